"""``AcceleratedOptimizer(..., safeguard="deferred")``: the torch.optim face of the deferred
safeguard (the core's ``update(..., loss=value)``, tests/test_deferred.py).

One closure call (or one ``step(loss=value)``) per step: the loss at the params a step starts
from judges the mix the previous step returned. Held to the NumPy recurrence of
tests/references.py (``Recurrence(deferred=True)``), to the functional core run by hand call
by call (one window per group), and through torch.optim's plumbing: LR schedulers,
``GradScaler``, checkpoints, a rejected group's torch state.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import relative_error
from references import Adam, GradientDescent, Recurrence, householder_lstsq
from test_deferred import CURVE, X0, rosenbrock, rosenbrock_grad

import aadl_func as aa

STEPS = 40

TORCH_INNERS = {
    # (the wrapped torch optimizer, the NumPy reference's inner step, the core's)
    "sgd": (
        lambda params, lr=5e-3: torch.optim.SGD(params, lr=lr),
        lambda: GradientDescent(5e-3),
        lambda lr=5e-3: aa.sgd(lr),
    ),
    "adam": (
        lambda params, lr=0.05: torch.optim.Adam(params, lr=lr),
        lambda: Adam(0.05),
        lambda lr=0.05: aa.adam(lr),
    ),
}


def torch_rosenbrock(x: torch.Tensor) -> torch.Tensor:
    return (CURVE * (x[1::2] - x[::2] ** 2) ** 2 + (1 - x[::2]) ** 2).sum()


def wrapped(inner: str, **options):
    x = torch.nn.Parameter(torch.tensor(X0))
    make_torch = TORCH_INNERS[inner][0]
    opt = aa.AcceleratedOptimizer(make_torch([x]), safeguard="deferred", **options)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch_rosenbrock(x)
        loss.backward()
        return loss

    return x, opt, closure


def take_step(opt, closure, how: str):
    """One step, the loss handed over as ``how`` says."""
    if how == "closure":
        return opt.step(closure)
    loss = closure()  # the training loop's own forward and backward
    if how == "loss-tensor":
        return opt.step(loss=loss.detach())
    return opt.step(loss=float(loss.detach()))


@pytest.mark.parametrize("how", ["closure", "loss-tensor", "loss-float"])
@pytest.mark.parametrize("inner", list(TORCH_INNERS))
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_follows_the_reference_recurrence(mode, inner, how):
    """The NumPy recurrence written from the semantics (item 6 of ``Recurrence``), fed the
    wrapper's own outputs call by call (Rosenbrock's valley with AA is chaotic: each call is
    judged on equal inputs). Bound: the core's own against this reference (test_deferred:
    1e-8 relative; float64, Householder QR like the core's float64 solve, the windows'
    conditioning late in the valley)."""
    x, opt, closure = wrapped(inner, mode=mode, history_depth=5)
    outputs, returned = [], []
    for _ in range(STEPS):
        returned.append(take_step(opt, closure, how))
        outputs.append(x.detach().numpy().copy())
    reference = Recurrence(
        rosenbrock_grad,
        TORCH_INNERS[inner][1](),
        mode=mode,
        history_depth=5,
        deferred=True,
        solve=householder_lstsq,
    )
    expected, kinds = reference.run(X0, STEPS, rosenbrock, inputs=outputs)
    errors = [relative_error(a, b) for a, b in zip(outputs, expected)]
    assert max(errors) <= 1e-8, (int(np.argmax(errors)), max(errors))
    state = opt.anderson_states[0]
    assert kinds.count("reverted") >= 3 and kinds.count("mix") >= 5, kinds
    assert int(state.num_rejected) == kinds.count("reverted")
    assert int(state.count) == STEPS - kinds.count("reverted")
    # torch.optim's return value: the closure's loss (before the step), None without one.
    if how == "closure":
        assert all(isinstance(r, torch.Tensor) for r in returned)
    else:
        assert all(r is None for r in returned)


class TorchStep:
    """An inner optimizer for the core: a ``torch.optim`` optimizer of its own, stepping a
    scratch copy of the params (a tensor or a list of tensors); the update is the
    displacement it took. The core calls it only on the calls it does not revert, so its
    torch state follows the core's decisions, not the wrapper's.

    ``exact=False``: ``stepped - params``, rounded once in the params' dtype.
    ``exact=True``: a displacement ``u`` with ``params + u == stepped`` bit for bit, so that
    the core's plain step is the torch optimizer's own, as the wrapper's: for float32 or
    half-precision params the difference in the wider dtype (exact there); for float64 ones
    ``exact_displacement()``, which raises where no float64 ``u`` does it (a step much
    longer than the distance from zero it lands at)."""

    def __init__(self, make, like: torch.Tensor | list[torch.Tensor], *, exact: bool = False):
        self.single = isinstance(like, torch.Tensor)
        self.exact = exact
        leaves = [like] if self.single else like
        self.scratch = [torch.nn.Parameter(leaf.detach().clone()) for leaf in leaves]
        self.optimizer = make(self.scratch)

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        grads, points = ([updates], [params]) if self.single else (updates, params)
        with torch.no_grad():
            for scratch, point, grad in zip(self.scratch, points, grads):
                scratch.copy_(point)
                scratch.grad = grad.clone()
        self.optimizer.step()
        if self.exact:
            moves = [
                s.detach().to(WIDER[p.dtype]) - p if p.dtype in WIDER else exact_displacement(s, p)
                for s, p in zip(self.scratch, points)
            ]
        else:
            moves = [s.detach().clone().sub_(p) for s, p in zip(self.scratch, points)]
        return (moves[0] if self.single else moves), state


WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def exact_displacement(stepped: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``u`` of ``start``'s dtype with ``start + u == stepped`` in every entry: ``stepped -
    start``, moved an ulp at a time towards the target where that sum rounds elsewhere
    (``start + u`` is monotone in ``u``)."""
    stepped = stepped.detach()
    u = stepped - start
    for _ in range(8):
        landed = start + u
        miss = landed != stepped
        if not bool(miss.any()):
            return u
        toward = torch.where(landed < stepped, math.inf, -math.inf).to(u.dtype)
        u = torch.where(miss, torch.nextafter(u, toward), u)
    raise AssertionError("no displacement reproduces the torch step here")


@pytest.mark.parametrize("inner", list(TORCH_INNERS))
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_matches_the_functional_core_call_by_call_per_group(mode, inner):
    """Two groups (other learning rates), the second added after 4 steps: each group's window
    and verdict are its own. The reference is the core run by hand, one state per group,
    ``update(state, params, grads, loss=L)``, its inner map the same torch optimizer on a
    copy (:class:`TorchStep`): bit for bit, call by call, the same calls reverted."""
    make_torch = TORCH_INNERS[inner][0]
    lrs = (5e-3, 3e-3) if inner == "sgd" else (0.05, 0.03)
    late = 4
    options = dict(mode=mode, history_depth=5)
    head, tail = (torch.nn.Parameter(torch.tensor(part)) for part in (X0[:4], X0[4:]))
    opt = aa.AcceleratedOptimizer(make_torch([head], lr=lrs[0]), safeguard="deferred", **options)
    mine = [torch.tensor(X0[:4]), torch.tensor(X0[4:])]
    cores = [
        aa.anderson(
            TorchStep(lambda ps, lr=lr: make_torch(ps, lr=lr), start, exact=mode == "aadl"),
            **options,
        )
        for lr, start in zip(lrs, mine)
    ]
    states = [cores[0].init(mine[0]), None]
    rejected = [[], []]
    for k in range(STEPS):
        if k == late:
            opt.add_param_group({"params": [tail], "lr": lrs[1]})
            states[1] = cores[1].init(mine[1])
        opt.zero_grad()
        loss = torch_rosenbrock(torch.cat([head, tail]))
        loss.backward()
        opt.step(loss=loss.detach())
        # The reference: the same loss at its own params.
        point = torch.cat(mine).requires_grad_(True)
        ref_loss = torch_rosenbrock(point)
        (grad,) = torch.autograd.grad(ref_loss, point)
        grads = [grad[:4], grad[4:]]
        for i in range(2 if k >= late else 1):
            before = int(states[i].num_rejected)
            mine[i], states[i] = cores[i].update(
                states[i], mine[i], grads[i], loss=ref_loss.detach()
            )
            rejected[i].append(int(states[i].num_rejected) > before)
        for p, ref in zip((head, tail), mine):
            assert torch.equal(p.detach(), ref), k
    windows = opt.anderson_states
    for window, state in zip(windows, states):
        assert int(window.num_rejected) == int(state.num_rejected)
        assert int(window.count) == int(state.count)
        assert int(window.num_mixed) == int(state.num_mixed)
    # Teeth: both groups rejected mixes, on calls that differ.
    tail_calls = [k for k, r in enumerate(rejected[1], start=late) if r]
    head_calls = [k for k, r in enumerate(rejected[0]) if r]
    assert head_calls and tail_calls and head_calls != tail_calls, (head_calls, tail_calls)


def test_a_rejected_group_is_not_stepped_by_the_torch_optimizer():
    """A rejection: the group's params are its previous plain step, bit for bit, and
    Adam's state (moments and step count) is the one of that plain step; the grads the
    closure left are back in ``.grad``."""
    x, opt, closure = wrapped("adam", mode="classic", history_depth=5)
    seen = 0
    for _ in range(STEPS):
        window = opt.anderson_states[0]
        previous_plain = None
        if window is not None:
            previous_plain = window.anchor[0] + window.residuals[int(window.head)][0]
        state = {k: v.clone() for k, v in opt.state[x].items()}
        rejected = int(window.num_rejected) if window is not None else 0
        opt.step(closure)
        if int(opt.anderson_states[0].num_rejected) > rejected:
            seen += 1
            assert torch.equal(x.detach(), previous_plain)
            assert all(torch.equal(opt.state[x][k], v) for k, v in state.items())
            assert x.grad is not None
    assert seen >= 3


def test_lr_scheduler_through_accelerate():
    """AADL's path: ``accelerate(..., safeguard="deferred")``, a scheduler made after it,
    ``optimizer.step(loss=value)``: no warning from the scheduler (its step follows an
    optimizer step), the learning rate follows the schedule, and the run equals the
    AcceleratedOptimizer's with the same schedule."""

    def run(via_accelerate):
        x = torch.nn.Parameter(torch.tensor(X0))
        torch_opt = torch.optim.Adam([x], lr=0.05)
        options = dict(relaxation=1.0, wait_iterations=0, history_depth=5, safeguard="deferred")
        if via_accelerate:
            aa.accelerate(torch_opt, mode="classic", **options)
            opt = torch_opt
        else:
            opt = aa.AcceleratedOptimizer(torch_opt, mode="classic", **options)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        lrs = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = torch_rosenbrock(x)
            loss.backward()
            opt.step(loss=loss.detach())
            scheduler.step()
            lrs.append(torch_opt.param_groups[0]["lr"])
        return x.detach().clone(), lrs

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched, lrs = run(True)
    assert lrs[9] == 0.025 and lrs[19] == 0.0125
    direct, _ = run(False)
    assert torch.equal(patched, direct)


def test_grad_scaler_passes_the_loss_and_skips_on_inf():
    """``scaler.step(opt, loss=value)``: GradScaler forwards the keyword; with a power-of-two
    scale the unscaled grads are exact, so the run equals the unscaled one bit for bit; a
    step with an Inf gradient is skipped whole (nothing judged: the pending mix waits)."""

    def run(with_scaler, bad_steps):
        x = torch.nn.Parameter(torch.tensor(X0, dtype=torch.float32))
        opt = aa.AcceleratedOptimizer(
            torch.optim.Adam([x], lr=0.05), mode="classic", history_depth=5, safeguard="deferred"
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if with_scaler else None
        history = []
        for k in range(STEPS):
            if k in bad_steps and not with_scaler:
                continue  # the reference never sees the bad batch
            opt.zero_grad()
            loss = torch_rosenbrock(x)
            if scaler is None:
                loss.backward()
                opt.step(loss=loss.detach())
            else:
                scaler.scale(loss).backward()
                if k in bad_steps:
                    x.grad[0] = float("inf")
                before = x.detach().clone()
                scaler.step(opt, loss=loss.detach())
                scaler.update()
                if k in bad_steps:
                    assert torch.equal(x.detach(), before)
                    continue
            history.append(x.detach().clone())
        return history, opt

    reference, _ = run(False, {7, 15})
    scaled, opt = run(True, {7, 15})
    assert len(reference) == len(scaled) == STEPS - 2
    assert all(torch.equal(a, b) for a, b in zip(reference, scaled))
    assert int(opt.anderson_states[0].num_rejected) >= 3


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_checkpoint_resume_is_bit_identical_with_a_mix_pending(mode):
    """Saved right after a step that returned a mix (its verdict pending), resumed in a new
    optimizer: the run continues bit for bit, verdicts included."""
    x, opt, closure = wrapped("adam", mode=mode, history_depth=5)
    saved_at = None
    for k in range(STEPS):
        opt.step(closure)
        if saved_at is None and k > 8 and float(opt.anderson_states[0].pending_loss) < np.inf:
            saved_at = k
            checkpoint = _roundtrip(opt.state_dict())
            x_saved = x.detach().clone()
            continue_from = k + 1
    assert saved_at is not None
    y, resumed, resumed_closure = wrapped("adam", mode=mode, history_depth=5)
    with torch.no_grad():
        y.copy_(x_saved)
    resumed.load_state_dict(checkpoint)
    for _ in range(continue_from, STEPS):
        resumed.step(resumed_closure)
    assert torch.equal(x.detach(), y.detach())
    for a, b in zip(opt.anderson_states, resumed.anderson_states):
        assert int(a.num_rejected) == int(b.num_rejected) and int(a.count) == int(b.count)


def test_old_checkpoints_load_into_a_deferred_optimizer():
    """A checkpoint of the default (``loss_fn``) safeguard, and one whose windows predate
    ``pending_loss`` (None there), load and continue with nothing pending: the first step's
    loss judges no mix."""
    x, opt, _ = wrapped("sgd", mode="aadl", history_depth=5)
    plain = aa.AcceleratedOptimizer(torch.optim.SGD([x], lr=5e-3), history_depth=5)
    for _ in range(6):
        plain.zero_grad()
        torch_rosenbrock(x).backward()
        plain.step()
    checkpoint = plain.state_dict()
    old = dict(checkpoint)
    old["anderson"] = dict(checkpoint["anderson"])
    old["anderson"]["windows"] = [w._replace(pending_loss=None) for w in old["anderson"]["windows"]]
    for saved in (checkpoint, old):
        y, resumed, closure = wrapped("sgd", mode="aadl", history_depth=5)
        resumed.load_state_dict(_roundtrip(saved))
        assert float(resumed.anderson_states[0].pending_loss) == np.inf
        resumed.step(closure)
        assert int(resumed.anderson_states[0].num_rejected) == 0


def test_arguments_are_checked_before_anything_changes():
    x, opt, closure = wrapped("sgd", mode="aadl", history_depth=5)
    for bad in ("closure", None, 1):
        with pytest.raises(ValueError, match="`safeguard` must be 'loss_fn'"):
            aa.AcceleratedOptimizer(torch.optim.SGD([x], lr=0.1), safeguard=bad)
    with pytest.raises(ValueError, match="safeguard='deferred' needs store_each_nth=1"):
        aa.AcceleratedOptimizer(
            torch.optim.SGD([x], lr=0.1), safeguard="deferred", store_each_nth=2
        )
    with pytest.raises(ValueError, match="safeguard='deferred' needs store_each_nth=1"):
        aa.accelerate(torch.optim.SGD([x], lr=0.1), store_each_nth=2, safeguard="deferred")
    before = x.detach().clone()
    closure()
    with pytest.raises(TypeError, match=r"call step\(closure\) or step\(loss=value\)"):
        opt.step()
    with pytest.raises(ValueError, match="pass `closure` or `loss`, not both"):
        opt.step(closure, loss=1.0)
    for bad in (torch.ones(2), "1.0", True, torch.tensor(1 + 1j)):
        with pytest.raises(TypeError, match="`loss` must be"):
            opt.step(loss=bad)
    plain = aa.AcceleratedOptimizer(torch.optim.SGD([x], lr=0.1))
    with pytest.raises(ValueError, match="make the optimizer with safeguard='deferred'"):
        plain.step(loss=1.0)
    assert torch.equal(x.detach(), before) and opt.anderson_states[0] is None
    assert "safeguard='deferred'" in repr(opt) and opt.safeguard == "deferred"

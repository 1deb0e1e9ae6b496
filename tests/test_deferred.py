"""The deferred safeguard, ``update(..., loss=L(x))``: a mix judged by the next call's loss.

Held to the NumPy recurrence of tests/references.py (``Recurrence(deferred=True)``, item 6 of
its docstring), written from the semantics, not from the library's code; and the execution
paths (in place, vmap, compile) to the eager one.
"""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch
from conftest import relative_error, snapshot
from references import (
    Adam,
    GradientDescent,
    Recurrence,
    householder_lstsq,
    rounding_bounds,
    solve_roundoff,
)

import aadl_func as aa

DIM = 10
CURVE = 10.0  # Rosenbrock has 100: a milder valley keeps the windows well conditioned
STEPS = 40


# Extended Rosenbrock: curved valleys where a window's secants often mislead the mix.
def rosenbrock(x: np.ndarray) -> float:
    return float(np.sum(CURVE * (x[1::2] - x[::2] ** 2) ** 2 + (1 - x[::2]) ** 2))


def rosenbrock_grad(x: np.ndarray) -> np.ndarray:
    a, b = x[::2], x[1::2]
    g = np.empty_like(x)
    g[::2] = -4 * CURVE * a * (b - a**2) - 2 * (1 - a)
    g[1::2] = 2 * CURVE * (b - a**2)
    return g


X0 = np.tile([-1.2, 1.0], DIM // 2) + 0.1 * np.random.default_rng(0).standard_normal(DIM)

INNERS = {
    # (the library's inner optimizer, the reference's)
    "sgd": (lambda: aa.sgd(5e-3), lambda: GradientDescent(5e-3)),
    "adam": (lambda: aa.adam(0.05), lambda: Adam(0.05)),
}


def run_library(opt, steps, *, inplace=False, dtype=torch.float64, x0=X0):
    x = torch.tensor(x0, dtype=dtype)
    state = opt.init(x)
    outputs = []
    for _ in range(steps):
        point = x.double().numpy()
        grads = torch.tensor(rosenbrock_grad(point), dtype=dtype)
        loss = torch.tensor(rosenbrock(point), dtype=dtype)
        x, state = opt.update(state, x, grads, inplace=inplace, loss=loss)
        outputs.append(x.double().numpy().copy())
    return outputs, state


@pytest.mark.parametrize("sufficient", [0.0, 0.5])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("restart", [False, True])
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_follows_the_reference_recurrence(mode, inner, restart, inplace, sufficient):
    """Every call within 1e-8 of the reference's from the library's own inputs, with the same
    decisions; ``sufficient``: the bar ``loss + c grads.u`` (``sufficient_decrease``)."""
    make, make_reference = INNERS[inner]
    options = dict(
        mode=mode, history_depth=5, restart_on_reject=restart, sufficient_decrease=sufficient
    )
    outputs, state = run_library(aa.anderson(make(), **options), STEPS, inplace=inplace)
    # Each call is checked on the library's own inputs (the reference is fed its outputs), so
    # that the trajectory's sensitivity (Rosenbrock's valley with AA is chaotic) does not
    # amplify the two implementations' roundings: the decisions are taken on equal losses.
    # Householder QR, the factorisation a float64 window is solved by: late in the valley the
    # window's differences are ill-conditioned, where two stable solvers part by cond * eps.
    reference = Recurrence(
        rosenbrock_grad, make_reference(), deferred=True, solve=householder_lstsq, **options
    )
    expected, kinds = reference.run(X0, STEPS, rosenbrock, inputs=outputs)
    errors = [relative_error(a, b) for a, b in zip(outputs, expected)]
    assert max(errors) <= 1e-8, (int(np.argmax(errors)), max(errors))
    # Teeth: mixes were kept and others rejected, and the counters say which.
    assert kinds.count("reverted") >= 3 and kinds.count("mix") >= 10
    assert int(state.num_rejected) == kinds.count("reverted")
    assert int(state.count) == STEPS - kinds.count("reverted")  # reverted calls not counted
    assert "rejected" not in kinds  # no mix was judged on the spot


def test_a_reverted_call_returns_the_previous_plain_step_and_keeps_the_inner_state():
    """Call by call: a rejection returns ``x_k + u_k`` of the call before, bit for bit, and
    the inner optimizer's state stays the one of that plain step."""
    opt = aa.anderson(aa.adam(0.05), mode="classic", history_depth=5)
    x = torch.tensor(X0)
    state = opt.init(x)
    seen = 0
    for _ in range(STEPS):
        point = x.numpy()
        grads, loss = torch.tensor(rosenbrock_grad(point)), torch.tensor(rosenbrock(point))
        before = snapshot(state)
        rejected_before = int(state.num_rejected)
        x_new, state = opt.update(state, x, grads, loss=loss)
        if int(state.num_rejected) > rejected_before:
            seen += 1
            plain = before.anchor + before.residuals[int(before.head)]
            assert torch.equal(x_new, plain)
            for a, b in zip(
                optree.tree_leaves(state.inner_state), optree.tree_leaves(before.inner_state)
            ):
                assert torch.equal(a, b)
            assert math.isinf(float(state.pending_loss))
        x = x_new
    assert seen >= 3


@pytest.mark.parametrize("history_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_float32_params_follow_the_float64_reference(mode, history_dtype):
    """Low precision: float32 params (float32 or bf16 windows) against the float64
    reference, call by call on the library's own inputs: the same decisions, and each
    call's point within the window's rounding (over the first calls: later the windows
    grow ill-conditioned, and a bf16 window's mix is then only as good as its rounding
    allows, docs/numerics.md). The bound of each call is the dtypes' rounding times the
    call's own sensitivity to it (``references.rounding_bounds``; it was 2e-6 / 2e-2, fitted
    to one run)."""
    steps = 10
    opt = aa.anderson(aa.adam(0.05), mode=mode, history_depth=5, history_dtype=history_dtype)
    outputs, state = run_library(opt, steps, dtype=torch.float32)

    def reference():
        return Recurrence(rosenbrock_grad, Adam(0.05), mode=mode, history_depth=5, deferred=True)

    expected, kinds = reference().run(X0, steps, rosenbrock, inputs=outputs)
    u_params = torch.finfo(torch.float32).eps / 2
    if history_dtype is None:  # a float32 window: the float64 solve's backward error
        u_diff = solve_roundoff(len(X0), 5)
    else:
        u_diff = torch.finfo(history_dtype).eps / 2
    bounds = rounding_bounds(reference, X0, outputs, u_params, u_diff, rosenbrock)
    if history_dtype is not None and mode == "classic":
        # A reverted call returns the previous plain step rebuilt from the state: the anchor
        # plus the stored step, rounded to the window's dtype (u_window of that step).
        starts = [X0, *outputs[:-1]]
        for k, kind in enumerate(kinds):
            if kind == "reverted":
                step = np.linalg.norm(expected[k] - starts[k - 1])
                bounds[k] += u_diff * step / np.linalg.norm(expected[k])
    errors = np.array([relative_error(a, b) for a, b in zip(outputs, expected)])
    worst = int(np.argmax(errors / bounds))
    assert errors[worst] <= bounds[worst], (worst, errors[worst], bounds[worst])
    assert int(state.num_rejected) == kinds.count("reverted") >= 2


@pytest.mark.parametrize("sufficient", [0.0, 0.5])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_vmapped_members_judge_their_own_mixes(mode, inplace, sufficient):
    """An ensemble under vmap, members starting apart so that they reject on different
    calls: each member equals its own eager run (with ``sufficient_decrease``, each judged
    against its own bar)."""
    starts = [X0, X0 * 0.9, X0 + 0.05]
    opt = aa.anderson(aa.adam(0.05), mode=mode, history_depth=5, sufficient_decrease=sufficient)
    eager = [run_library(opt, 25, x0=s) for s in starts]
    rejections = [int(state.num_rejected) for _, state in eager]
    assert len(set(rejections)) > 1 or min(rejections) >= 1

    x = torch.tensor(np.stack(starts))
    state = torch.func.vmap(opt.init)(x)
    step = torch.func.vmap(lambda s, p, g, v: opt.update(s, p, g, inplace=inplace, loss=v))
    for k in range(25):
        grads, loss = torch.func.vmap(torch.func.grad_and_value(torch_rosenbrock))(x)
        x, state = step(state, x, grads, loss)
        for m, (outputs, _) in enumerate(eager):
            assert relative_error(x[m].numpy(), outputs[k]) <= 1e-10, (k, m)
    assert [int(r) for r in state.num_rejected] == rejections


def torch_rosenbrock(x: torch.Tensor) -> torch.Tensor:
    a, b = x[::2], x[1::2]
    return (CURVE * (b - a**2) ** 2 + (1 - a) ** 2).sum()


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="torch.compile of update needs 2.12+")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_compiled_update_equals_eager(mode, inplace):
    opt = aa.anderson(aa.adam(0.05), mode=mode, history_depth=5)

    def step(state, params, grads, loss):
        return opt.update(state, params, grads, inplace=inplace, loss=loss)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.tensor(X0)
    state = opt.init(x)
    rejected = 0
    for _ in range(25):
        grads, loss = torch.func.grad_and_value(torch_rosenbrock)(x)
        inputs = (snapshot(state), x.clone(), grads, loss)
        compiled_x, compiled_state = compiled(*inputs)
        x, state = step(state, x, grads, loss)
        assert relative_error(compiled_x.numpy(), x.numpy()) <= 1e-12
        for name in ("count", "num_mixed", "num_rejected", "window_size"):
            assert int(getattr(compiled_state, name)) == int(getattr(state, name)), name
        assert float(compiled_state.pending_loss) == float(state.pending_loss)
        rejected = int(state.num_rejected)
    assert rejected >= 2


def test_a_nonfinite_loss_rejects_the_mix_and_never_reaches_the_params():
    """A mix whose loss is NaN (a point outside the loss's domain) is rejected, and the
    plain step the call returns is finite."""
    opt = aa.anderson(aa.sgd(0.5), mode="classic", history_depth=4)
    x = torch.tensor([3.0, -2.0], dtype=torch.float64)
    state = opt.init(x)
    for k in range(12):
        loss = 0.5 * (x**2).sum()
        if k >= 2 and int(state.num_mixed) > 0 and math.isinf(float(state.pending_loss)) is False:
            loss = torch.tensor(float("nan"), dtype=torch.float64)  # the mix's loss is NaN
        before = int(state.num_rejected)
        x, state = opt.update(state, x, x.clone(), loss=loss)
        assert torch.isfinite(x).all()
        if loss.isnan():
            assert int(state.num_rejected) == before + 1
    assert int(state.num_rejected) >= 1


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(loss=torch.tensor([1.0, 2.0])), TypeError, "`loss` must be the training loss"),
        (dict(loss="1.0"), TypeError, "`loss` must be the training loss"),
        (dict(loss=torch.tensor(True)), TypeError, "`loss` must be the training loss"),
        (dict(loss=torch.tensor(1.0), loss_fn=lambda p: p.sum()), ValueError, "not both"),
    ],
)
def test_bad_loss_is_refused_by_name_before_anything_changes(kwargs, error, match):
    opt = aa.anderson(aa.adam(0.05), mode="classic", history_depth=4)
    x = torch.tensor(X0)
    state = opt.init(x)
    for _ in range(3):
        x, state = opt.update(state, x, torch.tensor(rosenbrock_grad(x.numpy())), inplace=True)
    before_x, before_state = x.clone(), snapshot(state)
    with pytest.raises(error, match=match):
        opt.update(state, x, torch.ones_like(x), inplace=True, **kwargs)
    assert torch.equal(x, before_x)
    for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(before_state)):
        assert torch.equal(a, b)


def test_loss_needs_every_plain_step_in_the_window():
    opt = aa.anderson(aa.sgd(0.1), store_each_nth=2)
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="store_each_nth=1"):
        opt.update(opt.init(x), x, torch.ones(3), loss=torch.tensor(1.0))


def test_python_number_loss_and_a_state_saved_before_the_field(tmp_path):
    """A float loss is accepted; a state without ``pending_loss`` (saved by an earlier
    version) steps as one with nothing pending; a state with a pending mix round-trips
    through ``torch.save`` / ``torch.load(weights_only=True)``."""
    opt = aa.anderson(aa.sgd(5e-4), mode="classic", history_depth=5)
    x = torch.tensor(X0)
    state = opt.init(x)._replace(pending_loss=None)
    for _ in range(20):
        point = x.numpy()
        x, state = opt.update(
            state, x, torch.tensor(rosenbrock_grad(point)), loss=rosenbrock(point)
        )
        if math.isfinite(float(state.pending_loss)):
            break  # the last call returned a mix, to be judged by the next
    assert math.isfinite(float(state.pending_loss))
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert float(loaded.pending_loss) == float(state.pending_loss)


def test_a_corrupt_pending_loss_is_refused():
    opt = aa.anderson(aa.sgd(0.1), mode="classic", history_depth=4)
    x = torch.zeros(3)
    state = opt.init(x)._replace(pending_loss=torch.tensor(float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="pending_loss"):
        opt.update(state, x, torch.ones(3), loss=torch.tensor(1.0))


def test_wrapper_loads_a_checkpoint_saved_before_pending_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), history_depth=3)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    for _ in range(4):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    saved = opt.state_dict()
    old = dict(saved, anderson=dict(saved["anderson"]))
    old["anderson"]["windows"] = [
        w._replace(pending_loss=None) for w in saved["anderson"]["windows"]
    ]
    fresh = aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), history_depth=3)
    fresh.load_state_dict(old)
    assert math.isinf(float(fresh.state_dict()["anderson"]["windows"][0].pending_loss))


def test_sufficient_decrease_is_refused_by_the_torch_optim_faces():
    """The wrapped optimizer's step reaches the core as the params it stepped to, not as the
    gradients the condition reads: both faces refuse the option at construction, by name."""
    params = [torch.nn.Parameter(torch.ones(3))]
    for make in (aa.AcceleratedOptimizer, aa.accelerate):
        with pytest.raises(
            ValueError, match="`sufficient_decrease` is available in the functional"
        ):
            make(torch.optim.SGD(params, lr=0.1), sufficient_decrease=0.5)
        make(torch.optim.SGD(params, lr=0.1), sufficient_decrease=0.0)  # the default is taken

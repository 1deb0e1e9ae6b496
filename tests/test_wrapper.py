"""``AcceleratedOptimizer`` and ``accelerate``: the functional core behind torch.optim.

References: the functional core driven by hand with the built-in inner optimizers (which
match torch.optim step for step), plain torch.optim runs, and a float64 NumPy implementation
of spec.md's rules written here from background.md's formulas.
"""

from __future__ import annotations

import io
import types

import numpy as np
import optree
import pytest
import torch
from references import Recurrence, aadl_extrapolate, rounding_bounds, solve_roundoff
from test_wrapper_deferred import TorchStep
from torch import nn

import aadl_func as aa
from aadl_func import AcceleratedOptimizer, accelerate

# -- models and helpers ----------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.head = nn.Linear(3 * 4 * 4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def make_cnn(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = SmallCNN().to(dtype)
    model.conv.weight.data = model.conv.weight.data.contiguous(memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(100 + seed)
    X = torch.randn(8, 2, 6, 6, generator=generator).to(dtype)
    Y = torch.randn(8, 1, generator=generator).to(dtype)
    return model, X, Y


def groups_of(model, lrs=(0.05, 0.02)):
    return [
        {"params": list(model.conv.parameters()), "lr": lrs[0]},
        {"params": list(model.head.parameters()), "lr": lrs[1]},
    ]


def mse(model, X, Y):
    return (model(X) - Y).square().mean()


NAMES = (("conv.weight", "conv.bias"), ("head.weight", "head.bias"))


def functional_loss(model, X, Y, group_values):
    params = {
        name: v for names, values in zip(NAMES, group_values) for name, v in zip(names, values)
    }
    return (torch.func.functional_call(model, params, (X,)) - Y).square().mean()


def assert_same_params(a, b, **tol):
    for p, q in zip(a.parameters(), b.parameters()):
        if tol:
            torch.testing.assert_close(p, q, **tol)
        else:
            assert torch.equal(p, q)


OPTIONS = dict(history_depth=4, relaxation=0.6, frequency=2, reg=1e-12)


# -- wrapper == functional core --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sgd", "adam", "classic"])
def test_wrapper_matches_functional_core(kind):
    """Two param groups, a channels_last conv weight: the wrapper's trajectory is the core's,
    run by hand with one window per group, bit for bit. The core's inner map is the same
    torch optimizer stepping a copy (``TorchStep``), so both round the same inputs the same
    way; with the built-in ``sgd``/``adam`` (equal to torch.optim up to the last bit,
    ``test_inner.py``) the chaotic recurrence amplified that bit to a bound fitted to one
    run (1e-10, classic 1e-7)."""
    # float32, as users train: the displacement in float64 is exact, so the core's plain step
    # is torch's own in both modes (in float64 no displacement need reproduce it).
    model_a, X, Y = make_cnn(torch.float32)
    model_b, _, _ = make_cnn(torch.float32)
    options = dict(OPTIONS, mode="classic") if kind == "classic" else OPTIONS
    groups_b = [list(model_b.conv.parameters()), list(model_b.head.parameters())]
    if kind in ("sgd", "classic"):
        torch_opt = torch.optim.SGD(groups_of(model_a), momentum=0.9)
        makers = [lambda ps, lr=lr: torch.optim.SGD(ps, lr=lr, momentum=0.9) for lr in (0.05, 0.02)]
    else:
        torch_opt = torch.optim.Adam(groups_of(model_a, (1e-2, 5e-3)))
        makers = [lambda ps, lr=lr: torch.optim.Adam(ps, lr=lr) for lr in (1e-2, 5e-3)]
    opt = AcceleratedOptimizer(torch_opt, **options)
    cores = [
        aa.anderson(TorchStep(make, g, exact=True), **options) for make, g in zip(makers, groups_b)
    ]
    states = [core.init([p.detach() for p in g]) for core, g in zip(cores, groups_b)]

    for _ in range(12):
        opt.zero_grad()
        mse(model_a, X, Y).backward()
        assert opt.step() is None

        model_b.zero_grad()
        mse(model_b, X, Y).backward()
        with torch.no_grad():
            for i, (core, params) in enumerate(zip(cores, groups_b)):
                out, states[i] = core.update(
                    states[i], [p.detach().clone() for p in params], [p.grad for p in params]
                )
                for p, v in zip(params, out):
                    p.copy_(v)
        assert_same_params(model_a, model_b)
    for mine, theirs in zip(opt.anderson_states, states):
        assert int(mine.num_mixed) == int(theirs.num_mixed) >= 4
    assert model_a.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_wrapper_safeguard_matches_functional_core_two_groups():
    """With a closure each group is safeguarded in turn (earlier groups at their kept params,
    later ones at their plain step) and step() returns the loss at the kept params."""
    options = dict(history_depth=4, relaxation=1.5)
    model_a, X, Y = make_cnn(seed=1)
    model_b, _, _ = make_cnn(seed=1)
    opt = AcceleratedOptimizer(torch.optim.SGD(groups_of(model_a, (0.3, 0.1))), **options)
    groups_b = [list(model_b.conv.parameters()), list(model_b.head.parameters())]
    # The same torch step on a copy (stateless SGD: the extra plain step below is harmless),
    # so that the core rounds as the wrapper does: bit for bit (was 1e-10, fitted).
    inners = [
        TorchStep(lambda ps, lr=lr: torch.optim.SGD(ps, lr=lr), g)
        for lr, g in zip((0.3, 0.1), groups_b)
    ]
    cores = [aa.anderson(inner, **options) for inner in inners]
    states = [core.init([p.detach() for p in g]) for core, g in zip(cores, groups_b)]

    def closure():
        opt.zero_grad()
        loss = mse(model_a, X, Y)
        loss.backward()
        return loss

    evaluated_steps = 0
    for _ in range(12):
        with torch.no_grad():
            loss_before = mse(model_a, X, Y)
        decided = sum(int(s.num_mixed) + int(s.num_rejected) for s in states)
        returned = opt.step(closure)

        model_b.zero_grad()
        mse(model_b, X, Y).backward()
        with torch.no_grad():
            starts = [[p.detach().clone() for p in g] for g in groups_b]
            grads = [[p.grad.clone() for p in g] for g in groups_b]
            # The plain step of group 1, which group 0's safeguard sees (inner update is pure).
            u1, _ = inners[1].update(
                grads[1], states[1].inner_state, params=starts[1], inplace=False
            )
            plain1 = [x + u for x, u in zip(starts[1], u1)]
            out0, states[0] = cores[0].update(
                states[0],
                starts[0],
                grads[0],
                loss_fn=lambda c, others=plain1: functional_loss(model_b, X, Y, [c, others]),
            )
            out1, states[1] = cores[1].update(
                states[1],
                starts[1],
                grads[1],
                loss_fn=lambda c, others=out0: functional_loss(model_b, X, Y, [others, c]),
            )
            for params, out in zip(groups_b, (out0, out1)):
                for p, v in zip(params, out):
                    p.copy_(v)
        assert_same_params(model_a, model_b)
        if sum(int(s.num_mixed) + int(s.num_rejected) for s in states) > decided:
            evaluated_steps += 1  # the safeguard evaluated the closure
        # torch.optim's convention, whatever the safeguard did: the loss before the step.
        torch.testing.assert_close(returned.detach(), loss_before, rtol=1e-12, atol=0)
    assert evaluated_steps >= 8
    mixed = [int(s.num_mixed) for s in opt.anderson_states]
    rejected = [int(s.num_rejected) for s in opt.anderson_states]
    assert mixed == [int(s.num_mixed) for s in states]
    assert rejected == [int(s.num_rejected) for s in states]
    assert sum(mixed) > 0 and sum(rejected) > 0


def test_returned_loss_without_safeguard_evaluation_is_the_inner_loss():
    model, X, Y = make_cnn()
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), wait_iterations=5)
    with torch.no_grad():
        before = mse(model, X, Y)

    def closure():
        opt.zero_grad()
        loss = mse(model, X, Y)
        loss.backward()
        return loss

    torch.testing.assert_close(opt.step(closure).detach(), before)


# -- dtypes, layouts, in-place ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_without_mixing_equals_the_torch_optimizer_bitwise(dtype):
    """The plain step through the core reproduces torch.optim exactly (float64: to a rounding
    of the displacement, which has no wider dtype), and the params are updated in place (same
    storage, channels_last kept)."""
    model_a, X, Y = make_cnn(dtype)
    model_b, _, _ = make_cnn(dtype)
    opt_a = AcceleratedOptimizer(
        torch.optim.SGD(groups_of(model_a), momentum=0.9), wait_iterations=10**9
    )
    opt_b = torch.optim.SGD(groups_of(model_b), momentum=0.9)
    pointers = [p.data_ptr() for p in model_a.parameters()]
    for _ in range(6):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            mse(model, X, Y).float().backward()
            opt.step()
        if dtype == torch.float64:
            assert_same_params(model_a, model_b, rtol=1e-14, atol=1e-16)
        else:
            assert_same_params(model_a, model_b)
    assert [p.data_ptr() for p in model_a.parameters()] == pointers
    assert model_a.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == dtype for p in model_a.parameters())


def test_displacements_are_exact_in_the_wider_dtype_on_every_route():
    """The wrapper's inner step (`TakenStep`) on a tree of mixed dtypes and layouts: each
    `stepped - start` equals NumPy's float64 difference of the float64 values (float32 and
    half precision: exact there, so NumPy's rounding is none), in float32 for half precision
    and float64 otherwise, in the leaf's layout, never aliasing the stepped params; the
    pytree route, the list route and the steady call's leaf route agree."""
    from aadl_func._src.wrapper_groups import TakenStep

    g = torch.Generator().manual_seed(0)
    start = [
        torch.randn(5, 3, generator=g),
        torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(6, generator=g).to(torch.float16),
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.tensor([1e-30, -3.0, 2.0**-140, 1e30]),  # wide exponent gaps, a subnormal
    ]
    stepped = [a + 1e-3 * torch.randn(a.shape, generator=g).to(a.dtype) for a in start]
    stepped[1] = stepped[1].contiguous(memory_format=torch.channels_last)
    stepped[-1] = torch.tensor([-2.0, -3.0 + 2.0**-22, 0.0, 1e30 * (1 + 2.0**-23)])
    step = TakenStep()
    routes = {
        "list": step.update(stepped, (), start)[0],
        "leaves": step.update.update_leaves(stepped, (), start, None)[0],
        "tree": step.update(dict(enumerate(stepped)), (), dict(enumerate(start)))[0],
    }
    routes["tree"] = [routes["tree"][i] for i in range(len(start))]
    for name, out in routes.items():
        for u, s, a in zip(out, stepped, start):
            wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else torch.float64
            assert u.dtype == wide, name
            expected = s.double().numpy() - a.double().numpy()
            np.testing.assert_array_equal(u.double().numpy(), expected, err_msg=name)
            assert u.stride() == s.stride() and u.data_ptr() != s.data_ptr(), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_the_plain_step_is_torchs_own_bit_for_bit(dtype):
    """A wrapper that never mixes (mode "aadl", `wait_iterations` past the run) leaves the
    params where `torch.optim` alone puts them, bit by bit and sign of zero by sign of zero,
    step after step: SGD's fused `p + (-lr) g` rounds once, so in float64 `x + (s - x)` misses
    `s` in about a fifth of the entries where the step is longer than `|x|` (the entries
    built here), and a `-0` param with a zero gradient stays `-0`."""
    g = torch.Generator().manual_seed(0)
    start = ((torch.rand(4096, generator=g) - 0.5) * 0.05).to(dtype)
    start[:8] = -0.0
    grads = [(torch.rand(4096, generator=g, dtype=torch.float64) - 0.5).to(dtype) for _ in range(6)]
    for grad in grads:
        grad[:8] = 0.0
    mine, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    opt = AcceleratedOptimizer(torch.optim.SGD([mine], lr=0.1), wait_iterations=100)
    plain = torch.optim.SGD([theirs], lr=0.1)
    if dtype == torch.float64:  # the entries the old displacement route got wrong exist
        stepped = start.add(grads[0], alpha=-0.1)
        assert int(((start + (stepped - start)) != stepped).sum()) > 100
    for grad in grads:
        mine.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        plain.step()
        assert torch.equal(mine.detach().view(torch.int8), theirs.detach().view(torch.int8))
    assert torch.signbit(mine[:8]).all()
    assert int(opt.anderson_states[0].count) == len(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_params_keep_dtype_layout_and_storage(dtype):
    model, X, Y = make_cnn(dtype)
    opt = AcceleratedOptimizer(torch.optim.Adam(groups_of(model, (1e-2, 1e-2))), history_depth=3)
    pointers = [p.data_ptr() for p in model.parameters()]
    for _ in range(5):
        opt.zero_grad()
        mse(model, X, Y).float().backward()
        opt.step()
    assert all(int(s.num_mixed) == 3 for s in opt.anderson_states)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(p.dtype == dtype and torch.isfinite(p).all() for p in model.parameters())


# -- checkpoints -----------------------------------------------------------------------------


def _train(model, opt, X, Y, steps, closure_every=2):
    trajectory = []
    for k in range(steps):

        def closure():
            opt.zero_grad()
            loss = mse(model, X, Y)
            loss.backward()
            return loss

        if k % closure_every == 0:
            opt.step(closure)
        else:
            closure()
            opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


CHECKPOINT_OPTIONS = dict(
    history_depth=4, relaxation=0.5, store_each_nth=2, frequency=2, average=True, average_tol=0.2
)


def test_checkpoint_resume_is_bit_identical():
    model, X, Y = make_cnn(torch.float32)
    opt = AcceleratedOptimizer(
        torch.optim.Adam(groups_of(model, (3e-2, 1e-2))), **CHECKPOINT_OPTIONS
    )
    first = _train(model, opt, X, Y, 7)
    model_ckpt = _roundtrip(model.state_dict())
    opt_ckpt = _roundtrip(opt.state_dict())
    rest = _train(model, opt, X, Y, 8)

    resumed, _, _ = make_cnn(torch.float32, seed=5)
    resumed.load_state_dict(model_ckpt)
    resumed.conv.weight.data = resumed.conv.weight.data.contiguous(
        memory_format=torch.channels_last
    )
    opt2 = AcceleratedOptimizer(
        torch.optim.Adam(groups_of(resumed, (0.5, 0.5))), **CHECKPOINT_OPTIONS
    )
    opt2.load_state_dict(opt_ckpt)
    assert [g["lr"] for g in opt2.param_groups] == [3e-2, 1e-2]
    rest2 = _train(resumed, opt2, X, Y, 8)
    for a, b in zip(rest, rest2):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    for s, t in zip(opt.anderson_states, opt2.anderson_states):
        for name in ("count", "num_mixed", "num_rejected", "num_averaged", "window_size"):
            assert int(getattr(s, name)) == int(getattr(t, name))
        assert torch.equal(s.gram, t.gram)
    counts = opt.anderson_states[0]
    assert int(counts.num_mixed) > 0 and int(counts.num_averaged) > 0
    assert len(first) == 7


def _trained_optimizer(**options):
    model, X, Y = make_cnn()
    opt = AcceleratedOptimizer(torch.optim.SGD(groups_of(model)), **options)
    _train(model, opt, X, Y, 5)
    return model, opt


@pytest.mark.parametrize(
    "other, match",
    [
        (dict(history_depth=5), "history_depth"),
        (dict(history_depth=4, mode="classic"), "mode"),
        (dict(history_depth=4, history_dtype=torch.float32), "history_dtype"),
    ],
)
def test_load_state_dict_with_other_layout_options_raises(other, match):
    _, opt = _trained_optimizer(history_depth=4)
    saved = _roundtrip(opt.state_dict())
    model, _, _ = make_cnn()
    fresh = AcceleratedOptimizer(torch.optim.SGD(groups_of(model)), **other)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(saved)
    assert fresh.anderson_states == (None, None)
    assert len(fresh.state) == 0


def test_load_state_dict_for_other_params_raises():
    _, opt = _trained_optimizer(history_depth=4)
    saved = _roundtrip(opt.state_dict())
    torch.manual_seed(0)
    conv, head = nn.Conv2d(2, 3, 3).double(), nn.Linear(48, 2).double()  # another head shape
    fresh = AcceleratedOptimizer(
        torch.optim.SGD([{"params": conv.parameters()}, {"params": head.parameters()}], lr=0.1),
        history_depth=4,
    )
    with pytest.raises(ValueError, match="param group 1"):
        fresh.load_state_dict(saved)
    one_group = AcceleratedOptimizer(torch.optim.SGD(conv.parameters(), lr=0.1), history_depth=4)
    with pytest.raises(ValueError, match="2 windows for 1 param groups"):
        one_group.load_state_dict(saved)


def test_plain_torch_checkpoints_interoperate():
    """A torch.optim checkpoint loads (windows restart); ours loads into torch.optim."""
    model, opt = _trained_optimizer(history_depth=4)
    plain = torch.optim.SGD(groups_of(model))
    plain.load_state_dict(opt.state_dict())
    opt.load_state_dict(plain.state_dict())
    assert opt.anderson_states == (None, None)


def test_hyperparameters_may_change_on_resume():
    _, opt = _trained_optimizer(history_depth=4, relaxation=0.5)
    saved = _roundtrip(opt.state_dict())
    model, _, _ = make_cnn()
    fresh = AcceleratedOptimizer(torch.optim.SGD(groups_of(model)), history_depth=4, relaxation=1.0)
    fresh.load_state_dict(saved)
    assert int(fresh.anderson_states[0].count) == 5


# -- accelerate(): AADL's migration path -----------------------------------------------------


def np_mix(window, relaxation):
    """AADL's extrapolation of the iterates ``window`` (oldest first): tests/references.py."""
    return aadl_extrapolate(
        np.stack([np.asarray(w, dtype=np.float64) for w in window], axis=1), relaxation
    )


def np_aadl(x0, grad, lr, steps, *, relaxation, wait, depth, store, freq, loss=None, inputs=None):
    """spec.md steps 1-4 with plain gradient descent as the inner map. ``inputs`` (another
    run's outputs): call ``k`` starts from ``inputs[k - 1]`` and a kept mix enters the window
    as ``inputs[k]``, so that each call is checked on that run's own data."""
    window, x, out = [], np.array(x0, dtype=np.float64), []
    for k in range(1, steps + 1):
        if inputs is not None and k > 1:
            x = np.array(inputs[k - 2], dtype=np.float64)
        y = x - lr * grad(x)
        if k % store == 0:
            window = (window + [y.copy()])[-depth:]
        x = y
        if k > wait and k % freq == 0 and len(window) >= 3:
            xm = np_mix(window, relaxation)
            if loss is None or (np.isfinite(loss(xm)) and loss(xm) < loss(y)):
                x = xm
                if loss is not None:
                    window[-1] = xm.copy() if inputs is None else np.array(inputs[k - 1])
        out.append(x.copy())
    return out


def least_squares(n=10, m=30, seed=0):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((m, n)) * np.geomspace(1.0, 0.1, n)
    b = rng.standard_normal(m)
    return A, b


@pytest.mark.parametrize("acceleration_type", ["anderson", "Anderson_Normal_Equation"])
@pytest.mark.parametrize("safeguard", [False, True])
def test_accelerate_reproduces_spec_with_aadl_argument_order(acceleration_type, safeguard):
    A, b = least_squares()
    n, lr, steps = A.shape[1], 0.02, 12
    loss = (lambda x: 0.5 * np.sum((A @ x - b) ** 2)) if safeguard else None
    At, bt = torch.tensor(A), torch.tensor(b)
    w = nn.Parameter(torch.zeros(n, dtype=torch.float64))
    optimizer = torch.optim.SGD([w], lr=lr)
    # AADL's positional order: type, relaxation, wait_iterations, history_depth,
    # store_each_nth, frequency, reg_acc, average.
    accelerator = accelerate(optimizer, acceleration_type, 0.7, 2, 5, 1, 2, 0.0, False)
    assert isinstance(accelerator, AcceleratedOptimizer)

    def closure():
        optimizer.zero_grad()
        loss = 0.5 * (At @ w - bt).square().sum()
        loss.backward()
        return loss

    outputs = []
    for _ in range(steps):
        if safeguard:
            optimizer.step(closure)  # the patched torch optimizer, as AADL users call it
        else:
            closure()
            optimizer.step()
        outputs.append(w.detach().numpy().copy())
    assert int(accelerator.anderson_states[0].num_mixed) > 0

    # Each call against spec.md's steps replaying it on the run's own inputs, within the
    # call's rounding times its own sensitivity (references.rounding_bounds; it was 1e-7 on
    # the free-running trajectories, fitted: the mixes of a nearly converged window amplify
    # the last bit from call to call). A wrong argument order is off by O(1).
    def grad(x):
        return A.T @ (A @ x - b)

    options = dict(relaxation=0.7, wait=2, depth=5, store=1, freq=2, loss=loss)
    expected = np_aadl(np.zeros(n), grad, lr, steps, inputs=outputs, **options)

    def reference():
        return Recurrence(grad, lr, relaxation=0.7, wait_iterations=2, history_depth=5, frequency=2)

    u = 2.0**-53
    bounds = rounding_bounds(reference, np.zeros(n), outputs, u, solve_roundoff(n, 5), loss)
    for k, (got, want) in enumerate(zip(outputs, expected)):
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= bounds[k], (k + 1, error, bounds[k])


def test_accelerate_defaults_and_errors():
    w = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    accelerator = accelerate(optimizer)
    options = accelerator.anderson_options
    # AADL's defaults.
    assert (options["relaxation"], options["wait_iterations"], options["history_depth"]) == (
        0.1,
        1,
        15,
    )
    assert (options["store_each_nth"], options["frequency"], options["reg"]) == (1, 1, 0.0)
    assert options["average"] is False
    with pytest.raises(ValueError, match="already accelerated"):
        accelerate(optimizer)
    for bad in ("identity", "rna", "anderson_lstsq"):
        with pytest.raises(ValueError, match="acceleration_type"):
            accelerate(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), bad)
    with pytest.raises(TypeError, match="acceleration_type"):
        accelerate(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), None)
    with pytest.raises(ValueError, match="history_depth"):
        accelerate(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), history_depth=2)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        AcceleratedOptimizer(object())
    with pytest.raises(TypeError, match="bogus"):
        AcceleratedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1), bogus=1)


def test_accelerated_optimizer_checkpoints_through_its_own_methods():
    """After accelerate(), optimizer.state_dict()/load_state_dict() carry the windows."""
    model, X, Y = make_cnn()
    optimizer = torch.optim.SGD(groups_of(model), momentum=0.5)
    accelerator = accelerate(optimizer, "anderson", 0.5, 0, 4)
    _train(model, optimizer, X, Y, 4, closure_every=10**9)
    saved = _roundtrip(optimizer.state_dict())
    assert "anderson" in saved
    model2, _, _ = make_cnn()
    model2.load_state_dict(model.state_dict())
    optimizer2 = torch.optim.SGD(groups_of(model2), momentum=0.5)
    accelerator2 = accelerate(optimizer2, "anderson", 0.5, 0, 4)
    optimizer2.load_state_dict(saved)
    a = _train(model, optimizer, X, Y, 3, closure_every=10**9)
    b = _train(model2, optimizer2, X, Y, 3, closure_every=10**9)
    for pa, pb in zip(a, b):
        for p, q in zip(pa, pb):
            assert torch.equal(p, q)
    assert int(accelerator2.anderson_states[0].count) == int(accelerator.anderson_states[0].count)


# -- LR schedulers, gradient clipping, GradScaler --------------------------------------------


class ScheduledSgd(TorchStep):
    """The core's inner map for SGD under StepLR(step_size, gamma), lr_k = lr *
    gamma^(k // size): torch.optim.SGD with its own scheduler, stepping a copy of the params
    (``TorchStep``), so that it rounds as the wrapper's torch step does."""

    def __init__(self, lr, step_size, gamma, like):
        super().__init__(lambda ps: torch.optim.SGD(ps, lr=lr), like, exact=True)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size, gamma)

    def update(self, updates, state, params=None, inplace=False):
        moves = super().update(updates, state, params, inplace)
        self.scheduler.step()
        return moves


@pytest.mark.parametrize("via_accelerate", [False, True])
def test_step_lr_schedule(via_accelerate):
    model_a, X, Y = make_cnn(torch.float32)  # (float32: see test_wrapper_matches_functional_core)
    model_b, _, _ = make_cnn(torch.float32)
    torch_opt = torch.optim.SGD(groups_of(model_a, (0.1, 0.1)))
    if via_accelerate:
        accelerate(torch_opt, "anderson", 0.6, 0, 4, 1, 2, 1e-12)
        opt = torch_opt
    else:
        opt = AcceleratedOptimizer(torch_opt, **OPTIONS)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    params_b = list(model_b.parameters())
    groups_b = [params_b[:2], params_b[2:]]
    cores = [aa.anderson(ScheduledSgd(0.1, 3, 0.5, g), **OPTIONS) for g in groups_b]
    states = [core.init([p.detach() for p in g]) for core, g in zip(cores, groups_b)]
    for _ in range(10):
        opt.zero_grad()
        mse(model_a, X, Y).backward()
        opt.step()
        scheduler.step()
        model_b.zero_grad()
        mse(model_b, X, Y).backward()
        with torch.no_grad():
            for i, (core, params) in enumerate(zip(cores, groups_b)):
                out, states[i] = core.update(
                    states[i], [p.detach().clone() for p in params], [p.grad for p in params]
                )
                for p, v in zip(params, out):
                    p.copy_(v)
        # Bit for bit: the same torch step on both sides (was 1e-10, fitted).
        assert_same_params(model_a, model_b)
    assert torch_opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_gradient_clipping():
    max_norm = 0.05
    model_a, X, Y = make_cnn()
    model_b, _, _ = make_cnn()
    opt = AcceleratedOptimizer(torch.optim.SGD(model_a.parameters(), lr=0.5), **OPTIONS)
    params_b = list(model_b.parameters())
    core = aa.anderson(
        TorchStep(lambda ps: torch.optim.SGD(ps, lr=0.5), params_b, exact=True), **OPTIONS
    )
    state = core.init([p.detach() for p in params_b])
    clipped_steps = 0
    for _ in range(10):
        opt.zero_grad()
        mse(model_a, X, Y).backward()
        nn.utils.clip_grad_norm_(model_a.parameters(), max_norm)
        opt.step()

        model_b.zero_grad()
        mse(model_b, X, Y).backward()
        # The grads clipped and stepped as the wrapper's are (torch's total norm, torch's
        # step on a copy), so both sides round alike: bit for bit (was 1e-8, fitted to the
        # norm summed in another order and amplified by the mixes).
        total = nn.utils.clip_grad_norm_(params_b, max_norm)
        clipped_steps += bool(total > max_norm)
        with torch.no_grad():
            out, state = core.update(
                state, [p.detach().clone() for p in params_b], [p.grad for p in params_b]
            )
            for p, v in zip(params_b, out):
                p.copy_(v)
        assert_same_params(model_a, model_b)
    assert clipped_steps >= 5 and int(state.num_mixed) > 0


def test_grad_scaler_steps_and_skips_on_inf():
    """scaler.step(opt) runs the accelerated step; a step with an Inf gradient is skipped
    whole (params, windows and counters untouched), and training then continues exactly as
    a run that never saw that batch."""

    def run(with_scaler, bad_steps):
        model, X, Y = make_cnn(torch.float32)
        opt = AcceleratedOptimizer(torch.optim.Adam(groups_of(model, (1e-2, 1e-2))), **OPTIONS)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if with_scaler else None
        history = []
        for k in range(12):
            if k in bad_steps and not with_scaler:
                continue  # the reference never sees the bad batch
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mse(model, X, Y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if k in bad_steps:
                    model.head.bias.grad.fill_(float("inf"))
                before = [p.detach().clone() for p in model.parameters()]
                count = int(opt.anderson_states[0].count) if opt.anderson_states[0] else 0
                scaler.step(opt)
                scaler.update()
                if k in bad_steps:
                    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
                    state = opt.anderson_states[0]
                    assert (int(state.count) if state else 0) == count
                    continue
            history.append([p.detach().clone() for p in model.parameters()])
        return history, opt

    reference, _ = run(False, {4, 9})
    scaled, opt = run(True, {4, 9})
    assert len(reference) == len(scaled) == 10
    for a, b in zip(reference, scaled):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    assert int(opt.anderson_states[0].num_mixed) > 0


# -- torch.optim plumbing --------------------------------------------------------------------


def test_shares_the_wrapped_optimizers_groups_and_state():
    model, X, Y = make_cnn()
    inner = torch.optim.Adam(groups_of(model))
    opt = AcceleratedOptimizer(inner, history_depth=3)
    assert opt.param_groups is inner.param_groups
    assert opt.defaults is inner.defaults
    opt.zero_grad()
    mse(model, X, Y).backward()
    opt.step()
    assert opt.state is inner.state and len(opt.state) == 4
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    assert len(inner.param_groups) == 3
    (mse(model, X, Y) + extra.square().sum()).backward()
    opt.step()
    states = opt.anderson_states
    assert int(states[2].count) == 1 and int(states[0].count) == 2
    hooked = []
    opt.register_step_post_hook(lambda *args: hooked.append(1))
    opt.step()
    assert hooked == [1]


def _hook_trace(opt, trace: list, tag: str) -> list:
    """Step pre- and post-hooks on `opt` and global ones, each recording what it got."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def record(kind):
        return lambda o, args, kwargs: trace.append((kind, o is opt, args[0] is o, kwargs))

    return [
        register_optimizer_step_pre_hook(record(f"global pre {tag}")),
        opt.register_step_pre_hook(record("pre")),
        opt.register_step_post_hook(record("post")),
        register_optimizer_step_post_hook(record(f"global post {tag}")),
    ]


def test_step_runs_torch_optims_hooks_and_is_labelled_only_while_a_profiler_records(
    monkeypatch,
):
    """`AcceleratedOptimizer.step` keeps `torch.optim.Optimizer`'s step bookkeeping: the
    step hooks in torch's order with torch's arguments (a pre-hook may replace them, and
    one that returns something else raises torch's error), and its profiler label while a
    profiler records; without one no `record_function` is opened (its cost, ~6 us, is
    several percent of a small model's step). The wrapped optimizer's own step keeps its
    hooks (with torch's arguments) and, while a profiler records, its label."""
    from aadl_func._src import wrapper_hooks

    model, X, Y = make_cnn(seed=5)
    opt = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), history_depth=3)
    plain = torch.optim.SGD(make_cnn(seed=5)[0].parameters(), lr=0.1)
    traces: dict[str, list] = {"ours": [], "torch": []}
    handles = [*_hook_trace(opt, traces["ours"], ""), *_hook_trace(plain, traces["torch"], "")]
    inner, inner_calls = opt.optimizer, []
    for kind in ("pre", "post"):
        register = getattr(inner, f"register_step_{kind}_hook")
        handles.append(register(lambda o, a, k, kind=kind: inner_calls.append((kind, o, a, k))))
    try:
        for o in (opt, plain):
            o.zero_grad()
        mse(model, X, Y).backward()
        opened = []
        original = wrapper_hooks.record_function
        monkeypatch.setattr(wrapper_hooks, "record_function",
                            lambda name: opened.append(name) or original(name))  # fmt: skip
        opt.step()
        assert opened == []
        # (torch's wrapper calls the hooks with `args` = the optimizer and the step's arguments)
        assert inner_calls == [("pre", inner, (inner,), {}), ("post", inner, (inner,), {})]
        for p in plain.param_groups[0]["params"]:
            p.grad = torch.zeros_like(p)
        plain.step()
        # (each optimizer's global hooks see both: keep the calls on itself)
        ours = [t for t in traces["ours"] if t[1]]
        assert ours == [t for t in traces["torch"] if t[1]] and len(ours) == 4
        with torch.profiler.profile() as profiler:
            opt.step()
        assert opened == ["Optimizer.step#AcceleratedOptimizer.step"]
        names = [e.name for e in profiler.events()]
        assert "Optimizer.step#AcceleratedOptimizer.step" in names
        assert "Optimizer.step#SGD.step" in names
    finally:
        for handle in handles:
            handle.remove()
    closure_calls = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: (args, {"closure": lambda: closure_calls.append(1) or 0.5})
    )
    assert opt.step() == 0.5 and closure_calls  # the arguments the pre-hook gave
    bad = opt.register_step_pre_hook(lambda o, args, kwargs: "not a pair")
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.step()
    bad.remove()


@pytest.mark.parametrize("how", ["grads", "closure"])
def test_the_wrapped_optimizers_post_hook_sees_its_plain_step_and_may_raise(how):
    """The wrapped optimizer's step post-hook runs after its step and before the mix, as
    torch's wrapper runs it: it sees the params at the plain step (torch.optim.SGD's, from the
    same params). One that raises ends the step recorded (`PlainStep.finish()` runs once the
    wrapper has recorded the torch step): every group's window counts it, with the params,
    at the plain step, its newest entry, and the next step goes on."""
    model, X, Y = make_cnn(seed=7)
    opt = AcceleratedOptimizer(torch.optim.SGD(groups_of(model)), history_depth=3)
    reference_model = make_cnn(seed=7)[0]
    reference = torch.optim.SGD(groups_of(reference_model))

    def run(opt, model):
        def closure():
            model.zero_grad()
            loss = mse(model, X, Y)
            loss.backward()
            return loss

        if how == "closure":
            return opt.step(closure)
        closure()
        return opt.step()

    for _ in range(3):  # the window fills: the next step mixes
        run(opt, model)
    # The plain step from these params (SGD without momentum: a function of the params alone)
    with torch.no_grad():
        for p, q in zip(reference_model.parameters(), model.parameters()):
            p.copy_(q)
    run(reference, reference_model)
    plain = [p.detach().clone() for p in reference_model.parameters()]
    seen = []

    def post_hook(optimizer, args, kwargs):
        seen.append([p.detach().clone() for p in model.parameters()])
        if len(seen) == 1:
            raise ValueError("a post-hook fails")

    handle = opt.optimizer.register_step_post_hook(post_hook)
    counts = [int(w.count) for w in opt.anderson_states]
    with pytest.raises(ValueError, match="a post-hook fails"):
        run(opt, model)
    assert all(torch.equal(a, b) for a, b in zip(seen[0], plain))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain))
    for group, window, count in zip(opt.param_groups, opt.anderson_states, counts):
        assert int(window.count) == count + 1
        assert all(torch.equal(p, a) for p, a in zip(group["params"], window.anchor))
    run(opt, model)  # the next step: its hook runs again
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(seen) == 2
    assert [int(w.count) for w in opt.anderson_states] == [c + 2 for c in counts]
    handle.remove()


def test_a_step_patched_on_the_wrapped_optimizer_is_called_as_it_is():
    """A `step` replaced on the torch optimizer's instance before it is wrapped (a user's, or
    an LR scheduler's, which records that the optimizer stepped) is the wrapper's plain step
    as it is: the scheduler then steps without torch's warning (an error here) that it
    stepped before its optimizer."""
    model, X, Y = make_cnn(seed=6)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    calls, original = [], sgd.step
    sgd.step = types.MethodType(
        lambda self, *args, **kwargs: calls.append(1) or original(*args, **kwargs), sgd
    )
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    opt = AcceleratedOptimizer(sgd, history_depth=3)
    for _ in range(3):
        opt.zero_grad()
        mse(model, X, Y).backward()
        opt.step()
        scheduler.step()
    assert calls == [1, 1, 1] and sgd.param_groups[0]["lr"] == 0.1 * 0.5**3


def test_returned_loss_is_the_loss_before_the_step_when_a_later_group_averages():
    """As torch.optim: ``step(closure)`` returns the closure's loss at the params it started
    from, also when a group's safeguard evaluated the closure and a later group averaged; the
    closure runs once for the torch step and twice per safeguard decision, never more."""
    model, X, Y = make_cnn(seed=3)
    opt = AcceleratedOptimizer(
        torch.optim.SGD(groups_of(model, (0.2, 0.5))),
        history_depth=3,
        average=True,
        average_tol=0.3,
    )
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = mse(model, X, Y)
        loss.backward()
        return loss

    def counters():
        states = [s for s in opt.anderson_states if s is not None]
        decided = sum(int(s.num_mixed + s.num_rejected) for s in states)
        return decided, sum(int(s.num_averaged) for s in states)

    averaged_steps = 0
    for k in range(12):
        with torch.no_grad():
            if k % 4 == 3:  # jolt the head so that its window scatters and group 1 averages
                model.head.weight.neg_()
            loss_before = mse(model, X, Y)
        (decided, averaged), calls_before = counters(), len(calls)
        returned = opt.step(closure)
        torch.testing.assert_close(returned.detach(), loss_before, rtol=1e-12, atol=0)
        assert len(calls) - calls_before == 1 + 2 * (counters()[0] - decided)
        averaged_steps += counters()[1] > averaged
    assert averaged_steps >= 1


@pytest.mark.parametrize("safeguard", ["loss_fn", "deferred"])
@pytest.mark.parametrize("value", [None, "0.5", torch.ones(2)], ids=["None", "str", "vector"])
def test_a_closure_that_returns_no_loss_is_named_and_changes_nothing(value, safeguard):
    model, X, Y = make_cnn(seed=4)
    opt = AcceleratedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), safeguard=safeguard
    )
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        opt.zero_grad()
        mse(model, X, Y).backward()
        return value

    with pytest.raises(
        TypeError, match=r"AcceleratedOptimizer.step: `closure` must return the loss"
    ):
        opt.step(closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(s is None for s in opt.anderson_states) and not opt.optimizer.state


# -- params changed after the first step -----------------------------------------------------


def _tensors_of(acc):
    """Every tensor a refused step must leave as it was, with its value and version counter:
    the params, the torch optimizer's state and the windows."""
    tensors = [p for group in acc.param_groups for p in group["params"]]
    tensors += [v for s in acc.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for window in acc.anderson_states:
        tensors += [t for t in optree.tree_leaves(window) if isinstance(t, torch.Tensor)]
    return [(t, t.detach().clone(), t._version) for t in tensors]


def _double(model, opt):
    model.double()
    return model.float


def _replace(model, opt):  # a new param of another shape in place of the head's weight
    params = opt.param_groups[1]["params"]
    old, params[0] = params[0], nn.Parameter(torch.zeros(2, 48))
    return lambda: params.__setitem__(0, old)


def _append(model, opt):  # one param more in the head's group
    opt.param_groups[1]["params"].append(nn.Parameter(torch.zeros(3)))
    return opt.param_groups[1]["params"].pop


def _accelerated_cnn(via_accelerate, seed=5):
    """A float32 CNN, two param groups, SGD with momentum: the model, the torch optimizer,
    the accelerator and the step to call (the patched `optimizer.step` via `accelerate`)."""
    model, X, Y = make_cnn(torch.float32, seed=seed)
    inner = torch.optim.SGD(groups_of(model), momentum=0.9)
    if via_accelerate:
        acc = accelerate(inner, history_depth=3, wait_iterations=0, relaxation=1.0)
        return model, X, Y, inner, acc, inner.step
    acc = AcceleratedOptimizer(inner, history_depth=3)
    return model, X, Y, inner, acc, acc.step


def _mse_closure(model, inner, X, Y, calls=None):
    """The closure of a full-batch MSE step in the model's current dtype (`calls`: a list
    that records each call)."""

    def closure():
        if calls is not None:
            calls.append(1)
        inner.zero_grad()
        dtype = model.head.weight.dtype
        loss = mse(model, X.to(dtype), Y.to(dtype))
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("via_accelerate", [False, True])
@pytest.mark.parametrize(
    "change, error, match",
    [
        (_double, TypeError, r"param group 0 changed .*`params\[0\]` has dtype torch.float64"),
        (_replace, ValueError, r"param group 1 changed .*`params\[0\]` has shape \(2, 48\)"),
        (_append, ValueError, r"param group 1 changed .*different pytree structure"),
    ],
    ids=["double", "replaced", "appended"],
)
def test_params_that_no_longer_fit_their_window_are_refused_before_the_torch_step(
    change, error, match, via_accelerate
):
    """The core would refuse them after the torch optimizer had stepped the params and its
    momentum; the step refuses them first, changing nothing (params, momentum and windows
    keep their values and versions; the closure is not called), so that once the change is
    undone the run goes on bit for bit as one that never saw it."""
    runs = []
    for changed in (True, False):
        model, X, Y, inner, acc, step = _accelerated_cnn(via_accelerate)
        calls = []
        closure = _mse_closure(model, inner, X, Y, calls)
        for _ in range(4):
            step(closure)
        if changed:
            undo = change(model, inner)
            for group in inner.param_groups:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            tensors, windows, num_state = _tensors_of(acc), acc.anderson_states, len(acc.state)
            calls.clear()
            with pytest.raises(error, match=match) as raised:
                step(closure)
            assert "AcceleratedOptimizer.step" in str(raised.value)
            assert "changed since its window was made" in str(raised.value)
            assert "nothing was stepped" in str(raised.value)
            assert calls == [] and len(acc.state) == num_state
            assert all(a is b for a, b in zip(acc.anderson_states, windows))
            for t, value, version in tensors:
                assert t._version == version and torch.equal(t, value)
            undo()
        for _ in range(3):
            step(closure)
        assert [int(s.count) for s in acc.anderson_states] == [7, 7]
        runs.append((model, acc))
    assert_same_params(runs[0][0], runs[1][0])
    assert int(runs[0][1].anderson_states[1].num_mixed) > 0


@pytest.mark.parametrize("via_accelerate", [False, True])
def test_after_model_double_the_windows_start_afresh_as_the_error_says(via_accelerate):
    """`model.double()` after the first step: the error's recipe (the state dict without its
    "anderson" entry loaded back) keeps the torch optimizer's state, cast by torch to the new
    dtype, and starts every window afresh for the float64 params."""
    model, X, Y, inner, acc, step = _accelerated_cnn(via_accelerate)
    closure = _mse_closure(model, inner, X, Y)
    for _ in range(4):
        step(closure)
    model.double()
    with pytest.raises(TypeError, match=r"del sd\['anderson'\]"):
        step(closure)
    opt = inner if via_accelerate else acc
    sd = opt.state_dict()
    del sd["anderson"]
    opt.load_state_dict(sd)
    for _ in range(5):
        step(closure)
    assert [int(s.count) for s in acc.anderson_states] == [5, 5]
    assert all(s.anchor[0].dtype == torch.float64 for s in acc.anderson_states)
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in inner.state.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_window_check_lets_every_valid_step_through():
    """No false alarm where the params and the window legitimately differ in place or dtype:
    a window on another device than the params' (`history_device`, here the same CPU spelled
    out) or in another dtype (`history_dtype`), empty groups and groups added later."""
    model, X, Y = make_cnn(torch.float32, seed=6)
    inner = torch.optim.Adam(groups_of(model))
    acc = AcceleratedOptimizer(
        inner, history_depth=3, history_device="cpu", history_dtype=torch.float64
    )

    def closure():
        acc.zero_grad()
        loss = mse(model, X, Y)
        loss.backward()
        return loss

    for k in range(6):
        if k == 2:
            acc.add_param_group({"params": []})
        if k == 3:
            acc.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
        acc.step(closure)
    assert [None if s is None else int(s.count) for s in acc.anderson_states] == [6, 6, None, 3]

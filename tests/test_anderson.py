"""``anderson(..., mode="aadl")``: the spec's numbered semantics and the functional contract.

The trajectories of every option set in every execution mode are test_contract.py's; here:
the gates, the mix of prescribed windows (against ``references.aadl_extrapolate``), the
safeguard's counters, a ``functional_call`` training loop (against ``references.Recurrence``),
purity, mixed-dtype pytrees in place, checkpoints, layouts, and argument checking.
"""

from __future__ import annotations

import io
import math

import numpy as np
import optree
import pytest
import torch
from conftest import (
    GradientDescent,
    LogisticProblem,
    MomentumDescent,
    assert_tree_equal,
    relative_error,
    run_problem,
    snapshot,
    vector_to_tree,
)
from references import Recurrence, aadl_extrapolate, mix_bound, rounding_bounds, solve_roundoff
from torch.func import functional_call, grad

import aadl_func as aa

STEPS = 30
U64 = 2.0**-53  # float64's unit roundoff


def prescribed_mix_bound(window: np.ndarray, relaxation=1.0, reg=0.0) -> float:
    """The bound on a float64 mix of ``window`` (``(n, k)``, the plain steps exactly as the
    library stored them) against ``aadl_extrapolate``'s: the window's points are the same on
    both sides, its stored differences round by the float64 solve's backward error
    (``references.mix_bound``: ``8 sqrt(2) S + (k + 1) u``, ``S`` the reference's own
    sensitivity)."""
    n, k = window.shape
    return mix_bound(
        lambda w: aadl_extrapolate(w, relaxation, reg), window, U64, solve_roundoff(n, k), 0.0
    )


def test_low_precision_window_storage_dtype(logistic):
    opt = aa.anderson(GradientDescent(0.1), history_depth=4, history_dtype=torch.bfloat16)
    params = vector_to_tree(np.ones(logistic.dim))
    state = opt.init(params)
    for residual in state.residuals:
        assert all(leaf.dtype == torch.bfloat16 for leaf in optree.tree_leaves(residual))
    assert state.gram.dtype == torch.float64


def test_safeguard_rejections_are_counted(logistic):
    lr = 1.0 / logistic.smoothness
    x0 = np.random.default_rng(0).standard_normal(logistic.dim)
    opt = aa.anderson(GradientDescent(lr), history_depth=5)
    _, mixed, rejected, state = run_problem(logistic, opt, x0, STEPS, safeguard=True)
    # Every call from the third one mixes; the safeguard keeps some and rejects the others.
    assert [m or r for m, r in zip(mixed, rejected)] == [False, False] + [True] * (STEPS - 2)
    assert any(rejected) and any(mixed)
    assert int(state.num_rejected) == sum(rejected)


def test_safeguard_keeps_the_loss_below_plain_steps(logistic):
    # With loss_fn the returned params never have a higher loss than the plain inner step.
    lr = 1.0 / logistic.smoothness
    x0 = np.random.default_rng(2).standard_normal(logistic.dim)
    opt = aa.anderson(GradientDescent(lr), history_depth=6, relaxation=1.3)
    outputs, *_ = run_problem(logistic, opt, x0, STEPS, safeguard=True)
    for x_in, x_out in zip([x0, *outputs[:-1]], outputs):
        assert logistic.loss(x_out) <= logistic.loss(x_in - lr * logistic.grad(x_in))


def test_gates_follow_the_spec_formula():
    # Which calls mix, straight from the numbered semantics: k > wait, k % frequency == 0 and a
    # window of >= 3 entries, the window holding the y of every store_each_nth-th call.
    x = torch.linspace(-1.0, 1.0, 7, dtype=torch.float64)
    for wait, store, freq, depth in [(0, 1, 1, 3), (5, 2, 3, 4), (2, 3, 2, 5), (0, 4, 1, 3)]:
        opt = aa.anderson(
            GradientDescent(0.1),
            history_depth=depth,
            wait_iterations=wait,
            store_each_nth=store,
            frequency=freq,
        )
        params, state = x, opt.init(x)
        for k in range(1, 26):
            before = int(state.num_mixed)
            params, state = opt.update(state, params, 2.0 * params + torch.cos(params))
            entries = min(k // store, depth)
            assert int(state.window_size) == entries
            expected = k > wait and k % freq == 0 and entries >= 3
            assert (int(state.num_mixed) > before) == expected, (wait, store, freq, depth, k)


def _prescribed_run(opt, x0, targets):
    """Drives ``opt`` so that its plain steps are ``targets`` (GD with lr 1 and grads
    ``x - y``); returns the params after each call and the plain steps as rounded,
    ``x - (x - y)``."""
    x = torch.from_numpy(x0.copy())
    state = opt.init(x)
    outputs, plain = [], []
    for y in targets:
        grads = x - torch.from_numpy(y.copy())
        plain.append((x - grads).numpy().copy())
        x, state = opt.update(state, x, grads)
        outputs.append(x.numpy().copy())
    return outputs, plain, state


@pytest.mark.parametrize("history_depth,calls", [(3, 3), (4, 9), (6, 6), (6, 17), (10, 23)])
@pytest.mark.parametrize("relaxation,reg", [(1.0, 0.0), (0.4, 0.0), (1.7, 1e-2)])
def test_step_is_mix_of_the_last_plain_steps(history_depth, calls, relaxation, reg):
    # The first mix comes at the last call, after the ring has wrapped (calls > depth): the
    # returned point is the AADL formula on the last history_depth plain steps.
    rng = np.random.default_rng(history_depth + calls)
    n = 40
    steps = rng.standard_normal((calls, n)) * np.logspace(0, -1, calls)[:, None]
    targets = list(rng.standard_normal(n) + np.cumsum(steps, axis=0))
    opt = aa.anderson(
        GradientDescent(1.0),
        history_depth=history_depth,
        relaxation=relaxation,
        reg=reg,
        wait_iterations=calls - 1,
    )
    outputs, plain, state = _prescribed_run(opt, rng.standard_normal(n), targets)
    for out, y in zip(outputs[:-1], plain[:-1]):
        assert np.array_equal(out, y)
    window = np.stack(plain[-history_depth:], axis=1)
    expected = aadl_extrapolate(window, relaxation, reg)
    # Derived from the window's rounding (it was 1e-8, 3e6-1e7 times these bounds).
    assert relative_error(outputs[-1], expected) <= prescribed_mix_bound(window, relaxation, reg)
    assert relative_error(expected, plain[-1]) > 1e-3
    assert int(state.num_mixed) == 1 and int(state.window_size) == history_depth


@pytest.mark.parametrize("curvature", [1e-2, 1e-5])
def test_incremental_window_on_nearly_constant_steps(curvature):
    # Plain steps x0 + i v + curvature * (random second differences): DR is well conditioned
    # but tiny next to the residuals, the regime of slowly varying training steps.
    rng = np.random.default_rng(0)
    n, depth = 30, 5
    v, x0 = rng.standard_normal(n), rng.standard_normal(n)
    second = curvature * np.cumsum(np.cumsum(rng.standard_normal((n, depth)), axis=1), axis=1)
    window = x0[:, None] + np.arange(1, depth + 1)[None, :] * v[:, None] + second
    assert np.linalg.cond(np.diff(window, n=2, axis=1)) < 2.0
    opt = aa.anderson(GradientDescent(1.0), history_depth=depth, wait_iterations=depth - 1)
    outputs, plain, _ = _prescribed_run(opt, x0, list(window.T))
    window = np.stack(plain, axis=1)
    expected = aadl_extrapolate(window)
    # Derived from the window's rounding (it was 1e-8 of the mix's move, fitted to nothing);
    # the move is ~curvature x the params, so the bound is below 1e-8 of the move too.
    bound = prescribed_mix_bound(window)
    correction = np.linalg.norm(expected - window[:, -1]) / np.linalg.norm(expected)
    assert bound < 1e-8 * correction
    assert relative_error(outputs[-1], expected) <= bound
    # The pure solver handles the same window.
    mixed = aa.mix(torch.from_numpy(window.T.copy())).numpy()
    assert relative_error(mixed, expected) <= bound


# -- torch.func.functional_call ------------------------------------------------------------


class SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(3, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))).squeeze(-1)


def test_functional_call_training_loop():
    torch.manual_seed(0)
    model = SmallNet().double()
    inputs = torch.randn(64, 3, dtype=torch.float64)
    targets = torch.sin(inputs.sum(-1))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    names = list(params)

    def loss(p):
        return torch.mean((functional_call(model, p, (inputs,)) - targets) ** 2)

    gradient = grad(loss)

    # A NumPy view of the same problem, for the reference: the loss and gradient are torch's,
    # the Anderson logic is the reference's.
    shapes = {name: params[name].shape for name in names}

    def unflatten(x):
        out, start = {}, 0
        for name in names:
            size = math.prod(shapes[name])
            out[name] = torch.from_numpy(x[start : start + size].copy()).reshape(shapes[name])
            start += size
        return out

    def flatten(p):
        return np.concatenate([p[name].detach().reshape(-1).numpy() for name in names])

    np_grad = lambda x: flatten(gradient(unflatten(x)))
    np_loss = lambda x: float(loss(unflatten(x)))

    lr = 0.2
    opt = aa.anderson(GradientDescent(lr), history_depth=5, relaxation=0.5)
    state = opt.init(params)
    x0 = flatten(params)
    outputs = []
    for _ in range(40):
        params, state = opt.update(state, params, gradient(params), loss_fn=loss)
        assert list(params) == names
        outputs.append(flatten(params))
    expected, kinds = Recurrence(np_grad, lr, history_depth=5, relaxation=0.5).run(
        x0, 40, np_loss, inputs=outputs
    )
    mixed = [kind == "mix" for kind in kinds]
    # Each call within its rounding times its own sensitivity (references.rounding_bounds; it
    # was 1e-8); the grads are torch's, rounded like the params (u per point).
    errors = [relative_error(a, b) for a, b in zip(outputs, expected)]
    reference = lambda: Recurrence(np_grad, lr, history_depth=5, relaxation=0.5)  # noqa: E731
    bounds = rounding_bounds(reference, x0, outputs, U64, solve_roundoff(x0.size, 5), np_loss)
    assert all(e <= b for e, b in zip(errors, bounds)), max(e / b for e, b in zip(errors, bounds))
    assert int(state.num_mixed) == sum(mixed) > 0
    assert float(loss(params)) < 0.5 * float(loss(unflatten(x0)))
    # The trained params still drive the module.
    model.load_state_dict(params)
    assert torch.equal(model(inputs), functional_call(model, params, (inputs,)))


# -- purity, in-place, serialisation -------------------------------------------------------


def _mixed_params(gen):
    return {
        "conv": torch.randn(4, 3, 3, 3, generator=gen, dtype=torch.float64).to(
            memory_format=torch.channels_last
        ),
        "linear": (
            torch.randn(5, 3, generator=gen, dtype=torch.float64),
            torch.randn(5, generator=gen).to(torch.float32),
        ),
        "scale": torch.tensor(0.7, dtype=torch.float64),
    }


def _quadratic_grads(params, k):
    # A smooth, coupled, deterministic gradient field (not a constant): 0.8 x + 0.3 sin(x) + c_k.
    return optree.tree_map(
        lambda p: 0.8 * p + 0.3 * torch.sin(p) + 0.01 * math.cos(k) * torch.ones_like(p), params
    )


def _loss(params):
    return sum(
        (leaf.double() ** 2).sum() + torch.cos(leaf.double()).sum()
        for leaf in optree.tree_leaves(params)
    )


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("safeguard", [False, True], ids=["plain", "safeguard"])
def test_update_is_pure(mode, safeguard):
    gen = torch.Generator().manual_seed(3)
    params = _mixed_params(gen)
    opt = aa.anderson(MomentumDescent(0.3, 0.4), history_depth=4, relaxation=0.6, mode=mode)
    state = opt.init(params)
    loss_fn = _loss if safeguard else None
    for k in range(12):
        grads = _quadratic_grads(params, k)
        before = snapshot((state, params, grads))
        new_params, new_state = opt.update(state, params, grads, loss_fn=loss_fn)
        assert_tree_equal((state, params, grads), before)
        # The returned params own their memory: nothing aliases the inputs or the state.
        state_ptrs = {t.data_ptr() for t in optree.tree_leaves(new_state) if t.numel()}
        input_ptrs = {t.data_ptr() for t in optree.tree_leaves((state, params, grads)) if t.numel()}
        for leaf in optree.tree_leaves(new_params):
            assert leaf.data_ptr() not in state_ptrs | input_ptrs
        params, state = new_params, new_state
    assert int(state.num_mixed) > 0


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("history_dtype", [None, torch.float32])
@pytest.mark.parametrize("safeguard", [False, True], ids=["plain", "safeguard"])
def test_inplace_matches_pure(mode, history_dtype, safeguard):
    gen = torch.Generator().manual_seed(4)
    params = _mixed_params(gen)
    opt = aa.anderson(
        MomentumDescent(0.3, 0.4),
        history_depth=4,
        relaxation=0.8,
        store_each_nth=1,
        mode=mode,
        history_dtype=history_dtype,
    )
    loss_fn = _loss if safeguard else None
    pure_params, pure_state = params, opt.init(params)
    fast_params, fast_state = snapshot(params), opt.init(snapshot(params))
    for k in range(12):
        pure_params, pure_state = opt.update(
            pure_state, pure_params, _quadratic_grads(pure_params, k), loss_fn=loss_fn
        )
        fast_params, fast_state = opt.update(
            fast_state, fast_params, _quadratic_grads(fast_params, k), inplace=True, loss_fn=loss_fn
        )
        assert_tree_equal(fast_params, pure_params)
    assert_tree_equal(fast_state, pure_state)
    assert fast_params["conv"].is_contiguous(memory_format=torch.channels_last)
    assert int(pure_state.num_mixed) > 0


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_save_load_mid_run_continues_identically(mode):
    gen = torch.Generator().manual_seed(5)
    params = _mixed_params(gen)
    opt = aa.anderson(
        MomentumDescent(0.3, 0.4),
        history_depth=5,
        relaxation=0.7,
        history_dtype=torch.float32,
        mode=mode,
    )
    state = opt.init(params)
    for k in range(7):
        params, state = opt.update(state, params, _quadratic_grads(params, k), loss_fn=_loss)
    buffer = io.BytesIO()
    torch.save({"state": state, "params": params}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded["state"], aa.AndersonState)
    assert_tree_equal(loaded["state"], state)
    params2, state2 = loaded["params"], loaded["state"]
    for k in range(7, 16):
        params, state = opt.update(state, params, _quadratic_grads(params, k), loss_fn=_loss)
        params2, state2 = opt.update(state2, params2, _quadratic_grads(params2, k), loss_fn=_loss)
        assert_tree_equal(params2, params)
    assert_tree_equal(state2, state)
    assert int(state.num_mixed) > 0


# -- dtypes, shapes, memory format ---------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_params_keep_dtype_shape_and_memory_format(inplace, mode):
    gen = torch.Generator().manual_seed(6)
    conv = torch.randn(8, 3, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    params = {
        "conv": conv,
        "f64": torch.randn(4, 5, generator=gen, dtype=torch.float64),
        "bf16": torch.randn(6, generator=gen).to(torch.bfloat16),
        "scalar": torch.tensor(1.5, dtype=torch.float32),
        "column": torch.randn(7, 1, generator=gen, dtype=torch.float64),
    }
    layout = {name: (p.dtype, p.shape, p.stride()) for name, p in params.items()}
    opt = aa.anderson(GradientDescent(0.2), history_depth=4, relaxation=0.9, mode=mode)
    state = opt.init(params)
    for k in range(10):
        params, state = opt.update(state, params, _quadratic_grads(params, k), inplace=inplace)
        for name, p in params.items():
            assert (p.dtype, p.shape, p.stride()) == layout[name], name
            assert torch.isfinite(p.float()).all()
        assert params["conv"].is_contiguous(memory_format=torch.channels_last)
    assert int(state.num_mixed) > 0


def test_non_finite_mix_is_never_returned():
    # Iterates of size 1e200: the float64 Gram entries overflow, so no mix is possible. The
    # plain steps (finite) must come back unchanged, with the events counted.
    x = torch.tensor([1e200, -2e200, 3e200], dtype=torch.float64)
    opt = aa.anderson(GradientDescent(0.5), history_depth=4)
    state = opt.init(x)
    for _ in range(8):
        y = x - 0.5 * (x * 0.3)
        x, state = opt.update(state, x, x * 0.3)
        assert torch.isfinite(x).all()
        assert torch.equal(x, y)
    assert int(state.num_mixed) == 0 and int(state.num_nonfinite) > 0


# -- argument checking ---------------------------------------------------------------------


BAD_OPTIONS = [
    ("history_depth", 2),
    ("history_depth", 0),
    ("history_depth", 4.0),
    ("history_depth", True),
    ("history_depth", "10"),
    ("relaxation", 0.0),
    ("relaxation", -0.5),
    ("relaxation", math.nan),
    ("relaxation", math.inf),
    ("relaxation", "1"),
    ("relaxation", None),
    ("reg", -1e-8),
    ("reg", math.nan),
    ("reg", math.inf),
    ("reg", "0"),
    ("wait_iterations", -1),
    ("wait_iterations", 1.5),
    ("wait_iterations", None),
    ("store_each_nth", 0),
    ("store_each_nth", 2.0),
    ("frequency", 0),
    ("frequency", -3),
    ("frequency", "1"),
    ("mode", "anderson"),
    ("mode", None),
    ("average", "yes"),
    ("average", 1),
    ("average_tol", 0.0),
    ("average_tol", -0.1),
    ("average_tol", math.nan),
    ("history_device", "no-such-device"),
    ("history_device", 3.5),
    ("compute_device", "no-such-device"),
    ("history_dtype", torch.int32),
    ("history_dtype", "float32"),
    ("history_dtype", torch.bool),
]


@pytest.mark.parametrize("name,value", BAD_OPTIONS)
def test_invalid_options_raise_naming_the_argument(name, value):
    with pytest.raises((ValueError, TypeError), match=name):
        aa.anderson(GradientDescent(0.1), **{name: value})


@pytest.mark.parametrize("inner", [None, object(), 0.1, (lambda p: p)])
def test_invalid_inner_raises(inner):
    with pytest.raises(TypeError, match="inner"):
        aa.anderson(inner)


def test_valid_options_are_accepted():
    """Edge values (integers for floats, devices as strings or ``torch.device``, a float16
    window) are accepted and mean what they say: the window is stored in float16 on the CPU,
    and integer hyperparameters step exactly as their float values do."""
    x0 = torch.linspace(-1.0, 1.0, 7, dtype=torch.float64)
    edge = dict(
        history_depth=3,
        wait_iterations=0,
        store_each_nth=1,
        frequency=1,
        mode="aadl",
        average=True,
        average_tol=0.5,
        history_device="cpu",
        compute_device=torch.device("cpu"),
        history_dtype=torch.float16,
    )
    runs = []
    for numbers in (dict(relaxation=2, reg=0), dict(relaxation=2.0, reg=0.0)):
        opt = aa.anderson(GradientDescent(0.1), **edge, **numbers)
        x, state = x0, opt.init(x0)
        for residual in state.residuals:
            assert residual.dtype == torch.float16 and residual.device.type == "cpu"
        for _ in range(6):
            x, state = opt.update(state, x, 2.0 * x + torch.cos(x))
        assert int(state.count) == 6 and int(state.num_mixed) > 0
        runs.append(x)
    assert torch.equal(runs[0], runs[1])
    opt = aa.anderson(GradientDescent(0.1), history_depth=3, mode="classic", average=False)
    x, state = x0, opt.init(x0)
    for _ in range(3):
        x, state = opt.update(state, x, 2.0 * x + torch.cos(x))
    assert int(state.num_mixed) == 2  # classic mixes from the second pair on


def _bad_grads(params):
    return {
        "missing key": {"a": params["a"]},
        "extra key": {**params, "c": torch.zeros(2)},
        "wrong shape": {"a": params["a"], "b": torch.zeros(4, 2)},
        # floating grads of another dtype are cast to the params' dtype; integers are refused
        "non-floating dtype": {"a": params["a"], "b": params["b"].long()},
        "non-tensor leaf": {"a": params["a"], "b": 1.0},
        "tuple instead of dict": (params["a"], params["b"]),
    }


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        "missing key",
        "extra key",
        "wrong shape",
        "non-floating dtype",
        "non-tensor leaf",
        "tuple instead of dict",
    ],
)
def test_mismatched_grads_raise_before_any_change(case, inplace):
    params = {"a": torch.randn(3), "b": torch.randn(2, 4)}
    opt = aa.anderson(MomentumDescent(0.1, 0.5), history_depth=3)
    state = opt.init(params)
    for k in range(4):  # a mid-run state, with a full window
        params, state = opt.update(state, params, _quadratic_grads(params, k))
    before = snapshot((state, params))
    with pytest.raises((ValueError, TypeError), match="grads"):
        opt.update(state, params, _bad_grads(params)[case], inplace=inplace)
    assert_tree_equal((state, params), before)


@pytest.mark.parametrize("inplace", [False, True])
def test_params_unlike_the_state_raise_before_any_change(inplace):
    params = {"a": torch.randn(3), "b": torch.randn(2, 4)}
    opt = aa.anderson(GradientDescent(0.1), history_depth=3)
    state = opt.init(params)
    params, state = opt.update(state, params, _quadratic_grads(params, 0))
    before = snapshot(state)
    other = {"a": torch.randn(3), "b": torch.randn(4, 2)}
    with pytest.raises(ValueError, match="params"):
        opt.update(state, other, _quadratic_grads(other, 1), inplace=inplace)
    assert_tree_equal(state, before)
    # A state made by another configuration is refused too.
    with pytest.raises(ValueError, match="state"):
        aa.anderson(GradientDescent(0.1), history_depth=5).update(
            state, params, _quadratic_grads(params, 1)
        )
    assert_tree_equal(state, before)


def test_init_rejects_bad_params():
    opt = aa.anderson(GradientDescent(0.1))
    with pytest.raises(TypeError, match="params"):
        opt.init({"a": torch.zeros(3), "b": 1.0})
    with pytest.raises(TypeError, match="params"):
        opt.init(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="params"):
        opt.init({})


def test_problem_is_not_trivial(logistic: LogisticProblem):
    # Guards the meaning of the trajectory tests: the problem's gradient descent is slow.
    lr = 1.0 / logistic.smoothness
    x = np.random.default_rng(0).standard_normal(logistic.dim)
    g0 = np.linalg.norm(logistic.grad(x))
    for _ in range(STEPS):
        x = x - lr * logistic.grad(x)
    assert np.linalg.norm(logistic.grad(x)) > 1e-3 * g0

"""Reliability of the functional core: non-finite numbers, determinism, checkpoints.

What ``docs/reliability.md`` promises is checked here against independent float64 NumPy
references written from the math (AADL's extrapolation, textbook type-II Anderson) and the
documented recovery rule, never against numbers produced by the code under test.
"""

from __future__ import annotations

import io
from collections import deque

import numpy as np
import optree
import pytest
import torch
from conftest import GradientDescent
from references import aadl_extrapolate, type2_anderson

import aadl_func as aa
from aadl_func import AdamState, SgdState, adam, sgd

# -- independent references -------------------------------------------------------------------


def aadl_reference(window, relaxation):
    """AADL's extrapolation of the iterates ``window`` (oldest first): tests/references.py."""
    return aadl_extrapolate(
        np.stack([np.asarray(w, dtype=np.float64) for w in window], axis=1), relaxation
    )


def classic_reference(pairs: list[tuple[np.ndarray, np.ndarray]], relaxation: float):
    """Type-II Anderson on the pairs ``(x_i, g(x_i))`` (oldest first): tests/references.py."""
    xs = np.stack([p[0] for p in pairs], axis=1)
    gs = np.stack([p[1] for p in pairs], axis=1)
    return type2_anderson(xs, gs, relaxation)


class Shift:
    """``updates = grads``: with ``params = 0`` the inner step ``y`` is exactly ``grads``,
    which lets a test write any window it likes."""

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return updates, state


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _assert_bitwise(a, b) -> None:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
        assert torch.equal(x, y)


def _finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


# -- non-finite numbers ------------------------------------------------------------------------

CURVATURE = np.linspace(0.2, 1.0, 6)


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("bad_calls", [(5,), (5, 6), (4, 9)])
def test_nan_step_restarts_the_window(mode: str, bad_calls: tuple[int, ...]):
    """An inner step producing NaN: that call returns the (NaN) plain step, the window
    restarts, and the run continues exactly like the documented reference (a non-finite
    entry empties the window and is not kept) once the user rolls back to the last finite
    params, as mixed-precision training skips overflowing steps."""
    depth, relaxation, lr = 4, 0.7, 0.5
    opt = aa.anderson(GradientDescent(lr), history_depth=depth, relaxation=relaxation, mode=mode)
    x = np.ones(6)
    state = opt.init(torch.tensor(x))
    window: deque = deque(maxlen=depth)
    nonfinite_events = 0
    for k in range(1, 16):
        grad = CURVATURE * x if k not in bad_calls else np.full(6, np.nan)
        y = x - lr * grad  # the plain step, in NumPy
        if mode == "aadl":
            entry, finite = y, np.isfinite(y).all()
            nonfinite_events += int(not finite) + int(finite and k - 1 in bad_calls)
        else:
            entry, finite = (x, y), np.isfinite(y - x).all()
            nonfinite_events += int(not finite)
        if finite:
            window.append(entry)
        else:
            window.clear()
        if mode == "aadl":
            expected = aadl_reference(list(window), relaxation) if len(window) >= 3 else y
        else:
            expected = classic_reference(list(window), relaxation) if len(window) >= 2 else y

        out, state = opt.update(state, torch.tensor(x), torch.tensor(grad))
        out = out.numpy()
        if np.isfinite(y).all():
            assert np.isfinite(out).all(), f"call {k}: finite plain step, non-finite params"
            np.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-12)
        else:
            assert not np.isfinite(out).all()
        assert _finite(state.gram), "a non-finite Gram entry survived"
        assert int(state.num_nonfinite) == nonfinite_events
        x = out if np.isfinite(out).all() else x  # roll back a non-finite step
    # Mixing resumed: the last calls all mixed.
    assert int(state.num_mixed) >= 15 - max(bad_calls) - 2


def test_nan_without_rollback_stays_contained():
    """If the user keeps the NaN params, every plain step is NaN: the returned params are NaN
    (there is nothing finite to return), but the Gram and the counters stay finite."""
    opt = aa.anderson(GradientDescent(0.5), history_depth=4)
    x = torch.ones(6, dtype=torch.float64)
    state = opt.init(x)
    for k in range(1, 10):
        grads = torch.full_like(x, float("nan")) if k == 3 else x
        x, state = opt.update(state, x, grads)
        assert _finite(state.gram)
    assert int(state.window_size) == 1 and int(state.num_nonfinite) == 7


def test_overflowing_grads():
    """Huge float32 grads overflow the plain step to -inf (aadl_func.sgd): like a NaN step,
    then the rolled-back run resumes mixing two calls later and stays finite."""
    opt = aa.anderson(sgd(10.0), history_depth=5)
    x = torch.linspace(-1.0, 1.0, 8)
    state = opt.init(x)
    mixed_after = []
    for k in range(1, 13):
        grads = torch.full_like(x, 3e38) if k == 6 else 0.3 * x
        out, state = opt.update(state, x, grads)
        if k == 6:
            assert torch.isinf(out).all()
        else:
            assert _finite(out)
            x = out
        if k > 6:
            mixed_after.append(int(state.num_mixed))
        assert _finite(state.gram)
    # Calls 7 and 8 rebuild the window (restarted again by the -inf anchor), 9 mixes.
    assert mixed_after[:3] == [mixed_after[0]] * 2 + [mixed_after[0] + 1]
    assert int(state.num_nonfinite) == 2


def test_history_dtype_overflow_never_reaches_params():
    """A float16 window overflows (differences > 65504) while the float32 params are finite:
    those differences are dropped (window restart), the params are always the finite plain
    step or a finite mix, and mixing resumes once three representable entries are stored."""
    opt = aa.anderson(Shift(), history_depth=4, history_dtype=torch.float16)
    zero = torch.zeros(3)
    state = opt.init(zero)
    steps = [1e5, 3e5, 2e5, 1.0, 1.5, 1.75, 1.875]  # the window entries y_k
    for k, value in enumerate(steps, start=1):
        y = torch.tensor([value, -value, 2 * value])
        out, state = opt.update(state, zero, y)
        assert _finite(out)
        if k <= 4:  # 1e5, 3e5, 2e5 and 1.0 - 2e5 do not fit in float16
            assert torch.equal(out, y), "a restarted window must return the plain step"
    assert int(state.num_nonfinite) == 3
    assert int(state.window_size) == 4 and int(state.num_mixed) == 2
    # Geometric entries 1, 1.5, 1.75, 1.875 (float16-exact differences): the fixed point is 2.
    np.testing.assert_allclose(out.numpy(), [2.0, -2.0, 4.0], rtol=1e-6)


def test_nonfinite_gram_entry():
    """float64 iterates of size 1e200: each Gram entry (1e400) overflows, so every residual
    is dropped and every call returns the plain step, bitwise, with a finite state."""
    opt = aa.anderson(Shift(), history_depth=3)
    zero = torch.zeros(2, dtype=torch.float64)
    state = opt.init(zero)
    for k, value in enumerate([1e200, 2e200, 2.5e200, 2.75e200], start=1):
        y = torch.tensor([value, -value], dtype=torch.float64)
        out, state = opt.update(state, zero, y)
        assert torch.equal(out, y)
        assert _finite(state.gram) and int(state.window_size) == 1
        assert int(state.num_nonfinite) == k - 1


def test_difference_gram_overflow_restarts_window():
    """Entries of size ~1.2e154: the residual Gram row (~1.4e308) is finite, but the window
    also keeps the Gram of consecutive residual differences, |d| = 2.4e154, whose square
    overflows float64. Rule A applies: the residual is dropped, the window restarts, and the
    plain step is returned (finite), with a finite state."""
    opt = aa.anderson(Shift(), history_depth=3)
    zero = torch.zeros(1, dtype=torch.float64)
    state = opt.init(zero)
    for value in [0.0, 1.2e154, 0.0]:
        y = torch.tensor([value], dtype=torch.float64)
        out, state = opt.update(state, zero, y)
        assert torch.equal(out, y)
    for t in (state.gram, state.dr_gram, state.dr_rhs):
        assert _finite(t)
    assert int(state.window_size) == 1
    assert int(state.num_nonfinite) == 1 and int(state.num_mixed) == 0


def test_mixed_point_overflow():
    """float32 entries 0, 2e38, 3e38 extrapolate to the fixed point 4e38 > float32 max: the
    mix is discarded and the plain step returned; the window is kept. ``mix`` does the same."""
    opt = aa.anderson(Shift(), history_depth=3)
    zero = torch.zeros(2)
    state = opt.init(zero)
    for value in [0.0, 2e38, 3e38]:
        y = torch.full((2,), value)
        out, state = opt.update(state, zero, y)
        assert torch.equal(out, y)
    assert int(state.num_nonfinite) == 1 and int(state.window_size) == 3
    assert np.isclose(aadl_reference([np.zeros(1), [2e38], [3e38]], 1.0)[0], 4e38)
    window = torch.tensor([[0.0], [2e38], [3e38]])
    assert torch.equal(aa.mix(window), window[-1])


def test_mix_of_a_nonfinite_window_returns_the_newest_entry():
    window = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for bad in (float("nan"), float("inf")):
        poisoned = window.clone()
        poisoned[1, 2] = bad
        assert torch.equal(aa.mix(poisoned), poisoned[-1])


def test_nan_under_vmap_is_per_member():
    """Under vmap the restart is blended with torch.where: a NaN in one ensemble member
    restarts only its window; each member matches its own unbatched run."""
    opt = aa.anderson(GradientDescent(0.5), history_depth=4, relaxation=0.8)
    x0 = torch.stack([torch.ones(6), torch.linspace(-1, 1, 6)]).double()
    curvature = torch.tensor(CURVATURE)

    def grads_of(x, k, member):
        nan = k == 4 and member == 0
        return torch.full_like(x, float("nan")) if nan else curvature * x

    xs, states = x0, torch.func.vmap(opt.init)(x0)
    batched = []
    for k in range(1, 11):
        grads = torch.stack([grads_of(xs[m], k, m) for m in range(2)])
        out, states = torch.func.vmap(opt.update)(states, xs, grads)
        batched.append(out)
        xs = torch.where(torch.isfinite(out), out, xs)
    for member in range(2):
        x, state = x0[member], opt.init(x0[member])
        for k in range(1, 11):
            out, state = opt.update(state, x, grads_of(x, k, member))
            expected = batched[k - 1][member]
            assert _finite(out) == _finite(expected)
            if _finite(out):
                # Batched and single solves round differently; ten steps amplify that.
                torch.testing.assert_close(expected, out, rtol=1e-9, atol=1e-12)
                x = out
        assert int(states.num_nonfinite[member]) == int(state.num_nonfinite)
        assert int(states.num_mixed[member]) == int(state.num_mixed)
    assert states.num_nonfinite.tolist() == [2, 0]


# -- determinism -------------------------------------------------------------------------------


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(64, 5, generator=gen)
    target = torch.randn(64, 3, generator=gen)
    params = {
        "w1": 0.5 * torch.randn(5, 8, generator=gen),
        "b1": torch.zeros(8),
        "w2": 0.5 * torch.randn(8, 3, generator=gen),
    }

    def loss(p):
        hidden = torch.tanh(data @ p["w1"] + p["b1"])
        return ((hidden @ p["w2"] - target) ** 2).mean()

    return params, loss


def _run(opt: aa.Anderson, steps: int, *, inplace: bool, safeguard_every: int = 3):
    params, loss = _problem()
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    outputs = []
    for k in range(1, steps + 1):
        grads = torch.func.grad(loss)(params)
        loss_fn = loss if k % safeguard_every == 0 else None
        params, state = opt.update(state, params, grads, inplace=inplace, loss_fn=loss_fn)
        outputs.append({key: v.clone() for key, v in params.items()})
    return outputs, state


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("inplace", [False, True])
def test_two_fresh_runs_are_bit_identical(mode: str, inplace: bool):
    runs = [
        _run(
            aa.anderson(adam(0.05), history_depth=5, relaxation=0.5, mode=mode), 50, inplace=inplace
        )
        for _ in range(2)
    ]
    (out_a, state_a), (out_b, state_b) = runs
    assert int(state_a.num_mixed) > 10  # the runs did mix
    _assert_bitwise(out_a, out_b)
    _assert_bitwise(state_a, state_b)


# -- checkpoints -------------------------------------------------------------------------------


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "options, inner",
    [
        ({}, "adam"),
        ({"mode": "classic"}, "adam"),
        ({"history_dtype": torch.bfloat16, "relaxation": 0.5}, "sgd"),
        ({"store_each_nth": 2, "frequency": 3, "wait_iterations": 4}, "sgd"),
    ],
    ids=["aadl-adam", "classic-adam", "bf16-sgd", "gates-sgd"],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_checkpoint_round_trip_continues_bit_identically(options, inner, inplace):
    """torch.save / torch.load(weights_only=True) of the state (and params) mid-run, then both
    the uninterrupted run and the resumed one continue: they agree bit for bit."""
    make_inner = (lambda: adam(0.05)) if inner == "adam" else (lambda: sgd(0.1, momentum=0.9))
    opt = aa.anderson(make_inner(), history_depth=4, **options)
    params, loss = _problem()
    state = opt.init(params)
    for k in range(1, 11):
        loss_fn = loss if k % 4 == 0 else None
        params, state = opt.update(
            state, params, torch.func.grad(loss)(params), inplace=inplace, loss_fn=loss_fn
        )
    saved_state, saved_params = _save_load((state, params))
    assert isinstance(saved_state, aa.AndersonState)
    assert isinstance(saved_state.inner_state, AdamState if inner == "adam" else SgdState)
    _assert_bitwise(saved_state, state)

    def continue_run(state, params):
        outs = []
        for k in range(11, 23):
            loss_fn = loss if k % 4 == 0 else None
            params, state = opt.update(
                state, params, torch.func.grad(loss)(params), inplace=inplace, loss_fn=loss_fn
            )
            outs.append({key: v.clone() for key, v in params.items()})
        return outs, state

    # Read before continuing: an in-place run updates the state it is given in place.
    mixed_at_save = int(saved_state.num_mixed)
    resumed = continue_run(saved_state, saved_params)
    uninterrupted = continue_run(state, params)
    assert int(uninterrupted[1].num_mixed) > mixed_at_save
    _assert_bitwise(resumed, uninterrupted)


@pytest.mark.parametrize(
    "saved_with, loaded_with, params_change, error, excerpt",
    [
        ({"history_depth": 5}, {"history_depth": 6}, None, ValueError, "`state` holds 4"),
        ({"history_depth": 5}, {"history_depth": 4}, None, ValueError, "`state` holds 4"),
        ({"history_dtype": torch.bfloat16}, {}, None, TypeError, r"`state.residuals\[0\]\['b1'\]`"),
        ({}, {"history_dtype": torch.float16}, None, TypeError, r"`state.residuals\[0\]\['b1'\]`"),
        (
            {"history_depth": 5},
            {"mode": "classic", "history_depth": 4},
            None,
            ValueError,
            "`state` has no anchor or lacks 4 iterate differences",
        ),
        (
            {"mode": "classic", "history_depth": 4},
            {"history_depth": 5},
            None,
            ValueError,
            "`state` has no anchor or holds iterate differences",
        ),
        ({}, {}, "drop", ValueError, "`params` has a different pytree structure"),
        ({}, {}, "transpose", ValueError, r"`params\['w2'\]` has shape"),
        ({}, {}, "double", TypeError, r"`params\['b1'\]` has dtype torch.float64"),
    ],
)
def test_loading_a_state_saved_with_other_options_raises(
    saved_with, loaded_with, params_change, error, excerpt
):
    params, loss = _problem()
    saver = aa.anderson(sgd(0.1, momentum=0.9), **saved_with)
    state = saver.init(params)
    for _ in range(5):
        params, state = saver.update(state, params, torch.func.grad(loss)(params))
    loaded = _save_load(state)
    if params_change == "drop":
        params = {k: v for k, v in params.items() if k != "b1"}
    elif params_change == "transpose":
        params = {**params, "w2": params["w2"].T.contiguous()}
    elif params_change == "double":
        params = {k: v.double() for k, v in params.items()}
    grads = {k: torch.zeros_like(v) for k, v in params.items()}
    before = [t.clone() for t in _tensors(loaded)]
    loader = aa.anderson(sgd(0.1, momentum=0.9), **loaded_with)
    with pytest.raises(error, match=excerpt):
        loader.update(loaded, params, grads, inplace=True)
    for t, b in zip(_tensors(loaded), before):
        assert torch.equal(t, b)


class _Scripted:
    """Inner optimizer returning a fixed sequence of updates (the step does not see grads)."""

    def __init__(self, updates):
        self.updates = list(updates)

    def init(self, params):
        return torch.zeros((), dtype=torch.int64)

    def update(self, grads, state, params=None, inplace=False):
        return self.updates[int(state)].clone(), state + 1


def test_fp16_mix_overflowing_param_dtype_falls_back():
    """The mix is formed in float32 for fp16 params: here it is finite in float32 but beyond
    fp16's 65504, so casting it would give Inf. The plain step must be returned instead."""
    half = torch.float16
    steps = [torch.tensor([v], dtype=half) for v in (0.0, 40000.0, 60000.0)]
    opt = aa.anderson(_Scripted(steps), history_depth=3)
    w = torch.tensor([0.0], dtype=half)
    state = opt.init(w)
    outs = []
    for _ in range(3):
        out, state = opt.update(state, w, torch.zeros_like(w))
        outs.append(out)
    # Window 0, 40000, 60000 (all fp16-representable): the extrapolation, 80000, is not.
    x = np.array([0.0, 40000.0, 60000.0])
    dx = np.diff(x)
    gamma = dx[-1] / (dx[1] - dx[0])
    assert abs(x[-2] + dx[-1] - (dx[0] + (dx[1] - dx[0])) * gamma) > 65504
    assert torch.isfinite(outs[-1]).all()
    assert torch.equal(outs[-1], w + steps[-1])
    assert int(state.num_nonfinite) == 1 and int(state.num_mixed) == 0

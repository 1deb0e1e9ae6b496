"""The ``loss_fn`` safeguard of ``anderson(...).update`` against a float64 NumPy reference.

The reference is ``references.Recurrence``, written from spec.md's numbered rules and
background.md's formulas, with an explicit list window and ``numpy.linalg.lstsq``; it imports
nothing from aadl_func.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from references import Recurrence

import aadl_func as aa
from aadl_func import sgd

# -- reference -------------------------------------------------------------------------------


def np_run(x0, grad, lr, steps, loss, *, depth, relaxation=1.0, reg=0.0, wait=0, store=1, freq=1):
    """The steps of the ``anderson`` docstring (``references.Recurrence``, gradient descent
    inner step); returns (params after each call, decision per call, final window)."""
    reference = Recurrence(
        grad,
        lr,
        history_depth=depth,
        relaxation=relaxation,
        reg=reg,
        wait_iterations=wait,
        store_each_nth=store,
        frequency=freq,
    )
    trajectory, decisions = reference.run(x0, steps, loss)
    return trajectory, decisions, reference.window


def window_entries(state: aa.AndersonState) -> list[np.ndarray]:
    """The window of a mode-"aadl" state, oldest first: x_i = anchor - sum_{j >= i} d_j."""
    k = int(state.window_size)
    q = len(state.residuals)
    head = int(state.head)
    anchor = state.anchor.detach().double().numpy()
    order = [(head - t) % q for t in range(k - 1)]  # newest difference first
    entries = [anchor]
    for slot in order:
        entries.append(entries[-1] - state.residuals[slot].detach().double().numpy())
    return entries[::-1]


def quadratic(n: int, seed: int, condition: float = 50.0):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    A = q @ np.diag(np.geomspace(1.0, condition, n)) @ q.T
    b = rng.standard_normal(n)
    return A, b


# -- tests -----------------------------------------------------------------------------------

CONFIGS = [
    dict(depth=5, relaxation=1.0, sign=1.0),
    dict(depth=4, relaxation=0.5, sign=1.0, store=2, freq=2),
    dict(depth=6, relaxation=1.7, sign=1.0, wait=3, reg=1e-6),
    # A loss that prefers points far from the minimiser: mixes that help are rejected.
    dict(depth=5, relaxation=1.0, sign=-1.0),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_safeguard_matches_reference(config):
    config = dict(config)
    sign = config.pop("sign")
    n, lr, steps = 12, 0.015, 24
    A, b = quadratic(n, seed=3)

    def np_loss(x):
        return sign * (0.5 * x @ A @ x - b @ x)

    expected, decisions, window = np_run(
        np.zeros(n), lambda x: A @ x - b, lr, steps, np_loss, **config
    )
    assert "rejected" in decisions or sign > 0
    assert "mix" in decisions or sign < 0

    At, bt = torch.tensor(A), torch.tensor(b)
    opt = aa.anderson(
        sgd(lr),
        history_depth=config["depth"],
        relaxation=config["relaxation"],
        reg=config.get("reg", 0.0),
        wait_iterations=config.get("wait", 0),
        store_each_nth=config.get("store", 1),
        frequency=config.get("freq", 1),
    )
    x = torch.zeros(n, dtype=torch.float64)
    state = opt.init(x)
    for k in range(steps):
        before = (int(state.num_mixed), int(state.num_rejected))
        x, state = opt.update(
            state, x, At @ x - bt, loss_fn=lambda p: sign * (0.5 * p @ At @ p - bt @ p)
        )
        got = {
            (1, 0): "mix",
            (0, 1): "rejected",
            (0, 0): "plain",
        }[(int(state.num_mixed) - before[0], int(state.num_rejected) - before[1])]
        assert got == decisions[k], f"call {k + 1}"
        np.testing.assert_allclose(x.numpy(), expected[k], rtol=1e-9, atol=1e-11)
    assert int(state.num_mixed) == decisions.count("mix")
    assert int(state.num_rejected) == decisions.count("rejected")
    assert int(state.num_nonfinite) == 0
    # "x replaces the newest window entry": the whole window, rebuilt from the state.
    entries = window_entries(state)
    assert len(entries) == len(window)
    np.testing.assert_allclose(np.stack(entries), np.stack(window), rtol=1e-9, atol=1e-11)


def test_accepted_mix_replaces_newest_entry():
    """Right after an accepted mix the newest window entry is exactly the returned params."""
    n, lr = 10, 0.02
    A, b = quadratic(n, seed=5)
    At, bt = torch.tensor(A), torch.tensor(b)
    opt = aa.anderson(sgd(lr), history_depth=4)
    x = torch.zeros(n, dtype=torch.float64)
    state = opt.init(x)
    accepted = 0
    for _ in range(8):
        mixed = int(state.num_mixed)
        x_prev_window = window_entries(state) if int(state.window_size) else []
        x, state = opt.update(state, x, At @ x - bt, loss_fn=lambda p: 0.5 * p @ At @ p - bt @ p)
        entries = window_entries(state)
        np.testing.assert_array_equal(entries[-1], state.anchor.numpy())
        if int(state.num_mixed) > mixed:
            accepted += 1
            np.testing.assert_allclose(entries[-1], x.numpy(), rtol=1e-14, atol=1e-14)
            # The older entries are untouched.
            kept = x_prev_window[-(len(entries) - 1) :]
            np.testing.assert_allclose(np.stack(entries[:-1]), np.stack(kept), rtol=1e-12)
    assert accepted >= 3


def test_vmap_matches_loop_with_different_decisions():
    """An ensemble whose members accept and reject on different calls: vmap == a loop."""
    n, lr, steps, members = 8, 0.02, 12, 3
    problems = [quadratic(n, seed=10 + i) for i in range(members)]
    A = torch.tensor(np.stack([p[0] for p in problems]))
    b = torch.tensor(np.stack([p[1] for p in problems]))
    signs = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    opt = aa.anderson(sgd(lr), history_depth=4, relaxation=0.9)

    def step(state, x, A, b, sign):
        loss_fn = lambda p: sign * (0.5 * p @ A @ p - b @ p)
        return opt.update(state, x, A @ x - b, loss_fn=loss_fn)

    x = torch.zeros(members, n, dtype=torch.float64)
    state = torch.func.vmap(opt.init)(x)
    batched = []
    for _ in range(steps):
        x, state = torch.func.vmap(step)(state, x, A, b, signs)
        batched.append((x.clone(), state.num_mixed.clone(), state.num_rejected.clone()))

    decisions = []
    for i in range(members):
        xi = torch.zeros(n, dtype=torch.float64)
        si = opt.init(xi)
        history = []
        for k in range(steps):
            xi, si = step(si, xi, A[i], b[i], signs[i])
            bx, bm, br = batched[k]
            torch.testing.assert_close(bx[i], xi, rtol=1e-10, atol=1e-12)
            assert int(bm[i]) == int(si.num_mixed) and int(br[i]) == int(si.num_rejected)
            history.append((int(si.num_mixed), int(si.num_rejected)))
        decisions.append(history)
    assert len({tuple(h) for h in decisions}) > 1, "members should decide differently"
    assert any(r > 0 for _, r in decisions[1]) and any(m > 0 for m, _ in decisions[0])


def test_nan_loss_at_mix_returns_plain_step_and_state_stays_usable():
    """loss_fn is NaN outside a box the mixes leave: y is returned; later calls are normal."""
    n, lr, steps = 10, 0.015, 16
    A, b = quadratic(n, seed=7)
    At, bt = torch.tensor(A), torch.tensor(b)
    relaxation = 3.0  # over-relaxed mixes overshoot far beyond the plain steps
    opt = aa.anderson(sgd(lr), history_depth=5, relaxation=relaxation)

    box = 0.4

    def np_loss_box(x):
        return np.nan if np.max(np.abs(x)) > box else 0.5 * x @ A @ x - b @ x

    def loss_box(p):
        value = 0.5 * p @ At @ p - bt @ p
        return torch.where(p.abs().max() > box, torch.full_like(value, math.nan), value)

    expected, decisions, _ = np_run(
        np.zeros(n), lambda x: A @ x - b, lr, steps, np_loss_box, depth=5, relaxation=relaxation
    )
    assert "rejected" in decisions
    x = torch.zeros(n, dtype=torch.float64)
    state = opt.init(x)
    for k in range(steps):
        plain = x - lr * (At @ x - bt)
        rejected = int(state.num_rejected)
        x, state = opt.update(state, x, At @ x - bt, loss_fn=loss_box)
        if int(state.num_rejected) > rejected:
            assert torch.equal(x, plain)
        np.testing.assert_allclose(x.numpy(), expected[k], rtol=1e-9, atol=1e-11)
    assert int(state.num_rejected) == decisions.count("rejected")
    assert torch.isfinite(state.gram).all()


def test_nan_loss_everywhere_then_recovers():
    """A loss_fn that is NaN everywhere rejects every mix; the window keeps the plain steps,
    and a later sane loss_fn continues exactly like the reference with the same window."""
    n, lr = 10, 0.015
    A, b = quadratic(n, seed=8)
    At, bt = torch.tensor(A), torch.tensor(b)
    opt = aa.anderson(sgd(lr), history_depth=5)
    steps_nan, steps_ok = 8, 10

    # Reference: NaN losses for the first calls, then the quadratic (the gradient is evaluated
    # once per call, first: it counts the calls).
    calls = {"k": 0}

    def np_grad(x):
        calls["k"] += 1
        return A @ x - b

    def np_loss(x):
        return np.nan if calls["k"] <= steps_nan else 0.5 * x @ A @ x - b @ x

    expected, _, _ = np_run(np.zeros(n), np_grad, lr, steps_nan + steps_ok, np_loss, depth=5)

    x = torch.zeros(n, dtype=torch.float64)
    state = opt.init(x)
    for _ in range(steps_nan):
        plain = x - lr * (At @ x - bt)
        x, state = opt.update(
            state, x, At @ x - bt, loss_fn=lambda p: torch.tensor(math.nan, dtype=p.dtype)
        )
        assert torch.equal(x, plain)
    assert int(state.num_rejected) == steps_nan - 2 and int(state.num_mixed) == 0
    for k in range(steps_ok):
        x, state = opt.update(state, x, At @ x - bt, loss_fn=lambda p: 0.5 * p @ At @ p - bt @ p)
        np.testing.assert_allclose(x.numpy(), expected[steps_nan + k], rtol=1e-9, atol=1e-11)
    assert int(state.num_mixed) > 0


class _AffineMap:
    """Inner step ``y = x + c - (1 - r) x``: fixed point ``c / (1 - r)``, beyond float32."""

    def __init__(self, c: float, r: float):
        self.c, self.r = c, r

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return self.c - (1.0 - self.r) * params, state


@pytest.mark.parametrize("with_loss", [False, True])
def test_overflowing_float32_mix_is_never_returned(with_loss):
    """The window extrapolates to 1e41, which overflows float32: the mix is discarded (counted
    in num_nonfinite, never shown to loss_fn), y is returned, and the state stays finite."""
    c, r = 1e36, 1.0 - 1e-5
    opt = aa.anderson(_AffineMap(c, r), history_depth=4)
    x = torch.zeros(3, dtype=torch.float32)
    state = opt.init(x)
    seen = []

    def loss_fn(p):
        seen.append(p.clone())
        return p.double().square().sum()

    for k in range(1, 7):
        plain = x + (c - (1.0 - r) * x)
        x, state = opt.update(state, x, torch.zeros_like(x), loss_fn=loss_fn if with_loss else None)
        assert torch.equal(x, plain)
        assert torch.isfinite(x).all()
        assert int(state.num_nonfinite) == max(0, k - 2)
    assert int(state.num_mixed) == 0 and int(state.num_rejected) == 0
    assert seen == []
    assert torch.isfinite(state.gram).all() and torch.isfinite(state.anchor).all()
    # The state keeps working with a map whose mixes are representable again.
    opt2 = aa.anderson(_AffineMap(1.0, 0.5), history_depth=4)
    for _ in range(3):
        x, state = opt2.update(state, x, torch.zeros_like(x))
    assert torch.isfinite(x).all() and int(state.num_mixed) >= 1


def test_pure_step_after_accepted_mix_then_inplace():
    """An accepted mix with inplace=False must not hand out the window's own buffers: a
    following inplace=True step (which writes into the params it is given) must give the same
    trajectory as pure steps."""
    n, lr = 8, 0.05
    A, b = quadratic(n, seed=0, condition=10.0)
    At, bt = torch.tensor(A), torch.tensor(b)
    opt = aa.anderson(sgd(lr), history_depth=4, relaxation=0.7)
    loss_fn = lambda p: 0.5 * p @ At @ p - bt @ p

    def run(flags):
        x = torch.zeros(n, dtype=torch.float64)
        state = opt.init(x)
        out = []
        for inplace in flags:
            x, state = opt.update(state, x, At @ x - bt, inplace=inplace, loss_fn=loss_fn)
            out.append(x.clone())
        return out, state

    pure, s_pure = run([False] * 10)
    mixed, s_mixed = run([False, True] * 5)
    assert int(s_pure.num_mixed) >= 3
    for a, b_ in zip(pure, mixed):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-14)
    assert int(s_pure.num_mixed) == int(s_mixed.num_mixed)


def test_loss_fn_not_called_when_no_mix():
    calls = []
    opt = aa.anderson(sgd(0.1), history_depth=3, wait_iterations=4)
    x = torch.ones(4, dtype=torch.float64)
    state = opt.init(x)
    for _ in range(4):
        x, state = opt.update(state, x, x.clone(), loss_fn=lambda p: calls.append(1) or p.sum())
    assert calls == []
    x, state = opt.update(state, x, x.clone(), loss_fn=lambda p: calls.append(1) or p.sum())
    assert len(calls) == 2

"""aa.adasam against a NumPy float64 transcription of the paper's equations.

Wei, Bao and Liu, "Stochastic Anderson Mixing for Nonconvex Stochastic Optimization" (NeurIPS
2021): moving averages of the differences, delta = c ||r||^2 / (||dx||^2 + eps),
Gamma = (R^T R + delta X^T X)^+ R^T r, p = beta r - alpha (X + beta R) Gamma, and the step p
only if <p, r> > mu beta ||r||^2, else beta r. The reference below is written from those
equations on flat vectors with explicit matrices, independently of the module's ring buffers
and pytrees.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch.func import vmap
from untouched import assert_untouched, snapshot

import aadl_func as aa


class NumpyAdaSAM:
    """The paper's iteration on a flat float64 vector; ``X``, ``R``: lists of columns,
    newest last, at most ``m``."""

    def __init__(self, lr, alpha=1.0, m=10, damp=1e-2, gamma=0.9, mu=0.0, eps=1e-8, wd=0.0):
        self.beta, self.alpha, self.m, self.c = lr, alpha, m, damp
        self.gamma, self.mu, self.eps, self.wd = gamma, mu, eps, wd
        self.k = 0
        self.X, self.R = [], []
        self.mixed = self.fallback = 0

    def step(self, x, g):
        r = -(g + self.wd * x)
        if self.k == 0:
            self.dx = np.zeros_like(x)
            self.dr = np.zeros_like(x)
            new = x + self.beta * r
        else:
            self.dx = self.gamma * self.dx + (1 - self.gamma) * (x - self.x_prev)
            self.dr = self.gamma * self.dr + (1 - self.gamma) * (r - self.r_prev)
            self.X = (self.X + [self.dx])[-self.m :]
            self.R = (self.R + [self.dr])[-self.m :]
            X, R = np.stack(self.X, axis=1), np.stack(self.R, axis=1)
            delta = self.c * (r @ r) / (self.dx @ self.dx + self.eps)
            Gamma = np.linalg.pinv(R.T @ R + delta * X.T @ X) @ (R.T @ r)
            p = self.beta * r - self.alpha * (X + self.beta * R) @ Gamma
            if p @ r > self.mu * self.beta * (r @ r):
                new = x + p
                self.mixed += 1
            else:
                new = x + self.beta * r
                self.fallback += 1
        self.x_prev, self.r_prev = x, r
        self.k += 1
        return new


def _flat(tree):
    return torch.cat([tree["w"].reshape(-1), tree["b"].reshape(-1)]).numpy()


def _tree(v):
    t = torch.tensor(v)
    return {"w": t[:6].reshape(2, 3).clone(), "b": t[6:].clone()}


def _run_both(grad_of, steps, x0, **options):
    """Both implementations from ``x0`` (8 numbers as a two-leaf pytree), ``grad_of(k, x)``
    giving the gradient; returns the two trajectories and the final state."""
    ref = NumpyAdaSAM(
        options.get("lr", 1.0),
        options.get("alpha", 1.0),
        options.get("history_depth", 10),
        options.get("damp", 1e-2),
        options.get("gamma", 0.9),
        options.get("mu", 0.0),
        wd=options.get("weight_decay", 0.0),
    )
    opt = aa.adasam(**options)
    params = _tree(x0)
    state = opt.init(params)
    x = np.array(x0, dtype=np.float64)
    ours, theirs = [], []
    for k in range(steps):
        g = grad_of(k, x)
        x = ref.step(x, g)
        params, state = opt.update(state, params, _tree(g))
        theirs.append(x.copy())
        ours.append(_flat(params))
        assert np.allclose(_flat(params), x, rtol=1e-8, atol=1e-9), f"step {k}"
    return ours, theirs, state, ref


def test_quadratic_matches_the_equations():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 8))
    A = q @ q.T / 8 + 0.1 * np.eye(8)
    b = rng.standard_normal(8)
    x0 = rng.standard_normal(8)
    _, theirs, state, ref = _run_both(lambda k, x: A @ x - b, 25, x0, lr=0.3, history_depth=4)
    assert ref.mixed > 0 and int(state.num_mixed) == ref.mixed
    assert int(state.num_fallback) == ref.fallback and int(state.count) == 25
    # And it converges: far below where 25 plain steps of the same length get.
    x_star, plain = np.linalg.solve(A, b), x0
    for _ in range(25):
        plain = plain - 0.3 * (A @ plain - b)
    assert np.linalg.norm(theirs[-1] - x_star) < 1e-2 * np.linalg.norm(plain - x_star)


@pytest.mark.parametrize(
    "options",
    [
        dict(lr=0.5),
        dict(lr=0.2, alpha=1.5, history_depth=3, damp=0.1, gamma=0.0, weight_decay=0.01),
        dict(lr=0.1, history_depth=2, gamma=0.5, mu=0.1),
    ],
)
def test_random_problem_matches_the_equations(options):
    """Noisy gradients of a random nonconvex function: many steps fail the descent check, and
    the two implementations agree on which."""
    rng = np.random.default_rng(1)
    W = rng.standard_normal((8, 8))
    noise = rng.standard_normal((30, 8))

    def grad_of(k, x):  # f(x) = sum(log cosh(W x)) + |x|^2 / 10, plus noise
        return W.T @ np.tanh(W @ x) + x / 5 + 0.5 * noise[k]

    _, _, state, ref = _run_both(grad_of, 30, rng.standard_normal(8), **options)
    assert int(state.num_mixed) == ref.mixed and int(state.num_fallback) == ref.fallback
    assert ref.mixed + ref.fallback == 29 and ref.mixed > 0 and ref.fallback > 0


def test_descent_check_falls_back_to_the_plain_step():
    """One dimension, a window whose secant says 'the residual grows along dx' (negative
    curvature): Gamma ~ 1 and p = r - (dx + dr) Gamma < 0 along r, so the check fails and the
    step is exactly lr * r."""
    opt = aa.adasam(1.0, history_depth=1, damp=1e-12, gamma=0.0)
    params = {"x": torch.tensor([0.0], dtype=torch.float64)}
    state = opt.init(params)
    # Two calls to fill the window: x0 = 0, g0 = -1 (r0 = 1) -> x1 = 1; g1 = -2 (r1 = 2):
    # dx = 1, dr = 1, so Gamma = (dr r1) / (dr^2 + delta dx^2) ~ 2, p = 2 - 2 * 2 < 0.
    params, state = opt.update(state, params, {"x": torch.tensor([-1.0], dtype=torch.float64)})
    assert params["x"].item() == 1.0
    params, state = opt.update(state, params, {"x": torch.tensor([-2.0], dtype=torch.float64)})
    assert params["x"].item() == 3.0  # x1 + lr * r1, the plain step
    assert int(state.num_fallback) == 1 and int(state.num_mixed) == 0
    # With the opposite curvature the mix is taken: g2 = -1 (r2 = 1): dx = 2, dr = -1,
    # Gamma = (-1 * 1) / 1 ~ -1, p = 1 + (2 - 1) = 2 > 0 -> x3 = 5 (the secant's root of r).
    params, state = opt.update(state, params, {"x": torch.tensor([-1.0], dtype=torch.float64)})
    assert params["x"].item() == pytest.approx(5.0, rel=1e-9)
    assert int(state.num_mixed) == 1


def test_pure_vmap_and_save():
    opt = aa.adasam(0.1, history_depth=3)
    rng = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, 2, generator=rng), "b": torch.randn(4, 2, generator=rng)}
    grads = [{k: torch.randn(v.shape, generator=rng) for k, v in params.items()} for _ in range(5)]
    states = vmap(opt.init)(params)
    batched = params
    for g in grads:
        batched, states = vmap(opt.update)(states, batched, g)
    for member in range(4):
        p = {k: v[member] for k, v in params.items()}
        s = opt.init(p)
        before = {k: v.clone() for k, v in p.items()}
        for g in grads:
            new, s = opt.update(s, p, {k: v[member] for k, v in g.items()})
            assert all(torch.equal(p[k], before[k]) for k in p)  # inputs are not mutated
            p, before = new, {k: v.clone() for k, v in new.items()}
        for k in p:
            torch.testing.assert_close(batched[k][member], p[k], rtol=1e-5, atol=1e-6)
        assert int(states.num_mixed[member]) == int(s.num_mixed)
    buffer = io.BytesIO()
    torch.save(s, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded, aa.AdaSAMState)
    a, _ = opt.update(s, p, {k: v[3] for k, v in grads[0].items()})
    b, _ = opt.update(loaded, p, {k: v[3] for k, v in grads[0].items()})
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(lr=0.0), ValueError, "lr"),
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(lr="1"), TypeError, "lr"),
        (dict(alpha=-0.1), ValueError, "alpha"),
        (dict(history_depth=0), ValueError, "history_depth"),
        (dict(history_depth=2.0), TypeError, "history_depth"),
        (dict(damp=-1.0), ValueError, "damp"),
        (dict(gamma=1.0), ValueError, "gamma"),
        (dict(gamma=-0.5), ValueError, "gamma"),
        (dict(mu=float("nan")), ValueError, "mu"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(weight_decay=-1e-4), ValueError, "weight_decay"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, name):
    with pytest.raises(error, match=f"`{name}`"):
        aa.adasam(**kwargs)


def test_bad_update_inputs_name_themselves_and_change_nothing():
    opt = aa.adasam(0.1, history_depth=3)
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"`grads\['w'\]` has shape \(4,\), expected \(3,\)"):
        opt.update(state, params, {"w": torch.ones(4)})
    with pytest.raises(TypeError, match="`state`"):
        opt.update((), params, {"w": torch.ones(3)})
    other = aa.adasam(0.1, history_depth=4).init(params)
    with pytest.raises(ValueError, match="`state.dxs`"):
        opt.update(other, params, {"w": torch.ones(3)})
    with pytest.raises(TypeError, match="`params`"):
        opt.init({"w": torch.ones(3, dtype=torch.int64)})
    assert int(state.count) == 0 and torch.equal(params["w"], torch.ones(3))


def _two_leaves(dtype=torch.float32):
    return {"b": torch.linspace(0.0, 1.0, 3, dtype=dtype), "w": torch.ones(2, 3, dtype=dtype)}


def _state(dtype=torch.float32):
    """A state after two updates (its rings hold a column) for `_two_leaves(dtype)`."""
    opt, params = aa.adasam(0.1, history_depth=3), _two_leaves(dtype)
    state = opt.init(params)
    for k in range(2):
        params, state = opt.update(state, params, {n: (k + 1) * v for n, v in params.items()})
    return state


_BAD_UPDATES = {
    # grads of another structure: a list, or a dict with other keys (once matched by position)
    "grads-list": (
        lambda: (_state(), _two_leaves(), list(_two_leaves().values())),
        ValueError,
        r"`grads` has a different pytree structure from `params`: `grads` is a list of 2",
    ),
    "grads-keys": (
        lambda: (_state(), _two_leaves(), {"x": torch.ones(3), "y": torch.ones(2, 3)}),
        ValueError,
        r"`grads` has a different pytree structure .* keys \['x', 'y'\]",
    ),
    # grads of another dtype: once returned float64 params and a mixed-dtype state
    "grads-dtype": (
        lambda: (_state(), _two_leaves(), _two_leaves(torch.float64)),
        TypeError,
        r"`grads\['b'\]` has dtype torch.float64, expected torch.float32 like `params\['b'\]`",
    ),
    # a state made for float64 params, given float32 ones
    "state-dtype": (
        lambda: (_state(torch.float64), _two_leaves(), _two_leaves()),
        TypeError,
        r"`state.prev_params` has a leaf of dtype torch.float64, expected torch.float32",
    ),
    # a state made for other params (another key)
    "state-structure": (
        lambda: (_state(), {"a": torch.ones(3), "w": torch.ones(2, 3)}, _two_leaves()),
        ValueError,
        r"`grads` has a different pytree structure",
    ),
    "state-keys": (
        lambda: (_state(), *[{"a": torch.ones(3), "w": torch.ones(2, 3)}] * 2),
        ValueError,
        r"`state.prev_params` does not fit `params` \(another model\?\): `state.prev_params` "
        r"is a dict with keys \['b', 'w'\]",
    ),
    # counters that are not 0-d int64 tensors
    "count-float": (
        lambda: (_state()._replace(count=2.0), _two_leaves(), _two_leaves()),
        TypeError,
        r"`state.count` must be a 0-d int64 tensor, got float",
    ),
    "count-float-tensor": (
        lambda: (_state()._replace(count=torch.tensor(2.0)), _two_leaves(), _two_leaves()),
        TypeError,
        r"`state.count` must be a 0-d int64 tensor, got a torch.float32 tensor",
    ),
    "num_mixed-shape": (
        lambda: (
            (_state()._replace(num_mixed=torch.zeros(1, dtype=torch.int64)),)
            + (_two_leaves(), _two_leaves())
        ),
        TypeError,
        r"`state.num_mixed` must be a 0-d int64 tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_UPDATES))
def test_update_refuses_what_does_not_fit_the_params_and_changes_nothing(case):
    """Grads and states are compared with the params by pytree structure (not leaf by leaf
    in order), shape and dtype, and the counters by type, before anything is computed."""
    make, error, match = _BAD_UPDATES[case]
    state, params, grads = make()
    taken = snapshot(state, params, grads)
    with pytest.raises(error, match=r"^adasam: .*" + match):
        aa.adasam(0.1, history_depth=3).update(state, params, grads)
    assert_untouched(taken)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_takes_the_plain_step_and_raises_nothing(first, bad):
    """A NaN or infinite gradient, on the first call or once the window mixes, never reaches
    the pseudo-inverse (whose eigensolver raised on it): the call returns the plain step
    x + lr r, carrying the NaN as SGD would, and counts it as a fallback after the first
    call. The mixing then never makes finite params non-finite: from the returned state
    and finite inputs the calls take finite plain steps."""
    opt = aa.adasam(0.1, history_depth=3)
    params = {"w": torch.linspace(1.0, 2.0, 4)}
    state = opt.init(params)
    if not first:
        for _ in range(4):
            params, state = opt.update(state, params, {"w": params["w"] - 3.0})
        assert int(state.num_mixed) > 0
    grads = {"w": torch.tensor([bad, 1.0, 1.0, 1.0])}
    taken = snapshot(state, params)
    out, new_state = opt.update(state, params, grads)
    assert_untouched(taken)
    expected = params["w"] - 0.1 * grads["w"]
    torch.testing.assert_close(out["w"], expected, equal_nan=True, rtol=0, atol=0)
    assert int(new_state.num_mixed) == int(state.num_mixed)
    assert int(new_state.num_fallback) == int(state.num_fallback) + (not first)
    x = params
    for _ in range(3):
        g = {"w": x["w"] - 3.0}
        new, new_state = opt.update(new_state, x, g)
        torch.testing.assert_close(new["w"], x["w"] - 0.1 * g["w"], rtol=0, atol=0)
        assert torch.isfinite(new["w"]).all()
        x = new


def test_non_finite_params_and_an_overflowing_system_take_the_plain_step():
    """NaN params (with weight decay, the residual r = -(g + lambda x) is NaN too), and
    finite float64 params so large that the float64 system overflows, take the plain step
    instead of raising torch._C._LinAlgError."""
    opt = aa.adasam(0.5, history_depth=3, weight_decay=0.5)
    params = {"w": torch.tensor([float("nan"), 1.0, 2.0, 3.0])}
    out, state = opt.update(opt.init(params), params, {"w": torch.ones(4)})
    assert torch.isnan(out["w"][0])
    assert torch.equal(out["w"][1:], params["w"][1:] - 0.5 * (1.0 + 0.5 * params["w"][1:]))
    opt = aa.adasam(0.5, history_depth=3)
    x = {"w": torch.full((3,), 1e200, dtype=torch.float64)}
    state = opt.init(x)
    for _ in range(3):
        new, state = opt.update(state, x, {"w": x["w"]})
        assert torch.equal(new["w"], 0.5 * x["w"])
        x = new
    assert int(state.num_mixed) == 0


def test_a_non_finite_member_of_a_vmap_ensemble_leaves_the_others_alone():
    """Under vmap the finiteness test is a mask per member: a NaN in one member's grads
    gives that member the plain step and the other exactly what it gets without it."""
    opt = aa.adasam(0.1, history_depth=3)
    rng = torch.Generator().manual_seed(3)
    target = torch.randn(2, 5, generator=rng)
    params = {"w": torch.randn(2, 5, generator=rng)}
    states = vmap(opt.init)(params)
    for _ in range(3):
        params, states = vmap(opt.update)(states, params, {"w": (params["w"] - target) ** 3})
    assert bool((states.num_mixed > 0).all())
    grads = {"w": (params["w"] - target) ** 3}
    finite, _ = vmap(opt.update)(states, params, grads)
    grads["w"][1, 0] = float("nan")
    out, new_states = vmap(opt.update)(states, params, grads)
    assert torch.equal(out["w"][0], finite["w"][0])
    torch.testing.assert_close(
        out["w"][1], params["w"][1] - 0.1 * grads["w"][1], equal_nan=True, rtol=0, atol=0
    )
    assert new_states.num_fallback.tolist()[1] == states.num_fallback.tolist()[1] + 1

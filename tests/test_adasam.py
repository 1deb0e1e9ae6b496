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
    with pytest.raises(ValueError, match="`grads`"):
        opt.update(state, params, {"w": torch.ones(4)})
    with pytest.raises(TypeError, match="`state`"):
        opt.update((), params, {"w": torch.ones(3)})
    other = aa.adasam(0.1, history_depth=4).init(params)
    with pytest.raises(ValueError, match="`state.dxs`"):
        opt.update(other, params, {"w": torch.ones(3)})
    with pytest.raises(TypeError, match="`params`"):
        opt.init({"w": torch.ones(3, dtype=torch.int64)})
    assert int(state.count) == 0 and torch.equal(params["w"], torch.ones(3))

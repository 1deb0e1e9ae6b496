"""``anderson(..., mode="classic")``: textbook type-II Anderson acceleration.

The trajectories of the option sets against ``references.Recurrence`` (mode "classic") are
test_contract.py's. Here: the gates and the mix formula on given pairs, and, on a linear map,
GMRES computed independently (Saad's Arnoldi and Givens rotations): with full history and
relaxation 1, :math:`x^{AA}_{k+1} = g(x^{GMRES}_k)` (Walker & Ni, 2011).
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from conftest import GradientDescent, relative_error
from references import gmres_iterate, type2_anderson

import aadl_func as aa


def test_first_call_and_gates_return_the_plain_step():
    # One pair cannot be mixed; with wait/frequency gates the plain g(x_k) comes back.
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt = aa.anderson(GradientDescent(0.25), mode="classic", wait_iterations=3, frequency=2)
    state = opt.init(x)
    for k in range(1, 9):
        g = torch.sin(x) + x
        plain = x - 0.25 * g
        x, state = opt.update(state, x, g)
        if k <= 3 or k % 2:
            assert torch.equal(x, plain), k
        else:
            assert not torch.equal(x, plain), k
    assert int(state.num_mixed) == 3  # calls 4, 6, 8


def test_mix_formula_on_given_pairs():
    # Two pairs, by hand: alpha minimises ||a f_0 + (1 - a) f_1||, so
    # a = <f_1, f_1 - f_0> / ||f_1 - f_0||^2, and x_2 = sum_i alpha_i (x_i + beta f_i).
    x0 = np.array([1.0, 2.0, -1.0])
    f0 = np.array([-0.5, 0.25, 1.0])
    x1 = x0 + f0  # the plain step of call 1 is returned, so call 2 starts there
    f1 = np.array([0.3, -0.6, 0.2])
    a = f1 @ (f1 - f0) / np.sum((f1 - f0) ** 2)
    beta = 0.6
    expected = a * (x0 + beta * f0) + (1 - a) * (x1 + beta * f1)
    opt = aa.anderson(GradientDescent(1.0), mode="classic", relaxation=beta)
    x = torch.from_numpy(x0)
    state = opt.init(x)
    x, state = opt.update(state, x, torch.from_numpy(-f0))
    np.testing.assert_array_equal(x.numpy(), x1)
    x, state = opt.update(state, x, torch.from_numpy(-f1))
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-13)
    xs = np.stack([x0, x1], axis=1)
    np.testing.assert_allclose(
        type2_anderson(xs, xs + np.stack([f0, f1], axis=1), beta), expected, rtol=1e-13
    )


# -- GMRES equivalence ---------------------------------------------------------------------


def _linear_problem(d: int, symmetric: bool, seed: int):
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    A = q @ np.diag(np.linspace(1.0, 10.0, d)) @ q.T
    if not symmetric:
        skew = rng.standard_normal((d, d))
        A = A + 0.8 * (skew - skew.T)  # positive definite symmetric part: GMRES converges
    return A, rng.standard_normal(d), rng.standard_normal(d)


@pytest.mark.parametrize("symmetric", [True, False], ids=["spd", "nonsymmetric"])
@pytest.mark.parametrize("d", [3, 4, 6])
def test_full_history_is_gmres_equivalent(d, symmetric):
    A, b, x0 = _linear_problem(d, symmetric, seed=d + 10 * symmetric)
    lr = 0.08
    g = lambda x: x - lr * (A @ x - b)
    x_star = np.linalg.solve(A, b)
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=d + 2)
    x = torch.from_numpy(x0.copy())
    state = opt.init(x)
    for k in range(d + 1):
        # Call k + 1 sees the pairs of x_0 .. x_k and returns x^AA_{k+1} = g(x^GMRES_k).
        plain = g(x.numpy())
        x, state = opt.update(state, x, torch.from_numpy(A @ x.numpy() - b))
        expected = g(gmres_iterate(A, b, x0, k))
        assert relative_error(x.numpy(), expected) <= 1e-8, k
        if 0 < k < d:  # a real extrapolation, not the plain step
            assert relative_error(expected, plain) > 1e-6
    # GMRES is exact after d steps: x^AA_{d+1} = g(x*) = x*.
    assert relative_error(x.numpy(), x_star) <= 1e-8


def test_gmres_equivalence_on_a_pytree():
    d = 6
    A, b, x0 = _linear_problem(d, True, seed=3)
    lr = 0.08
    g = lambda x: x - lr * (A @ x - b)
    split = lambda v: {
        "head": torch.from_numpy(v[:2].copy()),
        "tail": (torch.from_numpy(v[2:].copy()),),
    }
    join = lambda t: np.concatenate([leaf.numpy() for leaf in optree.tree_leaves(t)])
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=10)
    params = split(x0)
    state = opt.init(params)
    for k in range(d + 1):
        params, state = opt.update(state, params, split(A @ join(params) - b))
        assert relative_error(join(params), g(gmres_iterate(A, b, x0, k))) <= 1e-8


def test_gmres_reference_is_sound():
    # The hand-written GMRES: residuals are monotone and it solves the system in d steps.
    A, b, x0 = _linear_problem(5, False, seed=0)
    residuals = [np.linalg.norm(b - A @ gmres_iterate(A, b, x0, k)) for k in range(6)]
    assert all(r1 <= r0 * (1 + 1e-12) for r0, r1 in zip(residuals, residuals[1:]))
    assert residuals[-1] <= 1e-10 * residuals[0]

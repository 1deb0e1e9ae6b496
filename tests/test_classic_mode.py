"""``anderson(..., mode="classic")``: textbook type-II Anderson acceleration.

The trajectories of the option sets against ``references.Recurrence`` (mode "classic") are
test_contract.py's. Here: the gates and the mix formula on given pairs, and, on a linear map,
GMRES: with full history and relaxation 1, :math:`x^{AA}_{k+1} = g(x^{GMRES}_k)` (Walker &
Ni, 2011). The theorem is checked in exact rational arithmetic (both methods by their normal
equations, over ``fractions.Fraction``: equal, not close), and the library against the
float64 reference of the same recurrence, replayed call by call within its derived rounding
bound (``references.rounding_bounds``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import optree
import pytest
import torch
from conftest import GradientDescent, relative_error
from references import Recurrence, gmres_iterate, rounding_bounds, solve_roundoff, type2_anderson

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


# -- exact rational arithmetic: the theorem itself ---------------------------------------------


def _exact(v) -> list:
    """A float64 array as exact rationals (every float is one)."""
    return [Fraction(float(e)) for e in np.asarray(v).reshape(-1)]


def _matvec(M: list, v: list) -> list:
    return [sum(m * e for m, e in zip(row, v)) for row in M]


def _least_squares(columns: list, rhs: list) -> list:
    """``argmin ||sum_j y_j c_j - rhs||`` exactly: the normal equations, by Gaussian
    elimination over the rationals (the columns are independent here)."""
    k = len(columns)
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    M = [[dot(ci, cj) for cj in columns] + [dot(ci, rhs)] for ci in columns]
    for i in range(k):
        pivot = next(r for r in range(i, k) if M[r][i] != 0)
        M[i], M[pivot] = M[pivot], M[i]
        for r in range(k):
            if r != i and M[r][i] != 0:
                factor = M[r][i] / M[i][i]
                M[r] = [a - factor * b for a, b in zip(M[r], M[i])]
    return [M[i][k] / M[i][i] for i in range(k)]


def exact_gmres(A: list, b: list, x0: list, k: int) -> list:
    """GMRES's ``x_k``: ``x_0 + V y``, ``V = [r_0, A r_0, ..., A^{k-1} r_0]``, ``y`` minimising
    ``||r_0 - A V y||`` (Saad, *Iterative Methods for Sparse Linear Systems*, 6.5)."""
    r0 = [bi - ai for bi, ai in zip(b, _matvec(A, x0))]
    basis = [r0]
    for _ in range(k - 1):
        basis.append(_matvec(A, basis[-1]))
    if k == 0:
        return x0
    y = _least_squares([_matvec(A, v) for v in basis], r0)
    return [x + sum(yj * v[i] for yj, v in zip(y, basis)) for i, x in enumerate(x0)]


def exact_anderson(g, x0: list, calls: int) -> list:
    """Type-II Anderson with full history and relaxation 1: call 1 returns ``g(x_0)``, call
    ``k + 1`` returns ``g_k - sum_j gamma_j (g_{j+1} - g_j)``, ``gamma`` minimising
    ``||f_k - sum_j gamma_j (f_{j+1} - f_j)||``, ``f_i = g(x_i) - x_i``. The outputs."""
    xs, gs, out = [x0], [g(x0)], []
    for k in range(calls):
        fs = [[gi - xi for gi, xi in zip(g_, x_)] for g_, x_ in zip(gs, xs)]
        if k == 0:
            x = gs[0]
        else:
            dF = [[a - c for a, c in zip(fs[j + 1], fs[j])] for j in range(k)]
            gamma = _least_squares(dF, fs[k])
            x = [
                gk - sum(gm * (gs[j + 1][i] - gs[j][i]) for j, gm in enumerate(gamma))
                for i, gk in enumerate(gs[k])
            ]
        out.append(x)
        xs.append(x)
        gs.append(g(x))
    return out


@pytest.mark.parametrize("symmetric", [True, False], ids=["spd", "nonsymmetric"])
@pytest.mark.parametrize("d", [3, 4, 6])
def test_anderson_is_gmres_in_exact_arithmetic(d, symmetric):
    """Walker & Ni's theorem, exactly: ``x^AA_{k+1} = g(x^GMRES_k)`` for ``k = 0 .. d``, and
    ``x^AA_{d+1} = x*`` (GMRES is exact after ``d`` steps). No tolerance: rationals."""
    A, b, x0 = _linear_problem(d, symmetric, seed=d + 10 * symmetric)
    A_, b_, x0_ = [_exact(row) for row in A], _exact(b), _exact(x0)
    lr = Fraction(0.08)
    g = lambda x: [xi - lr * (ax - bi) for xi, ax, bi in zip(x, _matvec(A_, x), b_)]  # noqa: E731
    outputs = exact_anderson(g, x0_, d + 1)
    for k in range(d + 1):
        assert outputs[k] == g(exact_gmres(A_, b_, x0_, k)), k
    assert _matvec(A_, outputs[d]) == b_
    # The float64 GMRES reference the other tests of the file use agrees with the exact one.
    for k in range(d + 1):
        exact = np.array([float(e) for e in exact_gmres(A_, b_, x0_, k)])
        assert relative_error(gmres_iterate(A, b, x0, k), exact) <= 1e-10


# -- the library: the same recurrence, to its rounding --------------------------------------


def assert_follows_anderson(A, b, x0, lr, outputs, depth) -> list[float]:
    """The library's ``outputs`` (call 1, 2, ...) against the float64 reference of type-II
    Anderson with full history (``references.Recurrence``, mode "classic"), replayed on
    them, within each call's derived rounding bound; the errors in units of the bounds."""
    grad = lambda x: A @ x - b  # noqa: E731
    reference = lambda: Recurrence(grad, lr, mode="classic", history_depth=depth)  # noqa: E731
    expected = reference().run(x0, len(outputs), inputs=outputs)[0]
    u = 2.0**-53
    bounds = rounding_bounds(reference, x0, outputs, u, solve_roundoff(len(x0), depth))
    errors = [relative_error(a, e) / bound for a, e, bound in zip(outputs, expected, bounds)]
    assert max(errors) <= 1.0, errors
    return errors


@pytest.mark.parametrize("symmetric", [True, False], ids=["spd", "nonsymmetric"])
@pytest.mark.parametrize("d", [3, 4, 6])
def test_full_history_is_gmres_equivalent(d, symmetric):
    """The library's classic mode with full history follows the exact-arithmetic recurrence
    above to each call's rounding: ``x_{k+1}`` is ``g(x^GMRES_k)``, computed in float64."""
    A, b, x0 = _linear_problem(d, symmetric, seed=d + 10 * symmetric)
    lr = 0.08
    g = lambda x: x - lr * (A @ x - b)
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=d + 2)
    x = torch.from_numpy(x0.copy())
    state = opt.init(x)
    outputs = []
    for k in range(d + 1):
        plain = g(x.numpy())
        x, state = opt.update(state, x, torch.from_numpy(A @ x.numpy() - b))
        outputs.append(x.numpy().copy())
        if 0 < k < d:  # a real extrapolation, not the plain step
            assert relative_error(g(gmres_iterate(A, b, x0, k)), plain) > 1e-6
    assert_follows_anderson(A, b, x0, lr, outputs, d + 2)


def test_gmres_equivalence_on_a_pytree():
    d = 6
    A, b, x0 = _linear_problem(d, True, seed=3)
    lr = 0.08
    split = lambda v: {
        "head": torch.from_numpy(v[:2].copy()),
        "tail": (torch.from_numpy(v[2:].copy()),),
    }
    join = lambda t: np.concatenate([leaf.numpy() for leaf in optree.tree_leaves(t)])
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=10)
    params = split(x0)
    state = opt.init(params)
    outputs = []
    for _ in range(d + 1):
        params, state = opt.update(state, params, split(A @ join(params) - b))
        outputs.append(join(params))
    assert_follows_anderson(A, b, x0, lr, outputs, 10)


def test_gmres_reference_is_sound():
    # The hand-written GMRES: residuals are monotone and it solves the system in d steps.
    A, b, x0 = _linear_problem(5, False, seed=0)
    residuals = [np.linalg.norm(b - A @ gmres_iterate(A, b, x0, k)) for k in range(6)]
    assert all(r1 <= r0 * (1 + 1e-12) for r0, r1 in zip(residuals, residuals[1:]))
    assert residuals[-1] <= 1e-10 * residuals[0]

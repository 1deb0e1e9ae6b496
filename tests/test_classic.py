"""``anderson(..., mode="classic")``: textbook type-II Anderson acceleration.

Checked against ``references.Recurrence`` (pairs of the last ``history_depth`` calls,
constraint eliminated with consecutive differences, ``lstsq``) on the logistic problem, and, on a
linear map, against GMRES computed independently (Saad's Arnoldi and Givens rotations): with full
history and relaxation 1, :math:`x^{AA}_{k+1} = g(x^{GMRES}_k)` (Walker & Ni, 2011).
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from conftest import GradientDescent, config_id, relative_error, run_problem
from references import Recurrence, gmres_iterate, type2_anderson

import aadl_func as aa

STEPS = 30

CONFIGS = [
    dict(history_depth=5),
    dict(history_depth=3, relaxation=0.5),
    dict(history_depth=6, relaxation=1.4, wait_iterations=4, frequency=2),
    dict(history_depth=8, relaxation=0.7, frequency=3),
    dict(history_depth=7, wait_iterations=6),
]


@pytest.mark.parametrize("safeguard", [False, True], ids=["plain", "safeguard"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_matches_textbook_type2(logistic, config, safeguard):
    lr = 1.0 / logistic.smoothness
    x0 = np.random.default_rng(0).standard_normal(logistic.dim)
    opt = aa.anderson(GradientDescent(lr), mode="classic", **config)
    outputs, mixed, _, state = run_problem(logistic, opt, x0, STEPS, safeguard=safeguard)
    loss = logistic.loss if safeguard else None
    expected, kinds = Recurrence(logistic.grad, lr, mode="classic", **config).run(
        x0, STEPS, loss, inputs=outputs
    )
    expected_mixed = [kind == "mix" for kind in kinds]
    assert mixed == expected_mixed and any(mixed)
    errors = [relative_error(a, b) for a, b in zip(outputs, expected)]
    assert max(errors) <= 1e-8, (int(np.argmax(errors)) + 1, max(errors))
    plain = [x - lr * logistic.grad(x) for x in [x0, *outputs[:-1]]]
    assert max(relative_error(e, p) for e, p, m in zip(expected, plain, mixed) if m) > 1e-6
    assert int(state.num_mixed) == sum(expected_mixed)
    assert int(state.window_size) == min(STEPS, config["history_depth"])


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=config_id)
def test_float32_params_match_textbook_type2(logistic, config):
    lr = 1.0 / logistic.smoothness
    x0 = np.random.default_rng(1).standard_normal(logistic.dim)
    opt = aa.anderson(GradientDescent(lr), mode="classic", **config)
    outputs, mixed, _, _ = run_problem(logistic, opt, x0, STEPS, dtype=torch.float32)
    expected, kinds = Recurrence(logistic.grad, lr, mode="classic", **config).run(
        x0, STEPS, inputs=outputs
    )
    expected_mixed = [kind == "mix" for kind in kinds]
    assert mixed == expected_mixed
    assert max(relative_error(a, b) for a, b in zip(outputs, expected)) <= 1e-4


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

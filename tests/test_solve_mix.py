"""``mix``, ``mixing_weights`` and ``solve_weights`` against independent NumPy references.

The references (``references.py``) follow background.md's formula literally and solve the
least-squares problem with ``numpy.linalg.lstsq`` (SVD); ``mix`` solves it from a float64
Householder QR factor, ``solve_weights`` from a float64 Gram matrix by an eigen-decomposition.
Tolerances are the spec's: 1e-8 relative for float64 windows, 1e-4 for float32 windows with
cond(DR) <= 1e3 (test_accuracy.py holds the float64 QR path to 1e-11).
"""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch
from references import aadl_extrapolate, aadl_gamma

import aadl_func as aa

# -- window helpers ------------------------------------------------------------------------


def stack_history(X: np.ndarray, kind: str, dtype: torch.dtype = torch.float64):
    """Turns an ``(n, k)`` window (columns oldest first) into a ``history`` pytree.

    Returns the history and a function mapping a ``mix`` output back to an ``(n,)`` vector in
    the same coordinate order, so that the NumPy reference sees exactly the same vectors.
    """
    n, k = X.shape
    rows = torch.tensor(X.T, dtype=torch.float64).to(dtype)
    if kind == "tensor":
        shape = (4, n // 4)
        history = rows.reshape(k, *shape)
        return history, lambda out: out.reshape(-1).double().numpy()
    if kind == "dict":
        history = {"a": rows[:, :6].reshape(k, 3, 2), "b": rows[:, 6:]}
    elif kind == "tuple":
        history = (rows[:, :5], rows[:, 5:].reshape(k, n - 5))
    else:
        raise AssertionError(kind)

    def to_vector(out):
        if kind == "dict":
            return torch.cat([out["a"].reshape(-1), out["b"].reshape(-1)]).double().numpy()
        return torch.cat([leaf.reshape(-1) for leaf in out]).double().numpy()

    return history, to_vector


def window_with_condition(rng: np.random.Generator, n: int, k: int, cond: float) -> np.ndarray:
    """A window whose DR = diff(diff(X)) has singular values logspace(0, -log10(cond))."""
    m = k - 2
    u = np.linalg.qr(rng.standard_normal((n, m)))[0]
    v = np.linalg.qr(rng.standard_normal((m, m)))[0]
    dr = u @ np.diag(np.logspace(0.0, -np.log10(cond), m)) @ v.T
    d0 = rng.standard_normal(n) / np.sqrt(n)
    dx = np.concatenate([d0[:, None], d0[:, None] + np.cumsum(dr, axis=1)], axis=1)
    x0 = rng.standard_normal(n) / np.sqrt(n)
    return np.concatenate([x0[:, None], x0[:, None] + np.cumsum(dx, axis=1)], axis=1)


def rel(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


# -- agreement with the reference ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensor", "dict", "tuple"])
@pytest.mark.parametrize("k", [3, 4, 6, 9, 12])
def test_mix_matches_reference_float64(kind, k):
    rng = np.random.default_rng(100 * k + len(kind))
    X = rng.standard_normal((24, k))
    dr = np.diff(X, n=2, axis=1)
    history, to_vector = stack_history(X, kind)
    # A weight of the order of DR's column norms squared, so that it visibly moves the answer.
    reg_scale = float(np.mean(np.sum(dr**2, axis=0)))
    for relaxation in (0.3, 1.0, 1.6):
        plain = aadl_extrapolate(X, relaxation, 0.0)
        for reg in (0.0, 0.3 * reg_scale):
            expected = aadl_extrapolate(X, relaxation, reg)
            out = aa.mix(history, relaxation=relaxation, reg=reg)
            assert optree.tree_structure(out) == optree.tree_structure(
                optree.tree_map(lambda h: h[0], history)
            )
            for leaf, h in zip(optree.tree_leaves(out), optree.tree_leaves(history)):
                assert leaf.dtype == torch.float64 and leaf.shape == h.shape[1:]
            assert rel(to_vector(out), expected) <= 1e-8
            if reg > 0:
                assert rel(expected, plain) > 1e-3  # the regularisation is really exercised


@pytest.mark.parametrize("cond", [10.0, 1e2, 1e3])
@pytest.mark.parametrize("k", [5, 8, 12])
def test_mix_float32_window_within_1e4_of_float64_reference(cond, k):
    rng = np.random.default_rng(int(cond) + k)
    X32 = window_with_condition(rng, 200, k, cond).astype(np.float32)
    X = X32.astype(np.float64)  # the float64 reference sees the very same (float32) window
    assert np.linalg.cond(np.diff(X, n=2, axis=1)) <= 1.05 * cond
    for relaxation in (0.5, 1.0, 1.5):
        expected = aadl_extrapolate(X, relaxation)
        out = aa.mix(torch.from_numpy(X32.T.copy()), relaxation=relaxation)
        assert out.dtype == torch.float32
        assert rel(out.double().numpy(), expected) <= 1e-4
        if cond >= 1e3:
            # The tolerance has teeth: float32 normal equations (the squared condition number
            # background.md warns about) miss it on these windows.
            dx = np.diff(X32, axis=1)
            dr = np.diff(dx, axis=1)
            gamma = np.linalg.solve(dr.T @ dr, dr.T @ dx[:, -1]).astype(np.float32)
            alpha = np.concatenate([gamma[:1], np.diff(gamma), 1 - gamma[-1:]])
            extr = X32[:, -2] + dx[:, -1] - (dx[:, :-1] + dr) @ gamma
            naive = relaxation * extr + (1 - relaxation) * X32[:, :-1] @ alpha
            assert rel(naive.astype(np.float64), expected) > 1e-4


def test_mix_bfloat16_window_is_solved_in_float64():
    rng = np.random.default_rng(7)
    Xb = torch.tensor(window_with_condition(rng, 64, 6, 30.0).T).to(torch.bfloat16)
    X = Xb.double().numpy().T
    out = aa.mix(Xb, relaxation=0.7)
    assert out.dtype == torch.bfloat16
    # Only the final rounding to bfloat16 (eps 2^-8) separates it from the float64 answer.
    assert rel(out.double().numpy(), aadl_extrapolate(X, 0.7)) <= 2**-8


@pytest.mark.parametrize("curvature", [1e-2, 1e-4, 1e-6])
def test_mix_on_nearly_constant_steps(curvature):
    # x_i = x0 + i v + curvature * (random second differences): cond(DR) ~ 1.5 but
    # ||DR|| / ||DX|| ~ curvature, the regime of slowly varying training steps. Differencing a
    # Gram matrix of DX would cancel to ~eps / curvature^2; the answer must stay at 1e-8.
    rng = np.random.default_rng(int(-np.log10(curvature)))
    n, k = 50, 6
    v, x0 = rng.standard_normal(n), rng.standard_normal(n)
    second = curvature * np.cumsum(np.cumsum(rng.standard_normal((n, k)), axis=1), axis=1)
    X = x0[:, None] + np.arange(k)[None, :] * v[:, None] + second
    assert np.linalg.cond(np.diff(X, n=2, axis=1)) < 3.0
    for relaxation in (0.5, 1.0):
        expected = aadl_extrapolate(X, relaxation)
        out = aa.mix(torch.from_numpy(X.T.copy()), relaxation=relaxation).numpy()
        assert rel(out, expected) <= 1e-8
        assert np.linalg.norm(out - expected) <= 1e-8 * np.linalg.norm(expected - X[:, -1])
    gamma = aa.mixing_weights(torch.from_numpy(X.T.copy())).gamma.numpy()
    assert rel(gamma, aadl_gamma(X)) <= 1e-8


# -- degenerate windows --------------------------------------------------------------------


def _integer_window(name: str, rng: np.random.Generator) -> np.ndarray:
    """Small-integer windows: every difference is exact in float32 and float64, so the
    degeneracy is exact and the minimum-norm least-squares answer is well defined."""
    n = 10
    x0 = rng.integers(-5, 6, n).astype(np.float64)
    v = rng.integers(-3, 4, n).astype(np.float64)
    w = rng.integers(-3, 4, n).astype(np.float64)
    if name == "all_equal":
        return np.repeat(x0[:, None], 6, axis=1)
    if name == "repeated_iterate":
        X = x0[:, None] + rng.integers(-4, 5, (n, 6))
        X[:, 3] = X[:, 2]
        return X
    if name == "repeated_pairs":
        X = x0[:, None] + rng.integers(-4, 5, (n, 6))
        return X[:, [0, 0, 1, 1, 2, 2]]
    if name == "constant_steps":  # DX all equal: DR = 0
        return x0[:, None] + v[:, None] * np.arange(7.0)[None, :]
    if name == "collinear":  # every difference a multiple of one vector: rank(DR) = 1
        return x0[:, None] + v[:, None] * np.array([0.0, 2, 3, 7, 8, 8, 11])[None, :]
    if name == "period_two":  # x_a, x_b, x_a, ...: DR = +-2 (x_b - x_a)
        return np.stack([x0, x0 + v] * 3, axis=1)
    if name == "rank_two":  # differences in a 2-d subspace, 6 unknowns
        t = np.array([0.0, 1, 3, 2, 5, 4, 9, 8])
        s = np.array([0.0, 2, 1, 1, 4, 3, 3, 6])
        return x0[:, None] + v[:, None] * t[None, :] + w[:, None] * s[None, :]
    if name == "last_two_equal":  # DX[:, -1] = 0: the right-hand side vanishes
        X = x0[:, None] + rng.integers(-4, 5, (n, 5))
        X[:, -1] = X[:, -2]
        return X
    raise AssertionError(name)


DEGENERATE = [
    "all_equal",
    "repeated_iterate",
    "repeated_pairs",
    "constant_steps",
    "collinear",
    "period_two",
    "rank_two",
    "last_two_equal",
]


@pytest.mark.parametrize("name", DEGENERATE)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_degenerate_windows_give_minimum_norm_answer(name, dtype):
    X = _integer_window(name, np.random.default_rng(DEGENERATE.index(name)))
    assert np.linalg.matrix_rank(np.diff(X, n=2, axis=1)) < X.shape[1] - 2 or name in (
        "last_two_equal",
        "repeated_iterate",
    )
    history = torch.tensor(X.T).to(dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    for relaxation in (0.5, 1.0, 1.3):
        for reg in (0.0, 0.5):
            out = aa.mix(history, relaxation=relaxation, reg=reg)
            assert torch.isfinite(out).all()
            expected = aadl_extrapolate(X, relaxation, reg)
            scale = max(np.linalg.norm(expected), 1.0)
            assert np.linalg.norm(out.double().numpy() - expected) <= tol * scale


def test_all_equal_window_returns_the_point():
    x = torch.randn(5, 3, dtype=torch.float64)
    for relaxation in (0.2, 1.0, 2.0):
        assert torch.equal(aa.mix(x.expand(4, 5, 3).clone(), relaxation=relaxation), x)


def test_constant_steps_give_relaxed_last_step():
    # DR = 0, so gamma = 0: extr = x_{k-1} and the relaxed point blends x_{k-2} and x_{k-1}.
    x0 = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    v = torch.tensor([0.5, 0.25, -1.0], dtype=torch.float64)
    history = torch.stack([x0 + i * v for i in range(5)])
    out = aa.mix(history, relaxation=0.25)
    torch.testing.assert_close(out, 0.25 * history[-1] + 0.75 * history[-2], rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "values,dtype",
    [
        ([3e38, -3e38, 3e38, -3e38, 3e38], torch.float32),  # differences overflow float32
        ([1e308, -1e308, 1e308, -1e308], torch.float64),  # differences overflow float64
        ([1e200, 2e200, -1e200, 5e199], torch.float64),  # Gram entries overflow
        ([1e-310, 3e-310, 2e-310, 7e-310], torch.float64),  # subnormal differences
        ([1e-40, 3e-41, 2e-42, 0.0], torch.float32),  # subnormal float32
    ],
)
def test_extreme_finite_windows_give_finite_output(values, dtype):
    base = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    history = torch.stack([v * base for v in values]).to(dtype)
    assert torch.isfinite(history).all()
    for relaxation in (0.5, 1.0, 1.7):
        out = aa.mix(history, relaxation=relaxation)
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_mixed_scale_pytree_is_finite():
    history = {
        "huge": torch.tensor([[3e38], [-3e38], [2e38], [-1e38]], dtype=torch.float32),
        "small": torch.randn(4, 3, dtype=torch.float64),
    }
    out = aa.mix(history, relaxation=0.9)
    assert all(torch.isfinite(leaf).all() for leaf in optree.tree_leaves(out))


# -- argument checking ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "history,error",
    [
        ({"a": torch.zeros(4, 2), "b": 1.0}, TypeError),  # non-tensor leaf
        ([np.zeros((4, 2))], TypeError),
        (torch.zeros(4, 2, dtype=torch.int64), TypeError),  # not floating point
        (torch.zeros(2, 5), ValueError),  # k < 3
        (torch.zeros(0, 5), ValueError),
        (torch.zeros(()), ValueError),  # no window dimension
        ({"a": torch.zeros(4, 2), "b": torch.zeros(3, 2)}, ValueError),  # mismatched k
        ((torch.zeros(5, 2), torch.zeros(5)), None),  # fine: 1-d leaves are allowed
        ({}, ValueError),  # no tensor at all
    ],
)
def test_mix_rejects_bad_history(history, error):
    if error is None:
        aa.mix(history)
        return
    with pytest.raises(error, match="history"):
        aa.mix(history)
    with pytest.raises(error, match="history"):
        aa.mixing_weights(history)


@pytest.mark.parametrize("relaxation", [0.0, -0.5, math.nan, math.inf, "1", True, None])
def test_mix_rejects_bad_relaxation(relaxation):
    with pytest.raises((TypeError, ValueError), match="relaxation"):
        aa.mix(torch.randn(4, 3), relaxation=relaxation)


@pytest.mark.parametrize("reg", [-1e-3, math.nan, math.inf, -math.inf, "0", False, None])
def test_mix_rejects_bad_reg(reg):
    with pytest.raises((TypeError, ValueError), match="reg"):
        aa.mix(torch.randn(4, 3), reg=reg)
    with pytest.raises((TypeError, ValueError), match="reg"):
        aa.mixing_weights(torch.randn(4, 3), reg=reg)


def test_mix_accepts_integer_hyperparameters():
    X = np.random.default_rng(3).standard_normal((6, 5))
    out = aa.mix(torch.from_numpy(X.T.copy()), relaxation=2, reg=1)
    assert rel(out.numpy(), aadl_extrapolate(X, 2.0, 1.0)) <= 1e-8


def test_mix_is_pure():
    history = {"a": torch.randn(5, 3, 2), "b": torch.randn(5, 4, dtype=torch.float64)}
    before = optree.tree_map(torch.clone, history)
    aa.mix(history, relaxation=0.5, reg=1e-3)
    for x, y in zip(optree.tree_leaves(history), optree.tree_leaves(before)):
        assert torch.equal(x, y)


# -- mixing_weights / solve_weights --------------------------------------------------------


@pytest.mark.parametrize("k", [3, 4, 7, 10])
@pytest.mark.parametrize("reg", [0.0, 0.2])
def test_mixing_weights_are_the_least_squares_solution(k, reg):
    rng = np.random.default_rng(10 * k + int(10 * reg))
    X = rng.standard_normal((15, k))
    dx = np.diff(X, axis=1)
    dr = np.diff(dx, axis=1)
    rhs = dx[:, -1]
    weights = aa.mixing_weights({"x": torch.from_numpy(X.T.copy())}, reg=reg)
    gamma = weights.gamma.numpy()
    alpha = weights.alpha.numpy()
    assert weights.gamma.dtype == weights.alpha.dtype == torch.float64
    assert gamma.shape == (k - 2,) and alpha.shape == (k - 1,)
    assert bool(weights.ok)
    assert rel(gamma, aadl_gamma(X, reg)) <= 1e-8
    assert abs(alpha.sum() - 1.0) <= 1e-12
    np.testing.assert_allclose(
        alpha, np.concatenate([gamma[:1], np.diff(gamma), 1 - gamma[-1:]]), rtol=0, atol=1e-14
    )
    # residual_norm is the norm of the least-squares residual (= the mixed residual F alpha).
    residual = rhs - dr @ gamma
    np.testing.assert_allclose(float(weights.residual_norm), np.linalg.norm(residual), rtol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(dx @ alpha), np.linalg.norm(residual), rtol=1e-9)
    # First-order optimality of the (regularised) objective.
    gradient = dr.T @ (dr @ gamma - rhs) + reg * gamma
    assert np.linalg.norm(gradient) <= 1e-12 * np.linalg.norm(dr, 2) * np.linalg.norm(rhs) + (
        1e-12 * reg * np.linalg.norm(gamma)
    )


def test_mixing_weights_of_a_linear_contraction_reach_zero_residual():
    # d + 2 iterates of a contraction in dimension d: the last residual is in span(DR).
    d = 4
    rng = np.random.default_rng(5)
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    m = q @ np.diag([0.8, -0.6, 0.4, -0.3]) @ q.T
    c = rng.standard_normal(d)
    xs = [rng.standard_normal(d)]
    for _ in range(d + 1):
        xs.append(m @ xs[-1] + c)
    weights = aa.mixing_weights(torch.tensor(np.stack(xs)))
    first_residual = np.linalg.norm(xs[1] - xs[0])
    assert float(weights.residual_norm) <= 1e-7 * first_residual


def _gram_of(dx: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dx.T @ dx)


@pytest.mark.parametrize("num_valid", [2, 3, 5])
def test_solve_weights_ignores_invalid_slots(num_valid):
    # Only the newest num_valid residuals take part: the answer equals the reference computed
    # on that sub-window alone, and the older residuals get zero weight.
    rng = np.random.default_rng(num_valid)
    q = 6
    dx = rng.standard_normal((9, q))
    dx[:, : q - num_valid] *= 1e3  # garbage in the invalid slots must not leak in
    sub = dx[:, q - num_valid :]
    window = np.concatenate([np.zeros((9, 1)), np.cumsum(sub, axis=1)], axis=1)
    weights = aa.solve_weights(_gram_of(dx), torch.tensor(num_valid), reg=0.0)
    alpha = weights.alpha.numpy()
    assert np.all(alpha[: q - num_valid] == 0.0)
    expected_gamma = aadl_gamma(window)
    expected_alpha = np.concatenate(
        [expected_gamma[:1], np.diff(expected_gamma), 1 - expected_gamma[-1:]]
    )
    np.testing.assert_allclose(alpha[q - num_valid :], expected_alpha, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(
        float(weights.residual_norm), np.linalg.norm(sub @ expected_alpha), rtol=1e-8
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_solve_weights_flags_non_finite_gram(bad):
    gram = _gram_of(np.random.default_rng(0).standard_normal((5, 4)))
    gram[1, 2] = gram[2, 1] = bad
    weights = aa.solve_weights(gram, 4)
    assert not bool(weights.ok)
    assert torch.equal(weights.alpha, torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    assert torch.isfinite(weights.gamma).all()


def test_solve_weights_non_finite_outside_valid_slots_is_ignored():
    dx = np.random.default_rng(1).standard_normal((5, 4))
    gram = _gram_of(dx)
    gram[0, :] = gram[:, 0] = math.nan  # slot 0 is not valid
    weights = aa.solve_weights(gram, 3)
    assert bool(weights.ok) and torch.isfinite(weights.alpha).all()
    assert float(weights.alpha[0]) == 0.0


def test_solve_weights_runs_under_vmap():
    rng = np.random.default_rng(2)
    dxs = [rng.standard_normal((7, 5)) for _ in range(3)]
    grams = torch.stack([_gram_of(dx) for dx in dxs])
    counts = torch.tensor([5, 3, 2])
    batched = torch.func.vmap(lambda g, c: aa.solve_weights(g, c, 0.1))(grams, counts)
    for i in range(3):
        single = aa.solve_weights(grams[i], int(counts[i]), 0.1)
        torch.testing.assert_close(batched.alpha[i], single.alpha, rtol=1e-12, atol=1e-14)


def test_solve_weights_rejects_too_small_gram():
    with pytest.raises(ValueError):
        aa.solve_weights(torch.ones(1, 1, dtype=torch.float64), 1)


# -- theory --------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6])
def test_linear_contraction_is_extrapolated_to_its_fixed_point(d):
    """d + 2 plain iterates of x -> M x + c (dimension d) determine the fixed point exactly.

    M is symmetric with eigenvalues of both signs and moduli spread over [0.2, 0.9], so the
    window is well conditioned (cond(DR) <~ 1e5 at d = 6). Normal equations, even in float64,
    lose accuracy like eps * cond(DR)^2: spectra with an eigenvalue near 0 give windows with
    cond(DR) ~ 1e7 at d = 6 and errors ~1e-4 (lstsq: ~1e-12), which says nothing about the
    extrapolation formula itself.
    """
    rng = np.random.default_rng(d)
    for trial in range(5):
        q = np.linalg.qr(rng.standard_normal((d, d)))[0]
        moduli = rng.permutation(np.linspace(0.2, 0.9, d))
        m = q @ np.diag(moduli * rng.choice([-1.0, 1.0], d)) @ q.T
        c = rng.standard_normal(d)
        x_star = np.linalg.solve(np.eye(d) - m, c)
        xs = [rng.standard_normal(d)]
        for _ in range(d + 1):
            xs.append(m @ xs[-1] + c)
        X = np.stack(xs, axis=1)
        out = aa.mix(torch.from_numpy(X.T.copy()), relaxation=1.0).numpy()
        assert rel(X[:, -1], x_star) > 1e-3  # the plain iterate is still far away
        assert rel(out, x_star) <= 1e-8, (trial, rel(out, x_star))
        # Also through a pytree split of the coordinates.
        tree = {"head": torch.from_numpy(X[:1].T.copy()), "tail": torch.from_numpy(X[1:].T.copy())}
        out_tree = aa.mix(tree)
        joined = torch.cat([out_tree["head"], out_tree["tail"]]).numpy()
        assert rel(joined, x_star) <= 1e-8

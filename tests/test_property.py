"""Property-based tests (hypothesis) of ``mix`` and of ``anderson``'s incremental window.

Random windows of iterates, well conditioned or degenerate (repeated iterates, collinear,
nearly collinear or low-rank differences, differences at the scale of rounding, constant
windows), at parameter
scales from 1e-20 to 1e20, in float32 and float64, are checked against a float64 NumPy
reference written from the math of background.md:

* well-conditioned windows: the result agrees with ``numpy.linalg.lstsq`` (an SVD solver, not
  the library's QR factor or Gram matrix) within spec.md's tolerances;
* every window: the result is finite, and the mixing obeys the documented safeguards of
  docs/reliability.md: the mixed residual is never larger than the plain step's, the solve is
  as good as a reference that keeps only the better-conditioned directions, the coefficients
  obey the truncation bound, and ``loss_fn`` never lets a worse point through.

Example counts are bounded and the examples derandomized, so CI is fast and reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from references import aadl_gamma, aadl_point

import aadl_func as aa
from aadl_func._src.core.lstsq import RCOND, RTOL

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
DTYPES = {"float32": torch.float32, "float64": torch.float64}
KINDS = ("random", "repeated", "collinear", "near_collinear", "low_rank", "rounding", "constant")


# -- the float64 reference ---------------------------------------------------------------------


def reference_gamma(X: np.ndarray, reg: float, cutoff: float | None = None) -> np.ndarray:
    r"""``argmin ||DX[:, -1] - DR g||^2 + reg ||g||^2``: ``references.aadl_gamma`` (``lstsq``
    on the augmented system).

    With ``cutoff``, singular values of ``DR`` with :math:`\sigma^2 \le` ``cutoff`` are
    dropped (a truncated-SVD solution over the better-conditioned directions only).
    """
    if cutoff is None:
        return aadl_gamma(X, reg)
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    U, s, Vt = np.linalg.svd(DR, full_matrices=False)
    keep = s**2 > cutoff
    coef = (U.T @ DX[:, -1]) * s / np.where(keep, s**2 + reg, 1.0)
    return Vt.T @ np.where(keep, coef, 0.0)


def mixed_residual_sq(X: np.ndarray, gamma: np.ndarray) -> float:
    """``||DX[:, -1] - DR gamma||^2``: the squared norm of the mixed residual."""
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    return float(np.sum((DX[:, -1] - DR @ gamma) ** 2))


def factor_scale(X: np.ndarray) -> float:
    """The factor route's scale: the largest column norm of ``[DR | DX[:, -1]]``."""
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    return float(max(np.linalg.norm(DR, axis=0).max(), np.linalg.norm(DX[:, -1])))


def gamma_bound(X: np.ndarray, gram: bool = False) -> float:
    r"""The documented bound on the coefficients (k iterates), with 10% slack for rounding.

    Factor route (``mix``, float64 windows of ``update``): :math:`\|\gamma\|_2 \le
    \sqrt{k-2}\, \|f_{\mathrm{last}}\| / (\mathrm{RCOND}\, s)`. Gram route (float32 and
    bf16 windows of ``update``): :math:`\|\gamma\|_2 \le \sqrt{(k-2)/\mathrm{RTOL}}`.
    """
    k = X.shape[1]
    if gram:
        return 1.1 * math.sqrt((k - 2) / RTOL)
    scale = factor_scale(X)
    if scale == 0.0:
        return 0.0
    last = np.linalg.norm(np.diff(X, axis=1)[:, -1])
    return 1.1 * math.sqrt(k - 2) * last / (RCOND * scale)


def step_bound(X: np.ndarray, relaxation: float, gram: bool = False) -> float:
    r"""``||x - x_newest|| <= (1 + 2 beta) max(||gamma||_inf, 1) sum_j ||DX_j||``."""
    spread = np.linalg.norm(np.diff(X, axis=1), axis=0).sum()
    return (1.0 + 2.0 * relaxation) * max(gamma_bound(X, gram), 1.0) * spread


# -- windows -------------------------------------------------------------------------------------


@st.composite
def windows(draw, kinds=KINDS, dtypes=tuple(DTYPES)):
    """``(X, tensor, relaxation, reg)``: an (n, k) float64 array of the iterates exactly as
    the library sees them (already rounded to the dtype), the (k, n) tensor, options."""
    kind = draw(st.sampled_from(kinds))
    dtype = DTYPES[draw(st.sampled_from(dtypes))]
    k = draw(st.integers(3, 8))
    n = draw(st.integers(k + 2, 24)) if kind == "random" else draw(st.integers(1, 24))
    scale = 10.0 ** draw(st.integers(-20, 20))
    relaxation = draw(st.sampled_from([0.1, 0.5, 1.0, 1.3]))
    reg = draw(st.sampled_from([0.0, 0.0, 1e-8, 1e-3])) * scale**2
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.standard_normal(n)
    if kind == "rounding":
        # Iterates a few units in the last place apart: differences are pure rounding noise.
        npdtype = np.float32 if dtype == torch.float32 else np.float64
        anchor = (scale * base).astype(npdtype)
        ulp = np.spacing(np.abs(anchor)).astype(np.float64)
        steps = rng.integers(-3, 4, size=(n, k))
        X = anchor.astype(np.float64)[:, None] + steps * ulp[:, None]
    else:
        if kind == "random":
            dx = rng.standard_normal((n, k - 1)) * 10.0 ** rng.uniform(-3, 0, k - 1)
        elif kind == "repeated":
            dx = rng.standard_normal((n, k - 1))
            dx[:, rng.random(k - 1) < 0.5] = 0.0  # x_{i+1} = x_i
            dx[:, rng.integers(k - 1)] = 0.0
        elif kind == "collinear":
            dx = np.outer(rng.standard_normal(n), rng.standard_normal(k - 1))
        elif kind == "near_collinear":
            # cond(DR) ~ 1/noise: around 1e6 the smallest directions sit at the truncation
            # threshold, where the coefficients are largest.
            noise = 10.0 ** rng.uniform(-9, -3)
            dx = np.outer(rng.standard_normal(n), rng.standard_normal(k - 1))
            dx = dx + noise * rng.standard_normal((n, k - 1))
        elif kind == "low_rank":
            rank = int(rng.integers(1, max(2, k - 2)))
            dx = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, k - 1))
        else:  # constant
            dx = np.zeros((n, k - 1))
        X = base[:, None] + np.concatenate([np.zeros((n, 1)), np.cumsum(dx, axis=1)], axis=1)
        X = scale * X
    tensor = torch.tensor(X.T).to(dtype)
    return tensor.double().numpy().T.copy(), tensor, relaxation, reg


def _dr_condition(X: np.ndarray) -> float:
    return float(np.linalg.cond(np.diff(np.diff(X, axis=1), axis=1)))


def _check_safeguards(X: np.ndarray, gamma: np.ndarray, reg: float) -> None:
    """The mixing's documented guarantees for coefficients ``gamma`` of window ``X``."""
    DX = np.diff(X, axis=1)
    unit = float(np.max(np.sum(DX**2, axis=0)))  # max ||f_i||^2
    plain = float(np.sum(DX[:, -1] ** 2))
    mixed = mixed_residual_sq(X, gamma)
    # Rounding of the float64 factor, and of evaluating ||DX[:, -1] - DR gamma|| here, both
    # amplified by coefficients up to the truncation bound.
    noise = 10 * np.finfo(float).eps * np.linalg.norm(np.diff(DX, axis=1)) * np.linalg.norm(gamma)
    slack = 1e-12 * unit + 2 * math.sqrt(plain) * noise + noise**2
    assert mixed <= plain + slack, "the mixed residual is larger than the plain step's"
    truncated = reference_gamma(X, reg, cutoff=(10 * RCOND * factor_scale(X)) ** 2)
    assert mixed + reg * gamma @ gamma <= (
        mixed_residual_sq(X, truncated) + reg * truncated @ truncated + slack
    ), "the solve is worse than a truncated-SVD reference"
    assert np.linalg.norm(gamma) <= gamma_bound(X)


# -- mix -----------------------------------------------------------------------------------------


@SETTINGS
@given(windows(kinds=("random",)))
def test_mix_matches_the_reference_on_well_conditioned_windows(window):
    X, history, relaxation, reg = window
    limit = 1e3 if history.dtype == torch.float32 else 1e5
    # Rare for these windows; ill-conditioned ones are checked below.
    assume(_dr_condition(X) <= limit)
    expected = aadl_point(X, reference_gamma(X, reg), relaxation)
    got = aa.mix(history, relaxation=relaxation, reg=reg)
    assert got.dtype == history.dtype and got.shape == history.shape[1:]
    error = np.linalg.norm(got.double().numpy() - expected)
    # spec.md: 1e-8 relative for float64 windows, 1e-4 for float32 windows (cond <= 1e3).
    tol = 1e-8 if history.dtype == torch.float64 else 1e-4
    assert error <= tol * np.linalg.norm(expected)
    if history.dtype == torch.float64:  # and the step itself, not only the point, is right
        assert error <= 1e-6 * np.linalg.norm(expected - X[:, -1])


@SETTINGS
@given(windows())
def test_mix_is_finite_and_safeguarded_on_any_window(window):
    X, history, relaxation, reg = window
    got = aa.mix(history, relaxation=relaxation, reg=reg)
    assert torch.isfinite(got).all()
    weights = aa.mixing_weights(history, reg=reg)
    assert bool(weights.ok)
    gamma = weights.gamma.numpy()
    assert np.isfinite(gamma).all()
    _check_safeguards(X, gamma, reg)
    # The returned point is AADL's formula for these coefficients (float64 combination,
    # rounded once to the window's dtype).
    expected = aadl_point(X, gamma, relaxation)
    eps = torch.finfo(history.dtype).eps
    spread = np.linalg.norm(np.diff(X, axis=1), axis=0).sum()
    coefficients = (1 + 2 * relaxation) * max(np.abs(gamma).max(), 1.0)
    tol = eps * np.linalg.norm(expected) + 1e-13 * coefficients * spread
    assert np.linalg.norm(got.double().numpy() - expected) <= tol + np.finfo(float).tiny
    assert np.linalg.norm(got.double().numpy() - X[:, -1]) <= step_bound(X, relaxation) * 1.01


@settings(max_examples=30, deadline=None, derandomize=True)
@given(windows(kinds=("random",), dtypes=("float64",)), st.integers(-20, 20))
def test_mix_is_scale_equivariant(window, exponent):
    """mix(s X) = s mix(X) for reg = 0: the truncation threshold is relative to the window."""
    X, history, relaxation, _ = window
    scale = 10.0**exponent
    plain = aa.mix(history, relaxation=relaxation).numpy()
    scaled = aa.mix(history * scale, relaxation=relaxation).numpy() / scale
    np.testing.assert_allclose(scaled, plain, rtol=1e-8, atol=1e-8 * np.abs(plain).max())


# -- anderson's incremental window -----------------------------------------------------------


class Shift:
    """``updates = grads``: with ``params = 0`` the inner step is exactly ``grads``."""

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return updates, state


def _feed(history: torch.Tensor, extra: torch.Tensor, relaxation, reg, inplace, loss_fn=None):
    """Runs ``anderson`` (depth k) over ``extra`` then ``history``; returns the last output and
    the state. The ring has wrapped around ``len(extra)`` times past its start."""
    k = history.shape[0]
    opt = aa.anderson(Shift(), history_depth=k, relaxation=relaxation, reg=reg)
    zero = torch.zeros_like(history[0])
    state = opt.init(zero)
    out = None
    for y in list(extra) + list(history):
        params = zero.clone()
        out, state = opt.update(state, params, y.clone(), inplace=inplace, loss_fn=loss_fn)
    return out, state


def _stored_gram_error(state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(state.gram, exact Gram of the stored residuals, the a-priori rounding bound)."""
    R = np.stack([r.double().numpy().ravel() for r in state.residuals])
    exact = R @ R.T
    n = R.shape[1]
    gamma_n = n * 2.0**-53 / (1 - n * 2.0**-53)
    # |fl(a.b) - a.b| <= gamma_n |a|.|b| for any summation order (Higham, Thm 3.1), for both.
    bound = 2 * gamma_n * (np.abs(R) @ np.abs(R).T)
    return state.gram.numpy(), exact, bound


@SETTINGS
@given(
    windows(kinds=("random",)),
    st.integers(0, 6),
    st.booleans(),
)
def test_update_matches_the_reference_on_well_conditioned_windows(window, extra, inplace):
    X, history, relaxation, reg = window
    limit = 1e3 if history.dtype == torch.float32 else 1e5
    assume(_dr_condition(X) <= limit)
    rng = np.random.default_rng(extra)
    junk = torch.tensor(rng.standard_normal((extra, history.shape[1]))).to(history.dtype)
    junk = junk * history.abs().max()
    out, state = _feed(history, junk, relaxation, reg, inplace)
    assert int(state.num_mixed) >= 1 and int(state.num_nonfinite) == 0
    expected = aadl_point(X, reference_gamma(X, reg), relaxation)
    error = np.linalg.norm(out.double().numpy() - expected)
    tol = 1e-8 if history.dtype == torch.float64 else 1e-4
    assert error <= tol * np.linalg.norm(expected)
    gram, exact, bound = _stored_gram_error(state)
    assert np.all(np.abs(gram - exact) <= bound + np.finfo(float).tiny)


@SETTINGS
@given(windows(), st.integers(0, 4), st.booleans(), st.integers(0, 2**32 - 1))
def test_update_is_finite_and_safeguarded_on_any_window(window, extra, inplace, seed):
    X, history, relaxation, reg = window
    rng = np.random.default_rng(seed)
    junk = history[:1].repeat(extra, 1)  # a prefix of repeated entries, wrapped away
    out, state = _feed(history, junk, relaxation, reg, inplace)
    assert torch.isfinite(out).all()
    assert int(state.num_nonfinite) == 0
    newest = X[:, -1]
    gram = history.dtype != torch.float64  # float32 windows take the Gram route
    assert np.linalg.norm(out.double().numpy() - newest) <= step_bound(X, relaxation, gram) * 1.01
    gram, exact, bound = _stored_gram_error(state)
    assert np.all(np.abs(gram - exact) <= bound + np.finfo(float).tiny)

    # With the loss safeguard the returned point is never worse than the plain step.
    target = torch.tensor(rng.standard_normal(X.shape[0]) * np.abs(X).max())
    weights = torch.tensor(rng.uniform(0.1, 1.0, X.shape[0]))

    def loss_fn(p):
        return (weights * (p.double() - target) ** 2).sum()

    guarded, state = _feed(history, junk, relaxation, reg, inplace, loss_fn=loss_fn)
    assert torch.isfinite(guarded).all()
    assert loss_fn(guarded) <= loss_fn(history[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exponent", [-20, -10, 0, 10, 20])
def test_extreme_scales_agree_with_the_unit_scale(dtype, exponent):
    """The same well-conditioned run at scale 10^e gives 10^e times the unit-scale result."""
    rng = np.random.default_rng(7)
    X = rng.standard_normal((12, 1)) + np.cumsum(rng.standard_normal((12, 6)), axis=1)
    scale = 10.0**exponent
    unit = torch.tensor(X.T).to(dtype)
    scaled = torch.tensor((scale * X).T).to(dtype)
    out_unit, _ = _feed(unit, unit[:0], 0.5, 0.0, False)
    out_scaled, _ = _feed(scaled, scaled[:0], 0.5, 0.0, False)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    got = out_scaled.double().numpy() / scale
    np.testing.assert_allclose(got, out_unit.double().numpy(), rtol=tol, atol=tol)


def test_tree_windows_match_the_flat_window():
    """A pytree window (dict of matrices) mixes exactly like its flattened concatenation."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((10, 1)) + np.cumsum(rng.standard_normal((10, 5)), axis=1)
    flat = torch.tensor(X.T)
    tree = {"a": flat[:, :4].reshape(5, 2, 2), "b": flat[:, 4:]}
    got = aa.mix(tree, relaxation=0.7)
    leaves = optree.tree_leaves(got)
    joined = torch.cat([leaf.reshape(-1) for leaf in leaves])
    torch.testing.assert_close(joined, aa.mix(flat, relaxation=0.7), rtol=1e-12, atol=1e-12)

"""``reg_column``: a Tikhonov weight per least-squares column (SciPy's ``w0``).

Held to NumPy float64 recurrences written here from the definition (column j of the small
problem gets ``reg + reg_column * ||Delta f_j||^2`` on its diagonal), solved with the tests'
reference least squares (``references.svd_lstsq``: the augmented problem by
``numpy.linalg.lstsq``) and AADL's reference point (``references.aadl_point``), in both
modes, and to
``scipy.optimize.anderson``'s own iterates where the two recurrences are the same (mode
classic, no line search: ``history_depth = M + 1``, ``reg_column = w0**2``, the inner step
``x + alpha F(x)``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import aadl_point, svd_lstsq
from torch.func import vmap

import aadl_func as aa

N = 8


def _problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.standard_normal((N, N)))
    # A contraction with a spread of rates, so that the window's columns differ in scale.
    a = q @ np.diag(np.linspace(0.05, 0.9, N)) @ q.T
    return a, rng.standard_normal(N)


def _g(x: np.ndarray) -> np.ndarray:
    """A nonlinear contraction: ``g(x) = A x + b + 0.05 sin(x)``."""
    a, b = _problem()
    return a @ x + b + 0.05 * np.sin(x)


def classic_reference(x0, steps, depth, reg, reg_column, relaxation=1.0):
    """Type-II Anderson acceleration on ``g`` with the per-column ridge (float64 NumPy)."""
    xs, fs, out = [], [], []
    x = np.array(x0, dtype=np.float64)
    for _ in range(steps):
        xs.append(x)
        fs.append(_g(x) - x)
        xs, fs = xs[-depth:], fs[-depth:]
        if len(xs) < 2:
            x = x + relaxation * fs[-1]
        else:
            dx = np.diff(np.stack(xs, 1), axis=1)
            df = np.diff(np.stack(fs, 1), axis=1)
            weights = reg + reg_column * (df * df).sum(0)
            gamma = svd_lstsq(df, fs[-1], weights)
            x = xs[-1] + relaxation * fs[-1] - (dx + relaxation * df) @ gamma
        out.append(x)
    return np.stack(out)


def aadl_reference(x0, steps, depth, reg, reg_column, relaxation=1.0):
    """AADL's recurrence on the plain iterates ``y = g(x)`` with the per-column ridge."""
    window, out = [], []
    x = np.array(x0, dtype=np.float64)
    for _ in range(steps):
        y = _g(x)
        window = (window + [y])[-depth:]
        x = y
        if len(window) >= 3:
            big_x = np.stack(window, 1)
            dx = np.diff(big_x, axis=1)
            dr = np.diff(dx, axis=1)
            weights = reg + reg_column * (dr * dr).sum(0)
            x = aadl_point(big_x, svd_lstsq(dr, dx[:, -1], weights), relaxation)
        out.append(x)
    return np.stack(out)


class _MapStep:
    """Inner "optimizer" whose update is ``g(x) - x`` (the grads argument is ignored)."""

    def init(self, params):
        return ()

    def update(self, grads, state, params=None, inplace=False):
        x = params["x"].numpy()
        return {"x": torch.from_numpy(_g(x) - x).to(params["x"].dtype)}, state


def _run(mode, steps, dtype=torch.float64, inplace=False, **options):
    opt = aa.anderson(_MapStep(), mode=mode, **options)
    x0 = np.linspace(-1.0, 1.0, N)
    params = {"x": torch.tensor(x0, dtype=dtype)}
    state = opt.init(params)
    out = []
    for _ in range(steps):
        # The grads are ignored (the inner map is g); in place they must not be the params.
        grads = {"x": torch.zeros_like(params["x"])}
        params, state = opt.update(state, params, grads, inplace=inplace)
        out.append(params["x"].double().numpy().copy())
    return np.stack(out), state, x0


@pytest.mark.parametrize("mode", ["classic", "aadl"])
@pytest.mark.parametrize(("reg", "reg_column"), [(0.0, 1e-4), (0.0, 0.3), (1e-6, 0.05)])
@pytest.mark.parametrize("inplace", [False, True])
def test_float64_iterates_match_the_numpy_reference(mode, reg, reg_column, inplace):
    steps, depth = 25, 5
    ours, state, x0 = _run(
        mode, steps, inplace=inplace, history_depth=depth, reg=reg, reg_column=reg_column
    )
    reference = classic_reference if mode == "classic" else aadl_reference
    expected = reference(x0, steps, depth, reg, reg_column)
    assert int(state.num_mixed) >= steps - 3
    # Different algorithms (QR + SVD of the streamed factor vs lstsq of the dense augmented
    # matrix) on a well-conditioned problem: agreement to float64 rounding over 25 steps.
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-11)


@pytest.mark.parametrize("mode", ["classic", "aadl"])
def test_float32_window_matches_the_reference_to_float32_rounding(mode):
    # Float32 windows solve the normal equations from the float64 Grams (the other route).
    steps, depth, reg_column = 15, 5, 0.05
    ours, _, x0 = _run(mode, steps, dtype=torch.float32, history_depth=depth, reg_column=reg_column)
    reference = classic_reference if mode == "classic" else aadl_reference
    expected = reference(x0, steps, depth, 0.0, reg_column)
    # The map is evaluated in float32 at float32 points: errors of a few float32 ulps of
    # |x| ~ 3 per step, not amplified by the damped problem.
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("mode", ["classic", "aadl"])
def test_per_column_weight_is_not_the_window_mean(mode):
    """The option changes the iterates, and differently from the mean-scaled ridge."""
    plain, _, _ = _run(mode, 20, history_depth=5)
    column, _, _ = _run(mode, 20, history_depth=5, reg_column=0.3)
    relative, _, _ = _run(mode, 20, history_depth=5, reg_relative=0.3)
    assert np.abs(column - plain).max() > 1e-6
    assert np.abs(column - relative).max() > 1e-6


def test_vmap_ensemble_equals_its_members():
    opt = aa.anderson(aa.sgd(0.3), mode="classic", history_depth=4, reg_column=0.1)
    a, b = (torch.tensor(t) for t in _problem())

    def grads(p):
        return {"x": a @ p["x"] - b + 0.3 * p["x"] ** 3}

    members = [{"x": torch.linspace(-1.0, 1.0, N, dtype=torch.float64) * s} for s in (0.5, 1, 2)]
    stacked = {"x": torch.stack([m["x"] for m in members])}
    states = vmap(opt.init)(stacked)
    singles = [opt.init(m) for m in members]
    for _ in range(12):
        stacked, states = vmap(lambda s, p: opt.update(s, p, grads(p)))(states, stacked)
        for i, m in enumerate(members):
            members[i], singles[i] = opt.update(singles[i], m, grads(m))
    for i, m in enumerate(members):
        torch.testing.assert_close(stacked["x"][i], m["x"], rtol=0, atol=1e-12)
    assert int(singles[0].num_mixed) > 5


scipy_optimize = pytest.importorskip("scipy.optimize")


def _scipy_iterates(F, x0, m, w0, alpha, steps):
    seen = []
    try:
        scipy_optimize.anderson(
            F,
            x0,
            M=m,
            w0=w0,
            alpha=alpha,
            line_search=None,
            maxiter=steps,
            f_tol=1e-300,
            callback=lambda x, f: seen.append(np.array(x, dtype=np.float64)),
        )
    except scipy_optimize.NoConvergence:
        pass
    return np.stack(seen[:steps])


@pytest.mark.parametrize("w0", [0.01, 0.5])
def test_scipy_anderson_iterates_with_w0(w0):
    """``scipy.optimize.anderson(F, M, w0, alpha, line_search=None)`` is mode classic with
    ``history_depth = M + 1``, ``reg_column = w0**2`` and the inner step
    ``x + alpha F(x)`` (SciPy's ``-alpha``-scaled initial Jacobian)."""
    m, alpha, steps = 5, 0.5, 12

    def F(x):  # a root problem: F(x) = g(x) - x
        return _g(np.asarray(x, dtype=np.float64)) - x

    x0 = np.linspace(-1.0, 1.0, N)
    expected = _scipy_iterates(F, x0, m, w0, alpha, steps)

    opt = aa.anderson(aa.sgd(alpha), mode="classic", history_depth=m + 1, reg_column=w0**2)
    params = {"x": torch.tensor(x0)}
    state = opt.init(params)
    ours = []
    for _ in range(len(expected)):
        grads = {"x": -torch.from_numpy(F(params["x"].numpy()))}  # sgd: x - alpha * grads
        params, state = opt.update(state, params, grads)
        ours.append(params["x"].numpy().copy())
    assert len(expected) == steps
    np.testing.assert_allclose(np.stack(ours), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [(-0.1, ValueError, ">= 0.0"), (float("nan"), ValueError, "finite"), (True, TypeError, "real")],
)
def test_bad_reg_column_is_refused_by_name(value, error, text):
    with pytest.raises(error, match=f"anderson: `reg_column` must be .*{text}"):
        aa.anderson(aa.sgd(0.1), reg_column=value)


def test_the_torch_optim_wrapper_takes_it():
    model = torch.nn.Linear(3, 1)
    wrapped = aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reg_column=0.2)
    assert wrapped.anderson_options["reg_column"] == 0.2
    with pytest.raises(ValueError, match="`reg_column`"):
        aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), reg_column=-1.0)

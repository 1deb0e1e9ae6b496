"""The Gauss–Newton (Levenberg–Marquardt by CG) probe of the full-batch suite
(``benchmarks/fullbatch/gauss_newton.py``): its residuals are the suite's losses, its CG solve
is NumPy's, and its count of evaluations is every evaluation it makes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("sklearn")  # the suite's problems (run.py imports them all)
sys.path.insert(0, str(ROOT))

from benchmarks.fullbatch import gauss_newton  # noqa: E402


@pytest.mark.parametrize("key", sorted(gauss_newton.PROBLEMS))
def test_half_the_squared_residuals_is_the_suites_loss(key):
    """`r` is written apart from the suite's loss; both must be the same function."""
    problem = gauss_newton.PROBLEMS[key](0)
    params = problem.initial
    shifted = {k: v + 0.05 * torch.randn_like(v) for k, v in params.items()}
    for point in (params, shifted):
        ours = 0.5 * (problem.r(point) ** 2).sum()
        torch.testing.assert_close(ours, problem.loss(point), rtol=1e-5, atol=0.0)


def test_cg_solves_the_damped_normal_equations_as_numpy_does():
    """On a linear least-squares problem, CG run as long as the dimension solves
    $(J^\\top J + \\lambda I) d = J^\\top r$: NumPy's dense solve of it in float64."""
    rng = np.random.default_rng(0)
    J, b, lam = rng.standard_normal((9, 6)), rng.standard_normal(9), 0.3
    theta = {"w": torch.tensor(rng.standard_normal(6))}
    A = torch.tensor(J)

    def r(params):
        return A @ params["w"] - torch.tensor(b)

    g = {"w": A.T @ r(theta)}

    def product(v):
        return {"w": A.T @ (A @ v["w"]) + lam * v["w"]}

    d = gauss_newton.cg(product, g, 6)["w"].numpy()
    expected = np.linalg.solve(J.T @ J + lam * np.eye(6), J.T @ (J @ theta["w"].numpy() - b))
    np.testing.assert_allclose(d, expected, rtol=1e-9, atol=1e-12)
    fewer = gauss_newton.cg(product, g, 2)["w"].numpy()
    assert np.abs(fewer - expected).max() > 1e-6  # two iterations are not the solve


# torch.func.jvp's first call loads decompositions that torch itself scripts with torch.jit,
# which warns on recent torch: nothing the probe does.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_every_evaluation_is_counted():
    """The run's count against a counter around the residual function: each jvp, each
    vjp's forward and each vjp's backward is one call of `r` or of its pullback; the probe
    counts 1 per gradient (forward and backward), 2 per CG product, 1 per trial."""
    problem = gauss_newton.PROBLEMS["poisson_pinn"](0)
    calls = {"r": 0}
    r = problem.r

    def counted(params):
        calls["r"] += 1
        return r(params)

    problem.r = counted
    budget = 40
    out = gauss_newton.levenberg_marquardt(problem, 3, 1e-1, budget)
    # `r` runs once per vjp (the first gradient, each trial) and once per jvp (each product).
    steps = out["steps"]
    assert calls["r"] == 1 + steps + 3 * steps
    assert 1 + steps * (2 * 3 + 1) >= budget > 1 + (steps - 1) * (2 * 3 + 1)

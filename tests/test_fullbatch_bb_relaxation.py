"""The Barzilai–Borwein relaxation probe of the full-batch suite
(``benchmarks/fullbatch/bb_relaxation.py``): its relaxation is BB's step for gradient
descent, and its optimizer is AA default's update with that relaxation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("sklearn")  # the suite's problems (run.py imports them all)
sys.path.insert(0, str(ROOT))

from benchmarks.fullbatch import bb_relaxation  # noqa: E402


def test_on_a_quadratic_with_gradient_descent_it_is_bb_over_the_learning_rate():
    """For gradient descent on L = x^T A x / 2 the inner step is f = -lr A x; the relaxation
    must be Barzilai–Borwein's step s^T s / s^T y (y the change of the gradient A x) over lr,
    computed here from the gradients, not from f."""
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    A = q @ torch.diag(torch.linspace(0.5, 3.0, 6, dtype=torch.float64)) @ q.T
    lr = 0.2
    x0 = torch.randn(6, generator=g, dtype=torch.float64)
    x1 = x0 - 0.3 * (A @ x0)
    beta = bb_relaxation.bb_relaxation(x1, -lr * (A @ x1), (x0, -lr * (A @ x0)))
    s, y = x1 - x0, A @ x1 - A @ x0
    assert beta == pytest.approx(float(s @ s / (s @ y)) / lr, rel=1e-12)


def test_clamped_and_one_without_positive_curvature():
    x0, x1 = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    assert bb_relaxation.bb_relaxation(x1, torch.zeros(2, dtype=torch.float64), None) == 1.0
    flat = (x0, torch.zeros(2, dtype=torch.float64))
    assert bb_relaxation.bb_relaxation(x1, torch.ones(2, dtype=torch.float64), flat) == 1.0
    tiny = bb_relaxation.bb_relaxation(x1, -1e-9 * torch.ones(2, dtype=torch.float64), flat)
    huge = bb_relaxation.bb_relaxation(x1, -1e9 * torch.ones(2, dtype=torch.float64), flat)
    assert (tiny, huge) == (bb_relaxation.HIGHEST, bb_relaxation.LOWEST)


def test_each_call_is_aa_defaults_update_with_that_relaxation():
    """The probe's optimizer against AA default's `aa.anderson` made with the relaxation the
    probe computes at each call: the same params after every call."""
    from benchmarks.fullbatch import methods

    o = methods.DEFAULT_AA
    model = torch.nn.Linear(3, 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    reference = {k: v.clone() for k, v in params.items()}
    probe = bb_relaxation.make_optimizer()
    state, ref_state = probe.init(params), probe.init(reference)
    previous = None
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        steps, _ = methods.aa.adam(o["lr"], betas=(0.0, 0.999)).update(
            {k: v.clone() for k, v in grads.items()}, ref_state.inner_state, params=reference,
            inplace=False,
        )  # fmt: skip
        x = torch.cat([v.reshape(-1).double() for v in reference.values()])
        f = torch.cat([v.reshape(-1).double() for v in steps.values()])
        beta = bb_relaxation.bb_relaxation(x, f, previous)
        previous = (x, f)
        expected = methods.aa.anderson(
            methods.aa.adam(o["lr"], betas=(0.0, 0.999)), mode="classic",
            history_depth=o["history_depth"], reg_relative=o["reg_relative"], relaxation=beta,
        )  # fmt: skip
        reference, ref_state = expected.update(ref_state, reference, grads)
        params, state = probe.update(state, params, {k: v.clone() for k, v in grads.items()})
        for k in params:
            torch.testing.assert_close(params[k], reference[k], rtol=0, atol=0)

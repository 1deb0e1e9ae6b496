"""The solver's batches, depth one, counts, best iterate and stopping tests (issue 34).

References are independent of the code under test: SciPy's ``scipy.optimize.anderson``
(``nonlin_solve`` with ``Anderson(M=1)``), eager solves of one problem at a time, and NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_solver import PROBLEMS, contraction, our_iterates, scipy_solve
from torch.func import vmap

import aadl_func as aa

D = torch.float64


# -- a. vmap over a start point batched outside ----------------------------------------------
def test_vmap_over_x0_batched_outside():
    """x0 comes in batched (a warm start per sample), the two ways a user writes it: as a
    vmapped argument beside the per-sample data, and as the only batched argument of a solve
    whose map is shared; also a pytree x0. Each member equals its own eager solve. (Before
    issue 34 the aliasing check read ``data_ptr()`` of the batched tensor and raised.)"""
    W, _ = contraction(n=5)
    C = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=D)
    X0 = torch.randn(4, 5, generator=torch.Generator().manual_seed(2), dtype=D)

    def solve(c, x0):
        return aa.fixed_point(lambda x: torch.tanh(W @ x) + c, x0, tol=1e-11)

    xs, infos = vmap(solve)(C, X0)
    shared = vmap(solve, in_dims=(None, 0))(C[0], X0)
    tree = vmap(
        lambda x0: aa.fixed_point(
            lambda x: {"a": torch.tanh(W @ x["a"]) + C[0]}, {"a": x0}, tol=1e-11
        )
    )(X0)
    for i in range(4):
        x, info = solve(C[i], X0[i])
        assert int(infos.iterations[i]) == int(info.iterations) and bool(infos.converged[i])
        torch.testing.assert_close(xs[i], x, rtol=0, atol=1e-12)
        x, info = solve(C[0], X0[i])
        assert int(shared[1].iterations[i]) == int(info.iterations)
        torch.testing.assert_close(shared[0][i], x, rtol=0, atol=1e-12)
        torch.testing.assert_close(tree[0]["a"][i], x, rtol=0, atol=1e-12)


# -- b. depth one: AA(1), SciPy's M = 1 -------------------------------------------------------
@pytest.mark.parametrize("name", ["F", "F2", "F3", "F6"])
def test_depth_one_is_scipys_m_one(name):
    """``history_depth=2`` (two pairs, one difference) is SciPy's ``Anderson(M=1)``: the same
    iterates to 1e-10 and the same step count, w0 = 0, no line search (SciPy's own solver on
    the same torch functions; measured: at most 2e-15 apart, 11 to 55 steps). On F5 and the
    linear system AA(1) diverges or stalls in both libraries alike."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    theirs, ok, singular = scipy_solve(
        fn, x0, nonlin.Anderson(M=1, w0=0), f_tol=1e-8, maxiter=300, line_search=None
    )
    ours, info = our_iterates(fn, x0, history_depth=2, tol=1e-8, max_iter=300)
    assert ok and not singular and bool(info.converged)
    assert len(ours) == len(theirs) == int(info.iterations) >= 2
    for a, b in zip(theirs, ours):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-10)


def test_depth_one_fixed_point_and_masked_loop():
    """AA(1) on a fixed point: eager and masked (vmap) loops agree, and it beats plain
    iteration's step count on a slowly contracting linear map (the secant of one difference
    is exact on the slowest mode's 1-dimensional direction)."""
    W, c = contraction(n=8, scale=0.95)
    g = lambda x: W @ x + c  # noqa: E731
    x0 = torch.zeros(8, dtype=D)
    x, info = aa.fixed_point(g, x0, tol=1e-10, history_depth=2, max_iter=500)
    xm, im = aa.fixed_point(g, x0, tol=1e-10, history_depth=2, max_iter=500, masked=True)
    assert bool(info.converged) and int(im.iterations) == int(info.iterations)
    torch.testing.assert_close(xm, x, rtol=0, atol=0)
    exact = torch.linalg.solve(torch.eye(8, dtype=D) - W, c)
    torch.testing.assert_close(x, exact, rtol=0, atol=1e-8)


# -- c. every call of g / F is counted --------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("alpha", [None, 0.5])
@pytest.mark.parametrize("line_search", [None, True])
def test_evaluations_count_every_call(alpha, line_search, masked):
    """``info.evaluations`` equals the calls of F, also with SciPy's alpha rule (whose F(x0)
    was not counted before issue 34: 19 calls, 18 reported) and with the line search."""
    if masked and line_search:
        return
    fn, x0 = PROBLEMS["F"]
    calls = []

    def counted(x):
        calls.append(1)
        return fn(x)

    x, info = aa.root(
        counted, torch.tensor(x0, dtype=D), alpha=alpha, tol=1e-8, line_search=line_search,
        masked=masked,
    )  # fmt: skip
    assert bool(info.converged) and int(info.evaluations) == len(calls)
    reference, _ = aa.root(fn, torch.tensor(x0, dtype=D), alpha=alpha, tol=1e-8)
    if not line_search:
        torch.testing.assert_close(x, reference, rtol=0, atol=0)

"""The solver's batches, depth one, counts, best iterate and stopping tests (issue 34).

References are independent of the code under test: SciPy's ``scipy.optimize.anderson``
(``nonlin_solve`` with ``Anderson(M=1)``), eager solves of one problem at a time, and NumPy.
"""

from __future__ import annotations

import torch
from torch.func import vmap

import aadl_func as aa

D = torch.float64


def contraction(n=6, seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g, dtype=D)
    W = scale * W / torch.linalg.matrix_norm(W, 2)
    c = torch.randn(n, generator=g, dtype=D)
    return W, c


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

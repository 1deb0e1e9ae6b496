r"""What a solve did: [`SolverInfo`][aadl_func.SolverInfo] and its status codes (shared by the
solvers' loops)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from aadl_func._src.state import allow_weights_only

__all__ = ["CALLBACK", "CONVERGED", "MAX_ITER", "NONFINITE", "REASONS", "SolverInfo"]

# Status codes of SolverInfo.status, indexing REASONS.
CONVERGED, MAX_ITER, NONFINITE, CALLBACK = range(4)
REASONS = ("converged", "max_iter", "nonfinite", "callback")


class SolverInfo(NamedTuple):
    """What a solve did. Tensors only, so the record also comes out of `vmap`.

    Attributes:
      iterations: 0-d int64, accepted steps (updates of `x`).
      evaluations: 0-d int64, calls of `g` or `F` (line-search trials included).
      residual_norms: 1-d float64, $\\|r_k\\|$ after `k` steps, `k = 0, 1, ...`
        (eager: `iterations + 1` entries; masked: one per round of the batch, a member that
        has stopped repeating its last value).
      converged: 0-d bool, the tolerance was met.
      status: 0-d int64, the reason code: 0 converged, 1 `max_iter` reached, 2 a non-finite
        residual (the step that produced it was not taken), 3 the callback asked to stop.
      returned_iteration: 0-d int64, the step `k` whose iterate $x_k$ was returned
        (`residual_norms[k]` is its residual): `iterations` when converged or without
        `return_best`, else the iterate with the lowest residual norm seen.
    """

    iterations: Tensor
    evaluations: Tensor
    residual_norms: Tensor
    converged: Tensor
    status: Tensor
    returned_iteration: Tensor

    @property
    def reason(self) -> str:
        """The status in words (eager results: one problem, not a batch)."""
        return REASONS[int(self.status)]


allow_weights_only(SolverInfo)

"""The small least-squares problem of Anderson acceleration, solved once, in float64.

Every mixing path (the pure :func:`aadl_func.mix` reference, the incremental window of
:func:`aadl_func.anderson`, the sharded window) reduces the window to the Gram matrix of its
residual vectors and calls :func:`solve_weights`. Keeping this in one place is what makes CPU
and GPU agree: AADL's users got different answers from ``torch.linalg.lstsq`` on the two
devices (pivoted QR on CPU, unpivoted QR on CUDA) exactly when the window was rank deficient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["MixingWeights", "solve_weights", "RTOL"]

# Eigenvalues of the projected Gram below RTOL * (largest residual norm squared) are treated
# as zero. Gram entries carry float64 rounding of order eps64 * ||f_i|| ||f_j||, so anything
# smaller than a few hundred eps64 is noise; 1e-13 keeps cond(DR) up to ~3e6 meaningful.
RTOL = 1e-13


class MixingWeights(NamedTuple):
    """Solution of the mixing problem for residuals ``f_0, ..., f_{q-1}`` (oldest first).

    Attributes:
      gamma: ``(q - 1,)`` float64, the least-squares coefficients on the residual differences.
      alpha: ``(q,)`` float64 affine weights, ``alpha = (gamma_0, gamma_1 - gamma_0, ...,
        1 - gamma_{q-2})``; they sum to one and minimise ``||sum_i alpha_i f_i||``.
      residual_norm: 0-d float64, ``||sum_i alpha_i f_i||`` (the mixed residual).
      ok: 0-d bool, False when the Gram matrix was not finite (the weights then fall back to
        ``alpha = e_last``, the plain iterate).
    """

    gamma: Tensor
    alpha: Tensor
    residual_norm: Tensor
    ok: Tensor


def solve_weights(gram: Tensor, num_valid: Tensor | int, reg: float = 0.0) -> MixingWeights:
    r"""Solves the regularised Anderson least-squares problem from a residual Gram matrix.

    With residuals :math:`F = [f_0, \dots, f_{q-1}]` (oldest first), their differences
    :math:`\Delta F = [f_1 - f_0, \dots, f_{q-1} - f_{q-2}] = F D` and the Gram matrix
    :math:`G = F^\top F`, this returns

    .. math::

        \gamma = \arg\min_\gamma \|f_{q-1} - \Delta F \gamma\|^2 + \mathrm{reg}\,\|\gamma\|^2
               = (D^\top G D + \mathrm{reg}\, I)^{+} D^\top G e_{q-1},

    the pseudo-inverse taken through a symmetric eigen-decomposition in float64 with
    eigenvalues below ``RTOL * max_i G_ii`` dropped. For a rank-deficient window this is the
    minimum-norm solution, a single well-defined answer on every device (pivoted and unpivoted
    QR return different ones). The float64 Gram squares the condition number of
    :math:`\Delta F`; with 16 digits that still resolves cond(DF) up to ~1e6, far beyond the
    float32 data the window holds, and the Gram is never formed in the history's precision.

    Only the last ``num_valid`` residuals take part (the window may not be full yet); the
    others get zero weight. Written without data-dependent Python control flow, so it runs
    under ``torch.func.vmap``.

    Args:
      gram: ``(q, q)`` float64 Gram matrix of the residuals in chronological order.
      num_valid: how many of the newest residuals are valid (0-d tensor or int).
      reg: absolute Tikhonov weight on :math:`\gamma` (``reg >= 0``).

    Returns:
      :class:`MixingWeights`.
    """
    q = gram.shape[-1]
    if q < 2:
        raise ValueError(f"the mixing problem needs at least 2 residuals, got a {q}x{q} Gram")
    dev = gram.device
    gram = gram.to(torch.float64)
    index = torch.arange(q, device=dev)
    num_valid = torch.as_tensor(num_valid, device=dev)
    valid = index >= q - num_valid
    pair = valid[:, None] & valid[None, :]
    ok = torch.isfinite(torch.where(pair, gram, 0.0)).all()
    g = torch.where(pair & ok, gram, 0.0)

    # D^T G D and D^T G e_last without forming D: differences of rows, then of columns.
    g_cols = g[:, 1:] - g[:, :-1]
    h = g_cols[1:, :] - g_cols[:-1, :]
    b = g[1:, -1] - g[:-1, -1]

    gamma_valid = valid[:-1]
    gmax = torch.diagonal(g).max()
    unit = torch.where(gmax > 0, gmax, torch.ones_like(gmax))
    # Invalid unknowns get a decoupled diagonal of the problem's own scale: gamma_j = 0 there.
    h = torch.where(gamma_valid[:, None] & gamma_valid[None, :], h, 0.0)
    h = h + torch.diag(torch.where(gamma_valid, 0.0, unit))
    b = torch.where(gamma_valid, b, 0.0)

    eigvals, eigvecs = torch.linalg.eigh(h)
    shifted = eigvals.clamp(min=0.0) + reg
    keep = shifted > RTOL * unit
    inverse = torch.where(keep, 1.0 / torch.where(keep, shifted, 1.0), 0.0)
    gamma = eigvecs @ (inverse * (eigvecs.mT @ b))
    gamma = torch.where(gamma_valid, gamma, 0.0)

    alpha = torch.cat([gamma[:1], gamma[1:] - gamma[:-1], 1.0 - gamma[-1:]])
    residual_sq = (alpha @ g @ alpha).clamp(min=0.0)
    return MixingWeights(gamma, alpha, residual_sq.sqrt(), ok)

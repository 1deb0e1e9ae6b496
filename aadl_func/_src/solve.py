r"""The small least-squares problem of Anderson acceleration, solved once, in float64.

Every mixing path reduces the window to a few float64 inner products and solves the small
problem with :func:`solve_coefficients`: the pure :func:`aadl_func.mix` forms
:math:`\Delta F^\top \Delta F` from an explicit window, the incremental window of
:func:`aadl_func.anderson` (sharded or not) keeps it row by row and calls
:func:`solve_differences`, and :func:`solve_weights` starts from a residual Gram matrix alone.
Keeping this in one place is what makes CPU and GPU agree: AADL's users got different answers
from ``torch.linalg.lstsq`` on the two devices (pivoted QR on CPU, unpivoted QR on CUDA)
exactly when the window was rank deficient."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["MixingWeights", "solve_weights", "solve_coefficients", "solve_differences", "RTOL"]

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

    Forming :math:`D^\top G D` from :math:`G` cancels when the residuals change little across
    the window: the entries of :math:`G` carry rounding of order
    :math:`\epsilon \max_i \|f_i\|^2`, so :math:`\gamma` is accurate to about
    :math:`\epsilon\, (\max_i \|f_i\| / \sigma_{\min}(\Delta F))^2` rather than
    :math:`\epsilon\, \mathrm{cond}(\Delta F)^2`. Callers holding the differences should
    use :func:`solve_differences`, as :func:`aadl_func.mix` and the incremental window do.

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

    # Scaled to max_i ||f_i||^2 = 1 (|G_ij| <= 1), so differencing cannot overflow near the
    # float64 limit and eigh sees O(1) entries whatever the parameters' scale.
    gmax = torch.diagonal(g).max()
    unit = torch.where(gmax > 0, gmax, torch.ones_like(gmax))
    g = g / unit

    # D^T G D and D^T G e_last without forming D: differences of rows, then of columns.
    g_cols = g[:, 1:] - g[:, :-1]
    h = g_cols[1:, :] - g_cols[:-1, :]
    b = g[1:, -1] - g[:-1, -1]

    weights = solve_differences(h, b, torch.diagonal(g), num_valid, reg / unit)
    return weights._replace(residual_norm=weights.residual_norm * unit.sqrt(), ok=ok & weights.ok)


def solve_coefficients(
    dr_gram: Tensor,
    dr_rhs: Tensor,
    residual_scale: Tensor,
    reg: float = 0.0,
    valid: Tensor | None = None,
) -> Tensor:
    r"""The regularised least-squares coefficients from the normal equations of :math:`\Delta F`.

    Returns :math:`\gamma = (H + \mathrm{reg}\, I)^{+} c` with :math:`H = \Delta F^\top \Delta F`
    (``dr_gram``) and :math:`c = \Delta F^\top f_{q-1}` (``dr_rhs``), the pseudo-inverse taken
    through a float64 symmetric eigen-decomposition whose eigenvalues below
    ``RTOL * residual_scale`` are dropped (``residual_scale`` is :math:`\max_i \|f_i\|^2`, so
    differences at the rounding level of the residuals never produce huge coefficients; a
    rank-deficient problem gets its minimum-norm solution).

    This is the single place where the small problem is solved; :func:`solve_differences`
    (validity masks, scaling, the affine weights) is its one caller, reached from explicit
    differences (:func:`aadl_func.mix`, the incremental window) or from a residual Gram matrix
    (:func:`solve_weights`).

    Args:
      dr_gram: ``(m, m)`` float64 :math:`H`.
      dr_rhs: ``(m,)`` float64 :math:`c`.
      residual_scale: 0-d float64, :math:`\max_i \|f_i\|^2` (1 is used when it is 0).
      reg: absolute Tikhonov weight, ``>= 0``.
      valid: optional ``(m,)`` bool mask; the other unknowns are decoupled and get
        :math:`\gamma_j = 0`.

    Returns:
      ``(m,)`` float64 :math:`\gamma`.
    """
    unit = torch.where(residual_scale > 0, residual_scale, torch.ones_like(residual_scale))
    h, b = dr_gram, dr_rhs
    if valid is not None:
        # Invalid unknowns get a decoupled diagonal of the problem's own scale: gamma_j = 0.
        h = torch.where(valid[:, None] & valid[None, :], h, 0.0)
        h = h + torch.diag(torch.where(valid, 0.0, unit))
        b = torch.where(valid, b, 0.0)

    eigvals, eigvecs = torch.linalg.eigh(h)
    shifted = eigvals.clamp(min=0.0) + reg
    keep = shifted > RTOL * unit
    inverse = torch.where(keep, 1.0 / torch.where(keep, shifted, 1.0), 0.0)
    gamma = eigvecs @ (inverse * (eigvecs.mT @ b))
    if valid is not None:
        gamma = torch.where(valid, gamma, 0.0)
    # Inputs at the edge of the float64 range can still round to Inf/NaN: fall back to
    # gamma = 0, the plain newest iterate, rather than let them reach the parameters.
    return torch.where(torch.isfinite(gamma).all(), gamma, 0.0)


def solve_differences(
    dr_gram: Tensor,
    dr_rhs: Tensor,
    residual_sq: Tensor,
    num_valid: Tensor | int,
    reg: float = 0.0,
) -> MixingWeights:
    r"""Solves the mixing problem from the inner products of the residual differences.

    The incremental window keeps, in float64, :math:`H = \Delta F^\top \Delta F`,
    :math:`c = \Delta F^\top f_{q-1}` and :math:`\|f_i\|^2`, each entry computed from the
    differences :math:`f_{j+1} - f_j` formed element by element (exact in float64 for float32
    data). Unlike differencing :math:`F^\top F` (:func:`solve_weights`), nothing cancels when
    the residuals change little across the window, so the weights agree with
    :func:`aadl_func.mix` to :math:`\epsilon\, \mathrm{cond}(\Delta F)^2`.

    Args:
      dr_gram: ``(q - 1, q - 1)`` float64 :math:`H`, chronological.
      dr_rhs: ``(q - 1,)`` float64 :math:`c`, chronological.
      residual_sq: ``(q,)`` float64 :math:`\|f_i\|^2`, chronological.
      num_valid: how many of the newest residuals are valid (0-d tensor or int).
      reg: absolute Tikhonov weight on :math:`\gamma`, ``>= 0``.

    Returns:
      :class:`MixingWeights`; ``residual_norm`` is
      :math:`(\|f_{q-1}\|^2 - 2 \gamma^\top c + \gamma^\top H \gamma)^{1/2}`.
    """
    q = residual_sq.shape[-1]
    dev = residual_sq.device
    num_valid = torch.as_tensor(num_valid, device=dev)
    valid = torch.arange(q, device=dev) >= q - num_valid
    gamma_valid = valid[:-1]
    pair = gamma_valid[:, None] & gamma_valid[None, :]
    h = torch.where(pair, dr_gram, 0.0)
    c = torch.where(gamma_valid, dr_rhs, 0.0)
    norms = torch.where(valid, residual_sq, 0.0)
    ok = torch.isfinite(h).all() & torch.isfinite(c).all() & torch.isfinite(norms).all()
    h, c, norms = (torch.where(ok, t, 0.0) for t in (h, c, norms))
    # Scaled to max_i ||f_i||^2 = 1, as in solve_weights: O(1) entries whatever the scale.
    unit = norms.max()
    unit = torch.where(unit > 0, unit, torch.ones_like(unit))
    h, c = h / unit, c / unit
    gamma = solve_coefficients(h, c, torch.ones_like(unit), reg / unit, valid=gamma_valid)
    alpha = torch.cat([gamma[:1], gamma[1:] - gamma[:-1], 1.0 - gamma[-1:]])
    mixed_sq = norms[-1] / unit - 2.0 * (gamma @ c) + gamma @ h @ gamma
    return MixingWeights(gamma, alpha, (mixed_sq.clamp(min=0.0) * unit).sqrt(), ok)

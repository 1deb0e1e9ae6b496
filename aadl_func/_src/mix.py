"""The pure AADL extrapolation over an explicit window: the reference every fast path matches."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.solve import MixingWeights, solve_differences
from aadl_func._src.validation import check_float

__all__ = ["mix", "mixing_weights", "aadl_coefficients"]


def _window_leaves(history: Any) -> tuple[list[Tensor], Any, int]:
    """The tensor leaves of ``history`` and its tree spec, checked to share a window dim >= 3.

    A leaf of shape ``(k,)`` holds ``k`` scalar iterates, which makes sense next to leaves of
    higher rank (a scalar parameter of a model); a history whose leaves are all 1-d is refused,
    since a single vector of ``n`` numbers would otherwise be read as ``n`` scalar iterates.
    """
    leaves, spec = tree.flatten(history, "history")
    if not leaves:
        raise ValueError("`history` must contain at least one tensor")
    first = leaves[0]
    window = first.shape[0] if first.dim() > 0 else 0
    for i, leaf in enumerate(leaves):
        if leaf.dim() == 0 or leaf.shape[0] != window:
            if i == 0:
                expected = "a leading window dimension (shape (k, ...), oldest iterate first)"
            else:
                expected = (
                    f"a leading window dimension of size {window} like "
                    f"`{tree.leaf_path(spec, 0, 'history')}`"
                )
            raise ValueError(
                f"`{tree.leaf_path(spec, i, 'history')}` must have {expected}, "
                f"got shape {tuple(leaf.shape)}"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"`{tree.leaf_path(spec, i, 'history')}` must be floating point, got {leaf.dtype}"
            )
    if all(leaf.dim() == 1 for leaf in leaves):
        raise ValueError(
            f"`history` must have a leaf of shape (k, n, ...): every leaf is 1-d (shape "
            f"{tuple(first.shape)}), which would be read as {window} iterates of a scalar; "
            "stack the iterates along a new first dimension (torch.stack(iterates)), or pass "
            "shape (k, 1) for k scalar iterates"
        )
    if window < 3:
        raise ValueError(f"`history` must hold at least 3 iterates (oldest first), got {window}")
    return leaves, spec, window


def _solve(leaves: list[Tensor], window: int, reg: float) -> tuple[MixingWeights, list]:
    r"""The AADL weights of the window, with the float64 differences of every leaf.

    The normal equations are formed from the second differences themselves,
    :math:`H = \Delta R^\top \Delta R` and :math:`c = \Delta R^\top \Delta X_{:, -1}`, all in
    float64: differencing a residual Gram matrix instead would cancel catastrophically when
    consecutive steps are nearly equal (slowly varying steps are the common case in training).
    """
    solve_device = leaves[0].device
    m = window - 2
    h = torch.zeros(m, m, dtype=torch.float64, device=solve_device)
    c = torch.zeros(m, dtype=torch.float64, device=solve_device)
    residual_sq = torch.zeros(window - 1, dtype=torch.float64, device=solve_device)
    per_leaf = []
    for leaf in leaves:
        x = leaf.reshape(window, -1).to(torch.float64)
        dx = x[1:] - x[:-1]
        dr = dx[1:] - dx[:-1]
        h = h + (dr @ dr.mT).to(solve_device)
        c = c + (dr @ dx[-1]).to(solve_device)
        residual_sq = residual_sq + (dx * dx).sum(-1).to(solve_device)
        per_leaf.append((x, dx, dr))
    # Non-finite sums (an overflowing window) give ok = False and gamma = 0: the newest iterate.
    weights = solve_differences(h, c, residual_sq, window - 1, reg)
    # ||DX[:, -1] - DR gamma|| from the data, not from the (cancelling) quadratic form.
    mixed_sq = torch.zeros((), dtype=torch.float64, device=solve_device)
    for _, dx, dr in per_leaf:
        r = dx[-1] - weights.gamma.to(dr.device) @ dr
        mixed_sq = mixed_sq + (r * r).sum().to(solve_device)
    residual_norm = torch.where(weights.ok, mixed_sq, 0.0).sqrt()
    return weights._replace(residual_norm=residual_norm), per_leaf


def mixing_weights(history: Any, *, reg: float = 0.0) -> MixingWeights:
    r"""Diagnostics of :func:`mix`: the AADL least-squares coefficients for a window.

    Returns :class:`MixingWeights` ``(gamma, alpha, residual_norm, ok)`` for the residuals
    ``DX[:, i] = X[:, i+1] - X[:, i]`` of ``history`` (see :func:`mix`): ``gamma`` minimises
    :math:`\|\Delta X_{:, -1} - \Delta R\,\gamma\|^2 + \mathrm{reg}\,\|\gamma\|^2`,
    ``residual_norm`` is :math:`\|\Delta X_{:, -1} - \Delta R\,\gamma\|` and ``ok`` is False
    when the window's float64 inner products overflowed (then ``gamma = 0``).
    """
    reg = check_float("mixing_weights", "reg", reg, minimum=0.0)
    leaves, _, window = _window_leaves(history)
    weights, _ = _solve(leaves, window, reg)
    return weights


def aadl_coefficients(alpha: Tensor, relaxation: float) -> Tensor:
    r"""Weights ``c`` with ``mix = x_last - sum_j c_j DX[:, j]`` (float64, oldest first).

    Writing every window entry through the newest one, :math:`x_i = x_{k-1} - \sum_{j \ge i}
    \Delta x_j`, the relaxed AADL point
    :math:`\sum_i \alpha_i((1-\beta) x_i + \beta x_{i+1})` becomes
    :math:`x_{k-1} - \sum_j (A_j - \beta \alpha_j) \Delta x_j` with
    :math:`A = \mathrm{cumsum}(\alpha)`.
    """
    return torch.cumsum(alpha, 0) - relaxation * alpha


def mix(history: Any, *, relaxation: float = 1.0, reg: float = 0.0) -> Any:
    r"""AADL's Anderson extrapolation of a window of iterates (pure, float64 inside).

    ``history`` is a tensor or pytree whose leaves share a leading window dimension
    :math:`k \ge 3`, oldest first; the leaves together form the columns
    :math:`X = [x_0, \dots, x_{k-1}]`. With :math:`\Delta X[:, i] = x_{i+1} - x_i` and
    :math:`\Delta R[:, i] = \Delta X[:, i+1] - \Delta X[:, i]`:

    .. math::

        \gamma &= \arg\min_\gamma \|\Delta X[:, -1] - \Delta R\,\gamma\|^2
                  + \mathrm{reg}\,\|\gamma\|^2 \\
        x_{\mathrm{extr}} &= X[:, -2] + \Delta X[:, -1] - (\Delta X[:, :-1] + \Delta R)\,\gamma \\
        x &= \beta\, x_{\mathrm{extr}} + (1 - \beta)\, X[:, :-1]\,\alpha, \quad
        \alpha = (\gamma_0, \gamma_1 - \gamma_0, \dots, 1 - \gamma_{k-3})

    with :math:`\beta` = ``relaxation``. The differences, the normal equations
    :math:`\Delta R^\top \Delta R` and :math:`\Delta R^\top \Delta X[:, -1]` and the combination
    are all formed in float64 and the small problem is solved by
    :func:`aadl_func._src.solve.solve_differences` (eigen-decomposition pseudo-inverse, one
    algorithm on every device); the result is cast back to each leaf's dtype. Finite input
    gives finite output: should the float64 sums or the combination overflow, the newest
    iterate is returned instead.

    Args:
      history: tensor or pytree of tensors with a leading window dimension, oldest first.
      relaxation: :math:`\beta > 0` (1 is undamped, above 1 over-relaxes).
      reg: absolute Tikhonov weight on :math:`\gamma`, ``>= 0``.

    Returns:
      One slice of ``history``'s structure: the extrapolated point.

    References:
      Walker & Ni, "Anderson acceleration for fixed-point iterations", SINUM 2011.
      Lupo Pasini, Reshniak, Stoyanov, "Anderson acceleration for distributed training of
      deep learning models", SoutheastCon 2022.
    """
    relaxation = check_float("mix", "relaxation", relaxation, minimum=0.0, strict=True)
    reg = check_float("mix", "reg", reg, minimum=0.0)
    leaves, spec, window = _window_leaves(history)
    weights, per_leaf = _solve(leaves, window, reg)
    coefficients = aadl_coefficients(weights.alpha, relaxation)
    mixed, newest = [], []
    for leaf, (x, dx, _) in zip(leaves, per_leaf):
        c = coefficients.to(dx.device)
        combined = x[-1] - c @ dx
        mixed.append(combined.to(leaf.dtype).reshape(leaf.shape[1:]))
        newest.append(leaf[-1])
    finite = weights.ok
    for m in mixed:
        finite = finite & torch.isfinite(m).all().to(finite.device)
    out = [torch.where(finite.to(m.device), m, n) for m, n in zip(mixed, newest)]
    return tree.unflatten(spec, out)

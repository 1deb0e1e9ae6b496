"""The pure AADL extrapolation over an explicit window: the reference every fast path matches."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.solve import MixingWeights, solve_weights
from aadl_func._src.validation import check_float

__all__ = ["mix", "mixing_weights", "aadl_coefficients"]


def _window_differences(history: Any) -> tuple[list[Tensor], list[Tensor], Any, Tensor]:
    """Float64 flattened iterates and their differences per leaf, plus the summed Gram."""
    leaves, spec = tree.flatten(history, "history")
    if not leaves:
        raise ValueError("`history` must contain at least one tensor")
    window = leaves[0].shape[0] if leaves[0].dim() > 0 else 0
    for i, leaf in enumerate(leaves):
        if leaf.dim() == 0 or leaf.shape[0] != window:
            raise ValueError(
                f"`history` leaf {i} must have a leading window dimension of size {window}, "
                f"got shape {tuple(leaf.shape)}"
            )
        if not leaf.is_floating_point():
            raise TypeError(f"`history` leaf {i} must be floating point, got {leaf.dtype}")
    if window < 3:
        raise ValueError(f"`history` must hold at least 3 iterates (oldest first), got {window}")
    solve_device = leaves[0].device
    iterates = [leaf.reshape(window, -1).to(torch.float64) for leaf in leaves]
    differences = [x[1:] - x[:-1] for x in iterates]
    gram = sum((d @ d.mT).to(solve_device) for d in differences)
    return iterates, differences, spec, gram


def mixing_weights(history: Any, *, reg: float = 0.0) -> MixingWeights:
    """Diagnostics of :func:`mix`: the AADL least-squares coefficients for a window.

    Returns :class:`MixingWeights` ``(gamma, alpha, residual_norm, ok)`` for the residuals
    ``DX[:, i] = X[:, i+1] - X[:, i]`` of ``history`` (see :func:`mix`).
    """
    reg = check_float("mixing_weights", "reg", reg, minimum=0.0)
    _, _, _, gram = _window_differences(history)
    return solve_weights(gram, gram.shape[-1], reg)


def aadl_coefficients(alpha: Tensor, relaxation: float) -> Tensor:
    r"""Weights ``c`` with ``mix = x_last - sum_j c_j DX[:, j]`` (float64, oldest first).

    Writing every window entry through the newest one, :math:`x_i = x_{k-1} - \sum_{j \ge i}
    \Delta x_j`, the relaxed AADL point
    :math:`\sum_i \alpha_i((1-\beta) x_i + \beta x_{i+1})` becomes
    :math:`x_{k-1} - \sum_j (A_j - \beta \alpha_j) \Delta x_j` with :math:`A = \mathrm{cumsum}(\alpha)`.
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

    with :math:`\beta` = ``relaxation``. The least-squares problem is solved by
    :func:`aadl_func.solve_weights` (float64, eigen-decomposition pseudo-inverse, one algorithm
    on every device); the combination is formed in float64 and cast back to each leaf's dtype.
    Finite input gives finite output: should the combination overflow the leaf dtype, the
    newest iterate is returned instead.

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
    iterates, differences, spec, gram = _window_differences(history)
    weights = solve_weights(gram, gram.shape[-1], reg)
    coefficients = aadl_coefficients(weights.alpha, relaxation)
    leaves, _ = tree.flatten(history, "history")
    mixed, newest = [], []
    for leaf, x, dx in zip(leaves, iterates, differences):
        c = coefficients.to(dx.device)
        combined = x[-1] - c @ dx
        mixed.append(combined.to(leaf.dtype).reshape(leaf.shape[1:]))
        newest.append(leaf[-1])
    finite = weights.ok
    for m in mixed:
        finite = finite & torch.isfinite(m).all().to(finite.device)
    out = [torch.where(finite.to(m.device), m, n) for m, n in zip(mixed, newest)]
    return tree.unflatten(spec, out)

"""`mix`: AADL's extrapolation over an explicit, stacked window (no state, no ring).

It is the package's reference for the step: `update` does not call it, but mixes with the
same solver (`aadl_func._src.core.lstsq.solve_factor()` for float64 windows) and the same
coefficients (`aadl_func._src.core.variants.aadl.aadl_coefficients()`) over its ring, and the tests
hold the two to each other and both to NumPy references written from the mathematics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.core.lstsq import MixingWeights, solve_factor
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.exec.ops import OPS
from aadl_func._src.validation import check_float
from aadl_func._src.window import difference_factor

__all__ = ["mix", "mixing_weights"]


def _window_leaves(history: Any) -> tuple[list[Tensor], Any, int]:
    """The tensor leaves of `history` and its tree spec, checked to share a window dim >= 3.

    A leaf of shape `(k,)` holds `k` scalar iterates, which makes sense next to leaves of
    higher rank (a scalar parameter of a model); a history whose leaves are all 1-d is refused,
    since a single vector of `n` numbers would otherwise be read as `n` scalar iterates.
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
    r"""The AADL weights of the window, with the float64 iterates and steps of every leaf.

    The steps $\Delta X$ are formed in float64 (element by element, exact for float32
    or bf16 windows); $A = [\Delta R \mid \Delta X_{:, -1}]$ is then reduced, chunk of
    coordinates by chunk, leaf by leaf, to its `(m + 1) x (m + 1)` factor by Householder
    QR (`aadl_func._src.window.difference_factor()`, a TSQR; the second differences are
    formed chunk by chunk, exactly as `numpy.diff` forms them), and the small problem is
    solved from it by `aadl_func._src.core.lstsq.solve_factor()`. No normal equations: the
    condition number of $\Delta R$ enters once, which makes this the most accurate path
    of the library (and $O(m^2 n)$, where the incremental window of
    [`aadl_func.anderson()`][aadl_func.anderson] is $O(m n)$ for float32/bf16 windows).
    """
    solve_device = leaves[0].device
    per_leaf = []
    for leaf in leaves:
        x = leaf.reshape(window, -1).to(torch.float64)
        per_leaf.append((x, x[1:] - x[:-1]))
    steps = [[dx[i] for _, dx in per_leaf] for i in range(window - 1)]
    order = torch.arange(window - 1)
    valid = torch.ones(window - 2, dtype=torch.bool)
    factor = difference_factor(steps, order, valid, solve_device)
    # A non-finite factor (an overflowing window) gives ok = False and gamma = 0: the newest
    # iterate.
    return solve_factor(factor, valid.to(solve_device), reg, ops=OPS), per_leaf


def mixing_weights(history: Any, *, reg: float = 0.0) -> MixingWeights:
    r"""Diagnostics of [`mix()`][aadl_func.mix]: the AADL least-squares coefficients for a window.

    Returns [`MixingWeights`][aadl_func.MixingWeights] `(gamma, alpha, residual_norm, ok)` for the
    residuals `DX[:, i] = X[:, i+1] - X[:, i]` of `history` (see [`mix()`][aadl_func.mix]): `gamma`
    minimises $\|\Delta X_{:, -1} - \Delta R\,\gamma\|^2 + \mathrm{reg}\,\|\gamma\|^2$,
    `residual_norm` is $\|\Delta X_{:, -1} - \Delta R\,\gamma\|$ and `ok` is False
    when the window's float64 differences or their factor overflowed (then `gamma = 0`).
    """
    reg = check_float("mixing_weights", "reg", reg, minimum=0.0)
    leaves, _, window = _window_leaves(history)
    weights, _ = _solve(leaves, window, reg)
    return weights


def mix(history: Any, *, relaxation: float = 1.0, reg: float = 0.0) -> Any:
    r"""AADL's Anderson extrapolation of a window of iterates (pure, float64 inside).

    `history` is a tensor or pytree whose leaves share a leading window dimension
    $k \ge 3$, oldest first; the leaves together form the columns
    $X = [x_0, \dots, x_{k-1}]$. With $\Delta X[:, i] = x_{i+1} - x_i$ and
    $\Delta R[:, i] = \Delta X[:, i+1] - \Delta X[:, i]$:

    $$
    \gamma &= \arg\min_\gamma \|\Delta X[:, -1] - \Delta R\,\gamma\|^2
              + \mathrm{reg}\,\|\gamma\|^2 \\
    x_{\mathrm{extr}} &= X[:, -2] + \Delta X[:, -1] - (\Delta X[:, :-1] + \Delta R)\,\gamma \\
    x &= \beta\, x_{\mathrm{extr}} + (1 - \beta)\, X[:, :-1]\,\alpha, \quad
    \alpha = (\gamma_0, \gamma_1 - \gamma_0, \dots, 1 - \gamma_{k-3})
    $$

    with $\beta$ = `relaxation`. The differences and the combination are formed in
    float64; $\gamma$ comes from a float64 Householder QR of
    $[\Delta R \mid \Delta X[:, -1]]$ and an SVD of its small triangular factor
    (`aadl_func._src.core.lstsq.solve_factor()`: singular values of $\Delta R$ with
    $\sigma^2 + \mathrm{reg} \le (10^{-13} s)^2$ dropped, $s$ the largest column
    norm, which gives the minimum-norm answer on rank-deficient windows). The error is about
    $\epsilon_{64}\,\mathrm{cond}(\Delta R)$ relative, never squared, and near
    $\epsilon_{64}$ when the ill-conditioning is only the columns' scales. The result is
    cast back to each leaf's dtype. Finite input gives finite output: should the float64
    differences, the factor or the combination overflow, the newest iterate is returned
    instead.

    Args:
      history: tensor or pytree of tensors with a leading window dimension, oldest first.
      relaxation: $\beta > 0$ (1 is undamped, above 1 over-relaxes).
      reg: absolute Tikhonov weight on $\gamma$, `>= 0`.

    Returns:
      One slice of `history`'s structure: the extrapolated point.

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
    for leaf, (x, dx) in zip(leaves, per_leaf):
        c = coefficients.to(dx.device)
        combined = x[-1] - c @ dx
        mixed.append(combined.to(leaf.dtype).reshape(leaf.shape[1:]))
        newest.append(leaf[-1])
    finite = weights.ok
    for m in mixed:
        finite = finite & torch.isfinite(m).all().to(finite.device)
    out = [torch.where(finite.to(m.device), m, n) for m, n in zip(mixed, newest)]
    return tree.unflatten(spec, out)

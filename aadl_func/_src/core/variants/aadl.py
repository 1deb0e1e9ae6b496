r"""Mode `"aadl"` (AADL's semantics): the window holds the plain iterates $x_0, \dots,
x_{k-1}$ as the newest one (the anchor) and the differences $\Delta x_j = x_{j+1} - x_j$;
the mix is $\sum_i \alpha_i ((1 - \beta) x_i + \beta x_{i+1})$, $\beta$ the relaxation."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

__all__ = ["aadl_coefficients", "base_bound", "last_plain_step", "mix_bound"]


def aadl_coefficients(
    alpha: Tensor | list[float], relaxation: float, *, negated: bool = False
) -> Tensor | list[float]:
    r"""Weights `c` with `mix = x_last - sum_j c_j DX[:, j]` (float64, oldest first).

    Writing every window entry through the newest one, $x_i = x_{k-1} - \sum_{j \ge i}
    \Delta x_j$, the relaxed AADL point
    $\sum_i \alpha_i((1-\beta) x_i + \beta x_{i+1})$ becomes
    $x_{k-1} - \sum_j (A_j - \beta \alpha_j) \Delta x_j$ with
    $A = \mathrm{cumsum}(\alpha)$.

    `negated=True` returns `-c`, formed by the swapped subtraction (`b - a` rounds to
    exactly `-(a - b)`), one operation fewer than negating `c`. `alpha` given as a list
    (`solve_known()`): `c` as a list, with the same roundings (the cumulative sum from 0,
    one addition after another, as torch's CPU `cumsum` of a float64 vector).
    """
    if isinstance(alpha, list):
        partial = list(itertools.accumulate(alpha, initial=0.0))[1:]
        if negated:
            return [relaxation * a - p for a, p in zip(alpha, partial)]
        return [p - relaxation * a for a, p in zip(alpha, partial)]
    if negated:
        return relaxation * alpha - torch.cumsum(alpha, 0)
    return torch.cumsum(alpha, 0) - relaxation * alpha


def mix_bound(options: Any, alpha: Tensor, norms: Tensor, base: Tensor) -> Tensor:
    r"""A bound of every entry of $x^+ = a - \sum_s c_s r_s$:
    $A + \sum_s |c_s| \|r_s\|$, $A$ the base's bound."""
    c = aadl_coefficients(alpha, options.relaxation).abs()
    return base + torch.where(c > 0, c * norms, 0.0).sum()


def base_bound(anchor: Tensor, params: Tensor, updates: Tensor) -> Tensor:
    r"""A bound of the combination's base, the anchor old or new, from the largest
    magnitudes of the old anchor, the params $x$ and the updates $u$: the new anchor
    $y = x + u$ is bounded by $\max|x| + \max|u|$ (also when $x$ already holds $y$)."""
    return torch.maximum(anchor, params + updates)


def last_plain_step(anchor: list[Tensor]) -> list[Tensor]:
    """The previous call's plain step $y_{k-1}$: the anchor, the newest plain iterate (stored
    on every call with `store_each_nth = 1`), as fresh tensors."""
    return [a.clone() for a in anchor]

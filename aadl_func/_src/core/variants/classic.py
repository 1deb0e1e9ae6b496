r"""Mode `"classic"` (textbook type-II Anderson acceleration): the window holds the pairs
$(x_i, g(x_i))$ as the newest point, the differences $\Delta x_j = x_j - x_{j-1}$ and the
residuals $f_i = g(x_i) - x_i$; the mix is $\sum_i \alpha_i (x_i + \beta f_i)$."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

__all__ = ["base_bound", "classic_coefficients", "last_plain_step", "mix_bound"]


def classic_coefficients(alpha: Tensor | list[float]) -> Tensor | list[float]:
    r"""Weights `w` with $\sum_i \alpha_i x_i = x_{\mathrm{last}} + \sum_j w_j
    \Delta x_j$ (float64, oldest first), $\Delta x_j = x_j - x_{j-1}$.

    Writing every point through the newest one, $x_i = x_{\mathrm{last}} - \sum_{j > i}
    \Delta x_j$, and using $\sum_i \alpha_i = 1$:
    $w_j = -\sum_{i < j} \alpha_i$, so $w_0 = 0$: the oldest difference (to a
    point outside the window) is never used. Mode "classic" keeps its points this way.
    `alpha` given as a list: `w` as a list, with the same roundings.
    """
    if isinstance(alpha, list):
        partial = list(itertools.accumulate(alpha, initial=0.0))[1:-1]
        return [0.0, *(-p for p in partial)]
    partial = torch.cumsum(alpha, 0)
    return torch.cat([torch.zeros_like(partial[:1]), -partial[:-1]])


def mix_bound(options: Any, alpha: Tensor, norms: Tensor, base: Tensor) -> Tensor:
    r"""A bound of every entry of $x^+ = \sum_i \alpha_i (x_i + \beta f_i)$:
    $A \sum_i |\alpha_i| + \beta \sum_i |\alpha_i| \|f_i\|$."""
    a = alpha.abs()
    return base * a.sum() + options.relaxation * torch.where(a > 0, a * norms, 0.0).sum()


def base_bound(anchor: Tensor, params: Tensor, steps: Tensor, num_slots: int) -> Tensor:
    r"""A bound of every iterate $x_i = a - \sum_{j > i} \Delta x_j$ from the largest
    magnitudes of the old anchor, the params (the new anchor $a = x$) and the stored steps:
    $\max|a| + Q \max|\Delta x|$ over the old and the new ones ($\Delta x = x - a_{old}$,
    bounded by $\max|x| + \max|a_{old}|$), $Q$ = `num_slots`."""
    step = torch.maximum(steps, anchor + params)
    return torch.maximum(anchor, params) + num_slots * step


def last_plain_step(anchor: list[Tensor], newest: list[Tensor]) -> list[Tensor]:
    """The previous call's plain step $y_{k-1} = x_{k-1} + f_{k-1}$: the anchor plus the
    newest residual, added in the params' dtype as the plain step was (exact for a window
    in the params' dtype; a lower `history_dtype` rounds $f_{k-1}$)."""
    return [a + f.to(a.dtype) for a, f in zip(anchor, newest)]

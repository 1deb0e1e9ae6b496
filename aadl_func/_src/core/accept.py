r"""The rules that keep or drop a mix, each a small function over explicit values.

The execution layer decides how a verdict is applied (a Python branch when it is known, a
mask under vmap and torch.compile, the same value on every rank when sharded); what the
verdict is, is decided here. Each works on 0-d tensors, and where noted on Python numbers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "INF",
    "beats",
    "in_range",
    "judged_loss",
    "rejects_pending",
    "spread_exceeds",
    "skips_exhausted",
    "sufficient_bar",
]

# A `pending_loss` with nothing to judge.
INF = math.inf


def beats(loss_mix: Tensor, loss_plain: Tensor) -> Tensor:
    r"""The `loss_fn` safeguard (spec step 4): the mix $x$ is kept only if
    $\ell(x) < \ell(y)$, $y$ the plain step, and $\ell(x)$ is finite (NaN loses)."""
    return torch.isfinite(loss_mix) & (loss_mix < loss_plain)


def judged_loss(loss: Tensor | float) -> Tensor | float:
    r"""The deferred safeguard's bar for the mix returned now: the loss $\ell(x_k)$ at the
    point it was made from, or $+\infty$ (nothing to judge) when that loss is not finite.
    A 0-d tensor or a Python number alike."""
    if isinstance(loss, float):
        return loss if math.isfinite(loss) else INF
    return torch.where(torch.isfinite(loss), loss, INF)


def sufficient_bar(loss: Tensor, slope: Tensor, c: float) -> Tensor:
    r"""The deferred safeguard's bar with a sufficient-decrease factor $c$ (Armijo's
    condition with the plain step as the yardstick): $\ell(x_k) + c\,\langle \nabla
    \ell(x_k), u_k \rangle$, `slope` the inner product of the gradient and the inner
    update at $x_k$. A slope that is not negative (not a descent step) or not finite asks
    for no more than a decrease: the bar is the loss."""
    descent = torch.isfinite(slope) & (slope < 0)
    return torch.where(descent, loss + c * torch.where(descent, slope, 0.0), loss)


def rejects_pending(pending: Tensor | float, loss: Tensor | float) -> Tensor | bool:
    r"""The deferred verdict on the previous call's mix: rejected when one is pending
    (`pending` finite) and the loss at it, `loss`, is not below `pending`, the loss at the
    point it was made from (NaN is not below anything). 0-d tensors or Python numbers."""
    if isinstance(pending, float):
        return math.isfinite(pending) and not loss < pending
    return torch.isfinite(pending) & ~(loss < pending)


def in_range(low: Tensor | float, high: Tensor | float, dtype: torch.dtype) -> Tensor | bool:
    """Whether values whose extremes are `low` and `high` are finite in `dtype` (a float32
    mix of fp16 params can be finite and still overflow there). NaN fails both comparisons.
    Tensors or Python numbers alike."""
    limit = torch.finfo(dtype).max
    return (low >= -limit) & (high <= limit)


def spread_exceeds(count: Tensor, variance_sum: Tensor, mean_sq: Tensor, tol: float) -> Tensor:
    r"""AADL's moving-average rule (spec step 5) on the window's $k$ = `count` entries:
    average when $k \ge 2$ and $\|s\|_2 > \mathrm{tol}\,\|\bar x\|_2$, with
    $\|s\|_2^2$ = `variance_sum` (Bessel-corrected) and $\|\bar x\|_2^2$ = `mean_sq`.
    Squared on both sides, so no square root; a non-finite spread or mean never averages."""
    triggered = (count >= 2) & (variance_sum > (tol * tol) * mean_sq) & torch.isfinite(mean_sq)
    return triggered & torch.isfinite(variance_sum)


def skips_exhausted(streak: int, limit: int | None) -> bool:
    """`skip_nonfinite`: whether one more skipped call, after `streak` in a row, would exceed
    `max_consecutive_skips` (None: no limit)."""
    return limit is not None and streak >= limit

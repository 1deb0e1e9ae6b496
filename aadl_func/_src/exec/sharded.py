r"""Sharded params' one reduction a step: the all_reduce of the newest Gram rows, and the
finiteness of a mix certified from reduced quantities alone.

`reduce_rows()` sums over the shard group, in one float64 vector of `O(Q)` entries (and,
for a float64 window, every rank's `Q x Q` QR factor), what the stages need to take the same
decisions on every rank; `certified_finite()` bounds the mix from those sums. Why one
all_reduce is enough, and the bound itself: `aadl_func._src.distributed`, which also holds the
call's `ShardedCall` (the group, and the safeguard's loss).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import flags, tree
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.lstsq import stack_factors
from aadl_func._src.update_call import Call, may_mix
from aadl_func._src.window import set_gram_row, window_factor

if TYPE_CHECKING:
    from aadl_func._src.stages import Solution

__all__ = ["Reduction", "certified_finite", "reduce_rows", "shard_factor"]


class Reduction(NamedTuple):
    """Sharded params: what the call's one all_reduce summed over ranks (`reduce_rows()`).

    Attributes:
      rows: `(g, h, c)`, the newest residual's rows of `gram`, `dr_gram` and `dr_rhs`.
      factor: a float64 window's QR factor of the whole window's differences (else None).
      base_bound: the bound of the combination's base, for `certified_finite()`.
    """

    rows: tuple
    factor: Tensor | None
    base_bound: Tensor


def shard_factor(call: Call, ring: tuple, head: Tensor, num_residuals: Tensor) -> Tensor | None:
    """This rank's factor for the step's all_reduce: float64 windows, on calls that may mix."""
    if not call.exact or flags.value(may_mix(call)) is False:
        return None
    return window_factor(ring, head, num_residuals, call.compute_device)


def reduce_rows(
    call: Call,
    grams: Grams,
    head: Tensor,
    new_rows: tuple | None = None,
    factor: Tensor | None = None,
) -> tuple[Grams, Reduction]:
    """The step's one all_reduce over the shard group.

    Sums over ranks, in one float64 vector: the rows `gram[head]` and `dr_gram[head]` of
    the previous newest residual (kept as this rank's partial sums because the safeguard
    may have replaced that residual after the previous reduction), then either the three
    partial rows of the residual appended now (`new_rows`) or the partial `dr_rhs`,
    then, with `factor` (this rank's `Q x Q` QR factor of a float64 window), a
    `(world, Q, Q)` block holding it in this rank's slot and zeros elsewhere, and this
    rank's bound for `certified_finite()`.

    The sum of the blocks is every rank's factor, in rank order, on every rank; their
    stacked QR (`aadl_func._src.core.lstsq.stack_factors()`) is the factor of the whole
    window, identical on all ranks. (Summing the factors' Gram matrices would square the
    condition number again; a TSQR tree needs a reduction with QR as its operator, which
    collectives do not offer.)

    Returns `(grams with the head rows summed, the Reduction)`.
    """
    q = call.q
    shards = call.shards
    gram, dr_gram, dr_rhs = grams
    device = gram.device
    at = head.to(device)
    tail = list(new_rows) if new_rows is not None else [dr_rhs]
    parts = [gram[at], dr_gram[at], *(t.to(device) for t in tail)]
    rows_end = sum(p.numel() for p in parts)
    world = shards.world_size
    if factor is not None:
        own = torch.arange(world, device=device) == shards.rank
        slots = torch.where(own[:, None, None], factor.to(device)[None], 0.0)
        parts.append(slots.reshape(-1))
    parts.append(_local_base_bound(call).to(device).reshape(1))
    total = shards.all_sum(torch.cat(parts))
    summed_factor = None
    if factor is not None:
        every_rank = total[rows_end : rows_end + world * q * q].reshape(world * q, q)
        summed_factor = stack_factors([every_rank])
    gram = set_gram_row(gram, head, total[:q])
    dr_gram = set_gram_row(dr_gram, head, total[q : 2 * q])
    if new_rows is not None:
        summed = (total[2 * q : 3 * q], total[3 * q : 4 * q], total[4 * q : 5 * q])
    else:
        summed = (total[:q], total[q : 2 * q], total[2 * q : 3 * q])
    return Grams(gram, dr_gram, dr_rhs), Reduction(summed, summed_factor, total[-1])


def _local_base_bound(call: Call) -> Tensor:
    """This rank's bound of the combination's base (the mode's rule); 0 if no mix can happen."""
    known = flags.value(may_mix(call))
    if known is not None and not known:
        return torch.zeros((), dtype=torch.float64, device=call.compute_device)
    return call.options.rules.base_bound(call)


def certified_finite(call: Call, solution: Solution) -> Tensor:
    r"""Whether the mix is certainly finite, from reduced quantities only (same on all ranks):
    the mode's bound of every entry of the mix (from the summed base bound and
    $\|r_s\| = \sqrt{G_{ss}}$) is at most half the largest value of the parameter and
    compute dtypes."""
    bound = call.options.rules.mix_bound(
        call.options, solution.weights.alpha, solution.norms, solution.reduction.base_bound
    )
    return tree.decision(bound <= call.overflow_limit, call.compute_device)

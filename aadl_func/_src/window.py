"""Passes over the ring window: the Gram row of a new residual and the mixing combination.

The window is a ring of ``Q`` slots, each a list of tensors (one per parameter leaf) living
on the history device in the history dtype. A step makes at most two passes over it:

* :func:`gram_row` -- the inner products of one new slot with every slot, accumulated in
  float64 (an O(Q n) pass that keeps the Gram matrix exact up to float64 rounding);
* :func:`combine` -- ``base + sum_s w_s slot_s`` (an O(Q n) pass).

Both stream the window in chunks of a few hundred kilobytes: a chunk of every slot is
upcast in cache, so no window-sized (or even parameter-sized) float64 temporary is ever
built, and ``torch.stack``/``torch.cat`` never touch the whole window. ``flat_view`` lines
slots up element by element, so ``channels_last`` buffers stream without copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import optree
import torch
from torch import Tensor

from aadl_func._src import tree

__all__ = ["chunk_size", "gram_row", "combine", "write_slot", "select", "set_gram_row"]

T = TypeVar("T")

# Elements per chunk across all slots: 2^19 float64 values (4 MiB) fit in a last-level cache.
_CHUNK_ELEMENTS = 1 << 19


def chunk_size(num_slots: int) -> int:
    return max(1 << 12, _CHUNK_ELEMENTS // max(num_slots, 1))


def gram_row(
    slots: Sequence[Sequence[Tensor]], vector: Sequence[Tensor], device: torch.device
) -> Tensor:
    """``row[s] = <slots[s], vector>`` summed over leaves, in float64, on ``device``.

    Args:
      slots: ``slots[s][leaf]`` window tensors.
      vector: one tensor per leaf, laid out like the slots (same strides).
      device: where the result (``Q`` scalars) goes; the pass itself runs where slots live.
    """
    row = torch.zeros(len(slots), dtype=torch.float64, device=device)
    for leaf_index, v in enumerate(vector):
        flats = [tree.flat_view(slot[leaf_index]) for slot in slots]
        v_flat = tree.flat_view(v)
        numel = v_flat.shape[0]
        step = chunk_size(len(slots))
        partial = None
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            block = torch.stack([f[start:stop] for f in flats]).to(torch.float64)
            contribution = torch.mv(block, v_flat[start:stop].to(torch.float64))
            partial = contribution if partial is None else partial + contribution
        if partial is not None:
            row = row + partial.to(device)
    return row


def combine(
    base: Sequence[Tensor] | None,
    rings: Sequence[Sequence[Sequence[Tensor]]],
    weights: Tensor,
    compute_dtypes: Sequence[torch.dtype],
    like: Sequence[Tensor],
) -> list[Tensor]:
    """``base + sum_s weights[s] * slot_s`` per leaf, slots taken from ``rings`` in order.

    Args:
      base: one tensor per leaf, or None for zero.
      rings: each ring is ``ring[s][leaf]``; their slots are concatenated.
      weights: ``(total slots,)`` float64 weights (any device).
      compute_dtypes: per leaf, the dtype of the accumulation (float32 or float64).
      like: per leaf, a tensor whose layout the result takes (on the slots' device).
    """
    slots = [slot for ring in rings for slot in ring]
    out = []
    for leaf_index, template in enumerate(like):
        cdt = compute_dtypes[leaf_index]
        device = slots[0][leaf_index].device
        w = weights.to(device=device, dtype=cdt)
        flats = [tree.flat_view(slot[leaf_index]) for slot in slots]
        base_flat = None if base is None else tree.flat_view(base[leaf_index])
        numel = flats[0].shape[0]
        step = chunk_size(len(slots))
        transformed = tree.is_transformed(flats[0]) or tree.is_transformed(w)
        if transformed:
            result = None
            pieces = []
        else:
            result = torch.empty_like(template, dtype=cdt, device=device)
            result_flat = tree.flat_view(result)
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            block = torch.stack([f[start:stop] for f in flats]).to(cdt)
            if base_flat is None:
                chunk = torch.mv(block.mT, w)
            else:
                chunk = torch.addmv(base_flat[start:stop].to(cdt), block.mT, w)
            if transformed:
                pieces.append(chunk)
            else:
                result_flat[start:stop] = chunk
        if transformed:
            result = torch.cat(pieces).reshape(template.shape)
        out.append(result)
    return out


def write_slot(
    ring: tuple[list[Tensor], ...], slot: Tensor, value: Sequence[Tensor], inplace: bool
) -> tuple[list[Tensor], ...]:
    """The ring with ``ring[slot] = value``: touches one slot when ``slot`` is concrete.

    Under a transform the slot index is a (batched) tensor, so every slot is blended with
    ``torch.where``; that rewrites the window, the price of data-dependent indexing in vmap.
    """
    index = tree.static_value(slot)
    if index is not None:
        if inplace:
            for dst, src in zip(ring[index], value):
                dst.copy_(src)
            return ring
        return tuple(list(value) if s == index else entries for s, entries in enumerate(ring))
    return tuple(
        [torch.where(slot == s, v, e) for v, e in zip(value, entries)]
        for s, entries in enumerate(ring)
    )


def set_gram_row(gram: Tensor, slot: Tensor, row: Tensor) -> Tensor:
    """Symmetric Gram with row and column ``slot`` replaced by ``row``."""
    index = torch.arange(gram.shape[-1], device=gram.device)
    hit = index == slot.to(gram.device)
    gram = torch.where(hit[:, None], row[None, :], gram)
    return torch.where(hit[None, :], row[:, None], gram)


def select(gate: Tensor, compute: Callable[[], T], otherwise: T) -> T:
    """``compute()`` where ``gate`` holds, else ``otherwise`` -- without computing it when the
    gate is a concrete False. Under vmap both are evaluated and blended leaf by leaf."""
    known = tree.static_value(gate)
    if known is not None:
        return compute() if known else otherwise
    return optree.tree_map(
        lambda new, old: torch.where(gate.to(new.device), new, old), compute(), otherwise
    )

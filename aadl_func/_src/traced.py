r"""A window slot written in place by a compiled step, one slot's worth of memory traffic.

A step traced by `torch.compile` does not know which ring slot is the head: the index is a
tensor, and reading it would guard on its value (a recompilation per slot) or sync the host.
Written as torch operations, `slot_s <- where(head == s, value, slot_s)` for every `s`
reads and rewrites the whole window: at `n = 2^22`, `Q = 9` float32 slots, 4.8 ms where
copying the one slot takes 0.35 ms (measured on this 2-core machine).

`copy_if_()` is the same write as an operator the compiler keeps opaque and in place
(it mutates `dst` and nothing else, so inductor re-inplaces it on the window's own buffer).
On the CPU it reads the 0-d mask (a host value, no synchronisation) and copies only on a
hit; elsewhere it writes the masked blend, which keeps the step free of host syncs.

The operator is tagged `flexible_layout` (`dst.copy_` takes any strides): without the
tag, inductor fixes the layout of each call's `src` by computing it into a buffer of its
own, `Q` parameter-sized writes for one entry offered to `Q` slots instead of one.
torch before 2.8 takes no tags in `custom_op`: there the operator is registered untagged,
with the same results and those extra copies under inductor.

One operator per slot on purpose: an operator that mutates a *list* of tensors is
functionalised by torch 2.13's inductor into clones of every slot (and crashed at
`n = 2^22`); a single mutated tensor is re-inplaced cleanly.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

__all__ = ["copy_if_"]


def _tags() -> dict:
    """`tags=(flexible_layout,)` where this torch's `custom_op` takes tags (2.8 and later);
    an untagged operator computes the same values (the tag only spares inductor copies)."""
    if "tags" in inspect.signature(torch.library.custom_op).parameters and hasattr(
        torch.Tag, "flexible_layout"
    ):
        return {"tags": (torch.Tag.flexible_layout,)}
    return {}


@torch.library.custom_op("aadl_func::copy_if_", mutates_args=("dst",), **_tags())
def copy_if_(dst: Tensor, mask: Tensor, src: Tensor) -> None:
    """`dst.copy_(src)` where the 0-d bool `mask` holds; `dst` unchanged otherwise."""
    if mask.device.type == "cpu":
        if bool(mask):
            dst.copy_(src)
    else:
        dst.copy_(torch.where(mask.to(dst.device), src, dst))


@copy_if_.register_fake
def _(dst: Tensor, mask: Tensor, src: Tensor) -> None:
    return None


@copy_if_.register_vmap
def _(info, in_dims, dst: Tensor, mask: Tensor, src: Tensor):
    # A vmapped (and compiled) ensemble: members out of step have a batched mask; the rows of
    # `dst` are then blended, one member's mask per row, as the torch path did before.
    dst_dim, mask_dim, src_dim = in_dims
    if dst_dim is None:
        raise ValueError("copy_if_: `dst` must be batched when vmapped (an in-place write)")
    rows = dst.movedim(dst_dim, 0)
    values = src.expand(rows.shape[1:]) if src_dim is None else src.movedim(src_dim, 0)
    if mask_dim is None:
        copy_if_(rows, mask, values.expand(rows.shape))
    else:
        hits = mask.movedim(mask_dim, 0).reshape(-1, *([1] * (rows.dim() - 1)))
        rows.copy_(torch.where(hits.to(rows.device), values, rows))
    return None, None  # no output (and so no output dimension)

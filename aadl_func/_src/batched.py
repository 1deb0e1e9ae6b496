"""The window's passes over leaves wrapped by a torch.func transform or traced by torch.compile.

The same passes as `aadl_func._src.kernels`, for leaves that are batched tensors (vmap)
or traced values (torch.compile), whose slot index may itself be batched or traced:

* on the CPU, eager and not differentiated, the vmap rules of
  `aadl_func._src.vmap_rules` run each member's pass with the eager kernels;
* traced, whole-vector expressions that the compiler fuses into one read of the window;
* otherwise (an accelerator, a differentiated pass) chunks gathered with `torch.stack`
  and batched matrix-vector products.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aadl_func._src import kernels, tree, vmap_rules
from aadl_func._src.core.scalars import wide

__all__ = ["combine_leaf", "difference_rows_leaf", "factor_leaf", "gram_leaf"]


def gram_leaf(flats: Sequence[Tensor], v: Tensor) -> Tensor | None:
    """The same pass for tensors wrapped by a torch.func transform (batched under vmap)."""
    if vmap_rules.per_member([*flats, v]):
        return vmap_rules.gram_row(list(flats), v)
    if tree.tracing():
        # Whole-vector expressions: the compiler fuses the widening into one reduction per
        # slot (no chunks, no float64 copy of the window).
        acc = wide(v.dtype)  # float64, or complex128 with <f, v> = sum(conj(f) v)
        v64 = v.to(acc)
        return torch.stack([torch.sum(f.to(acc).conj() * v64) for f in flats])
    numel = v.shape[0]
    step = kernels.chunk_size(len(flats), v.device)
    acc = wide(v.dtype)
    partial = None
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        block = torch.stack([f[start:stop] for f in flats]).to(acc)
        contribution = torch.mv(block.conj(), v[start:stop].to(acc))
        partial = contribution if partial is None else partial + contribution
    return partial


def combine_leaf(
    base: Tensor | None, flats: Sequence[Tensor], w: Tensor, cdt: torch.dtype, template: Tensor
) -> Tensor:
    """The same pass under a torch.func transform: chunks gathered with `torch.stack`."""
    if vmap_rules.per_member([base, *flats, w]):
        return vmap_rules.combine(base, list(flats), w).reshape(template.shape)
    acc = kernels.accumulator(cdt, base, flats)
    w = w.to(acc)
    if tree.tracing():
        # One elementwise expression, fused by the compiler into a single pass.
        total = None if base is None else base.to(acc)
        for s, f in enumerate(flats):
            term = w[s] * f.to(acc)
            total = term if total is None else total + term
        return total.to(cdt).reshape(template.shape)
    numel = flats[0].shape[0]
    step = kernels.chunk_size(len(flats), flats[0].device)
    pieces = []
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        block = torch.stack([f[start:stop] for f in flats]).to(acc)
        if base is None:
            pieces.append(torch.mv(block.mT, w).to(cdt))
        else:
            pieces.append(torch.addmv(base[start:stop].to(acc), block.mT, w).to(cdt))
    if not pieces:
        return torch.zeros_like(template, dtype=cdt)
    return torch.cat(pieces).reshape(template.shape)


def _difference_rows_traced(
    flats: Sequence[Tensor], slot: Tensor, exact: bool
) -> tuple[Tensor, Tensor]:
    """The pass as whole-vector expressions for the compiler: the slots are selected by
    masks and every product is widened in registers, so it fuses into one read of the
    window."""
    widened = [f.to(wide(f.dtype)) for f in flats]
    at = slot.to(flats[0].device)

    def pick(index: Tensor) -> Tensor:
        chosen = widened[0]
        for s in range(1, len(widened)):
            chosen = torch.where(index == s, widened[s], chosen)
        return chosen

    newest = pick(at)
    g = torch.stack([torch.sum(f.conj() * newest) for f in widened])
    if not exact:
        return g, g[:0]
    step = newest - pick((at - 1) % len(widened))
    return g, torch.stack([torch.sum(f.conj() * step) for f in widened])


def difference_rows_leaf(
    flats: Sequence[Tensor], slot: Tensor, exact: bool
) -> tuple[Tensor, Tensor]:
    """The same pass under a torch.func transform (the slot may be a batched tensor)."""
    index = tree.static_value(slot)
    if index is not None and vmap_rules.per_member(flats):
        return vmap_rules.difference_rows(list(flats), index, exact)
    if tree.tracing():
        return _difference_rows_traced(flats, slot, exact)
    numel = flats[0].shape[0]
    step = kernels.chunk_size(len(flats), flats[0].device)
    totals = None
    pick = torch.stack([torch.as_tensor(slot), (torch.as_tensor(slot) - 1) % len(flats)])
    pick = pick.to(flats[0].device)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        b = torch.stack([f[start:stop] for f in flats]).to(wide(flats[0].dtype))
        newest, previous = b.index_select(0, pick)
        bh = b.conj()
        parts = (torch.mv(bh, newest), torch.mv(bh, newest - previous) if exact else newest[:0])
        totals = parts if totals is None else tuple(t + u for t, u in zip(totals, parts))
    return totals


def factor_leaf(flats: Sequence[Tensor], order: Tensor, valid: Tensor, factor: Tensor) -> Tensor:
    """The same pass under a torch.func transform (`order` and `valid` may be batched):
    chunks gathered with `torch.stack`, the block formed by a `Q x Q` difference matrix
    (`1 * a - 1 * b` is one rounding, exactly `a - b`)."""
    q = len(flats)
    dev = flats[0].device
    acc = wide(flats[0].dtype)
    chrono = torch.eye(q, dtype=acc, device=dev)[order.to(dev)]
    steps = torch.where(valid.to(dev)[:, None], chrono[1:] - chrono[:-1], 0.0)
    select = torch.cat([steps, chrono[-1:]])
    numel = flats[0].shape[0]
    step = kernels.chunk_size(q, dev)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        chunk = torch.stack([f[start:stop] for f in flats]).to(acc)
        # mode="reduced": the R of mode="r" has no derivative (torch.func.grad through update).
        factor = torch.linalg.qr(torch.cat([factor, chunk.mT @ select.mT]), mode="reduced").R
    return factor

r"""Passes over the ring window: the Gram row of a new residual and the mixing combination.

The window is a ring of ``Q`` slots, each a list of tensors (one per parameter leaf) living
on the history device in the history dtype. A step makes at most two passes over it:

* :func:`gram_row` -- :math:`\langle s_j, v \rangle` for every slot :math:`s_j`, accumulated
  in float64 from the stored values (products of float32 or bf16 numbers are exact in
  float64, so the Gram matrix is exact up to float64 summation rounding);
* :func:`combine` -- :math:`b + \sum_j w_j s_j` in the compute dtype.

Both are O(Q n) and never build a window-sized temporary: ``torch.stack``/``torch.cat`` never
touch the whole window, and no parameter-sized float64 copy is made.

How fast they run depends on the layout, which :func:`new_ring` chooses: it allocates the
``Q`` slots of a leaf as equally spaced rows of one buffer. A pass then sees the window as
one strided ``(Q, n)`` matrix without copying it, so

* a pass whose dtypes already match is a single BLAS matrix-vector product over the window
  (``torch.mv``/``torch.addmv`` on the strided view), exactly the two passes that bound any
  Anderson step from below;
* a pass that must widen the data (a float32 or bf16 window into the float64 Gram) streams it
  in chunks of ``Q x chunk`` elements: each chunk is converted with one copy into a small
  float64 buffer that stays in cache, then multiplied there.

Slots that are not rows of one buffer (the pure ``inplace=False`` path replaces a slot by a
new tensor each step) take the same chunked route, one copy per slot and chunk. Under
``torch.func`` transforms the slots are gathered per chunk with ``torch.stack``. ``flat_view``
lines slots up element by element in storage order, so ``channels_last`` buffers stream
without copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import optree
import torch
from torch import Tensor

from aadl_func._src import flags, native, ops, traced, tree

__all__ = [
    "chunk_size",
    "new_ring",
    "gram_row",
    "combine",
    "write_slot",
    "select",
    "assign",
    "blending",
    "set_gram_row",
    "difference_rows",
    "append_difference",
    "difference_factor",
]

T = TypeVar("T")

# Elements per chunk across all slots: 2^16 float64 values (512 KiB) stay in a core's L2
# cache while they are converted and multiplied. Larger chunks fall out of cache, smaller
# ones pay Python's per-operation overhead more often (measured on a 2-core Xeon VM).
_CHUNK_ELEMENTS = 1 << 16
_MIN_CHUNK = 1 << 10
# On an accelerator every chunk is a kernel launch: chunks of 2^22 float64 values (32 MiB)
# keep launches few while the buffer stays far below a large model's parameter size.
_DEVICE_CHUNK_ELEMENTS = 1 << 22


def chunk_size(num_slots: int, device: torch.device | None = None) -> int:
    """Elements per slot in one chunk of a streaming pass over ``num_slots`` slots."""
    total = _CHUNK_ELEMENTS if device is None or device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    return max(_MIN_CHUNK, total // max(num_slots, 1))


def _buffer_width(num_slots: int, numel: int, device: torch.device) -> int:
    """Chunk width of a widening pass: a chunk size, capped so that the ``num_slots x width``
    float64 buffer is at most about one float32 parameter (``4 numel`` bytes)."""
    cap = max(_MIN_CHUNK, numel // (2 * max(num_slots, 1)))
    return min(chunk_size(num_slots, device), cap, numel)


def new_ring(
    like: Tensor,
    num_slots: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> list[Tensor]:
    """``num_slots`` zeroed window slots shaped and strided like ``like``: rows of one buffer.

    Every slot is a view of one ``num_slots * like.numel()`` allocation, ``like``'s strides
    (``channels_last`` included) kept, so the passes of this module see the ring as one
    ``(num_slots, n)`` matrix. In-place updates keep this layout; a slot replaced by a new
    tensor (the pure path) only makes the passes take their chunked route.

    Args:
      like: a parameter leaf; its shape and memory format are copied.
      num_slots: ``Q``.
      dtype: the history dtype.
      device: the history device.
      pin_memory: page-lock the buffer (a CPU window serving CUDA params).
    """
    if tree.is_transformed(like):
        # Under vmap each slot must be a batched tensor of its own.
        return [
            torch.zeros_like(like, dtype=dtype, device=device, memory_format=torch.preserve_format)
            for _ in range(num_slots)
        ]
    strides = torch.empty_like(
        like, dtype=dtype, device="meta", memory_format=torch.preserve_format
    ).stride()
    numel = like.numel()
    buffer = torch.zeros(num_slots * numel, dtype=dtype, device=device, pin_memory=pin_memory)
    return [buffer.as_strided(like.shape, strides, s * numel) for s in range(num_slots)]


def _runs(flats: Sequence[Tensor]) -> list[tuple[int, Tensor]]:
    """Groups consecutive slots into ``(first slot, (k, n) view)`` runs.

    Slots ``i .. i + k - 1`` form a run when they are equally spaced, non-overlapping,
    contiguous views of one storage (as :func:`new_ring` makes them); the run is then a
    strided matrix over that storage, no copy made. Any other slot is a run of one. The
    slots are flat views or C-contiguous tensors of any shape (their ``n`` elements in
    order either way).
    """
    runs: list[tuple[int, Tensor]] = []
    numel = flats[0].numel()
    start = 0
    while start < len(flats):
        first = flats[start]
        stop = start + 1
        if numel > 0 and first.is_contiguous():
            ptr = first.untyped_storage().data_ptr()
            spacing = None
            while stop < len(flats):
                f = flats[stop]
                if (
                    f.dtype != first.dtype
                    or f.device != first.device
                    or not f.is_contiguous()
                    or f.untyped_storage().data_ptr() != ptr
                ):
                    break
                gap = f.storage_offset() - flats[stop - 1].storage_offset()
                if gap < numel or (spacing is not None and gap != spacing):
                    break
                spacing = gap
                stop += 1
            if spacing is not None:
                view = first.as_strided((stop - start, numel), (spacing, 1))
                runs.append((start, view))
                start = stop
                continue
        runs.append((start, first.reshape(1, numel)))
        start = stop
    return runs


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two flat views are the same elements (e.g. the residual just written)."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def gram_row(
    slots: Sequence[Sequence[Tensor]], vector: Sequence[Tensor], device: torch.device
) -> Tensor:
    r"""``row[s] = <slots[s], vector>`` summed over leaves, in float64, on ``device``.

    .. math::

        \mathrm{row}_s = \sum_{\mathrm{leaves}} \sum_i \mathrm{f64}(s_{s,i})\,
        \mathrm{f64}(v_i)

    The pass runs where the slots live; only the ``Q`` results move to ``device``.

    Args:
      slots: ``slots[s][leaf]`` window tensors.
      vector: one tensor per leaf, laid out like the slots (same strides); it may be one of
        the slots (the residual just written), which is then converted only once.
      device: where the result (``Q`` scalars) goes.
    """
    row = torch.zeros(len(slots), dtype=torch.float64, device=device)
    for leaf_index, v in enumerate(vector):
        flats = [tree.flat_view(slot[leaf_index]) for slot in slots]
        v_flat = tree.flat_view(v)
        if tree.any_transformed([v_flat, *flats]):
            partial = _gram_leaf_transformed(flats, v_flat)
        else:
            partial = _gram_leaf(flats, v_flat)
        if partial is not None:
            row = row + partial.to(device)
    return row


def _gram_leaf(flats: Sequence[Tensor], v: Tensor) -> Tensor | None:
    q, numel = len(flats), v.shape[0]
    if numel == 0:
        return None
    runs = _runs(flats)
    f64 = torch.float64
    partial = torch.zeros(q, dtype=f64, device=v.device)
    if v.dtype == f64 and all(block.dtype == f64 for _, block in runs):
        # Nothing to widen: one BLAS product per run over the whole vector.
        for first, block in runs:
            torch.mv(block, v, out=partial[first : first + block.shape[0]])
        return partial
    dots = native.float64_dots(flats, v)
    if dots is not None:
        return dots
    step = _buffer_width(q, numel, v.device)
    buffer = torch.empty(q, step, dtype=f64, device=v.device)
    # Chunk views made in one call per run (cheaper than slicing chunk by chunk).
    pieces = [(first, block.shape[0], block.split(step, dim=1)) for first, block in runs]
    v_row = next((s for s, f in enumerate(flats) if _same(f, v)), None)
    if v_row is None:
        v_pieces = v.split(step)
        v_buffer = torch.empty(step, dtype=f64, device=v.device)
    else:
        v_full = buffer[v_row]
    for i in range(len(pieces[0][2])):
        width = pieces[0][2][i].shape[1]
        b = buffer if width == step else buffer[:, :width]
        if len(pieces) == 1:
            b.copy_(pieces[0][2][i])
        else:
            for first, k, chunks in pieces:
                b[first : first + k].copy_(chunks[i])
        if v_row is None:
            v_chunk = v_buffer[:width].copy_(v_pieces[i])
        else:
            v_chunk = v_full if width == step else b[v_row]
        partial.addmv_(b, v_chunk)
    return partial


def _gram_leaf_transformed(flats: Sequence[Tensor], v: Tensor) -> Tensor | None:
    """The same pass for tensors wrapped by a torch.func transform (batched under vmap)."""
    if ops.per_member([*flats, v]):
        return ops.gram_row(list(flats), v)
    if tree.tracing():
        # Whole-vector expressions: the compiler fuses the widening into one reduction per
        # slot (no chunks, no float64 copy of the window).
        v64 = v.to(torch.float64)
        return torch.stack([torch.sum(f.to(torch.float64) * v64) for f in flats])
    numel = v.shape[0]
    step = chunk_size(len(flats), v.device)
    partial = None
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        block = torch.stack([f[start:stop] for f in flats]).to(torch.float64)
        contribution = torch.mv(block, v[start:stop].to(torch.float64))
        partial = contribution if partial is None else partial + contribution
    return partial


def combine(
    base: Sequence[Tensor] | None,
    rings: Sequence[Sequence[Sequence[Tensor]]],
    weights: Tensor,
    compute_dtypes: Sequence[torch.dtype],
    like: Sequence[Tensor],
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    r"""``base + sum_s weights[s] * slot_s`` per leaf, slots taken from ``rings`` in order.

    .. math::

        x = b + \sum_s w_s\, s_s \quad \text{(in the compute dtype)}

    One pass over the window where it lives; the result is the only parameter-sized
    allocation (page-locked when ``like`` is, so that it can be sent to an accelerator
    asynchronously), none with ``out``.

    Args:
      base: one tensor per leaf, or None for zero.
      rings: each ring is ``ring[s][leaf]``; their slots are concatenated.
      weights: ``(total slots,)`` float64 weights (any device).
      compute_dtypes: per leaf, the dtype of the accumulation (float32 or float64).
      like: per leaf, a tensor whose layout the result takes (on the slots' device).
      out: per leaf, a tensor to write the result into instead (laid out like ``like``, in
        the compute dtype, on the slots' device, overlapping none of the inputs; it may be
        ``base`` itself, which then accumulates the sum in place).
    """
    slots = [slot for ring in rings for slot in ring]
    results = []
    for leaf_index, template in enumerate(like):
        cdt = compute_dtypes[leaf_index]
        device = slots[0][leaf_index].device
        w = weights.to(device=device, dtype=cdt)
        leaves = [slot[leaf_index] for slot in slots]
        base_flat = None if base is None else tree.flat_view(base[leaf_index])
        if tree.any_transformed([w, base_flat, *leaves]):
            flats = [tree.flat_view(t) for t in leaves]
            result = _combine_leaf_transformed(base_flat, flats, w, cdt, template)
            results.append(result if out is None else out[leaf_index].copy_(result))
            continue
        if out is None:
            result = _empty_like(template, cdt, device, pin_memory=_is_pinned(template))
        else:
            result = out[leaf_index]
            if (result.dtype, result.device, result.stride()) != (cdt, device, template.stride()):
                raise ValueError(
                    f"combine: `out` leaf {leaf_index} must be a {cdt} tensor on {device} with "
                    f"strides {template.stride()}, got {result.dtype} on {result.device} with "
                    f"strides {result.stride()}"
                )
        flat_result = tree.flat_view(result)
        if result.is_contiguous() and all(t.is_contiguous() for t in leaves):
            flats = leaves  # in C order, as the flat views of base and result: no views needed
        else:  # e.g. channels_last: every operand as a dense view in storage order
            flats = [tree.flat_view(t) for t in leaves]
        _combine_leaf(base_flat, flats, w, flat_result)
        results.append(result)
    return results


def _combine_leaf(base: Tensor | None, flats: Sequence[Tensor], w: Tensor, result: Tensor) -> None:
    """Writes ``base + sum_s w[s] flats[s]`` into the flat ``result``."""
    cdt, numel = result.dtype, result.shape[0]
    if numel == 0:
        return
    runs = _runs(flats)
    # ``base`` may be ``result`` itself: the sum is then accumulated in place, which reads
    # and writes one buffer instead of reading one and writing another.
    in_place = base is not None and _same(base, result)
    if all(block.dtype == cdt for _, block in runs) and (base is None or base.dtype == cdt):
        # Matching dtypes: BLAS reads the slots in place. One run is one product over the
        # whole vector; several runs go chunk by chunk so the result chunk stays in cache.
        step = numel if len(runs) == 1 else min(chunk_size(1, result.device), numel)
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            out = result[start:stop]
            for index, (first, block) in enumerate(runs):
                wk = w[first : first + block.shape[0]]
                matrix = block[:, start:stop].mT
                if index > 0 or in_place:
                    out.addmv_(matrix, wk)
                elif base is None:
                    torch.mv(matrix, wk, out=out)
                else:
                    torch.addmv(base[start:stop], matrix, wk, out=out)
        return
    # Widening (e.g. a bf16 window into float32): convert a chunk of every slot in cache.
    # A float32 result is accumulated in float64 and rounded once: the products of float32
    # weights and bf16/fp16 values are exact there, so every element rounds to the same
    # float32 whatever order BLAS sums it in, which changes with the vector's length and
    # alignment (a shard of it, say). Rounded to bf16 in the next stored step, a one-ulp
    # difference would otherwise grow into a different run.
    q = len(flats)
    acc = _accumulator(cdt, base, flats)
    w = w.to(acc)
    step = _buffer_width(q, numel, result.device)
    buffer = torch.empty(q, step, dtype=acc, device=result.device)
    sums = torch.empty(step, dtype=acc, device=result.device)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        b = buffer if stop - start == step else buffer[:, : stop - start]
        for first, block in runs:
            b[first : first + block.shape[0]].copy_(block[:, start:stop])
        total = sums[: stop - start]
        if base is None:
            torch.mv(b.mT, w, out=total)
        else:
            total.copy_(base[start:stop]).addmv_(b.mT, w)
        result[start:stop].copy_(total)


def _accumulator(cdt: torch.dtype, base: Tensor | None, flats: Sequence[Tensor]) -> torch.dtype:
    """The dtype a combination accumulates in: float64 for a float32 result widened from
    narrower operands (a bf16/fp16 window or params), so that it is rounded once and comes
    out the same on every path (see :func:`_combine_leaf`); else the compute dtype."""
    operands = [*flats, base] if base is not None else flats
    if cdt == torch.float32 and any(t.dtype != cdt for t in operands):
        return torch.float64
    return cdt


def _combine_leaf_transformed(
    base: Tensor | None, flats: Sequence[Tensor], w: Tensor, cdt: torch.dtype, template: Tensor
) -> Tensor:
    """The same pass under a torch.func transform: chunks gathered with ``torch.stack``."""
    if ops.per_member([base, *flats, w]):
        return ops.combine(base, list(flats), w).reshape(template.shape)
    acc = _accumulator(cdt, base, flats)
    w = w.to(acc)
    if tree.tracing():
        # One elementwise expression, fused by the compiler into a single pass.
        total = None if base is None else base.to(acc)
        for s, f in enumerate(flats):
            term = w[s] * f.to(acc)
            total = term if total is None else total + term
        return total.to(cdt).reshape(template.shape)
    numel = flats[0].shape[0]
    step = chunk_size(len(flats), flats[0].device)
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


def _empty_like(
    template: Tensor, dtype: torch.dtype, device: torch.device, *, pin_memory: bool
) -> Tensor:
    """An uninitialised tensor with ``template``'s shape and memory format."""
    if not pin_memory:
        return torch.empty_like(template, dtype=dtype, device=device)
    strides = torch.empty_like(template, dtype=dtype, device="meta").stride()
    return torch.empty_strided(template.shape, strides, dtype=dtype, device=device, pin_memory=True)


def _is_pinned(t: Tensor) -> bool:
    # ``is_pinned`` asks the accelerator runtime; only worth asking when one exists.
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


def write_slot(
    ring: tuple[list[Tensor], ...], slot: Tensor, value: Sequence[Tensor], inplace: bool
) -> tuple[list[Tensor], ...]:
    """The ring with ``ring[slot] = value``: touches one slot when ``slot`` is concrete.

    In place, ``value`` is copied into the slot's buffers (nothing to do when ``value`` is
    those buffers, e.g. a residual computed straight into its slot), with :func:`assign`.
    When the slot index is not concrete (traced by torch.compile; members of a vmapped
    ensemble out of step) every slot is blended with ``torch.where``: one pass over the
    window, the price of data-dependent indexing without reading the index. A compiled
    in-place step with the index on the CPU writes large slots through ``traced.copy_if_``
    instead, which copies into the one slot that matches and leaves the others untouched.
    """
    if tree.tracing():
        value = [stored_value(v) for v in value]
    index = tree.static_value(slot)
    if index is not None:
        if inplace:
            for dst, src in zip(ring[index], value):
                if src is not dst:
                    assign(dst, src)
            return ring
        return tuple(list(value) if s == index else entries for s, entries in enumerate(ring))
    if inplace:
        # Traced in-place step: every slot is written in place under its mask, so the window
        # keeps its buffers. Large leaves go through ``traced.copy_if_`` (one slot's traffic,
        # not a pass over the window).
        large = _skips_misses(ring, slot, value)
        for s, entries in enumerate(ring):
            for dst, src, big in zip(entries, value, large):
                assign(dst, src, where=slot == s, skip_misses=big)
        return ring
    return tuple(
        [torch.where((slot == s).to(v.device), v, e) for v, e in zip(value, entries)]
        for s, entries in enumerate(ring)
    )


# Integer types of the same width, for the bitcast of :func:`stored_value`.
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def stored_value(value: Tensor) -> Tensor:
    """``value`` as the window stores it, for a traced (compiled) step.

    Inductor computes a fused kernel's bf16/fp16 intermediates in float32 and may drop a
    cast it judges redundant: a slot written and then read by the Gram pass in the same
    kernel would be read *unrounded*, and the state's Gram would not be the Gram of the
    stored window. A bitcast through an integer type of the same width has no float
    shortcut, so the value every later pass reads is the rounded one that is stored.
    """
    integer = _SAME_WIDTH_INT.get(value.dtype)
    if integer is None:
        return value
    return (value.view(integer) | 0).view(value.dtype)


def set_gram_row(gram: Tensor, slot: Tensor, row: Tensor) -> Tensor:
    """Symmetric Gram with row and column ``slot`` replaced by ``row``."""
    known = tree.static_value(slot)
    if known is not None and not tree.any_transformed([gram, row]):
        # Eager: the same entries as the masked blend below, in three operations.
        gram = gram.clone()
        gram[known] = row
        gram[:, known] = row
        return gram
    index = torch.arange(gram.shape[-1], device=gram.device)
    hit = index == slot.to(gram.device)
    gram = torch.where(hit[:, None], row[None, :], gram)
    return torch.where(hit[None, :], row[:, None], gram)


# A compiled in-place ring write goes through ``traced.copy_if_`` for leaves of this many
# elements or more. Below, the masked rewrite of every slot, fused with the pass that computes
# the new entry, costs less than the operator's calls (tens of microseconds per step). Measured
# on this 2-core machine, compiled step / eager step, masked rewrite against copy_if_:
# 2^16, m = 5: 0.30 / 0.51; 2^17, m = 5: 0.45 / 0.62; 2^18, m = 10: 1.27 / 0.75;
# 2^20, m = 3: 1.57 / 0.99; 2^22, m = 3: 2.16 / 1.13; 2^22, m = 10: ~1.45 / ~0.9.
_TRACED_COPY_MIN_NUMEL = 1 << 18


def _skips_misses(
    ring: tuple[list[Tensor], ...], slot: Tensor, value: Sequence[Tensor]
) -> list[bool]:
    """Per leaf, whether a traced in-place :func:`write_slot` uses ``traced.copy_if_``:
    compiled, the slot index a host value (on an accelerator the fused blend keeps the step
    free of host reads), and a leaf large enough to pay for the operator's calls."""
    if not (tree.tracing() and slot.device.type == "cpu"):
        return [False] * len(value)
    return [v.device.type == "cpu" and v.numel() >= _TRACED_COPY_MIN_NUMEL for v in value]


# The gates of the blended ``select`` calls whose ``compute`` is running (outermost first).
_blending: list[Tensor] = []


def blending() -> bool:
    """Whether a blended :func:`select` is computing (its in-place writes must be masked)."""
    return len(_blending) > 0  # not bool(): dynamo 2.10-2.12 cannot trace bool() of a list


def _gates(mask: Tensor | None) -> Tensor | None:
    for gate in _blending:
        mask = gate if mask is None else mask & gate.to(mask.device)
    return mask


def assign(
    dst: Tensor, src: Tensor, where: Tensor | None = None, *, skip_misses: bool = False
) -> None:
    """``dst.copy_(src)``, except inside a blended :func:`select` (a gate without a value:
    vmap, torch.compile), where both outcomes are computed: the write then happens only
    where the gates hold (and ``where``), so an in-place write is right whatever the gates
    decide. Every in-place write to the params or the state during a step goes through
    here.

    ``skip_misses``: the masked write goes through ``traced.copy_if_``, which copies on a
    hit and leaves ``dst`` untouched otherwise instead of rewriting it (a compiled step's
    large ring slots, see :func:`write_slot`)."""
    mask = _gates(where)
    if mask is None:
        dst.copy_(src)
    elif skip_misses:
        traced.copy_if_(dst, mask, src)
    else:
        dst.copy_(torch.where(mask.to(dst.device), src, dst))


def select(
    gate: Tensor,
    compute: Callable[[], T],
    otherwise: T | Callable[[], T],
    *,
    blend: bool = True,
) -> T:
    """``compute()`` where ``gate`` holds, else ``otherwise`` -- without computing it when the
    gate is a concrete False (or, under vmap, False for every member). Under vmap with members
    that disagree, and under torch.compile, both are evaluated and blended leaf by leaf.

    ``otherwise`` may be a zero-argument callable, called only when its value is needed (a
    concrete False gate, or blending under vmap): placeholders such as a parameter-sized
    zero tensor then cost nothing on the steps that compute.

    ``blend=False``: for a result the caller only uses where ``gate`` holds (it masks the
    rest itself); a gate without a value then returns ``compute()`` as it is, saving a
    parameter-sized blend (its in-place writes are still masked, see :func:`assign`).
    """
    known = flags.value(gate)
    if known is None:
        known = tree.uniform_value(gate)  # a vmapped ensemble whose members agree
    if known is not None:
        if known:
            return compute()
        return otherwise() if callable(otherwise) else otherwise
    fallback = otherwise() if callable(otherwise) and blend else otherwise
    _blending.append(gate)
    try:
        computed = compute()
    finally:
        _blending.pop()
    if not blend:
        return computed
    # A leaf both outcomes share (a window slot neither touched, a buffer written in place
    # by assign) is kept, not blended.
    return optree.tree_map(
        lambda new, old: old if new is old else torch.where(gate.to(new.device), new, old),
        computed,
        fallback,
    )


def append_difference(
    ring: Sequence[Sequence[Tensor]],
    slot: int,
    newest: Sequence[Tensor],
    anchor: Sequence[Tensor],
    device: torch.device,
) -> Tensor | None:
    r"""In place, in one pass per leaf: ``ring[slot] = newest - anchor``, ``anchor = newest``,
    and the Gram row :math:`g_t = \langle f_t, f_s \rangle` of the new residual (float64,
    summed over leaves, on ``device``), which :func:`difference_rows` then takes as ``g``.

    The in-place append of a float32 window on the CPU with the native kernel
    (:func:`aadl_func._src.native.append_differences`): it replaces a subtraction, a copy and
    the Gram-row pass. Returns None, having written nothing, unless every leaf qualifies
    (float32 throughout, ``newest``, ``anchor`` and the slots laid out alike).
    """
    leaves = []
    for leaf_index, (y, a) in enumerate(zip(newest, anchor)):
        slots = [entry[leaf_index] for entry in ring]
        if not (y.stride() == a.stride() == slots[slot].stride()):
            return None
        if y.is_contiguous():  # the kernel takes contiguous tensors as they are
            leaves.append((slots, y, a))
        else:  # e.g. channels_last: dense 1-d views in storage order
            flats = [tree.flat_view(t) for t in slots]
            leaves.append((flats, tree.flat_view(y), tree.flat_view(a)))
    rows = native.append_differences(leaves, slot)
    if rows is None:
        return None
    # Summed from the first leaf's row (the kernel never returns -0.0, so 0 + row = row).
    row = rows[0].to(device)
    for leaf_row in rows[1:]:
        row = row + leaf_row.to(device)
    return row


def difference_rows(
    slots: Sequence[Sequence[Tensor]],
    slot: Tensor,
    device: torch.device,
    gram: Tensor,
    g: Tensor | None = None,
    *,
    direct: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""The new Gram rows after residual ``f_s`` was written in slot ``s``, in one pass.

    With :math:`d_t = f_t - f_{t-1}` (ring predecessor) and the window's Gram matrix ``gram``
    (:math:`G`, whose row :math:`s - 1` is current), returns, in ring order,

    .. math::

        g_t = \langle f_t, f_s \rangle, \qquad
        h_t = \langle d_t, d_s \rangle = p_t - p_{t-1}, \qquad
        c_t = \langle d_t, f_s \rangle = g_t - g_{t-1}, \qquad
        p_t = \langle f_t, d_s \rangle .

    A float64 window gets :math:`p` from :math:`d_s` formed element by element (exact), so
    :math:`h` carries rounding :math:`\epsilon \|f\| \|d\|`, one factor
    :math:`\|f\| / \|d\|` below differencing :math:`G` twice. A float32, bf16 or fp16 window
    takes :math:`p_t = g_t - G_{t, s-1}` instead, which saves a matrix-vector product per
    chunk (a third of the step on CPU): its rounding, :math:`\epsilon_{64} (\|f\| / \|d\|)^2`
    relative, stays far below that of the stored data itself,
    :math:`\epsilon_{32} \|f\| / \|d\|`, until :math:`\|f\| / \|d\|` reaches ~1e9.

    Args:
      slots: ``slots[t][leaf]`` window tensors (ring order).
      slot: 0-d int64, the slot just written (its predecessor is the previous newest).
      device: where the three ``(Q,)`` float64 results go.
      gram: ``(Q, Q)`` float64 :math:`G` before the write (row ``s - 1`` is used).
      g: the row :math:`g` if already computed (by :func:`append_difference`; float32,
        bf16 or fp16 windows only), which saves the pass.
      direct: form :math:`d_s` element by element whatever the window's dtype, as for a
        float64 window, instead of reading row ``s - 1`` of ``gram``. A sharded step needs
        this when the safeguard replaces the newest residual: ``gram`` row ``s - 1`` is
        then already summed over ranks, while :math:`g` is this rank's partial row.

    Returns:
      ``(g, h, c)``.
    """
    q = len(slots)
    exact = direct or all(s.dtype == torch.float64 for s in slots[0])
    p = torch.zeros(q, dtype=torch.float64, device=device) if exact else None
    if g is not None and exact:
        raise ValueError(
            "difference_rows: a precomputed `g` needs a float32/bf16/fp16 window and direct=False"
        )
    leaves = [] if g is not None else range(len(slots[0]))
    g = torch.zeros(q, dtype=torch.float64, device=device) if g is None else g.to(device)
    index = tree.static_value(slot)
    for leaf_index in leaves:
        flats = [tree.flat_view(s[leaf_index]) for s in slots]
        if index is None or tree.any_transformed(flats):
            parts = _difference_rows_transformed(flats, slot, exact)
        else:
            parts = _difference_rows_leaf(flats, index, exact)
        if parts is not None:
            g = g + parts[0].to(device)
            if exact:
                p = p + parts[1].to(device)
    c = g - g.roll(1)
    if not exact:
        # p_t = <f_t, d_s> = g_t - <f_t, f_{s-1}>, the last from the stored row s - 1, except
        # t = s, whose stored entry is the old f_s: there p_s = g_s - g_{s-1} = c_s.
        if index is not None:
            p = g - gram.to(device)[(index - 1) % q]
            p[index] = c[index]
        else:
            ring = torch.arange(q, device=device)
            at = slot.to(device)
            previous = (at - 1) % q
            before = torch.where(ring == at, _pick(g, previous), _pick(gram.to(device), previous))
            p = g - before
    return g, p - p.roll(1), c


def _pick(t: Tensor, index: Tensor) -> Tensor:
    """``t[index]`` for a 0-d index tensor, without reading its value (vmap, torch.compile)."""
    return t.index_select(0, index.reshape(1)).squeeze(0)


def _difference_rows_leaf(
    flats: Sequence[Tensor], s: int, exact: bool
) -> tuple[Tensor, Tensor | None] | None:
    q, numel = len(flats), flats[0].shape[0]
    if numel == 0:
        return None
    if not exact:
        g = native.float64_dots(flats, flats[s])
        if g is not None:
            return g, None
    f64, dev = torch.float64, flats[0].device
    runs = _runs(flats)
    step = _buffer_width(q, numel, dev)
    buffer = torch.empty(q, step, dtype=f64, device=dev)
    newest_step = torch.empty(step, dtype=f64, device=dev)
    g = torch.zeros(q, dtype=f64, device=dev)
    p = torch.zeros(q, dtype=f64, device=dev)
    pieces = [(first, block.shape[0], block.split(step, dim=1)) for first, block in runs]
    for i in range(len(pieces[0][2])):
        width = pieces[0][2][i].shape[1]
        b = buffer if width == step else buffer[:, :width]
        for first, k, chunks in pieces:
            b[first : first + k].copy_(chunks[i])
        g.addmv_(b, b[s])
        if exact:
            p.addmv_(b, torch.sub(b[s], b[s - 1], out=newest_step[:width]))
    return g, p


def _difference_rows_traced(
    flats: Sequence[Tensor], slot: Tensor, exact: bool
) -> tuple[Tensor, Tensor]:
    """The pass as whole-vector expressions for the compiler: the slots are selected by
    masks and every product is widened in registers, so it fuses into one read of the
    window."""
    wide = [f.to(torch.float64) for f in flats]
    at = slot.to(flats[0].device)

    def pick(index: Tensor) -> Tensor:
        chosen = wide[0]
        for s in range(1, len(wide)):
            chosen = torch.where(index == s, wide[s], chosen)
        return chosen

    newest = pick(at)
    g = torch.stack([torch.sum(f * newest) for f in wide])
    if not exact:
        return g, g[:0]
    step = newest - pick((at - 1) % len(wide))
    return g, torch.stack([torch.sum(f * step) for f in wide])


def _difference_rows_transformed(
    flats: Sequence[Tensor], slot: Tensor, exact: bool
) -> tuple[Tensor, Tensor]:
    """The same pass under a torch.func transform (the slot may be a batched tensor)."""
    index = tree.static_value(slot)
    if index is not None and ops.per_member(flats):
        return ops.difference_rows(list(flats), index, exact)
    if tree.tracing():
        return _difference_rows_traced(flats, slot, exact)
    numel = flats[0].shape[0]
    step = chunk_size(len(flats), flats[0].device)
    totals = None
    pick = torch.stack([torch.as_tensor(slot), (torch.as_tensor(slot) - 1) % len(flats)])
    pick = pick.to(flats[0].device)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        b = torch.stack([f[start:stop] for f in flats]).to(torch.float64)
        newest, previous = b.index_select(0, pick)
        parts = (torch.mv(b, newest), torch.mv(b, newest - previous) if exact else newest[:0])
        totals = parts if totals is None else tuple(t + u for t, u in zip(totals, parts))
    return totals


def difference_factor(
    slots: Sequence[Sequence[Tensor]],
    order: Tensor,
    valid: Tensor,
    device: torch.device,
) -> Tensor:
    r"""The float64 triangular factor ``R`` of :math:`[\Delta F \mid f_{\mathrm{last}}]`, streamed.

    With the residuals :math:`f_p` = ``slots[order[p]]`` in chronological order (``p = 0 ..
    Q - 1``, the newest last), the columns are :math:`\Delta F_{:, j} = f_{j+1} - f_j`
    (``j < Q - 1``, zero where ``valid[j]`` is False) and :math:`f_{Q-1}`; their
    ``Q x Q`` factor (:math:`R^\top R = A^\top A`) is built by a streaming TSQR: for each
    chunk of ``b`` coordinates of every leaf, the ``b x Q`` float64 block of :math:`A` is
    formed from the slots (the differences element by element, one rounding each, as
    ``numpy.diff`` forms them) below :math:`R`, and :math:`R \leftarrow` the factor of
    :math:`[R; \text{block}]` by a Householder QR. That costs :math:`O(Q^2 n)` flops but only
    :math:`O(Q b)` memory (the chunk sizes of the other passes), nothing parameter-sized.

    Args:
      slots: ``slots[s][leaf]`` window tensors (ring order), any floating dtype.
      order: ``(Q,)`` int64, the ring slots from oldest to newest.
      valid: ``(Q - 1,)`` bool, which differences take part.
      device: where the ``(Q, Q)`` result goes.
    """
    q = len(slots)
    factor = torch.zeros(q, q, dtype=torch.float64, device=device)
    concrete = not tree.any_transformed([order, valid])
    positions = (order.tolist(), valid.tolist()) if concrete else None
    for leaf_index in range(len(slots[0])):
        flats = [tree.flat_view(s[leaf_index]) for s in slots]
        if flats[0].shape[0] == 0:
            continue
        here = flats[0].device
        # Under a transform, or when autograd records (differentiating through mix or a pure
        # update): the differentiable path (no out= writes, no LAPACK-only geqrf).
        differentiable = torch.is_grad_enabled() and any(f.requires_grad for f in flats)
        if positions is None or differentiable or tree.any_transformed(flats):
            factor = _factor_leaf_transformed(flats, order, valid, factor.to(here))
        else:
            factor = _factor_leaf(flats, *positions, factor.to(here))
    return factor.to(device)


def _factor_leaf(
    flats: Sequence[Tensor], order: list[int], valid: list[bool], factor: Tensor
) -> Tensor:
    q, numel = len(flats), flats[0].shape[0]
    f64, dev = torch.float64, flats[0].device
    # Each chunk costs a LAPACK call whose overhead rivals O(Q^2 b) flops for small b: chunks
    # 4x wider than the other passes' (2^18 values on a CPU; measured 2x faster at n = 2^20,
    # Q = 9), with the same cap of about one float32 parameter.
    step = min(4 * _buffer_width(q, numel, dev), max(_MIN_CHUNK, numel // (2 * q)), numel)
    # The QR's input [R; block], column-major (LAPACK's layout) as the transpose of a
    # row-major (Q, Q + step) buffer: each column of the block is then one contiguous row,
    # written by one subtraction. Columns of invalid differences stay zero (so do R's).
    work_t = torch.zeros(q, q + step, dtype=f64, device=dev)
    # geqrf writes its Householder vectors and R into a second buffer of that layout (R is
    # its upper triangle), so that no chunk allocates anything chunk-sized.
    reflected_t = torch.empty(q, q + step, dtype=f64, device=dev)
    tau = torch.empty(q, dtype=f64, device=dev)
    # float64 slots are read in place; others are widened chunk by chunk first (subtracting
    # them in their own dtype would round the differences).
    widen = any(f.dtype != f64 for f in flats)
    buffer = torch.empty(q, step, dtype=f64, device=dev) if widen else None
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        width = stop - start
        if widen:
            rows = [buffer[s, :width].copy_(f[start:stop]) for s, f in enumerate(flats)]
        else:
            rows = [f[start:stop] for f in flats]
        work_t[:, :q].copy_(factor.mT)
        for j in range(q - 1):
            if valid[j]:
                torch.sub(rows[order[j + 1]], rows[order[j]], out=work_t[j, q : q + width])
        work_t[q - 1, q : q + width].copy_(rows[order[-1]])
        reflected = reflected_t[:, : q + width].mT
        torch.geqrf(work_t[:, : q + width].mT, out=(reflected, tau))
        factor = reflected[:q].triu()
    return factor


def _factor_leaf_transformed(
    flats: Sequence[Tensor], order: Tensor, valid: Tensor, factor: Tensor
) -> Tensor:
    """The same pass under a torch.func transform (``order`` and ``valid`` may be batched):
    chunks gathered with ``torch.stack``, the block formed by a ``Q x Q`` difference matrix
    (``1 * a - 1 * b`` is one rounding, exactly ``a - b``)."""
    q = len(flats)
    dev = flats[0].device
    chrono = torch.eye(q, dtype=torch.float64, device=dev)[order.to(dev)]
    steps = torch.where(valid.to(dev)[:, None], chrono[1:] - chrono[:-1], 0.0)
    select = torch.cat([steps, chrono[-1:]])
    numel = flats[0].shape[0]
    step = chunk_size(q, dev)
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        chunk = torch.stack([f[start:stop] for f in flats]).to(torch.float64)
        # mode="reduced": the R of mode="r" has no derivative (torch.func.grad through update).
        factor = torch.linalg.qr(torch.cat([factor, chunk.mT @ select.mT]), mode="reduced").R
    return factor

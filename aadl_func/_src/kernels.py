r"""The window's passes over one parameter leaf, eager (no torch.func transform, not traced).

Each pass reads the `Q` slots of one leaf once ($O(Q n)$) and never builds a
window-sized temporary:

* `gram_leaf()` -- $\langle s_j, v \rangle$ for every slot, accumulated in float64
  from the stored values (products of float32 or bf16 numbers are exact in float64); a
  complex window's in complex128, $\langle s, v \rangle = \sum_i \overline{s_i} v_i$
  (`block.conj()`, which is the block itself for real data: `aadl_func._src.core.scalars`);
* `combine_leaf()` -- $b + \sum_j w_j s_j$ in the compute dtype;
* `difference_rows_leaf()` -- the Gram rows of a newly written slot;
* `factor_leaf()` -- a streaming float64 QR factor of the slots' differences.

How fast they run depends on the layout `aadl_func._src.window.new_ring()` chooses: the
`Q` slots of a leaf are equally spaced rows of one buffer, which `slot_runs()` sees as one
strided `(Q, n)` matrix without copying it, so

* a pass whose dtypes already match is a single BLAS matrix-vector product over the window
  (`torch.mv`/`torch.addmv` on the strided view), exactly the two passes that bound any
  Anderson step from below;
* a pass that must widen the data (a float32 or bf16 window into the float64 Gram) streams it
  in chunks of `Q x chunk` elements: each chunk is converted with one copy into a small
  float64 buffer that stays in cache, then multiplied there; a float32 window on the CPU
  takes the native kernel (`aadl_func._src.native`) instead where it is built.

Slots that are not rows of one buffer (the pure `inplace=False` path replaces a slot by a
new tensor each step) take the same chunked route, one copy per slot and chunk. The passes
for batched (vmap) or traced (torch.compile) leaves are in `aadl_func._src.batched`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aadl_func._src import native
from aadl_func._src.core.scalars import wide

__all__ = [
    "accumulator",
    "buffer_width",
    "chunk_size",
    "combine_leaf",
    "difference_rows_leaf",
    "factor_leaf",
    "gram_leaf",
    "slot_runs",
    "same",
]


# Elements per chunk across all slots: 2^16 float64 values (512 KiB) stay in a core's L2
# cache while they are converted and multiplied. Larger chunks fall out of cache, smaller
# ones pay Python's per-operation overhead more often (measured on a 2-core Xeon VM).
_CHUNK_ELEMENTS = 1 << 16


_MIN_CHUNK = 1 << 10


# On an accelerator every chunk is a kernel launch: chunks of 2^22 float64 values (32 MiB)
# keep launches few while the buffer stays far below a large model's parameter size.
_DEVICE_CHUNK_ELEMENTS = 1 << 22


def chunk_size(num_slots: int, device: torch.device | None = None) -> int:
    """Elements per slot in one chunk of a streaming pass over `num_slots` slots."""
    total = _CHUNK_ELEMENTS if device is None or device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    return max(_MIN_CHUNK, total // max(num_slots, 1))


def buffer_width(num_slots: int, numel: int, device: torch.device) -> int:
    """Chunk width of a widening pass: a chunk size, capped so that the `num_slots x width`
    float64 buffer is at most about one float32 parameter (`4 numel` bytes)."""
    cap = max(_MIN_CHUNK, numel // (2 * max(num_slots, 1)))
    return min(chunk_size(num_slots, device), cap, numel)


def slot_runs(flats: Sequence[Tensor]) -> list[tuple[int, Tensor]]:
    """Groups consecutive slots into `(first slot, (k, n) view)` runs.

    Slots `i .. i + k - 1` form a run when they are equally spaced, non-overlapping,
    contiguous views of one storage (as `new_ring()` makes them); the run is then a
    strided matrix over that storage, no copy made. Any other slot is a run of one. The
    slots are flat views or C-contiguous tensors of any shape (their `n` elements in
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


def same(a: Tensor, b: Tensor) -> bool:
    """Whether two flat views are the same elements (e.g. the residual just written)."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def gram_leaf(flats: Sequence[Tensor], v: Tensor) -> Tensor | None:
    q, numel = len(flats), v.shape[0]
    if numel == 0:
        return None
    runs = slot_runs(flats)
    # float64, or complex128 for a complex window, whose products <s, v> = conj(s) . v are
    # formed as `mv(block.conj(), v)` (`conj()` of a real tensor is that tensor).
    acc = wide(v.dtype)
    partial = torch.zeros(q, dtype=acc, device=v.device)
    if v.dtype == acc and all(block.dtype == acc for _, block in runs):
        # Nothing to widen: one BLAS product per run over the whole vector.
        for first, block in runs:
            torch.mv(block.conj(), v, out=partial[first : first + block.shape[0]])
        return partial
    dots = native.float64_dots(flats, v)
    if dots is not None:
        return dots
    step = buffer_width(q, numel, v.device)
    buffer = torch.empty(q, step, dtype=acc, device=v.device)
    # Chunk views made in one call per run (cheaper than slicing chunk by chunk).
    pieces = [(first, block.shape[0], block.split(step, dim=1)) for first, block in runs]
    v_row = next((s for s, f in enumerate(flats) if same(f, v)), None)
    if v_row is None:
        v_pieces = v.split(step)
        v_buffer = torch.empty(step, dtype=acc, device=v.device)
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
        partial.addmv_(b.conj(), v_chunk)
    return partial


def combine_leaf(
    base: Tensor | None,
    flats: Sequence[Tensor],
    w: Tensor,
    result: Tensor,
    runs: list[tuple[int, Tensor]] | None = None,
) -> None:
    """Writes `base + sum_s w[s] flats[s]` into the flat `result` (`runs`: `slot_runs(flats)`
    when the caller has it)."""
    cdt, numel = result.dtype, result.shape[0]
    if numel == 0:
        return
    if runs is None:
        runs = slot_runs(flats)
    # `base` may be `result` itself: the sum is then accumulated in place, which reads
    # and writes one buffer instead of reading one and writing another.
    in_place = base is not None and same(base, result)
    if all(block.dtype == cdt for _, block in runs) and (base is None or base.dtype == cdt):
        # Matching dtypes: BLAS reads the slots in place. One run is one product over the
        # whole vector; several runs go chunk by chunk so the result chunk stays in cache.
        step = numel if len(runs) == 1 else min(chunk_size(1, result.device), numel)
        # Each run's weights and, in one chunk, its whole matrix, sliced once: the pure path
        # (slots not rows of one buffer) has a run per slot, and slicing costs per call.
        terms = [
            (w if block.shape[0] == w.shape[0] else w[first : first + block.shape[0]], block)
            for first, block in runs
        ]
        whole = step == numel
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            out = result if whole else result[start:stop]
            for index, (wk, block) in enumerate(terms):
                matrix = (block if whole else block[:, start:stop]).mT
                if index > 0 or in_place:
                    out.addmv_(matrix, wk)
                elif base is None:
                    torch.mv(matrix, wk, out=out)
                else:
                    torch.addmv(base if whole else base[start:stop], matrix, wk, out=out)
        return
    # Widening (e.g. a bf16 window into float32): convert a chunk of every slot in cache.
    # A float32 result is accumulated in float64 and rounded once: the products of float32
    # weights and bf16/fp16 values are exact there, so every element rounds to the same
    # float32 whatever order BLAS sums it in, which changes with the vector's length and
    # alignment (a shard of it, say). Rounded to bf16 in the next stored step, a one-ulp
    # difference would otherwise grow into a different run.
    q = len(flats)
    acc = accumulator(cdt, base, flats)
    w = w.to(acc)
    step = buffer_width(q, numel, result.device)
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


def accumulator(cdt: torch.dtype, base: Tensor | None, flats: Sequence[Tensor]) -> torch.dtype:
    """The dtype a combination accumulates in: float64 for a float32 result widened from
    narrower operands (a bf16/fp16 window or params), so that it is rounded once and comes
    out the same on every path (see `combine_leaf()`); else the compute dtype."""
    operands = [*flats, base] if base is not None else flats
    if cdt == torch.float32 and any(t.dtype != cdt for t in operands):
        return torch.float64
    return cdt


def difference_rows_leaf(
    flats: Sequence[Tensor], s: int, exact: bool
) -> tuple[Tensor, Tensor | None] | None:
    q, numel = len(flats), flats[0].shape[0]
    if numel == 0:
        return None
    if not exact:
        g = native.float64_dots(flats, flats[s])
        if g is not None:
            return g, None
    acc, dev = wide(flats[s].dtype), flats[0].device
    runs = slot_runs(flats)
    step = buffer_width(q, numel, dev)
    buffer = torch.empty(q, step, dtype=acc, device=dev)
    newest_step = torch.empty(step, dtype=acc, device=dev)
    g = torch.zeros(q, dtype=acc, device=dev)
    p = torch.zeros(q, dtype=acc, device=dev)
    pieces = [(first, block.shape[0], block.split(step, dim=1)) for first, block in runs]
    for i in range(len(pieces[0][2])):
        width = pieces[0][2][i].shape[1]
        b = buffer if width == step else buffer[:, :width]
        for first, k, chunks in pieces:
            b[first : first + k].copy_(chunks[i])
        # `resolve_conj`: with the lazily conjugated block (which shares memory with its
        # row argument) torch 2.5's addmv_ gave wrong complex products under vmap's
        # per-member rule; a real block has no conjugate bit, so it costs real windows nothing.
        bh = b.conj().resolve_conj()
        g.addmv_(bh, b[s])
        if exact:
            p.addmv_(bh, torch.sub(b[s], b[s - 1], out=newest_step[:width]))
    return g, p


def factor_leaf(
    flats: Sequence[Tensor], order: list[int], valid: list[bool], factor: Tensor
) -> Tensor:
    q, numel = len(flats), flats[0].shape[0]
    acc, dev = wide(flats[0].dtype), flats[0].device
    # Each chunk costs a LAPACK call whose overhead rivals O(Q^2 b) flops for small b: chunks
    # 4x wider than the other passes' (2^18 values on a CPU; measured 2x faster at n = 2^20,
    # Q = 9), with the same cap of about one float32 parameter.
    step = min(4 * buffer_width(q, numel, dev), max(_MIN_CHUNK, numel // (2 * q)), numel)
    # The QR's input [R; block], column-major (LAPACK's layout) as the transpose of a
    # row-major (Q, Q + step) buffer: each column of the block is then one contiguous row,
    # written by one subtraction. Columns of invalid differences stay zero (so do R's).
    work_t = torch.zeros(q, q + step, dtype=acc, device=dev)
    # geqrf writes its Householder vectors and R into a second buffer of that layout (R is
    # its upper triangle), so that no chunk allocates anything chunk-sized.
    reflected_t = torch.empty(q, q + step, dtype=acc, device=dev)
    tau = torch.empty(q, dtype=acc, device=dev)
    # float64 slots are read in place; others are widened chunk by chunk first (subtracting
    # them in their own dtype would round the differences).
    widen = any(f.dtype != acc for f in flats)
    buffer = torch.empty(q, step, dtype=acc, device=dev) if widen else None
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

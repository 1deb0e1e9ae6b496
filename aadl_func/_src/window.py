r"""The window as a ring-buffer data structure, and its passes over whole rings.

The window is a ring of `Q` slots, each a list of tensors (one per parameter leaf) living
on the history device in the history dtype (`new_ring()` lays a leaf's slots out as
rows of one buffer). Its operations:

* `write_slot()` -- `ring[slot] = value` (in place or not, the slot concrete or traced);
* `set_gram_row()` -- a row and column of a Gram matrix replaced;
* `gram_row()` -- $\langle s_j, v \rangle$ for every slot, in float64;
* `difference_rows()` -- the Gram rows of a newly written slot, in one pass;
* `append_difference()` -- the fused in-place append of a float32 window (native kernel);
* `combine()` -- $b + \sum_j w_j s_j$ in the compute dtype;
* `difference_factor()` -- a streaming float64 QR factor of the slots' differences;
* `window_factor()` -- that factor of a whole ring, its valid entries in chronological order.

Each pass runs leaf by leaf with the eager kernels (`aadl_func._src.kernels`) or, for
leaves batched by vmap or traced by torch.compile, their counterparts
(`aadl_func._src.batched`); the choice is per leaf because one tree may mix devices and
batched and unbatched leaves. All are O(Q n) and build no window-sized temporary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from aadl_func._src import batched, kernels, native, tree
from aadl_func._src.blend import Blend
from aadl_func._src.core.ring import chronological, difference_valid
from aadl_func._src.core.scalars import EXACT, float64_tensor, wide

__all__ = [
    "append_difference",
    "combine",
    "difference_factor",
    "difference_rows",
    "gram_row",
    "rows_from_dots",
    "new_ring",
    "set_gram_row",
    "stored_value",
    "window_factor",
    "write_slot",
]


def new_ring(
    like: Tensor,
    num_slots: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    pin_memory: bool = False,
) -> list[Tensor]:
    """`num_slots` zeroed window slots shaped and strided like `like`: rows of one buffer.

    Every slot is a view of one `num_slots * like.numel()` allocation, `like`'s strides
    (`channels_last` included) kept, so the passes of this module see the ring as one
    `(num_slots, n)` matrix. In-place updates keep this layout; a slot replaced by a new
    tensor (the pure path) only makes the passes take their chunked route.

    Args:
      like: a parameter leaf; its shape and memory format are copied.
      num_slots: `Q`.
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


def gram_row(
    slots: Sequence[Sequence[Tensor]], vector: Sequence[Tensor], device: torch.device
) -> Tensor:
    r"""`row[s] = <slots[s], vector>` summed over leaves, in float64, on `device`.

    $$
    \mathrm{row}_s = \sum_{\mathrm{leaves}} \sum_i \mathrm{f64}(s_{s,i})\,
    \mathrm{f64}(v_i)
    $$

    The pass runs where the slots live; only the `Q` results move to `device`.

    Args:
      slots: `slots[s][leaf]` window tensors.
      vector: one tensor per leaf, laid out like the slots (same strides); it may be one of
        the slots (the residual just written), which is then converted only once.
      device: where the result (`Q` scalars) goes.
    """
    # float64, or complex128 for a complex window (whose leaves are all complex: check_floating).
    row = torch.zeros(len(slots), dtype=wide(vector[0].dtype), device=device)
    for leaf_index, v in enumerate(vector):
        flats = [tree.flat_view(slot[leaf_index]) for slot in slots]
        v_flat = tree.flat_view(v)
        if tree.any_transformed([v_flat, *flats]):
            partial = batched.gram_leaf(flats, v_flat)
        else:
            partial = kernels.gram_leaf(flats, v_flat)
        if partial is not None:
            row = row + partial.to(device)
    return row


def combine(
    base: Sequence[Tensor] | None,
    rings: Sequence[Sequence[Sequence[Tensor]]],
    weights: Tensor,
    compute_dtypes: Sequence[torch.dtype],
    like: Sequence[Tensor],
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    r"""`base + sum_s weights[s] * slot_s` per leaf, slots taken from `rings` in order.

    $$
            x = b + \sum_s w_s\, s_s \quad \text{(in the compute dtype)}
    $$

    One pass over the window where it lives; the result is the only parameter-sized
    allocation (page-locked when `like` is, so that it can be sent to an accelerator
    asynchronously), none with `out`.

    Args:
      base: one tensor per leaf, or None for zero.
      rings: each ring is `ring[s][leaf]`; their slots are concatenated.
      weights: `(total slots,)` float64 weights (any device).
      compute_dtypes: per leaf, the dtype of the accumulation (float32 or float64).
      like: per leaf, a tensor whose layout the result takes (on the slots' device).
      out: per leaf, a tensor to write the result into instead (laid out like `like`, in
        the compute dtype, on the slots' device, overlapping none of the inputs; it may be
        `base` itself, which then accumulates the sum in place).
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
            result = batched.combine_leaf(base_flat, flats, w, cdt, template)
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
        kernels.combine_leaf(base_flat, flats, w, flat_result)
        results.append(result)
    return results


def _empty_like(
    template: Tensor, dtype: torch.dtype, device: torch.device, *, pin_memory: bool
) -> Tensor:
    """An uninitialised tensor with `template`'s shape and memory format."""
    if not pin_memory:
        return torch.empty_like(template, dtype=dtype, device=device)
    strides = torch.empty_like(template, dtype=dtype, device="meta").stride()
    return torch.empty_strided(template.shape, strides, dtype=dtype, device=device, pin_memory=True)


def _is_pinned(t: Tensor) -> bool:
    # `is_pinned` asks the accelerator runtime; only worth asking when one exists.
    return t.device.type == "cpu" and torch.cuda.is_available() and t.is_pinned()


def write_slot(
    ring: tuple[list[Tensor], ...],
    slot: Tensor,
    value: Sequence[Tensor],
    inplace: bool,
    blend: Blend,
) -> tuple[list[Tensor], ...]:
    """The ring with `ring[slot] = value`: touches one slot when `slot` is concrete.

    In place, `value` is copied into the slot's buffers (nothing to do when `value` is
    those buffers, e.g. a residual computed straight into its slot), with `blend.assign`
    (masked inside a blended select of the call, see `aadl_func._src.blend.Blend`).
    When the slot index is not concrete (traced by torch.compile; members of a vmapped
    ensemble out of step) every slot is blended with `torch.where`: one pass over the
    window, the price of data-dependent indexing without reading the index. A compiled
    in-place step with the index on the CPU writes large slots through `traced.copy_if_`
    instead, which copies into the one slot that matches and leaves the others untouched.
    """
    if tree.tracing():
        value = [stored_value(v) for v in value]
    index = tree.static_value(slot)
    if index is not None:
        if inplace:
            for dst, src in zip(ring[index], value):
                if src is not dst:
                    blend.assign(dst, src)
            return ring
        return tuple(list(value) if s == index else entries for s, entries in enumerate(ring))
    if inplace:
        # Traced in-place step: every slot is written in place under its mask, so the window
        # keeps its buffers. Large leaves go through `traced.copy_if_` (one slot's traffic,
        # not a pass over the window).
        large = _skips_misses(ring, slot, value)
        for s, entries in enumerate(ring):
            for dst, src, big in zip(entries, value, large):
                blend.assign(dst, src, where=slot == s, skip_misses=big)
        return ring
    return tuple(
        [torch.where((slot == s).to(v.device), v, e) for v, e in zip(value, entries)]
        for s, entries in enumerate(ring)
    )


# Integer types of the same width, for the bitcast of `stored_value()`.
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def stored_value(value: Tensor) -> Tensor:
    """`value` as the window stores it, for a traced (compiled) step.

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
    r"""Hermitian (real: symmetric) Gram with column `slot` replaced by `row` and row
    `slot` by its conjugate: `row[t]` is $G_{t,s} = \langle f_t, f_s \rangle$, so
    $G_{s,t} = \overline{\mathrm{row}_t}$ (`conj()` of a real row is the row)."""
    known = tree.static_value(slot)
    if known is not None and not tree.any_transformed([gram, row]):
        # Eager: the same entries as the masked blend below, in three operations.
        gram = gram.clone()
        gram[known] = row.conj()
        gram[:, known] = row
        return gram
    index = torch.arange(gram.shape[-1], device=gram.device)
    hit = index == slot.to(gram.device)
    gram = torch.where(hit[:, None], row.conj()[None, :], gram)
    return torch.where(hit[None, :], row[:, None], gram)


# A compiled in-place ring write goes through `traced.copy_if_` for leaves of this many
# elements or more. Below, the masked rewrite of every slot, fused with the pass that computes
# the new entry, costs less than the operator's calls (tens of microseconds per step). Measured
# on this 2-core machine, compiled step / eager step, masked rewrite against copy_if_:
# 2^16, m = 5: 0.30 / 0.51; 2^17, m = 5: 0.45 / 0.62; 2^18, m = 10: 1.27 / 0.75;
# 2^20, m = 3: 1.57 / 0.99; 2^22, m = 3: 2.16 / 1.13; 2^22, m = 10: ~1.45 / ~0.9.
_TRACED_COPY_MIN_NUMEL = 1 << 18


def _skips_misses(
    ring: tuple[list[Tensor], ...], slot: Tensor, value: Sequence[Tensor]
) -> list[bool]:
    """Per leaf, whether a traced in-place `write_slot()` uses `traced.copy_if_`:
    compiled, the slot index a host value (on an accelerator the fused blend keeps the step
    free of host reads), and a leaf large enough to pay for the operator's calls."""
    if not (tree.tracing() and slot.device.type == "cpu"):
        return [False] * len(value)
    return [v.device.type == "cpu" and v.numel() >= _TRACED_COPY_MIN_NUMEL for v in value]


def append_difference(
    ring: Sequence[Sequence[Tensor]],
    slot: int,
    newest: Sequence[Tensor],
    anchor: Sequence[Tensor],
    device: torch.device,
) -> Tensor | None:
    r"""In place, in one pass per leaf: `ring[slot] = newest - anchor`, `anchor = newest`,
    and the Gram row $g_t = \langle f_t, f_s \rangle$ of the new residual (float64,
    summed over leaves, on `device`), which `difference_rows()` then takes as `g`.

    The in-place append of a float32 window on the CPU with the native kernel
    (`aadl_func._src.native.append_differences()`): it replaces a subtraction, a copy and
    the Gram-row pass. Returns None, having written nothing, unless every leaf qualifies
    (float32 throughout, `newest`, `anchor` and the slots laid out alike).
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
    r"""The new Gram rows after residual `f_s` was written in slot `s`, in one pass.

    With $d_t = f_t - f_{t-1}$ (ring predecessor) and the window's Gram matrix `gram`
    ($G$, whose row $s - 1$ is current), returns, in ring order,

    $$
    g_t = \langle f_t, f_s \rangle, \qquad
    h_t = \langle d_t, d_s \rangle = p_t - p_{t-1}, \qquad
    c_t = \langle d_t, f_s \rangle = g_t - g_{t-1}, \qquad
    p_t = \langle f_t, d_s \rangle .
    $$

    A float64 window gets $p$ from $d_s$ formed element by element (exact), so
    $h$ carries rounding $\epsilon \|f\| \|d\|$, one factor
    $\|f\| / \|d\|$ below differencing $G$ twice. A float32, bf16 or fp16 window
    takes $p_t = g_t - G_{t, s-1}$ instead, which saves a matrix-vector product per
    chunk (a third of the step on CPU): its rounding, $\epsilon_{64} (\|f\| / \|d\|)^2$
    relative, stays far below that of the stored data itself,
    $\epsilon_{32} \|f\| / \|d\|$, until $\|f\| / \|d\|$ reaches ~1e9.

    Args:
      slots: `slots[t][leaf]` window tensors (ring order).
      slot: 0-d int64, the slot just written (its predecessor is the previous newest).
      device: where the three `(Q,)` float64 results go.
      gram: `(Q, Q)` float64 $G$ before the write (row `s - 1` is used).
      g: the row $g$ if already computed (by `append_difference()`; float32,
        bf16 or fp16 windows only), which saves the pass.
      direct: form $d_s$ element by element whatever the window's dtype, as for a
        float64 window, instead of reading row `s - 1` of `gram`. A sharded step needs
        this when the safeguard replaces the newest residual: `gram` row `s - 1` is
        then already summed over ranks, while $g$ is this rank's partial row.

    Returns:
      `(g, h, c)`.
    """
    q = len(slots)
    exact = direct or all(s.dtype in EXACT for s in slots[0])
    acc = wide(slots[0][0].dtype)  # float64 or complex128 (leaves all real or all complex)
    p = torch.zeros(q, dtype=acc, device=device) if exact else None
    if g is not None and exact:
        raise ValueError(
            "difference_rows: a precomputed `g` needs a float32/bf16/fp16 window and direct=False"
        )
    leaves = [] if g is not None else range(len(slots[0]))
    g = torch.zeros(q, dtype=acc, device=device) if g is None else g.to(device)
    index = tree.static_value(slot)
    for leaf_index in leaves:
        flats = [tree.flat_view(s[leaf_index]) for s in slots]
        if index is None or tree.any_transformed(flats):
            parts = batched.difference_rows_leaf(flats, slot, exact)
        else:
            parts = kernels.difference_rows_leaf(flats, index, exact)
        if parts is not None:
            g = g + parts[0].to(device)
            if exact:
                p = p + parts[1].to(device)
    return rows_from_dots(g, p, gram, slot, index, device)


def rows_from_dots(
    g: Tensor, p: Tensor | None, gram: Tensor, slot: Tensor, index: int | None, device: Any
) -> tuple[Tensor, Tensor, Tensor]:
    r"""`difference_rows()`'s rows from its pass: $g_t = \langle f_t, f_s \rangle$ and, for a
    float64 window, $p_t = \langle f_t, d_s \rangle$ (None otherwise: then taken from
    `gram`'s row $s - 1$). `slot` is the 0-d slot tensor, `index` its value when known."""
    q, acc = g.shape[0], g.dtype
    if p is None and index is not None and acc == torch.float64 and tree.readable(g, gram):
        # Eager on the CPU: the same subtractions on Python floats (fewer tiny operations).
        _, h, c = known_rows(g.tolist(), gram[(index - 1) % q].tolist(), index)
        return g, float64_tensor(h), float64_tensor(c)
    c = g - g.roll(1)
    if p is None:
        # p_t = <f_t, d_s> = g_t - <f_t, f_{s-1}>, the last the conjugate of the stored row
        # s - 1 (G is Hermitian), except t = s, whose stored entry is the old f_s: there
        # p_s = g_s - <f_s, f_{s-1}> = g_s - conj(g_{s-1}), which for real data is c_s.
        if index is not None:
            previous = (index - 1) % q
            p = g - gram.to(device)[previous].conj()
            p[index] = g[index] - g[previous].conj() if acc.is_complex else c[index]
        else:
            ring = torch.arange(q, device=device)
            at = slot.to(device)
            previous = (at - 1) % q
            before = torch.where(ring == at, _pick(g, previous), _pick(gram.to(device), previous))
            p = g - before.conj()
    return g, p - p.roll(1), c


def known_rows(
    g: list[float], before: list[float], index: int
) -> tuple[list[float], list[float], list[float]]:
    r"""`rows_from_dots()` for a real float32/bf16/fp16 window whose row $g$ and the Gram's
    row `before` $= G_{s-1, :}$ are known as Python floats (an eager step): `(g, h, c)` as
    lists, each entry one IEEE subtraction, as that function's tensor operations round it.
    `index` is the slot $s$."""
    q = len(g)
    c = [g[t] - g[t - 1] for t in range(q)]  # g - g.roll(1)
    p = [g[t] - before[t] for t in range(q)]
    p[index] = c[index]  # p_s = g_s - g_{s-1} (real data)
    return g, [p[t] - p[t - 1] for t in range(q)], c


def _pick(t: Tensor, index: Tensor) -> Tensor:
    """`t[index]` for a 0-d index tensor, without reading its value (vmap, torch.compile)."""
    return t.index_select(0, index.reshape(1)).squeeze(0)


def difference_factor(
    slots: Sequence[Sequence[Tensor]],
    order: Tensor,
    valid: Tensor,
    device: torch.device,
) -> Tensor:
    r"""The float64 (complex window: complex128) triangular factor `R` of
    $[\Delta F \mid f_{\mathrm{last}}]$, streamed.

    With the residuals $f_p$ = `slots[order[p]]` in chronological order (`p = 0 ..
    Q - 1`, the newest last), the columns are $\Delta F_{:, j} = f_{j+1} - f_j$
    (`j < Q - 1`, zero where `valid[j]` is False) and $f_{Q-1}$; their
    `Q x Q` factor ($R^\top R = A^\top A$) is built by a streaming TSQR: for each
    chunk of `b` coordinates of every leaf, the `b x Q` float64 block of $A$ is
    formed from the slots (the differences element by element, one rounding each, as
    `numpy.diff` forms them) below $R$, and $R \leftarrow$ the factor of
    $[R; \text{block}]$ by a Householder QR. That costs $O(Q^2 n)$ flops but only
    $O(Q b)$ memory (the chunk sizes of the other passes), nothing parameter-sized.

    Args:
      slots: `slots[s][leaf]` window tensors (ring order), any floating dtype.
      order: `(Q,)` int64, the ring slots from oldest to newest.
      valid: `(Q - 1,)` bool, which differences take part.
      device: where the `(Q, Q)` result goes.
    """
    q = len(slots)
    factor = torch.zeros(q, q, dtype=wide(slots[0][0].dtype), device=device)
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
            factor = batched.factor_leaf(flats, order, valid, factor.to(here))
        else:
            factor = kernels.factor_leaf(flats, *positions, factor.to(here))
    return factor.to(device)


def window_factor(ring: tuple, head: Tensor, num_residuals: Tensor, device: Any) -> Tensor:
    """The float64 QR factor of `[DF | f_head]` over the valid residuals of `ring`
    (this rank's rows only when sharded): one streaming pass, O(Q^2 n) flops."""
    q = len(ring)
    return difference_factor(
        ring, chronological(q, head), difference_valid(q, num_residuals), device
    )

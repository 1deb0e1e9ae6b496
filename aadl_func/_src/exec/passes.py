r"""The eager executor's passes and small problem, over explicit tensors.

Each function is one stage of `aadl_func._src.exec.eager` with its inputs as arguments: the
Gram rows of an append and whether they are finite, the mixing weights of the window, the
combination of its slots, and the finiteness test of a mix. They run the tensor operations
of the general path's stages (`aadl_func._src.stages`, `aadl_func._src.window`), so they
give its bits, and skip its machinery: the slots are read as the `(Q, n)` matrices
`anderson.init` lays them out as, and the native kernel is called directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from aadl_func._src import kernels, native
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.ring import to_ring_order
from aadl_func._src.core.scalars import EXACT, float64_tensor
from aadl_func._src.core.weights import known_weights, window_weights
from aadl_func._src.exec.ops import OPS
from aadl_func._src.options import AndersonOptions
from aadl_func._src.window import combine as window_combine
from aadl_func._src.window import difference_rows, known_rows, window_factor

__all__ = [
    "add_steps",
    "appended_grams",
    "combine",
    "copy_leaves",
    "finite",
    "mixing_weights",
    "ring_list",
    "ring_order",
]

_INT64 = torch.int64


def appended_grams(
    ring: tuple, slot: int, grams: Grams, grown: int, g: Tensor | None = None
) -> Grams | None:
    r"""The Grams `(gram, dr_gram, dr_rhs)` after the residual in `ring[slot]` joined the
    window of `grown` residuals (`aadl_func._src.stages.append()`), or None when its rows
    are not finite over the valid slots (the append is poisoned). A float32 or bf16
    window: the row $g$ from the native kernel's pass (or `g`, which the fused append
    computed), and the rest as Python floats (`window.known_rows()`); other windows:
    `aadl_func._src.window.difference_rows()`."""
    q = len(ring)
    if not any(leaf.dtype in EXACT for leaf in ring[0]):
        if grams.gram.dtype == torch.float64 and grams.gram.is_cpu:
            known = g.tolist() if g is not None else _known_dots_row(ring, slot)
            if known is not None:
                return _appended_known(grams, slot, grown, known)
        g = _dots_row(ring, slot, grams.gram.device) if g is None else g
    slot_t = torch.scalar_tensor(slot, dtype=_INT64)
    rows = difference_rows(ring, slot_t, grams.gram.device, grams.gram, g=g)
    stacked = torch.stack(rows)
    if grown != q:
        age = (slot_t - torch.arange(q)) % q
        stacked = torch.where((age < grown).to(stacked.device), stacked, 0.0)
    low, high = torch.aminmax(stacked)
    if not (-math.inf < low.item() and high.item() < math.inf):
        return None
    g, h, c = rows
    return Grams(_set_row(grams.gram, slot, g), _set_row(grams.dr_gram, slot, h), c)


def _dots_row(ring: tuple, slot: int, device: torch.device) -> Tensor | None:
    r"""The row $g_t = \langle f_t, f_s \rangle$ of the residual in `ring[slot]` by the
    native kernel (summed over leaves) on `device`, or None where a leaf does not lie as
    it takes it."""
    row = _known_dots_row(ring, slot)
    return None if row is None else float64_tensor(row).to(device)


def _known_dots_row(ring: tuple, slot: int) -> list[float] | None:
    """`_dots_row()` as Python floats: the leaves' rows summed in the same order, each sum
    one IEEE addition, as the float64 tensor additions there round it (from `0.0`, so a
    `-0.0` sum comes out `0.0` as there), without a tensor per leaf."""
    g = [0.0] * len(ring)
    for i, newest in enumerate(ring[slot]):
        if newest.numel() == 0:
            continue
        part = None
        if newest.is_contiguous():
            part = native.float64_dots([entry[i] for entry in ring], newest.view(-1))
        if part is None:  # not a plain contiguous CPU window: the general pass
            return None
        g = [a + b for a, b in zip(g, part.tolist())]
    return g


def _appended_known(grams: Grams, slot: int, grown: int, g: list[float]) -> Grams | None:
    """`appended_grams()` from the row `g` of a real window, the rows and the finiteness
    test over the valid slots (age below `grown`) in Python floats."""
    q = len(g)
    gram, dr_gram = grams.gram.tolist(), grams.dr_gram.tolist()
    g, h, c = known_rows(g, gram[(slot - 1) % q], slot)
    checked = (g, h, c)
    if grown != q:  # only the slots in the window (their age below `grown`)
        checked = [[v for t, v in enumerate(row) if (slot - t) % q < grown] for row in checked]
    if not all(map(math.isfinite, chain.from_iterable(checked))):
        return None
    return Grams(
        _with_row(gram, slot, g),
        _with_row(dr_gram, slot, h),
        float64_tensor(c),
    )


def mixing_weights(
    options: AndersonOptions, ring: tuple, grams: Grams, head: int, num_residuals: int
) -> tuple[Tensor | list[float], Any]:
    """The affine weights $\alpha$ of the window whose newest residual is in slot `head`
    (`aadl_func._src.stages.solve()`), chronological, and whether the solve succeeded:
    from the Grams, or for a float64 window from a QR factor streamed from the ring (a full
    window: as Python floats, `core.weights.known_weights()`)."""
    exact = all(leaf.dtype in EXACT for leaf in ring[0])
    device = grams.gram.device
    head_t, num_t, factor = None, None, None
    if exact:
        head_t, num_t = _counters(head, num_residuals)
        factor = window_factor(ring, head_t, num_t, device)
    known = known_weights(options, grams, head, num_residuals, factor, ops=OPS)
    if known is not None:
        return known[1], True
    if head_t is None:
        head_t, num_t = _counters(head, num_residuals)
    weights, _, _ = window_weights(
        options, len(ring), grams, head_t, num_t, device, exact=exact, factor=factor, ops=OPS
    )
    return weights.alpha, weights.ok


def _counters(*values: int) -> tuple[Tensor, ...]:
    return tuple(torch.scalar_tensor(v, dtype=_INT64) for v in values)


def ring_order(newest: int, *chrono: Tensor | list[float]) -> Tensor:
    """Vectors by chronological position moved to their ring slots and concatenated
    (`aadl_func._src.core.ring.to_ring_order()`): position `j` goes to slot
    `(newest + 1 + j) % Q`. Lists (known values) become one float64 tensor."""
    if isinstance(chrono[0], list):
        return float64_tensor(ring_list(newest, *chrono))
    if len(chrono) == 1:
        return to_ring_order(chrono[0], newest)
    return torch.cat([to_ring_order(c, newest) for c in chrono])


def ring_list(newest: int, *chrono: list[float]) -> list[float]:
    """`ring_order()` for lists (known values), as one list."""
    shift = (newest + 1) % len(chrono[0])
    return [v for c in chrono for v in (c[-shift:] + c[:-shift] if shift else c)]


def combine(
    like: Sequence[Tensor],
    compute_dtypes: Sequence[torch.dtype],
    base: Sequence[Tensor] | None,
    rings: Sequence[tuple],
    weights: Tensor,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """`aadl_func._src.window.combine()` (same arguments), reading each leaf's slots as
    the `(Q, n)` matrices `anderson.init` lays them out as, without looking for their runs;
    other layouts go to that function."""
    templates = [*like, *(base or ()), *(out or ())]
    if not all(t.is_contiguous() for t in templates):  # e.g. channels_last: flat views
        return window_combine(base, rings, weights, compute_dtypes, like, out=out)
    runs = []
    for i in range(len(like)):
        leaf_runs, first = [], 0
        for ring in rings:
            matrix = _rows_of_one_buffer([entry[i] for entry in ring])
            if matrix is None:
                return window_combine(base, rings, weights, compute_dtypes, like, out=out)
            leaf_runs.append((first, matrix))
            first += len(ring)
        runs.append(leaf_runs)
    results, converted = [], {}  # the weights in each compute dtype, converted once
    for i, template in enumerate(like):
        cdt = compute_dtypes[i]
        if cdt not in converted:
            converted[cdt] = weights.to(dtype=cdt)
        result = torch.empty_like(template, dtype=cdt) if out is None else out[i]
        kernels.combine_leaf(
            None if base is None else base[i].view(-1),
            [entry[i] for ring in rings for entry in ring],
            converted[cdt],
            result.view(-1),
            runs[i],
        )
        results.append(result)
    return results


def add_steps(params: list[Tensor], updates: list[Tensor], stepped: list[Tensor]) -> None:
    """`y = x + u` into the params (`_Step.plain_step()`), each leaf recorded in
    `stepped`: on several leaves as one foreach op, which adds leaf by leaf with the same
    per-tensor kernel on the CPU (one Python call instead of one per leaf; on one leaf the
    plain op costs less). An exception between the adds and their record is told apart
    by the params' version counters, which the steady call's recovery reads
    (`exec.inplace.restart_window()`)."""
    if len(params) == 1:
        stepped.append(params[0].add_(updates[0]))
    else:
        torch._foreach_add_(params, updates)
        stepped.extend(params)


def copy_leaves(targets: list[Tensor], sources: list[Tensor]) -> None:
    """`targets[i].copy_(sources[i])` for every leaf (as `add_steps()`: one foreach op on
    several leaves)."""
    if len(targets) == 1:
        targets[0].copy_(sources[0])
    else:
        torch._foreach_copy_(targets, sources)


def finite(x_hist: Sequence[Tensor], params: Sequence[Tensor], solved: Any) -> bool:
    """Whether the solve and the mix are finite in the params' dtypes
    (`aadl_func._src.stages.finite()`)."""
    if not solve_succeeded(solved):
        return False
    kernel = native.available()
    for t, p in zip(x_hist, params):
        if t.numel() == 0:
            continue
        if kernel and t.dtype == p.dtype == torch.float32 and _plain_contiguous(t):
            # Within float32's range is finite: one pass of the native kernel.
            if not native.finite_f32(t):
                return False
            continue
        limit = torch.finfo(p.dtype).max
        low, high = torch.aminmax(t)
        if not (low.item() >= -limit and high.item() <= limit):
            return False
    return True


def solve_succeeded(solved: Any) -> bool:
    """Whether the small solve succeeded: `solved` a bool, or a 0-d bool tensor."""
    return solved if isinstance(solved, bool) else bool(solved.item())


def _plain_contiguous(t: Tensor) -> bool:
    """A plain C-contiguous CPU tensor, whose elements the native kernel may read."""
    return type(t) is Tensor and t.is_cpu and t.is_contiguous()


def _rows_of_one_buffer(slots: Sequence[Tensor]) -> Tensor | None:
    """The slots as one `(Q, n)` matrix when they are consecutive C-contiguous rows of one
    buffer (as `anderson.init` lays a leaf's slots out), else None."""
    first = slots[0]
    n = first.numel()
    if n == 0 or not first.is_contiguous():
        return None
    size, start = first.element_size(), first.data_ptr()
    for s, slot in enumerate(slots):
        if slot.data_ptr() != start + s * n * size or not slot.is_contiguous():
            return None
        if slot.dtype != first.dtype:
            return None
    # Every slot lies in the first one's storage if that storage reaches past the last row.
    if first.untyped_storage().nbytes() < (first.storage_offset() + len(slots) * n) * size:
        return None
    return first.as_strided((len(slots), n), (n, 1))


def _with_row(matrix: list[list[float]], slot: int, row: list[float]) -> Tensor:
    """`_set_row()` for a real matrix given as nested lists: a new float64 tensor."""
    matrix[slot] = list(row)
    for i, value in enumerate(row):
        matrix[i][slot] = value
    return float64_tensor([v for r in matrix for v in r], len(matrix))


def _set_row(gram: Tensor, slot: int, row: Tensor) -> Tensor:
    """`aadl_func._src.window.set_gram_row()` for a known slot."""
    gram = gram.clone()
    gram[slot] = row.conj()
    gram[:, slot] = row
    return gram

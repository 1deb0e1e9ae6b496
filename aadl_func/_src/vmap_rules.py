r"""The window's passes as torch operators whose `vmap` rule runs them member by member.

Under `torch.func.vmap` every window slot is a batched tensor, physically a `(B, n)`
buffer. Expressed in batched torch operations, the two passes of a step (the float64 Gram row
and the combination $b + \sum_s w_s s_s$) must stack the slots chunk by chunk and
multiply with batched matrix-vector products, which on a CPU costs several times the passes
of the members' own steps. Registered with `torch.library`, the passes instead get a
batching rule that takes each member's rows (plain 1-d views of the physical buffers, no
copy) and runs the eager pass on them: the native float64 kernel or one BLAS product per
run of slots, exactly what a member's own step does. The rest of the step (the decisions,
the small solve) stays batched, so an ensemble step costs about the members' passes plus
one step's Python.

Only for CPU tensors outside `torch.compile` (`per_member()`): a compiled step traces
its passes as fused torch expressions instead, and on an accelerator the batched torch path
keeps one kernel launch for all members.

The operators take flat 1-d tensors (`tree.flat_view`) and compute, in float64 from exact
products of the stored values,

$$
\mathrm{gram\_row}_s = \langle r_s, v \rangle, \qquad
\mathrm{difference\_rows} = (\langle r_t, r_s \rangle_t,\ \langle r_t, r_s - r_{s-1}
\rangle_t), \qquad
\mathrm{combine} = b + \sum_s w_s r_s \ \text{(in the compute dtype)}.
$$
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import List  # noqa: UP035 (see the operators below)

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import kernels, tree
from aadl_func._src.core.scalars import wide

__all__ = ["per_member", "gram_row", "difference_rows", "combine"]


def per_member(tensors: Sequence[Tensor | None]) -> bool:
    """Whether the passes over `tensors` (flat, some batched by vmap) should run member by
    member: eager (not traced), on the CPU, and not recorded by autograd (the operators
    have no derivative; a differentiated pass takes the batched torch path)."""
    if tree.tracing():
        return False
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or t.requires_grad or _differentiated(t)):
            return False
    return True


def _differentiated(t: Tensor) -> bool:
    """Whether a torch.func `grad`/`jvp` level wraps `t` (under `jvp` a tensor carries
    a forward tangent yet reports `requires_grad=False`)."""
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_gradtrackingtensor(t):
            return True
        t = _functorch.get_unwrapped(t)
    return False


def _wrapped(tensors: Sequence[Tensor | None]) -> bool:
    """Whether a member's tensors are still wrapped by another transform level."""
    return any(t is not None and _functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _member(t: Tensor | None, dim: int | None, b: int) -> Tensor | None:
    return t if t is None or dim is None else t.select(dim, b)


def _rows(rows: Sequence[Tensor], dims: Sequence[int | None], b: int) -> list[Tensor]:
    return [_member(r, d, b) for r, d in zip(rows, dims)]


# -- the Gram row <r_s, v> -------------------------------------------------------------
def _gram_row(rows: list[Tensor], vector: Tensor) -> Tensor:
    partial = kernels.gram_leaf(rows, vector)
    return partial if partial is not None else vector.new_zeros(len(rows), dtype=wide(vector.dtype))


# The operators' signatures say `List[Tensor]`: torch before 2.7 infers a schema from the
# annotation strings (`from __future__ import annotations`) by evaluating them among
# `typing`'s names, and knows `typing.List` but not the built-in `list[Tensor]`.
@torch.library.custom_op("aadl_func::gram_row", mutates_args=())
def gram_row(rows: List[Tensor], vector: Tensor) -> Tensor:  # noqa: UP006
    """`(len(rows),)` float64 (complex: complex128) `<rows[s], vector>`."""
    return _gram_row(rows, vector)


@gram_row.register_fake
def gram_row_shape(rows: list[Tensor], vector: Tensor) -> Tensor:
    return vector.new_empty(len(rows), dtype=wide(vector.dtype))


@gram_row.register_vmap
def gram_row_per_member(info, in_dims, rows: list[Tensor], vector: Tensor):
    row_dims, vector_dim = in_dims
    out = torch.empty(info.batch_size, len(rows), dtype=wide(vector.dtype), device=vector.device)
    for b in range(info.batch_size):
        member_rows, member_vector = _rows(rows, row_dims, b), _member(vector, vector_dim, b)
        # Plain members run the eager pass directly (no operator dispatch per member);
        # members batched at another level too (nested vmap) go through that level's rule.
        run = gram_row if _wrapped([*member_rows, member_vector]) else _gram_row
        out[b] = run(member_rows, member_vector)
    return out, 0


# -- the rows of a newly written slot --------------------------------------------------
@torch.library.custom_op("aadl_func::difference_rows", mutates_args=())
def difference_rows(
    rows: List[Tensor],  # noqa: UP006
    slot: int,
    exact: bool,
) -> tuple[Tensor, Tensor]:
    """`(<r_t, r_s>, <r_t, r_s - r_{s-1}>)` over `t` in float64; the second is empty
    unless `exact` (window.difference_rows)."""
    return _difference_rows(rows, slot, exact)


def _difference_rows(rows: list[Tensor], slot: int, exact: bool) -> tuple[Tensor, Tensor]:
    q = len(rows)
    parts = kernels.difference_rows_leaf(rows, slot, exact)
    acc = wide(rows[0].dtype)
    zeros = rows[0].new_zeros(q if exact else 0, dtype=acc)
    if parts is None:  # empty rows
        return rows[0].new_zeros(q, dtype=acc), zeros
    g, p = parts
    return g, p if exact else zeros


@difference_rows.register_fake
def difference_rows_shape(rows: list[Tensor], slot: int, exact: bool) -> tuple[Tensor, Tensor]:
    q, acc = len(rows), wide(rows[0].dtype)
    return rows[0].new_empty(q, dtype=acc), rows[0].new_empty(q if exact else 0, dtype=acc)


@difference_rows.register_vmap
def difference_rows_per_member(info, in_dims, rows: list[Tensor], slot: int, exact: bool):
    row_dims = in_dims[0]
    q, size = len(rows), info.batch_size
    device = next(r.device for r in rows)
    acc = wide(rows[0].dtype)
    g = torch.empty(size, q, dtype=acc, device=device)
    p = torch.empty(size, q if exact else 0, dtype=acc, device=device)
    for b in range(size):
        member_rows = _rows(rows, row_dims, b)
        run = difference_rows if _wrapped(member_rows) else _difference_rows
        g[b], p[b] = run(member_rows, slot, exact)
    return (g, p), (0, 0)


# -- the combination b + sum_s w_s r_s -------------------------------------------------
@torch.library.custom_op("aadl_func::combine", mutates_args=())
def combine(base: Tensor | None, rows: List[Tensor], weights: Tensor) -> Tensor:  # noqa: UP006
    """`base + sum_s weights[s] rows[s]` in `weights`' dtype (the compute dtype)."""
    result = torch.empty(rows[0].shape, dtype=weights.dtype, device=rows[0].device)
    kernels.combine_leaf(base, rows, weights, result)
    return result


@combine.register_fake
def combine_shape(base: Tensor | None, rows: list[Tensor], weights: Tensor) -> Tensor:
    return rows[0].new_empty(rows[0].shape, dtype=weights.dtype)


@combine.register_vmap
def combine_per_member(info, in_dims, base: Tensor | None, rows: list[Tensor], weights: Tensor):
    base_dim, row_dims, weight_dim = in_dims
    numel = next(r.shape[-1] for r in rows)
    out = torch.empty(info.batch_size, numel, dtype=weights.dtype, device=rows[0].device)
    for b in range(info.batch_size):
        member_base = _member(base, base_dim, b)
        member_rows = _rows(rows, row_dims, b)
        member_weights = _member(weights, weight_dim, b)
        if _wrapped([member_base, *member_rows, member_weights]):
            # Batched at another level too (nested vmap): that level's rule takes over.
            out[b] = combine(member_base, member_rows, member_weights)
        else:
            kernels.combine_leaf(member_base, member_rows, member_weights, out[b])
    return out, 0

"""The memory of the leaves and of the state: metadata only (layouts, addresses, extents).

A step writes in place into every params leaf and every tensor of the state, each element
once: a leaf that cannot be written, two elements at one address, or two tensors that
overlap would tear a step halfway or change a tensor behind the window's Grams. These checks
refuse them before anything is written; messages name the leaf by its key path.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import optree
import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.state import AndersonState

__all__ = [
    "all_strided",
    "check_dense",
    "check_no_aliasing",
    "check_state_memory",
    "check_writable",
    "first_overlap",
    "self_overlapping",
    "byte_span",
]


def check_dense(owner: str, name: str, leaves: list[Tensor], spec: Any) -> None:
    """Every leaf is a dense (strided) tensor: sparse, sparse-CSR or MKL-DNN layouts have no
    element-wise in-place arithmetic or byte extents, and would fail inside the step with
    torch's message instead of this one (torch.optim's dense optimizers refuse them too)."""
    for i, t in enumerate(leaves):
        if isinstance(t, Tensor) and t.layout is not torch.strided:
            raise TypeError(
                f"{owner}: `{tree.leaf_path(spec, i, name)}` has layout {t.layout}; only "
                "dense (strided) tensors are supported: pass .to_dense()"
            )


def all_strided(leaves: list[Tensor]) -> bool:
    """Whether every one of `leaves` (tensors) is dense: one C-level pass, no Python loop."""
    return all(map(operator.is_, map(_LAYOUT, leaves), itertools.repeat(torch.strided)))


def check_writable(owner: str, name: str, leaves: list[Tensor], spec: Any) -> None:
    """Every leaf can be written in place, element by element, each element once; checked
    before the first write, so that a leaf torch would refuse halfway through a step (after
    others were written) is refused up front. Eager tensors only (metadata, no values).

    Refused: an inference tensor outside inference mode (torch refuses the write, and only
    after an earlier leaf was written), and memory where two elements share an address (an
    `expand`-ed tensor, an overlapping `as_strided` view: an element would be stepped
    once per alias). Not detectable from torch, so not refused: memory mapped read-only."""
    for i, t in enumerate(leaves):
        problem = _unwritable(t) if isinstance(t, Tensor) else None
        if problem is not None:
            raise ValueError(f"{owner}: `{tree.leaf_path(spec, i, name)}` {problem}")


def _unwritable(t: Tensor) -> str | None:
    """Why `t` cannot be written in place (None if it can)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "is an inference tensor (made under torch.inference_mode()), which cannot be "
            "written in place outside that mode: pass a tensor made outside it (.clone() "
            "there), or inplace=False"
        )
    if not t.is_contiguous() and self_overlapping(t):
        return (
            "has elements that share memory (an expanded tensor or an overlapping "
            "as_strided view), which a write in place would step once per alias: pass "
            ".contiguous(), or inplace=False"
        )
    return None


def self_overlapping(t: Tensor) -> bool:
    r"""Whether two elements of `t` have the same address (from shape, strides only).

    Dimensions sorted by stride are disjoint when each stride exceeds the extent of the
    smaller ones, $s_i > \sum_{j < i} (n_j - 1) s_j$ (every dense or sliced layout);
    otherwise the elements' offsets are counted exactly (one pass over an index, rare)."""
    if t.numel() == 0:
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    extent = sum((size - 1) * stride for stride, size in dims)
    offsets = torch.arange(extent + 1).as_strided(t.shape, t.stride())
    return offsets.unique().numel() < t.numel()


def first_overlap(leaves: list[Tensor], counts: Any) -> tuple[int, int] | None:
    """The first pair `(j, k)`, `j < k` in the order of `leaves`, of tensors that share
    memory and for which `counts(j, k)` holds; None if there is none.

    One sort of the tensors' byte spans finds the candidates (normally none: distinct
    allocations, or the disjoint rows of one); a candidate whose spans interleave without
    sharing an element (`w[0::2]` and `w[1::2]`) is cleared by an exact element test."""
    spans = [(*span, k) for k, span in enumerate(map(byte_span, leaves)) if span is not None]
    spans.sort()
    # The common case in one linear scan: no span starts before the previous ones end.
    reach = 0
    for start, end, _ in spans:
        if start < reach:
            break
        reach = max(reach, end)
    else:
        return None
    found = []
    active: list[tuple] = []
    for span in spans:
        active = [a for a in active if a[1] > span[0]]
        for a in active:
            j, k = sorted((a[2], span[2]))
            if counts(j, k) and _share_elements(leaves[j], leaves[k]):
                found.append((k, j))
        active.append(span)
    if not found:
        return None
    k, j = min(found)
    return j, k


def _share_elements(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors whose spans overlap touch a common byte (a marker over the span)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True  # spans overlap across storages: only the allocator's view, be safe
    base = min(a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size())
    size = a.untyped_storage().nbytes() - base
    marker = torch.zeros(size, dtype=torch.uint8, device=a.device)

    def view(t: Tensor) -> Tensor:
        item = t.element_size()
        return torch.as_strided(
            marker,
            (*t.shape, item),
            (*(s * item for s in t.stride()), 1),
            t.storage_offset() * item - base,
        )

    view(a).fill_(1)
    return bool(view(b).any())


def byte_span(t: Tensor) -> tuple | None:
    """`(first byte, end byte)` of the memory `t` may touch (None if none): a
    conservative extent, exact for the dense tensors that states and params are. Device
    memory and host memory have distinct addresses (one virtual address space per process);
    meta tensors have none."""
    nbytes = t.nbytes
    if nbytes == 0 or t.is_meta:
        return None
    start = t.data_ptr()
    if t.is_contiguous():
        return (start, start + nbytes)
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return (start, start + (extent + 1) * t.element_size())


def check_no_aliasing(state: AndersonState, p_leaves: list[Tensor], spec: Any, owner: str) -> None:
    """No two tensors of the state (window slots, anchor, Grams, counters, the inner state's
    buffers) and no state tensor and params leaf overlap in memory: a write into one would
    change the other behind the window's Grams (a checkpoint loaded with shared storages,
    or a state built by hand). One sort of the tensors' byte spans."""
    named: list[tuple[str, Any]] = [("params", tree.unflatten(spec, p_leaves))]
    for field in AndersonState._fields:
        named.append((f"state.{field}", getattr(state, field)))
    leaves, owners = [], []
    for k, (_, value) in enumerate(named):
        for i, leaf in enumerate(optree.tree_leaves(value, none_is_leaf=False)):
            if isinstance(leaf, Tensor):
                leaves.append(_physical(leaf))
                owners.append((k, i))
    num_params = len(p_leaves)  # the params come first; two params leaves may share memory
    pair = first_overlap(leaves, lambda j, k: k >= num_params)
    if pair is not None:
        first, second = (_leaf_name(named, *owners[i]) for i in pair)
        raise ValueError(
            f"{owner}: `{second}` shares memory with `{first}`; every tensor of the state "
            "must own its memory (was the state built from shared tensors, or the params "
            "from the state's?)"
        )


def check_state_memory(state: AndersonState, owner: str) -> None:
    """Every tensor of the state is dense and can be written in place (`check_dense()`,
    `check_writable()`), in both modes: `update(..., inplace=True)` writes the ring's
    slots, the anchor, the Grams, the counters and the inner state's buffers, and a state
    checked once is trusted by every later call, whichever its `inplace`.

    The common case (every tensor dense, writable, contiguous) is answered by C-level maps
    over the state's leaves, in a constant number of Python steps; only a state that fails
    it is walked leaf by leaf, for the name of the first offending leaf."""
    leaves = optree.tree_leaves(state, none_is_leaf=False)
    fine = (
        all(map(isinstance, leaves, itertools.repeat(Tensor)))
        and all_strided(leaves)
        and not any(map(Tensor.is_inference, leaves))
        and all(map(Tensor.is_contiguous, leaves))
    )
    if fine:
        return
    for field in AndersonState._fields:
        leaves, spec = optree.tree_flatten(getattr(state, field), none_is_leaf=False)
        check_dense(owner, f"state.{field}", leaves, spec)
        check_writable(owner, f"state.{field}", leaves, spec)


_LAYOUT = operator.attrgetter("layout")


def _physical(t: Tensor) -> Tensor:
    """The tensor whose memory `t` is: itself, or under `torch.func` transforms the tensor
    they wrap (a batched or grad-tracking tensor has no storage of its own; a `vmap` batch
    of params is one physical tensor holding every member)."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def _leaf_name(named: list, k: int, i: int) -> str:
    name, value = named[k]
    leaves, value_spec = optree.tree_flatten(value, none_is_leaf=False)
    return tree.leaf_path(value_spec, i, name)

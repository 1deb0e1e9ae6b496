"""Pytree helpers shared by the solver, the window and the transformation.

Parameters are arbitrary pytrees of tensors (dicts, tuples, lists, NamedTuples). We flatten
with optree, whose default node registry agrees with `torch.utils._pytree` for the
containers users pass, so states built here also flatten under `torch.func`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import optree
import torch
from torch import Tensor
from torch._C import _functorch

__all__ = [
    "flatten",
    "unflatten",
    "check_like",
    "same_structure",
    "leaf_path",
    "structure_difference",
    "is_transformed",
    "readable",
    "any_transformed",
    "tracing",
    "static_value",
    "shared",
    "uniform_value",
    "decision",
    "flat_view",
]

_KEYED = (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT, optree.PyTreeKind.DEFAULTDICT)
_FIELDS = (optree.PyTreeKind.NAMEDTUPLE, optree.PyTreeKind.STRUCTSEQUENCE)


# The spec of a tree that is one tensor: every such tree has this one (specs compare equal).
_LEAF = optree.tree_structure(torch.empty(0), none_is_leaf=False)


def _prefix(owner: str | None) -> str:
    return f"{owner}: " if owner else ""


def flatten(tree: Any, name: str = "params", owner: str | None = None) -> tuple[list[Tensor], Any]:
    """Flattens `tree` into its tensor leaves and a tree spec, rejecting non-tensor leaves.

    `None` is not a leaf (optree's default), so `{"b": None}` has no leaves; a `tree` that
    is `None` itself is rejected, since every caller needs a tree. `owner` (e.g.
    `"anderson.update"`) prefixes the error messages, which name the offending leaf by its
    key path (`params['bn.num_batches_tracked']`).
    """
    if isinstance(tree, Tensor) and not _is_compiling():
        # A bare tensor (one-leaf params, a window slot of them). Not when traced: dynamo
        # traces optree's flatten into a spec of its own, which this one would not match.
        return [tree], _LEAF
    if tree is None:
        raise TypeError(f"{_prefix(owner)}`{name}` is None; a pytree of tensors is required")
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=False)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"{_prefix(owner)}`{name}` must be a pytree of tensors; "
                f"`{leaf_path(spec, i, name)}` is {type(leaf).__name__}{_hint(leaf)}"
            )
    return leaves, spec


def _hint(leaf: Any) -> str:
    """What the user probably meant, for the leaves people pass by mistake."""
    if isinstance(leaf, torch.nn.Module):
        return "; pass its parameters as a dict: dict(model.named_parameters())"
    if isinstance(leaf, Iterator):  # model.parameters() is a generator: it would be used up
        return "; pass dict(model.named_parameters()) (or a list) instead of an iterator"
    return ""


def unflatten(spec: Any, leaves: list[Tensor]) -> Any:
    return optree.tree_unflatten(spec, leaves)


def leaf_path(spec: Any, index: int, name: str) -> str:
    """The key path of leaf `index` of `spec` as code: `params['w']`, `state.anchor[0]`.

    Only error messages call this: building the accessors costs a pass over the spec.
    """
    return spec.accessors()[index].codify(name)


def _kind(spec: Any) -> Any:
    """The node's `optree.PyTreeKind`. Under `torch.compile`, dynamo stands in a Python analog
    for optree's spec that has no `kind`: it is read from the node type's registration."""
    kind = getattr(spec, "kind", None)
    if kind is not None:
        return kind
    if spec.is_leaf():
        return optree.PyTreeKind.LEAF
    handler = optree.register_pytree_node.get(spec.type, namespace=getattr(spec, "namespace", ""))
    return optree.PyTreeKind.CUSTOM if handler is None else handler.kind


def _describe_node(spec: Any) -> str:
    if spec.is_leaf():
        return "a tensor"
    kind = _kind(spec)
    if kind == optree.PyTreeKind.NONE:
        return "None"
    name = spec.type.__name__
    if kind in _KEYED:
        return f"a {name} with keys {list(spec.entries())}"
    if kind in _FIELDS:
        return f"a {name}"
    return f"a {name} of {spec.num_children}"


def _entry_path(spec: Any, position: int) -> str:
    entry = spec.entries()[position]
    if _kind(spec) in _FIELDS:
        return f".{spec.type._fields[position]}"
    return f"[{entry!r}]"


def structure_difference(spec: Any, ref_spec: Any, name: str, ref_name: str) -> str:
    """Where two pytree structures first differ, in words with key paths (no spec dumps).

    E.g. `grads['b'] is None where params['b'] is a tensor` or `grads is a tuple of 2 where
    params is a dict with keys ['b', 'w']`.
    """

    def walk(node: Any, ref: Any, path: str) -> str | None:
        same_node = (
            node.is_leaf() == ref.is_leaf()
            and _kind(node) == _kind(ref)
            and (node.is_leaf() or node.type == ref.type)
            and node.num_children == ref.num_children
            and list(node.entries()) == list(ref.entries())
        )
        if not same_node:
            return (
                f"`{name}{path}` is {_describe_node(node)} where `{ref_name}{path}` is "
                f"{_describe_node(ref)}"
            )
        for i, (child, ref_child) in enumerate(zip(node.children(), ref.children())):
            found = walk(child, ref_child, path + _entry_path(node, i))
            if found is not None:
                return found
        return None

    found = walk(spec, ref_spec, "")
    # Specs can differ in what the walk does not compare (e.g. a custom node's metadata).
    return found if found is not None else f"`{name}` and `{ref_name}` differ in node metadata"


def same_structure(spec: Any, ref_spec: Any) -> bool:
    """`spec == ref_spec`, also where `torch.compile` cannot trace that comparison.

    Under tracing, dynamo stands in a Python analog for optree's tree spec, whose `==` (a
    dataclass's, comparing the nodes' unflatten functions) dynamo before torch 2.13 cannot
    trace. There, and only there, the nodes are compared one by one instead: type, children,
    entries (a dict's keys), which is what distinguishes the containers users pass.
    """
    if _SPEC_EQ_TRACEABLE or not tracing():
        return spec == ref_spec
    return _same_nodes(spec, ref_spec)


_SPEC_EQ_TRACEABLE = torch.__version__ >= (2, 13)


def _same_nodes(node: Any, ref: Any) -> bool:
    if node.is_leaf() or ref.is_leaf():
        return node.is_leaf() and ref.is_leaf()
    if node.type is not ref.type or node.num_children != ref.num_children:
        return False
    if list(node.entries()) != list(ref.entries()):
        return False
    return all(_same_nodes(a, b) for a, b in zip(node.children(), ref.children()))


def check_like(
    name: str,
    leaves: list[Tensor],
    spec: Any,
    ref_leaves: list[Tensor],
    ref_spec: Any,
    ref_name: str = "params",
    check_dtype: bool = False,
    owner: str | None = None,
) -> None:
    """Raises if `leaves`/`spec` do not match the reference structure and shapes.

    Messages name the first offending leaf by its key path in both trees, e.g.
    `grads['w'] has shape (2, 3), expected (3, 2) like params['w']`.
    """
    if not same_structure(spec, ref_spec):
        raise ValueError(
            f"{_prefix(owner)}`{name}` has a different pytree structure from `{ref_name}`: "
            + structure_difference(spec, ref_spec, name, ref_name)
        )
    for i, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
        if leaf.shape != ref.shape or (check_dtype and leaf.dtype != ref.dtype):
            what, got, expected, kind = (
                ("shape", tuple(leaf.shape), tuple(ref.shape), ValueError)
                if leaf.shape != ref.shape
                else ("dtype", leaf.dtype, ref.dtype, TypeError)
            )
            raise kind(
                f"{_prefix(owner)}`{leaf_path(spec, i, name)}` has {what} {got}, expected "
                f"{expected} like `{leaf_path(ref_spec, i, ref_name)}`"
            )


def tracing() -> bool:
    """True while `torch.compile` (dynamo) traces the code: tensors have no values then."""
    return _is_compiling()


_is_compiling = torch.compiler.is_compiling


def is_transformed(t: Tensor) -> bool:
    """True when `t` has no concrete value to branch on: wrapped by a torch.func transform
    (vmap, grad, ...), or traced by `torch.compile`.

    Under tracing every tensor counts as transformed, so the traced code takes the vmap path:
    decisions are masks (`torch.where`), never Python branches on values. The functorch
    query is not asked then: dynamo cannot trace that builtin (it would break the graph).
    """
    if _is_compiling():
        return True
    return _functorch.is_functorch_wrapped_tensor(t)


def readable(*tensors: Tensor) -> bool:
    """Whether Python may read the values of every tensor now (`.item()`, `.tolist()`) at
    no more than a copy: plain CPU tensors, not under a transform or tracing (on an
    accelerator a read would synchronise)."""
    for t in tensors:  # a loop, not all(genexpr): this is asked on the eager hot path
        if not t.is_cpu or is_transformed(t):
            return False
    return True


def any_transformed(tensors: Iterable[Tensor | None]) -> bool:
    """`is_transformed()` for any of `tensors` (`None` entries ignored), with one
    Python call for the lot: the window's passes ask it per leaf on every step."""
    if _is_compiling():
        return True
    wrapped = _functorch.is_functorch_wrapped_tensor
    return any(wrapped(t) for t in tensors if t is not None)


def static_value(t: Tensor) -> bool | int | None:
    """The Python value of a 0-d CPU tensor when it is concrete, else `None`.

    `update` expresses every decision as a tensor so that it runs under `vmap`; when a gate
    is a plain CPU tensor (eager mode, counters live on the CPU) reading it costs nothing and
    lets us skip work whose result would be discarded by `torch.where`. Under a transform we
    return `None` and the caller blends both outcomes instead.
    """
    # is_transformed, inlined: this runs a couple of dozen times per eager call (`ndim` and
    # `is_cpu` rather than `dim()` and `device.type`, which builds a device object).
    if _is_compiling() or _functorch.is_functorch_wrapped_tensor(t):
        return None
    if t.ndim or not t.is_cpu:
        return None
    return t.item()


def shared(t: Tensor) -> Tensor:
    """`t` as a plain tensor when `vmap` batches it but every member holds one element.

    A vmapped function's unbatched result comes back from `vmap` broadcast along the batch
    dimension (stride 0), so a counter that every member of an ensemble advances together
    (`count`, `head`) arrives at the next vmapped call as a batched tensor over a single
    element. The stride says so without reading any value; that element, taken as a plain
    tensor, is then a value `static_value()` may read, and the window is written at one
    slot index for all members (O(n) per member instead of blending every slot). Anything
    else, and anything under `torch.compile`, is returned unchanged.
    """
    if tracing() or not _functorch.is_batchedtensor(t):
        return t
    bdim = _functorch.maybe_get_bdim(t)
    physical = _functorch.get_unwrapped(t)
    if bdim is None or _functorch.is_functorch_wrapped_tensor(physical):
        return t  # batched at several levels (nested transforms): leave it to the masks
    if physical.shape[bdim] > 1 and physical.stride(bdim) != 0:
        return t
    return physical.select(bdim, 0)


def uniform_value(flag: Tensor) -> bool | None:
    """The value every member holds when `vmap` batches a 0-d bool `flag` and all of its
    members agree, else `None`.

    An ensemble whose members decide alike (all mix, or none) then takes that one branch, as
    each member's own step would, instead of computing both and blending them element by
    element. Read from the physical CPU tensor of a single vmap level (eager only: under
    `torch.compile`, nested transforms or on an accelerator it returns `None`).
    """
    if _is_compiling() or not _functorch.is_batchedtensor(flag):
        return None
    physical = _functorch.get_unwrapped(flag)
    if (
        _functorch.is_functorch_wrapped_tensor(physical)
        or physical.dtype != torch.bool
        or physical.device.type != "cpu"
        or physical.numel() == 0
    ):
        return None
    if physical.all().item():
        return True
    if not physical.any().item():
        return False
    return None


def decision(flag: Tensor, device: torch.device) -> Tensor:
    """A 0-d bool decision (a finiteness check, the safeguard's verdict) made ready to combine
    with the step's counters and gates.

    Eager: moved to the CPU, where the counters live, so that `static_value()` can read
    it and skip work (for a flag computed on an accelerator this copy waits for the device).
    Under `torch.compile`: moved to `device` (the compute device, where the traced step
    keeps its counters) and never read, so the traced graph has no device-to-host copy.
    """
    if tracing():
        return flag.to(device)
    return flag.cpu()


def flat_view(t: Tensor) -> Tensor:
    """A 1-d view of a dense tensor, in storage order; a reshaped copy for non-dense ones.

    Tensors created with `*_like(..., memory_format=torch.preserve_format)` from the same
    dense tensor share its strides, so their flat views line up element by element, which lets
    us stream window slots in chunks without copying them (`channels_last` included).
    """
    if t.is_contiguous():
        return t.reshape(-1)  # a view (of a batched or traced tensor too)
    if is_transformed(t):
        return t.reshape(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.shape[d]), reverse=True)
    permuted = t.permute(order)
    if permuted.is_contiguous():
        return permuted.view(-1)
    return t.reshape(-1)


def as_layout(t: Tensor, like: Tensor) -> Tensor:
    """`t` with the strides of `like` (a copy only when they differ), so flat views align."""
    if is_transformed(t) or is_transformed(like) or t.stride() == like.stride():
        return t
    return torch.empty_like(like, dtype=t.dtype, device=t.device).copy_(t)

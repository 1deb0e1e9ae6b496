"""Validation of `update`'s arguments against each other and against the state.

Everything here reads metadata only (types, pytree structure, shapes, dtypes, devices), never
values, so the checks run before any buffer is written and also under `torch.func.vmap`.
Messages name the offending leaf by its key path (`params['bn.num_batches_tracked']`,
`state.residuals[0]['w']`); the paths are built only when an error is raised.

The module also holds the autograd policy of `init`/`update` (`autograd_policy()`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import weakref
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.core.scalars import COMPLEX_HISTORY, wide
from aadl_func._src.state import COUNTERS, AndersonState
from aadl_func._src.validation import (
    check_bool,
    check_callable,
    check_leaf_devices,
    check_leaf_dtypes,
    same_device,
)

if TYPE_CHECKING:
    from aadl_func._src.options import AndersonOptions as Config

__all__ = [
    "MISSING",
    "OUTERMOST",
    "as_a_transformation",
    "autograd_policy",
    "check_call",
    "check_state",
    "check_state_values",
    "mark_verified",
    "checked_layout",
    "remember_layout",
    "check_update_inputs",
    "differentiating",
    "keep_requires_grad",
]

Params = Any

OWNER = "anderson.update"
HINT = "was it made by another configuration?"


# -- autograd ---------------------------------------------------------------------------------
def differentiating() -> bool:
    """Whether a torch.func transform that differentiates (`grad`, `vjp`, `jacrev`,
    `jvp`, `jacfwd`, `hessian`) is active around the caller.

    Always False while `torch.compile` traces (it cannot trace the query): a compiled
    `update` runs without grad, and differentiating through one is not supported."""
    if tree.tracing():
        return False
    if _functorch.maybe_current_level() is None:  # no transform at all: the common case
        return False
    stack = _functorch.get_interpreter_stack() or ()
    return any(
        interpreter.key() in (_functorch.TransformType.Grad, _functorch.TransformType.Jvp)
        for interpreter in stack
    )


def autograd_policy() -> contextlib.AbstractContextManager:
    """The grad mode `init` and `update` run in.

    Outside torch.func's differentiating transforms they run under `torch.no_grad()`: the
    window, the mix and the safeguard record no autograd graph, whatever the inputs'
    `requires_grad` or history (`dict(model.named_parameters())`, grads from
    `torch.autograd.grad(create_graph=True)`), and an in-place step may write into leaves
    that require grad, as `torch.optim` does. Under `torch.func.grad`/`vjp`/`jvp`
    (and `jacrev`, ...) nothing is disabled: a user differentiating *through* a pure
    `update` does so on purpose, and `torch.no_grad` inside `grad` would silently cut the
    gradient to zero.
    """
    return contextlib.nullcontext() if differentiating() else torch.no_grad()


def keep_requires_grad(out: Params, params: Params, inplace: bool) -> Params:
    """`out` with the `requires_grad` flags of `params`, leaf for leaf.

    `update` runs without grad, so its new tensors (`inplace=False`) do not require grad;
    a leaf of `params` that did gets its counterpart flagged as a new leaf that requires
    grad, ready for the next `backward`. In place the returned leaves are the params
    themselves, and under torch.func transforms the flags belong to the transform.
    """
    if inplace:
        return out
    p_leaves = tree.flatten(params, "params")[0]
    if not any(p.requires_grad for p in p_leaves):
        return out
    for o, p in zip(tree.flatten(out, "params")[0], p_leaves):
        if p.requires_grad and not o.requires_grad and not tree.is_transformed(o):
            o.requires_grad_(True)
    return out


# -- update's arguments -----------------------------------------------------------------------
def check_update_inputs(
    config: Config,
    state: AndersonState,
    params: Params,
    grads: Params,
    loss_fn: Any,
    inplace: Any = False,
) -> tuple[list[Tensor], Any, Params]:
    """Validates every argument of `update` before anything is computed or written.

    With `inplace=True` the inner optimizer and the window overwrite buffers as soon as the
    step starts, so a mismatch found later would leave a half-updated state behind: every
    check that can be made from metadata alone (types, structure, shapes, dtypes, devices) is
    made here. Values are never inspected (no `.item()`), so the checks also run under vmap.

    Returns:
      `(params leaves, params spec, grads)`: `grads` cast to the params' dtypes where they
      differ (float32 grads for float64 params, as `torch.optim`'s arithmetic promotes them).
    """
    if grads is MISSING:  # update(state, params) or update(grads, state): see check_call
        check_call(state, params, grads, {})
    if not isinstance(state, AndersonState):
        if isinstance(params, AndersonState):  # update(updates, state, params): optax's order
            raise TypeError(as_a_transformation("state"))
        raise TypeError(f"{OWNER}: `state` must be an AndersonState, got {type(state).__name__}")
    check_bool(OWNER, "inplace", inplace)
    if loss_fn is not None:
        check_callable(OWNER, "loss_fn", loss_fn)
    p_leaves, spec = tree.flatten(params, "params", owner=OWNER)
    check_floating(OWNER, p_leaves, spec, config)
    g_leaves, g_spec = tree.flatten(grads, "grads", owner=OWNER)
    tree.check_like("grads", g_leaves, g_spec, p_leaves, spec, owner=OWNER)
    # (Traced, the leaves are dense stand-ins, and dynamo cannot trace the C-level maps.)
    if not (tree.tracing() or (all_strided(p_leaves) and all_strided(g_leaves))):
        check_dense(OWNER, "params", p_leaves, spec)  # names the leaf
        check_dense(OWNER, "grads", g_leaves, g_spec)
    cast = False
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        if g.dtype != p.dtype:
            # Real grads are cast to any params dtype; complex ones only to a complex one.
            if not (g.is_floating_point() or (g.is_complex() and p.is_complex())):
                raise TypeError(
                    f"{OWNER}: `{tree.leaf_path(g_spec, i, 'grads')}` has dtype {g.dtype}; "
                    f"gradients must be floating, or complex for complex params (they are "
                    f"cast to the params' dtype, here {p.dtype})"
                )
            cast = True
        if not same_device(g.device, p.device):
            raise ValueError(
                f"{OWNER}: `{tree.leaf_path(g_spec, i, 'grads')}` is on device {g.device}, "
                f"expected {p.device} like `{tree.leaf_path(spec, i, 'params')}`"
            )
    if inplace and differentiating():
        # The in-place step writes into the params being differentiated: autograd refuses it
        # halfway through, after the inner optimizer has overwritten its buffers.
        raise ValueError(
            f"{OWNER}: `inplace=True` cannot be differentiated through (a torch.func "
            "grad/vjp/jvp transform is active); pass inplace=False"
        )
    if inplace:
        check_in_place(p_leaves, spec, g_leaves, g_spec)
    layout = (config, spec, [(p.shape, p.dtype, p.device) for p in p_leaves])
    if not checked_layout(state, layout):
        check_state(config, state, p_leaves, spec)
        remember_layout(state, layout)
    if cast:
        grads = tree.unflatten(g_spec, [g.to(p.dtype) for g, p in zip(g_leaves, p_leaves)])
    return p_leaves, spec, grads


# -- the call itself --------------------------------------------------------------------------
class _Missing:
    def __repr__(self) -> str:
        return "<required>"


#: `update`'s `grads` when not given (a call made as to a gradient transformation).
MISSING: Any = _Missing()

#: Where `anderson` goes in a composition, for the calls made as to a gradient transformation.
OUTERMOST = (
    "anderson must be the outermost transformation: call update(state, params, grads); to "
    "clip or decay, put aa.chain(...) as anderson's inner optimizer"
)


def as_a_transformation(argument: str) -> str:
    """The message for a call made as to a gradient transformation, by what gave it away:
    `params` passed by keyword too (torchopt's chain), or `state` passed second (optax's
    chain, `update(grads, state)`)."""
    how = {
        "params": "`params` passed by keyword too, as in update(updates, state, params=...)",
        "state": "`state` passed second, as in update(updates, state, params)",
    }[argument]
    return f"{OWNER}: called as a gradient transformation ({how}). {OUTERMOST}"


def check_call(state: Any, params: Any, grads: Any, misplaced: dict[str, Any]) -> Any:
    """`update`'s `grads` for a call that named it (`update(state, params, grads=g)`);
    the call made as to a gradient transformation raises a `TypeError` that says where
    `anderson` goes instead (`OUTERMOST`).

    Those calls are torchopt's and optax's chains, `update(updates, state, params=params,
    inplace=...)`, and the gradient-transformation order `update(grads, state)`. Only calls
    that passed `grads` by keyword or not at all come here: the common call pays nothing.
    """
    if grads is MISSING and set(misplaced) == {"grads"}:
        return misplaced["grads"]
    if "params" in misplaced:
        raise TypeError(as_a_transformation("params"))
    if isinstance(params, AndersonState):
        raise TypeError(as_a_transformation("state"))
    if misplaced:
        names = ", ".join(f"`{name}`" for name in misplaced)
        raise TypeError(
            f"{OWNER}: unexpected keyword argument {names}; the call is update(state, params, "
            "grads, *, inplace=False, loss_fn=None, loss=None)"
        )
    raise TypeError(f"{OWNER}: `grads` is missing; the call is update(state, params, grads)")


def check_in_place(p_leaves: list[Tensor], spec: Any, g_leaves: list[Tensor], g_spec: Any) -> None:
    """In place, every params leaf can be written (`check_writable()`), no params leaf
    overlaps another (the same tensor twice, overlapping views) and no grads leaf overlaps a
    params leaf: the step writes every params leaf once, so an overlap would be stepped
    twice, and grads read after the params were written would have changed. Out of place
    nothing is written, and each leaf is stepped on its own.

    Metadata only (addresses and extents); skipped under vmap / torch.compile, whose
    tensors have no addresses."""
    leaves = [*p_leaves, *g_leaves]
    if tree.any_transformed(leaves):
        return
    if not all(map(Tensor.is_contiguous, p_leaves)) or any(map(Tensor.is_inference, p_leaves)):
        check_writable(OWNER, "params", p_leaves, spec)  # C-level maps first: the common case
    if len(leaves) == 2:  # one leaf: its grads against it, without the sort
        p, g = _span(leaves[0]), _span(leaves[1])
        if p is None or g is None or g[1] <= p[0] or p[1] <= g[0]:
            return
    num_params = len(p_leaves)
    pair = _first_overlap(leaves, lambda j, k: j < num_params)
    if pair is not None:
        first, second = pair
        raise ValueError(
            f"{OWNER}: `{_input_path(second, num_params, spec, g_spec)}` shares memory with "
            f"`{_input_path(first, num_params, spec, g_spec)}`; with inplace=True every "
            "params leaf is written once, so params must not overlap one another (the "
            "same tensor twice, overlapping views) and grads must not overlap params: "
            "pass distinct tensors, or inplace=False"
        )


# -- the leaves' memory -----------------------------------------------------------------------
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


def _input_path(k: int, num_params: int, spec: Any, g_spec: Any) -> str:
    if k < num_params:
        return tree.leaf_path(spec, k, "params")
    return tree.leaf_path(g_spec, k - num_params, "grads")


def check_floating(owner: str, leaves: list[Tensor], spec: Any, config: Config) -> None:
    """Every params leaf is a real floating tensor, or every one is complex in a mode that
    accepts complex params (mode "classic": `aadl_func._src.modes.Mode.complex_params`)
    with a `history_dtype` that has a complex counterpart."""
    complex_leaves = 0
    for i, p in enumerate(leaves):
        if not p.is_floating_point():  # the real case passes with this one test per leaf
            if not p.is_complex():
                raise TypeError(
                    f"{owner}: `{tree.leaf_path(spec, i, 'params')}` must be floating, got "
                    f"{p.dtype}; pass trainable parameters only (not buffers such as "
                    "BatchNorm's num_batches_tracked)"
                )
            complex_leaves += 1
    if complex_leaves:
        _check_complex(owner, leaves, spec, config, complex_leaves)


def _check_complex(
    owner: str, leaves: list[Tensor], spec: Any, config: Config, complex_leaves: int
) -> None:
    """Complex params: a mode with complex windows, all leaves complex, a history dtype with a
    complex counterpart."""
    first = next(i for i, p in enumerate(leaves) if p.is_complex())
    name = tree.leaf_path(spec, first, "params")
    if not config.rules.complex_params:
        raise TypeError(
            f"{owner}: `{name}` is {leaves[first].dtype}; complex params are supported in "
            f"mode='classic' only (type-II Anderson acceleration with a Hermitian least-squares "
            f"problem, as scipy.optimize.anderson), not in mode={config.mode!r}, whose "
            "extrapolation of optimizer steps is implemented for real params only: pass "
            "mode='classic'"
        )
    if complex_leaves != len(leaves):
        real = next(i for i, p in enumerate(leaves) if not p.is_complex())
        raise TypeError(
            f"{owner}: `{name}` is complex but `{tree.leaf_path(spec, real, 'params')}` is "
            f"{leaves[real].dtype}; params must be all real or all complex (one window over "
            "complex numbers would give a real leaf complex values): make the real leaves "
            "complex, or step them with another optimizer"
        )
    dtype = config.history_dtype
    if dtype is not None and dtype not in COMPLEX_HISTORY:
        raise TypeError(
            f"{owner}: `history_dtype` is {dtype}, which has no complex counterpart for the "
            f"complex `{name}` (a complex leaf's window holds complex numbers with parts of "
            "history_dtype): pass torch.float32 (a complex64 window), torch.float64 "
            "(complex128) or None"
        )


def check_state(config: Config, state: AndersonState, p_leaves: list[Tensor], spec: Any) -> None:
    """The state's layout matches this optimizer's options and `params`.

    Catches states made by another configuration (e.g. a checkpoint saved with a different
    `history_depth`, `mode`, `history_dtype` or inner optimizer) or for other params
    (structure, shape, dtype, device), which would otherwise mix garbage or fail halfway
    through a step.
    """
    for name in COUNTERS:
        value = getattr(state, name)
        if not (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.int64):
            raise TypeError(
                f"{OWNER}: `state.{name}` must be a 0-d int64 tensor, got {_describe(value)}"
            )
    pending = state.pending_loss
    if not (isinstance(pending, Tensor) and pending.dim() == 0 and pending.dtype == torch.float64):
        raise TypeError(
            f"{OWNER}: `state.pending_loss` must be a 0-d float64 tensor, got {_describe(pending)}"
        )
    q = config.num_slots
    if not isinstance(state.residuals, tuple) or len(state.residuals) != q:
        held = len(state.residuals) if isinstance(state.residuals, (tuple, list)) else "no"
        raise ValueError(
            f"{OWNER}: `state` holds {held} window slots, this optimizer expects {q} "
            f"(history_depth={config.history_depth}, mode={config.mode!r}); {HINT}"
        )
    history_devices = [config.history_device_of(p) for p in p_leaves]
    history_dtypes = [config.history_dtype_of(p) for p in p_leaves]
    where = "the history device for `params`; was the state made on another device?"
    what = "the history_dtype for `params`; was the state made with other options or params?"

    def check_window(name: str, window: Any) -> None:
        leaves, window_spec = tree.flatten(window, name, owner=OWNER)
        tree.check_like("params", p_leaves, spec, leaves, window_spec, ref_name=name, owner=OWNER)
        check_leaf_dtypes(OWNER, name, leaves, history_dtypes, what, spec=window_spec)
        check_leaf_devices(OWNER, name, leaves, history_devices, where, spec=window_spec)

    empty_anchor = isinstance(state.anchor, tuple) and len(state.anchor) == 0
    # Both modes keep the newest point as an anchor; mode "classic" also keeps a ring of the
    # differences of its points (`iterates`), mode "aadl" none.
    iterates = state.iterates if isinstance(state.iterates, tuple) else None
    if not config.rules.keeps_iterates and (iterates is None or len(iterates) != 0 or empty_anchor):
        raise ValueError(
            f"{OWNER}: `state` has no anchor or holds iterate differences, so it was made "
            f"in mode 'classic', not {config.mode!r}"
        )
    if config.rules.keeps_iterates and (iterates is None or len(iterates) != q or empty_anchor):
        raise ValueError(
            f"{OWNER}: `state` has no anchor or lacks {q} iterate differences, so it was "
            f"made in mode 'aadl', with another history_depth or by an earlier version, "
            f"not for mode {config.mode!r}"
        )
    # The anchor keeps the params' own dtype: a params dtype change is reported as such.
    a_leaves, a_spec = tree.flatten(state.anchor, "state.anchor", owner=OWNER)
    tree.check_like(
        "params", p_leaves, spec, a_leaves, a_spec, ref_name="state.anchor", owner=OWNER
    )
    check_leaf_dtypes(
        OWNER,
        "params",
        p_leaves,
        [a.dtype for a in a_leaves],
        "the dtype of the params the state was made for",
        spec=spec,
    )
    check_window("state.residuals[0]", state.residuals[0])
    if config.rules.keeps_iterates:
        check_window("state.iterates[0]", state.iterates[0])
    check_leaf_devices(OWNER, "state.anchor", a_leaves, history_devices, where, spec=a_spec)
    compute_device = config.compute_device_of(p_leaves)
    # complex128 (Hermitian) for a complex window, all of whose leaves are complex (checked
    # above by check_floating): the first leaf decides.
    grams = wide(history_dtypes[0])
    for name, shape in (("gram", (q, q)), ("dr_gram", (q, q)), ("dr_rhs", (q,))):
        value = getattr(state, name)
        if not (
            isinstance(value, Tensor)
            and tuple(value.shape) == shape
            and value.dtype == grams
            and same_device(value.device, compute_device)
        ):
            dtype = str(grams).removeprefix("torch.")
            raise ValueError(
                f"{OWNER}: `state.{name}` must be a {shape} {dtype} tensor on {compute_device}, "
                f"got {_describe(value, device=True)}; {HINT}"
            )
    # The inner optimizer knows its state's layout: the built-in ones (InnerOptimizer) and any
    # custom one that offers the same `check_state` validate it here, before any write.
    check_inner = getattr(config.inner, "check_state", None)
    if callable(check_inner):
        check_inner(state.inner_state, p_leaves, spec, name="state.inner_state", owner=OWNER)
    if not verified(state):
        # A state from outside: the other slots (every slot is made like slot 0, so the
        # states update returns need no per-call look at them), then the values.
        check_ring("state.residuals", state.residuals, check_window)
        if config.rules.keeps_iterates:
            check_ring("state.iterates", state.iterates, check_window)
        check_state_values(config, state, p_leaves, spec)


# -- the state's values -----------------------------------------------------------------------
# A state is *verified* once its values have been checked (or `update` made it): the value
# checks then cost one dictionary look-up and an identity test per field. An entry is keyed
# by the id of the state's `count` tensor and holds a weak reference to it plus the state's
# other fields themselves: while the entry exists those fields are alive, so no other object
# can have their identity (a check by `id()` alone would take a field rebuilt after the old
# one was freed for the old one). The entry goes when `count` dies, normally with the
# state, so it keeps nothing alive that the state does not (and at most `_KEEP` entries
# are listed, if counters outlive their states). A state rebuilt with `_replace` is checked
# again; tensors written in place by the caller behind `update`'s back are not noticed.


class _Entry(weakref.ref):
    """A weak reference to a verified state's `count`, with the state's other fields (held)
    and whether its tensors are inference tensors (valid only in inference mode)."""

    __slots__ = ("key", "fields", "inference", "layout")


_VERIFIED: dict[int, _Entry] = {}
_KEEP = 64  # states listed at most (optimizers stepping in turn, each with its newest state)

#: Counters above this are refused: a float64 (the inner schedules' `count`) holds every
#: integer up to it exactly, and `count + 1` cannot overflow int64.
MAX_COUNT = 2**53


def _forget(entry: _Entry) -> None:
    """Drops `entry` once its `count` is freed (weakref callback)."""
    if _VERIFIED.get(entry.key) is entry:
        del _VERIFIED[entry.key]


def verified(state: AndersonState) -> bool:
    """Whether `state`'s values were checked already (or it was made by `update`).

    Always True where values cannot be read (vmap, torch.compile, counters on an
    accelerator): there only the metadata checks run."""
    if tree.tracing():
        return True  # compiled: no values (and no ids to guard on)
    if _verified_entry(state) is not None:
        return True  # the common case first: only concrete counters are ever listed
    return not _concrete(state.count)


def _verified_entry(state: AndersonState) -> _Entry | None:
    """The entry of a verified eager state (see `verified()`), else None."""
    count = state.count
    entry = _VERIFIED.get(id(count))
    if (
        entry is not None
        and entry() is count
        and all(map(operator.is_, entry.fields, state[1:]))
        and (not entry.inference or torch.is_inference_mode_enabled())
    ):
        return entry
    return None


def checked_layout(state: AndersonState, layout: tuple) -> bool:
    """Whether `check_state()` passed already for this verified state with these options and
    params (`layout`: the options, the params' structure and each leaf's shape, dtype and
    device), so that its metadata checks need not run again: a state is checked once, not on
    every call. Never under torch.compile, which checks at trace time."""
    if tree.tracing() or not isinstance(state, AndersonState):
        return False
    entry = _verified_entry(state)
    if entry is None or entry.layout is None:
        return False
    config, spec, leaves = entry.layout
    return config is layout[0] and spec == layout[1] and leaves == layout[2]


def remember_layout(state: AndersonState, layout: tuple | None) -> None:
    """Records that `state` (if verified) passed `check_state()` for `layout`."""
    if tree.tracing():
        return
    entry = _verified_entry(state)
    if entry is not None:
        entry.layout = layout


def _layout_of(state: AndersonState) -> tuple | None:
    """The layout `state` was checked for (`checked_layout()`), if any."""
    entry = _verified_entry(state) if not tree.tracing() else None
    return None if entry is None else entry.layout


def _concrete(counter: Any) -> bool:
    # tree.static_value's test without reading the value (no tensor operation on the hot path).
    return (
        isinstance(counter, Tensor)
        and not tree.is_transformed(counter)
        and counter.ndim == 0
        and counter.is_cpu
    )


def mark_verified(state: AndersonState, *, made_from: AndersonState | None = None) -> None:
    """Records `state` (returned by an eager `update`, or checked) as verified; `made_from`:
    the state `update` made it from, whose checked layout (`checked_layout()`) it inherits."""
    count = state.count
    if not (isinstance(count, Tensor) and count.ndim == 0 and count.is_cpu):
        return
    layout = None if made_from is None else _layout_of(made_from)
    key = id(count)
    entry = _VERIFIED.get(key)
    # A state made in inference mode holds inference tensors, which only that mode may write.
    inference = count.is_inference()
    if entry is not None and entry() is count:  # in place, the count is the same each call
        entry.fields, entry.inference = state[1:], inference
        if made_from is not None:
            entry.layout = layout
        return
    entry = _Entry(count, _forget)
    entry.key, entry.layout = key, layout
    entry.fields, entry.inference = state[1:], inference
    # Listed once complete: an exception raised before this line leaves no half-made entry.
    _VERIFIED[key] = entry
    if len(_VERIFIED) > _KEEP:  # counters kept alive after their states: drop the oldest
        del _VERIFIED[next(iter(_VERIFIED))]


def check_state_values(
    config: Config, state: AndersonState, p_leaves: list[Tensor], spec: Any, owner: str = OWNER
) -> None:
    """The state's values satisfy its invariants (a state from `torch.load`, the wrapper's
    `load_state_dict` or built by hand); run once per state, before anything is written.

    Counters: `0 <= count <= 2**53`, `head` in `[0, Q)`,
    `0 <= window_size <= min(history_depth, count)`, the outcome counters (`num_mixed`,
    `num_rejected`, `num_nonfinite`, `num_averaged`) in `[0, count]`,
    `0 <= skip_streak <= num_skipped`; no two tensors of the state (or the state and the
    params) share memory; and the inner optimizer's own value checks (the built-in ones:
    `count` equal to the state's, Adam's `exp_avg_sq >= 0`).
    """
    counters = {name: getattr(state, name) for name in COUNTERS}
    if not _concrete_counters(list(counters.values())):
        return  # counters on an accelerator or transformed: nothing to read cheaply
    check_state_memory(state, owner)
    value = {name: int(t.item()) for name, t in counters.items()}
    count = value["count"]
    bounds = {
        "count": (0, MAX_COUNT, f"0 and 2**53 ({MAX_COUNT})"),
        "head": (0, config.num_slots - 1, f"0 and {config.num_slots - 1} (the ring's slots - 1)"),
        "window_size": (
            0,
            min(config.history_depth, count),
            f"0 and min(history_depth={config.history_depth}, count={count})",
        ),
        "num_skipped": (0, MAX_COUNT, f"0 and 2**53 ({MAX_COUNT})"),
        "skip_streak": (0, value["num_skipped"], f"0 and num_skipped={value['num_skipped']}"),
    }
    for name in ("num_mixed", "num_rejected", "num_nonfinite", "num_averaged"):
        bounds[name] = (0, count, f"0 and count={count}")
    for name in COUNTERS:
        low, high, text = bounds[name]
        if not low <= value[name] <= high:
            raise ValueError(
                f"{owner}: `state.{name}` is {value[name]}, expected between {text}; "
                "was the state saved by this optimizer and loaded unchanged?"
            )
    if value["num_mixed"] + value["num_averaged"] > count:
        raise ValueError(
            f"{owner}: `state.num_mixed` + `state.num_averaged` is "
            f"{value['num_mixed'] + value['num_averaged']}, expected at most count={count} "
            "(a call returns a mix or a window mean, not both); was the state saved by this "
            "optimizer and loaded unchanged?"
        )
    check_pending_loss(config, state, value, owner)
    check_values = getattr(config.inner, "check_values", None)
    if callable(check_values):
        check_values(state.inner_state, count=count, name="state.inner_state", owner=owner)
    check_no_aliasing(state, p_leaves, spec, owner)
    check_window_values(state, owner)
    mark_verified(state)


#: The state's fields whose values feed the window's arithmetic.
WINDOW_FIELDS = ("anchor", "residuals", "iterates", "gram", "dr_gram", "dr_rhs")


def check_window_values(state: AndersonState, owner: str = OWNER) -> None:
    """Every value of the window (anchor, ring slots, Grams) is finite and at most half its
    dtype's largest value in magnitude, so that the difference of two of them, as the step
    forms them, cannot overflow. `update` stores only finite entries of such a size for
    finite params and steps; a state from outside with larger ones (a tampered checkpoint:
    3e38 in a float32 anchor) is refused here, once, rather than trusted by the
    finiteness fallback, which covers the mix but not the plain step.

    One pass over the window (`torch._foreach_norm`, the largest magnitude of every
    leaf), on the first call with a state from outside."""
    leaves = optree.tree_leaves([getattr(state, f) for f in WINDOW_FIELDS], none_is_leaf=False)
    leaves = list(itertools.compress(leaves, map(Tensor.numel, leaves)))  # inf-norm of none
    # A leaf batched by vmap (e.g. a state made by init inside vmap from params batched
    # outside) has no values to read here: it is not checked (docs/reliability.md).
    leaves = [t for t in leaves if not tree.is_transformed(t)]
    if not leaves:
        return
    largest = torch.stack(
        [*map(Tensor.double, map(Tensor.cpu, torch._foreach_norm(leaves, math.inf)))]
    )
    limits = torch.tensor([*map(_half_max, map(_DTYPE, leaves))], dtype=torch.float64)
    if bool((largest <= limits).all()):  # a NaN fails the comparison
        return
    for field in WINDOW_FIELDS:
        leaves, spec = optree.tree_flatten(getattr(state, field), none_is_leaf=False)
        for i, t in enumerate(leaves):
            if t.numel() == 0 or bool(t.abs().le(_half_max(t.dtype)).all()):
                continue
            finite = bool(t.isfinite().all())
            worst = f"{float(t.abs().max()):.3g}" if finite else "a non-finite value"
            raise ValueError(
                f"{owner}: `{tree.leaf_path(spec, i, f'state.{field}')}` holds {worst}; a "
                f"window holds finite values up to {_half_max(t.dtype):.3g} in magnitude "
                f"(half the largest {t.dtype}); was the state saved by this optimizer and "
                "loaded unchanged?"
            )


_DTYPE = operator.attrgetter("dtype")


@functools.cache
def _half_max(dtype: torch.dtype) -> float:
    """Half the largest finite value of `dtype` (of its real parts, for a complex one)."""
    return torch.finfo(dtype).max / 2


def check_pending_loss(config: Config, state: AndersonState, value: dict, owner: str) -> None:
    """`pending_loss` is +inf, or a finite loss left by a call that returned a mix: then
    the state has made a call (`count >= 1`), returned a mix (`num_mixed >= 1`) and its
    window holds enough entries to have mixed (`window_size >= min_window`; only a
    rejection, which clears the loss, shrinks it). A finite loss in a state that never mixed
    would make the next call's `loss` reject a mix that was never returned."""
    pending = tree.static_value(state.pending_loss)
    if pending is None or pending == math.inf:
        return
    if not (pending == pending and pending > -math.inf):
        raise ValueError(
            f"{owner}: `state.pending_loss` is {pending}, expected a loss or +inf; was the "
            "state saved by this optimizer and loaded unchanged?"
        )
    needs = {"count": 1, "num_mixed": 1, "window_size": config.rules.min_window}
    for name, least in needs.items():
        if value[name] < least:
            raise ValueError(
                f"{owner}: `state.pending_loss` is {pending}, a mix waiting for its verdict, "
                f"but `state.{name}` is {value[name]} (a state with a pending mix has "
                f"count >= 1, num_mixed >= 1 and window_size >= {config.rules.min_window}); "
                "was the state saved by this optimizer and loaded unchanged?"
            )


def _first_overlap(leaves: list[Tensor], counts: Any) -> tuple[int, int] | None:
    """The first pair `(j, k)`, `j < k` in the order of `leaves`, of tensors that share
    memory and for which `counts(j, k)` holds; None if there is none.

    One sort of the tensors' byte spans finds the candidates (normally none: distinct
    allocations, or the disjoint rows of one); a candidate whose spans interleave without
    sharing an element (`w[0::2]` and `w[1::2]`) is cleared by an exact element test."""
    spans = [(*span, k) for k, span in enumerate(map(_span, leaves)) if span is not None]
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


def _span(t: Tensor) -> tuple | None:
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


def check_no_aliasing(
    state: AndersonState, p_leaves: list[Tensor], spec: Any, owner: str = OWNER
) -> None:
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
    pair = _first_overlap(leaves, lambda j, k: k >= num_params)
    if pair is not None:
        first, second = (_leaf_name(named, *owners[i]) for i in pair)
        raise ValueError(
            f"{owner}: `{second}` shares memory with `{first}`; every tensor of the state "
            "must own its memory (was the state built from shared tensors, or the params "
            "from the state's?)"
        )


def _concrete_counters(counters: list) -> bool:
    """Whether every counter is a plain 0-d CPU tensor whose value can be read (C-level maps:
    the check of a state from outside stays a few Python steps)."""
    return (
        all(map(isinstance, counters, itertools.repeat(Tensor)))
        and not any(map(_functorch.is_functorch_wrapped_tensor, counters))
        and not any(map(_NDIM, counters))
        and all(map(_IS_CPU, counters))
    )


_NDIM, _IS_CPU = operator.attrgetter("ndim"), operator.attrgetter("is_cpu")


def check_state_memory(state: AndersonState, owner: str = OWNER) -> None:
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


def check_ring(name: str, ring: tuple, check_window: Any) -> None:
    """Every slot of a ring is laid out like the params (structure, shapes, dtypes, devices).

    Slot 0 had the full check against the params; the other slots are compared with slot 0
    leaf by leaf (attribute reads only), and a slot that differs gets the full check too, so
    that the error names its own leaf (`state.residuals[2]['w']`)."""
    first, first_spec = tree.flatten(ring[0], f"{name}[0]", owner=OWNER)
    for s in range(1, len(ring)):
        leaves, spec = tree.flatten(ring[s], f"{name}[{s}]", owner=OWNER)
        if spec != first_spec or any(
            a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
            for a, b in zip(leaves, first)
        ):
            check_window(f"{name}[{s}]", ring[s])


def _describe(value: object, *, device: bool = False) -> str:
    """What a state field holds, for error messages: its dtype and shape (and device)."""
    if not isinstance(value, Tensor):
        return type(value).__name__
    text = f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{text} on {value.device}" if device else text

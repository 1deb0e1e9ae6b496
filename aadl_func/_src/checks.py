"""Validation of `update`'s arguments against each other and against the state.

Everything here reads metadata only (types, pytree structure, shapes, dtypes, devices), never
values, so the checks run before any buffer is written and also under `torch.func.vmap`.
Messages name the offending leaf by its key path (`params['bn.num_batches_tracked']`,
`state.residuals[0]['w']`); the paths are built only when an error is raised.

The module also holds the autograd policy of `init`/`update` (`autograd_policy()`). The
checks of the leaves' memory are in `aadl_func._src.leaf_memory`, those of a state's values in
`aadl_func._src.state_values`, the record of the states already checked in
`aadl_func._src.verified_states`; their names used by the rest of the package are importable
from here too.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.core.scalars import COMPLEX_HISTORY, wide
from aadl_func._src.leaf_memory import (
    all_strided,
    byte_span,
    check_dense,
    check_no_aliasing,
    check_state_memory,
    check_writable,
    first_overlap,
    self_overlapping,
)
from aadl_func._src.state import COUNTERS, AndersonState
from aadl_func._src.state_values import (
    MAX_COUNT,
    WINDOW_FIELDS,
    check_pending_loss,
    check_state_values,
    check_window_values,
)
from aadl_func._src.validation import (
    check_bool,
    check_callable,
    check_leaf_devices,
    check_leaf_dtypes,
    same_device,
)
from aadl_func._src.verified_states import (
    checked_layout,
    mark_verified,
    remember_layout,
    verified,
)

if TYPE_CHECKING:
    from aadl_func._src.options import AndersonOptions as Config

__all__ = [
    "MISSING",
    "OUTERMOST",
    "as_a_transformation",
    "autograd_policy",
    "check_call",
    "check_dense",
    "check_floating",
    "check_state",
    "check_state_values",
    "mark_verified",
    "checked_layout",
    "remember_layout",
    "self_overlapping",
    "verified",
    # Checks of the memory and of a state's values, importable from here as before.
    "MAX_COUNT",
    "WINDOW_FIELDS",
    "check_no_aliasing",
    "check_pending_loss",
    "check_state_memory",
    "check_window_values",
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
        p, g = byte_span(leaves[0]), byte_span(leaves[1])
        if p is None or g is None or g[1] <= p[0] or p[1] <= g[0]:
            return
    num_params = len(p_leaves)
    pair = first_overlap(leaves, lambda j, k: j < num_params)
    if pair is not None:
        first, second = pair
        raise ValueError(
            f"{OWNER}: `{_input_path(second, num_params, spec, g_spec)}` shares memory with "
            f"`{_input_path(first, num_params, spec, g_spec)}`; with inplace=True every "
            "params leaf is written once, so params must not overlap one another (the "
            "same tensor twice, overlapping views) and grads must not overlap params: "
            "pass distinct tensors, or inplace=False"
        )


# -- the params' kinds -----------------------------------------------------------------------
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
    _check_scalars(state)
    _check_rings(config, state)
    history_devices = [config.history_device_of(p) for p in p_leaves]
    history_dtypes = [config.history_dtype_of(p) for p in p_leaves]

    def check_window(name: str, window: Any) -> None:
        leaves, window_spec = tree.flatten(window, name, owner=OWNER)
        tree.check_like("params", p_leaves, spec, leaves, window_spec, ref_name=name, owner=OWNER)
        check_leaf_dtypes(OWNER, name, leaves, history_dtypes, _WHAT, spec=window_spec)
        check_leaf_devices(OWNER, name, leaves, history_devices, _WHERE, spec=window_spec)

    _check_points(config, state, p_leaves, spec, history_devices, check_window)
    _check_grams(config, state, config.compute_device_of(p_leaves), wide(history_dtypes[0]))
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
        check_state_values(config, state, p_leaves, spec, OWNER)


_WHERE = "the history device for `params`; was the state made on another device?"
_WHAT = "the history_dtype for `params`; was the state made with other options or params?"


def _check_scalars(state: AndersonState) -> None:
    """The counters are 0-d int64 tensors, `pending_loss` a 0-d float64 one."""
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


def _check_rings(config: Config, state: AndersonState) -> None:
    """The state has the ring slots of this optimizer's options, and the anchor and ring of
    iterate differences (or none) of its mode."""
    q = config.num_slots
    if not isinstance(state.residuals, tuple) or len(state.residuals) != q:
        held = len(state.residuals) if isinstance(state.residuals, (tuple, list)) else "no"
        raise ValueError(
            f"{OWNER}: `state` holds {held} window slots, this optimizer expects {q} "
            f"(history_depth={config.history_depth}, mode={config.mode!r}); {HINT}"
        )
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


def _check_points(
    config: Config,
    state: AndersonState,
    p_leaves: list[Tensor],
    spec: Any,
    history_devices: list[torch.device],
    check_window: Any,
) -> None:
    """The anchor is laid out like the params (their dtypes, the history devices), and so
    are the first slot of each ring (`check_window`)."""
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
    check_leaf_devices(OWNER, "state.anchor", a_leaves, history_devices, _WHERE, spec=a_spec)


def _check_grams(
    config: Config, state: AndersonState, compute_device: torch.device, grams: torch.dtype
) -> None:
    """The Grams are `(Q, Q)` / `(Q,)` tensors of dtype `grams` on `compute_device`: float64,
    or complex128 (Hermitian) for a complex window, all of whose leaves are complex (checked
    by check_floating), so that the first leaf decides."""
    q = config.num_slots
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

"""Validation of ``update``'s arguments against each other and against the state.

Everything here reads metadata only (types, pytree structure, shapes, dtypes, devices), never
values, so the checks run before any buffer is written and also under ``torch.func.vmap``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.state import AndersonState
from aadl_func._src.validation import (
    check_bool,
    check_callable,
    check_leaf_devices,
    check_leaf_dtypes,
    same_device,
)

if TYPE_CHECKING:
    from aadl_func._src.anderson import _Config as Config

__all__ = ["check_update_inputs", "check_state"]

Params = Any


def check_update_inputs(
    config: Config,
    state: AndersonState,
    params: Params,
    grads: Params,
    loss_fn: Any,
    inplace: Any = False,
) -> tuple[list[Tensor], Any, list[Tensor]]:
    """Validates every argument of ``update`` before anything is computed or written.

    With ``inplace=True`` the inner optimizer and the window overwrite buffers as soon as the
    step starts, so a mismatch found later would leave a half-updated state behind: every
    check that can be made from metadata alone (types, structure, shapes, dtypes, devices) is
    made here. Values are never inspected (no ``.item()``), so the checks also run under vmap.
    """
    owner = "anderson.update"
    if not isinstance(state, AndersonState):
        raise TypeError(f"{owner}: `state` must be an AndersonState, got {type(state).__name__}")
    check_bool(owner, "inplace", inplace)
    if loss_fn is not None:
        check_callable(owner, "loss_fn", loss_fn)
    p_leaves, spec = tree.flatten(params, "params")
    for i, p in enumerate(p_leaves):
        if not p.is_floating_point():
            raise TypeError(f"{owner}: `params` leaf {i} must be floating, got {p.dtype}")
    g_leaves, g_spec = tree.flatten(grads, "grads")
    tree.check_like("grads", g_leaves, g_spec, p_leaves, spec, check_dtype=True)
    check_leaf_devices(owner, "grads", g_leaves, [p.device for p in p_leaves], "like `params`")
    if inplace and torch.is_grad_enabled():
        for i, p in enumerate(p_leaves):
            # autograd forbids in-place writes into leaves that require grad; fail before the
            # inner optimizer has overwritten its buffers rather than halfway through.
            if p.requires_grad and p.is_leaf and not tree.is_transformed(p):
                raise ValueError(
                    f"{owner}: `inplace=True` cannot write into `params` leaf {i}, a leaf that "
                    "requires grad; call update under torch.no_grad() or pass detached params"
                )
    check_state(config, state, p_leaves, spec)
    return p_leaves, spec, g_leaves


def check_state(config: Config, state: AndersonState, p_leaves: list[Tensor], spec: Any) -> None:
    """The state's layout matches this optimizer's options and ``params``.

    Catches states made by another configuration (e.g. a checkpoint saved with a different
    ``history_depth``, ``mode`` or ``history_dtype``) or for other params (structure, shape,
    dtype, device), which would otherwise mix garbage or fail halfway through a step.
    """
    owner = "anderson.update"
    for name in _COUNTERS:
        value = getattr(state, name)
        if not (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.int64):
            raise TypeError(
                f"{owner}: `state.{name}` must be a 0-d int64 tensor, got {_describe(value)}"
            )
    q = config.num_slots
    hint = "was it made by another configuration?"
    if not isinstance(state.residuals, tuple) or len(state.residuals) != q:
        held = len(state.residuals) if isinstance(state.residuals, (tuple, list)) else "no"
        raise ValueError(
            f"{owner}: `state` holds {held} window slots, this optimizer expects {q} "
            f"(history_depth={config.history_depth}, mode={config.mode!r}); {hint}"
        )
    history_devices = [config.history_device_of(p) for p in p_leaves]
    history_dtypes = [config.history_dtype_of(p) for p in p_leaves]
    where = "the history device for `params`; was the state made on another device?"
    what = "the history_dtype for `params`; was the state made with other options or params?"

    def check_window(name: str, window: Any) -> None:
        leaves, window_spec = tree.flatten(window, name)
        tree.check_like("params", p_leaves, spec, leaves, window_spec, ref_name=name)
        check_leaf_dtypes(owner, name, leaves, history_dtypes, what)
        check_leaf_devices(owner, name, leaves, history_devices, where)

    empty_anchor = isinstance(state.anchor, tuple) and len(state.anchor) == 0
    if config.mode == "aadl":
        if not (isinstance(state.iterates, tuple) and len(state.iterates) == 0) or empty_anchor:
            raise ValueError(
                f"{owner}: `state` has no anchor or holds iterates, so it was made in mode "
                f"'classic', not {config.mode!r}"
            )
        # The anchor keeps the params' own dtype: a params dtype change is reported as such.
        a_leaves, a_spec = tree.flatten(state.anchor, "state.anchor")
        tree.check_like("params", p_leaves, spec, a_leaves, a_spec, ref_name="state.anchor")
        check_leaf_dtypes(
            owner,
            "params",
            p_leaves,
            [a.dtype for a in a_leaves],
            "the dtype of the params the state was made for",
        )
        check_window("state.residuals", state.residuals[0])
        check_leaf_devices(owner, "state.anchor", a_leaves, history_devices, where)
    else:
        if not empty_anchor or not isinstance(state.iterates, tuple) or len(state.iterates) != q:
            raise ValueError(
                f"{owner}: `state` has an anchor or lacks {q} iterates, so it was made in mode "
                f"'aadl' or with another history_depth, not mode {config.mode!r}"
            )
        check_window("state.residuals", state.residuals[0])
        check_window("state.iterates", state.iterates[0])
    compute_device = config.compute_device_of(p_leaves)
    for name, shape in (("gram", (q, q)), ("dr_gram", (q, q)), ("dr_rhs", (q,))):
        value = getattr(state, name)
        if not (
            isinstance(value, Tensor)
            and tuple(value.shape) == shape
            and value.dtype == torch.float64
            and same_device(value.device, compute_device)
        ):
            raise ValueError(
                f"{owner}: `state.{name}` must be a {shape} float64 tensor on {compute_device}, "
                f"got {_describe(value, device=True)}; {hint}"
            )


_COUNTERS = (
    "count",
    "head",
    "window_size",
    "num_mixed",
    "num_rejected",
    "num_nonfinite",
    "num_averaged",
    "num_skipped",
    "skip_streak",
)


def _describe(value: object, *, device: bool = False) -> str:
    """What a state field holds, for error messages: its dtype and shape (and device)."""
    if not isinstance(value, Tensor):
        return type(value).__name__
    text = f"{value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{text} on {value.device}" if device else text

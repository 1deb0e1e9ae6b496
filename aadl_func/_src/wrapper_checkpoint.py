"""The windows of `AcceleratedOptimizer` in a checkpoint: the `"anderson"` entry of its
`state_dict()` (format, options, one `AndersonState` per param group) and its restoration
into windows laid out for the current params, checked before anything is modified."""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor

from aadl_func._src.anderson import Anderson
from aadl_func._src.checks import check_state_values
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState

__all__ = ["FORMAT", "plain_values", "restore_windows", "saved_windows"]

# Bumped if the layout of `state_dict()["anderson"]` changes.
FORMAT = 2  # 2: AndersonState gained num_skipped and skip_streak
# Options that fix the window's layout: a checkpoint saved with other values cannot be resumed.
LAYOUT_OPTIONS = ("history_depth", "mode", "history_dtype")
OWNER = "AcceleratedOptimizer.load_state_dict"


def plain_values(options: dict[str, Any]) -> dict[str, Any]:
    """`options` in plain Python values (devices and dtypes as strings), so that they
    survive `torch.load(weights_only=True)`."""
    return {
        name: str(value) if isinstance(value, (torch.device, torch.dtype)) else value
        for name, value in options.items()
    }


def saved_windows(options: dict[str, Any], windows: list[AndersonState | None]) -> dict:
    """The `"anderson"` entry: the format, the options (`plain_values()`) and the windows."""
    return {"format": FORMAT, "options": dict(options), "windows": list(windows)}


def restore_windows(
    anderson: Anderson,
    config: AndersonOptions,
    options: dict[str, Any],
    param_groups: list[dict[str, Any]],
    saved: Any,
) -> list[AndersonState | None]:
    """The windows of a `saved_windows()` entry, copied into new states made by `anderson`
    for the params of `param_groups`; a ValueError if the entry does not fit them."""
    if not (isinstance(saved, dict) and saved.get("format") == FORMAT):
        raise ValueError(f"{OWNER}: unrecognised 'anderson' entry (format {FORMAT} expected)")
    saved_options = saved.get("options", {})
    differ = [
        f"{name}={saved_options.get(name)!r} (this optimizer: {options[name]!r})"
        for name in LAYOUT_OPTIONS
        if saved_options.get(name) != options[name]
    ]
    if differ:
        raise ValueError(
            f"{OWNER}: the checkpoint's windows were saved with "
            + ", ".join(differ)
            + "; make the optimizer with the same options to resume"
        )
    windows = saved.get("windows")
    if not isinstance(windows, list) or len(windows) != len(param_groups):
        held = len(windows) if isinstance(windows, list) else "no"
        raise ValueError(
            f"{OWNER}: the checkpoint holds {held} windows for {len(param_groups)} param groups"
        )
    depth = options["history_depth"]
    return [
        None
        if window is None
        else _restore_window(anderson, config, depth, group["params"], index, window)
        for index, (group, window) in enumerate(zip(param_groups, windows))
    ]


def _restore_window(
    anderson: Anderson,
    config: AndersonOptions,
    history_depth: int,
    group_params: list[Tensor],
    index: int,
    saved: Any,
) -> AndersonState:
    """Param group `index`'s window: `saved` checked against a state made for its params
    (structure, then each tensor's layout, shape and dtype), copied into it, and its values
    checked as `update` checks a state from outside."""
    where = f"param group {index}"
    if not isinstance(saved, AndersonState):
        raise ValueError(f"{OWNER}: the window of {where} is not an AndersonState")
    params = [p.detach() for p in group_params]
    if not params:
        raise ValueError(f"{OWNER}: {where} has no params but the checkpoint has a window")
    template = anderson.init(params)
    if saved.pending_loss is None:  # saved before the field existed: nothing pending
        saved = saved._replace(pending_loss=template.pending_loss)
    template_leaves, template_spec = optree.tree_flatten(template)
    saved_leaves, saved_spec = optree.tree_flatten(saved)
    if template_spec != saved_spec:
        raise ValueError(
            f"{OWNER}: the window of {where} has another structure than its "
            f"{len(params)} params with history_depth={history_depth} "
            "(different params or options?)"
        )
    for template_leaf, saved_leaf in zip(template_leaves, saved_leaves):
        _check_leaf(template_leaf, saved_leaf, where)
    for template_leaf, saved_leaf in zip(template_leaves, saved_leaves):
        template_leaf.copy_(saved_leaf)
    # The values (counters in range, the inner state's invariants), as `update` checks
    # a state from outside; the copies above own their memory, so no aliasing is left.
    check_state_values(config, template, params, optree.tree_structure(params), OWNER)
    return template


def _check_leaf(template_leaf: Tensor, saved_leaf: Any, where: str) -> None:
    """`saved_leaf` is a dense tensor with values, of `template_leaf`'s shape and dtype."""
    if isinstance(saved_leaf, Tensor) and (
        saved_leaf.layout is not torch.strided or saved_leaf.is_meta
    ):
        raise ValueError(
            f"{OWNER}: the window of {where} holds a {saved_leaf.layout} tensor on "
            f"{saved_leaf.device}; a window holds dense tensors with values (load "
            "the state_dict() the optimizer saved, unchanged)"
        )
    if not isinstance(saved_leaf, Tensor) or (
        template_leaf.shape != saved_leaf.shape or template_leaf.dtype != saved_leaf.dtype
    ):
        got = (
            f"{saved_leaf.dtype} {tuple(saved_leaf.shape)}"
            if isinstance(saved_leaf, Tensor)
            else type(saved_leaf).__name__
        )
        raise ValueError(
            f"{OWNER}: the window of {where} holds a {got} tensor where its params need "
            f"{template_leaf.dtype} {tuple(template_leaf.shape)}"
        )

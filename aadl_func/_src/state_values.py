"""The values of a state from outside (`torch.load`, a checkpoint, built by hand): its
counters in range, its pending loss, its window finite and not too large, its tensors owning
their memory; checked once per state, before anything is written, then marked verified
(`aadl_func._src.verified_states`)."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.leaf_memory import check_no_aliasing, check_state_memory
from aadl_func._src.state import COUNTERS, AndersonState
from aadl_func._src.verified_states import mark_verified

if TYPE_CHECKING:
    from aadl_func._src.options import AndersonOptions as Config

__all__ = ["MAX_COUNT", "WINDOW_FIELDS", "check_state_values", "check_window_values"]


#: Counters above this are refused: a float64 (the inner schedules' `count`) holds every
#: integer up to it exactly, and `count + 1` cannot overflow int64.
MAX_COUNT = 2**53


def check_state_values(
    config: Config, state: AndersonState, p_leaves: list[Tensor], spec: Any, owner: str
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


def check_window_values(state: AndersonState, owner: str) -> None:
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

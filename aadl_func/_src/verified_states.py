"""The states whose values were checked: a state is checked once, not on every call.

A state is *verified* once its values have been checked (or `update` made it): the value
checks then cost one dictionary look-up and an identity test per field. An entry is keyed
by the id of the state's `count` tensor and holds a weak reference to it plus the state's
other fields themselves: while the entry exists those fields are alive, so no other object
can have their identity (a check by `id()` alone would take a field rebuilt after the old
one was freed for the old one). The entry goes when `count` dies, normally with the
state, so it keeps nothing alive that the state does not (and at most `KEEP` entries
are listed, if counters outlive their states). A state rebuilt with `_replace` is checked
again; tensors written in place by the caller behind `update`'s back are not noticed.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.state import AndersonState

__all__ = ["checked_layout", "mark_verified", "memo", "remember_layout", "set_memo", "verified"]

KEEP = 64  # states listed at most (optimizers stepping in turn, each with its newest state)


class _Entry(weakref.ref):
    """A weak reference to a verified state's `count`, with the state's other fields (held),
    whether its tensors are inference tensors (valid only in inference mode), the layout it
    was checked for and `memo`, what an executor keeps of it between calls
    (`aadl_func._src.exec.steady`)."""

    __slots__ = ("key", "fields", "inference", "layout", "memo")


class _Verified:
    """The entries of the verified states, oldest first, keyed by `id(count)`: the one
    owner of the list, which an entry leaves when its `count` is freed (the weak
    reference's callback) or when more than `keep` are listed (the oldest goes)."""

    def __init__(self, keep: int) -> None:
        self._entries: dict[int, _Entry] = {}
        self._keep = keep

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, state: AndersonState) -> _Entry | None:
        """The entry of a verified eager state (see `verified()`), else None."""
        count = state.count
        entry = self._entries.get(id(count))
        if (
            entry is not None
            and entry() is count
            and all(map(operator.is_, entry.fields, state[1:]))
            and (not entry.inference or torch.is_inference_mode_enabled())
        ):
            return entry
        return None

    def record(self, state: AndersonState, layout: tuple | None, new_layout: bool) -> None:
        """Lists `state` (its `count` a 0-d CPU tensor) as verified, with `layout`; an entry
        of the same `count` (in place, the count is the same each call) takes the state's
        new fields, and `layout` if `new_layout`."""
        count = state.count
        key = id(count)
        entry = self._entries.get(key)
        # A state made in inference mode holds inference tensors, which only that mode may write.
        inference = count.is_inference()
        if entry is not None and entry() is count:
            if not all(map(operator.is_, entry.fields, state[1:])):
                entry.memo = None  # kept of other tensors
            entry.fields, entry.inference = state[1:], inference
            if new_layout:
                entry.layout = layout
            return
        entry = _Entry(count, self._forget)
        entry.key, entry.layout, entry.memo = key, layout, None
        entry.fields, entry.inference = state[1:], inference
        # Listed once complete: an exception raised before this line leaves no half-made entry.
        self._entries[key] = entry
        if len(self._entries) > self._keep:  # counters kept alive after their states
            del self._entries[next(iter(self._entries))]

    def _forget(self, entry: _Entry) -> None:
        """Drops `entry` once its `count` is freed (weakref callback)."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]


_VERIFIED = _Verified(KEEP)
# Bound once: `update` asks on every call, and a look-up of the method per call costs more
# than the rest of `verified()`'s common case.
_find, _record = _VERIFIED.find, _VERIFIED.record


def verified(state: AndersonState) -> bool:
    """Whether `state`'s values were checked already (or it was made by `update`).

    Always True where values cannot be read (vmap, torch.compile, counters on an
    accelerator): there only the metadata checks run."""
    if tree.tracing():
        return True  # compiled: no values (and no ids to guard on)
    if _find(state) is not None:
        return True  # the common case first: only concrete counters are ever listed
    return not _concrete(state.count)


def checked_layout(state: AndersonState, layout: tuple) -> bool:
    """Whether `check_state()` passed already for this verified state with these options and
    params (`layout`: the options, the params' structure and each leaf's shape, dtype and
    device), so that its metadata checks need not run again: a state is checked once, not on
    every call. Never under torch.compile, which checks at trace time."""
    if tree.tracing() or not isinstance(state, AndersonState):
        return False
    entry = _find(state)
    if entry is None or entry.layout is None:
        return False
    config, spec, leaves = entry.layout
    return config is layout[0] and spec == layout[1] and leaves == layout[2]


def remember_layout(state: AndersonState, layout: tuple | None) -> None:
    """Records that `state` (if verified) passed `check_state()` for `layout`."""
    if tree.tracing():
        return
    entry = _find(state)
    if entry is not None:
        entry.layout = layout


def memo(state: AndersonState) -> Any:
    """What was kept with the verified state `state` (`set_memo()`), else None."""
    entry = _find(state)
    return None if entry is None else entry.memo


def set_memo(state: AndersonState, value: Any) -> None:
    """Keeps `value` with `state`, if it is verified (until its fields change)."""
    entry = _find(state)
    if entry is not None:
        entry.memo = value


def _layout_of(state: AndersonState) -> tuple | None:
    """The layout `state` was checked for (`checked_layout()`), if any."""
    entry = _find(state) if not tree.tracing() else None
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
    _record(state, layout, made_from is not None)

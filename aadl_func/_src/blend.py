"""Decisions without values: `select` and masked in-place writes, per `update` call.

Eagerly a step's decisions (mix or not, keep or reject, store or not) are concrete booleans
and only the chosen branch runs. Under `torch.func.vmap` (members that disagree) and
`torch.compile` a decision has no value: both branches run and their results are blended
with `torch.where`, and an in-place write made inside a branch must then only land where
the decision holds. A `Blend` is that context for one call: it knows which blended
selects are running, so every in-place write of the call goes through `Blend.assign()`.
It belongs to the call (`aadl_func._src.update_call.Call`), so calls in different threads
never see each other's gates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import optree
import torch
from torch import Tensor

from aadl_func._src import flags, traced, tree

__all__ = ["Blend"]

T = TypeVar("T")


class Blend:
    """The gates of the blended `select()` calls running in one `update` call."""

    __slots__ = ("_gates",)

    def __init__(self) -> None:
        self._gates: list[Tensor] = []  # outermost first

    def active(self) -> bool:
        """Whether a blended `select()` is computing (its in-place writes are masked)."""
        return len(self._gates) > 0  # not bool(): dynamo 2.10-2.12 cannot trace bool() of a list

    def _mask(self, mask: Tensor | None) -> Tensor | None:
        for gate in self._gates:
            mask = gate if mask is None else mask & gate.to(mask.device)
        return mask

    def assign(
        self, dst: Tensor, src: Tensor, where: Tensor | None = None, *, skip_misses: bool = False
    ) -> None:
        """`dst.copy_(src)`, except inside a blended `select()` (a gate without a value:
        vmap, torch.compile), where both outcomes are computed: the write then happens only
        where the gates hold (and `where`), so an in-place write is right whatever the gates
        decide. Every in-place write to the params or the state during a step goes through
        here.

        `skip_misses`: the masked write goes through `traced.copy_if_`, which copies on a
        hit and leaves `dst` untouched otherwise instead of rewriting it (a compiled step's
        large ring slots, see `aadl_func._src.window.write_slot()`)."""
        mask = self._mask(where)
        if mask is None:
            dst.copy_(src)
        elif skip_misses:
            traced.copy_if_(dst, mask, src)
        else:
            dst.copy_(torch.where(mask.to(dst.device), src, dst))

    def select(
        self,
        gate: Tensor,
        compute: Callable[[], T],
        otherwise: T | Callable[[], T],
        *,
        blend: bool = True,
    ) -> T:
        """`compute()` where `gate` holds, else `otherwise` -- without computing it when
        the gate is a concrete False (or, under vmap, False for every member). Under vmap with
        members that disagree, and under torch.compile, both are evaluated and blended leaf
        by leaf.

        `otherwise` may be a zero-argument callable, called only when its value is needed
        (a concrete False gate, or blending under vmap): placeholders such as a
        parameter-sized zero tensor then cost nothing on the steps that compute.

        `blend=False`: for a result the caller only uses where `gate` holds (it masks
        the rest itself); a gate without a value then returns `compute()` as it is, saving
        a parameter-sized blend (its in-place writes are still masked, see `assign()`).
        """
        known = flags.value(gate)
        if known is None:
            known = tree.uniform_value(gate)  # a vmapped ensemble whose members agree
        if known is not None:
            if known:
                return compute()
            return otherwise() if callable(otherwise) else otherwise
        fallback = otherwise() if callable(otherwise) and blend else otherwise
        self._gates.append(gate)
        try:
            computed = compute()
        finally:
            self._gates.pop()
        if not blend:
            return computed
        # A leaf both outcomes share (a window slot neither touched, a buffer written in
        # place by assign) is kept, not blended.
        return optree.tree_map(
            lambda new, old: old if new is old else torch.where(gate.to(new.device), new, old),
            computed,
            fallback,
        )

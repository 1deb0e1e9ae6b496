r"""A built-in inner optimizer's known rule bound to one state's buffers.

Anderson's steady call (`aadl_func._src.exec.steady`) keeps what it can of a state from one
call to the next. For a built-in optimizer whose update has a known rule (Adam with a number
learning rate and no decay: `transforms.adam_leaves()`), it keeps the state's buffers as
lists of tensors and the update count as a Python int: while the version counters of these
tensors stay as the previous call left them (the steady plan tracks them), nothing has
written them since, so they need no flattening, no shape checks and no `.item()`. The
update is the rule's (the operations of `update(..., inplace=False)`, bit for bit); the new
buffers are adopted at the commit point by `set_` (O(1)) and the count written in place (by
the steady call's native commit).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import optree
import torch
from torch import Tensor

__all__ = ["BoundRule", "bind"]


class BoundRule:
    """`rule(grads, *fields, done) -> (updates, *new_fields) | None` on the buffers `fields`
    (per field of the state after its count, that field's leaves) of a state of
    `state_type` whose counter is `count`; `spec` the params' structure."""

    __slots__ = ("rule", "state_type", "spec", "count", "fields")

    def __init__(
        self, rule: Callable, state_type: type, spec: Any, count: Tensor, fields: list
    ) -> None:
        self.rule, self.state_type, self.spec = rule, state_type, spec
        self.count, self.fields = count, fields

    def tensors(self) -> list[Tensor]:
        """Every tensor of the state it is bound to (for their version counters)."""
        return [self.count, *chain(*self.fields)]

    def update(self, grads: list[Tensor], done: int) -> tuple[list[Tensor], list] | None:
        """The update after `done` updates: `(updates, new_fields)`, or None (a leaf the
        rule does not take: nothing computed)."""
        out = self.rule(grads, *self.fields, done)
        return None if out is None else (out[0], list(out[1:]))

    def state(self, count: int, new_fields: list) -> Any:
        """The public state with `count` updates done and the buffers `new_fields` (what
        `update(..., inplace=False)` returns; built only where a state object is needed)."""
        fields = [optree.tree_unflatten(self.spec, leaves) for leaves in new_fields]
        return self.state_type(torch.tensor(count, dtype=torch.int64), *fields)

    def adopt(self, new_fields: list) -> None:
        """The buffers of the state it is bound to become `new_fields`, each taking over its
        new tensor's memory (`Tensor.set_`, as `exec.inplace.adopt()`); the caller writes
        the count (the steady call, in its commit point's native call). Doing it again
        changes nothing."""
        for old, new in zip(self.fields, new_fields):
            for dst, src in zip(old, new):
                if dst is not src:
                    dst.set_(src)


def bind(
    rule: Callable, state_type: type, state: Any, params: list[Tensor], spec: Any
) -> BoundRule | None:
    """`rule` bound to `state`'s buffers, if `state` is a `state_type` with a concrete CPU
    int64 counter and buffers laid out as `params` (same structure, shapes, dtypes and
    devices, plain tensors): the buffers `update` would take and broadcast nothing into.
    Else None."""
    count = state.count if type(state) is state_type else None
    if type(count) is not Tensor or count.ndim or not count.is_cpu or count.dtype != torch.int64:
        return None
    if count.is_inference() or torch._C._functorch.is_functorch_wrapped_tensor(count):
        return None
    fields = []
    for field in state[1:]:
        leaves, field_spec = optree.tree_flatten(field, none_is_leaf=False)
        if field_spec != spec:
            return None
        for b, p in zip(leaves, params):
            if type(b) is not Tensor or b.is_inference() or b.shape != p.shape:
                return None
            if b.dtype != p.dtype or b.device != p.device:
                return None
        fields.append(leaves)
    return BoundRule(rule, state_type, spec, count, fields)

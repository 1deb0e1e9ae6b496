"""A step's decisions (0-d bool tensors) and the logic that combines them.

`update` expresses every decision (store, mix, accept, poisoned, ...) as a 0-d bool tensor,
so that it runs under `vmap` (one decision per member) and under `torch.compile` (no
branch on a value). In an eager call most decisions are known in Python: they are then the
two shared constants `TRUE` and `FALSE`, and `both()`, `either()`,
`negate()` and `value()` work on them with identity tests instead of tensor
operations. A tensor operation on a 0-d tensor costs microseconds; an eager step combines
a few dozen decisions, which made that logic a sizeable part of a small model's step.

The constants are never written to (decisions are not stored in the state; counters are
int64 tensors of their own). A decision that is not a constant (batched, traced, or a fresh
eager flag not yet passed through `settle()`) goes through the tensor operations, so
every result is the same tensor value as before; only the way to it is shorter.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.core.scalars import real_view

__all__ = [
    "TRUE",
    "FALSE",
    "known",
    "value",
    "settle",
    "decision",
    "both",
    "either",
    "negate",
    "add_if",
    "all_finite",
]

TRUE = torch.tensor(True)
FALSE = torch.tensor(False)


def known(flag: bool) -> Tensor:
    """A decision known in Python, as its shared constant."""
    return TRUE if flag else FALSE


def value(flag: Tensor) -> bool | None:
    """The Python value of a decision when it has one (eager), else `None` (vmap, compile)."""
    if flag is TRUE:
        return True
    if flag is FALSE:
        return False
    return tree.static_value(flag)


def settle(flag: Tensor) -> Tensor:
    """`flag` as its constant when its value can be read (eager: one host read of a CPU
    value), so that the decisions combined with it later cost no tensor operation."""
    known_value = value(flag)
    return flag if known_value is None else known(known_value)


def decision(flag: Tensor, device: torch.device) -> Tensor:
    """`aadl_func._src.tree.decision()` (a flag made ready to combine with the step's
    counters and gates), then `settle()`d."""
    return settle(tree.decision(flag, device))


def both(a: Tensor, b: Tensor) -> Tensor:
    """`a & b`."""
    if a is FALSE or b is FALSE:
        return FALSE
    if a is TRUE:
        return b
    if b is TRUE:
        return a
    return a & b


def either(a: Tensor, b: Tensor) -> Tensor:
    """`a | b`."""
    if a is TRUE or b is TRUE:
        return TRUE
    if a is FALSE:
        return b
    if b is FALSE:
        return a
    return a | b


def negate(a: Tensor) -> Tensor:
    """`~a`."""
    if a is TRUE:
        return FALSE
    if a is FALSE:
        return TRUE
    return ~a


def add_if(counter: Tensor, flag: Tensor) -> Tensor:
    """`counter + flag` (a 0-d int64 counter, a 0-d bool); with a known flag the counter
    itself when False (nothing to write back) and one addition when True."""
    known_value = value(flag)
    if known_value is not None:
        return counter + 1 if known_value else counter
    return counter + flag.long()


def all_finite(t: Tensor, device: torch.device | None = None) -> Tensor:
    """The decision "every element of `t` is finite" (no Inf, no NaN); with `device`,
    made ready to combine as `aadl_func._src.tree.decision()` makes it.

    Eager, for a CPU tensor: its smallest and largest elements, in one reduction, compared in
    Python (NaN, which `aminmax` propagates, fails both comparisons), a constant decision;
    `isfinite(t).all()` runs several kernels and costs a few times more. Otherwise (vmap,
    torch.compile, an accelerator) that tensor expression, which reads no value.
    """
    if t.numel() == 0:
        return TRUE
    if tree.readable(t):
        low, high = torch.aminmax(real_view(t))  # complex: over the real and imaginary parts
        return known(-math.inf < low.item() and high.item() < math.inf)
    flag = torch.isfinite(t).all()
    return flag if device is None else decision(flag, device)

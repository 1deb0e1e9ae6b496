"""The execution layer's answers to the math's questions (`aadl_func._src.core.ops.Ops`).

`OPS` reads a value wherever Python may read it now: a plain 0-d CPU tensor outside any
torch.func transform and outside `torch.compile`'s tracing (an eager step, whose counters
live on the CPU). There a choice whose outcome is known skips the work a mask would
discard, with the same bits (`torch.where` with an all-True mask returns its input), and
the constants of the small solve are made once per dtype and device. Under vmap and
torch.compile it answers as `aadl_func._src.core.ops.PLAIN` does, except that a traced
graph keeps the small factorisations on the factor's device (no device-to-host copy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from aadl_func._src import flags, tree

__all__ = ["OPS", "Known"]


class Known:
    """Answers that read values where they may (`OPS`, the executors' instance)."""

    def __init__(self) -> None:
        # (value, dtype, device) -> a (1,) constant, read only; never filled while tracing,
        # where constants are made in the graph.
        self._constants: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}

    def value(self, t: Tensor) -> bool | int | float | None:
        return tree.static_value(t)

    def all_finite(self, t: Tensor) -> Tensor:
        return flags.all_finite(t)

    def where(self, flag: Tensor, a: Tensor, b: Tensor | float) -> Tensor:
        if flag is flags.TRUE:
            return a
        return torch.where(flag, a, b)

    def values_known(self, *tensors: Tensor) -> bool:
        return tree.readable(*tensors)

    def small_device(self, device: torch.device) -> torch.device:
        return device if tree.tracing() else torch.device("cpu")

    def constant(self, value: float, like: Tensor) -> Tensor:
        if tree.tracing():
            return torch.full((1,), value, dtype=like.dtype, device=like.device)
        key = (value, like.dtype, like.device)
        made = self._constants.get(key)
        if made is None:
            made = self._constants[key] = torch.full(
                (1,), value, dtype=like.dtype, device=like.device
            )
        return made


OPS = Known()

"""The questions the math asks about its data, as an interface the execution layer answers.

The same algorithm runs eagerly on the CPU (where a 0-d tensor's value can be read, so work
whose result would be thrown away is skipped), under `torch.func.vmap` and `torch.compile`
(where nothing can be read and every choice is a mask), and sharded. The math does not ask
which: it asks `ops`, as optax's math calls `jnp.where` and leaves jit outside. `PLAIN`
answers without reading anything (every choice a mask), which is right everywhere; the
executors in `aadl_func._src.exec.ops` answer faster where they may read values, with the
same bits.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Ops", "PLAIN", "Plain"]


class Ops(Protocol):
    """The execution layer's answers to the math's data-dependent questions."""

    def value(self, t: Tensor) -> bool | int | float | None:
        """The Python value of the 0-d tensor `t` when it may be read now, else None."""
        ...

    def all_finite(self, t: Tensor) -> Tensor:
        """A 0-d bool: no element of `t` is Inf or NaN."""
        ...

    def where(self, flag: Tensor, a: Tensor, b: Tensor | float) -> Tensor:
        """`torch.where(flag, a, b)`; may return `a` itself when `flag` is known True."""
        ...

    def values_known(self, *tensors: Tensor) -> bool:
        """Whether Python may read every value of `tensors` now, at no more than a copy."""
        ...

    def small_device(self, device: torch.device) -> torch.device:
        """Where an `m x m` factorisation of a problem living on `device` runs."""
        ...

    def constant(self, value: float, like: Tensor) -> Tensor:
        """A `(1,)` tensor holding `value` in `like`'s dtype and device (read only)."""
        ...


class Plain:
    """Answers that read no value: every choice a mask, every constant made afresh, the
    small factorisations on the CPU (one LAPACK routine whatever the device)."""

    def value(self, t: Tensor) -> None:
        return None

    def all_finite(self, t: Tensor) -> Tensor:
        return torch.isfinite(t).all()

    def where(self, flag: Tensor, a: Tensor, b: Tensor | float) -> Tensor:
        return torch.where(flag, a, b)

    def values_known(self, *tensors: Tensor) -> bool:
        return False

    def small_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")

    def constant(self, value: float, like: Tensor) -> Tensor:
        return torch.full((1,), value, dtype=like.dtype, device=like.device)


PLAIN = Plain()

"""The types of [`aadl_func.Anderson`][aadl_func.Anderson]'s `init` and `update`, for annotations.

`anderson(...)` returns plain functions; these protocols describe their calls to a type
checker (`opt.update(state, params, grads)` returns params of the type passed in, and the
state), and let code that takes an accelerated optimizer as an argument say so:

    def train(init: aa.AndersonInit, update: aa.AndersonUpdate) -> None: ...

`inplace` changes what is written, not what is returned, so `update` needs no overloads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from torch import Tensor

from aadl_func._src.state import AndersonState

__all__ = ["AndersonInit", "AndersonUpdate"]

P = TypeVar("P")  # a pytree of tensors: the params (and grads) of one call


class AndersonInit(Protocol):
    """`init(params) -> AndersonState`: a fresh state for `params` (a pytree of tensors)."""

    def __call__(self, params: Any, /) -> AndersonState: ...


class AndersonUpdate(Protocol):
    """`update(state, params, grads, *, inplace=False, loss_fn=None, loss=None)`.

    Returns `(params, state)`: the new params, a pytree like `params` (dict in, dict
    out), and the new state. `state` and `params` are passed by position (see
    [`aadl_func.anderson()`][aadl_func.anderson] for the keywords).
    """

    def __call__(
        self,
        state: AndersonState,
        params: P,
        grads: P,
        /,
        *,
        inplace: bool = False,
        loss_fn: Callable[[P], Tensor] | None = None,
        loss: Tensor | float | None = None,
    ) -> tuple[P, AndersonState]: ...


# -- what an inner optimizer's `update` says about its in-place writes ----------------------
# The built-in inner optimizers set `update.writes_state` (aadl_func._src.inner): whether an
# in-place update writes state buffers (momentum, moments), not only the gradients. One
# attribute answers two questions, each with the default that is safe for an inner
# optimizer that does not say.


def keeps_buffers(inner: Any) -> bool:
    """Whether `inner`'s in-place update may write state buffers, so that an in-place step
    must ask for it out of place and commit the buffers with the plain step (atomic.py).
    An inner optimizer that does not say is assumed to."""
    return getattr(inner.update, "writes_state", True)


def adopts_buffers(inner: Any) -> bool:
    """Whether the new buffers of `inner`'s out-of-place update may be adopted into the
    caller's (fresh tensors of the same layout: only the built-ins, which say so)."""
    return getattr(inner.update, "writes_state", False)

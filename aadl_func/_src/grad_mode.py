"""Running code without autograd, with torch's grad mode put back however it ends.

`with torch.no_grad(): ...` alone is not enough in a library that promises to leave the
process as it found it: CPython (3.11) emits a line event for a `with` statement's line as
its block ends, *before* it calls `__exit__` and outside the block's exception handler, so
an exception raised there (by a signal's handler, a trace function) skips `__exit__`, and
grad mode would stay off for the rest of the process. A `finally` around the `with` runs
whatever happens inside it. (One fault at a time: an exception at the `finally`'s own line
finds `__exit__` already run.) Grad mode switched off directly, without a `with`, is put
back the same way: by an inner `finally`, with the outer one behind it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["kept"]

T = TypeVar("T")


def kept(
    run: Callable[[], T], context: Callable[[], contextlib.AbstractContextManager] | None = None
) -> T:
    """`run()` under `context()` (`torch.no_grad()` when None), grad mode restored to what it
    was before, whether `run` returns or raises, and wherever an exception arrives.

    Without a `context`, grad mode is switched off directly (`torch.no_grad()`'s own switch,
    without its context object: a small step notices the objects), except while dynamo
    traces, which follows `torch.no_grad()` as a context manager."""
    enabled = torch.is_grad_enabled()
    try:
        if context is not None or _is_compiling():
            with (torch.no_grad if context is None else context)():
                return run()
        try:
            _set_grad_enabled(False)
            return run()
        finally:
            _set_grad_enabled(enabled)
    finally:
        # Set again where it differs: the restore above was skipped (an exception raised at
        # its line event, or at the `with` statement's before its `__exit__`). One fault at a
        # time: an exception at this `finally`'s own line finds grad mode restored already.
        if torch.is_grad_enabled() != enabled:
            _set_grad_enabled(enabled)


_set_grad_enabled = torch._C._set_grad_enabled
_is_compiling = torch.compiler.is_compiling

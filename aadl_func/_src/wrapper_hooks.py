"""`AcceleratedOptimizer.step`'s `torch.optim.Optimizer` bookkeeping: its step hooks and its
profiler label.

`torch.optim.Optimizer` wraps every subclass's `step` (`Optimizer.profile_hook_step`): the
step pre-hooks (global, then the optimizer's; one may replace the arguments), the step, the
profiler's Python-tracer entry point `_optimizer_step_code()` and the post-hooks (the
optimizer's, then global), all inside `record_function("Optimizer.step#<class>.step")`. The
wrapper keeps all of it but opens that `record_function` only while a profiler records
(or under torch.compile, which traces it as torch's): with none, it labels nothing and costs
about 6 us, a few percent of a small model's accelerated step.

The wrapped optimizer's own step, the wrapper's plain step, runs the same way where it is
torch's wrapper around its class's `step` (`PlainStep`), in two calls: the pre-hooks and the
class's step, whose call is the last line of the package's code before the torch optimizer
writes (the wrapper's recovery needs no package line between that write and the statement
that records it), then, once the wrapper has recorded the step, `_optimizer_step_code()` and
the post-hooks (`PlainStep.finish()`). While a profiler records, under torch.compile, or
where the step is not torch's wrapper (a `step` patched on the instance: a user's, an LR
scheduler's) it is called whole, as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.optim import optimizer as torch_optimizer

__all__ = ["PlainStep", "hooked_step"]

_profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled
# The code of the wrapper `Optimizer.profile_hook_step` puts around a class's `step` (one code
# object for every wrapper it makes): how `PlainStep` knows a step as torch's.
_TORCH_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def hooked_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step` with `torch.optim.Optimizer.profile_hook_step`'s hooks and, while a profiler
    records, its label; marked `hooked`, so that `Optimizer._patch_step_function()` leaves
    it as it is."""

    @functools.wraps(step)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        # (`args` with the optimizer first, as torch passes them to the hooks)
        if torch.compiler.is_compiling() or _profiling():
            with record_function(f"Optimizer.step#{type(args[0]).__name__}.step"):
                return _with_hooks(step, args, kwargs)
        return _with_hooks(step, args, kwargs)

    hooked.hooked = True  # type: ignore[attr-defined]
    return hooked


class PlainStep:
    """`optimizer.step`, called in two parts where it is torch's wrapper around the class's
    `step`: `plain(*args)` runs the step pre-hooks and the class's step and returns
    what it returns; `plain.finish()` then runs what torch's wrapper runs after the step
    (`_optimizer_step_code()`, the post-hooks, with the arguments the pre-hooks left), and
    must follow each call. Called whole (`finish()` then does nothing) while a profiler
    records, under torch.compile, or where `optimizer.step` is not torch's wrapper."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.whole = optimizer.step
        function = getattr(self.whole, "__func__", None)
        ours = getattr(self.whole, "__self__", None) is optimizer
        torchs = getattr(function, "__code__", None) is _TORCH_WRAPPER
        # (the class's own `step`, which torch's wrapper calls; None: always called whole)
        self.inner = function.__wrapped__ if ours and torchs else None
        self.optimizer = optimizer
        self.pending: tuple[tuple, dict] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.inner is None or torch.compiler.is_compiling() or _profiling():
            self.pending = None
            return self.whole(*args)
        args, kwargs = _pre_hooks(self.inner, (self.optimizer, *args), {})
        self.pending = args, kwargs
        return self.inner(*args, **kwargs)  # the last line before the torch optimizer writes

    def finish(self) -> None:
        if self.pending is not None:
            (args, kwargs), self.pending = self.pending, None
            _post_hooks(self.optimizer, args, kwargs)


def _with_hooks(step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`profile_hook_step`'s body: the hooks around `step(*args, **kwargs)`, `args[0]` the
    optimizer."""
    self = args[0]  # (torch's: the optimizer before a pre-hook replaces the arguments)
    args, kwargs = _pre_hooks(step, args, kwargs)
    out = step(*args, **kwargs)
    _post_hooks(self, args, kwargs)
    return out


def _pre_hooks(step: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The step pre-hooks (global, then the optimizer's `args[0]`), each of which may replace
    `(args, kwargs)`; returns the arguments they leave."""
    self = args[0]
    for pre_hook in chain(
        torch_optimizer._global_optimizer_pre_hooks.values(),
        self._optimizer_step_pre_hooks.values(),
    ):
        result = pre_hook(self, args, kwargs)
        if result is not None:
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
            else:
                raise RuntimeError(
                    f"{step} must return None or a tuple of (new_args, new_kwargs), but got "
                    f"{result}."
                )
    return args, kwargs


def _post_hooks(self: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """What torch's wrapper runs after the step: the profiler's entry point, then the post-hooks
    (the optimizer's, then global)."""
    self._optimizer_step_code()
    for post_hook in chain(
        self._optimizer_step_post_hooks.values(),
        torch_optimizer._global_optimizer_post_hooks.values(),
    ):
        post_hook(self, args, kwargs)

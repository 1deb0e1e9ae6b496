"""`AcceleratedOptimizer.step`'s `torch.optim.Optimizer` bookkeeping: its step hooks and its
profiler label.

`torch.optim.Optimizer` wraps every subclass's `step` (`Optimizer.profile_hook_step`): the
step pre-hooks (global, then the optimizer's; one may replace the arguments), the step, the
profiler's Python-tracer entry point `_optimizer_step_code()` and the post-hooks (the
optimizer's, then global), all inside `record_function("Optimizer.step#<class>.step")`. The
wrapper keeps all of it but opens that `record_function` only while a profiler records
(or under torch.compile, which traces it as torch's): with none, it labels nothing and costs
about 6 us, a few percent of a small model's accelerated step. The wrapped optimizer's own
`step` keeps torch's wrapper, label and hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.optim import optimizer as torch_optimizer

__all__ = ["hooked_step"]

_profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled


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


def _with_hooks(step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`profile_hook_step`'s body: the hooks around `step(*args, **kwargs)`, `args[0]` the
    optimizer."""
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
    out = step(*args, **kwargs)
    self._optimizer_step_code()
    for post_hook in chain(
        self._optimizer_step_post_hooks.values(),
        torch_optimizer._global_optimizer_post_hooks.values(),
    ):
        post_hook(self, args, kwargs)
    return out

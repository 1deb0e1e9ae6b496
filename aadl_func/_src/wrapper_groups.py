"""The param groups of `AcceleratedOptimizer` around the wrapped optimizer's step: the inner
map every group's window sees (`TakenStep`), the marks a call of the core moves, and the
torch step that leaves out the groups whose mix the deferred safeguard rejects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from aadl_func._src import flags
from aadl_func._src.state import AndersonState

__all__ = ["TakenStep", "marks", "torch_step_unless_rejected"]

# A dtype in which the difference of two values of the key dtype is exact (up to exponent gaps
# of 2^13 for half precision, 2^29 for float32): the displacement loses nothing.
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


class TakenStep:
    """Inner optimizer whose step has already been taken by a `torch.optim` optimizer.

    `update(stepped, state, params)` returns `stepped - params`: the "gradient" argument
    carries the params after the torch optimizer's step. The displacement is returned in a
    wider dtype (float32 for half precision, float64 for float32), where it is exact, so the
    core's in-place plain step `params.add_(stepped - params)` (rounded once to the params'
    dtype) reproduces the torch optimizer's params bit for bit; float64 params get a float64
    displacement (exact whenever `stepped / 2 <= params <= 2 stepped`, by Sterbenz's lemma).
    """

    def init(self, params: Any) -> tuple:
        return ()

    def update(
        self, updates: Any, state: tuple, params: Any = None, inplace: bool = False
    ) -> tuple[Any, tuple]:
        if params is None:
            raise ValueError("the wrapped torch optimizer's step needs the params it started from")

        def displacement(stepped: Tensor, start: Tensor) -> Tensor:
            # A copy even in the params' own dtype (float64): the stepped tensors are the
            # model's params, which must hold the torch optimizer's step until the core's
            # outcome is written (an exception before that leaves them there).
            wide = stepped.to(_WIDER.get(stepped.dtype, stepped.dtype), copy=True)
            return wide.sub_(start)

        return optree.tree_map(displacement, updates, params), state


def marks(window: AndersonState) -> tuple[int, int]:
    """What a call of the core moves when it records an outcome: `count` (a step) or
    `num_rejected` (a reverted mix, which is not counted in `count`)."""
    return int(window.count), int(window.num_rejected)


def torch_step_unless_rejected(
    torch_step: Callable[[], Any],
    param_groups: list[dict[str, Any]],
    torch_state: Any,
    verdicts: list[Tensor],
) -> Any:
    """`torch_step()`, the wrapped optimizer's step, for every group but those whose pending
    mix the deferred safeguard rejects (`verdicts`, one per group): their params go back to
    the previous plain step (in the core), so the torch optimizer must not step them from the
    rejected point.

    Eagerly their grads are hidden (`None`: torch.optim skips such params, state and all) and
    put back after. Compiled, where the verdicts have no value, the torch optimizer steps
    every group and a rejected group's tensor state (`torch_state`, the optimizer's `state`)
    is blended back."""
    known = [flags.value(verdict) for verdict in verdicts]
    if all(value is False for value in known):
        return torch_step()
    if any(value is None for value in known):
        # No try block here: dynamo cannot resume in one after torch.optim's own break.
        kept = [
            entry
            for group, verdict in zip(param_groups, verdicts)
            for entry in _torch_state(torch_state, group["params"], verdict)
        ]
        returned = torch_step()
        for tensor, before, verdict in kept:
            tensor.copy_(torch.where(verdict.to(tensor.device), before, tensor))
        return returned
    hidden = [
        (p, p.grad) for group, value in zip(param_groups, known) if value for p in group["params"]
    ]
    try:
        for p, _ in hidden:
            p.grad = None
        return torch_step()
    finally:
        for p, grad in hidden:
            p.grad = grad


def _torch_state(
    state: Any, params: list[Tensor], verdict: Tensor
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """`(tensor, copy, verdict)` for the wrapped optimizer's state tensors of `params`
    (momentum, moments, step counts): what a compiled step blends back where `verdict`
    rejects. Params without state have never been stepped, so no mix of theirs is pending."""
    return [
        (value, value.clone(), verdict)
        for p in params
        for value in state.get(p, {}).values()
        if isinstance(value, Tensor)
    ]

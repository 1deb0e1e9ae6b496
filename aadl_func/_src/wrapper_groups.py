"""The param groups of `AcceleratedOptimizer` around the wrapped optimizer's step: the inner
map every group's window sees (`StepInParams` on the stepped params themselves, or
`TakenStep` from a copy taken before the step; `in_params_route()` chooses), the marks a call
of the core moves, and the torch step that leaves out the groups whose mix the deferred
safeguard rejects."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor
from torch.nn import Parameter

from aadl_func._src import distributed, flags
from aadl_func._src.checks import check_update_inputs
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState

__all__ = [
    "StepInParams",
    "TakenStep",
    "check_windows_fit",
    "hide_rejected_grads",
    "in_params_route",
    "marks",
    "negative_zeros",
    "put_back_grads",
    "torch_step_unless_rejected",
]

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
        if type(updates) is list and type(params) is list and len(updates) == len(params):
            return displacements(updates, params), state  # the wrapper's call: lists
        return optree.tree_map(lambda s, a: displacements([s], [a])[0], updates, params), state


def _update_leaves(
    stepped: list[Tensor], state: tuple, start: list[Tensor], spec: Any
) -> tuple[list[Tensor], tuple]:
    """`TakenStep.update` on leaves the caller checked (anderson's steady call, which looks
    it up on `update` as on a built-in's): the same values, without the pytree walk."""
    return displacements(stepped, start), state


TakenStep.update.update_leaves = _update_leaves  # type: ignore[attr-defined]


def displacements(stepped: list[Tensor], start: list[Tensor]) -> list[Tensor]:
    """`stepped - start` leaf by leaf, each in the wider dtype of `TakenStep` (exact there).

    A copy even in the params' own dtype (float64): the stepped tensors are the model's
    params, which must hold the torch optimizer's step until the core's outcome is written
    (an exception before that leaves them there). Several plain tensors subtract in one
    foreach call, which on every device runs each pair's subtraction (one IEEE rounding of
    the same operands: the same bits as `sub_`); DTensors go one by one."""
    wide = [s.to(_WIDER[s.dtype]) if s.dtype in _WIDER else s.clone() for s in stepped]
    if len(wide) > 1 and all(type(t) is Tensor for t in (*wide, *start)):
        torch._foreach_sub_(wide, start)
    else:
        for w, a in zip(wide, start):
            w.sub_(a)
    return wide


class StepInParams:
    """Inner optimizer for a torch step already written into the params the core gets: its
    update is its `updates` argument, which the caller passes as `-0`
    (`negative_zeros()`).

    Mode "aadl"'s window holds only the plain iterates `y`, so the core needs neither the
    params before the torch step nor the displacement: given the stepped params as `x` and
    `u = -0`, its plain step `y = x + u` is `x` bit for bit (`x + (-0) = x` for every float
    `x`, `+0` and `-0` included; a NaN stays a NaN), and every outcome it writes (the mix, a
    rejected mix's previous plain step, a recovery) lands in the params directly.
    """

    def init(self, params: Any) -> tuple:
        return ()

    def update(
        self, updates: Any, state: tuple, params: Any = None, inplace: bool = False
    ) -> tuple[Any, tuple]:
        return updates, state


def _given_leaves(
    updates: list[Tensor], state: tuple, params: list[Tensor], spec: Any
) -> tuple[list[Tensor], tuple]:
    """`StepInParams.update` on leaves (the steady call's route)."""
    return updates, state


StepInParams.update.update_leaves = _given_leaves  # type: ignore[attr-defined]
# Its caller's promise to the steady call (`exec.plan.Plan.plain_in_params`): the grads are
# `negative_zeros()` of the params, which hold the plain step already.
StepInParams.update.plain_in_params = True  # type: ignore[attr-defined]


def negative_zeros(params: list[Tensor]) -> list[Tensor]:
    """`-0` in the shape, dtype and device of each of `params`: one element, expanded (no
    param-sized memory; the core only reads its updates). The same views for the same
    layout of params (a group's, step after step)."""
    # (CPU params: no device object made; a step notices them.)
    layout = tuple((p.shape, p.dtype, None if p.is_cpu else p.device) for p in params)
    return list(_negative_zeros(layout))


@functools.lru_cache(maxsize=64)
def _negative_zeros(layout: tuple[tuple[torch.Size, torch.dtype, Any], ...]) -> tuple:
    """`negative_zeros()` for params of `layout` (shape, dtype, device: None for the CPU),
    as views of one 0-d `-0` per dtype and device: not inference tensors, whatever mode the
    first step runs in (only ever read)."""
    with torch.inference_mode(False):
        zeros = {(d, v): torch.full((), -0.0, dtype=d, device=v or "cpu") for _, d, v in layout}
        return tuple(zeros[d, v].expand(shape) for shape, d, v in layout)


def in_params_route(config: AndersonOptions | None, no_loss_fn: bool) -> Callable[[list], bool]:
    """Which param groups of a step run the core on their params themselves
    (`StepInParams`, no copy of them kept before the torch step): none unless `config` (the
    wrapper's options with that inner, made in mode "aadl" only) is given, the step runs
    eagerly and without the `loss_fn` safeguard (`no_loss_fn`: its closure is evaluated at
    candidates written into the params the core works on); then those of plain tensors
    (`nn.Parameter`s included; DTensors go the copied way)."""
    if config is None or not no_loss_fn or torch.compiler.is_compiling():
        return _never
    return _plain_tensors


def _never(params: list[Tensor]) -> bool:
    return False


def _plain_tensors(params: list[Tensor]) -> bool:
    return all(type(p) is Parameter or type(p) is Tensor for p in params)


_STRIDED = torch.strided


def check_windows_fit(
    config: AndersonOptions,
    param_groups: list[dict[str, Any]],
    windows: list[AndersonState | None],
) -> None:
    """Raises if a group's params no longer fit the window the core made for them: another
    number of params, or a param of another shape, dtype, device or layout (after
    `model.double()`, `model.to(device)`, a param replaced by a new tensor). Called before
    the torch step, so that nothing is written: the core would raise the same, but only
    after the torch optimizer had stepped the params and its buffers.

    The common case is one comparison per param with the window's anchor, which keeps the
    params' shapes, dtypes and (without `history_device`) devices; only a group that differs
    goes through the core's own check (`check_update_inputs`), whose error is raised with
    what to do about it."""
    check_device = config.history_device is None  # else the window is there, wherever they are
    for index, (group, window) in enumerate(zip(param_groups, windows)):
        params = group["params"]
        if window is None or not params:
            continue
        anchor = window.anchor
        for p, a in zip(params, anchor):
            if (
                p.shape != a.shape
                or p.dtype != a.dtype
                or p.layout is not _STRIDED
                # (two CPU tensors: the same device, without making the device objects)
                or (check_device and not (p.is_cpu and a.is_cpu) and p.device != a.device)
            ):
                break
        else:
            if len(params) == len(anchor):
                continue
        _check_group(config, index, params, window)


def _check_group(
    config: AndersonOptions, index: int, params: list[Tensor], window: AndersonState
) -> None:
    """The core's check of param group `index` against its window, as `update` would make it
    (sharded params: their local shards, which the core checks itself)."""
    if any(distributed.is_dtensor(p) for p in params):
        return
    values = [p.detach() for p in params]
    try:
        check_update_inputs(config, window, values, values, None, False)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"AcceleratedOptimizer.step: the params of param group {index} changed since its "
            f"window was made ({error}); nothing was stepped. Params converted in place "
            "(model.double(), model.to(device)): start the windows afresh, keeping the torch "
            "optimizer's state, with `sd = optimizer.state_dict(); del sd['anderson']; "
            "optimizer.load_state_dict(sd)`; params replaced by new ones: make the optimizer "
            "anew for them"
        ) from None


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

    The compiled step's: where the verdicts have no value, the torch optimizer steps every
    group and a rejected group's tensor state (`torch_state`, the optimizer's `state`) is
    blended back; where they have one, their grads are hidden (`hide_rejected_grads()`). The
    eager step hides and puts back the grads itself, around its record of the step."""
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
    hidden: list[tuple[Tensor, Tensor | None]] = []
    try:
        hide_rejected_grads(param_groups, verdicts, hidden)
        return torch_step()
    finally:
        put_back_grads(hidden)


def hide_rejected_grads(
    param_groups: list[dict[str, Any]],
    verdicts: list[Tensor],
    hidden: list[tuple[Tensor, Tensor | None]],
) -> None:
    """Hides from the torch optimizer the grads of the groups whose pending mix the deferred
    safeguard rejects (`verdicts` with values, one per group): `p.grad = None`, which
    torch.optim skips, state and all. Each `(p, grad)` is appended to `hidden` before its
    grad is hidden, so that `put_back_grads(hidden)` restores them however far this got."""
    for group, verdict in zip(param_groups, verdicts):
        if flags.value(verdict):
            for p in group["params"]:
                hidden.append((p, p.grad))
                p.grad = None


def put_back_grads(hidden: list[tuple[Tensor, Tensor | None]]) -> None:
    """The grads `hide_rejected_grads()` hid, back in their params (again: the same)."""
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

"""What `AcceleratedOptimizer.step` asks of the user's loss: the safeguard's option, the
`loss=` argument, and the closure as the step calls it (checked, interruptible, evaluated
once ahead, or with a group's params set to a candidate)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from aadl_func._src.acceptance import ACCEPTANCES
from aadl_func._src.atomic import InterruptGuard

__all__ = [
    "SAFEGUARDS",
    "check_is_a_loss",
    "check_loss_argument",
    "check_no_sufficient_decrease",
    "check_served_rules",
    "check_safeguard",
    "closure_loss",
    "interruptible",
    "returning",
    "returns_a_loss",
]

# The wrapper's safeguards: the closure evaluated at each mix (the core's `loss_fn`), or the
# loss of the next step judging the previous mix (the core's `loss=`).
SAFEGUARDS = ("loss_fn", "deferred")


def check_safeguard(owner: str, safeguard: Any, store_each_nth: Any) -> None:
    """`safeguard` is one of the wrapper's; the deferred one reads the previous plain step
    from the window, so it needs every step stored."""
    if not isinstance(safeguard, str) or safeguard not in SAFEGUARDS:
        raise ValueError(
            f"{owner}: `safeguard` must be 'loss_fn' (a closure safeguards each mix) or "
            f"'deferred' (the next step's loss judges the mix), got {safeguard!r}"
        )
    if safeguard == "deferred" and store_each_nth != 1:
        raise ValueError(
            f"{owner}: safeguard='deferred' needs store_each_nth=1 (got {store_each_nth!r}): "
            "a rejected mix goes back to the previous plain step, read from the window"
        )


def check_served_rules(owner: str, options: dict[str, Any]) -> None:
    """Refuses an acceptance rule that the torch.optim faces cannot serve
    (`Acceptance.torch_optim_refusal`; the line search: a closure writes its candidates into
    the module's parameters, through which no forward-mode derivative flows), by its option
    in `options` (the values given, before they are checked)."""
    for name, rule in ACCEPTANCES.items():
        if rule.torch_optim_refusal is not None and options[name] is True:
            raise ValueError(
                f"{owner}: `{name}=True` is available in the functional API only "
                + rule.torch_optim_refusal
            )


def check_no_sufficient_decrease(owner: str, sufficient_decrease: object) -> None:
    """`sufficient_decrease` reads the gradient with the inner update; the torch.optim faces
    hand the core the params the torch optimizer stepped to, not the gradients."""
    if sufficient_decrease not in (0, 0.0):
        raise ValueError(
            f"{owner}: `sufficient_decrease` is available in the functional API only "
            "(aa.anderson(..., sufficient_decrease=c) with update(..., loss=value)): the "
            "wrapped optimizer's step reaches the core as the params it stepped to, not as "
            f"the gradients the condition reads; got {sufficient_decrease!r}"
        )


def check_loss_argument(
    safeguard: str, closure: Callable[[], Any] | None, loss: Tensor | float | None
) -> Tensor | float | None:
    """`step`'s `loss` checked against the safeguard and `closure`, before anything runs."""
    owner = "AcceleratedOptimizer.step"
    if safeguard != "deferred":
        if loss is not None:
            raise ValueError(
                f"{owner}: `loss` is the deferred safeguard's; make the optimizer with "
                "safeguard='deferred' to pass it"
            )
        return None
    if closure is not None and loss is not None:
        raise ValueError(f"{owner}: pass `closure` or `loss`, not both")
    if closure is None and loss is None:
        raise TypeError(
            f"{owner}: safeguard='deferred' judges the previous mix by the loss at the "
            "params: call step(closure) or step(loss=value)"
        )
    if loss is not None:
        check_is_a_loss(loss, "`loss` must be")
    return loss


def check_is_a_loss(loss: Any, what: str) -> Any:
    """`loss` if it is a loss (a real tensor of one element or a real number), else a
    TypeError that says `what` should have been."""
    if isinstance(loss, Tensor) and loss.numel() == 1 and not loss.is_complex():
        if loss.dtype != torch.bool:
            return loss
    elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return loss
    raise TypeError(
        f"AcceleratedOptimizer.step: {what} a real tensor of one element or a real number, "
        f"got {type(loss).__name__}"
        + (f" of shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, Tensor) else "")
    )


def returns_a_loss(closure: Callable[[], Any]) -> Callable[[], Any]:
    """`closure`, checked to return a loss: the safeguard compares two of them."""

    def checked() -> Any:
        return check_is_a_loss(closure(), "`closure` must return the loss:")

    return checked


def returning(loss: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """The closure whose first call returns `loss`, evaluated already (grads in place)."""
    calls = 0

    def once_evaluated() -> Any:
        nonlocal calls
        calls += 1
        return loss if calls == 1 else closure()

    return once_evaluated


def interruptible(closure: Callable[[], Any], guard: InterruptGuard) -> Callable[[], Any]:
    """`closure` run as the user's code: Ctrl-C acts at once inside it (see
    `aadl_func._src.atomic.InterruptGuard.callbacks()`).

    Traced (the wrapped optimizer's step compiled on its own, its closure call with it), the
    signal handlers stay as they are, which dynamo cannot trace: Ctrl-C in the closure is
    then deferred to the end of the step, as elsewhere in it."""

    def run() -> Any:
        if torch.compiler.is_compiling():
            return closure()
        with guard.callbacks():
            return closure()

    return run


def closure_loss(
    params: list[Tensor], closure: Callable[[], Any]
) -> Callable[[list[Tensor]], Tensor]:
    """`loss_fn` for the safeguard: the closure's loss with `params` set to a candidate."""

    def loss_fn(candidate: list[Tensor]) -> Tensor:
        with torch.no_grad():
            for p, value in zip(params, candidate):
                p.copy_(value)
        with torch.enable_grad():
            loss = closure()
        if isinstance(loss, Tensor):
            return loss.detach().reshape(())
        return torch.tensor(float(loss), dtype=torch.float64)

    return loss_fn

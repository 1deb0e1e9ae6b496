"""What a problem of the suite is: a :class:`Spec` (how to build one seed's instance, its dtype,
its kind of target) and the helper that turns a loss into a full-batch ``Problem``.

A *loss* problem is judged by the relative suboptimality of the training loss,
$(f - f^*)/|f^*|$, with $f^*$ from a long float64 run (``f_star.json``); where the minimum is
$0$ and known (Rosenbrock), the denominator is $f$ at the standard start instead. A *PINN* is
judged by the relative $L^2$ error of its solution against the exact one, the tracked metric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from _compare import Problem
from torch import Tensor
from torch.func import grad_and_value


@dataclass(frozen=True)
class Spec:
    """One problem of the suite. ``make(seed, dtype)``: the instance whose initial weights come
    from ``seed``. ``gd_lrs``: the plain gradient descent grid (its stable range depends on the
    problem's scale, unlike Adam's). ``pinn``: judged by the tracked relative $L^2$ error.
    ``zero_minimum``: $f^* = 0$ is known; the relative suboptimality divides by
    ``scale`` ($f$ at the standard start) instead of $|f^*|$."""

    key: str
    title: str
    make: Callable[[int, torch.dtype], Problem]
    gd_lrs: tuple[float, ...]
    dtype: torch.dtype = torch.float32
    pinn: bool = False
    zero_minimum: bool = False
    scale: float | None = None


def half_square_norm(params: dict[str, Tensor]) -> Tensor:
    r"""$\tfrac12 \lVert \theta \rVert^2$ over every leaf: the L2 term that gives the
    over-parametrised problems a minimum $f^* > 0$ to measure suboptimality against."""
    return sum(0.5 * (p**2).sum() for p in params.values())


def full_batch(
    initial: dict[str, Tensor],
    train_loss: Callable[[dict[str, Tensor]], Tensor],
    track: Callable[[dict[str, Tensor]], float] | None = None,
) -> Problem:
    """The ``Problem`` of a deterministic loss: its gradient by ``torch.func.grad_and_value``,
    its forward-only value without a graph, seconds as the process's CPU time."""

    def forward_loss(params: dict[str, Tensor]) -> Tensor:
        with torch.no_grad():
            return train_loss(params)

    return Problem(
        initial={k: v.detach().clone() for k, v in initial.items()},
        loss_and_grad=grad_and_value(train_loss),
        loss=forward_loss,
        evaluate=lambda params: {},
        forward_cost=1.0,
        track=track,
    )

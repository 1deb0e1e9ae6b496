r"""`line_search=True`: the backtracking search along the mix, on an eager call.

With the plain step $y$, the mix $x$ and $d = x - y$, the call returns $y + s\,d$ for the
step length $s$ that `aadl_func._src.core.linesearch.armijo()` finds on
$\phi(s) = \ell(y + s d)$, $\ell$ = `loss_fn`, with $\phi'(0) = \nabla\ell(y)^\top d$
from one forward-mode derivative. A direction that does not descend, or a search that finds
no step length, keeps $y$, and the window restarts (`aadl_func._src.stages.restarted()`).
The search is a Python loop on loss values: eager calls only (`check_call()`).

`aadl_func._src.acceptance.ACCEPTANCES` registers these functions as the acceptance rule that
`anderson(..., line_search=True)` chooses.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from aadl_func._src import flags, tree
from aadl_func._src.core import linesearch
from aadl_func._src.exec.inplace import callbacks
from aadl_func._src.update_call import Call
from aadl_func._src.validation import scalar_loss

__all__ = ["TORCH_OPTIM_REFUSAL", "check_call", "search"]

OWNER = "anderson.update"
# Why the torch.optim faces refuse the search (the end of their message).
TORCH_OPTIM_REFUSAL = (
    "(aa.anderson(..., line_search=True) with update(..., loss_fn=...)): a closure writes the "
    "candidate into the module's parameters, through which no forward-mode derivative flows"
)


def check_call(loss_fn: Any, shards: Any, transformed: bool) -> None:
    """Refuses a call the search cannot serve, before anything is computed or written."""
    if loss_fn is None:
        raise ValueError(
            f"{OWNER}: `line_search=True` needs `loss_fn` (the loss searched along the mix)"
        )
    if transformed:
        raise ValueError(
            f"{OWNER}: `line_search=True` needs an eager call; its search is a Python loop on "
            "loss values, which vmap and torch.compile cannot run. Use the `loss_fn` "
            "safeguard (line_search=False) there"
        )
    if shards is not None:
        raise ValueError(f"{OWNER}: `line_search=True` is not available with sharded params")


def search(
    call: Call, mixable: Tensor, x: list[Tensor], x_hist: list[Tensor], y: list[Tensor]
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Step 4 with `line_search`: `(use_mix, x, x_hist)`, the point returned where
    `use_mix` holds (params' dtype) and its value for the window (mode "aadl" moves the
    newest entry to it); `x` and `x_hist` themselves when the full step qualifies."""
    known = flags.value(mixable)
    if known is None:  # check_call refused transformed calls
        raise RuntimeError(f"{OWNER}: the line search needs an eager call")
    if not known:
        return flags.FALSE, x, x_hist
    direction = [xi - yi for xi, yi in zip(x, y)]

    def loss_at(*leaves: Tensor) -> Tensor:
        value = call.loss_fn(tree.unflatten(call.spec, list(leaves)))
        return scalar_loss(OWNER, value).reshape(())

    def phi(s: float) -> float:
        value = float(loss_at(*linesearch.along(y, x, s)))
        return value if math.isfinite(value) else math.inf

    with callbacks(call):
        with warnings.catch_warnings():
            # torch's first forward-mode derivative in a process scripts its decompositions
            # with the deprecated torch.jit.script, and says so; nothing a user can act on.
            warnings.filterwarnings(
                "ignore", "`torch.jit.script` is deprecated", DeprecationWarning
            )
            phi0, derphi0 = (float(v) for v in torch.func.jvp(loss_at, tuple(y), tuple(direction)))
        s = None
        if math.isfinite(phi0) and linesearch.is_descent(derphi0):
            s = linesearch.armijo(phi, phi0, derphi0)
    if s is None:
        return flags.FALSE, x, x_hist
    if s == 1.0:
        return flags.TRUE, x, x_hist
    point = linesearch.along(y, x, s)
    return flags.TRUE, point, point

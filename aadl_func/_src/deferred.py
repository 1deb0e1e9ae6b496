r"""The deferred safeguard: a mix judged by the loss the next call brings.

The `loss_fn` safeguard (`aadl_func._src.acceptance.SAFEGUARD`) judges a mix before it is
returned, at the price of two forward passes per mixing call. A training loop computes the
loss at its params anyway, with the gradient it passes to `update`; the deferred safeguard
uses that value instead, one call later. With `update(state, x_k, grads_k, loss=L(x_k))`:

* call $k$ returns the mix $x_{k+1}$ and records
  $\ell_k = L(x_k)$, the loss at the point it was made from
  (`AndersonState.pending_loss`; +inf when the call returned no mix);
* call $k+1$ brings $L(x_{k+1})$. If $L(x_{k+1}) < \ell_k$ the mix is
  kept and the call proceeds as usual. Otherwise (a NaN or an infinite loss included) the
  mix is **rejected**: the call returns the plain step $y_k = g(x_k)$ of call
  $k$, read back from the window, and changes nothing else but `num_rejected` and,
  with `restart_on_reject`, the window's size (it keeps its newest entry). Its gradient,
  taken at the rejected mix, is not used, and neither is the inner optimizer: its state
  stays the one of $y_k$. Like a skipped call it is not counted in `count` (which
  the inner optimizers' step counts and the call-count gates follow).

A rejection therefore costs one gradient evaluation (the one at the rejected point) and a
kept mix costs nothing: no forward pass is added. The window must hold $y_k$, so the
option needs `store_each_nth = 1`. The rejected call's outcome is
`aadl_func._src.stages.revert()`; a `history_dtype` below the params' dtype rounds
$y_k$'s update in mode "classic" ($y_k = x_k + f_k$ from the stored residual).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aadl_func._src import flags, tree
from aadl_func._src.checks import OWNER
from aadl_func._src.core import accept
from aadl_func._src.state import AndersonState

if TYPE_CHECKING:  # an annotation only: options -> modes -> the steps -> stages -> here
    from aadl_func._src.options import AndersonOptions

__all__ = [
    "INF",
    "bar",
    "check_loss",
    "cleared",
    "empty",
    "pending_after",
    "reads_grads",
    "rejects",
]

INF = accept.INF


def empty() -> Tensor:
    """A `pending_loss` with nothing to judge (a fresh state's)."""
    return torch.full((), INF, dtype=torch.float64)


def check_loss(options: AndersonOptions, loss: Any, loss_fn: Any) -> Tensor:
    """`loss` as a 0-d tensor, or a clear error (before anything is computed or written)."""
    if loss_fn is not None:
        raise ValueError(
            f"{OWNER}: pass `loss` (the deferred safeguard) or `loss_fn` (the immediate one), "
            "not both"
        )
    if options.store_each_nth != 1:
        raise ValueError(
            f"{OWNER}: `loss` needs store_each_nth=1 (got {options.store_each_nth}): a "
            "rejected mix goes back to the previous call's plain step, which is read from "
            "the window"
        )
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor(float(loss), dtype=torch.float64)
    if not isinstance(loss, Tensor) or loss.numel() != 1 or loss.dtype == torch.bool:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(
            f"{OWNER}: `loss` must be the training loss at `params`, a scalar tensor or "
            f"number, got {got}"
        )
    if loss.is_complex():
        raise TypeError(f"{OWNER}: `loss` must be real, got {loss.dtype}")
    return loss.detach().reshape(())


def rejects(state: AndersonState, loss: Tensor | None) -> Tensor:
    """The decision "the pending mix is rejected": a mix is pending (`pending_loss` is
    finite) and `loss` is not below it; a known False without `loss`. (Sharded params:
    `update` has made `loss` identical on every rank, so every rank decides alike.)"""
    if loss is None:
        return flags.FALSE
    pending = state.pending_loss
    if tree.static_value(pending) == INF:
        return flags.FALSE  # eager, nothing pending: no read of the loss
    verdict = accept.rejects_pending(pending, as_pending(loss, pending))
    return flags.decision(verdict, pending.device)


def as_pending(loss: Tensor, pending: Tensor) -> Tensor:
    """`loss` in `pending_loss`'s dtype and device."""
    return loss.to(device=pending.device, dtype=torch.float64)


def cleared(state: AndersonState) -> Tensor:
    """`pending_loss` when the call returns no mix: the state's own tensor if it already
    says so (eager: nothing to write back), else +inf."""
    if tree.static_value(state.pending_loss) == INF:
        return state.pending_loss
    return torch.full_like(state.pending_loss, INF)


def reads_grads(options: Any, loss: Tensor | None) -> bool:
    """Whether `bar()` reads the call's grads after its inner update (which must then be
    computed out of place: in place it may overwrite them)."""
    return loss is not None and options.sufficient_decrease != 0.0


def bar(options: Any, loss: Tensor | None, grads: list[Tensor], updates: list[Tensor]) -> Any:
    r"""The value the mix returned by this call will be judged against: the call's `loss`,
    or with `sufficient_decrease` $c$ the bar $\ell(x_k) + c \langle g, u \rangle$
    (`aadl_func._src.core.accept.sufficient_bar()`; $g$ the grads, $u$ the inner
    update, their inner product summed in float64 over the leaves)."""
    if not reads_grads(options, loss):
        return loss
    slope = sum((g.to(torch.float64) * u.to(torch.float64)).sum() for g, u in zip(grads, updates))
    value = torch.as_tensor(loss, dtype=torch.float64, device=slope.device)
    return accept.sufficient_bar(value, slope, options.sufficient_decrease)


def pending_after(call: Any, use_mix: Tensor, nothing: Tensor) -> Tensor:
    """`pending_loss` after a call that returns the mix where `use_mix` holds: the call's
    `loss` there (a finite one; a mix made from a point of non-finite loss is not judged),
    else `nothing`, the plain step's (`cleared()`, so that it is read once a call)."""
    if call.loss is None:
        return nothing
    known = flags.value(use_mix)
    if known is False:
        return nothing
    loss = as_pending(call.loss, nothing)
    judged = accept.judged_loss(loss)
    if known:
        return judged
    return torch.where(use_mix.to(judged.device), judged, nothing)

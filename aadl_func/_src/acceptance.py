r"""Step 4 of [`aadl_func.anderson()`][aadl_func.anderson]: which point a call returns, the
mix $x$ or the plain step $y$.

An acceptance rule is one `Acceptance` record. The default, `SAFEGUARD`, keeps a usable
mix, and with `loss_fn` only one that lowers the loss, $\ell(x) < \ell(y)$ (its verdict:
`aadl_func._src.core.accept.beats()`). Another rule is one module of its functions (the line
search: `aadl_func._src.mix_search`) plus its record in `ACCEPTANCES`, keyed by the boolean
option of [`aadl_func.anderson()`][aadl_func.anderson] that turns it on. The step
(`aadl_func._src.update.update()`) calls the rule's `choose`; the rest of the package reads
the record's fields, never the rule's option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import Tensor

from aadl_func._src import flags, mix_search, tree
from aadl_func._src.core import accept
from aadl_func._src.exec.inplace import callbacks
from aadl_func._src.update_call import Call
from aadl_func._src.validation import scalar_loss

__all__ = ["ACCEPTANCES", "Acceptance", "SAFEGUARD", "chosen"]


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """One acceptance rule.

    Attributes:
      choose: `choose(call, mixable, x, x_hist, y) -> (use_mix, x, x_hist)`. `mixable` says
        the mix is computed and finite; `x` is the mix in the params' dtype, `x_hist` its
        value for the window (history device), `y` the plain step. It returns whether the
        call returns its `x` (a flag, `aadl_func._src.flags`), and the point and window
        value it returns there (the mix itself, or a point the rule found).
      check_call: `check_call(loss_fn, shards, transformed)`, called by `update` before
        anything is computed or written: it raises for a call the rule cannot serve.
      restarts: a mix it turns down restarts the window (`aadl_func._src.stages.restarted()`).
      torch_optim_refusal: None if the torch.optim faces
        ([`aadl_func.AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer]) serve the rule;
        else the end of their message refusing it: how to reach it, and why they cannot.
    """

    choose: Callable[..., tuple[Tensor, list[Tensor], list[Tensor]]]
    check_call: Callable[[Any, Any, bool], None]
    restarts: bool = False
    torch_optim_refusal: str | None = None


def _loss_safeguard(
    call: Call, mixable: Tensor, x: list[Tensor], x_hist: list[Tensor], y: list[Tensor]
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """`mixable`, and with `loss_fn` also `loss_fn(x) < loss_fn(y)` (both finite)."""
    loss_fn = call.loss_fn
    if loss_fn is None:
        return mixable, x, x_hist

    def decide() -> Tensor:
        with callbacks(call):
            loss_x = scalar_loss("anderson.update", loss_fn(tree.unflatten(call.spec, x)))
            loss_y = scalar_loss("anderson.update", loss_fn(tree.unflatten(call.spec, y)))
        if call.shards is not None:
            loss_x, loss_y = call.shards.mean_losses(loss_x, loss_y)
        better = accept.beats(loss_x, loss_y).reshape(())
        return flags.both(mixable, flags.decision(better, call.compute_device))

    return call.blend.select(mixable, decide, flags.FALSE), x, x_hist


def _any_call(loss_fn: Any, shards: Any, transformed: bool) -> None:
    """The safeguard serves every call: with or without `loss_fn`, eager or transformed."""


# The default: every usable mix, or with `loss_fn` every one that lowers the loss.
SAFEGUARD = Acceptance(choose=_loss_safeguard, check_call=_any_call)

# The other rules, by the boolean option of `anderson` that turns each on (one at a time).
ACCEPTANCES = {
    # N-GMRES's step; it restarts when the direction does not descend or no step length
    # qualifies.
    "line_search": Acceptance(
        choose=mix_search.search,
        check_call=mix_search.check_call,
        restarts=True,
        torch_optim_refusal=mix_search.TORCH_OPTIM_REFUSAL,
    ),
}


def chosen(owner: str, values: dict[str, Any]) -> Acceptance:
    """The rule that the checked option `values` turn on (`SAFEGUARD` if none does); an
    error naming both options if two do."""
    on = [name for name in ACCEPTANCES if values[name]]
    if len(on) > 1:
        raise ValueError(
            f"{owner}: `{on[0]}=True` and `{on[1]}=True` are two acceptance rules; "
            "choose one of them"
        )
    return ACCEPTANCES[on[0]] if on else SAFEGUARD

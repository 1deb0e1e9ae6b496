"""The modes of [`aadl_func.anderson()`][aadl_func.anderson], one record each.

Everything that differs between the modes is here or in the functions a record names: the
ring's layout, how much window a mix needs, whether AADL's moving average applies, the
mode's part of the one `update` sequence (`aadl_func._src.update.update()`: how the window
takes its entry, the mix, what a kept mix changes), and the bounds behind a sharded step's
finiteness certificate (`aadl_func._src.exec.sharded.certified_finite()`). Adding a mode
is one module of these functions (with its math in `aadl_func._src.core.variants`) and one
record here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from aadl_func._src import aadl_step, classic_step
from aadl_func._src.core.variants import aadl, classic

__all__ = ["MODES", "Mode"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One mode of [`aadl_func.anderson()`][aadl_func.anderson].

    Attributes:
      name: the `mode` option's value.
      num_slots: ring slots for a `history_depth`.
      min_window: window entries (aadl: iterates, classic: pairs) before a mix.
      keeps_iterates: the state holds a second ring (`AndersonState.iterates`) of steps.
      averages: AADL's moving average (`average=True`) is defined for it.
      complex_params: complex params are accepted (a complex window, Hermitian Grams).
      store_and_step: `store_and_step(call) -> (window, y)`, steps 1 and 2 of a call
        (`aadl_func._src.update_call.Call`): the plain step `y` and the window with this
        call's entry stored (or not), a NamedTuple with at least `ring`, `grams`, `head`,
        `window_size`, `anchor` and `poisoned`.
      state_fields: `state_fields(call, window, final=...)`, the mode's own state fields
        at the commit point (`final=False`) and in the final state.
      extrapolate: `extrapolate(call, window) -> (x_hist, ok)`, step 3: the mix (compute
        dtype, history device) and whether it is usable.
      no_mix: `no_mix(call)`, placeholders of `extrapolate`'s shapes for a call that does
        not mix (blended under vmap).
      keep_mix: `keep_mix(call, window, x_hist, x) -> window` after `loss_fn` kept the mix,
        or None when a kept mix changes nothing in the window.
      base_bound: `base_bound(call)`, this rank's bound of the combination's base.
      mix_bound: `mix_bound(options, alpha, norms, base)`, a bound of every entry of the mix
        from the summed base bound and the residual norms.
      last_plain_step: `last_plain_step(call)`, the previous call's plain step read from
        the window (history device), where a rejected mix goes back to
        (`aadl_func._src.deferred`).
      eager_steps: which of the fast paths' straight-line sequences
        (`aadl_func._src.exec.eager`, `aadl_func._src.exec.steady`) runs the mode's eager
        calls, `"aadl"` or `"classic"`; None: every call takes the general path's `update`
        (where a new mode starts, until the fast paths hold a sequence of its own).
    """

    name: str
    num_slots: Callable[[int], int]
    min_window: int
    keeps_iterates: bool
    averages: bool
    complex_params: bool
    store_and_step: Callable[..., tuple[Any, Any]]
    state_fields: Callable[..., dict[str, Any]]
    extrapolate: Callable[..., tuple[Any, Any]]
    no_mix: Callable[..., tuple[Any, Any]]
    keep_mix: Callable[..., Any] | None
    base_bound: Callable[..., Any]
    mix_bound: Callable[..., Any]
    last_plain_step: Callable[..., Any]
    eager_steps: str | None = None


MODES = {
    # AADL stores differences of consecutive entries (depth - 1 of them) beside the newest.
    "aadl": Mode(
        name="aadl",
        num_slots=lambda depth: depth - 1,
        min_window=3,
        keeps_iterates=False,
        averages=True,
        # Not implemented for complex windows: AADL's extrapolation from the plain steps of
        # an optimizer, its moving average and its safeguards are written, and tested, for
        # real parameters only.
        complex_params=False,
        store_and_step=aadl_step.store_and_step,
        state_fields=aadl_step.state_fields,
        extrapolate=aadl_step.extrapolate,
        no_mix=aadl_step.no_mix,
        # The kept mix becomes the anchor, so that the next difference starts from it.
        keep_mix=aadl_step.keep_mix,
        base_bound=aadl_step.base_bound,
        mix_bound=aadl.mix_bound,
        last_plain_step=aadl_step.last_plain_step,
        eager_steps="aadl",
    ),
    # Classic stores one residual and one step per pair. The moving average needs a window
    # of plain iterates, whose spread the residual Gram of pairs does not give.
    "classic": Mode(
        name="classic",
        num_slots=lambda depth: depth,
        min_window=2,
        keeps_iterates=True,
        averages=False,
        # Type-II Anderson acceleration over complex numbers: the Hermitian least-squares
        # problem min ||sum alpha_i f_i|| over complex alpha, as scipy.optimize.anderson.
        complex_params=True,
        store_and_step=classic_step.store_and_step,
        state_fields=classic_step.state_fields,
        extrapolate=classic_step.extrapolate,
        no_mix=classic_step.no_mix,
        keep_mix=None,
        base_bound=classic_step.base_bound,
        mix_bound=classic.mix_bound,
        last_plain_step=classic_step.last_plain_step,
        eager_steps="classic",
    ),
}

r"""One `update` call as the stages see it: the `Call` record of its inputs, fixed before
the first stage runs, and what follows from those inputs alone.

Besides the record: `advance()`, a 0-d counter stepped (read once eagerly, a tensor chain
under vmap and torch.compile), which gives the call its number; `may_mix()`, the call-count
gates of a mix, which the stages (`aadl_func._src.stages.gate()`) and the sharded
reduction (`aadl_func._src.exec.sharded`) both ask; and the dtypes the mix is computed in,
with their overflow limit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aadl_func._src import distributed, flags, tree
from aadl_func._src.atomic import InterruptGuard, Progress
from aadl_func._src.blend import Blend
from aadl_func._src.core.scalars import EXACT
from aadl_func._src.state import AndersonState

if TYPE_CHECKING:
    from aadl_func._src.options import AndersonOptions

__all__ = ["Call", "advance", "may_mix", "mixes_on", "stores_on"]


class Call:
    """One call of `update`: its inputs and what follows from them alone, fixed before the
    first stage runs and never written afterwards.

    Attributes:
      options: the `AndersonOptions`.
      state: the state passed in (in an eager in-place call, the tensors every commit writes).
      params, spec: the params' leaves `x` and their tree structure.
      updates: the inner optimizer's update leaves `u` (`y = x + u`).
      inner_state: the inner optimizer's state after this call's update.
      inplace, loss_fn: as given to `update`.
      loss: the training loss at `params` given to `update` (the deferred safeguard,
        `aadl_func._src.deferred`), a 0-d tensor, or None.
      shards: sharded params only, the call's `aadl_func._src.distributed.ShardedCall`.
      guard: eager in-place calls only, the `InterruptGuard`.
      plain: the wrapper's recovery: record the plain step, never mix.
      count, count_value: the call's number (1-based) as a counter and, eagerly, as an int.
      q: ring slots.
      ring, anchor, iterates: the state's window leaves (`iterates`: mode "classic").
      compute_device: where the Grams and the small problem live.
      compute_dtypes: per params leaf, the dtype the mix is computed in.
      overflow_limit: half the largest value of the params' and compute dtypes.
      exact: a float64 window, solved through a QR factor instead of its Grams.
      blend: the call's `Blend` (`select` and masked writes).
      progress: eager in-place calls only, the `Progress` of
        the call's writes, for `aadl_func._src.exec.inplace.recover()`.
    """

    __slots__ = (
        "options",
        "state",
        "params",
        "spec",
        "updates",
        "inner_state",
        "inplace",
        "loss_fn",
        "loss",
        "shards",
        "guard",
        "plain",
        "count",
        "count_value",
        "q",
        "ring",
        "anchor",
        "iterates",
        "compute_device",
        "compute_dtypes",
        "overflow_limit",
        "exact",
        "blend",
        "progress",
    )

    def __init__(
        self,
        options: AndersonOptions,
        state: AndersonState,
        params: list[Tensor],
        spec: Any,
        updates: list[Tensor],
        inner_state: Any,
        *,
        inplace: bool,
        loss_fn: Any,
        loss: Tensor | None = None,
        shards: distributed.ShardedCall | None = None,
        guard: InterruptGuard | None = None,
        plain: bool = False,
    ) -> None:
        self.options = options
        self.state = state
        self.params = params
        self.spec = spec
        self.updates = updates
        self.inner_state = inner_state
        self.inplace = inplace
        self.loss_fn = loss_fn
        self.loss = loss
        self.shards = shards
        self.guard = guard
        self.plain = plain
        # Eager: the call's number as an int, from which the call-count gates are read
        # without tensor operations (None under vmap / torch.compile).
        self.count, self.count_value = advance(state.count, 1)
        self.q = options.num_slots
        self.ring = tuple(tree.flatten(r, "state.residuals")[0] for r in state.residuals)
        self.anchor = tree.flatten(state.anchor, "state.anchor")[0]
        self.iterates = tuple(tree.flatten(r, "state.iterates")[0] for r in state.iterates)
        self.compute_device = state.gram.device
        self.compute_dtypes, self.overflow_limit = _arithmetic(
            options.history_dtype, tuple(p.dtype for p in params)
        )
        # A float64 window is mixed through a QR factor of its differences (accurate to
        # eps * cond); other windows through their float64 Gram matrices (O(m n)).
        self.exact = all(leaf.dtype in EXACT for leaf in self.ring[0])
        # The call's decisions without values (vmap, torch.compile): see blend.py.
        self.blend = Blend()
        self.progress = Progress() if guard is not None else None


# -- the call-count gates ---------------------------------------------------------------------
def mixes_on(options: AndersonOptions, count: Any) -> Any:
    """Whether call number `count` (an int, or a counter tensor) passes the call-count
    gates of a mix: past `wait_iterations` and on the `frequency`."""
    return (count > options.wait_iterations) & (count % options.frequency == 0)


def stores_on(options: AndersonOptions, count: Any) -> Any:
    """Whether call number `count` (an int, or a counter tensor) stores its plain step in
    the window: every `store_each_nth`."""
    return count % options.store_each_nth == 0


def may_mix(call: Call) -> Tensor:
    """The call-count gates of a mix (`mixes_on()`); eagerly read from the call's number."""
    if call.count_value is not None:
        return flags.known(mixes_on(call.options, call.count_value))
    return mixes_on(call.options, call.count)


# -- small helpers ----------------------------------------------------------------------------
def advance(
    counter: Tensor,
    step: int,
    *,
    modulo: int | None = None,
    low: int | None = None,
    high: int | None = None,
) -> tuple[Tensor, int | None]:
    """`counter + step` (a 0-d int64 counter), then taken `% modulo` or clamped to
    `[low, high]`: a new tensor and, eagerly, its value as an int (else `None`).

    An eager counter is read once and the result made in one operation; the same chain of
    tensor operations (`clamp(w - 1, min=0)`: two) costs a few microseconds per link,
    which adds up over the counters a step advances. Under vmap or torch.compile the chain
    is applied to the tensor.
    """
    value = tree.static_value(counter)
    if value is None:
        result = counter + step
        if modulo is not None:
            result = result % modulo
        if low is not None or high is not None:
            result = torch.clamp(result, min=low, max=high)
        return result, None
    value += step
    if modulo is not None:
        value %= modulo
    if low is not None:
        value = max(value, low)
    if high is not None:
        value = min(value, high)
    return torch.scalar_tensor(value, dtype=torch.int64), value


_ARITHMETIC: dict[tuple, tuple[tuple[torch.dtype, ...], float]] = {}


def _arithmetic(
    history_dtype: torch.dtype | None, param_dtypes: tuple[torch.dtype, ...]
) -> tuple[tuple[torch.dtype, ...], float]:
    """Per params leaf, the dtype the mix is computed in (the params' and the history's,
    at least float32), and the overflow limit of `aadl_func._src.stages.finite()`'s
    certificate: half the largest value of every params and compute dtype. Cached for eager
    calls, which ask on every step (a traced step computes it once, at trace time)."""
    key = (history_dtype, param_dtypes)
    if not tree.tracing() and key in _ARITHMETIC:
        return _ARITHMETIC[key]
    compute = tuple(
        torch.promote_types(torch.promote_types(d, history_dtype or d), torch.float32)
        for d in param_dtypes
    )
    result = compute, 0.5 * min(torch.finfo(d).max for d in [*param_dtypes, *compute])
    if not tree.tracing():
        _ARITHMETIC[key] = result
    return result

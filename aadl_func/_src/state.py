"""The immutable state threaded through [`aadl_func.anderson()`][aadl_func.anderson]'s `update`."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src.core.lstsq import MixingWeights

__all__ = ["AndersonState", "COUNTERS", "allow_weights_only"]


class AndersonState(NamedTuple):
    """State of [`aadl_func.anderson()`][aadl_func.anderson]: tensors only, so vmap and `torch.save`
    work.

    The window is stored as differences, which keeps the Gram matrix free of cancellation and
    lets a low-precision `history_dtype` hold small steps accurately.

    Attributes:
      count: 0-d int64, number of `update` calls so far.
      inner_state: the inner optimizer's state.
      anchor: the newest window entry, a pytree like `params` (params' dtype, history
        device). Mode "classic": the newest point `x_i` (at `init`, the params given).
      residuals: ring of `Q` pytrees like `params` (history dtype and device). Mode "aadl":
        `Q = history_depth - 1` differences `x_{i+1} - x_i` of consecutive window entries.
        Mode "classic": `Q = history_depth` residuals `g(x_i) - x_i`.
      iterates: mode "classic": ring of the `Q` differences `x_i - x_{i-1}` of
        consecutive points (history dtype and device; the oldest one's is never used), so a
        low-precision window rounds the steps, not the points. Mode "aadl": `()`.
      gram: `(Q, Q)` float64 Gram matrix of `residuals` in ring order (compute device);
        complex params: complex128, Hermitian, `G[t, s] = <f_t, f_s> = f_t^H f_s` (so are
        `dr_gram` and `dr_rhs`).
      dr_gram: `(Q, Q)` float64 Gram matrix of the consecutive differences
        `d_t = residuals[t] - residuals[t - 1]` (ring order; the oldest slot's entry is
        unused). Kept from differences formed element by element, so it does not cancel
        when consecutive residuals are nearly equal, as `D^T gram D` would.
      dr_rhs: `(Q,)` float64, `<d_t, residuals[head]>` in ring order.
      head: 0-d int64, ring slot of the newest residual.
      window_size: 0-d int64, entries in the window (aadl: iterates, classic: pairs).
      num_mixed: 0-d int64, calls whose returned params came from the mixing.
      num_rejected: 0-d int64, mixes the `loss_fn` safeguard rejected.
      num_nonfinite: 0-d int64, mixes discarded because the Gram matrix or the mixed point was
        not finite (the plain step was returned instead).
      num_averaged: 0-d int64, calls whose params were replaced by the window mean.
      num_skipped: 0-d int64, calls skipped by `skip_nonfinite` (non-finite grads or inner
        update: params and the rest of the state left as they were).
      skip_streak: 0-d int64, consecutive skipped calls up to now (0 after a step is taken).
      pending_loss: 0-d float64 (beside the counters): with `update(..., loss=...)` (the
        deferred safeguard), the loss at the point the returned mix was made from, which the
        next call's `loss` must beat; +inf when the last call returned no mix.
        `None` in a state saved before the field existed (read as +inf).
    """

    count: Tensor
    inner_state: Any
    anchor: Any
    residuals: tuple
    iterates: tuple
    gram: Tensor
    dr_gram: Tensor
    dr_rhs: Tensor
    head: Tensor
    window_size: Tensor
    num_mixed: Tensor
    num_rejected: Tensor
    num_nonfinite: Tensor
    num_averaged: Tensor
    num_skipped: Tensor
    skip_streak: Tensor
    pending_loss: Tensor | None = None


# The 0-d int64 counters of the state (checked and moved together).
COUNTERS = (
    "count",
    "head",
    "window_size",
    "num_mixed",
    "num_rejected",
    "num_nonfinite",
    "num_averaged",
    "num_skipped",
    "skip_streak",
)


def allow_weights_only(*records: type) -> None:
    """Lets `torch.load(weights_only=True)` (torch's default) rebuild `records`: public
    NamedTuples of tensors that users save (states, solver results), so that loading a
    checkpoint never needs `weights_only=False`, which may run arbitrary pickled code.

    Every module that defines such a record calls this at import. The allow-list exists from
    torch 2.4; an older torch has no weights-only loading of custom classes at all."""
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(list(records))


allow_weights_only(AndersonState, MixingWeights)

r"""Mode "classic": textbook (type-II) Anderson acceleration on the pairs $(x_i, g(x_i))$
(the mode's part of `aadl_func._src.update.update()`, named in its
`aadl_func._src.modes.Mode` record).

The window holds the newest point $x_{k}$ (the anchor, in the params' dtype), a ring of
the steps $\Delta x_i = x_i - x_{i-1}$ between consecutive points and a ring of the
residuals $f_i = g(x_i) - x_i$ (the inner updates). One call:

$$
\alpha = \arg\min_{\sum \alpha = 1} \Big\|\sum_i \alpha_i f_i\Big\|^2 (+\ \text{ridge}),
\qquad
x^+ = \sum_i \alpha_i \big(x_i + \beta f_i\big)
    = x_{k} + \sum_j w_j \Delta x_j + \beta \sum_i \alpha_i f_i,
$$

$w_j = -\sum_{i<j} \alpha_i$ (`aadl_func._src.core.variants.classic.classic_coefficients()`): the
points are combined through their steps, so a low-precision window rounds the steps, not
the points. On a linear map with full history and $\beta = 1$ the iterates are
GMRES's (Walker & Ni, 2011).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import distributed, flags
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.ring import to_ring_order
from aadl_func._src.core.variants import classic
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.exec.sharded import Reduction
from aadl_func._src.stages import (
    append,
    finite,
    owned,
    plain_step,
    read_slot,
    solve,
    store_anchor,
    stores,
    to_history,
    window_tree,
)
from aadl_func._src.update_call import Call, advance
from aadl_func._src.window import combine, write_slot

__all__ = [
    "base_bound",
    "extrapolate",
    "last_plain_step",
    "no_mix",
    "state_fields",
    "store_and_step",
]


class Window(NamedTuple):
    """The window after this call's pair was stored (or not)."""

    iterates: tuple
    anchor: list[Tensor]
    ring: tuple
    grams: Grams
    head: Tensor
    window_size: Tensor
    poisoned: Tensor
    reduction: Reduction | None


def store_and_step(call: Call) -> tuple[Window, list[Tensor]]:
    """Steps 2 and 1: the pair `(x_k, g(x_k) - x_k)` is stored before an in-place step
    overwrites `x_k`, then the plain step `y`."""
    state = call.state
    unchanged = Window(
        call.iterates,
        call.anchor,
        call.ring,
        Grams.of(state),
        state.head,
        state.window_size,
        flags.FALSE,
        None,
    )
    window = call.blend.select(stores(call), lambda: store_pair(call), unchanged)
    return window, plain_step(call)


def state_fields(call: Call, window: Window, *, final: bool) -> dict[str, Any]:
    """The mode's fields of the state at the commit point (the anchor and the steps'
    ring); none in the final state (a kept mix leaves the window as it is)."""
    if final:
        return {}
    return {
        "anchor": window_tree(call, "anchor", window.anchor),
        "iterates": window_tree(call, "iterates", window.iterates),
    }


def store_pair(call: Call) -> Window:
    """The step `x_k - x_{k-1}` joins the iterates' ring, the residual `u = g(x_k) - x_k`
    the residuals' ring (with its Gram rows), and `x_k` becomes the anchor."""
    state, anchor, iterates = call.state, call.anchor, call.iterates
    slot, _ = advance(state.head, 1, modulo=call.q)
    point = to_history(call.params, anchor)
    step = [(x - a).to(d.dtype) for x, a, d in zip(point, anchor, iterates[0])]
    iterates = write_slot(iterates, slot, to_history(step, iterates[0]), call.inplace, call.blend)
    residual = owned(call, to_history(call.updates, call.ring[0]), call.updates)
    grams = Grams.of(state)
    ring, grams, head, size, poisoned, reduction = append(
        call, call.ring, grams, state.head, state.window_size, residual
    )
    anchor = store_anchor(call, anchor, point, call.params)
    return Window(iterates, anchor, ring, grams, head, size, poisoned, reduction)


def extrapolate(call: Call, window: Window) -> tuple[list[Tensor], Tensor]:
    """The mix $x^+ = x_k + \\sum_j w_j \\Delta x_j + \\beta \\sum_i \\alpha_i f_i$
    (compute dtype, history device) and whether it is usable (solved and finite)."""
    solution = solve(
        call, window.ring, window.grams, window.head, window.window_size, window.reduction
    )
    alpha, order = solution.weights.alpha, solution.order
    # The sum of the steps comes first and the anchor is added last (a fresh tensor, in
    # place), so that the sum rounds alike on every path, as without an anchor.
    steps = combine(
        None,
        [window.iterates, window.ring],
        torch.cat(
            [
                to_ring_order(classic_coefficients(alpha), order),
                to_ring_order(call.options.relaxation * alpha, order),
            ]
        ),
        call.compute_dtypes,
        window.anchor,
    )
    x_hist = [v.add_(a) for v, a in zip(steps, window.anchor)]
    return x_hist, finite(call, x_hist, solution)


def no_mix(call: Call) -> tuple[list[Tensor], Tensor]:
    """Placeholders for the blend under vmap, built only on calls that do not mix."""
    zeros = [torch.zeros_like(r, dtype=c) for r, c in zip(call.ring[0], call.compute_dtypes)]
    return zeros, flags.FALSE


def base_bound(call: Call) -> Tensor:
    """A bound of every iterate on this rank
    (`aadl_func._src.core.variants.classic.base_bound()`)."""
    device = call.compute_device
    anchor = distributed.max_abs(call.anchor, device)
    params = distributed.max_abs(call.params, device)
    steps = distributed.max_abs([leaf for entry in call.iterates for leaf in entry], device)
    return classic.base_bound(anchor, params, steps, call.q)


def last_plain_step(call: Call) -> list[Tensor]:
    """The previous call's plain step
    (`aadl_func._src.core.variants.classic.last_plain_step()`)."""
    return classic.last_plain_step(call.anchor, read_slot(call.ring, call.state.head))

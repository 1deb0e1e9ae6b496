r"""Mode "aadl": AADL's Anderson step on the window of plain iterates (the mode's part of
`aadl_func._src.update.update()`, named in its `aadl_func._src.modes.Mode` record).

The window holds the newest plain iterate $y_{k}$ (the anchor, in the params' dtype)
and a ring of the differences $\Delta x_j = y_{j+1} - y_j$ of consecutive ones (the
"residuals" of AADL's fixed-point view). One call (see
[`aadl_func.anderson()`][aadl_func.anderson]):

$$
y = g(x), \qquad
\gamma = \arg\min_\gamma \|\Delta x_{\mathrm{last}} - \Delta R\,\gamma\|^2
    + \lambda\|\gamma\|^2, \qquad
x^+ = y - \sum_j c_j\, \Delta x_j,\quad c = \mathrm{cumsum}(\alpha) - \beta\alpha,
$$

$\alpha$ the affine weights of $\gamma$ (`aadl_func._src.core.lstsq`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import distributed, flags, tree
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.ring import to_ring_order
from aadl_func._src.core.variants import aadl
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.exec.inplace import undo_later
from aadl_func._src.exec.sharded import Reduction
from aadl_func._src.stages import (
    append,
    finite,
    owned,
    plain_step,
    read_slot,
    replace_newest,
    solve,
    store_anchor,
    stores,
    to_history,
    window_tree,
)
from aadl_func._src.update_call import Call, advance
from aadl_func._src.window import append_difference, combine

__all__ = [
    "base_bound",
    "extrapolate",
    "keep_mix",
    "last_plain_step",
    "no_mix",
    "state_fields",
    "store_and_step",
]


class Window(NamedTuple):
    """The window after this call's plain step was stored (or not)."""

    ring: tuple
    grams: Grams
    head: Tensor
    num_residuals: Tensor
    window_size: Tensor
    anchor: list[Tensor]
    poisoned: Tensor
    reduction: Reduction | None
    stored: Tensor  # this call stored y (the anchor holds it)


def store_and_step(call: Call) -> tuple[Window, list[Tensor]]:
    """Steps 1 and 2: the plain step `y`, then the window with `y` stored (or not)."""
    y = plain_step(call)
    return store_iterate(call, y, stores(call)), y


def state_fields(call: Call, window: Window, *, final: bool) -> dict[str, Any]:
    """The mode's fields of the state at the commit point (the anchor), and in the final
    state (the window, which a kept mix moves: `keep_mix()`)."""
    anchor = window_tree(call, "anchor", window.anchor)
    if not final:
        return {"anchor": anchor}
    return {
        "anchor": anchor,
        "residuals": window_tree(call, "residuals", window.ring),
        "gram": window.grams.gram,
        "dr_gram": window.grams.dr_gram,
        "dr_rhs": window.grams.dr_rhs,
    }


def store_iterate(call: Call, y: list[Tensor], store: Tensor) -> Window:
    """Step 2: on a storing call, `y - anchor` joins the ring and `y` becomes the anchor."""
    state, anchor = call.state, call.anchor
    y_hist = to_history(y, anchor)
    # The window is empty exactly until the first stored call (count < store_each_nth);
    # read from the count, which the members of a vmapped ensemble share (window_size
    # is per member once a restart may have happened), so the append is not blended.
    empty = (
        flags.known(call.count_value - 1 < call.options.store_each_nth)
        if call.count_value is not None
        else state.count < call.options.store_each_nth
    )
    num_residuals, _ = advance(state.window_size, -1, low=0)
    grams = Grams.of(state)

    def append_residual() -> tuple:
        residual, g = _difference(call, y_hist)
        appended = append(call, call.ring, grams, state.head, num_residuals, residual, g=g)
        return (*appended, g is not None)

    no_append = (call.ring, grams, state.head, num_residuals, flags.FALSE, None, False)
    ring, grams, head, num_residuals, poisoned, reduction, anchor_stored = call.blend.select(
        flags.both(store, flags.negate(empty)), append_residual, no_append
    )

    def new_anchor() -> list[Tensor]:
        if call.inplace and anchor_stored:  # the fused append copied y already
            return anchor
        return store_anchor(call, anchor, y_hist, y)

    def grown() -> Tensor:
        return call.blend.select(
            empty, lambda: torch.ones_like(num_residuals), lambda: advance(num_residuals, 1)[0]
        )

    return Window(
        ring=ring,
        grams=grams,
        head=head,
        num_residuals=num_residuals,
        window_size=call.blend.select(store, grown, state.window_size),
        anchor=call.blend.select(store, new_anchor, anchor),
        poisoned=poisoned,
        reduction=reduction,
        stored=store,
    )


def _difference(call: Call, y_hist: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
    """The new residual `y - anchor` in the history dtype, and its Gram row if the fused
    kernel computed it.

    In place the difference goes straight into its ring slot (rounded to the history dtype
    once): appending allocates nothing parameter-sized. A float32 window on the CPU does it
    in one pass with the anchor copy and the Gram row (`append_difference`).
    """
    head = tree.static_value(call.state.head) if call.inplace else None
    slot = None if head is None else (head + 1) % call.q
    if slot is not None and tree.any_transformed(y_hist):
        # A vmapped ensemble stepping together (a shared head): batched tensors have neither
        # `out=` nor raw pointers, so the difference takes the route below and is then
        # copied into its one slot.
        slot = None
    if slot is None:
        residual = [
            (yh - a).to(call.options.history_dtype_of(a)) for yh, a in zip(y_hist, call.anchor)
        ]
        return to_history(residual, call.ring[0]), None
    g = append_difference(call.ring, slot, y_hist, call.anchor, call.compute_device)
    if g is None:
        for yh, a, r in zip(y_hist, call.anchor, call.ring[slot]):
            torch.sub(yh, a, out=r)
    return call.ring[slot], g


def extrapolate(call: Call, window: Window) -> tuple[list[Tensor], Tensor]:
    """Step 3: the mix $x^+ = y - \\sum_j c_j \\Delta x_j$ (compute dtype, history
    device) and whether it is usable (solved and finite)."""
    solution = solve(
        call, window.ring, window.grams, window.head, window.num_residuals, window.reduction
    )
    minus_c = aadl_coefficients(solution.weights.alpha, call.options.relaxation, negated=True)
    anchor = window.anchor
    into = _mix_into_params(call, anchor, window.stored)
    if into is not None:
        undo_later(call, call.params, anchor)  # the anchor holds y
    try:
        x_hist = combine(
            # Mixing into the params, which hold y = the anchor bit for bit: accumulating
            # there reads one parameter-sized buffer fewer than anchor -> params.
            anchor if into is None else into,
            [window.ring],
            to_ring_order(minus_c, solution.order),
            call.compute_dtypes,
            anchor,
            out=into,
        )
        ok = finite(call, x_hist, solution)
    except BaseException:
        if into is not None:
            for p, a in zip(call.params, anchor):
                p.copy_(a)  # back to y: the caller holds the plain step
        raise
    if into is not None and not flags.value(ok):
        for p, a in zip(call.params, anchor):
            p.copy_(a)  # back to y
    return x_hist, ok


def _mix_into_params(call: Call, anchor: list[Tensor], store: Tensor) -> list[Tensor] | None:
    """The params' buffers when the mix can be written straight into them, saving a
    parameter-sized allocation and a copy: in place, without the safeguard or the moving
    average (both still read y there), unsharded, and only when this call stored y in the
    anchor (same device, dtype, layout), which then undoes a rejected mix."""
    if not call.inplace or call.loss_fn is not None or call.options.average:
        return None
    if call.shards is not None or flags.value(store) is not True:
        return None
    if tree.any_transformed(call.params):
        # vmap (members stepping together know `store`): undoing a rejected mix needs
        # `ok` as a value, which a batched flag is not.
        return None
    for p, a, c in zip(call.params, anchor, call.compute_dtypes):
        if not (p.dtype == a.dtype == c) or (p.device, p.stride()) != (a.device, a.stride()):
            return None
    return call.params


def no_mix(call: Call) -> tuple[list[Tensor], Tensor]:
    """Placeholders for the blend under vmap, built only on calls that do not mix."""
    zeros = [torch.zeros_like(a, dtype=c) for a, c in zip(call.anchor, call.compute_dtypes)]
    return zeros, flags.FALSE


def keep_mix(call: Call, window: Window, x_hist: list[Tensor], x: list[Tensor]) -> Window:
    """The safeguard kept the mix: it becomes the anchor and the newest residual grows by
    `x - y` (so that the next difference is taken from the point actually returned)."""
    ring, anchor = window.ring, window.anchor
    newest = read_slot(ring, window.head)
    x_anchor = [v.to(a.dtype) for v, a in zip(x_hist, anchor)]
    residual = [
        (r.to(c) + (xa - a).to(c)).to(r.dtype)
        for r, xa, a, c in zip(newest, x_anchor, anchor, call.compute_dtypes)
    ]
    if call.inplace and call.progress is not None:
        # The plain step's newest entry, put back if the call is interrupted before its end.
        kept = [*read_slot(ring, window.head), *anchor]
        undo_later(call, kept, [t.clone() for t in kept])
    ring, grams = replace_newest(call, ring, window.grams, window.head, residual)
    if call.inplace:
        for a, xa in zip(anchor, x_anchor):
            call.blend.assign(a, xa)
        x_anchor = anchor
    else:
        x_anchor = owned(call, x_anchor, x)
    return window._replace(ring=ring, grams=grams, anchor=x_anchor)


def base_bound(call: Call) -> Tensor:
    """The largest magnitude of the combination's base on this rank
    (`aadl_func._src.core.variants.aadl.base_bound()`)."""
    device = call.compute_device
    anchor = distributed.max_abs(call.anchor, device)
    params = distributed.max_abs(call.params, device)
    return aadl.base_bound(anchor, params, distributed.max_abs(call.updates, device))


def last_plain_step(call: Call) -> list[Tensor]:
    """The previous call's plain step (`aadl_func._src.core.variants.aadl.last_plain_step()`)."""
    return aadl.last_plain_step(call.anchor)

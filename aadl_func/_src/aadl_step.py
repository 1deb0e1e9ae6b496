r"""Mode "aadl": AADL's Anderson step on the window of plain iterates.

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
from aadl_func._src.average import window_average
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.ring import to_ring_order
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.exec.inplace import begin_writes, commit, undo_later
from aadl_func._src.exec.sharded import Reduction
from aadl_func._src.stages import (
    append,
    commit_plain,
    count_outcome,
    finite,
    gate,
    output,
    owned,
    plain_step,
    read_slot,
    replace_newest,
    solve,
    store_anchor,
    stores,
    to_history,
    to_params,
    window_tree,
)
from aadl_func._src.state import AndersonState
from aadl_func._src.update_call import Call, advance
from aadl_func._src.window import append_difference, combine

__all__ = ["aadl_step", "base_bound", "last_plain_step"]


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


def aadl_step(call: Call) -> tuple[Any, AndersonState]:
    """One `update` call in mode "aadl" (the numbered steps of
    [`aadl_func.anderson()`][aadl_func.anderson])."""
    options = call.options
    begin_writes(call)
    y = plain_step(call)  # step 1
    store = stores(call)
    window = store_iterate(call, y, store)  # step 2
    # Commit point (atomic.py): from here on the caller holds a finished plain step.
    plain = commit_plain(
        call,
        window.ring,
        window.grams,
        window.head,
        window.window_size,
        window.poisoned,
        anchor=window_tree(call, "anchor", window.anchor),
    )
    # The committed tensors (the caller's, in place), so that the final state shares them
    # unless the safeguard moves the newest entry.
    window = window._replace(grams=Grams.of(plain))
    mean, averaged = moving_average(call, window)  # step 5, decided before any mix
    mixes = flags.both(gate(call, window.window_size), flags.negate(averaged))
    # x is only used where mixable = mixes & ok holds (the safeguard, the output): a gate
    # without a value (vmap, compile) computes it unblended.
    x_hist, ok = call.blend.select(
        mixes, lambda: extrapolate(call, window, store), lambda: no_mix(call), blend=False
    )
    mixable = flags.both(mixes, ok)
    x = call.blend.select(mixable, lambda: to_params(call, x_hist), y, blend=False)
    use_mix, x, x_hist = options.acceptance.choose(call, mixable, x, x_hist, y)  # step 4
    if call.loss_fn is not None:
        # A kept mix replaces the newest entry, so that the next residual starts from it.
        window = call.blend.select(use_mix, lambda: move_newest(call, window, x_hist, x), window)
    if options.average:
        x = call.blend.select(averaged, lambda: to_params(call, mean), x)
    final = count_outcome(
        call,
        plain,
        gate=mixes,
        ok=ok,
        use_mix=use_mix,
        poisoned=window.poisoned,
        anchor=window_tree(call, "anchor", window.anchor),
        residuals=window_tree(call, "residuals", window.ring),
        gram=window.grams.gram,
        dr_gram=window.grams.dr_gram,
        dr_rhs=window.grams.dr_rhs,
        num_averaged=flags.add_if(plain.num_averaged, averaged),
    )
    out = output(call, flags.either(use_mix, averaged), x, y, final)
    return tree.unflatten(call.spec, out), commit(call, final)


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


def moving_average(call: Call, window: Window) -> tuple[list[Tensor] | None, Tensor]:
    """Step 5, AADL's moving average (`aadl_func._src.average`), decided on the window
    of plain iterates before any mix: `(the window mean, whether it replaces the params)`.
    When it applies, the window is too noisy to extrapolate from, so the call does not mix
    (nor evaluate the safeguard's losses)."""
    if not call.options.average or call.plain:
        return None, flags.FALSE

    def average() -> tuple[list[Tensor], Tensor]:
        return window_average(
            window.anchor,
            window.ring,
            window.grams.gram,
            window.head,
            window.window_size,
            tol=call.options.average_tol,
            compute_dtypes=call.compute_dtypes,
        )

    no_mean = [torch.zeros_like(a, dtype=c) for a, c in zip(window.anchor, call.compute_dtypes)]
    return call.blend.select(window.window_size >= 2, average, (no_mean, flags.FALSE))


def extrapolate(call: Call, window: Window, store: Tensor) -> tuple[list[Tensor], Tensor]:
    """Step 3: the mix $x^+ = y - \\sum_j c_j \\Delta x_j$ (compute dtype, history
    device) and whether it is usable (solved and finite)."""
    solution = solve(
        call, window.ring, window.grams, window.head, window.num_residuals, window.reduction
    )
    minus_c = aadl_coefficients(solution.weights.alpha, call.options.relaxation, negated=True)
    anchor = window.anchor
    into = _mix_into_params(call, anchor, store)
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


def move_newest(call: Call, window: Window, x_hist: list[Tensor], x: list[Tensor]) -> Window:
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
    """The largest magnitude of the combination's base on this rank: the anchor, old or new
    (`y = x + u`, bounded by `max|x| + max|u|`, also when `x` already holds `y`)."""
    device = call.compute_device
    anchor = distributed.max_abs(call.anchor, device)
    newest = distributed.max_abs(call.params, device) + distributed.max_abs(call.updates, device)
    return torch.maximum(anchor, newest)


def last_plain_step(call: Call) -> list[Tensor]:
    """The previous call's plain step $y_{k-1}$: the anchor (the newest plain iterate,
    stored on every call with `store_each_nth = 1`), as a fresh tensor."""
    return [a.clone() for a in call.anchor]

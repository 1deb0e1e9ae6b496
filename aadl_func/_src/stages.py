r"""The stages of one `update` call that both modes share.

`aadl_func._src.update.update()`, with the mode's functions (`aadl_func._src.aadl_step`,
`aadl_func._src.classic_step`), is a short sequence of these stages:

1. `plain_step()` -- the inner optimizer's step $y = g(x)$;
2. `append()` -- the new residual joins the ring and its Gram rows the float64 Grams;
3. `commit_plain()` -- the commit point: the caller now holds a finished plain step;
4. `solve()` -- the mixing weights of the window's least-squares problem;
5. the mode's own combination (`aadl_func._src.window.combine()`), then `finite()`
   and the options' acceptance rule (`aadl_func._src.acceptance`) -- accept or reject the mix;
6. `output()` and `commit()` (`aadl_func._src.exec.inplace`) -- the returned params and
   the final state.

Every stage takes the `Call` (the call's inputs, read-only: `aadl_func._src.update_call`)
and returns what it computed; nothing is handed from one stage to another through shared
attributes. The execution concerns a stage meets are left to the module that owns them: a
gate without a value (vmap, torch.compile) to the call's `aadl_func._src.blend.Blend`, the
window passes' backends to `aadl_func._src.window`, an eager in-place call's commits and
recovery to `aadl_func._src.exec.inplace`, sharded params' reduction to
`aadl_func._src.exec.sharded`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import deferred, flags, tree
from aadl_func._src.core import accept
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.lstsq import MixingWeights
from aadl_func._src.core.ring import slot_valid
from aadl_func._src.core.scalars import float64_tensor, real_view
from aadl_func._src.core.weights import known_weights, window_weights
from aadl_func._src.exec.inplace import commit
from aadl_func._src.exec.ops import OPS
from aadl_func._src.exec.sharded import Reduction, certified_finite, reduce_rows, shard_factor
from aadl_func._src.state import AndersonState
from aadl_func._src.update_call import Call, advance, may_mix, stores_on
from aadl_func._src.window import difference_rows, set_gram_row, window_factor, write_slot

__all__ = [
    "Solution",
    "append",
    "commit_plain",
    "count_outcome",
    "finite",
    "gate",
    "output",
    "plain_step",
    "replace_newest",
    "reset_streak",
    "revert",
    "solve",
    "stores",
    "to_history",
    "to_params",
    "window_tree",
]

Params = Any


class Solution(NamedTuple):
    """`solve()`'s result.

    Attributes:
      weights: the [`MixingWeights`][aadl_func.MixingWeights] (chronological).
      order: the chronological slot order for `to_ring_order()`.
      reduction: sharded params only, the call's `Reduction` (else None).
      norms: sharded params only, $\\|f_i\\|$ chronological (else None).
    """

    weights: MixingWeights
    order: Tensor | int
    reduction: Reduction | None = None
    norms: Tensor | None = None


# -- the plain step ---------------------------------------------------------------------------
def plain_step(call: Call) -> list[Tensor]:
    """`y = x + u`: the plain step, written into the params' buffers if `inplace`."""
    if call.inplace:
        if call.progress is not None and not call.blend.active():
            stepped = call.progress.stepped  # each leaf recorded in its add's statement
            for p, u in zip(call.params, call.updates):
                stepped.append(p.add_(u))
            return list(stepped)
        if not call.blend.active():
            return [p.add_(u) for p, u in zip(call.params, call.updates)]
        for p, u in zip(call.params, call.updates):
            call.blend.assign(p, p + u)  # inside a blended select (skip_nonfinite, traced)
        return call.params
    return [p + u for p, u in zip(call.params, call.updates)]


def owned(call: Call, values: list[Tensor], callers: list[Tensor]) -> list[Tensor]:
    """`values` with copies of those that are the caller's own tensors.

    The window must own its buffers, or a caller writing into what it passed or got back
    (`x.copy_(new)`, a later in-place step) corrupts it. In-place steps copy into the
    window's slots anyway, so nothing needs cloning there.
    """
    if call.inplace:
        return values
    return [v.clone() if v is c else v for v, c in zip(values, callers)]


def store_anchor(
    call: Call, anchor: list[Tensor], values: list[Tensor], callers: list[Tensor]
) -> list[Tensor]:
    """The anchor after `anchor = values` (the newest entry, in the params' dtype): copied
    into its buffers in place, else `values` owned by the window (`callers`: the caller's
    tensors that `values` may be, see `owned()`)."""
    if call.inplace:
        for a, v in zip(anchor, values):
            call.blend.assign(a, v)
        return anchor
    return owned(call, values, callers)


def to_history(leaves: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    """Leaves moved to the window's device/dtype/layout (O(n) per leaf, no-op if there).

    A copy from CUDA to a CPU window lands in page-locked memory (`non_blocking`), all
    leaves in flight at once; the CPU reads the window right away, so we wait for those
    copies once before handing the leaves over (reading them earlier would race).
    """
    moved, streams = [], {}
    for v, w in zip(leaves, like):
        moved.append(v.to(device=w.device, dtype=w.dtype, non_blocking=True))
        if v.is_cuda and w.device.type == "cpu" and not tree.is_transformed(v):
            streams[v.device] = torch.cuda.current_stream(v.device)
    for stream in streams.values():
        stream.synchronize()
    return [tree.as_layout(v, w) for v, w in zip(moved, like)]


def to_params(call: Call, leaves: list[Tensor]) -> list[Tensor]:
    """Leaves moved to the params' devices and dtypes. From a page-locked CPU window to
    CUDA the copy is asynchronous (stream-ordered before any use of the params)."""
    return [
        v.to(device=p.device, dtype=p.dtype, non_blocking=True) for v, p in zip(leaves, call.params)
    ]


# -- the call-count gates ---------------------------------------------------------------------
def gate(call: Call, window_size: Tensor) -> Tensor:
    """Whether this call mixes: past `wait_iterations`, on the `frequency`, with the
    mode's minimum window (and never in the wrapper's `plain` recovery)."""
    if call.plain:
        return flags.FALSE
    minimum = call.options.rules.min_window
    mixes = may_mix(call)
    size = tree.static_value(window_size)
    known = flags.value(mixes)
    if size is not None and known is not None:
        return flags.known(known and size >= minimum)
    return flags.both(mixes, window_size >= minimum)


def stores(call: Call) -> Tensor:
    """Whether this call stores its plain step in the window (every `store_each_nth`)."""
    if call.count_value is not None:
        return flags.known(stores_on(call.options, call.count_value))
    return stores_on(call.options, call.count)


# -- the ring and its Grams -------------------------------------------------------------------
def append(
    call: Call,
    ring: tuple,
    grams: Grams,
    head: Tensor,
    num_residuals: Tensor,
    residual: list[Tensor],
    g: Tensor | None = None,
) -> tuple[tuple, tuple, Tensor, Tensor, Tensor, Reduction | None]:
    """Writes `residual` into the next slot and updates `grams = (gram, dr_gram, dr_rhs)`.

    `g`: the residual's Gram row when `append_difference()`
    already computed it.

    A residual whose Gram rows are not finite (an Inf/NaN iterate) is zeroed and the window
    restarts from the newest entry, so poisoned data never reaches a later mix.

    Returns `(ring, grams, head, num_residuals, poisoned, reduction)`; `reduction` (sharded
    params only) holds the sums over ranks that `solve()` then uses.
    """
    q = call.q
    slot, _ = advance(head, 1, modulo=q)
    ring = write_slot(ring, slot, residual, call.inplace, call.blend)
    rows = local_rows = difference_rows(ring, slot, call.compute_device, grams.gram, g=g)
    grown, _ = advance(num_residuals, 1, high=q)
    reduction = None
    if call.shards is not None:
        # The state keeps the newest rows as this rank's partial sums; the decisions below
        # use the sums over ranks. A float64 window's factor for this call's mix rides
        # along in the same all_reduce.
        grams, reduction = reduce_rows(
            call, grams, head, rows, shard_factor(call, ring, slot, grown)
        )
        rows = reduction.rows
    stacked = torch.stack(rows)  # (3, Q): one finiteness check for the three rows
    if tree.static_value(grown) != q:  # a full window has no invalid slot to mask
        valid = slot_valid(q, slot, grown).to(stacked.device)
        stacked = torch.where(valid, stacked, 0.0)
    poisoned = flags.negate(flags.all_finite(stacked, call.compute_device))

    def restart() -> tuple:
        if call.blend.active():  # blended into the slot by select: a broadcast zero, no fill
            zeros = [r.new_zeros(()).expand_as(r) for r in residual]
        else:
            zeros = [torch.zeros_like(r) for r in residual]
        return write_slot(ring, slot, zeros, call.inplace, call.blend), Grams(
            *map(torch.zeros_like, grams)
        )

    g, h, c = local_rows
    updated = Grams(set_gram_row(grams.gram, slot, g), set_gram_row(grams.dr_gram, slot, h), c)
    ring, grams = call.blend.select(poisoned, restart, (ring, updated))
    num_residuals = call.blend.select(poisoned, lambda: torch.zeros_like(grown), grown)
    if reduction is not None:
        summed = call.blend.select(poisoned, lambda: tuple(map(torch.zeros_like, rows)), rows)
        reduction = reduction._replace(rows=summed)
    return ring, grams, slot, num_residuals, poisoned, reduction


def replace_newest(call: Call, ring: tuple, grams: Grams, head: Tensor, residual: list[Tensor]):
    """`ring[head] = residual` (the safeguard moved the newest entry) and its Gram rows.

    Only the newest residual changed, so the rows of `head` and `dr_rhs` are recomputed;
    the difference it forms with its successor belongs to the oldest slot, which is unused.
    Sharded, the rows come from this rank's data alone (`direct`): the row of the
    previous residual in `grams` was summed over ranks by this call's reduction.
    """
    ring = write_slot(ring, head, residual, call.inplace, call.blend)
    g, h, c = difference_rows(
        ring, head, call.compute_device, grams.gram, direct=call.shards is not None
    )
    return ring, Grams(set_gram_row(grams.gram, head, g), set_gram_row(grams.dr_gram, head, h), c)


# -- the least-squares problem ----------------------------------------------------------------
def solve(
    call: Call,
    ring: tuple,
    grams: Grams,
    head: Tensor,
    num_residuals: Tensor,
    reduction: Reduction | None = None,
) -> Solution:
    """The mixing weights of the window (chronological) and the chronological slot order
    (a tensor of ring slots; eagerly, the newest slot as an int: see `to_ring_order()`).

    A float64 window: a float64 QR factor of `[DF | f_last]` streamed from the ring
    (summed over ranks by stacking every rank's factor) and
    `aadl_func._src.core.lstsq.solve_factor()`, accurate to `eps * cond(DF)`. Other
    windows: the incrementally kept float64 Gram matrices and
    `aadl_func._src.core.lstsq.solve_differences()` (normal equations, `O(Q^2)`).

    Sharded params: `reduction` is `append()`'s, or made here on a call that stored
    nothing; the `Solution` carries it on to `finite()`.
    """
    gram, dr_gram, dr_rhs = grams
    factor = None
    if call.shards is None:
        newest = tree.static_value(head)
        if call.exact and newest is not None:
            factor = window_factor(ring, head, num_residuals, call.compute_device)
        count = tree.static_value(num_residuals)
        known = known_weights(call.options, grams, newest, count, factor, ops=OPS)
        if known is not None:
            alpha = float64_tensor(known[1])
            return Solution(MixingWeights(known[0], alpha, None, flags.TRUE), newest)
    else:
        if reduction is None:
            factor = shard_factor(call, ring, head, num_residuals)
            (gram, dr_gram, _), reduction = reduce_rows(call, grams, head, factor=factor)
        g, h, dr_rhs = reduction.rows
        gram, dr_gram = set_gram_row(gram, head, g), set_gram_row(dr_gram, head, h)
    if call.exact:
        if reduction is not None:
            factor = reduction.factor  # every rank's, from this call's all_reduce
        elif factor is None:
            factor = window_factor(ring, head, num_residuals, call.compute_device)
    weights, order, residual_sq = window_weights(
        call.options,
        len(ring),
        Grams(gram, dr_gram, dr_rhs),
        head,
        num_residuals,
        call.compute_device,
        exact=call.exact,
        factor=factor,
        ops=OPS,
    )
    if reduction is None:
        return Solution(weights, order)
    return Solution(weights, order, reduction, residual_sq.clamp(min=0.0).sqrt())


# -- accept or reject -------------------------------------------------------------------------
def finite(call: Call, leaves: list[Tensor], solution: Solution) -> Tensor:
    """Whether the mix `leaves` is finite in the params' dtypes (and the solve was)."""
    solved = flags.decision(solution.weights.ok, call.compute_device)
    if call.shards is not None:
        # A local check would differ between ranks; the certificate is the same on all.
        return flags.both(solved, certified_finite(call, solution))
    # Checked against the params' dtype, which the mix is cast to.
    flag = flags.TRUE
    for t, p in zip(leaves, call.params):
        if t.numel() == 0:
            continue
        transformed = tree.is_transformed(t)
        t = real_view(t)  # a complex mix: its real and imaginary parts
        if transformed:
            # Batched, aminmax runs as a per-row reduction ~10x slower than amin + amax.
            low, high = t.amin(), t.amax()
        else:
            low, high = torch.aminmax(t)
        if not transformed and flags.value(flag) is not None:
            # Eager on the CPU: the two values read and compared in Python (no device
            # wait there), which saves the small comparison operations.
            if not accept.in_range(low.item(), high.item(), p.dtype):
                return flags.both(solved, flags.FALSE)
            continue
        flag = flags.both(
            flag, tree.decision(accept.in_range(low, high, p.dtype), call.compute_device)
        )
    return flags.both(solved, flag)


def restarted(call: Call, window_size: Tensor, rejected: Tensor) -> Tensor:
    """`restart_on_reject`, or a rule that restarts (`Acceptance.restarts`): the window
    size after a rejected mix is cut to the newest entry (aadl) or pair (classic); older
    slots count again only once overwritten."""
    if not (call.options.restart_on_reject or call.options.acceptance.restarts):
        return window_size
    known = flags.value(rejected)
    if known is not None:
        return window_size.clamp(max=1) if known else window_size
    return torch.where(rejected, window_size.clamp(max=1), window_size)


def output(
    call: Call, use_mix: Tensor, x: list[Tensor], y: list[Tensor], final: AndersonState
) -> list[Tensor]:
    """The returned params: `x` where `use_mix` else `y`, in the params' buffers if
    `inplace` (`y` already lives there). `final`: the call's final state, which
    `commit()` (`aadl_func._src.exec.inplace`) then makes the caller's.

    In an eager in-place call the final writes start here: from now on an exception
    finishes the call (these copies, then the final commit, see `inplace.recover()`) instead
    of going back to the plain step. It is called after the last `loss_fn` call and every
    computation of the step."""
    chosen = call.blend.select(use_mix, lambda: x, y)
    if call.inplace:
        writes = [(p, v) for p, v in zip(call.params, chosen) if v is not p]
        if call.progress is not None:
            call.progress.writes = writes  # first the writes, then the state they go with
            call.progress.pending = final
        for p, v in writes:
            call.blend.assign(p, v)
        return call.params
    return list(chosen)


# -- the state and its commits ----------------------------------------------------------------
def window_tree(call: Call, name: str, leaves: Any) -> Any:
    """The state field `name` (`anchor`: one list of leaves; `residuals` and
    `iterates`: one list per slot) as trees like `params`. When every leaf is the
    caller's own tensor (a window written in place, or not written) this is the caller's
    own field object: nothing to rebuild, and nothing to write back at a commit."""
    mine = {"anchor": call.anchor, "residuals": call.ring, "iterates": call.iterates}[name]
    if name == "anchor":
        if _same_leaves(leaves, mine):
            return call.state.anchor
        return tree.unflatten(call.spec, list(leaves))
    if len(leaves) == len(mine) and all(_same_leaves(a, b) for a, b in zip(leaves, mine)):
        return getattr(call.state, name)
    return tuple(tree.unflatten(call.spec, list(r)) for r in leaves)


def commit_plain(
    call: Call,
    ring: tuple,
    grams: Grams,
    head: Tensor,
    window_size: Tensor,
    poisoned: Tensor,
    **fields: Any,
) -> AndersonState:
    """The commit point: the state after this call's plain step (the window after its
    append, and the mode's own `fields`), made the caller's; a Ctrl-C deferred so far is
    raised here."""
    state = call.state
    plain = state._replace(
        count=call.count,
        inner_state=call.inner_state,
        skip_streak=reset_streak(call),
        pending_loss=deferred.cleared(state),  # the plain step is no mix to judge
        residuals=window_tree(call, "residuals", ring),
        gram=grams.gram,
        dr_gram=grams.dr_gram,
        dr_rhs=grams.dr_rhs,
        head=head,
        window_size=window_size,
        num_nonfinite=flags.add_if(state.num_nonfinite, poisoned),
        **fields,
    )
    # In place, the caller's state now holds these values: building the final state
    # from it leaves the fields the mix does not change as the caller's own tensors,
    # which the final commit then need not copy again.
    plain = commit(call, plain, plain=True)
    if call.guard is not None:
        call.guard.checkpoint()
    return plain


def reset_streak(call: Call) -> Tensor:
    """`skip_streak` after a call that takes a step: 0 (the state's own tensor if it is
    already 0, so that there is nothing to write back)."""
    streak = call.state.skip_streak
    return call.blend.select(
        flags.known(tree.static_value(streak) == 0),
        lambda: streak,
        lambda: torch.zeros_like(streak),
    )


def count_outcome(
    call: Call,
    plain: AndersonState,
    *,
    gate: Tensor,
    ok: Tensor,
    use_mix: Tensor,
    poisoned: Tensor,
    **fields: Any,
) -> AndersonState:
    """The final state: `plain` with the mix's outcome counted (and the mode's `fields`)."""
    mixable = flags.both(gate, ok)
    rejected = flags.both(mixable, flags.negate(use_mix))
    failed = flags.both(gate, flags.both(flags.negate(ok), flags.negate(poisoned)))
    return plain._replace(
        window_size=restarted(call, plain.window_size, rejected),
        num_mixed=flags.add_if(plain.num_mixed, use_mix),
        num_rejected=flags.add_if(plain.num_rejected, rejected),
        # A poisoned append was counted at the commit; a failed mix on a poisoned call
        # is the same event.
        num_nonfinite=flags.add_if(plain.num_nonfinite, failed),
        pending_loss=deferred.pending_after(call, use_mix, plain.pending_loss),
        **fields,
    )


def revert(call: Call, *, blended: bool) -> tuple[Any, AndersonState]:
    """The call whose `loss` rejected the pending mix (`aadl_func._src.deferred`):
    the previous call's plain step, read from the window by the mode's
    `last_plain_step`, and the state with only `num_rejected`,
    `pending_loss`, `skip_streak` and (`restart_on_reject`) `window_size` changed;
    the inner optimizer's state stays that of the plain step.

    Eagerly the params are written in place through `output()` (an exception then
    finishes the call) and the state is committed. `blended` (the decision has no value:
    vmap, compile): the leaves are returned out of place, and the caller writes them after
    blending them with the kept call's outcome."""
    state = call.state
    y = to_params(call, call.options.rules.last_plain_step(call))
    # `count` stays, as for a skipped call: the inner optimizer took no step (its own step
    # count equals `count`), and the call-count gates count the steps taken.
    final = state._replace(
        num_rejected=state.num_rejected + 1,
        pending_loss=deferred.cleared(state),
        skip_streak=reset_streak(call),
        window_size=restarted(call, state.window_size, flags.TRUE),
    )
    if blended:
        return tree.unflatten(call.spec, y), final
    out = output(call, flags.FALSE, y, y, final)
    return tree.unflatten(call.spec, out), commit(call, final)


# -- small helpers ----------------------------------------------------------------------------
def _same_leaves(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def read_slot(ring: tuple, slot: Tensor) -> list[Tensor]:
    """The leaves of `ring[slot]` (`slot` a 0-d tensor, traced or not)."""
    index = tree.static_value(slot)
    if index is not None:
        return list(ring[index])
    # index_select, not `[slot]`: indexing with a tensor would read its value (torch.compile).
    at = slot.reshape(1)
    return [
        torch.stack([entries[i] for entries in ring]).index_select(0, at.to(ring[0][i].device))[0]
        for i in range(len(ring[0]))
    ]

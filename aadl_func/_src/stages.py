r"""The stages of one `update` call that both modes share.

A mode's step function (`aadl_func._src.aadl_step`, `aadl_func._src.classic_step`)
is a short sequence of these stages:

1. `plain_step()` -- the inner optimizer's step $y = g(x)$;
2. `append()` -- the new residual joins the ring and its Gram rows the float64 Grams;
3. `commit_plain()` -- the commit point: the caller now holds a finished plain step;
4. `solve()` -- the mixing weights of the window's least-squares problem;
5. the mode's own combination (`aadl_func._src.window.combine()`), then `finite()`
   and `safeguard()` -- accept or reject the mix;
6. `output()` and `commit()` -- the returned params and the final state.

Every stage takes the `Call` (the call's inputs, read-only) and returns what it
computed; nothing is handed from one stage to another through shared attributes. The
execution concerns a stage meets are left to the module that owns them: a gate without a
value (vmap, torch.compile) to the call's `aadl_func._src.blend.Blend`, the window passes'
backends to `aadl_func._src.window`, an eager in-place commit to
`aadl_func._src.atomic`, sharded params' reductions to `Reduction` below.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import deferred, distributed, flags, protocols, tree
from aadl_func._src.atomic import InterruptGuard, Progress, write_back
from aadl_func._src.blend import Blend
from aadl_func._src.core import accept
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.lstsq import (
    MixingWeights,
    stack_factors,
)
from aadl_func._src.core.ring import chronological, difference_valid, slot_valid
from aadl_func._src.core.scalars import EXACT, float64_tensor, real_view
from aadl_func._src.core.weights import known_weights, window_weights
from aadl_func._src.exec.ops import OPS
from aadl_func._src.state import AndersonState
from aadl_func._src.validation import scalar_loss
from aadl_func._src.window import difference_factor, difference_rows, set_gram_row, write_slot

if TYPE_CHECKING:
    from aadl_func._src.options import AndersonOptions

__all__ = [
    "Call",
    "Reduction",
    "Solution",
    "advance",
    "append",
    "begin_writes",
    "commit",
    "commit_plain",
    "commit_to",
    "count_outcome",
    "finite",
    "gate",
    "output",
    "plain_step",
    "recover",
    "replace_newest",
    "reset_streak",
    "restart_window",
    "revert",
    "safeguard",
    "solve",
    "stores",
    "to_history",
    "to_params",
    "undo_later",
    "window_tree",
    "window_factor",
]

Params = Any


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
        the call's writes, for `recover()`.
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


class Reduction(NamedTuple):
    """Sharded params: what the call's one all_reduce summed over ranks (`reduce_rows()`).

    Attributes:
      rows: `(g, h, c)`, the newest residual's rows of `gram`, `dr_gram` and `dr_rhs`.
      factor: a float64 window's QR factor of the whole window's differences (else None).
      base_bound: the bound of the combination's base, for `certified_finite()`.
    """

    rows: tuple
    factor: Tensor | None
    base_bound: Tensor


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
def may_mix(call: Call) -> Tensor:
    """The call-count gates of a mix: past `wait_iterations` and on the `frequency`;
    eagerly read from the call's number."""
    options = call.options
    if call.count_value is not None:
        count = call.count_value
        return flags.known(count > options.wait_iterations and count % options.frequency == 0)
    return (call.count > options.wait_iterations) & (call.count % options.frequency == 0)


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
        return flags.known(call.count_value % call.options.store_each_nth == 0)
    return call.count % call.options.store_each_nth == 0


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
            call, grams, head, rows, _shard_factor(call, ring, slot, grown)
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
def window_factor(ring: tuple, head: Tensor, num_residuals: Tensor, device: Any) -> Tensor:
    """The float64 QR factor of `[DF | f_head]` over the valid residuals of `ring`
    (this rank's rows only when sharded): one streaming pass, O(Q^2 n) flops."""
    q = len(ring)
    return difference_factor(
        ring, chronological(q, head), difference_valid(q, num_residuals), device
    )


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
            factor = _shard_factor(call, ring, head, num_residuals)
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


def safeguard(call: Call, gate: Tensor, x: list[Tensor], y: list[Tensor]) -> Tensor:
    """`gate` and `loss_fn(x) < loss_fn(y)` (both finite); `gate` without `loss_fn`."""
    loss_fn = call.loss_fn
    if loss_fn is None:
        return gate

    def decide() -> Tensor:
        with callbacks(call):
            loss_x = scalar_loss("anderson.update", loss_fn(tree.unflatten(call.spec, x)))
            loss_y = scalar_loss("anderson.update", loss_fn(tree.unflatten(call.spec, y)))
        if call.shards is not None:
            loss_x, loss_y = call.shards.mean_losses(loss_x, loss_y)
        better = accept.beats(loss_x, loss_y).reshape(())
        return flags.both(gate, flags.decision(better, call.compute_device))

    return call.blend.select(gate, decide, flags.FALSE)


def restarted(call: Call, window_size: Tensor, rejected: Tensor) -> Tensor:
    """`restart_on_reject`: the window size after a rejected mix is cut to the newest
    entry (aadl) or pair (classic); older slots count again only once overwritten."""
    if not (call.options.restart_on_reject or call.options.line_search):
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
    `commit()` then makes the caller's.

    In an eager in-place call the final writes start here: from now on an exception
    finishes the call (these copies, then the final commit, see `recover()`) instead
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


def commit(call: Call, new_state: AndersonState, *, plain: bool = False) -> AndersonState:
    """Makes `new_state` the caller's: in an eager in-place call its values are written
    into the tensors of the state passed in (which is returned), see atomic.py. The
    copies are from tensors the caller does not hold, so an interrupted commit is finished
    by doing them again (`recover()`). `plain`: the commit point's commit, after which
    an exception goes back to the plain step; after any other commit the call is done."""
    if call.guard is None:
        return new_state
    commit_to(call.state, call.progress, new_state, call.inner_state, _adopts(call), plain=plain)
    return call.state


def commit_to(
    state: AndersonState,
    progress: Progress,
    new_state: AndersonState,
    inner_state: Any,
    adopts: bool,
    *,
    plain: bool = False,
) -> None:
    """`commit()`'s writes: `new_state`'s values into the tensors of `state` (the
    caller's), recorded in `progress`. `adopts`: the caller's inner-state buffers may take
    over `inner_state`'s memory (`adopt()`) at the commit point."""
    progress.pending = new_state
    if plain and inner_state is not state.inner_state and adopts:
        # The built-in inner optimizers' new buffers are fresh tensors: the caller's take
        # over their memory (O(1) each) instead of a copy, and the rest is written back.
        adopt(state.inner_state, inner_state)
        write_back(state, new_state._replace(inner_state=state.inner_state))
    else:
        write_back(state, new_state)
    # Each outcome recorded in one statement, so that no line runs between the two.
    if plain:
        progress.pending, progress.plain = None, True
    else:
        progress.pending, progress.writes, progress.undo = None, [], []


def _adopts(call: Call) -> bool:
    """Whether the inner state's new buffers may be adopted by the caller's."""
    return protocols.adopts_buffers(call.options.inner)


def adopt(target: Any, source: Any) -> None:
    """`target`'s tensors take over the memory of `source`'s (`Tensor.set_`, O(1)),
    leaf by leaf; leaves of another shape, dtype or device are copied. Doing it again is a
    no-op, so an interrupted adoption is finished by repeating it."""
    targets = optree.tree_leaves(target, none_is_leaf=True)
    sources = optree.tree_leaves(source, none_is_leaf=True)
    for dst, src in zip(targets, sources):
        if isinstance(dst, Tensor) and isinstance(src, Tensor) and dst is not src:
            if dst.shape == src.shape and dst.dtype == src.dtype and dst.device == src.device:
                dst.set_(src)
            else:
                dst.copy_(src)


def begin_writes(call: Call) -> None:
    """The first write into the caller's tensors is next: the params' version counters are
    recorded, so that `recover()` knows which leaves hold their plain step (a version
    counter moves with the write itself; `Progress.stepped` backs it up for inference
    tensors, which keep none)."""
    if call.progress is not None:
        # Inference tensors keep no version counter: their leaves go by `stepped` alone.
        call.progress.param_versions = [
            None if p.is_inference() else p._version for p in call.params
        ]


def undo_later(call: Call, targets: list[Tensor], sources: list[Tensor]) -> None:
    """After the commit point: copies `targets[i] <- sources[i]` that restore the plain
    step in tensors about to be written (`sources` must stay as they are until the call
    ends)."""
    if call.progress is not None:
        call.progress.undo.append((targets, sources))


def recover(call: Call) -> None:
    """Turns an exception raised anywhere in an eager in-place call into one complete
    outcome (docs/reliability.md, "The exception guarantee"), by copies only:

    * during a commit (plain, final or skipped): the commit is finished (the final one with
      the output's copies into the params), so the caller holds that state;
    * after the commit point: the params and the window entries written since are put back,
      so the caller holds the plain step (its mix dropped, uncounted);
    * before the commit point, once the writes began: the plain step is completed (params,
      inner state, counters) with the window restarted from it, as after a non-finite
      append (`restart_window()`);
    * before any write (the checks, the inner optimizer's out-of-place update): nothing to
      do, the caller holds the state as it was.

    A second exception while this runs is not handled (one fault at a time).
    """
    progress = call.progress
    if progress.pending is not None:
        for dst, src in progress.writes:
            dst.copy_(src)
        write_back(call.state, progress.pending)
        progress.pending, progress.writes = None, []
    elif progress.plain:
        for targets, sources in progress.undo:
            for dst, src in zip(targets, sources):
                dst.copy_(src)
    elif progress.param_versions is not None:
        restart_window(call)


def restart_window(call: Call) -> None:
    """The plain step of the call, completed in the caller's tensors, with the window
    restarted from it: params `y = x + u` (leaves not yet stepped get their update),
    the inner optimizer's new state, `count` advanced, the anchor `y` the window's only
    entry (mode "aadl": `window_size = 1`; "classic": no pair, `window_size = 0`), the
    Grams zero, `head` one slot on, `skip_streak = 0`; the other counters as they were.
    Ring slots written halfway are outside the window and never read before being
    rewritten (their Gram entries are recomputed then)."""
    state = call.state
    progress = call.progress
    for i, (p, u, version) in enumerate(zip(call.params, call.updates, progress.param_versions)):
        done = i < len(progress.stepped) if version is None else p._version != version
        if not done:
            p.add_(u)
    write_back(state.inner_state, call.inner_state)
    for a, p in zip(call.anchor, call.params):
        a.copy_(p)
    for field in (state.gram, state.dr_gram, state.dr_rhs):
        field.zero_()
    state.head.fill_((int(state.head) + 1) % call.q)
    state.window_size.fill_(0 if call.options.rules.keeps_iterates else 1)
    state.count.fill_(call.count_value)
    state.skip_streak.fill_(0)
    state.pending_loss.fill_(deferred.INF)


def callbacks(call: Call) -> contextlib.AbstractContextManager:
    """Where the user's `loss_fn` runs: interruptible, after a deferred Ctrl-C is raised."""
    return call.guard.callbacks() if call.guard is not None else contextlib.nullcontext()


# -- sharded params (DTensor / FSDP2; see distributed.py) -------------------------------------
def _shard_factor(call: Call, ring: tuple, head: Tensor, num_residuals: Tensor) -> Tensor | None:
    """This rank's factor for the step's all_reduce: float64 windows, on calls that may mix."""
    if not call.exact or flags.value(may_mix(call)) is False:
        return None
    return window_factor(ring, head, num_residuals, call.compute_device)


def reduce_rows(
    call: Call,
    grams: Grams,
    head: Tensor,
    new_rows: tuple | None = None,
    factor: Tensor | None = None,
) -> tuple[Grams, Reduction]:
    """The step's one all_reduce over the shard group.

    Sums over ranks, in one float64 vector: the rows `gram[head]` and `dr_gram[head]` of
    the previous newest residual (kept as this rank's partial sums because the safeguard
    may have replaced that residual after the previous reduction), then either the three
    partial rows of the residual appended now (`new_rows`) or the partial `dr_rhs`,
    then, with `factor` (this rank's `Q x Q` QR factor of a float64 window), a
    `(world, Q, Q)` block holding it in this rank's slot and zeros elsewhere, and this
    rank's bound for `certified_finite()`.

    The sum of the blocks is every rank's factor, in rank order, on every rank; their
    stacked QR (`aadl_func._src.core.lstsq.stack_factors()`) is the factor of the whole
    window, identical on all ranks. (Summing the factors' Gram matrices would square the
    condition number again; a TSQR tree needs a reduction with QR as its operator, which
    collectives do not offer.)

    Returns `(grams with the head rows summed, the Reduction)`.
    """
    q = call.q
    shards = call.shards
    gram, dr_gram, dr_rhs = grams
    device = gram.device
    at = head.to(device)
    tail = list(new_rows) if new_rows is not None else [dr_rhs]
    parts = [gram[at], dr_gram[at], *(t.to(device) for t in tail)]
    rows_end = sum(p.numel() for p in parts)
    world = shards.world_size
    if factor is not None:
        own = torch.arange(world, device=device) == shards.rank
        slots = torch.where(own[:, None, None], factor.to(device)[None], 0.0)
        parts.append(slots.reshape(-1))
    parts.append(_local_base_bound(call).to(device).reshape(1))
    total = shards.all_sum(torch.cat(parts))
    summed_factor = None
    if factor is not None:
        every_rank = total[rows_end : rows_end + world * q * q].reshape(world * q, q)
        summed_factor = stack_factors([every_rank])
    gram = set_gram_row(gram, head, total[:q])
    dr_gram = set_gram_row(dr_gram, head, total[q : 2 * q])
    if new_rows is not None:
        summed = (total[2 * q : 3 * q], total[3 * q : 4 * q], total[4 * q : 5 * q])
    else:
        summed = (total[:q], total[q : 2 * q], total[2 * q : 3 * q])
    return Grams(gram, dr_gram, dr_rhs), Reduction(summed, summed_factor, total[-1])


def _local_base_bound(call: Call) -> Tensor:
    """This rank's bound of the combination's base (the mode's rule); 0 if no mix can happen."""
    known = flags.value(may_mix(call))
    if known is not None and not known:
        return torch.zeros((), dtype=torch.float64, device=call.compute_device)
    return call.options.rules.base_bound(call)


def certified_finite(call: Call, solution: Solution) -> Tensor:
    r"""Whether the mix is certainly finite, from reduced quantities only (same on all ranks):
    the mode's bound of every entry of the mix (from the summed base bound and
    $\|r_s\| = \sqrt{G_{ss}}$) is at most half the largest value of the parameter and
    compute dtypes."""
    bound = call.options.rules.mix_bound(
        call.options, solution.weights.alpha, solution.norms, solution.reduction.base_bound
    )
    return tree.decision(bound <= call.overflow_limit, call.compute_device)


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
    at least float32), and the overflow limit of `finite()`'s certificate: half the
    largest value of every params and compute dtype. Cached for eager calls, which ask on
    every step (a traced step computes it once, at trace time)."""
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

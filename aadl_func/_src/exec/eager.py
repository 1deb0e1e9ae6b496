r"""The eager executor: one `update` call whose decisions are Python values.

A plain eager call on CPU tensors knows every decision of its step as a Python value (the
counters are read once; a finiteness test is one `aminmax`): whether it stores, whether
it mixes, whether the mix is finite. This executor runs the step as the numbered stages of
[`aadl_func.anderson()`][aadl_func.anderson]'s docstring, in straight-line code over
explicit tensors, with the same tensor operations as the general path
(`aadl_func._src.update.update()` and its stages, which serve vmap, torch.compile,
sharded params and the other options) and therefore the same bits. What it leaves out is
the general path's machinery: no `Call`, no blends, no decision tensors.

In place, the protocol is the general path's (`aadl_func._src.atomic`): the same commit
point, the same `Progress` record and, on an exception anywhere, the same recovery
(`aadl_func._src.exec.inplace.recover()`), so the exception guarantee of docs/reliability.md holds
unchanged. A pure call builds a new window and state as the general path does, sharing the
tensors the call leaves as they were.

Which calls it takes (`applies()`): eager and outside any torch.func transform, unsharded,
real CPU params with their window and Grams on the CPU, no `loss_fn`, moving average or
`skip_nonfinite`, and no deferred rejection to carry out (the general path reverts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import deferred, flags, protocols, stages, tree, update_call
from aadl_func._src.acceptance import SAFEGUARD
from aadl_func._src.atomic import InterruptGuard, Progress, guarded
from aadl_func._src.checks import mark_verified
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.exec import inplace, passes
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState
from aadl_func._src.window import append_difference

__all__ = ["applies", "run"]

_INT64 = torch.int64


def applies(
    options: AndersonOptions,
    state: AndersonState,
    p_leaves: list[Tensor],
    *,
    inplace: bool,
    loss_fn: Any,
    mix: bool,
    shards: Any,
    transformed: bool,
) -> bool:
    """Whether this executor runs the call (see the module docstring)."""
    if transformed or shards is not None or loss_fn is not None or not mix:
        return False
    if options.average or options.skip_nonfinite or options.acceptance is not SAFEGUARD:
        return False  # (the fast paths run the default acceptance rule only)
    if options.rules.eager_steps is None:
        return False  # a mode without a straight-line sequence here
    if tree.tracing():
        return False
    if _functorch.maybe_current_level() is not None:
        # Inside vmap or grad: a leaf of the state, the grads or the inner updates may be
        # batched or differentiated even when the params are not.
        return False
    if not state.gram.is_cpu:
        return False
    for p, a in zip(p_leaves, tree.flatten(state.anchor, "state.anchor")[0]):
        if not p.is_cpu or p.is_complex() or not a.is_cpu:
            return False
    return True


def _read_counters(state: AndersonState) -> list[int]:
    """`count`, `head`, `window_size`, `skip_streak` and `num_mixed` as Python ints, each
    read once a call (0-d int64 tensors, checked). One `.item()` each: a read costs less
    than one `torch.stack` of them."""
    return [
        c.item()
        for c in (state.count, state.head, state.window_size, state.skip_streak, state.num_mixed)
    ]


def _counter(value: int) -> Tensor:
    return torch.scalar_tensor(value, dtype=_INT64)


def run(
    options: AndersonOptions,
    state: AndersonState,
    params: Any,
    p_leaves: list[Tensor],
    spec: Any,
    grads: Any,
    loss: Tensor | None,
    *,
    inplace: bool,
) -> tuple[Any, AndersonState] | None:
    """The call, or None, having written nothing, when a deferred rejection is due (the
    general path carries it out)."""
    if flags.value(deferred.rejects(state, loss)):
        return None  # the deferred safeguard rejects the pending mix: the general path reverts
    if not inplace:
        out, new_state = _call(options, state, params, p_leaves, spec, grads, loss, None)
        mark_verified(new_state, made_from=state)  # as anderson._returned marks it
        return out, new_state
    guard = InterruptGuard()
    return guarded(guard, lambda: _call(options, state, params, p_leaves, spec, grads, loss, guard))


def _call(options, state, params, p_leaves, spec, grads, loss, guard) -> tuple[Any, Any]:
    # In place, the inner update out of place when the inner optimizer keeps buffers: their
    # new values are committed with the plain step (as on the general path, anderson.step).
    keeps_buffers = protocols.keeps_buffers(options.inner)
    in_place = guard is not None and not keeps_buffers and not deferred.reads_grads(options, loss)
    updates, inner_state = options.inner.update(
        grads, state.inner_state, params=params, inplace=in_place
    )
    u_leaves, u_spec = tree.flatten(updates, "inner updates")
    tree.check_like("inner updates", u_leaves, u_spec, p_leaves, spec, owner="anderson.update")
    if deferred.reads_grads(options, loss):
        loss = deferred.bar(options, loss, tree.flatten(grads, "grads")[0], u_leaves)
    step = _Step(options, state, p_leaves, spec, u_leaves, inner_state, loss, guard)
    try:
        out = step.classic() if options.rules.eager_steps == "classic" else step.aadl()
    except BaseException:
        step.recover()
        raise
    return tree.unflatten(spec, out), step.current


class _Step:
    """One call: its inputs, the counters as Python values, the window's leaves as the call
    changes them and, in place, the `Progress` of its writes."""

    __slots__ = (
        "options",
        "state",
        "params",
        "spec",
        "updates",
        "inner_state",
        "loss",
        "guard",
        "inplace",
        "progress",
        "current",
        "q",
        "count",
        "head",
        "size",
        "anchor",
        "ring",
        "iterates",
        "compute_dtypes",
        "streak",
        "mixed",
    )

    def __init__(self, options, state, params, spec, updates, inner_state, loss, guard):
        self.options, self.state, self.params, self.spec = options, state, params, spec
        self.updates, self.inner_state, self.loss, self.guard = updates, inner_state, loss, guard
        self.inplace = guard is not None
        self.progress = Progress() if self.inplace else None
        self.current = state  # the state as of the last commit (pure: as built so far)
        self.q = options.num_slots
        count, self.head, self.size, self.streak, self.mixed = _read_counters(state)
        self.count = count + 1  # this call's number
        self.anchor = tree.flatten(state.anchor, "state.anchor")[0]
        self.ring = tuple([tree.flatten(r, "state.residuals")[0] for r in state.residuals])
        self.iterates = tuple([tree.flatten(r, "state.iterates")[0] for r in state.iterates])
        self.compute_dtypes = update_call._arithmetic(
            options.history_dtype, tuple([p.dtype for p in params])
        )[0]

    # -- the two modes ------------------------------------------------------------------------
    def classic(self) -> list[Tensor]:
        """Mode "classic" (`aadl_func._src.classic_step`)."""
        options, state = self.options, self.state
        self.begin_writes()
        grams = Grams.of(state)
        head, size, poisoned = self.head, self.size, False
        stored = update_call.stores_on(options, self.count)
        if stored:
            # The pair (x_k, g(x_k) - x_k), stored before the step overwrites x_k.
            head = (self.head + 1) % self.q
            point = _to_history(self.params, self.anchor)
            steps = [(x - a).to(d.dtype) for x, a, d in zip(point, self.anchor, self.iterates[0])]
            self.iterates = self.put(self.iterates, head, _to_history(steps, self.iterates[0]))
            residual = self.own(_to_history(self.updates, self.ring[0]), self.updates)
            self.ring = self.put(self.ring, head, residual)
            grams, size, poisoned = self.append(grams, head, size)
            self.set_anchor(point, self.params)
        y = self.plain_step()
        self.commit_plain(grams, head, size, poisoned, stored)
        if not self.mixes(size, options.rules.min_window):
            return self.finish(False, False, poisoned, y)
        alpha, solved = passes.mixing_weights(self.options, self.ring, grams, head, size)
        relaxation = options.relaxation
        scaled = [relaxation * a for a in alpha] if isinstance(alpha, list) else relaxation * alpha
        coefficients = passes.ring_order(head, classic_coefficients(alpha), scaled)
        steps = self.combine(None, [self.iterates, self.ring], coefficients)
        x_hist = [v.add_(a) for v, a in zip(steps, self.anchor)]
        ok = passes.finite(x_hist, self.params, solved)
        x = stages.to_params(self, x_hist) if ok else y
        return self.finish(True, ok, poisoned, x)

    def aadl(self) -> list[Tensor]:
        """Mode "aadl" (`aadl_func._src.aadl_step`)."""
        options, state = self.options, self.state
        self.begin_writes()
        y = self.plain_step()
        grams = Grams.of(state)
        head, size, poisoned = self.head, self.size, False
        num_residuals = max(self.size - 1, 0)
        stored = update_call.stores_on(options, self.count)
        if stored:
            y_hist = _to_history(y, self.anchor)
            anchor_stored = False
            if self.count - 1 >= options.store_each_nth:  # the window holds an entry
                head = (self.head + 1) % self.q
                g = self.store_difference(head, y_hist)
                anchor_stored = g is not None
                grams, num_residuals, poisoned = self.append(grams, head, num_residuals, g)
                size = num_residuals + 1
            else:
                size = 1
            if not anchor_stored:  # the fused append copied y already
                self.set_anchor(y_hist, y)
        self.commit_plain(grams, head, size, poisoned, stored)
        current = self.current
        grams = Grams.of(current)  # in place: the caller's
        if not self.mixes(size, options.rules.min_window):
            return self.finish(False, False, poisoned, y)
        alpha, solved = passes.mixing_weights(self.options, self.ring, grams, head, num_residuals)
        minus_c = aadl_coefficients(alpha, options.relaxation, negated=True)
        into = self.params if self.inplace and stored and self._mixes_into_params() else None
        if into is not None:
            # The params hold y, bit for bit the anchor: accumulate the mix there.
            self.progress.undo.append((self.params, self.anchor))
        try:
            base = self.anchor if into is None else into
            x_hist = self.combine(base, [self.ring], passes.ring_order(head, minus_c), out=into)
            ok = passes.finite(x_hist, self.params, solved)
        except BaseException:
            if into is not None:
                _write(self.params, self.anchor)  # back to y
            raise
        if into is not None and not ok:
            _write(self.params, self.anchor)
        x = stages.to_params(self, x_hist) if ok else y
        return self.finish(True, ok, poisoned, x)

    # -- writing the window: in place, or a new window --------------------------------------
    def put(self, ring: tuple, slot: int, values: list[Tensor]) -> tuple:
        """`ring[slot] = values`: copied into the slot's buffers in place, else a new ring
        (`aadl_func._src.window.write_slot()`)."""
        if self.inplace:
            _write(ring[slot], values)
            return ring
        return tuple(list(values) if s == slot else entry for s, entry in enumerate(ring))

    def own(self, values: list[Tensor], callers: list[Tensor]) -> list[Tensor]:
        """`aadl_func._src.stages.owned()`: the window never holds the caller's tensors."""
        if self.inplace:
            return values
        return [v.clone() if v is c else v for v, c in zip(values, callers)]

    def set_anchor(self, values: list[Tensor], callers: list[Tensor]) -> None:
        """The anchor becomes `values` (`aadl_func._src.stages.store_anchor()`)."""
        if self.inplace:
            _write(self.anchor, values)
        else:
            self.anchor = self.own(values, callers)

    def plain_step(self) -> list[Tensor]:
        """`y = x + u`, into the params in place (each leaf recorded as it is stepped)."""
        if not self.inplace:
            return [p + u for p, u in zip(self.params, self.updates)]
        stepped = self.progress.stepped
        for p, u in zip(self.params, self.updates):
            stepped.append(p.add_(u))
        return self.params

    def store_difference(self, slot: int, y_hist: list[Tensor]) -> Tensor | None:
        """Mode "aadl": `ring[slot] = y - anchor` (`aadl_step._difference()`); in place
        straight into the slot, with the anchor copy and the Gram row fused where the
        native kernel applies (its row is returned)."""
        if not self.inplace:
            history_dtype = self.options.history_dtype_of
            residual = [(yh - a).to(history_dtype(a)) for yh, a in zip(y_hist, self.anchor)]
            self.ring = self.put(self.ring, slot, _to_history(residual, self.ring[0]))
            return None
        g = append_difference(self.ring, slot, y_hist, self.anchor, self.state.gram.device)
        if g is None:
            for yh, a, r in zip(y_hist, self.anchor, self.ring[slot]):
                torch.sub(yh, a, out=r)
        return g

    # -- the stages ---------------------------------------------------------------------------
    def begin_writes(self) -> None:
        """See `aadl_func._src.exec.inplace.begin_writes()`."""
        if self.inplace:
            self.progress.param_versions = [
                None if p.is_inference() else p._version for p in self.params
            ]

    def append(
        self, grams: Grams, slot: int, num_residuals: int, g: Tensor | None = None
    ) -> tuple[tuple, int, bool]:
        """The Gram rows of the residual written in `slot` (`stages.append()`): the new
        grams, the number of residuals and whether the append was poisoned (non-finite
        rows: the slot and the grams are zeroed, the window restarts)."""
        grown = min(num_residuals + 1, self.q)
        appended = passes.appended_grams(self.ring, slot, grams, grown, g)
        if appended is not None:
            return appended, grown, False
        self.ring = self.put(self.ring, slot, [torch.zeros_like(r) for r in self.ring[slot]])
        return Grams(*map(torch.zeros_like, grams)), 0, True

    def combine(
        self, base: list[Tensor] | None, rings: list[tuple], weights: Tensor, out: Any = None
    ) -> list[Tensor]:
        """`base + sum_s weights[s] slot_s` per leaf (`passes.combine()`)."""
        return passes.combine(self.anchor, self.compute_dtypes, base, rings, weights, out)

    def commit_plain(
        self, grams: Grams, head: int, size: int, poisoned: bool, stored: bool
    ) -> None:
        """The commit point (`stages.commit_plain()`): the state of the plain step, which an
        in-place call makes the caller's (a Ctrl-C deferred so far is raised here)."""
        state = self.state
        plain = state._replace(
            count=self.counter(state.count, self.count - 1, self.count),
            inner_state=self.inner_state,
            skip_streak=self.zero_streak(),
            pending_loss=deferred.cleared(state),
            gram=grams.gram,
            dr_gram=grams.dr_gram,
            dr_rhs=grams.dr_rhs,
            head=self.counter(state.head, self.head, head),
            window_size=self.counter(state.window_size, self.size, size),
            num_nonfinite=state.num_nonfinite + 1 if poisoned else state.num_nonfinite,
        )
        if not self.inplace:
            self.current = plain._replace(
                residuals=self.window_tree(state.residuals, self.ring),
                anchor=self.window_tree(state.anchor, self.anchor),
                iterates=self.window_tree(state.iterates, self.iterates),
            )
            return
        inplace.commit_to(state, self.progress, plain, self.inner_state, self._adopts(), plain=True)
        self.guard.checkpoint()

    def counter(self, tensor: Tensor, old: int, new: int) -> Tensor | int:
        """A counter of the plain step's state: `tensor`, the state's own, when its value
        `old` stays; else in place the value itself, which the commit writes into `tensor`
        (`atomic.write_back()`), or a new tensor."""
        if new == old:
            return tensor
        return new if self.inplace else _counter(new)

    def window_tree(self, field: Any, leaves: Any) -> Any:
        """The state's field as trees like `params` (`stages.window_tree()`): the field
        itself when every leaf is still its own."""
        if isinstance(leaves, list):  # the anchor
            same = _same(tree.flatten(field, "state.anchor")[0], leaves)
            return field if same else tree.unflatten(self.spec, list(leaves))
        mine = tuple([tree.flatten(r, "state window")[0] for r in field])
        if len(mine) == len(leaves) and all(_same(a, b) for a, b in zip(mine, leaves)):
            return field
        return tuple(tree.unflatten(self.spec, list(r)) for r in leaves)

    def zero_streak(self) -> Tensor:
        streak = self.state.skip_streak
        return streak if self.streak == 0 else torch.zeros_like(streak)

    def mixes(self, size: int, minimum: int) -> bool:
        """The call-count gates and the mode's minimum window (`stages.gate()`)."""
        return update_call.mixes_on(self.options, self.count) and size >= minimum

    def finish(self, mixes: bool, ok: bool, poisoned: bool, x: list[Tensor]) -> list[Tensor]:
        """The final state (`stages.count_outcome()`) and the returned params (`output()`),
        written and committed in place."""
        current = self.current
        pending = deferred.pending_after(self, flags.known(ok), current.pending_loss)
        failed = mixes and not ok and not poisoned  # a poisoned call was counted at the commit
        final = current._replace(
            num_mixed=self.counter(
                current.num_mixed, self.mixed, self.mixed + 1 if ok else self.mixed
            ),
            num_nonfinite=current.num_nonfinite + 1 if failed else current.num_nonfinite,
            pending_loss=pending,
        )
        if not self.inplace:
            self.current = final
            return list(x)
        writes = [(p, v) for p, v in zip(self.params, x) if v is not p]
        self.progress.writes, self.progress.pending = writes, final
        for p, v in writes:
            p.copy_(v)
        inplace.commit_to(self.state, self.progress, final, None, False)
        return self.params

    def recover(self) -> None:
        """An exception anywhere: one complete outcome, as on the general path."""
        if self.progress is None or self.progress.param_versions is None:
            return  # nothing written
        call = update_call.Call(
            self.options,
            self.state,
            self.params,
            self.spec,
            self.updates,
            self.inner_state,
            inplace=True,
            loss_fn=None,
            loss=self.loss,
            guard=self.guard,
        )
        call.count, call.count_value = _counter(self.count), self.count
        call.progress = self.progress
        inplace.recover(call)

    def _adopts(self) -> bool:
        return protocols.adopts_buffers(self.options.inner)

    def _mixes_into_params(self) -> bool:
        """`aadl_step._mix_into_params()`: the params' buffers can take the mix."""
        for p, a, c in zip(self.params, self.anchor, self.compute_dtypes):
            if not (p.dtype == a.dtype == c) or (p.device, p.stride()) != (a.device, a.stride()):
                return False
        return True


def _to_history(leaves: list[Tensor], like: list[Tensor]) -> list[Tensor]:
    """`aadl_func._src.stages.to_history()`: the leaves themselves when each already has
    its window leaf's dtype and strides on the CPU (there every move is a no-op)."""
    for v, w in zip(leaves, like):
        if not (v.dtype == w.dtype and v.is_cpu and w.is_cpu and v.stride() == w.stride()):
            return stages.to_history(leaves, like)
    return list(leaves)


def _write(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    for dst, src in zip(targets, sources):
        if src is not dst:
            dst.copy_(src)


def _same(a: Sequence[Tensor], b: Sequence[Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))

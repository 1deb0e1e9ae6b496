r"""The steady in-place call: a full window and a plan kept with the state.

Most calls of a training loop look alike: eager and in place, on the same params tensors,
with the window full, storing and mixing. The eager executor (`aadl_func._src.exec.eager`)
reads each of them from the state and checks every input again. Here what cannot have
changed since the previous call is kept with the state in a `Plan` (`aadl_func._src.exec.plan`,
`aadl_func._src.verified_states.set_memo()`): the params' leaves, each leaf's window
slots as one matrix, the native kernel's pointers and output buffers, the counters as Python
ints, and a built-in inner optimizer's buffers with its count. A plan holds while every
tensor it copies or writes behind torch's back keeps the version counter the previous call
left it with: whatever wrote one since (the caller, the executor, a recovery, a
`load_state_dict`) moved it, and the next call builds the plan again from the tensors. What
can change between calls is checked each call as
`aadl_func._src.checks.check_update_inputs()` would check it (any mismatch goes to the
checked path): the grads against the params, and params tensors other than the plan's (the
wrapper passes fresh copies) for their shapes, layout and memory.

The call is the executor's, operation for operation, so it gives its bits
(tests/test_steady_step.py holds every byte of params and state to it), except for its
bookkeeping, which the native kernel does in fewer calls with the same bytes: the whole
tree's append and Gram row (`native.LeafRows`), the Gram rows of the append from it and the
committed Gram (`LeafRows.known_rows()`, `window.known_rows()`'s subtractions), the commit
point's stores into the Grams and counters (`native.commit_rows()`, done again by
`_Call._recover()` if an exception cuts them short), and the small system read from the
committed Grams (`native.System`, `core.lstsq.solve_known()`'s divisions). A built-in Adam
runs by its known rule on the buffers the plan keeps (`inner_bound.BoundRule`); another
built-in inner optimizer on the leaves the plan checked (`update.update_leaves`). Mode
"aadl": the inner update, then one pass of the fused append (`y = x + u` into the params
where the updates allow, `plan.steps_fit()`, else added first; plain SGD's `u = -lr g`
formed in that pass from the grads, which it then only reads, `_Call._scaled_in_append()`;
the newest difference into its slot, the anchor, the Gram row, the largest values of `y` and
of that difference), the commit point, the small solve
(`aadl_func._src.core.lstsq.solve_known_scaled()`),
`x^+ = y - sum_j c_j \Delta x_j` accumulated in the params, the finiteness test (skipped
where the window's maxima bound the mix: `native.LeafRows.mix_bounded()`) and the final
commit. Mode "classic": the
pair `(x_k - anchor, u_k)` into its slots and its Gram row first, then the anchor and the
plain step, and the mix over both rings. A call off the `frequency` (or within
`wait_iterations`) stores and commits the same way and stops before the solve. A call off
`store_each_nth` takes its plain step, commits it with the window as it is and, on the gates,
mixes that window as the executor does (mode "aadl": out of place, from the anchor). Its
`Progress` record is the executor's, so an exception anywhere ends as there
(`aadl_func._src.exec.inplace.recover()`).
A poisoned append (a non-finite Gram row) or a small solve that fails goes on as the
executor does.

The deferred safeguard (`loss=`): the verdict on the pending mix is read from the plan's
Python value of `pending_loss`; a kept mix (or none pending) goes on as above, the commit
point clears the bar and a returned mix sets it to the call's loss, as in the executor
(`aadl_func._src.deferred`); a rejection reverts to the previous call's plain step as the
general path does (`stages.revert()`: no inner step), without `restart_on_reject`.

Which calls `run()` takes (else it returns None, having written nothing): an eager in-place
`update` without `loss_fn` and outside any torch.func transform, in either mode, without the
moving average, `skip_nonfinite`, an acceptance rule other than the default (`line_search`),
a per-column ridge, or `sufficient_decrease` with `loss`, and not a deferred rejection that
restarts the window (`restart_on_reject`);
float32 CPU params and windows laid out as `anderson.init` lays them out, with the native
kernel; a full window.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import kernels, native, tree, update_call
from aadl_func._src.atomic import InterruptGuard, Progress, guarded, write_back
from aadl_func._src.checks import check_update_inputs
from aadl_func._src.core import accept
from aadl_func._src.core.grams import Grams
from aadl_func._src.core.variants import aadl, classic
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.exec import inplace, passes
from aadl_func._src.exec import plan as plans
from aadl_func._src.exec import steady_weights as weigh
from aadl_func._src.exec.eager import _write
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState
from aadl_func._src.verified_states import memo, set_memo

__all__ = ["run"]

_FLOAT32 = torch.float32
_INF = math.inf


def run(
    options: AndersonOptions, state: Any, params: Any, grads: Any, loss: Tensor | None = None
) -> tuple[Any, AndersonState] | None:
    """The steady call (see the module docstring), or None, having written nothing. `loss`:
    the deferred safeguard's, as `deferred.check_loss()` returns it."""
    if _functorch.maybe_current_level() is not None or tree.tracing():
        return None
    if loss is not None and options.sufficient_decrease:
        return None  # its bar reads the grads (`deferred.bar`): the executor's
    if not isinstance(state, AndersonState) or state.pending_loss is None:
        return None
    plan = memo(state)
    try:
        leaves, spec = plans.flatten(params, "params", plan)
        g_leaves, g_spec = plans.flatten(grads, "grads", plan)
    except Exception:  # noqa: BLE001 (the checked path says what is wrong, as always)
        return None
    if any(type(t) is not Tensor for t in (*leaves, *g_leaves)):
        return None  # sharded (DTensor) params, grads that are not tensors, ...
    if type(plan) is plans.Unplannable:
        if plan.options is options and plan.native == native.available():
            return None
        plan = None
    if plan is None or plan.options is not options or plan.versions != plans.versions(plan):
        if not plans.steady_window(options, state):
            return None
        # A new plan is made from inputs that pass every check of the executor's call (which
        # raise here as they would there, before anything is written).
        check_update_inputs(options, state, params, grads, None, True)
        plan = plans.new_plan(options, state, leaves, spec)
        set_memo(state, plan or plans.Unplannable(options, native.available()))
        if plan is None:
            return None
    if not (spec == plan.spec == g_spec and plans.params_fit(leaves, plan)):
        return None
    if not (plan.plain_in_params or plans.grads_fit(g_leaves, leaves)):
        return None  # (the wrapper's `-0`s, made for these params, need no check)
    # The deferred verdict on the pending mix (`deferred.rejects`, on Python floats).
    value = None if loss is None else float(loss)
    rejected = value is not None and accept.rejects_pending(plan.pending, value)
    if rejected and options.restart_on_reject:
        return None  # the window restarts: the general path's
    guard = InterruptGuard()
    call = _Call(plan, state, params, leaves, grads, g_leaves, guard, loss, value)
    out = guarded(guard, call.revert if rejected else call.run)
    if call.steady:
        plan.versions = plans.versions(plan)
    else:  # the window restarted: the next calls are not steady
        set_memo(state, None)
    return (tree.unflatten(plan.spec, out) if plan.list_size is None else list(out)), state


class _Call:
    """One steady call: the executor's stages (`aadl_func._src.exec.eager._Step`'s `aadl()`
    and `classic()`) over the plan's tensors and values."""

    def __init__(
        self,
        plan: plans.Plan,
        state: AndersonState,
        params: Any,
        leaves: list[Tensor],
        grads: Any,
        g_leaves: list[Tensor],
        guard: InterruptGuard,
        loss: Tensor | None,
        loss_value: float | None,
    ) -> None:
        self.plan, self.state, self.guard = plan, state, guard
        self.params, self.leaves, self.grads, self.g_leaves = params, leaves, grads, g_leaves
        self.loss, self.loss_value = loss, loss_value
        self.count = plan.count + 1  # this call's number
        self.mixes = update_call.mixes_on(plan.options, self.count)
        self.stores = update_call.stores_on(plan.options, self.count)
        self.progress = Progress()
        self.updates: list[Tensor] = []
        self.inner_state: Any = state.inner_state
        # The bound rule's new buffers (`plan.bound`), adopted at the commit point, and the
        # inner count after this call's update.
        self.new_fields: list | None = None
        self.inner_done = plan.inner_count
        self.steady = True  # the plan still describes the state after the call
        self.committing: int | None = None  # the commit point's slot, while it writes
        self.stepping = False  # the plain step is the append's (`_append()`)
        # Plain SGD's update formed in the append's pass: `updates` are then the grads,
        # which the append multiplies by `scale` (`_scaled_in_append()`).
        self.scale: float | None = None

    def run(self) -> list[Tensor]:
        plan, state = self.plan, self.state
        if self._scaled_in_append():
            return self._stepped()
        # The inner update out of place when it keeps buffers (committed with the plain step);
        # a built-in's on the leaves, which the plan checked as its checks would: by its
        # known rule on the buffers the plan keeps where it has one.
        bound = plan.bound
        done = None if bound is None else bound.update(self.g_leaves, plan.inner_count)
        if done is not None:
            self.updates, self.new_fields = done
            self.inner_done = plan.inner_count + 1
            return self._stepped()
        if bound is not None:  # (a leaf it does not take) the count moves without the plan
            self.steady = False
        leaf_update = plan.leaf_update
        done = leaf_update and leaf_update(self.g_leaves, state.inner_state, self.leaves, plan.spec)
        if done:
            self.updates, self.inner_state = done
        else:
            updates, self.inner_state = plan.options.inner.update(
                self.grads, state.inner_state, params=self.params, inplace=not plan.keeps,
            )  # fmt: skip
            u_leaves, u_spec = tree.flatten(updates, "inner updates")
            tree.check_like("inner updates", u_leaves, u_spec, self.leaves, plan.spec,
                            owner="anderson.update")  # fmt: skip
            self.updates = u_leaves
        return self._stepped()

    def _scaled_in_append(self) -> bool:
        """Plain SGD (`plan.gradient_scale`), on a call that stores, with grads the append's
        pass may read: its update `grads * -lr` is formed there, and the grads are only read
        (its in-place `update` would scale them first, a pass over them the append saves)."""
        rule = self.plan.gradient_scale
        if rule is None or not self.stores:
            return False
        done = rule(self.state.inner_state)
        if done is None or not plans.steps_fit(self.g_leaves, self.leaves, self.plan):
            return False
        self.updates, (self.scale, self.inner_state) = self.g_leaves, done
        return True

    def _stepped(self) -> list[Tensor]:
        """The rest of the call, once the inner update is known; an exception from here on
        ends at one complete outcome."""
        try:
            return self._steps()
        except BaseException:
            self._recover()
            raise

    def _inner_state(self) -> Any:
        """The inner optimizer's new state, as an object (built from the bound rule's new
        buffers where they are not adopted at the commit point)."""
        if self.new_fields is not None and self.inner_state is self.state.inner_state:
            self.inner_state = self.plan.bound.state(self.inner_done, self.new_fields)
        return self.inner_state

    def _steps(self) -> list[Tensor]:
        self.progress.param_versions = [p._version for p in self.leaves]
        return self._classic() if self.plan.classic else self._aadl()

    def _aadl(self) -> list[Tensor]:
        """Mode "aadl" (`_Step.aadl()`)."""
        plan, progress = self.plan, self.progress
        params, q = self.leaves, plan.q
        # 1. y = x + u, in the params: in the append's pass where it may (the params hold y
        # already where u is the wrapper's -0).
        steps = () if plan.plain_in_params else self.updates
        fit = self.scale is not None  # (`_scaled_in_append()` checked them)
        if steps and not (fit or self.stores and plans.steps_fit(steps, params, plan)):
            passes.add_steps(params, steps, progress.stepped)
            steps = ()
        if not self.stores:
            return self._unstored()
        head = (plan.head + 1) % q  # 2. y - anchor joins the window, y is the anchor
        self._append(head, steps)
        if not plan.rows.known_rows(plan.gram_rows[plan.head], head):  # (not finite)
            return self._poisoned(head, 1)
        self._commit_plain(head)  # 3. the commit point
        if not self.mixes:  # a call that only stores (`frequency`, `wait_iterations`)
            return self._finish(False, params, mixes=False)
        weights, solved = weigh.aadl_weights(plan, self.state, head)  # 4. the weights
        progress.undo.append((params, plan.anchor))
        try:  # 5. the mix, accumulated in the params (which hold y, the anchor)
            ok = self._mix(params, weights) and passes.solve_succeeded(solved)
        except BaseException:
            _write(params, plan.anchor)
            raise
        if not ok:
            _write(params, plan.anchor)
        return self._finish(ok, params)

    def _mix(self, params: list[Tensor], weights: Tensor) -> bool:
        """Mode "aadl"'s mix `y - sum_j c_j \\Delta y_j` accumulated in the params, leaf by
        leaf (`addmv_` over the slots), and whether it is finite (`passes.finite()`, whose
        native test every leaf of a plan takes): in one native call where the plan has a
        `native_blas` mixer."""
        plan = self.plan
        if plan.mixer is not None:
            return plan.mixer.mix(params, weights)
        for p, columns in zip(params, plan.columns):
            (p if p.dim() == 1 else p.view(-1)).addmv_(columns, weights)
        return plan.rows.mix_bounded(weights) or plan.rows.finite(params)

    def _classic(self) -> list[Tensor]:
        """Mode "classic" (`_Step.classic()`)."""
        plan, progress = self.plan, self.progress
        params, q = self.leaves, plan.q
        if not self.stores:
            passes.add_steps(params, self.updates, progress.stepped)  # y = x + u, in the params
            return self._unstored()
        head = (plan.head + 1) % q
        # 1. The pair (x_k, u_k) joins the window before the step overwrites x_k.
        for iterates, x, a in zip(plan.iterates, params, plan.anchor):
            torch.sub(x, a, out=iterates[head])  # the difference written once, in its slot
        passes.copy_leaves([slots[head] for slots in plan.slots], self.updates)
        self._dots(head)
        finite = plan.rows.known_rows(plan.gram_rows[plan.head], head)
        if not finite:  # the slot zeroed, as the append does before the anchor is written
            for slots in plan.slots:
                slots[head].copy_(torch.zeros_like(slots[head]))
        passes.copy_leaves(plan.anchor, params)
        passes.add_steps(params, self.updates, progress.stepped)  # 2. y = x + u, in the params
        if not finite:
            return self._poisoned(head, 0)
        self._commit_plain(head)  # 3. the commit point
        if not self.mixes:  # a call that only stores (`frequency`, `wait_iterations`)
            return self._finish(False, params, mixes=False)
        return self._classic_mix(head)  # 4. the weights and the mix

    def _classic_mix(self, head: int) -> list[Tensor]:
        """Mode "classic"'s mix over both rings from the window whose newest pair is in slot
        `head`, and the final state."""
        plan = self.plan
        coefficients, solved = weigh.classic_weights(plan, self.state, head)
        # The native weights' buffer: the plan holds the products' views on it.
        direct = coefficients is plan.system.classic
        x_hist = []
        for a, iterates, slots, runs, terms in zip(
            plan.anchor, plan.iterates, plan.slots, plan.runs, plan.mix_terms
        ):
            result = torch.empty_like(a, dtype=_FLOAT32)
            flat = result if result.dim() == 1 else result.view(-1)
            if direct and terms is not None:  # `combine_leaf()`'s two products, as it runs them
                (points, w_points), (steps, w_steps) = terms
                torch.mv(points, w_points, out=flat)
                flat.addmv_(steps, w_steps)
            else:
                kernels.combine_leaf(None, [*iterates, *slots], coefficients, flat, runs)
            x_hist.append(result.add_(a))
        ok = passes.finite(x_hist, self.leaves, solved)
        return self._finish(ok, x_hist if ok else self.leaves)

    def _unstored(self) -> list[Tensor]:
        """A call off `store_each_nth`, after its plain step (`_Step.aadl()` and
        `classic()` with nothing stored): that step's state committed with the window as it
        is, then, on the call-count gates, the mix of that window as the executor forms it
        (mode "aadl": out of place from the anchor, the last stored plain step)."""
        plan, state = self.plan, self.state
        inner_state = self._inner_state()
        plain = state._replace(count=self.count, inner_state=inner_state, **self._cleared())
        inplace.commit_to(state, self.progress, plain, inner_state, plan.adopts, plain=True)
        self.guard.checkpoint()
        plan.count, plan.pending, plan.inner_count = self.count, _INF, self.inner_done
        if not self.mixes:
            return self._finish(False, self.leaves, mixes=False)
        head = plan.head
        if plan.classic:
            return self._classic_mix(head)
        alpha, solved = weigh.affine_weights(plan, state, head)
        minus_c = aadl_coefficients(alpha, plan.options.relaxation, negated=True)
        x_hist = passes.combine(
            plan.anchor, [_FLOAT32] * len(plan.anchor), plan.anchor, [plan.ring()],
            passes.ring_order(head, minus_c),
        )  # fmt: skip
        ok = passes.finite(x_hist, self.leaves, solved)
        return self._finish(ok, x_hist if ok else self.leaves)

    def _commit_plain(self, head: int) -> None:
        """The commit point (`_Step.commit_plain()`): the plain step's state, with the
        Grams the append made (`plan.rows.values`), becomes the caller's (and the plan's
        values). Its writes (`_plain_writes()`) are done again by `_recover()` if an
        exception cuts them short, which finishes the commit, as `exec.inplace.recover()`
        finishes the executor's."""
        plan = self.plan
        self.committing = head
        self._plain_writes(head)
        # Each outcome recorded in one statement, so that no line runs between the two.
        self.progress.plain, self.committing = True, None
        self.guard.checkpoint()
        plan.count, plan.head, plan.pending = self.count, head, _INF
        plan.inner_count = self.inner_done

    def _plain_writes(self, head: int) -> None:
        """The commit point's writes into the caller's state: the Gram rows, `dr_rhs`, the
        counters (one native call: the bytes of torch's copies and fills), the cleared bar
        and the inner optimizer's new buffers. Doing them again gives the same state."""
        plan, state = self.plan, self.state
        # The counters (with a bound rule, its count too: `plan.counters`).
        counts = plan.counts
        counts[0], counts[1] = self.count, head
        if plan.bound is not None:
            counts[2] = self.inner_done
        torch.autograd.graph.increment_version(plan.committed)  # as torch's writes would
        native.commit_rows(plan.committed, head, plan.rows.values_address, plan.counters, counts)
        if plan.pending != _INF:
            state.pending_loss.fill_(_INF)
        if self.new_fields is not None:
            plan.bound.adopt(self.new_fields)
        elif self.inner_state is not state.inner_state:
            write = inplace.adopt if plan.adopts else write_back
            write(state.inner_state, self.inner_state)

    def _cleared(self) -> dict[str, float]:
        """The commit point's `pending_loss` (`deferred.cleared()`): +inf, written only where
        a mix was pending."""
        return {} if self.plan.pending == _INF else {"pending_loss": _INF}

    def _finish(self, ok: bool, x: list[Tensor], *, mixes: bool = True) -> list[Tensor]:
        """The final state (`_Step.finish()`): the mix counted, or the failed one (a call
        that `mixes`); `x` written into the params where it is not them. A returned mix
        with the deferred safeguard's `loss`: that loss is the bar the next call's loss
        must beat (`deferred.pending_after()`)."""
        plan, state, progress = self.plan, self.state, self.progress
        plan.mixed += 1 if ok else 0
        if ok and x is self.leaves and self.loss_value is None:
            # The common end: the mix is in the params and only `num_mixed` changes.
            progress.pending = state._replace(num_mixed=plan.mixed)
            state.num_mixed.fill_(plan.mixed)
            progress.pending, progress.undo = None, []
            return self.leaves
        failed = mixes and not ok
        pending = {}
        if ok and self.loss_value is not None:
            pending = {"pending_loss": accept.judged_loss(self.loss_value)}
        final = state._replace(
            num_mixed=plan.mixed if ok else state.num_mixed,
            num_nonfinite=state.num_nonfinite + 1 if failed else state.num_nonfinite,
            **pending,
        )
        writes = [(p, v) for p, v in zip(self.leaves, x) if v is not p]
        progress.writes, progress.pending = writes, final
        for p, v in writes:
            p.copy_(v)
        inplace.commit_to(state, progress, final, None, False)
        if pending:
            plan.pending = pending["pending_loss"]
        return self.leaves

    def _poisoned(self, head: int, window_size: int) -> list[Tensor]:
        """A Gram row that is not finite (`_Step.append()`'s poisoned append): the slot and
        the Grams are zeroed and the window restarts (`window_size` entries: the anchor `y`
        in mode "aadl", no pair in "classic"); no mix."""
        plan, state, progress = self.plan, self.state, self.progress
        if not plan.classic:  # (classic zeroed its slot before the anchor was written)
            for slots in plan.slots:
                slots[head].copy_(torch.zeros_like(slots[head]))
        grams = Grams(*map(torch.zeros_like, Grams.of(state)))
        inner_state = self._inner_state()
        plain = state._replace(
            count=self.count,
            inner_state=inner_state,
            head=head,
            window_size=window_size,
            num_nonfinite=state.num_nonfinite + 1,
            gram=grams.gram,
            dr_gram=grams.dr_gram,
            dr_rhs=grams.dr_rhs,
            **self._cleared(),
        )
        inplace.commit_to(state, progress, plain, inner_state, plan.adopts, plain=True)
        self.guard.checkpoint()
        progress.writes, progress.pending = [], state
        inplace.commit_to(state, progress, state, None, False)
        self.steady = False
        return self.leaves

    def revert(self) -> list[Tensor]:
        """A deferred rejection (`aadl_func._src.stages.revert()`, the general path's):
        the previous call's plain step (the mode's `last_plain_step`: the anchor, or in mode
        "classic" the anchor plus the newest residual) written into the params,
        `num_rejected` counted and the bar cleared; no inner step, nothing else changes."""
        plan, state, progress = self.plan, self.state, self.progress
        if plan.classic:
            newest = [slots[plan.head] for slots in plan.slots]
            y = classic.last_plain_step(plan.anchor, newest)
        else:
            y = aadl.last_plain_step(plan.anchor)
        final = state._replace(num_rejected=int(state.num_rejected) + 1, pending_loss=_INF)
        try:  # `stages.output()` and the commit: an exception from here finishes the call
            progress.writes, progress.pending = list(zip(self.leaves, y)), final
            for p, v in progress.writes:
                p.copy_(v)
            inplace.commit_to(state, progress, final, None, False)
        except BaseException:
            self._recover()
            raise
        plan.pending = _INF
        return self.leaves

    def _recover(self) -> None:
        """An exception anywhere: one complete outcome, as the executor's
        (`_Step.recover()`)."""
        if self.committing is not None:  # the commit point's writes, finished
            self._plain_writes(self.committing)
            self.progress.plain, self.committing = True, None
            return
        if self.progress.param_versions is None and self.progress.pending is None:
            return  # nothing written
        plan = self.plan
        if self.stepping:  # the plain step in the append's pass: done or not, every leaf
            self.progress.param_versions = [None] * len(self.leaves)
            self.progress.stepped = list(self.leaves) if plan.rows.stepped.value else []
        updates = self.updates
        if self.scale is not None:  # the update the append forms (its grads are as they were)
            updates = [torch.mul(g, self.scale) for g in self.g_leaves]
        call = update_call.Call(
            plan.options, self.state, self.leaves, plan.spec, updates, self._inner_state(),
            inplace=True, loss_fn=None, loss=self.loss, guard=self.guard,
        )  # fmt: skip
        call.count, call.count_value = (
            torch.scalar_tensor(self.count, dtype=torch.int64),
            self.count,
        )
        call.progress = self.progress
        inplace.recover(call)

    def _dots(self, head: int) -> None:
        """Mode "classic": the Gram row of the residual in slot `head`, summed over the
        leaves from 0.0 into `plan.rows.out` (`passes._known_dots_row()`, one kernel call:
        `native.LeafRows`)."""
        self.plan.rows.dots(head)

    def _append(self, head: int, steps: list[Tensor] | tuple) -> None:
        """The fused append of every leaf (`native.append_differences()`, one kernel call for
        the tree: `native.LeafRows`): the Gram row of the new difference, summed over the
        leaves into `plan.rows.out`; with `steps`, the plain step `y = x + u` into the
        params first, in the same pass."""
        plan = self.plan
        # Written behind torch's back: bump the version counters as an in-place op would.
        touched = plan.appended[head]
        if steps:
            # Whether the params hold y is then the kernel's mark, which `_recover()` reads
            # (not their version counters: the kernel writes them after the bump).
            plan.rows.stepped.value = 0
            self.stepping, touched = True, touched + self.leaves
        torch.autograd.graph.increment_version(touched)
        plan.rows.append(head, self.leaves, steps, 1.0 if self.scale is None else self.scale)

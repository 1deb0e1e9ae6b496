r"""The steady call's plan: what it keeps of a state from one call to the next, and the tests
that the state and the inputs of a call still fit it (`aadl_func._src.exec.steady`).

A `Plan` holds the params' leaves, each leaf's window slots as one matrix, the native
kernel's pointers and output buffers, and the counters and pending loss as Python
values. It holds while every tensor it copies keeps the version counter the previous call
left it with (`versions()`). `new_plan()` makes one for a state in the steady state
(`steady_window()`) whose calls can be steady at all (else None); `params_fit()` and
`grads_fit()` check a call's params and grads as the executor's checks would take them.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import kernels, native, native_blas, protocols, tree
from aadl_func._src.acceptance import SAFEGUARD
from aadl_func._src.core.lstsq import known_gamma
from aadl_func._src.exec import passes
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState

__all__ = [
    "Plan",
    "Unplannable",
    "grads_fit",
    "new_plan",
    "params_fit",
    "steady_window",
    "versions",
]

_FLOAT32 = torch.float32


class Plan:
    """What a steady call needs of its state, kept from the previous call."""

    __slots__ = (
        "options", "params", "shapes", "spec", "anchor", "slots", "columns", "rows",
        "count", "head", "mixed", "pending", "q", "gram_rows", "tracked", "versions",
        "keeps", "adopts", "leaf_update", "committed", "counters", "finite", "classic",
        "iterates", "runs", "storages", "bound", "inner_count", "system", "counts", "mix_terms",
        "solver", "gamma_of", "mixer", "plain_in_params", "list_size", "appended",
        "gradient_scale",
    )  # fmt: skip

    def __init__(self, options: AndersonOptions, state: AndersonState, leaves: list, spec: Any):
        self.options, self.params, self.spec = options, leaves, spec
        self.shapes = [p.shape for p in leaves]
        # The params' number when they are a plain list of tensors (the wrapper's), whose
        # leaves the steady call takes without optree (`flatten()`); else None.
        self.list_size = len(leaves) if tree.flatten(list(leaves))[1] == spec else None
        self.anchor = tree.flatten(state.anchor, "state.anchor")[0]
        ring = [tree.flatten(r, "state.residuals")[0] for r in state.residuals]
        self.slots = [[entry[i] for entry in ring] for i in range(len(leaves))]
        # Each leaf's slots as the (Q, n) matrix `anderson.init` lays them out as, transposed
        # for the mix (`kernels.combine_leaf` with the params as base and result).
        matrices = [passes._rows_of_one_buffer(s) for s in self.slots]
        self.columns = [None if m is None else m.mT for m in matrices]
        # Mode "classic": the steps' ring too, and each leaf's two matrices as
        # `kernels.combine_leaf()`'s runs (the steps' weights first, as `passes.combine()`).
        self.classic = options.rules.eager_steps == "classic"
        its = [tree.flatten(r, "state.iterates")[0] for r in state.iterates]
        self.iterates = [[entry[i] for entry in its] for i in range(len(leaves))]
        self.runs = [
            [(0, passes._rows_of_one_buffer(i)), (len(ring), m)] if self.classic else None
            for i, m in zip(self.iterates, matrices)
        ]
        self.count, self.head, self.mixed = (
            int(t) for t in (state.count, state.head, state.num_mixed)
        )
        self.pending = float(state.pending_loss)  # the deferred safeguard's bar, or +inf
        self.q = q = state.dr_rhs.shape[0]
        # The address of each row of the (contiguous float64) Gram: `known_rows()`'s
        # `before` at an append is the row of the newest residual's slot.
        self.gram_rows = [state.gram.data_ptr() + 8 * q * s for s in range(q)]
        # Every Gram value finite, as each row appended from now on is checked to be (a
        # non-finite one restarts the window with zeros): the small solve may skip the test
        # and read its system from the tensors (`system`).
        grams = (state.gram, state.dr_gram, state.dr_rhs)
        self.finite = all(math.isfinite(v) for t in grams for v in t.reshape(-1).tolist())
        # Every tensor the plan copies or writes behind torch's back (a leaf's slots share
        # one buffer's version counter), and their version counters as the last call left them.
        self.tracked = [
            state.count, state.head, state.window_size, state.skip_streak, state.num_mixed,
            state.num_nonfinite, state.pending_loss, state.gram, state.dr_gram, state.dr_rhs,
            *self.anchor, *[s[0] for s in self.slots], *[s[0] for s in self.iterates if s],
        ]  # fmt: skip
        # What the commit point writes natively (`native.commit_rows()`).
        self.committed = [state.gram, state.dr_gram, state.dr_rhs, state.count, state.head]
        self.counters = native.pointers([state.count, state.head])
        self._kernel_calls(state)
        # The window's memory, which no params leaf may share.
        self.storages = {t.untyped_storage().data_ptr() for t in self.tracked}
        self.keeps = protocols.keeps_buffers(options.inner)
        self.adopts = protocols.adopts_buffers(options.inner)
        # A built-in inner optimizer's update on checked leaves (out of place), else None.
        leaf_update = getattr(options.inner.update, "update_leaves", None)
        self.leaf_update = leaf_update if self.keeps else None
        # An inner optimizer whose caller has written the plain step into the params and
        # passes `-0` as the grads (the wrapper's `StepInParams`): `y = x + (-0)` is `x`,
        # so the steady call neither adds nor checks them.
        self.plain_in_params = getattr(options.inner.update, "plain_in_params", False) is True
        # Plain SGD's update as a number (`inner._gradient_scale()`), which mode "aadl"'s
        # append multiplies the grads by in its pass, else None.
        scale = getattr(options.inner.update, "gradient_scale", None)
        self.gradient_scale = None if self.classic or self.plain_in_params else scale
        # Its known rule bound to the inner state's buffers (`inner_bound`), whose count the
        # plan keeps as a Python int; those tensors are tracked too (their memory changes
        # at each commit, so they are not among `storages`).
        bind = getattr(options.inner.update, "bind_leaves", None) if self.adopts else None
        self.bound = None if bind is None else bind(state.inner_state, leaves, spec)
        self.inner_count = None
        if self.bound is not None:
            self.inner_count = int(self.bound.count)
            self.tracked += self.bound.tensors()
            # Its count is written by the commit point's native call too.
            self.committed.append(self.bound.count)
            self.counters = native.pointers([state.count, state.head, self.bound.count])
        self.counts = (ctypes.c_int64 * len(self.counters))()  # the values they get
        self.versions = versions(self)

    def _kernel_calls(self, state: AndersonState) -> None:
        """What the steady call's native calls need of the window: the Gram-row passes
        (`rows`), the small system (`system`) and, where torch's LAPACK and BLAS can be
        called directly (the same bits), the small solve and mix in one call each."""
        # The Gram-row passes over every leaf, one native call each (`native.LeafRows`).
        self.rows = native.LeafRows(self.slots, self.anchor)
        if not self.classic:  # the largest values of the slots, which bound mode "aadl"'s mix
            self.rows.measure(self.slots)
        # What an append into slot `s` writes (its version counters to bump): each leaf's
        # slot `s` and anchor.
        self.appended = [
            [t for slots, a in zip(self.slots, self.anchor) for t in (slots[s], a)]
            for s in range(len(self.slots[0]))
        ]
        # The small system read from the committed Grams (the native kernel)...
        self.system = native.System(state.gram, state.dr_gram, state.dr_rhs)
        # ... and solved in one native call (`native_blas.solver()`; else None: the torch
        # route).
        self.solver = native_blas.solver(self.q - 1)
        # `known_gamma()` of the system, or the same bytes from the solver (None where
        # LAPACK failed), for the calls it does not take whole (a relative ridge).
        self.gamma_of = (
            functools.partial(known_gamma, cutoff_inverse=self.system.cutoff_inverse)
            if self.solver is None
            else self.solver.gamma_of
        )
        # Mode "aadl"'s mix and its finiteness test of a small window, in one native call
        # likewise (`native_blas.mixer()`; else None: one `addmv_` per leaf).
        self.mixer = None
        if not self.classic and None not in self.columns:
            self.mixer = native_blas.mixer(self.rows, self.columns)
        # Mode "classic": the mix's two products per leaf (`_mix_terms()`).
        self.mix_terms = [
            _mix_terms(p, runs, self.system.classic) if self.classic else None
            for p, runs in zip(self.params, self.runs)
        ]

    def ring(self) -> tuple:
        """The residuals' window as the executor's ring: per slot, its leaves."""
        return tuple([[leaf[s] for leaf in self.slots] for s in range(self.q)])


def _mix_terms(p: Tensor, runs: list, weights: Tensor) -> tuple | None:
    """Mode "classic"'s two products for leaf `p` as `kernels.combine_leaf()` forms them in
    one piece (a leaf within one chunk): each run's matrix transposed and its weights, views
    of the native weights' buffer `weights`. None for a larger leaf, or a run that is not a
    matrix (a layout `new_plan()` declines)."""
    (first, points), (second, steps) = runs
    if points is None or steps is None or p.numel() > kernels.chunk_size(1, p.device):
        return None
    return (
        (points.mT, weights[first : first + points.shape[0]]),
        (steps.mT, weights[second : second + steps.shape[0]]),
    )


def flatten(values: Any, name: str, plan: Any) -> tuple[list, Any]:
    """`tree.flatten(values, name)`, where a plain list as long as the params of `plan`
    (when they are a plain list of tensors, as the wrapper's) is its own leaves: with the
    plan's spec, which is optree's for it once the caller has checked that every item is a
    tensor."""
    if type(values) is list and type(plan) is Plan and len(values) == plan.list_size:
        return list(values), plan.spec
    return tree.flatten(values, name)


def versions(plan: Plan) -> list[int]:
    return [t._version for t in plan.tracked]


class Unplannable(NamedTuple):
    """Kept with a state none of whose calls can be steady for `options` (its options, the
    params' kinds, the window's layout, the native kernel `native` off), so that they do not
    try again; a state the caller rebuilds loses it (`verified_states`)."""

    options: Any
    native: bool


def steady_window(options: AndersonOptions, state: AndersonState) -> bool:
    """Whether the window is in the steady state now: full, no skip streak (plain CPU
    counters, read once each); a finite `pending_loss` (a mix the deferred safeguard judges
    next) is judged call by call."""
    small = (state.count, state.head, state.window_size, state.skip_streak, state.num_mixed)
    for t in (*small, state.pending_loss):
        if type(t) is not Tensor or t.is_inference() or not t.is_cpu or t.ndim:
            return False  # not a state `update` made: the checked path says what is wrong
    if any(t.dtype != torch.int64 for t in small) or state.pending_loss.dtype != torch.float64:
        return False
    q = options.num_slots
    full = q if options.rules.keeps_iterates else q + 1  # pairs; iterates
    return int(state.window_size) == full and int(state.skip_streak) == 0


def new_plan(
    options: AndersonOptions, state: AndersonState, leaves: list[Tensor], spec: Any
) -> Plan | None:
    """A plan for `state` (in the steady state) if its calls can be steady ones, else
    None: that is a matter of the options, the params' kinds and the window's layout."""
    if options.average or options.skip_nonfinite:
        return None
    if options.acceptance is not SAFEGUARD or options.reg_column:
        return None
    if options.rules.eager_steps is None or not native.available() or options.num_slots < 2:
        return None
    grams = (state.gram, state.dr_gram, state.dr_rhs)
    if not all(t.is_cpu and t.dtype == torch.float64 and t.is_contiguous() for t in grams):
        return None  # (`native.commit_rows()` writes them as C arrays)
    if any(type(p) is not Tensor or p.dtype != _FLOAT32 for p in leaves):
        return None
    plan = Plan(options, state, leaves, spec)
    for p, a, slots, column in zip(leaves, plan.anchor, plan.slots, plan.columns):
        if p.is_inference() or not p.is_contiguous() or p.numel() == 0:
            return None
        if not (p.requires_grad is False or p.is_leaf):
            return None  # a view of a leaf that requires grad: checks.check_writable's
        if not native.can_append(slots, 0, p, a) or column is None:
            return None
        if a.dtype != _FLOAT32 or a.stride() != p.stride():
            return None
    if plan.classic and not all(
        run[0][1] is not None and run[0][1].dtype == _FLOAT32 for run in plan.runs
    ):
        return None
    return plan


def params_fit(leaves: list, plan: Plan) -> bool:
    """Params the plan was made for: its own tensors, or others (the wrapper passes fresh
    copies each call) that pass the executor's in-place checks the same way: plain float32
    CPU tensors of the planned shapes, C-contiguous and writable, no two sharing memory and
    none sharing the window's. A `set_` or `resize_` since would change a shape or layout."""
    fresh = False
    for p, planned, shape in zip(leaves, plan.params, plan.shapes):
        if p.shape != shape or p.dtype != _FLOAT32 or not p.is_contiguous():
            return False
        if p is not planned:
            if type(p) is not Tensor or p.is_inference() or not p.is_cpu or p.is_neg():
                return False
            if p.requires_grad and not p.is_leaf:
                return False  # a view of a leaf that requires grad: checks.check_writable's
            fresh = True
    if not fresh:
        return True
    storages = [p.untyped_storage().data_ptr() for p in leaves]
    return len(set(storages)) == len(storages) and not plan.storages.intersection(storages)


def steps_fit(steps: list, leaves: list, plan: Plan) -> bool:
    """Inner updates the append's pass may add into the params (`native.LeafRows.append()`
    with steps): dense contiguous float32 CPU tensors of the leaves' sizes, whose memory
    holds their values (no negative view) and is neither the window's nor a params leaf's
    (where `add_()` would read what it writes, the executor's add says what it does)."""
    storages = set(plan.storages)
    for u, p in zip(steps, leaves):
        if type(u) is not Tensor or u.layout != torch.strided:
            return False  # (what `native.plain_vectors()` may ask of it is a strided tensor's)
        if not native.plain_vectors([u], _FLOAT32, p.numel()):
            return False
        storages.add(p.untyped_storage().data_ptr())
    return not any(u.untyped_storage().data_ptr() in storages for u in steps)


def grads_fit(grads: list, params: list) -> bool:
    """Grads the executor would take as they are: plain tensors of the params' shapes,
    dtypes and devices, sharing no memory with any params leaf."""
    for g, p in zip(grads, params):
        if type(g) is not Tensor or g.shape != p.shape or g.dtype != p.dtype:
            return False
        if g.device != p.device or g.layout != torch.strided:
            return False
    # Separate storages cannot overlap; grads in a params leaf's storage go the checked way.
    storages = {p.untyped_storage().data_ptr() for p in params}
    return not any(g.untyped_storage().data_ptr() in storages for g in grads)

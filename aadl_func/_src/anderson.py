"""``anderson``: Anderson acceleration as a functional (init, update) transformation."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import distributed, flags, tree
from aadl_func._src.atomic import InterruptGuard, write_back
from aadl_func._src.average import window_average
from aadl_func._src.checks import (
    autograd_policy,
    check_floating,
    check_update_inputs,
    keep_requires_grad,
)
from aadl_func._src.mix import aadl_coefficients, classic_coefficients
from aadl_func._src.solve import solve_differences, solve_factor, stack_factors
from aadl_func._src.state import COUNTERS, AndersonState
from aadl_func._src.validation import (
    check_bool,
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_int,
)
from aadl_func._src.window import (
    append_difference,
    assign,
    blending,
    combine,
    difference_factor,
    difference_rows,
    new_ring,
    select,
    set_gram_row,
    write_slot,
)

__all__ = ["Anderson", "anderson"]

Params = Any
LossFn = Callable[[Params], Tensor]


class Anderson(NamedTuple):
    """A functional optimizer: ``state = init(params)``;
    ``params, state = update(state, params, grads, *, inplace=False, loss_fn=None)``."""

    init: Callable[[Params], AndersonState]
    update: Callable[..., tuple[Params, AndersonState]]


@dataclasses.dataclass(frozen=True)
class _Config:
    inner: Any
    history_depth: int
    relaxation: float
    reg: float
    wait_iterations: int
    store_each_nth: int
    frequency: int
    mode: str
    average: bool
    average_tol: float
    history_device: torch.device | None
    compute_device: torch.device | None
    history_dtype: torch.dtype | None
    skip_nonfinite: bool = False
    max_consecutive_skips: int | None = None
    reg_relative: float = 0.0
    restart_on_reject: bool = False

    @property
    def num_slots(self) -> int:
        # aadl stores differences of consecutive entries; classic stores one residual per pair.
        return self.history_depth - 1 if self.mode == "aadl" else self.history_depth

    def history_device_of(self, p: Tensor) -> torch.device:
        return self.history_device if self.history_device is not None else p.device

    def history_dtype_of(self, p: Tensor) -> torch.dtype:
        return self.history_dtype if self.history_dtype is not None else p.dtype

    def compute_device_of(self, leaves: list[Tensor]) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return self.history_device_of(leaves[0])


def anderson(
    inner: Any,
    *,
    history_depth: int = 10,
    relaxation: float = 1.0,
    reg: float = 0.0,
    wait_iterations: int = 0,
    store_each_nth: int = 1,
    frequency: int = 1,
    mode: str = "aadl",
    average: bool = False,
    average_tol: float = 0.1,
    history_device: torch.device | str | None = None,
    compute_device: torch.device | str | None = None,
    history_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    max_consecutive_skips: int | None = None,
    reg_relative: float = 0.0,
    restart_on_reject: bool = False,
) -> Anderson:
    r"""Anderson-accelerates an inner optimizer, treating its step as a fixed-point map ``g``.

    Mode ``"aadl"`` (default, AADL's semantics). Call number :math:`k` (1-based):

    1. :math:`y = g(x)`, the inner optimizer's step from ``params`` with ``grads``;
    2. if :math:`k \bmod` ``store_each_nth`` :math:`= 0`, :math:`y` joins the window (at most
       ``history_depth`` entries, oldest dropped);
    3. if :math:`k >` ``wait_iterations``, :math:`k \bmod` ``frequency`` :math:`= 0` and the
       window holds at least 3 entries, the params become :math:`x` = :func:`aadl_func.mix`
       (window, ``relaxation``, ``reg``), else :math:`y`;
    4. with ``loss_fn``, :math:`x` is kept only if ``loss_fn(x) < loss_fn(y)``, and then also
       replaces the newest window entry; a non-finite :math:`x` is never returned.
    5. with ``average=True``, AADL's moving average, decided before step 3: when the window's
       spread :math:`\|s\|_2` (per-coordinate sample standard deviation) exceeds
       ``average_tol`` :math:`\|\bar x\|_2`, the params become the window mean :math:`\bar x`
       and no mix is formed on that call (see ``aadl_func._src.average``).

    Mode ``"classic"``: textbook type-II Anderson acceleration on the pairs
    :math:`(x_i, g(x_i))` of the last ``history_depth`` calls,

    .. math::

        x_{k+1} = \sum_i \alpha_i \big((1 - \beta) x_i + \beta g(x_i)\big), \quad
        \alpha = \arg\min_{\sum \alpha = 1} \Big\|\sum_i \alpha_i (g(x_i) - x_i)\Big\|,

    gated by ``wait_iterations`` and ``frequency`` (and at least 2 pairs); on a linear map with
    full history and :math:`\beta = 1` it is equivalent to GMRES (Walker & Ni, 2011).

    The window is a ring of residuals with float64 Gram matrices (of the residuals and of their
    consecutive differences) updated one row per stored entry: a step costs two passes over
    the window (:math:`O(m n)`), solves an :math:`m \times m` problem in float64
    (``aadl_func._src.solve.solve_differences``) and stores, in mode "aadl", the newest entry
    plus ``history_depth - 1`` differences; in mode "classic", the newest point plus
    ``history_depth`` differences of points and ``history_depth`` residuals (points are
    stored as steps so that a low-precision ``history_dtype`` rounds the steps, not the
    points). A float64 window is solved more accurately, from
    a float64 QR factor of the differences streamed from the ring on mixing calls
    (``aadl_func._src.solve.solve_factor``: :math:`O(m^2 n)` flops, no extra
    parameter-sized memory), so that the condition number of the differences is not squared.

    Args:
      inner: the inner optimizer, e.g. :func:`aadl_func.adam`, or any object with torchopt-style
        ``init(params)`` and ``update(updates, state, params=None, inplace=...)`` returning
        ``(updates, state)`` (updates are added to the params).
      history_depth: window entries, ``>= 3``.
      relaxation: :math:`\beta > 0`; 1 is undamped, above 1 over-relaxes.
      reg: absolute Tikhonov weight of the least-squares problem, ``>= 0``.
      wait_iterations: calls before the first mixing, ``>= 0``.
      store_each_nth: store every n-th inner step in the window, ``>= 1``.
      frequency: mix every ``frequency`` calls, ``>= 1``.
      mode: ``"aadl"`` or ``"classic"``.
      average: AADL's moving-average rule on the window (see the README).
      average_tol: relative spread of the window above which ``average`` applies, ``> 0``.
      history_device: where the window lives (default: each parameter's device).
      compute_device: where the small least-squares problem is solved (default: the history
        device of the first parameter). Passes over the window always run where it lives.
      history_dtype: dtype of the stored differences (default: each parameter's dtype).
      skip_nonfinite: skip a call whose grads or inner update are not finite (as optax's
        ``apply_if_finite`` and ``torch.amp.GradScaler`` do): params and state are left as
        they were, except ``num_skipped`` and ``skip_streak``, which count it. The inner
        update is then computed out of place and adopted only if finite (one inner-state-sized
        temporary more with ``inplace=True``).
      max_consecutive_skips: with ``skip_nonfinite``, how many calls in a row may be skipped;
        the next non-finite one raises ``FloatingPointError`` and changes nothing (eager mode;
        under ``vmap`` the calls are only counted). None: never give up.
      reg_relative: a Tikhonov weight relative to the window, ``>= 0``: the least-squares
        problem is solved with :math:`\lambda = \mathrm{reg} + \mathrm{reg\_relative}\,
        \|\Delta F\|_F^2 / m` (below), which does not depend on the scale of the parameters
        or of the step.
      restart_on_reject: when the ``loss_fn`` safeguard rejects a mix, the window restarts
        from its newest entry (below). Without ``loss_fn`` nothing is ever rejected.

    Options for minibatch (stochastic) training, where consecutive residuals differ by gradient
    noise as much as by curvature (see examples/minibatch.py and the README):

    * ``reg_relative``: with :math:`\Delta F = [\Delta f_0, \dots, \Delta f_{m-1}]` the
      :math:`m` valid differences of consecutive residuals (mode "aadl": :math:`\Delta R`),
      the coefficients solve

      .. math::

          \gamma = \arg\min_\gamma \|f_{\mathrm{last}} - \Delta F \gamma\|^2
              + \lambda \|\gamma\|^2, \qquad
          \lambda = \mathrm{reg} + \mathrm{reg\_relative}\;
              \frac{1}{m} \sum_j \|\Delta f_j\|^2 .

      The relative part scales with :math:`\Delta F^\top \Delta F`, so the damping of
      :math:`\gamma` towards the plain step is the same whatever the parameters' or the
      learning rate's scale (an absolute ``reg`` must be re-tuned when either changes), as
      the ridges of regularised nonlinear acceleration (Scieur, d'Aspremont, Bach, 2016:
      :math:`\propto \|R^\top R\|`) and of AdaSAM (Wei, Bao, Liu, 2021:
      :math:`\propto \|r_k\|^2 / \|\Delta x_{k-1}\|^2`) are.
    * ``restart_on_reject``: when ``loss_fn`` rejects the mix of call :math:`k`, the window
      keeps only its newest entry (mode "aadl": :math:`y_k`; mode "classic": the pair
      :math:`(x_k, g(x_k))`), so the next mixes use only steps taken from then on. A rejection
      says the window's secant information no longer describes the map (in minibatch training,
      it is mostly noise). The restart itself costs nothing: no pass over the window, no
      extra loss evaluation (the safeguard's ``loss_fn`` may be a held-out minibatch's loss).

    ``inplace=True`` is exception safe: if ``loss_fn`` (or Ctrl-C) interrupts a call, the params
    and the state passed in are left exactly as after the plain step ``y`` of that call (its
    mix is dropped uncounted), ready for the next call, and the exception propagates. The
    state's tensors are updated in place and the returned state holds those same tensors.
    See ``aadl_func._src.atomic`` and docs/reliability.md. That guarantee is the eager one:
    under ``torch.compile`` (and ``vmap``) the in-place writes are masked blends inside one
    graph, the returned state carries new counters, and an interrupted compiled call may be
    half written; ``inplace=False`` never writes its inputs (README, "Compiling").

    Returns:
      :class:`Anderson` ``(init, update)``.
    """
    return Anderson(
        *_functions(
            _make_config(
                inner,
                history_depth=history_depth,
                relaxation=relaxation,
                reg=reg,
                wait_iterations=wait_iterations,
                store_each_nth=store_each_nth,
                frequency=frequency,
                mode=mode,
                average=average,
                average_tol=average_tol,
                history_device=history_device,
                compute_device=compute_device,
                history_dtype=history_dtype,
                skip_nonfinite=skip_nonfinite,
                max_consecutive_skips=max_consecutive_skips,
                reg_relative=reg_relative,
                restart_on_reject=restart_on_reject,
            )
        )
    )


def _make_config(
    inner: Any,
    *,
    history_depth: int,
    relaxation: float,
    reg: float,
    wait_iterations: int,
    store_each_nth: int,
    frequency: int,
    mode: str,
    average: bool,
    average_tol: float,
    history_device: torch.device | str | None,
    compute_device: torch.device | str | None,
    history_dtype: torch.dtype | None,
    skip_nonfinite: bool,
    max_consecutive_skips: int | None,
    reg_relative: float = 0.0,
    restart_on_reject: bool = False,
) -> _Config:
    """The validated options of :func:`anderson` (each error names its argument)."""
    owner = "anderson"
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"{owner}: `inner` must have callable `init` and `update` (e.g. aadl_func.adam(...)),"
            f" got {type(inner).__name__}"
        )
    if not isinstance(average, bool):
        raise TypeError(f"{owner}: `average` must be a bool, got {type(average).__name__}")
    if average and mode == "classic":
        # The rule averages a window of plain iterates; mode "classic" stores pairs
        # (x_i, g(x_i) - x_i) whose Gram does not give the spread of the g(x_i).
        raise ValueError(f"{owner}: `average=True` is defined for mode='aadl' only")
    config = _Config(
        inner=inner,
        history_depth=check_int(owner, "history_depth", history_depth, 3),
        relaxation=check_float(owner, "relaxation", relaxation, minimum=0.0, strict=True),
        reg=check_float(owner, "reg", reg, minimum=0.0),
        wait_iterations=check_int(owner, "wait_iterations", wait_iterations, 0),
        store_each_nth=check_int(owner, "store_each_nth", store_each_nth, 1),
        frequency=check_int(owner, "frequency", frequency, 1),
        mode=check_choice(owner, "mode", mode, ("aadl", "classic")),
        average=average,
        average_tol=check_float(owner, "average_tol", average_tol, minimum=0.0, strict=True),
        history_device=check_device(owner, "history_device", history_device),
        compute_device=check_device(owner, "compute_device", compute_device),
        history_dtype=check_dtype(owner, "history_dtype", history_dtype),
        skip_nonfinite=check_bool(owner, "skip_nonfinite", skip_nonfinite),
        max_consecutive_skips=(
            None
            if max_consecutive_skips is None
            else check_int(owner, "max_consecutive_skips", max_consecutive_skips, 0)
        ),
        reg_relative=check_float(owner, "reg_relative", reg_relative, minimum=0.0),
        restart_on_reject=check_bool(owner, "restart_on_reject", restart_on_reject),
    )
    if config.max_consecutive_skips is not None and not config.skip_nonfinite:
        raise ValueError(f"{owner}: `max_consecutive_skips` needs `skip_nonfinite=True`")
    return config


def _functions(config: _Config) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``init`` and ``update`` functions of :class:`Anderson` for ``config``."""

    def init(params: Params) -> AndersonState:
        with autograd_policy():  # no graph through the state (see checks.autograd_policy)
            return _init(config, params)

    def update(
        state: AndersonState,
        params: Params,
        grads: Params,
        *,
        inplace: bool = False,
        loss_fn: LossFn | None = None,
    ) -> tuple[Params, AndersonState]:
        with autograd_policy():  # no graph through the window (see checks.autograd_policy)
            out, new_state = _update(config, state, params, grads, inplace=inplace, loss_fn=loss_fn)
        return keep_requires_grad(out, params, inplace), new_state

    return init, update


def _counter() -> Tensor:
    # Counters live on the CPU: reading them never synchronises an accelerator.
    return torch.zeros((), dtype=torch.int64)


def _pin_window(config: _Config, p: Tensor) -> bool:
    # The newest entry of a CPU window serving CUDA params is page-locked: the mix is laid
    # out like it (window.combine), so the O(n) copy back to the params is asynchronous.
    # The ring itself never crosses devices and stays pageable.
    return p.is_cuda and config.history_device_of(p).type == "cpu"


def _window_buffer(
    config: _Config,
    p: Tensor,
    num_slots: int = 1,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
) -> list[Tensor]:
    """``num_slots`` zeroed window buffers for leaf ``p``, rows of one allocation."""
    return new_ring(
        p,
        num_slots,
        dtype=config.history_dtype_of(p) if dtype is None else dtype,
        device=config.history_device_of(p),
        pin_memory=pin_memory,
    )


def _anchor_buffer(config: _Config, p: Tensor) -> Tensor:
    return _window_buffer(config, p, dtype=p.dtype, pin_memory=_pin_window(config, p))[0]


def _init(config: _Config, params: Params) -> AndersonState:
    # Sharded (DTensor) params: the state holds each rank's local shards only.
    params = distributed.local_params(params, "anderson.init", average=config.average)
    leaves, spec = tree.flatten(params, "params", owner="anderson.init")
    if not leaves:
        raise ValueError("anderson.init: `params` must contain at least one tensor")
    check_floating("anderson.init", leaves, spec)
    q = config.num_slots

    def ring() -> tuple:
        # A leaf's q slots are rows of one buffer: a pass over them is one strided matrix.
        per_leaf = [_window_buffer(config, p, q) for p in leaves]
        return tuple(tree.unflatten(spec, [slots[s] for slots in per_leaf]) for s in range(q))

    anchor_leaves = [_anchor_buffer(config, p) for p in leaves]
    if config.mode == "aadl":
        iterates: tuple = ()
    else:
        # Classic's anchor starts at the params the state is made for, so the first pair's
        # difference x_0 - anchor is 0 (that difference is never weighted, see _ClassicStep).
        anchor_leaves = [a.copy_(p.detach()) for a, p in zip(anchor_leaves, leaves)]
        iterates = ring()
    anchor = tree.unflatten(spec, anchor_leaves)
    device = config.compute_device_of(leaves)
    return AndersonState(
        count=_counter(),
        inner_state=config.inner.init(params),
        anchor=anchor,
        residuals=ring(),
        iterates=iterates,
        gram=torch.zeros(q, q, dtype=torch.float64, device=device),
        dr_gram=torch.zeros(q, q, dtype=torch.float64, device=device),
        dr_rhs=torch.zeros(q, dtype=torch.float64, device=device),
        head=torch.full((), q - 1, dtype=torch.int64),
        window_size=_counter(),
        num_mixed=_counter(),
        num_rejected=_counter(),
        num_nonfinite=_counter(),
        num_averaged=_counter(),
        num_skipped=_counter(),
        skip_streak=_counter(),
    )


def _update(
    config: _Config,
    state: AndersonState,
    params: Params,
    grads: Params,
    *,
    inplace: bool,
    loss_fn: LossFn | None,
    plain: bool = False,
) -> tuple[Params, AndersonState]:
    """One call of ``update``; ``plain=True`` (the wrapper's recovery) records the plain step
    in the window and returns it, with no mix and no moving average."""
    # Sharded (DTensor) params: the step runs on local shards (the inner optimizer included,
    # so it must act coordinate-wise) and reduces over the mesh; see distributed.py.
    shards, params, grads, loss_fn = distributed.sharded_call(
        params, grads, loss_fn, inplace=inplace, average=config.average, owner="anderson.update"
    )
    # ``grads`` come back cast to the params' dtypes where they differ (as torch.optim does).
    p_leaves, spec, grads = check_update_inputs(config, state, params, grads, loss_fn, inplace)
    transformed = tree.any_transformed(p_leaves)  # vmap, or torch.compile
    if tree.tracing():
        # Traced (torch.compile): the decisions stay on the compute device (tree.decision),
        # so the counters join them there; the returned state keeps them on that device.
        state = _counters_on(state, config.compute_device_of(p_leaves))
    elif transformed:
        # vmap: counters that every member shares become plain values (tree.shared), so an
        # ensemble stepping together writes its windows at one slot, O(n) per member.
        state = state._replace(**{name: tree.shared(getattr(state, name)) for name in COUNTERS})
    # An eager in-place call writes the caller's buffers, so it commits in two stages and
    # defers Ctrl-C between them (atomic.py). Under a transform the caller's tensors are not
    # written back: the transformed call returns its state.
    eager_in_place = inplace and not transformed
    guard = InterruptGuard() if eager_in_place else None
    with guard if guard is not None else contextlib.nullcontext():
        # With skip_nonfinite the inner update is computed out of place, so that a non-finite
        # one can be dropped without having touched the inner state.
        updates, inner_state = config.inner.update(
            grads, state.inner_state, params=params, inplace=inplace and not config.skip_nonfinite
        )
        u_leaves, u_spec = tree.flatten(updates, "inner updates")
        tree.check_like("inner updates", u_leaves, u_spec, p_leaves, spec, owner="anderson.update")
        kind = _AadlStep if config.mode == "aadl" else _ClassicStep
        step = kind(
            config,
            state,
            p_leaves,
            spec,
            u_leaves,
            inner_state,
            inplace,
            loss_fn,
            shards,
            guard=guard,
            plain=plain,
        )
        if config.skip_nonfinite:
            out, new_state = _run_if_finite(step, tree.flatten(grads, "grads")[0])
        else:
            out, new_state = step.run()
    if shards is not None:
        out = tree.unflatten(spec, shards.globalize(tree.flatten(out, "params")[0]))
    return out, new_state


def _counters_on(state: AndersonState, device: torch.device) -> AndersonState:
    """``state`` with its 0-d counters on ``device`` (a no-op for those already there)."""
    return state._replace(**{name: getattr(state, name).to(device) for name in COUNTERS})


def _all_finite(leaves: list[Tensor], device: torch.device) -> Tensor:
    flag = flags.TRUE
    for t in leaves:
        flag = flags.both(flag, flags.all_finite(t, device))
    return flag


def _run_if_finite(step: _Step, g_leaves: list[Tensor]) -> tuple[list[Tensor] | Any, Any]:
    """``step.run()`` if the grads and the inner update are finite, else the skipped call.

    A skipped call returns the params and the state as they were, with ``num_skipped`` and
    ``skip_streak`` increased; with ``max_consecutive_skips`` reached it raises instead.
    """
    config, state = step.config, step.state
    device = step.compute_device
    finite = flags.both(_all_finite(g_leaves, device), _all_finite(step.updates, device))
    if step.shards is not None:
        # Every rank must take the same decision: one all_reduce of one value.
        bad = step.shards.all_sum((~finite).to(torch.float64).reshape(1))
        finite = (bad == 0).reshape(())
    if flags.value(finite) is False:
        check_skip_allowed(config, state, "anderson.update")

    def skipped() -> tuple[Any, AndersonState]:
        return tree.unflatten(step.spec, list(step.params)), step.commit(count_skip(state))

    return select(finite, step.run, skipped)


def check_skip_allowed(config: _Config, state: AndersonState, owner: str) -> None:
    """Raises ``FloatingPointError`` if one more skipped call would exceed
    ``max_consecutive_skips`` (eager mode: the streak is a concrete counter)."""
    limit = config.max_consecutive_skips
    streak = tree.static_value(state.skip_streak)
    if limit is not None and streak is not None and streak >= limit:
        raise FloatingPointError(
            f"{owner}: the grads or the inner update are not finite for the {streak + 1}-th "
            f"call in a row (max_consecutive_skips={limit}); params and state are left as "
            "after the last finite call. Lower the learning rate, clip the gradients or check "
            "the loss."
        )


def count_skip(state: AndersonState) -> AndersonState:
    """``state`` after a skipped call: everything as it was but the two skip counters."""
    return state._replace(num_skipped=state.num_skipped + 1, skip_streak=state.skip_streak + 1)


class _Step:
    """One call of ``update``: the parts both modes share (gates, ring append, safeguard)."""

    def __init__(
        self,
        config: _Config,
        state: AndersonState,
        p_leaves: list[Tensor],
        spec: Any,
        u_leaves: list[Tensor],
        inner_state: Any,
        inplace: bool,
        loss_fn: LossFn | None,
        shards: distributed.ShardedCall | None = None,
        *,
        guard: InterruptGuard | None = None,
        plain: bool = False,
    ) -> None:
        self.config = config
        # Eager in-place calls only: the caller's state is written back at each commit.
        self.guard = guard
        self.plain = plain
        self.state = state
        self.params = p_leaves
        self.spec = spec
        self.updates = u_leaves
        self.inner_state = inner_state
        self.inplace = inplace
        self.loss_fn = loss_fn
        # Eager: the call's number as an int, from which the call-count gates are read
        # without tensor operations (None under vmap / torch.compile).
        self.count, self.count_value = _advance(state.count, 1)
        self.q = config.num_slots
        self.ring = tuple(tree.flatten(r, "state.residuals")[0] for r in state.residuals)
        # The caller's window leaves by field (window_tree): residuals, anchor or iterates.
        self.caller_window: dict[str, Any] = {"residuals": self.ring}
        self.compute_device = state.gram.device
        self.compute_dtypes, self.overflow_limit = _arithmetic(
            config.history_dtype, tuple(p.dtype for p in p_leaves)
        )
        # A float64 window is mixed through a QR factor of its differences (accurate to
        # eps * cond); other windows through their float64 Gram matrices (O(m n)).
        self.exact = all(leaf.dtype == torch.float64 for leaf in self.ring[0])
        # Sharded params only: the Gram row of the newest residual and the QR factor summed over
        # ranks, the mixing weights and the bounds of the finiteness certificate (see
        # distributed.py).
        self.shards = shards
        self.summed_rows: tuple | None = None
        self.summed_factor: Tensor | None = None
        self.base_bound: Tensor | None = None
        self.weights: Any = None
        self.chrono_norms: Tensor | None = None

    # -- helpers ---------------------------------------------------------------------------
    def owned(self, values: list[Tensor], callers: list[Tensor]) -> list[Tensor]:
        """``values`` with copies of those that are the caller's own tensors.

        The window must own its buffers, or a caller writing into what it passed or got back
        (``x.copy_(new)``, a later in-place step) corrupts it. In-place steps copy into the
        window's slots anyway, so nothing needs cloning there.
        """
        if self.inplace:
            return values
        return [v.clone() if v is c else v for v, c in zip(values, callers)]

    def store_anchor(
        self, anchor: list[Tensor], values: list[Tensor], callers: list[Tensor]
    ) -> list[Tensor]:
        """The anchor after ``anchor = values`` (the newest entry, in the params' dtype):
        copied into its buffers in place, else ``values`` owned by the window (``callers``:
        the caller's tensors that ``values`` may be, see :meth:`owned`)."""
        if self.inplace:
            for a, v in zip(anchor, values):
                assign(a, v)
            return anchor
        return self.owned(values, callers)

    def inner_step(self) -> list[Tensor]:
        """``y = x + u``: the plain step, written into the params' buffers if ``inplace``."""
        if self.inplace:
            if not blending():
                return [p.add_(u) for p, u in zip(self.params, self.updates)]
            for p, u in zip(self.params, self.updates):
                assign(p, p + u)  # inside a blended select (skip_nonfinite, traced)
            return self.params
        return [p + u for p, u in zip(self.params, self.updates)]

    def to_history(self, leaves: list[Tensor], like: list[Tensor]) -> list[Tensor]:
        """Leaves moved to the window's device/dtype/layout (O(n) per leaf, no-op if there).

        A copy from CUDA to a CPU window lands in page-locked memory (``non_blocking``), all
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

    def slot_valid(self, head: Tensor, num_residuals: Tensor) -> Tensor:
        """Ring-order mask of slots holding one of the newest ``num_residuals`` residuals."""
        slots = torch.arange(self.q, device=head.device)
        age = (head - slots) % self.q
        return age < num_residuals

    def chronological(self, head: Tensor) -> Tensor:
        """Ring slots from oldest to newest (the newest is ``head``)."""
        return (head + 1 + torch.arange(self.q, device=head.device)) % self.q

    def append(
        self,
        ring: tuple,
        grams: tuple,
        head: Tensor,
        num_residuals: Tensor,
        residual: list[Tensor],
        g: Tensor | None = None,
    ) -> tuple[tuple, tuple, Tensor, Tensor, Tensor]:
        """Writes ``residual`` into the next slot and updates ``grams = (gram, dr_gram, dr_rhs)``.

        ``g``: the residual's Gram row when :func:`append_difference` already computed it.

        A residual whose Gram rows are not finite (an Inf/NaN iterate) is zeroed and the window
        restarts from the newest entry, so poisoned data never reaches a later mix.

        Returns ``(ring, grams, head, num_residuals, poisoned)``.
        """
        slot, _ = _advance(head, 1, modulo=self.q)
        ring = write_slot(ring, slot, residual, self.inplace)
        rows = local_rows = difference_rows(ring, slot, self.compute_device, grams[0], g=g)
        grown, _ = _advance(num_residuals, 1, high=self.q)
        if self.shards is not None:
            # The state keeps the newest rows as this rank's partial sums; the decisions below
            # use the sums over ranks. A float64 window's factor for this call's mix rides
            # along in the same all_reduce.
            factor = self.shard_factor(ring, slot, grown)
            grams, rows = self.reduce_rows(grams, head, rows, factor=factor)
        stacked = torch.stack(rows)  # (3, Q): one finiteness check for the three rows
        if tree.static_value(grown) != self.q:  # a full window has no invalid slot to mask
            valid = self.slot_valid(slot, grown).to(stacked.device)
            stacked = torch.where(valid, stacked, 0.0)
        poisoned = flags.negate(flags.all_finite(stacked, self.compute_device))

        def restart() -> tuple:
            if blending():  # blended into the slot by select: a broadcast zero, no fill
                zeros = [r.new_zeros(()).expand_as(r) for r in residual]
            else:
                zeros = [torch.zeros_like(r) for r in residual]
            return write_slot(ring, slot, zeros, self.inplace), tuple(map(torch.zeros_like, grams))

        g, h, c = local_rows
        updated = (set_gram_row(grams[0], slot, g), set_gram_row(grams[1], slot, h), c)
        ring, grams = select(poisoned, restart, (ring, updated))
        num_residuals = select(poisoned, lambda: torch.zeros_like(grown), grown)
        if self.shards is not None:
            self.summed_rows = select(poisoned, lambda: tuple(map(torch.zeros_like, rows)), rows)
        return ring, grams, slot, num_residuals, poisoned

    def replace_newest(self, ring: tuple, grams: tuple, head: Tensor, residual: list[Tensor]):
        """``ring[head] = residual`` (the safeguard moved the newest entry) and its Gram rows.

        Only the newest residual changed, so the rows of ``head`` and ``dr_rhs`` are recomputed;
        the difference it forms with its successor belongs to the oldest slot, which is unused.
        Sharded, the rows come from this rank's data alone (``direct``): the row of the
        previous residual in ``grams`` was summed over ranks by this call's reduction.
        """
        ring = write_slot(ring, head, residual, self.inplace)
        g, h, c = difference_rows(
            ring, head, self.compute_device, grams[0], direct=self.shards is not None
        )
        return ring, (set_gram_row(grams[0], head, g), set_gram_row(grams[1], head, h), c)

    def difference_valid(self, num_residuals: Tensor) -> Tensor:
        """Chronological mask of the differences ``f_{j+1} - f_j`` between valid residuals."""
        return torch.arange(self.q - 1) >= self.q - num_residuals

    def factor(self, ring: tuple, head: Tensor, num_residuals: Tensor) -> Tensor:
        """The float64 QR factor of ``[DF | f_head]`` over the valid residuals of ``ring``
        (this rank's rows only when sharded): one streaming pass, O(Q^2 n) flops."""
        order = self.chronological(head)
        valid = self.difference_valid(num_residuals)
        return difference_factor(ring, order, valid, self.compute_device)

    def shard_factor(self, ring: tuple, head: Tensor, num_residuals: Tensor) -> Tensor | None:
        """This rank's factor for the step's all_reduce: float64 windows, on calls that may mix."""
        if not self.exact or flags.value(self.may_mix()) is False:
            return None
        return self.factor(ring, head, num_residuals)

    def may_mix(self) -> Tensor:
        """The call-count gates of a mix (the window size is checked by the caller): past
        ``wait_iterations`` and on the ``frequency``; eagerly read from the call's number."""
        config = self.config
        if self.count_value is not None:
            count = self.count_value
            return flags.known(count > config.wait_iterations and count % config.frequency == 0)
        return (self.count > config.wait_iterations) & (self.count % config.frequency == 0)

    def solve(self, ring: tuple, grams: tuple, head: Tensor, num_residuals: Tensor):
        """The mixing weights of the window (chronological) and the chronological slot order
        (a tensor of ring slots; eagerly, the newest slot as an int: see :meth:`to_ring_order`).

        A float64 window: a float64 QR factor of ``[DF | f_last]`` streamed from the ring
        (summed over ranks by stacking every rank's factor) and
        :func:`aadl_func._src.solve.solve_factor`, accurate to ``eps * cond(DF)``. Other
        windows: the incrementally kept float64 Gram matrices and
        :func:`aadl_func._src.solve.solve_differences` (normal equations, ``O(Q^2)``).
        """
        gram, dr_gram, dr_rhs = grams
        if self.shards is not None:
            if self.summed_rows is None:
                factor = self.shard_factor(ring, head, num_residuals)
                (gram, dr_gram, _), self.summed_rows = self.reduce_rows(grams, head, factor=factor)
            g, h, dr_rhs = self.summed_rows
            gram, dr_gram = set_gram_row(gram, head, g), set_gram_row(dr_gram, head, h)
        newest = tree.static_value(head)
        if newest is not None:
            # Eager: a cached index instead of index arithmetic on every call.
            slots, later = _chronological_slots(self.q, newest, gram.device)
        else:
            slots = self.chronological(head).to(self.compute_device)
            later = slots[1:]  # d at chronological position j + 1 is the column of gamma_j
        residual_sq = torch.diagonal(gram).index_select(0, slots)  # ||f_i||^2, oldest first
        dr_chrono = dr_gram.index_select(0, later).index_select(1, later)
        dr_rhs = dr_rhs.index_select(0, later)
        order = newest if newest is not None else slots
        num_valid = num_residuals.to(self.compute_device)
        reg = self.regularisation(dr_chrono, num_valid)
        if self.exact:
            if self.shards is not None:
                factor = self.summed_factor  # every rank's, from this call's all_reduce
            else:
                factor = self.factor(ring, head, num_residuals)
            valid = self.difference_valid(num_residuals).to(self.compute_device)
            weights = solve_factor(factor, valid, reg)
        else:
            weights = solve_differences(
                dr_chrono, dr_rhs, residual_sq, num_valid, reg, residual_norm=False
            )
        if self.shards is not None:
            self.weights = weights
            self.chrono_norms = residual_sq.clamp(min=0.0).sqrt()
        return weights, order

    def regularisation(self, dr_chrono: Tensor, num_valid: Tensor) -> float | Tensor:
        r"""The Tikhonov weight :math:`\lambda = \mathrm{reg} + \mathrm{reg\_relative}\,
        \|\Delta F\|_F^2 / m` of the small problem.

        :math:`\Delta F` holds the :math:`m` valid differences of consecutive residuals (the
        columns of :math:`\gamma`), so the relative part is their mean squared norm, the
        diagonal of ``dr_chrono`` (:math:`\Delta F^\top \Delta F`, chronological) over the
        valid columns: no pass over the window. Scaling every residual by :math:`s` scales
        both sides of the normal equations by :math:`s^2`, so this part leaves
        :math:`\gamma` unchanged (scale-free, unlike the absolute ``reg``).
        """
        config = self.config
        if config.reg_relative == 0.0:
            return config.reg
        m = dr_chrono.shape[0]
        # gamma_j (j = 0..m-1) is valid when residuals j and j + 1 both are (solve.py).
        valid = torch.arange(m, device=dr_chrono.device) >= m + 1 - num_valid
        mean_sq = torch.where(valid, torch.diagonal(dr_chrono), 0.0).sum() / valid.sum().clamp(
            min=1
        )
        return config.reg + config.reg_relative * mean_sq

    def restarted(self, window_size: Tensor, rejected: Tensor) -> Tensor:
        """``restart_on_reject``: the window size after a rejected mix is cut to the newest
        entry (aadl) or pair (classic); older slots count again only once overwritten."""
        if not self.config.restart_on_reject:
            return window_size
        known = flags.value(rejected)
        if known is not None:
            return window_size.clamp(max=1) if known else window_size
        return torch.where(rejected, window_size.clamp(max=1), window_size)

    def to_ring_order(self, chrono_values: Tensor, order: Tensor | int) -> Tensor:
        """Values by chronological position (oldest first) moved to their ring slots;
        ``order`` from :meth:`solve`."""
        if isinstance(order, int):  # the newest slot: position j is slot (order + 1 + j) % Q
            return chrono_values.roll(order + 1)
        return torch.zeros_like(chrono_values).index_copy(0, order, chrono_values)

    def finite(self, leaves: list[Tensor]) -> Tensor:
        if self.shards is not None:
            # A local check would differ between ranks; the certificate is the same on all.
            return self.certified_finite()
        # Checked against the params' dtype, which the mix is cast to: a float32 mix of fp16
        # params can be finite and still overflow there. NaN fails both comparisons.
        flag = flags.TRUE
        for t, p in zip(leaves, self.params):
            if t.numel() == 0:
                continue
            limit = torch.finfo(p.dtype).max
            transformed = tree.is_transformed(t)
            if transformed:
                # Batched, aminmax runs as a per-row reduction ~10x slower than amin + amax.
                low, high = t.amin(), t.amax()
            else:
                low, high = torch.aminmax(t)
            if not transformed and flags.value(flag) is not None:
                # Eager on the CPU: the two values read and compared in Python (no device
                # wait there), which saves the small comparison operations.
                lo, hi = low.item(), high.item()
                if not (lo >= -limit and hi <= limit):
                    return flags.FALSE
                continue
            flag = flags.both(
                flag, tree.decision((low >= -limit) & (high <= limit), self.compute_device)
            )
        return flag

    def to_params(self, leaves: list[Tensor]) -> list[Tensor]:
        """Leaves moved to the params' devices and dtypes. From a page-locked CPU window to
        CUDA the copy is asynchronous (stream-ordered before any use of the params)."""
        return [
            v.to(device=p.device, dtype=p.dtype, non_blocking=True)
            for v, p in zip(leaves, self.params)
        ]

    def safeguard(self, gate: Tensor, x: list[Tensor], y: list[Tensor]) -> Tensor:
        """``gate`` and ``loss_fn(x) < loss_fn(y)`` (both finite); True without ``loss_fn``."""
        if self.loss_fn is None:
            return gate

        def decide() -> Tensor:
            with self.callbacks():
                loss_x = self.loss_fn(tree.unflatten(self.spec, x))
                loss_y = self.loss_fn(tree.unflatten(self.spec, y))
            for loss in (loss_x, loss_y):
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise TypeError("anderson.update: `loss_fn` must return a scalar tensor")
            if self.shards is not None:
                loss_x, loss_y = self.shards.mean_losses(loss_x, loss_y)
            better = torch.isfinite(loss_x) & (loss_x < loss_y)
            return flags.both(gate, flags.decision(better.reshape(()), self.compute_device))

        return select(gate, decide, flags.FALSE)

    def output(self, use_mix: Tensor, x: list[Tensor], y: list[Tensor]) -> list[Tensor]:
        """The returned params: ``x`` where ``use_mix`` else ``y``, in the params' buffers if
        ``inplace`` (``y`` already lives there)."""
        chosen = select(use_mix, lambda: x, y)
        if self.inplace:
            for p, v in zip(self.params, chosen):
                if v is not p:
                    assign(p, v)
            return self.params
        return list(chosen)

    def new_state(self, **fields: Any) -> AndersonState:
        """The state after this call's plain step: counted, inner state advanced, not skipped."""
        return self.state._replace(
            count=self.count,
            inner_state=self.inner_state,
            skip_streak=select(
                flags.known(tree.static_value(self.state.skip_streak) == 0),
                lambda: self.state.skip_streak,
                lambda: torch.zeros_like(self.state.skip_streak),
            ),
            **fields,
        )

    def window_tree(self, name: str, leaves: Any) -> Any:
        """The state field ``name`` (``anchor``: one list of leaves; ``residuals`` and
        ``iterates``: one list per slot) as trees like ``params``. When every leaf is the
        caller's own tensor (a window written in place, or not written) this is the caller's
        own field object: nothing to rebuild, and nothing to write back at a commit."""
        mine = self.caller_window.get(name)
        if name == "anchor":
            if mine is not None and _same_leaves(leaves, mine):
                return getattr(self.state, name)
            return tree.unflatten(self.spec, list(leaves))
        if mine is not None and len(leaves) == len(mine):
            if all(_same_leaves(a, b) for a, b in zip(leaves, mine)):
                return getattr(self.state, name)
        return tuple(tree.unflatten(self.spec, list(r)) for r in leaves)

    def commit_plain(
        self,
        ring: tuple,
        grams: tuple,
        head: Tensor,
        window_size: Tensor,
        poisoned: Tensor,
        **fields: Any,
    ) -> AndersonState:
        """The commit point: the state after this call's plain step (the window after its
        append, and the mode's own ``fields``), made the caller's; a Ctrl-C deferred so far is
        raised here."""
        plain = self.new_state(
            residuals=self.window_tree("residuals", ring),
            gram=grams[0],
            dr_gram=grams[1],
            dr_rhs=grams[2],
            head=head,
            window_size=window_size,
            num_nonfinite=flags.add_if(self.state.num_nonfinite, poisoned),
            **fields,
        )
        # In place, the caller's state now holds these values: building the final state
        # from it leaves the fields the mix does not change as the caller's own tensors,
        # which the final commit then need not copy again.
        plain = self.commit(plain)
        if self.guard is not None:
            self.guard.checkpoint()
        return plain

    def commit(self, new_state: AndersonState) -> AndersonState:
        """Makes ``new_state`` the caller's: in an eager in-place call its values are written
        into the tensors of the state passed in (which is returned), see atomic.py."""
        if self.guard is None:
            return new_state
        write_back(self.state, new_state)
        return self.state

    def callbacks(self) -> contextlib.AbstractContextManager:
        """Where the user's ``loss_fn`` runs: interruptible, after a deferred Ctrl-C is raised."""
        return self.guard.callbacks() if self.guard is not None else contextlib.nullcontext()

    def gate(self, window_size: Tensor, minimum: int) -> Tensor:
        """Whether this call mixes: past ``wait_iterations``, on the ``frequency``, with enough
        window (and never in the wrapper's ``plain`` recovery)."""
        if self.plain:
            return flags.FALSE
        may_mix = self.may_mix()
        size = tree.static_value(window_size)
        mixes = flags.value(may_mix)
        if size is not None and mixes is not None:
            return flags.known(mixes and size >= minimum)
        return flags.both(may_mix, window_size >= minimum)

    def stores(self) -> Tensor:
        """Whether this call stores its plain step in the window (every ``store_each_nth``)."""
        if self.count_value is not None:
            return flags.known(self.count_value % self.config.store_each_nth == 0)
        return self.count % self.config.store_each_nth == 0

    # -- sharded params (DTensor / FSDP2; see distributed.py) ------------------------------
    def reduce_rows(
        self,
        grams: tuple,
        head: Tensor,
        new_rows: tuple | None = None,
        factor: Tensor | None = None,
    ) -> tuple[tuple, tuple]:
        """The step's one all_reduce over the shard group.

        Sums over ranks, in one float64 vector: the rows ``gram[head]`` and ``dr_gram[head]`` of
        the previous newest residual (kept as this rank's partial sums because the safeguard
        may have replaced that residual after the previous reduction), then either the three
        partial rows of the residual appended now (``new_rows``) or the partial ``dr_rhs``,
        then, with ``factor`` (this rank's ``Q x Q`` QR factor of a float64 window), a
        ``(world, Q, Q)`` block holding it in this rank's slot and zeros elsewhere, and this
        rank's bound for :meth:`certified_finite`.

        The sum of the blocks is every rank's factor, in rank order, on every rank; their
        stacked QR (:func:`aadl_func._src.solve.stack_factors`) is the factor of the whole
        window, identical on all ranks, kept in ``summed_factor``. (Summing the factors'
        Gram matrices would square the condition number again; a TSQR tree needs a reduction
        with QR as its operator, which collectives do not offer.)

        Returns ``(grams with the head rows summed, the summed (g, h, c) of the newest
        residual)``.
        """
        q = self.q
        gram, dr_gram, dr_rhs = grams
        device = gram.device
        at = head.to(device)
        tail = list(new_rows) if new_rows is not None else [dr_rhs]
        parts = [gram[at], dr_gram[at], *(t.to(device) for t in tail)]
        rows_end = sum(p.numel() for p in parts)
        world = self.shards.world_size
        if factor is not None:
            own = torch.arange(world, device=device) == self.shards.rank
            slots = torch.where(own[:, None, None], factor.to(device)[None], 0.0)
            parts.append(slots.reshape(-1))
        parts.append(self.local_base_bound().to(device).reshape(1))
        total = self.shards.all_sum(torch.cat(parts))
        self.base_bound = total[-1]
        if factor is not None:
            every_rank = total[rows_end : rows_end + world * q * q].reshape(world * q, q)
            self.summed_factor = stack_factors([every_rank])
        gram = set_gram_row(gram, head, total[:q])
        dr_gram = set_gram_row(dr_gram, head, total[q : 2 * q])
        if new_rows is not None:
            summed = (total[2 * q : 3 * q], total[3 * q : 4 * q], total[4 * q : 5 * q])
        else:
            summed = (total[:q], total[q : 2 * q], total[2 * q : 3 * q])
        return (gram, dr_gram, dr_rhs), summed

    def local_base_bound(self) -> Tensor:
        r"""This rank's largest magnitude of the combination's base (0 if no mix can happen).

        Mode "aadl": the anchor, old (``state.anchor``) or new (``y = x + u``, bounded by
        ``max|x| + max|u|``, also when ``x`` already holds ``y``). Mode "classic": every
        iterate :math:`x_i = a - \sum_{j > i} \Delta x_j`, bounded by
        ``max|a| + Q max|dx|`` over the old anchor and differences and the new ones
        (``a = x``, ``dx = x - a_old``).
        """
        config = self.config
        known = flags.value(self.may_mix())
        device = self.compute_device
        if known is not None and not known:
            return torch.zeros((), dtype=torch.float64, device=device)
        anchor = distributed.max_abs(tree.flatten(self.state.anchor, "state.anchor")[0], device)
        newest = distributed.max_abs(self.params, device)
        if config.mode == "aadl":
            newest = newest + distributed.max_abs(self.updates, device)
            return torch.maximum(anchor, newest)
        differences = [
            leaf for entry in self.state.iterates for leaf in tree.flatten(entry, "iterates")[0]
        ]
        step = torch.maximum(distributed.max_abs(differences, device), anchor + newest)
        return torch.maximum(anchor, newest) + self.q * step

    def certified_finite(self) -> Tensor:
        r"""Whether the mix is certainly finite, from reduced quantities only (same on all ranks).

        With :math:`A` the summed base bound and :math:`\|r_s\| = \sqrt{G_{ss}}`, every entry
        of the mix is bounded by :math:`A + \sum_s |c_s| \|r_s\|` (aadl,
        :math:`x = a - \sum_s c_s r_s`) or :math:`A \sum_i |\alpha_i| + \beta \sum_i
        |\alpha_i| \|r_i\|` (classic); the mix is accepted when that bound is at most half
        the largest value of the parameter and compute dtypes.
        """
        alpha = self.weights.alpha
        if self.config.mode == "aadl":
            c = aadl_coefficients(alpha, self.config.relaxation).abs()
            spread = torch.where(c > 0, c * self.chrono_norms, 0.0).sum()
            bound = self.base_bound + spread
        else:
            a = alpha.abs()
            spread = torch.where(a > 0, a * self.chrono_norms, 0.0).sum()
            bound = self.base_bound * a.sum() + self.config.relaxation * spread
        return tree.decision(bound <= self.overflow_limit, self.compute_device)


class _AadlStep(_Step):
    def run(self) -> tuple[Params, AndersonState]:
        config, state = self.config, self.state
        anchor = tree.flatten(state.anchor, "state.anchor")[0]
        self.caller_window["anchor"] = anchor
        y = self.inner_step()
        y_hist = self.to_history(y, anchor)

        store = self.stores()
        # The window is empty exactly until the first stored call (count < store_each_nth);
        # read from the count, which the members of a vmapped ensemble share (window_size
        # is per member once a restart may have happened), so the append is not blended.
        empty = (
            flags.known(self.count_value - 1 < config.store_each_nth)
            if self.count_value is not None
            else state.count < config.store_each_nth
        )
        num_residuals, _ = _advance(state.window_size, -1, low=0)

        anchor_stored = False  # set when the append below already copied y into the anchor

        def append_residual() -> tuple:
            nonlocal anchor_stored
            head = tree.static_value(state.head) if self.inplace else None
            slot = None if head is None else (head + 1) % self.q
            if slot is not None and tree.any_transformed(y_hist):
                # A vmapped ensemble stepping together (a shared head): batched tensors have
                # neither ``out=`` nor raw pointers, so the difference takes the route below
                # and is then copied into its one slot.
                slot = None
            g = None
            if slot is not None:
                # In place the difference goes straight into its ring slot (rounded to the
                # history dtype once): appending allocates nothing parameter-sized. A float32
                # window on the CPU does it in one pass with the anchor copy and the Gram row.
                g = append_difference(self.ring, slot, y_hist, anchor, self.compute_device)
                anchor_stored = g is not None
                if g is None:
                    for yh, a, r in zip(y_hist, anchor, self.ring[slot]):
                        torch.sub(yh, a, out=r)
                residual = self.ring[slot]
            else:
                residual = [
                    (yh - a).to(config.history_dtype_of(a)) for yh, a in zip(y_hist, anchor)
                ]
                residual = self.to_history(residual, self.ring[0])
            return self.append(self.ring, grams, state.head, num_residuals, residual, g=g)

        grams = (state.gram, state.dr_gram, state.dr_rhs)
        no_append = (
            self.ring,
            grams,
            state.head,
            num_residuals,
            flags.FALSE,
        )
        ring, grams, head, num_residuals, poisoned = select(
            flags.both(store, flags.negate(empty)), append_residual, no_append
        )

        def store_anchor() -> list[Tensor]:
            if self.inplace and anchor_stored:
                return anchor
            return self.store_anchor(anchor, y_hist, y)

        anchor = select(store, store_anchor, anchor)

        def grown() -> Tensor:
            return select(
                empty,
                lambda: torch.ones_like(num_residuals),
                lambda: _advance(num_residuals, 1)[0],
            )

        window_size = select(store, grown, state.window_size)
        # Commit point (atomic.py): from here on the caller holds a finished plain step.
        plain = self.commit_plain(
            ring, grams, head, window_size, poisoned, anchor=self.window_tree("anchor", anchor)
        )
        # The committed tensors (the caller's, in place), so that the final state shares them
        # unless the safeguard moves the newest entry.
        grams = (plain.gram, plain.dr_gram, plain.dr_rhs)

        # Step 5, AADL's moving average (see aadl_func._src.average): decided on the window of
        # plain iterates before any mix. When it applies, the window is too noisy to
        # extrapolate from, so this call skips the mix (and its loss evaluations).
        averaged = flags.FALSE
        if config.average and not self.plain:

            def average() -> tuple[list[Tensor], Tensor]:
                return window_average(
                    anchor,
                    ring,
                    grams[0],
                    head,
                    window_size,
                    tol=config.average_tol,
                    compute_dtypes=self.compute_dtypes,
                )

            no_mean = [torch.zeros_like(a, dtype=c) for a, c in zip(anchor, self.compute_dtypes)]
            mean_hist, averaged = select(window_size >= 2, average, (no_mean, averaged))

        gate = flags.both(self.gate(window_size, 3), flags.negate(averaged))

        def mix_into_params() -> list[Tensor] | None:
            """The params' buffers when the mix can be written straight into them, saving a
            parameter-sized allocation and a copy: in place, without the safeguard or the
            moving average (both still read y there), unsharded, and only when this call
            stored y in the anchor (same device, dtype, layout), which then undoes a
            rejected mix."""
            if not self.inplace or self.loss_fn is not None or config.average:
                return None
            if self.shards is not None or flags.value(store) is not True:
                return None
            if tree.any_transformed(self.params):
                # vmap (members stepping together know ``store``): undoing a rejected mix
                # below needs ``ok`` as a value, which a batched flag is not.
                return None
            for p, a, c in zip(self.params, anchor, self.compute_dtypes):
                if not (p.dtype == a.dtype == c) or (p.device, p.stride()) != (
                    a.device,
                    a.stride(),
                ):
                    return None
            return self.params

        def extrapolate() -> tuple[list[Tensor], Tensor]:
            weights, order = self.solve(ring, grams, head, num_residuals)
            minus_c = aadl_coefficients(weights.alpha, config.relaxation, negated=True)
            into = mix_into_params()
            try:
                x_hist = combine(
                    # Mixing into the params, which hold y = the anchor bit for bit:
                    # accumulating there reads one parameter-sized buffer fewer than
                    # anchor -> params.
                    anchor if into is None else into,
                    [ring],
                    self.to_ring_order(minus_c, order),
                    self.compute_dtypes,
                    anchor,
                    out=into,
                )
                ok = flags.both(
                    flags.decision(weights.ok, self.compute_device), self.finite(x_hist)
                )
            except BaseException:
                if into is not None:
                    for p, a in zip(self.params, anchor):
                        p.copy_(a)  # back to y: the caller holds the plain step
                raise
            if into is not None and not flags.value(ok):
                for p, a in zip(self.params, anchor):
                    p.copy_(a)  # back to y
            return x_hist, ok

        def no_mix() -> tuple[list[Tensor], Tensor]:
            # Placeholders for the blend under vmap, built only on calls that do not mix.
            zeros = [torch.zeros_like(a, dtype=c) for a, c in zip(anchor, self.compute_dtypes)]
            return zeros, flags.FALSE

        # x is only used where mixable = gate & ok holds (the safeguard, the output): a gate
        # without a value (vmap, compile) computes it unblended.
        x_hist, ok = select(gate, extrapolate, no_mix, blend=False)
        mixable = flags.both(gate, ok)
        x = select(mixable, lambda: self.to_params(x_hist), y, blend=False)
        use_mix = self.safeguard(mixable, x, y)

        if self.loss_fn is not None:

            def replace_newest() -> tuple:
                newest = _read_slot(ring, head)
                x_anchor = [v.to(a.dtype) for v, a in zip(x_hist, anchor)]
                residual = [
                    (r.to(c) + (xa - a).to(c)).to(r.dtype)
                    for r, xa, a, c in zip(newest, x_anchor, anchor, self.compute_dtypes)
                ]
                ring_moved, new_grams = self.replace_newest(ring, grams, head, residual)
                if self.inplace:
                    for a, xa in zip(anchor, x_anchor):
                        assign(a, xa)
                    x_anchor = anchor
                else:
                    x_anchor = self.owned(x_anchor, x)
                return ring_moved, new_grams, x_anchor

            ring, grams, anchor = select(use_mix, replace_newest, (ring, grams, anchor))

        if config.average:
            x = select(averaged, lambda: self.to_params(mean_hist), x)
        out = self.output(flags.either(use_mix, averaged), x, y)
        rejected = flags.both(mixable, flags.negate(use_mix))
        failed = flags.both(gate, flags.both(flags.negate(ok), flags.negate(poisoned)))
        final = plain._replace(
            anchor=self.window_tree("anchor", anchor),
            residuals=self.window_tree("residuals", ring),
            gram=grams[0],
            dr_gram=grams[1],
            dr_rhs=grams[2],
            window_size=self.restarted(plain.window_size, rejected),
            num_mixed=flags.add_if(plain.num_mixed, use_mix),
            num_rejected=flags.add_if(plain.num_rejected, rejected),
            # A poisoned append was counted at the commit; a failed mix on a poisoned call
            # is the same event.
            num_nonfinite=flags.add_if(plain.num_nonfinite, failed),
            num_averaged=flags.add_if(plain.num_averaged, averaged),
        )
        return tree.unflatten(self.spec, out), self.commit(final)


class _ClassicStep(_Step):
    def run(self) -> tuple[Params, AndersonState]:
        config, state = self.config, self.state
        # The points x_i are kept as the newest one (the anchor, in the params' dtype) and
        # the differences dx_i = x_i - x_{i-1} of consecutive ones (history dtype), so that a
        # low-precision window rounds the steps, not the points themselves.
        anchor = tree.flatten(state.anchor, "state.anchor")[0]
        iterates = tuple(tree.flatten(r, "state.iterates")[0] for r in state.iterates)
        self.caller_window["anchor"] = anchor
        self.caller_window["iterates"] = iterates
        store = self.stores()

        def append_pair() -> tuple:
            slot, _ = _advance(state.head, 1, modulo=self.q)
            # x_k is copied into the window before an in-place step overwrites params.
            point = self.to_history(self.params, anchor)
            step = [(x - a).to(d.dtype) for x, a, d in zip(point, anchor, iterates[0])]
            step = self.to_history(step, iterates[0])
            new_iterates = write_slot(iterates, slot, step, self.inplace)
            residual = self.owned(self.to_history(self.updates, self.ring[0]), self.updates)
            ring, grams, head, size, poisoned = self.append(
                self.ring,
                (state.gram, state.dr_gram, state.dr_rhs),
                state.head,
                state.window_size,
                residual,
            )
            new_anchor = self.store_anchor(anchor, point, self.params)
            return new_iterates, new_anchor, ring, grams, head, size, poisoned

        unchanged = (
            iterates,
            anchor,
            self.ring,
            (state.gram, state.dr_gram, state.dr_rhs),
            state.head,
            state.window_size,
            flags.FALSE,
        )
        iterates, anchor, ring, grams, head, window_size, poisoned = select(
            store, append_pair, unchanged
        )

        y = self.inner_step()
        # Commit point (atomic.py): from here on the caller holds a finished plain step.
        plain = self.commit_plain(
            ring,
            grams,
            head,
            window_size,
            poisoned,
            anchor=self.window_tree("anchor", anchor),
            iterates=self.window_tree("iterates", iterates),
        )

        gate = self.gate(window_size, 2)

        def extrapolate() -> tuple[list[Tensor], Tensor]:
            weights, order = self.solve(ring, grams, head, window_size)
            alpha = weights.alpha
            # The sum of the steps comes first and the anchor is added last (a fresh tensor,
            # in place), so that the sum rounds alike on every path, as without an anchor.
            steps = combine(
                None,
                [iterates, ring],
                torch.cat(
                    [
                        self.to_ring_order(classic_coefficients(alpha), order),
                        self.to_ring_order(config.relaxation * alpha, order),
                    ]
                ),
                self.compute_dtypes,
                anchor,
            )
            x_hist = [v.add_(a) for v, a in zip(steps, anchor)]
            ok = flags.both(flags.decision(weights.ok, self.compute_device), self.finite(x_hist))
            return x_hist, ok

        def no_mix() -> tuple[list[Tensor], Tensor]:
            # Placeholders for the blend under vmap, built only on calls that do not mix.
            zeros = [torch.zeros_like(r, dtype=c) for r, c in zip(ring[0], self.compute_dtypes)]
            return zeros, flags.FALSE

        # x is only used where mixable = gate & ok holds (the safeguard, the output): a gate
        # without a value (vmap, compile) computes it unblended.
        x_hist, ok = select(gate, extrapolate, no_mix, blend=False)
        mixable = flags.both(gate, ok)
        x = select(mixable, lambda: self.to_params(x_hist), y, blend=False)
        use_mix = self.safeguard(mixable, x, y)
        out = self.output(use_mix, x, y)
        rejected = flags.both(mixable, flags.negate(use_mix))
        failed = flags.both(gate, flags.both(flags.negate(ok), flags.negate(poisoned)))
        final = plain._replace(
            window_size=self.restarted(plain.window_size, rejected),
            num_mixed=flags.add_if(plain.num_mixed, use_mix),
            num_rejected=flags.add_if(plain.num_rejected, rejected),
            # A poisoned append was counted at the commit; a failed mix on a poisoned call
            # is the same event.
            num_nonfinite=flags.add_if(plain.num_nonfinite, failed),
        )
        return tree.unflatten(self.spec, out), self.commit(final)


def _advance(
    counter: Tensor,
    step: int,
    *,
    modulo: int | None = None,
    low: int | None = None,
    high: int | None = None,
) -> tuple[Tensor, int | None]:
    """``counter + step`` (a 0-d int64 counter), then taken ``% modulo`` or clamped to
    ``[low, high]``: a new tensor and, eagerly, its value as an int (else ``None``).

    An eager counter is read once and the result made in one operation; the same chain of
    tensor operations (``clamp(w - 1, min=0)``: two) costs a few microseconds per link,
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
    at least float32), and the overflow limit of :meth:`_Step.finite`'s certificate: half
    the largest value of every params and compute dtype. Cached for eager calls, which ask
    on every step (a traced step computes it once, at trace time)."""
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


_SLOT_ORDERS: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}


def _chronological_slots(q: int, newest: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The ring slots oldest first when ``newest`` is the newest one, and those after the
    oldest (the slots of the differences' newer ends), cached: a handful of tiny index
    tensors per device, shared read-only by every step."""
    key = (q, newest, device)
    if key not in _SLOT_ORDERS:
        slots = torch.tensor([(newest + 1 + j) % q for j in range(q)], device=device)
        _SLOT_ORDERS[key] = (slots, slots[1:])
    return _SLOT_ORDERS[key]


def _same_leaves(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _read_slot(ring: tuple, slot: Tensor) -> list[Tensor]:
    index = tree.static_value(slot)
    if index is not None:
        return list(ring[index])
    # index_select, not ``[slot]``: indexing with a tensor would read its value (torch.compile).
    at = slot.reshape(1)
    return [
        torch.stack([entries[i] for entries in ring]).index_select(0, at.to(ring[0][i].device))[0]
        for i in range(len(ring[0]))
    ]

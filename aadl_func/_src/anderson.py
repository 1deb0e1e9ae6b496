"""`anderson`: Anderson acceleration as a functional (init, update) transformation.

The entry points live here: [`anderson()`][aadl_func.anderson] (the options, `AndersonOptions`),
`init` (the state's buffers, laid out by the mode's record in `aadl_func._src.modes`) and
`update`, which checks its arguments, runs the inner optimizer and hands one
`aadl_func._src.update_call.Call` to the one sequence of steps
(`aadl_func._src.update.update()`, with the mode's functions). `step()` is that
entry point for other front ends
([`aadl_func.AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import (
    deferred,
    distributed,
    flags,
    grad_mode,
    native,
    protocols,
    tree,
)
from aadl_func._src.atomic import InterruptGuard, guarded
from aadl_func._src.checks import (
    MISSING,
    autograd_policy,
    check_call,
    check_dense,
    check_floating,
    check_update_inputs,
    differentiating,
    keep_requires_grad,
    mark_verified,
)
from aadl_func._src.core import accept
from aadl_func._src.core.scalars import wide
from aadl_func._src.exec import eager, steady
from aadl_func._src.exec.inplace import commit, recover
from aadl_func._src.options import AndersonOptions
from aadl_func._src.protocols import AndersonInit, AndersonUpdate
from aadl_func._src.stages import revert
from aadl_func._src.state import COUNTERS, AndersonState
from aadl_func._src.update import update as general_update
from aadl_func._src.update_call import Call
from aadl_func._src.window import new_ring

__all__ = ["Anderson", "anderson"]

Params = Any
LossFn = Callable[[Params], Tensor]


class Anderson(NamedTuple):
    """A functional optimizer: `state = init(params)`;
    `params, state = update(state, params, grads, *, inplace=False, loss_fn=None,
    loss=None)`.

    Typed by [`aadl_func.AndersonInit`][aadl_func.AndersonInit] and
    [`aadl_func.AndersonUpdate`][aadl_func.AndersonUpdate]."""

    init: AndersonInit
    update: AndersonUpdate


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
    reg_column: float = 0.0,
    line_search: bool = False,
    sufficient_decrease: float = 0.0,
) -> Anderson:
    r"""Anderson-accelerates an inner optimizer, treating its step as a fixed-point map `g`.

    The defaults are AADL's, so that AADL's users get AADL's algorithm unchanged; the
    recommended full-batch setting differs because mode `"classic"` with a safeguard around
    Adam without momentum did better on every problem measured (docs/guide.md):
    `anderson(adam(lr, betas=(0.0, 0.999)), mode="classic", history_depth=20,
    reg_relative=1e-4)`, called as `update(state, params, grads, loss=value)`.

    Mode `"aadl"` (default, AADL's semantics). Call number $k$ (1-based):

    1. $y = g(x)$, the inner optimizer's step from `params` with `grads`;
    2. if $k \bmod$ `store_each_nth` $= 0$, $y$ joins the window (at most
       `history_depth` entries, oldest dropped);
    3. if $k >$ `wait_iterations`, $k \bmod$ `frequency` $= 0$ and the
       window holds at least 3 entries, the params become $x$ = [`aadl_func.mix()`][aadl_func.mix]
       (window, `relaxation`, `reg`), else $y$;
    4. with `loss_fn`, $x$ is kept only if `loss_fn(x) < loss_fn(y)`, and then also
       replaces the newest window entry; a non-finite $x$ is never returned.
    5. with `average=True`, AADL's moving average, decided before step 3: when the window's
       spread $\|s\|_2$ (per-coordinate sample standard deviation) exceeds
       `average_tol` $\|\bar x\|_2$, the params become the window mean $\bar x$
       and no mix is formed on that call (see `aadl_func._src.average`).

    Mode `"classic"`: textbook type-II Anderson acceleration on the pairs
    $(x_i, g(x_i))$ of the last `history_depth` calls,

    $$
    x_{k+1} = \sum_i \alpha_i \big((1 - \beta) x_i + \beta g(x_i)\big), \quad
    \alpha = \arg\min_{\sum \alpha = 1} \Big\|\sum_i \alpha_i (g(x_i) - x_i)\Big\|,
    $$

    gated by `wait_iterations` and `frequency` (and at least 2 pairs); on a linear map with
    full history and $\beta = 1$ it is equivalent to GMRES (Walker & Ni, 2011).

    The window is a ring of residuals with float64 Gram matrices (of the residuals and of their
    consecutive differences) updated one row per stored entry: a step costs two passes over
    the window ($O(m n)$), solves an $m \times m$ problem in float64
    (`aadl_func._src.core.lstsq.solve_differences`) and stores, in mode "aadl", the newest entry
    plus `history_depth - 1` differences; in mode "classic", the newest point plus
    `history_depth` differences of points and `history_depth` residuals (points are
    stored as steps so that a low-precision `history_dtype` rounds the steps, not the
    points). A float64 window is solved more accurately, from
    a float64 QR factor of the differences streamed from the ring on mixing calls
    (`aadl_func._src.core.lstsq.solve_factor`: $O(m^2 n)$ flops, no extra
    parameter-sized memory), so that the condition number of the differences is not squared.

    Args:
      inner: the inner optimizer, e.g. [`aadl_func.adam()`][aadl_func.adam], or any object with
        torchopt-style `init(params)` and `update(updates, state, params=None, inplace=...)`
        returning `(updates, state)` (updates are added to the params).
      history_depth: window entries, `>= 3`.
      relaxation: $\beta > 0$; 1 is undamped, above 1 over-relaxes.
      reg: absolute Tikhonov weight of the least-squares problem, `>= 0`.
      wait_iterations: calls before the first mixing, `>= 0`.
      store_each_nth: store every n-th inner step in the window, `>= 1`.
      frequency: mix every `frequency` calls, `>= 1`.
      mode: `"aadl"` or `"classic"` (complex params: `"classic"` only, with complex128
        Hermitian Grams; docs/solver.md, "Complex tensors").
      average: AADL's moving-average rule on the window (see the README).
      average_tol: relative spread of the window above which `average` applies, `> 0`.
      history_device: where the window lives (default: each parameter's device).
      compute_device: where the small least-squares problem is solved (default: the history
        device of the first parameter). Passes over the window always run where it lives.
      history_dtype: dtype of the stored differences (default: each parameter's dtype).
      skip_nonfinite: skip a call whose grads or inner update are not finite (as optax's
        `apply_if_finite` and `torch.amp.GradScaler` do): params and state are left as
        they were, except `num_skipped` and `skip_streak`, which count it. The inner
        update is then computed out of place and adopted only if finite (one inner-state-sized
        temporary more with `inplace=True`).
      max_consecutive_skips: with `skip_nonfinite`, how many calls in a row may be skipped;
        the next non-finite one raises `FloatingPointError` and changes nothing (eager mode;
        under `vmap` the calls are only counted). None: never give up.
      reg_relative: a Tikhonov weight relative to the window, `>= 0`: the least-squares
        problem is solved with $\lambda = \mathrm{reg} + \mathrm{reg\_relative}\,
        \|\Delta F\|_F^2 / m$ (below), which does not depend on the scale of the parameters
        or of the step.
      restart_on_reject: when the `loss_fn` safeguard rejects a mix, the window restarts
        from its newest entry (below). Without `loss_fn` nothing is ever rejected.
      reg_column: a Tikhonov weight per column, `>= 0`: column $j$ of the
        least-squares problem gets $\mathrm{reg\_column}\, \|\Delta f_j\|^2$ on top of
        $\lambda$ (below). This is SciPy's `w0` (`scipy.optimize.anderson`) with
        `reg_column = w0**2`: each column is damped relative to its own norm, so the newest,
        smallest differences are not over-damped as by `reg_relative`'s window mean.
      line_search: with `loss_fn`, search along the mix instead of keeping or dropping it
        (below). Eager calls only (not under vmap or torch.compile, not sharded).
      sufficient_decrease: $c \in [0, 1)$, the deferred safeguard's (`loss=`) bar for
        keeping a mix: below the loss at the point it was made from by at least $c$ times
        the decrease the plain step promises to first order (below). 0 (default): below that
        loss at all. Not with sharded params.

    Options for minibatch (stochastic) training, where consecutive residuals differ by gradient
    noise as much as by curvature (see examples/minibatch.py and the README):

    * `reg_relative`: with $\Delta F = [\Delta f_0, \dots, \Delta f_{m-1}]$ the
      $m$ valid differences of consecutive residuals (mode "aadl": $\Delta R$),
      the coefficients solve

      $$
      \gamma = \arg\min_\gamma \|f_{\mathrm{last}} - \Delta F \gamma\|^2
          + \lambda \|\gamma\|^2, \qquad
      \lambda = \mathrm{reg} + \mathrm{reg\_relative}\;
          \frac{1}{m} \sum_j \|\Delta f_j\|^2 .
      $$

      The relative part scales with $\Delta F^\top \Delta F$, so the damping of
      $\gamma$ towards the plain step is the same whatever the parameters' or the
      learning rate's scale (an absolute `reg` must be re-tuned when either changes), as
      the ridges of regularised nonlinear acceleration (Scieur, d'Aspremont, Bach, 2016:
      $\propto \|R^\top R\|$) and of AdaSAM (Wei, Bao, Liu, 2021:
      $\propto \|r_k\|^2 / \|\Delta x_{k-1}\|^2$) are.
    * `restart_on_reject`: when `loss_fn` rejects the mix of call $k$, the window
      keeps only its newest entry (mode "aadl": $y_k$; mode "classic": the pair
      $(x_k, g(x_k))$), so the next mixes use only steps taken from then on. A rejection
      says the window's secant information no longer describes the map (in minibatch training,
      it is mostly noise). The restart itself costs nothing: no pass over the window, no
      extra loss evaluation (the safeguard's `loss_fn` may be a held-out minibatch's loss).

    * `line_search` (N-GMRES's step, De Sterck 2012; O-ACCEL, Riseth 2019): with the plain
      step $y$, the mix $x$ and $d = x - y$, the returned point is $y + s\,d$ for the
      step length $s$ of a backtracking Armijo search on $\phi(s) = $ `loss_fn`$(y + s d)$
      (`aadl_func._src.core.linesearch.armijo()`, SciPy's: $s = 1$ first, then
      interpolations, down to $s = 0.01$) with $\phi'(0) = \nabla \ell(y)^\top d$ from
      one forward-mode derivative (`torch.func.jvp` of `loss_fn`). When $d$ is not a
      descent direction ($\phi'(0) \ge 0$) or no step length qualifies, $y$ is returned
      and the window restarts from its newest entry, as `restart_on_reject` does. A point
      that is kept counts as a mix and, in mode "aadl", replaces the newest window entry.
      It costs `loss_fn`'s forward-mode derivative and one evaluation per trial (one when
      $s = 1$ qualifies), where the plain `loss_fn` safeguard costs two evaluations.

    * `sufficient_decrease` (Armijo's condition, with the plain step as the yardstick): with
      `update(..., loss=value)` the mix $x_{k+1}$ returned at call $k$ is judged at call
      $k + 1$ by the loss there; it is kept only if
      $\ell(x_{k+1}) < \ell(x_k) + c\, \langle \nabla \ell(x_k), u_k \rangle$, $u_k$ the
      inner optimizer's update at $x_k$ (the plain step's direction) and `grads` taken as
      $\nabla \ell(x_k)$. With $c = 0$ any decrease keeps a mix, and a mix that decreases
      the loss by little is kept again and again: on the full-batch suite's Poisson PINN and
      extended Rosenbrock, around Adam, the accepted mixes stall where the inner optimizer
      alone goes on (docs/guide.md). The inner update is then computed out of place (its
      input is the gradient the condition reads).

    `inplace=True` may also write the grads (the inner optimizer's in-place update puts its
    update there, torchopt's convention); pass grads that are not needed after the call.
    (Mode "aadl" around a plain `sgd` reads them only, once its window is full: the update
    `-lr * g` is formed in the pass that stores the window's entry.)

    `inplace=True` is exception safe: whatever is raised wherever in a call (`loss_fn`,
    Ctrl-C, an out-of-memory error, another signal's handler), the params and the state
    passed in are left at one complete outcome, ready for the next call, and the exception
    propagates: as they were (raised before the first write), as after the plain step `y`
    of that call (its mix dropped uncounted; raised in `loss_fn`, by a deferred Ctrl-C, or
    anywhere after the commit point), as after the plain step with the window restarted from
    `y` (raised while the plain step was being written), or the call's complete result
    (raised during its final writes). The state's tensors are updated in place and the
    returned state holds those same tensors. See `aadl_func._src.exec.inplace.recover` and
    docs/reliability.md. That guarantee is the eager one:
    under `torch.compile` (and `vmap`) the in-place writes are masked blends inside one
    graph, the returned state carries new counters, and an interrupted compiled call may be
    half written; `inplace=False` never writes its inputs (README, "Compiling").

    Returns:
      [`Anderson`][aadl_func.Anderson] `(init, update)`.
    """
    options = AndersonOptions(**locals())  # validates every option (AndersonOptions)
    return Anderson(*functions(options))


def functions(options: AndersonOptions) -> tuple[AndersonInit, AndersonUpdate]:
    """The `init` and `update` functions of [`Anderson`][aadl_func.Anderson] for `options`."""

    def init(params: Params) -> AndersonState:
        # No graph through the state (see checks.autograd_policy).
        return _without_graph(functools.partial(_init, options, params))

    def update(
        state: AndersonState,
        params: Params,
        grads: Params = MISSING,
        /,
        *,
        inplace: bool = False,
        loss_fn: LossFn | None = None,
        loss: Tensor | float | None = None,
        **misplaced: Any,
    ) -> tuple[Params, AndersonState]:
        # `grads`' default and `misplaced` only catch calls made as to a gradient
        # transformation (`update(updates, state, params=...)`), to say what to call instead.
        # A missing `grads` is caught by check_update_inputs: testing it here (`grads is
        # MISSING`) costs a compiled step one more parameter-sized buffer (torch 2.13).
        if misplaced:
            grads = check_call(state, params, grads, misplaced)
        # No graph through the window (see checks.autograd_policy).
        out, new_state = _without_graph(
            functools.partial(
                step, options, state, params, grads, inplace=inplace, loss_fn=loss_fn, loss=loss
            )
        )
        return keep_requires_grad(out, params, inplace), new_state

    return init, update


def _without_graph(run: Callable[[], Any]) -> Any:
    """`run()` under `autograd_policy()` (`torch.no_grad()` unless a differentiating
    transform is active), torch's grad mode put back as it was however it ends
    (`grad_mode.kept`: a `with` alone can skip its `__exit__`)."""
    return grad_mode.kept(run, autograd_policy if differentiating() else None)


def _counter() -> Tensor:
    # Counters live on the CPU: reading them never synchronises an accelerator.
    return torch.zeros((), dtype=torch.int64)


def _pin_window(options: AndersonOptions, p: Tensor) -> bool:
    # The newest entry of a CPU window serving CUDA params is page-locked: the mix is laid
    # out like it (window.combine), so the O(n) copy back to the params is asynchronous.
    # The ring itself never crosses devices and stays pageable.
    return p.is_cuda and options.history_device_of(p).type == "cpu"


def _window_buffer(
    options: AndersonOptions,
    p: Tensor,
    num_slots: int = 1,
    dtype: torch.dtype | None = None,
    pin_memory: bool = False,
) -> list[Tensor]:
    """`num_slots` zeroed window buffers for leaf `p`, rows of one allocation."""
    return new_ring(
        p,
        num_slots,
        dtype=options.history_dtype_of(p) if dtype is None else dtype,
        device=options.history_device_of(p),
        pin_memory=pin_memory,
    )


def _init(options: AndersonOptions, params: Params) -> AndersonState:
    """A fresh state for `params`: empty rings, zero Grams and counters, the inner state."""
    # Sharded (DTensor) params: the state holds each rank's local shards only.
    params = distributed.local_params(params, "anderson.init", average=options.average)
    leaves, spec = tree.flatten(params, "params", owner="anderson.init")
    if not leaves:
        raise ValueError("anderson.init: `params` must contain at least one tensor")
    check_dense("anderson.init", "params", leaves, spec)
    check_floating("anderson.init", leaves, spec, options)
    if any(options.history_device_of(p).type == "cpu" for p in leaves):
        native.warn_if_missing(stacklevel=3)  # the kernel serves CPU windows (once a process)
    q = options.num_slots

    def ring() -> tuple:
        # A leaf's q slots are rows of one buffer: a pass over them is one strided matrix.
        per_leaf = [_window_buffer(options, p, q) for p in leaves]
        return tuple(tree.unflatten(spec, [slots[s] for slots in per_leaf]) for s in range(q))

    anchor_leaves = [
        _window_buffer(options, p, dtype=p.dtype, pin_memory=_pin_window(options, p))[0]
        for p in leaves
    ]
    iterates: tuple = ()
    if options.rules.keeps_iterates:
        # Classic's anchor starts at the params the state is made for, so the first pair's
        # step x_0 - anchor is 0 (that step is never weighted, see classic_step).
        anchor_leaves = [a.copy_(p.detach()) for a, p in zip(anchor_leaves, leaves)]
        iterates = ring()
    device = options.compute_device_of(leaves)
    # complex128 (Hermitian) for complex params, which are all complex (check_floating).
    grams = wide(leaves[0].dtype)
    return AndersonState(
        count=_counter(),
        inner_state=options.inner.init(params),
        anchor=tree.unflatten(spec, anchor_leaves),
        residuals=ring(),
        iterates=iterates,
        gram=torch.zeros(q, q, dtype=grams, device=device),
        dr_gram=torch.zeros(q, q, dtype=grams, device=device),
        dr_rhs=torch.zeros(q, dtype=grams, device=device),
        head=torch.full((), q - 1, dtype=torch.int64),
        window_size=_counter(),
        num_mixed=_counter(),
        num_rejected=_counter(),
        num_nonfinite=_counter(),
        num_averaged=_counter(),
        num_skipped=_counter(),
        skip_streak=_counter(),
        pending_loss=deferred.empty(),
    )


def step(
    options: AndersonOptions,
    state: AndersonState,
    params: Params,
    grads: Params,
    *,
    inplace: bool = False,
    loss_fn: LossFn | None = None,
    loss: Tensor | float | None = None,
    mix: bool = True,
) -> tuple[Params, AndersonState]:
    """One call of `update` for `options`: the functional core's entry point for front
    ends such as [`aadl_func.AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer].

    `mix=False` (the wrapper's recovery after an interrupted safeguard) records the plain
    step in the window and returns it, with no mix and no moving average.

    `loss` (the deferred safeguard, `aadl_func._src.deferred`): when it rejects the
    mix the previous call returned, the call goes back to that call's plain step
    (`aadl_func._src.stages.revert()`) and runs no inner step.
    """
    if loss is not None:
        loss = deferred.check_loss(options, loss, loss_fn)
    if inplace is True and loss_fn is None and mix:
        # The steady call of a training loop, on the plan the previous call left.
        done = steady.run(options, state, params, grads, loss)
        if done is not None:
            return done
    if isinstance(state, AndersonState) and state.pending_loss is None:
        state = state._replace(pending_loss=deferred.empty())  # saved before the field
    # Sharded (DTensor) params: the step runs on local shards (the inner optimizer included,
    # so it must act coordinate-wise) and reduces over the mesh; see distributed.py.
    shards, params, grads, loss_fn = distributed.sharded_call(
        params, grads, loss_fn, inplace=inplace, average=options.average, owner="anderson.update"
    )
    # `grads` come back cast to the params' dtypes where they differ (as torch.optim does).
    p_leaves, spec, grads = check_update_inputs(options, state, params, grads, loss_fn, inplace)
    transformed = tree.any_transformed(p_leaves)  # vmap, or torch.compile
    options.acceptance.check_call(loss_fn, shards, transformed)
    if options.sufficient_decrease and shards is not None:
        raise ValueError(
            "anderson.update: `sufficient_decrease` is not available with sharded params (its "
            "slope would need a reduction over the mesh); use sufficient_decrease=0.0"
        )
    if eager.applies(
        options,
        state,
        p_leaves,
        inplace=inplace,
        loss_fn=loss_fn,
        mix=mix,
        shards=shards,
        transformed=transformed,
    ):
        # Decisions as Python values: the straight-line executor (same operations, same bits).
        done = eager.run(options, state, params, p_leaves, spec, grads, loss, inplace=inplace)
        if done is not None:
            return done
    return _general(
        options,
        state,
        params,
        p_leaves,
        spec,
        grads,
        _Flags(inplace, loss_fn, loss, mix, shards, transformed),
    )


class _Flags(NamedTuple):
    """How `step` was called, for the general path."""

    inplace: bool
    loss_fn: LossFn | None
    loss: Tensor | None
    mix: bool
    shards: Any
    transformed: bool


def _general(options, state, params, p_leaves, spec, grads, how: _Flags) -> tuple:
    """The general path (`aadl_func._src.update.update()`): every call
    the eager executor does not take (vmap, torch.compile, sharded params, `loss_fn`, the
    moving average, `skip_nonfinite`, a deferred rejection)."""
    if tree.tracing():
        # Traced (torch.compile): the decisions stay on the compute device (tree.decision),
        # so the counters join them there; the returned state keeps them on that device.
        state = _counters_on(state, options.compute_device_of(p_leaves))
    elif how.transformed:
        # vmap: counters that every member shares become plain values (tree.shared), so an
        # ensemble stepping together writes its windows at one slot, O(n) per member.
        state = state._replace(**{name: tree.shared(getattr(state, name)) for name in MOVED})
    # An eager in-place call writes the caller's buffers, so it commits in two stages and
    # defers Ctrl-C between them (atomic.py). Under a transform the caller's tensors are not
    # written back: the transformed call returns its state.
    guard = InterruptGuard() if how.inplace and not how.transformed else None
    if how.loss is not None and how.shards is not None:
        how = how._replace(loss=how.shards.mean_loss(how.loss))  # every rank judges the same
    # `guarded`: the guard's handler is taken out however the call ends (atomic.py).
    return guarded(
        guard, lambda: _general_call(options, state, params, p_leaves, spec, grads, how, guard)
    )


def _general_call(options, state, params, p_leaves, spec, grads, how: _Flags, guard) -> tuple:
    """`_general`'s call, with the guard (if any) held."""
    # The deferred safeguard's verdict on the mix the previous call returned, before any
    # inner step: a known rejection (eager) goes back without one.
    rejected = deferred.rejects(state, how.loss)
    reject_known = flags.value(rejected)
    if reject_known:
        call = Call(
            options,
            state,
            p_leaves,
            spec,
            [],  # no inner step
            state.inner_state,
            inplace=how.inplace,
            loss_fn=None,
            loss=how.loss,
            shards=how.shards,
            guard=guard,
        )
        out, new_state = _finish(call, lambda: revert(call, blended=False))
        return _returned(call, out, new_state, how.transformed)
    # With skip_nonfinite the inner update is computed out of place, so that a non-finite
    # one can be dropped without having touched the inner state.
    # Eager in place (guarded) also when the inner optimizer keeps buffers: their new
    # values are committed with the plain step, so an exception before it leaves the
    # inner state as it was. (The built-in ones say whether they do; others are assumed
    # to.) In place it would only write the grads, which the guarantee does not cover.
    # A rejection without a value (vmap, compile) blends it with the kept call: out of
    # place too.
    keeps_buffers = protocols.keeps_buffers(options.inner)
    updates, inner_state = options.inner.update(
        grads,
        state.inner_state,
        params=params,
        inplace=how.inplace
        and not options.skip_nonfinite
        and (guard is None or not keeps_buffers)
        and reject_known is not None
        and not deferred.reads_grads(options, how.loss),
    )
    u_leaves, u_spec = tree.flatten(updates, "inner updates")
    tree.check_like("inner updates", u_leaves, u_spec, p_leaves, spec, owner="anderson.update")
    g_leaves = tree.flatten(grads, "grads")[0]
    how = how._replace(loss=deferred.bar(options, how.loss, g_leaves, u_leaves))
    call = Call(
        options,
        state,
        p_leaves,
        spec,
        u_leaves,
        inner_state,
        inplace=how.inplace,
        loss_fn=how.loss_fn,
        loss=how.loss,
        shards=how.shards,
        guard=guard,
        plain=not how.mix,
    )
    run = general_update
    if options.skip_nonfinite:
        run = functools.partial(_run_if_finite, run=general_update, g_leaves=g_leaves)
    if reject_known is None:
        out, new_state = _blend_verdict(call, rejected, run)
    else:
        out, new_state = _finish(call, lambda: run(call))
    return _returned(call, out, new_state, how.transformed)


def _finish(call: Call, run: Callable[[], tuple[Any, AndersonState]]) -> tuple[Any, Any]:
    """`run()`, with an eager in-place call's exception turned into one complete outcome."""
    try:
        return run()
    except BaseException:
        if call.progress is not None:
            recover(call)  # one complete outcome, whatever was raised where
        raise


def _returned(call: Call, out: Any, new_state: AndersonState, transformed: bool) -> tuple:
    """What `update` returns: the params (DTensors again if sharded) and the state, marked
    as verified when this eager call made it."""
    if call.shards is not None:
        out = tree.unflatten(call.spec, call.shards.globalize(tree.flatten(out, "params")[0]))
    if new_state is not call.state and not transformed:
        # Made here: its values need no check on the next call, and its layout is the one
        # the state passed in was checked for.
        mark_verified(new_state, made_from=call.state)
    return out, new_state


def _blend_verdict(call: Call, rejected: Tensor, run: Callable) -> tuple[Any, AndersonState]:
    """The call when the deferred safeguard's verdict has no value (vmap, compile): the kept
    call where the mix is kept, the reverted one elsewhere, blended; in place, the params
    are then written with the blend (the kept call's own writes were masked)."""
    out, new_state = call.blend.select(
        flags.negate(rejected), lambda: run(call), lambda: revert(call, blended=True)
    )
    if call.inplace:
        leaves = tree.flatten(out, "params")[0]
        for p, v in zip(call.params, leaves):
            if v is not p:
                p.copy_(v)
        out = tree.unflatten(call.spec, list(call.params))
    return out, new_state


# The 0-d fields that live beside the counters (on the CPU, eagerly).
MOVED = (*COUNTERS, "pending_loss")


def _counters_on(state: AndersonState, device: torch.device) -> AndersonState:
    """`state` with its 0-d counters on `device` (a no-op for those already there)."""
    return state._replace(**{name: getattr(state, name).to(device) for name in MOVED})


def _all_finite(leaves: list[Tensor], device: torch.device) -> Tensor:
    flag = flags.TRUE
    for t in leaves:
        flag = flags.both(flag, flags.all_finite(t, device))
    return flag


def _run_if_finite(
    call: Call, *, run: Callable[[Call], tuple[Any, AndersonState]], g_leaves: list[Tensor]
) -> tuple[Any, AndersonState]:
    """`run(call)` if the grads and the inner update are finite, else the skipped call.

    A skipped call returns the params and the state as they were, with `num_skipped` and
    `skip_streak` increased; with `max_consecutive_skips` reached it raises instead.
    """
    device = call.compute_device
    finite = flags.both(_all_finite(g_leaves, device), _all_finite(call.updates, device))
    if call.shards is not None:
        # Every rank must take the same decision: one all_reduce of one value.
        bad = call.shards.all_sum((~finite).to(torch.float64).reshape(1))
        finite = (bad == 0).reshape(())
    if flags.value(finite) is False:
        check_skip_allowed(call.options, call.state, "anderson.update")

    def skipped() -> tuple[Any, AndersonState]:
        return tree.unflatten(call.spec, list(call.params)), commit(call, count_skip(call.state))

    return call.blend.select(finite, lambda: run(call), skipped)


def check_skip_allowed(options: AndersonOptions, state: AndersonState, owner: str) -> None:
    """Raises `FloatingPointError` if one more skipped call would exceed
    `max_consecutive_skips` (eager mode: the streak is a concrete counter)."""
    limit = options.max_consecutive_skips
    streak = tree.static_value(state.skip_streak)
    if streak is not None and accept.skips_exhausted(streak, limit):
        raise FloatingPointError(
            f"{owner}: the grads or the inner update are not finite for the {streak + 1}-th "
            f"call in a row (max_consecutive_skips={limit}); params and state are left as "
            "after the last finite call. Lower the learning rate, clip the gradients or check "
            "the loss."
        )


def count_skip(state: AndersonState) -> AndersonState:
    """`state` after a skipped call: everything as it was but the two skip counters."""
    return state._replace(num_skipped=state.num_skipped + 1, skip_streak=state.skip_streak + 1)

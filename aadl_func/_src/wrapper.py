r"""`AcceleratedOptimizer` and `accelerate`: the functional core behind a torch.optim face.

The wrapped `torch.optim` optimizer is the inner map $g$ of Anderson acceleration, and
[`aadl_func.anderson()`][aadl_func.anderson] does everything else (window, mixing, safeguard,
moving average), one window per param group as in AADL, its outcome written into the params in
place. How the torch step reaches the core:

* mode "aadl", whose window holds only the plain iterates: the core runs on the params as the
  torch optimizer left them, $y = g(x)$, with an internal inner optimizer whose update is
  $-0$ (`wrapper_groups.StepInParams`), so its plain step is torch's own bit for bit and it
  writes its outcome into the params directly (no copy of the params, no displacement);
* mode "classic" (which keeps the pairs $(x_i, g(x_i) - x_i)$), with the `loss_fn` safeguard
  (its closure is evaluated at candidates written into the params), compiled, or on DTensor
  params: the step snapshots the params $x$ before the torch step and hands both to the core
  through an inner optimizer whose update is the displacement $y - x$ the torch optimizer
  already took (`wrapper_groups.TakenStep`); the outcome is copied into the params.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from aadl_func._src import deferred, flags, grad_mode
from aadl_func._src.anderson import Anderson, check_skip_allowed, count_skip, functions, step
from aadl_func._src.atomic import InterruptGuard, guarded
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState
from aadl_func._src.wrapper_checkpoint import plain_values, restore_windows, saved_windows
from aadl_func._src.wrapper_groups import (
    StepInParams,
    TakenStep,
    check_windows_fit,
    hide_rejected_grads,
    in_params_route,
    marks,
    negative_zeros,
    put_back_grads,
    torch_step_unless_rejected,
)
from aadl_func._src.wrapper_hooks import PlainStep, hooked_step
from aadl_func._src.wrapper_loss import (
    check_loss_argument,
    check_no_sufficient_decrease,
    check_safeguard,
    check_served_rules,
    closure_loss,
    interruptible,
    returning,
    returns_a_loss,
)

__all__ = ["AcceleratedOptimizer", "accelerate"]

# Attribute through which a torch optimizer patched by `accelerate` reaches its accelerator.
_ACCELERATOR_ATTRIBUTE = "_aadl_func_accelerator"


class AcceleratedOptimizer(Optimizer):
    r"""Anderson acceleration (AADL) around a `torch.optim` optimizer.

    Each call of `step()` is one call of [`aadl_func.anderson()`][aadl_func.anderson]'s `update` per
    param group, with the wrapped optimizer's step as the inner map $y = g(x)$:

    1. the params $x$ are snapshotted and `torch_optimizer.step(closure)` is taken
       (all groups at once, with the usual gradients, LR schedules and clipping);
    2. for each param group in turn, the functional core updates that group's window with
       $y$ and returns its params (the mix, the window mean, or $y$, by the rules
       of [`aadl_func.anderson()`][aadl_func.anderson]), which are written back with `param.copy_`
       (dtype, device and `channels_last` are kept).

    With a `closure` the safeguard is on: `loss_fn` writes a candidate into the group's
    params and evaluates `closure()` (grad enabled, as `torch.optim` does, so the closure
    may call `backward`; the `.grad` fields then hold the gradient at the last candidate).
    Groups are decided one after the other, each with the groups before it at their kept
    values and the ones after it at $y$, as in AADL.

    With `safeguard="deferred"` a mix costs no closure call: the loss at the params a step
    starts from, $L(x_{k+1})$ (`step(closure)` evaluates the closure once, first, as
    `torch.optim` does; or `step(loss=value)`, the value the loop computed with the
    gradients), judges the mix $x_{k+1}$ the previous step returned, against the
    loss $L(x_k)$ of the point it was made from (the functional core's
    `update(..., loss=value)`, `aadl_func._src.deferred`). Per group: if
    $L(x_{k+1}) < L(x_k)$ fails, the group's params go back to its previous plain step
    $y_k$ (read from its window), the torch optimizer does not step that group (its
    grads, taken at the rejected point, are hidden from it; its state stays that of
    $y_k$) and the step is not counted; the other groups step as usual.

    Attributes:
      optimizer: the wrapped `torch.optim` optimizer; `param_groups`, `state` and
        `defaults` are its own, so LR schedulers, gradient clipping and `GradScaler` work on
        the wrapper unchanged.
      anderson_states: per param group, its [`aadl_func.AndersonState`][aadl_func.AndersonState]
        (counters `num_mixed`, `num_rejected`, `num_averaged`, ...), or None before the first step.

    The keyword parameters after `optimizer` are the options of
    [`aadl_func.anderson()`][aadl_func.anderson] (all but `inner`), with its defaults
    (docs/options.md), validated here. They are spelled out for type checkers;
    `tests/test_options.py` holds them to `aadl_func._src.options.AndersonOptions`, where they are
    defined.

    Args:
      optimizer: a `torch.optim.Optimizer`; its `step`, `state_dict` and
        `load_state_dict` are captured now.
      safeguard: `"loss_fn"` (default: a `closure` passed to `step()` safeguards each
        mix with two more closure calls; without one, no safeguard) or `"deferred"` (one
        closure call or a `loss=` per step, above; needs `store_each_nth=1`).
    """

    def __init__(
        self,
        optimizer: Optimizer,
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
        safeguard: str = "loss_fn",
    ) -> None:
        given = locals()
        resolved = {name: given[name] for name in AndersonOptions.names()}
        check_safeguard("AcceleratedOptimizer", safeguard, store_each_nth)
        check_served_rules("AcceleratedOptimizer", resolved)
        check_no_sufficient_decrease("AcceleratedOptimizer", sufficient_decrease)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "AcceleratedOptimizer: `optimizer` must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if isinstance(optimizer, AcceleratedOptimizer) or hasattr(
            optimizer, _ACCELERATOR_ATTRIBUTE
        ):
            raise ValueError("AcceleratedOptimizer: `optimizer` is already accelerated")
        self._config = AndersonOptions(TakenStep(), **resolved)
        self._anderson = Anderson(*functions(self._config))
        # Mode "aadl" (whose window holds only the plain iterates) runs the core on the
        # stepped params themselves where it can (`in_params_route()`): no copy of the params
        # before the torch step, no displacement, no copy of the outcome.
        self._in_params_config = None
        if mode == "aadl":
            self._in_params_config = AndersonOptions(StepInParams(), **resolved)
            self._in_params_anderson = Anderson(*functions(self._in_params_config))
        self._options = plain_values(resolved)
        self._safeguard = safeguard
        self.optimizer = optimizer
        self._windows: list[AndersonState | None] = [None] * len(optimizer.param_groups)
        # The torch optimizer's own methods, captured before `accelerate` patches them (its
        # step in two calls, `PlainStep`: its post-hooks run once the step is recorded).
        self._plain_step = PlainStep(optimizer)
        self._plain_state_dict: Callable[[], dict[str, Any]] = optimizer.state_dict
        self._plain_load_state_dict: Callable[[dict[str, Any]], None] = optimizer.load_state_dict
        # torch.optim.Optimizer's bookkeeping (hooks, profiling of `step`). Its `__init__`
        # is not called: it would build param_groups of its own instead of sharing the
        # wrapped optimizer's.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        _disable_compiling_eagerly()

    # -- the wrapped optimizer's view --------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def anderson_states(self) -> tuple[AndersonState | None, ...]:
        return tuple(self._sync_windows())

    @property
    def anderson_options(self) -> dict[str, Any]:
        """The options of [`aadl_func.anderson()`][aadl_func.anderson] in use, defaults filled
        in."""
        return dict(self._options)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def safeguard(self) -> str:
        """`"loss_fn"` (a closure safeguards each mix) or `"deferred"`."""
        return self._safeguard

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return (
            f"{type(self).__name__}({self.optimizer!r}, {options}, safeguard={self._safeguard!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group to the wrapped optimizer; its window starts empty at the next step."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _sync_windows(self) -> list[AndersonState | None]:
        missing = len(self.param_groups) - len(self._windows)
        if missing < 0:
            raise RuntimeError(
                "AcceleratedOptimizer: param groups were removed from the wrapped optimizer"
            )
        self._windows.extend([None] * missing)
        return self._windows

    # -- step --------------------------------------------------------------------------------
    @hooked_step
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, *, loss: Tensor | float | None = None
    ) -> Any:
        """One accelerated step; see the class docstring.

        With `safeguard="deferred"` the step needs the loss at the params it starts from:
        `closure` (evaluated once, first, as `torch.optim` does) or `loss`, the value the
        training loop computed with the gradients (as `ReduceLROnPlateau.step(metrics)`
        takes its metric; `GradScaler.step(optimizer, loss=value)` passes it through).

        Exception safety (docs/reliability.md, "The exception guarantee"). Ctrl-C (Python's
        default handler, main thread) is deferred over the whole step except inside
        `closure`, where it acts at once, and is raised once the step is complete. An
        exception raised

        * by `closure` before the wrapped optimizer writes anything (`torch.optim`
          evaluates it first), or by the argument checks: nothing has changed;
        * after the wrapped optimizer's step (in its step post-hooks, in a safeguard's
          `closure`, in the core, or in the copies back into the params): the groups
          decided before keep their decisions; the group in progress ends at one outcome
          of the core (its plain step, its finished step, or its plain step with the window
          restarted), written into its params; every later group ends at the wrapped
          optimizer's plain step, recorded in its window (no mix, no moving average), or,
          when the deferred safeguard rejected its mix, at its previous plain step. Params,
          the torch optimizer's state and the windows then agree, and the next step
          continues from there;
        * inside the wrapped optimizer's own step (its loop over the params, e.g. an
          out-of-memory error or an exception from another signal's handler): not
          protected. Some params and some of the torch optimizer's buffers may have been
          stepped and others not; the windows are unchanged (they have not seen the step),
          so a next step treats the params it finds as a new starting point.

        Returns:
          What `torch.optim` returns: the wrapped optimizer's return value, i.e. the
          closure's loss at the params the step started from (None without `closure`).

        Raises:
          TypeError: `closure` returned something other than a loss (a tensor of one
            element or a real number), raised at its first evaluation, before the wrapped
            optimizer writes anything; or `loss` is not one; or `safeguard="deferred"`
            got neither `closure` nor `loss`.
          ValueError: `loss` without `safeguard="deferred"`, or with `closure`.
          TypeError, ValueError: a group's params no longer fit its window: another number
            of params, or a param of another shape, dtype, device or layout than when the
            window was made (after `model.double()`, `model.to(device)`, a param replaced).
            The core's own error, with how to start the windows afresh; raised before the
            closure and the wrapped optimizer run.
        """
        # Without autograd, as torch.optim's steps; grad mode put back however the step ends
        # (`grad_mode.kept`: `@torch.no_grad()` alone can skip its `__exit__`).
        return grad_mode.kept(functools.partial(self._step_without_grad, closure, loss))

    def _step_without_grad(
        self, closure: Callable[[], Any] | None, loss: Tensor | float | None
    ) -> Any:
        """`step`'s body, under `torch.no_grad()`."""
        loss = check_loss_argument(self._safeguard, closure, loss)
        if not torch.compiler.is_compiling():  # (compiled: the core checks at trace time)
            # The params against their windows, before the closure and the torch step.
            check_windows_fit(self._config, self.param_groups, self._sync_windows())
        if closure is not None:
            closure = returns_a_loss(closure)  # the safeguards compare its losses
        if self._safeguard == "deferred" and closure is not None:
            # The closure's loss, at the params the step starts from, judges the last mix;
            # the torch step then gets it back without a second evaluation. Evaluated here,
            # before anything is written (an exception or Ctrl-C in it changes nothing), and
            # outside `_step`: compiled, its `backward` breaks this frame, not that one.
            with torch.enable_grad():
                loss = closure()
            closure = returning(loss, closure)
        if torch.compiler.is_compiling():
            # Under torch.compile: no Ctrl-C guard (dynamo cannot trace signal handlers, and
            # a graph is not interruptible between its kernels anyway; docs/compiling.md).
            return self._step(closure, loss)
        guard = InterruptGuard()
        if closure is not None:
            closure = interruptible(closure, guard)
        # `guarded`: the guard's handler is taken out however the step ends (atomic.py).
        return guarded(guard, functools.partial(self._step, closure, loss))

    def _step(self, closure: Callable[[], Any] | None, loss: Tensor | float | None) -> Any:
        groups = self.param_groups
        windows = self._sync_windows()
        if self._config.skip_nonfinite:
            returned, skipped = self._skip_if_nonfinite(closure)
            if skipped:
                return returned
            closure = None if closure is None else returning(returned, closure)
        # `clone` keeps the memory format (channels_last) by default. Spelled out
        # (`memory_format=torch.preserve_format`), it makes dynamo (torch 2.13) give up on
        # this frame where the torch step below breaks the graph.
        in_params = in_params_route(self._in_params_config, closure is None or loss is not None)
        starts = [
            None if in_params(group["params"]) else [p.detach().clone() for p in group["params"]]
            for group in groups
        ]
        verdicts = self._verdicts(windows, loss)
        if torch.compiler.is_compiling():
            # Compiled (docs/compiling.md): no recovery, so no count to read and no try
            # block, which dynamo cannot resume in after torch.optim's own graph break.
            # `torch` is named in this frame (and `step`) on purpose: dynamo only traces
            # frames that name it or hold a tensor.
            torch_step = functools.partial(self._torch_step, closure)
            returned = torch_step_unless_rejected(torch_step, groups, self.state, verdicts)
            for index, (group, start) in enumerate(zip(groups, starts)):
                if not group["params"]:
                    continue
                if closure is None or loss is not None:
                    self._update_group(windows, index, group["params"], start, None, loss)
                else:  # the safeguard calls the closure inside the core: see _eagerly
                    _eagerly(
                        self._update_group, windows, index, group["params"], start, closure, None
                    )
            return returned
        # Once the torch optimizer has stepped, every group must end recorded. `position`:
        # the first group not finished; `mark`: its window's marks before its update (None
        # until read); `hidden`: the grads of groups whose mix the deferred safeguard rejects,
        # hidden from the torch optimizer, put back once its step is recorded.
        position, mark, torch_stepped, hidden = 0, None, False, []
        try:
            hide_rejected_grads(groups, verdicts, hidden)
            # One statement: no line runs between the torch step and its record.
            returned, torch_stepped = self._torch_step(closure), True
            put_back_grads(hidden)
            self._plain_step.finish()  # its post-hooks; an exception in one is recovered
            for index, (group, start) in enumerate(zip(groups, starts)):
                position, mark = index, None
                params = group["params"]
                if params:
                    mark = marks(self._window(windows, index, params if start is None else start))
                    guarded_closure = None if loss is not None else closure
                    self._update_group(windows, index, params, start, guarded_closure, loss)
                position, mark = index + 1, None
        except BaseException:
            put_back_grads(hidden)
            if torch_stepped:
                self._recover(groups, starts, windows, position, mark, loss)
            raise
        return returned

    def _verdicts(self, windows: list[AndersonState | None], loss: Any) -> list[Tensor]:
        """Per group, whether the deferred safeguard rejects its pending mix (the core's own
        decision, `aadl_func._src.deferred.rejects()`, read before the torch step)."""
        if loss is None:
            return [flags.FALSE] * len(windows)
        value = deferred.check_loss(self._config, loss, None)
        return [flags.FALSE if w is None else deferred.rejects(w, value) for w in windows]

    def _window(
        self, windows: list[AndersonState | None], index: int, start: list[Tensor]
    ) -> AndersonState:
        """Group `index`'s window, made for the params `start` if it has none yet."""
        window = windows[index]
        if window is None:
            window = windows[index] = self._anderson.init(start)
        return window

    def _update_group(
        self,
        windows: list[AndersonState | None],
        index: int,
        params: list[Tensor],
        start: list[Tensor] | None,
        closure: Callable[[], Any] | None,
        loss: Any = None,
    ) -> None:
        """Group `index`'s call of the core: from `start` (its params before the torch
        step; None on the params themselves, see `in_params_route()`) and its params now
        (after it), the outcome written into the params and the returned state kept
        (compiled, its counters are new tensors). `closure`: the `loss_fn` safeguard;
        `loss`: the deferred one."""
        loss_fn = None if closure is None else closure_loss(params, closure)
        update = (self._anderson if start is not None else self._in_params_anderson).update
        self._call_core(update, windows, index, params, start, loss_fn=loss_fn, loss=loss)

    def _call_core(
        self,
        function: Callable[..., tuple[Any, AndersonState]],
        windows: list[AndersonState | None],
        index: int,
        params: list[Tensor],
        start: list[Tensor] | None,
        **keywords: Any,
    ) -> None:
        """Group `index`'s call `function(window, start, stepped, inplace=True, **keywords)`
        of the core (its `update`, or `step` without mixing): its outcome written into the
        group's `params` and the state it returns kept as the group's window. `start` None:
        `function(window, stepped, -0, ...)` (`StepInParams`), which writes the outcome
        into the params itself."""
        stepped = [p.detach() for p in params]
        if start is None:
            window = self._window(windows, index, stepped)
            zeros = negative_zeros(stepped)
            windows[index] = function(window, stepped, zeros, inplace=True, **keywords)[1]
            return
        window = self._window(windows, index, start)
        out, windows[index] = function(window, start, stepped, inplace=True, **keywords)
        for p, value in zip(params, out):  # (one by one: DTensor has no `_foreach_copy_`)
            p.copy_(value)

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        """The wrapped optimizer's own step, in one line: its caller records that it
        returned in the same statement."""
        return self._plain_step() if closure is None else self._plain_step(closure)

    def _recover(
        self,
        groups: list[dict[str, Any]],
        starts: list[list[Tensor] | None],
        windows: list[AndersonState | None],
        position: int,
        mark: tuple[int, int] | None,
        loss: Any,
    ) -> None:
        """After an exception past the torch optimizer's step: group `position` (the first
        one not finished) ends at the core's outcome, the later groups at the plain step.

        The core wrote its outcome in place into `starts[position]` (None: into the params
        themselves) and the window (`aadl_func._src.exec.inplace.recover()`), and counted
        the call (`count`, or `num_rejected` for a call that reverted a mix); a window whose
        marks did not move (or were not read) never saw the step, so that group is finished
        like the later ones, from its params."""
        first = position
        if position < len(groups) and mark is not None:
            window = windows[position]
            if window is not None and marks(window) != mark:
                if starts[position] is not None:  # (None: the outcome is in the params)
                    for p, value in zip(groups[position]["params"], starts[position]):
                        p.copy_(value)
                first = position + 1
        self._finish_plain(groups, starts, windows, first, loss)

    def _finish_plain(
        self,
        groups: list[dict[str, Any]],
        starts: list[list[Tensor] | None],
        windows: list[AndersonState | None],
        first: int,
        loss: Any = None,
    ) -> None:
        """Records the plain step (already in the params) in the windows of groups `first`
        onwards, without mixing: the recovery after an interrupted safeguard. With the
        deferred safeguard's `loss` a group whose mix it rejects (not stepped by the torch
        optimizer) goes back to its previous plain step instead, as the core decides."""
        for index in range(first, len(groups)):
            params = groups[index]["params"]
            if not params:
                continue
            config = self._config if starts[index] is not None else self._in_params_config
            plain_step = functools.partial(step, config)
            self._call_core(plain_step, windows, index, params, starts[index], loss=loss, mix=False)

    def _skip_if_nonfinite(self, closure: Callable[[], Any] | None) -> tuple[Any, bool]:
        """`skip_nonfinite`: evaluates the closure (if any) and skips the step, before the
        wrapped optimizer changes anything, when a gradient is not finite.

        Returns `(loss, skipped)`.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        flags = [
            torch.isfinite(p.grad).all()
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        # One read of one flag: under torch.compile, the one graph break of this option
        # (whether the torch optimizer steps at all depends on the values).
        if not flags or bool(torch.stack(flags).all()):
            return loss, False
        windows = self._sync_windows()
        for index, group in enumerate(self.param_groups):
            if group["params"] and windows[index] is not None:
                check_skip_allowed(self._config, windows[index], "AcceleratedOptimizer.step")
        for index, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            if windows[index] is None:
                windows[index] = self._anderson.init([p.detach() for p in group["params"]])
            windows[index] = count_skip(windows[index])
        return loss, True

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's `state_dict()` plus an `"anderson"` entry.

        `"anderson"` holds the options and, per param group, the window
        ([`aadl_func.AndersonState`][aadl_func.AndersonState], tensors only, counters included). The
        result loads with `torch.load(weights_only=True)`; like `torch.optim`'s, it references the
        live tensors (save it or copy it before stepping again).
        """
        saved = dict(self._plain_state_dict())
        saved["anderson"] = saved_windows(self._options, self._sync_windows())
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restores the wrapped optimizer and the windows, so the run continues bit for bit.

        The windows are copied into buffers laid out for the current params (their devices,
        dtypes and memory formats). A state dict without an `"anderson"` entry (a plain
        `torch.optim` checkpoint) restores the optimizer and empties the windows.

        Raises:
          ValueError: the checkpoint's `history_depth`, `mode` or `history_dtype` differ
            from this optimizer's, or a window does not fit its param group (number, shapes or
            dtypes of the params). Nothing is modified then.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                "AcceleratedOptimizer.load_state_dict: expected a dict, got "
                f"{type(state_dict).__name__}"
            )
        plain = dict(state_dict)
        saved = plain.pop("anderson", None)
        windows: list[AndersonState | None] = [None] * len(self.param_groups)
        if saved is not None:
            windows = restore_windows(
                self._anderson, self._config, self._options, self.param_groups, saved
            )
        self._plain_load_state_dict(plain)
        self._windows = windows


def _eagerly(function: Callable[..., None], *args: Any) -> None:
    """`function(*args)`, run eagerly from a compiled step: a group's call of the core when
    the safeguard evaluates the user's closure inside it.

    The closure breaks the graph (`backward`), in the middle of the core's step. Dynamo
    cannot resume a frame inside its `try`/`with` blocks: it would run the rest of each
    such frame eagerly on decisions traced before the break, and return its stand-in for
    optree's tree spec to eager code, which then fails. One deliberate break here instead
    keeps the core whole (eager, as without `torch.compile`).
    """
    function(*args)


def _disable_compiling_eagerly() -> None:
    """Puts `_eagerly` behind `torch.compiler.disable`, once, from the first wrapper built.

    The decorator imports `torch._dynamo` (1.5-3 s), which `import aadl_func` must not pay
    where nothing is compiled. A wrapper exists only around a torch optimizer, whose
    construction has imported dynamo already, so here it costs nothing; and every compiled
    step runs on a wrapper, so dynamo always finds `_eagerly` disabled."""
    global _eagerly
    if _eagerly is _run_eagerly:
        _eagerly = torch.compiler.disable(_run_eagerly)


_run_eagerly = _eagerly


# -- AADL's migration path -------------------------------------------------------------------
def accelerate(
    optimizer: Optimizer,
    acceleration_type: str = "anderson",
    relaxation: float = 0.1,
    wait_iterations: int = 1,
    history_depth: int = 15,
    store_each_nth: int = 1,
    frequency: int = 1,
    reg_acc: float = 0.0,
    average: bool = False,
    history_device: torch.device | str | None = None,
    compute_device: torch.device | str | None = None,
    *,
    mode: str = "aadl",
    average_tol: float = 0.1,
    history_dtype: torch.dtype | None = None,
    skip_nonfinite: bool = False,
    max_consecutive_skips: int | None = None,
    reg_relative: float = 0.0,
    restart_on_reject: bool = False,
    reg_column: float = 0.0,
    line_search: bool = False,
    sufficient_decrease: float = 0.0,
    safeguard: str = "loss_fn",
) -> AcceleratedOptimizer:
    r"""AADL's `accelerate`: Anderson-accelerates `optimizer` in place.

    Same positional order and defaults as AADL's `AADL.accelerate`, so an AADL script only
    changes its import. Like AADL it replaces `optimizer.step` on the instance (and
    `state_dict` / `load_state_dict`, which then carry the windows), so code that keeps
    calling `optimizer.step(closure)` is accelerated; it also returns the
    [`AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer] doing the work (counters in
    `anderson_states`). Create LR schedulers after calling `accelerate` (torch warns about a step
    replaced after the scheduler was made).

    Semantics are those of [`aadl_func.anderson()`][aadl_func.anderson] (`reg_acc` is its `reg`):
    the window holds every `store_each_nth`-th plain step, mixing happens every `frequency` calls
    after `wait_iterations` once the window holds 3 entries, a `closure` turns on the loss
    safeguard, and `average=True` the moving-average rule. The keyword-only parameters
    (`mode`, `average_tol`, ...) are the other options of
    [`aadl_func.anderson()`][aadl_func.anderson], with its defaults (`tests/test_options.py` holds
    them to `AndersonOptions`).

    Args:
      optimizer: the `torch.optim.Optimizer` to accelerate.
      acceleration_type: `"anderson"` or `"anderson_normal_equation"` (case-insensitive).
        Both use the one stable float64 solver
        ([`aadl_func.solve_weights()`][aadl_func.solve_weights]): AADL's normal-equation variant
        squared the condition number in the params' precision, which this library never does, so it
        is kept only as a name.
      relaxation: mixing parameter (AADL's default 0.1).
      wait_iterations: plain steps before the first mix (AADL's default 1).
      history_depth: window entries (AADL's default 15).
      store_each_nth: store every n-th plain step.
      frequency: mix every `frequency` steps.
      reg_acc: Tikhonov weight of the least-squares problem.
      average: AADL's moving average of the window.
      history_device: where the windows live. Default: each parameter's device (AADL
        defaulted to `"cpu"`; pass it to keep the windows off the accelerator).
      compute_device: where the small least-squares problem is solved (default: the history
        device).
      safeguard: `"loss_fn"` or `"deferred"`, as
        [`AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer]'s; the patched `optimizer.step`
        then takes `step(closure)` or `step(loss=value)`.

    Returns:
      The [`AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer] now behind `optimizer.step`.

    Raises:
      ValueError: unknown `acceleration_type` (AADL's `"identity"` included), an invalid
        option, or an optimizer that is already accelerated.
    """
    given = locals()
    if not isinstance(acceleration_type, str):
        raise TypeError(
            f"accelerate: `acceleration_type` must be a str, got {type(acceleration_type).__name__}"
        )
    kind = acceleration_type.lower()
    if kind not in ("anderson", "anderson_normal_equation"):
        raise ValueError(
            "accelerate: `acceleration_type` must be 'anderson' or 'anderson_normal_equation', "
            f"got {acceleration_type!r}"
        )
    # Every option under its own name but `reg` (AADL's `reg_acc`).
    options = {name: given[name] for name in AndersonOptions.names() if name != "reg"}
    accelerator = AcceleratedOptimizer(optimizer, reg=reg_acc, safeguard=safeguard, **options)
    setattr(optimizer, _ACCELERATOR_ATTRIBUTE, accelerator)
    # Bound to `optimizer` itself (as AADL's MethodType): LR schedulers re-bind
    # `optimizer.step.__func__` to the optimizer when they wrap it.
    optimizer.step = MethodType(_accelerated_step, optimizer)  # type: ignore[method-assign]
    optimizer.state_dict = MethodType(_accelerated_state_dict, optimizer)  # type: ignore[method-assign]
    optimizer.load_state_dict = MethodType(_accelerated_load_state_dict, optimizer)  # type: ignore[method-assign]
    return accelerator


def _accelerated_step(
    optimizer: Optimizer,
    closure: Callable[[], Any] | None = None,
    *,
    loss: Tensor | float | None = None,
) -> Any:
    return getattr(optimizer, _ACCELERATOR_ATTRIBUTE).step(closure, loss=loss)


def _accelerated_state_dict(optimizer: Optimizer) -> dict[str, Any]:
    return getattr(optimizer, _ACCELERATOR_ATTRIBUTE).state_dict()


def _accelerated_load_state_dict(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    getattr(optimizer, _ACCELERATOR_ATTRIBUTE).load_state_dict(state_dict)

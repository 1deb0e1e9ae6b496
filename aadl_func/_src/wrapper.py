r"""`AcceleratedOptimizer` and `accelerate`: the functional core behind a torch.optim face.

The wrapped `torch.optim` optimizer is the inner map $g$ of Anderson acceleration. A
step snapshots the params $x$, lets the torch optimizer step (params $y = g(x)$),
and hands both to [`aadl_func.anderson()`][aadl_func.anderson] through an internal inner optimizer
whose update is the displacement $y - x$ the torch optimizer already took. The functional core then
does everything else (window, mixing, safeguard, moving average), one window per param group as in
AADL, and the result is written back into the params in place.
"""

from __future__ import annotations

import functools
import numbers
from collections import OrderedDict
from collections.abc import Callable
from types import MethodType
from typing import Any

import optree
import torch
from torch import Tensor
from torch.optim import Optimizer

from aadl_func._src import deferred, flags, grad_mode
from aadl_func._src.anderson import Anderson, check_skip_allowed, count_skip, functions, step
from aadl_func._src.atomic import InterruptGuard, guarded
from aadl_func._src.checks import check_state_values
from aadl_func._src.options import AndersonOptions
from aadl_func._src.state import AndersonState

__all__ = ["AcceleratedOptimizer", "accelerate"]

# Bumped if the layout of `state_dict()["anderson"]` changes.
_FORMAT = 2  # 2: AndersonState gained num_skipped and skip_streak
# Options that fix the window's layout: a checkpoint saved with other values cannot be resumed.
_LAYOUT_OPTIONS = ("history_depth", "mode", "history_dtype")
# Attribute through which a torch optimizer patched by `accelerate` reaches its accelerator.
_ACCELERATOR_ATTRIBUTE = "_aadl_func_accelerator"
# The wrapper's safeguards: the closure evaluated at each mix (the core's `loss_fn`), or the
# loss of the next step judging the previous mix (the core's `loss=`).
_SAFEGUARDS = ("loss_fn", "deferred")


# A dtype in which the difference of two values of the key dtype is exact (up to exponent gaps
# of 2^13 for half precision, 2^29 for float32): the displacement loses nothing.
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


class _TakenStep:
    """Inner optimizer whose step has already been taken by a `torch.optim` optimizer.

    `update(stepped, state, params)` returns `stepped - params`: the "gradient" argument
    carries the params after the torch optimizer's step. The displacement is returned in a
    wider dtype (float32 for half precision, float64 for float32), where it is exact, so the
    core's in-place plain step `params.add_(stepped - params)` (rounded once to the params'
    dtype) reproduces the torch optimizer's params bit for bit; float64 params get a float64
    displacement (exact whenever `stepped / 2 <= params <= 2 stepped`, by Sterbenz's lemma).
    """

    def init(self, params: Any) -> tuple:
        return ()

    def update(
        self, updates: Any, state: tuple, params: Any = None, inplace: bool = False
    ) -> tuple[Any, tuple]:
        if params is None:
            raise ValueError("the wrapped torch optimizer's step needs the params it started from")

        def displacement(stepped: Tensor, start: Tensor) -> Tensor:
            return stepped.to(_WIDER.get(stepped.dtype, stepped.dtype)).sub_(start)

        return optree.tree_map(displacement, updates, params), state


def _plain_values(options: dict[str, Any]) -> dict[str, Any]:
    """`options` in plain Python values (devices and dtypes as strings), so that they
    survive `torch.load(weights_only=True)`."""
    return {
        name: str(value) if isinstance(value, (torch.device, torch.dtype)) else value
        for name, value in options.items()
    }


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
        safeguard: str = "loss_fn",
    ) -> None:
        given = locals()
        resolved = {name: given[name] for name in AndersonOptions.names()}
        _check_safeguard("AcceleratedOptimizer", safeguard, store_each_nth)
        _check_no_line_search("AcceleratedOptimizer", line_search)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "AcceleratedOptimizer: `optimizer` must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if isinstance(optimizer, AcceleratedOptimizer) or hasattr(
            optimizer, _ACCELERATOR_ATTRIBUTE
        ):
            raise ValueError("AcceleratedOptimizer: `optimizer` is already accelerated")
        self._config = AndersonOptions(_TakenStep(), **resolved)
        self._anderson = Anderson(*functions(self._config))
        self._options = _plain_values(resolved)
        self._safeguard = safeguard
        self.optimizer = optimizer
        self._windows: list[AndersonState | None] = [None] * len(optimizer.param_groups)
        # The torch optimizer's own methods, captured before `accelerate` patches them.
        self._plain_step: Callable[..., Any] = optimizer.step
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
        * after the wrapped optimizer's step (in a safeguard's `closure`, in the core, or
          in the copies back into the params): the groups decided before keep their
          decisions; the group in progress ends at one outcome of the core (its plain step,
          its finished step, or its plain step with the window restarted), written into its
          params; every later group ends at the wrapped optimizer's plain step, recorded in
          its window (no mix, no moving average), or, when the deferred safeguard rejected
          its mix, at its previous plain step. Params, the torch optimizer's state and
          the windows then agree, and the next step continues from there;
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
        """
        # Without autograd, as torch.optim's steps; grad mode put back however the step ends
        # (`grad_mode.kept`: `@torch.no_grad()` alone can skip its `__exit__`).
        return grad_mode.kept(functools.partial(self._step_without_grad, closure, loss))

    def _step_without_grad(
        self, closure: Callable[[], Any] | None, loss: Tensor | float | None
    ) -> Any:
        """`step`'s body, under `torch.no_grad()`."""
        loss = self._check_loss_argument(closure, loss)
        if self._safeguard == "deferred" and closure is not None:
            # The closure's loss, at the params the step starts from, judges the last mix;
            # the torch step then gets it back without a second evaluation. Evaluated here,
            # before anything is written (an exception or Ctrl-C in it changes nothing), and
            # outside `_step`: compiled, its `backward` breaks this frame, not that one.
            closure = _returns_a_loss(closure)
            with torch.enable_grad():
                loss = closure()
            closure = _returning(loss, closure)
        if torch.compiler.is_compiling():
            # Under torch.compile: no Ctrl-C guard (dynamo cannot trace signal handlers, and
            # a graph is not interruptible between its kernels anyway; docs/compiling.md).
            return self._step(None if closure is None else _returns_a_loss(closure), loss)
        guard = InterruptGuard()
        if closure is not None:
            closure = _interruptible(_returns_a_loss(closure), guard)
        # `guarded`: the guard's handler is taken out however the step ends (atomic.py).
        return guarded(guard, functools.partial(self._step, closure, loss))

    def _check_loss_argument(
        self, closure: Callable[[], Any] | None, loss: Tensor | float | None
    ) -> Tensor | float | None:
        """`loss` checked against the safeguard and `closure`, before anything runs."""
        owner = "AcceleratedOptimizer.step"
        if self._safeguard != "deferred":
            if loss is not None:
                raise ValueError(
                    f"{owner}: `loss` is the deferred safeguard's; make the optimizer with "
                    "safeguard='deferred' to pass it"
                )
            return None
        if closure is not None and loss is not None:
            raise ValueError(f"{owner}: pass `closure` or `loss`, not both")
        if closure is None and loss is None:
            raise TypeError(
                f"{owner}: safeguard='deferred' judges the previous mix by the loss at the "
                "params: call step(closure) or step(loss=value)"
            )
        if loss is not None:
            _check_is_a_loss(loss, "`loss` must be")
        return loss

    def _step(self, closure: Callable[[], Any] | None, loss: Tensor | float | None) -> Any:
        groups = self.param_groups
        windows = self._sync_windows()
        if self._config.skip_nonfinite:
            returned, skipped = self._skip_if_nonfinite(closure)
            if skipped:
                return returned
            closure = None if closure is None else _returning(returned, closure)
        # `clone` keeps the memory format (channels_last) by default. Spelled out
        # (`memory_format=torch.preserve_format`), it makes dynamo (torch 2.13) give up on
        # this frame where the torch step below breaks the graph.
        starts = [[p.detach().clone() for p in group["params"]] for group in groups]
        verdicts = self._verdicts(windows, loss)
        if torch.compiler.is_compiling():
            # Compiled (docs/compiling.md): no recovery, so no count to read and no try
            # block, which dynamo cannot resume in after torch.optim's own graph break.
            # `torch` is named in this frame (and `step`) on purpose: dynamo only traces
            # frames that name it or hold a tensor.
            returned = self._torch_step_unless_rejected(closure, verdicts)
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
        # until read).
        position, mark, torch_stepped = 0, None, False
        try:
            # One statement: no line runs between the torch step and its record.
            returned, torch_stepped = self._torch_step_unless_rejected(closure, verdicts), True
            for index, (group, start) in enumerate(zip(groups, starts)):
                position, mark = index, None
                params = group["params"]
                if params:
                    mark = _marks(self._window(windows, index, start))
                    guarded_closure = None if loss is not None else closure
                    self._update_group(windows, index, params, start, guarded_closure, loss)
                position, mark = index + 1, None
        except BaseException:
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

    def _torch_step_unless_rejected(
        self, closure: Callable[[], Any] | None, verdicts: list[Tensor]
    ) -> Any:
        """The wrapped optimizer's step for every group but those whose pending mix the
        deferred safeguard rejects: their params go back to the previous plain step (in
        the core), so the torch optimizer must not step them from the rejected point.

        Eagerly their grads are hidden (`None`: torch.optim skips such params, state and
        all) and put back after. Compiled, where the verdicts have no value, the torch
        optimizer steps every group and a rejected group's tensor state is blended back."""
        known = [flags.value(verdict) for verdict in verdicts]
        if all(value is False for value in known):
            return self._torch_step(closure)
        if any(value is None for value in known):
            # No try block here: dynamo cannot resume in one after torch.optim's own break.
            kept = [
                entry
                for group, verdict in zip(self.param_groups, verdicts)
                for entry in _torch_state(self.state, group["params"], verdict)
            ]
            returned = self._torch_step(closure)
            for tensor, before, verdict in kept:
                tensor.copy_(torch.where(verdict.to(tensor.device), before, tensor))
            return returned
        hidden = [
            (p, p.grad)
            for group, value in zip(self.param_groups, known)
            if value
            for p in group["params"]
        ]
        try:
            for p, _ in hidden:
                p.grad = None
            return self._torch_step(closure)
        finally:
            for p, grad in hidden:
                p.grad = grad

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
        start: list[Tensor],
        closure: Callable[[], Any] | None,
        loss: Any = None,
    ) -> None:
        """Group `index`'s call of the core: from `start` (its params before the torch
        step) and its params now (after it), the outcome written into the params and the
        returned state kept (compiled, its counters are new tensors). `closure`: the
        `loss_fn` safeguard; `loss`: the deferred one."""
        loss_fn = None if closure is None else _closure_loss(params, closure)
        stepped = [p.detach() for p in params]
        out, windows[index] = self._anderson.update(
            self._window(windows, index, start),
            start,
            stepped,
            inplace=True,
            loss_fn=loss_fn,
            loss=loss,
        )
        for p, value in zip(params, out):
            p.copy_(value)

    def _torch_step(self, closure: Callable[[], Any] | None) -> Any:
        """The wrapped optimizer's own step, in one line: its caller records that it
        returned in the same statement."""
        return self._plain_step() if closure is None else self._plain_step(closure)

    def _recover(
        self,
        groups: list[dict[str, Any]],
        starts: list[list[Tensor]],
        windows: list[AndersonState | None],
        position: int,
        mark: tuple[int, int] | None,
        loss: Any,
    ) -> None:
        """After an exception past the torch optimizer's step: group `position` (the first
        one not finished) ends at the core's outcome, the later groups at the plain step.

        The core wrote its outcome in place into `starts[position]` and the window
        (`aadl_func._src.stages.recover()`), and counted the call (`count`, or
        `num_rejected` for a call that reverted a mix); a window whose marks did not move
        (or were not read) never saw the step, so that group is finished like the later
        ones, from its params."""
        first = position
        if position < len(groups) and mark is not None:
            window = windows[position]
            if window is not None and _marks(window) != mark:
                for p, value in zip(groups[position]["params"], starts[position]):
                    p.copy_(value)
                first = position + 1
        self._finish_plain(groups, starts, windows, first, loss)

    def _finish_plain(
        self,
        groups: list[dict[str, Any]],
        starts: list[list[Tensor]],
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
            start = starts[index]
            stepped = [p.detach() for p in params]
            out, windows[index] = step(
                self._config,
                self._window(windows, index, start),
                start,
                stepped,
                inplace=True,
                loss=loss,
                mix=False,
            )
            for p, value in zip(params, out):
                p.copy_(value)

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
        saved["anderson"] = {
            "format": _FORMAT,
            "options": dict(self._options),
            "windows": list(self._sync_windows()),
        }
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
            windows = self._restore_windows(saved)
        self._plain_load_state_dict(plain)
        self._windows = windows

    def _restore_windows(self, saved: Any) -> list[AndersonState | None]:
        owner = "AcceleratedOptimizer.load_state_dict"
        if not (isinstance(saved, dict) and saved.get("format") == _FORMAT):
            raise ValueError(f"{owner}: unrecognised 'anderson' entry (format {_FORMAT} expected)")
        options = saved.get("options", {})
        differ = [
            f"{name}={options.get(name)!r} (this optimizer: {self._options[name]!r})"
            for name in _LAYOUT_OPTIONS
            if options.get(name) != self._options[name]
        ]
        if differ:
            raise ValueError(
                f"{owner}: the checkpoint's windows were saved with "
                + ", ".join(differ)
                + "; make the optimizer with the same options to resume"
            )
        saved_windows = saved.get("windows")
        groups = self.param_groups
        if not isinstance(saved_windows, list) or len(saved_windows) != len(groups):
            held = len(saved_windows) if isinstance(saved_windows, list) else "no"
            raise ValueError(
                f"{owner}: the checkpoint holds {held} windows for {len(groups)} param groups"
            )
        return [
            None if window is None else self._restore_window(index, window)
            for index, window in enumerate(saved_windows)
        ]

    def _restore_window(self, index: int, saved: Any) -> AndersonState:
        owner = "AcceleratedOptimizer.load_state_dict"
        where = f"param group {index}"
        if not isinstance(saved, AndersonState):
            raise ValueError(f"{owner}: the window of {where} is not an AndersonState")
        params = [p.detach() for p in self.param_groups[index]["params"]]
        if not params:
            raise ValueError(f"{owner}: {where} has no params but the checkpoint has a window")
        template = self._anderson.init(params)
        if saved.pending_loss is None:  # saved before the field existed: nothing pending
            saved = saved._replace(pending_loss=template.pending_loss)
        template_leaves, template_spec = optree.tree_flatten(template)
        saved_leaves, saved_spec = optree.tree_flatten(saved)
        if template_spec != saved_spec:
            raise ValueError(
                f"{owner}: the window of {where} has another structure than its "
                f"{len(params)} params with history_depth={self._options['history_depth']} "
                "(different params or options?)"
            )
        for template_leaf, saved_leaf in zip(template_leaves, saved_leaves):
            if isinstance(saved_leaf, Tensor) and (
                saved_leaf.layout is not torch.strided or saved_leaf.is_meta
            ):
                raise ValueError(
                    f"{owner}: the window of {where} holds a {saved_leaf.layout} tensor on "
                    f"{saved_leaf.device}; a window holds dense tensors with values (load "
                    "the state_dict() the optimizer saved, unchanged)"
                )
            if not isinstance(saved_leaf, Tensor) or (
                template_leaf.shape != saved_leaf.shape or template_leaf.dtype != saved_leaf.dtype
            ):
                got = (
                    f"{saved_leaf.dtype} {tuple(saved_leaf.shape)}"
                    if isinstance(saved_leaf, Tensor)
                    else type(saved_leaf).__name__
                )
                raise ValueError(
                    f"{owner}: the window of {where} holds a {got} tensor where its params need "
                    f"{template_leaf.dtype} {tuple(template_leaf.shape)}"
                )
        for template_leaf, saved_leaf in zip(template_leaves, saved_leaves):
            template_leaf.copy_(saved_leaf)
        # The values (counters in range, the inner state's invariants), as `update` checks
        # a state from outside; the copies above own their memory, so no aliasing is left.
        check_state_values(self._config, template, params, optree.tree_structure(params), owner)
        return template


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


def _returning(loss: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """The closure whose first call returns `loss`, evaluated already (grads in place)."""
    calls = 0

    def once_evaluated() -> Any:
        nonlocal calls
        calls += 1
        return loss if calls == 1 else closure()

    return once_evaluated


def _interruptible(closure: Callable[[], Any], guard: InterruptGuard) -> Callable[[], Any]:
    """`closure` run as the user's code: Ctrl-C acts at once inside it (see
    `aadl_func._src.atomic.InterruptGuard.callbacks()`).

    Traced (the wrapped optimizer's step compiled on its own, its closure call with it), the
    signal handlers stay as they are, which dynamo cannot trace: Ctrl-C in the closure is
    then deferred to the end of the step, as elsewhere in it."""

    def run() -> Any:
        if torch.compiler.is_compiling():
            return closure()
        with guard.callbacks():
            return closure()

    return run


def _returns_a_loss(closure: Callable[[], Any]) -> Callable[[], Any]:
    """`closure`, checked to return a loss: the safeguard compares two of them."""

    def checked() -> Any:
        return _check_is_a_loss(closure(), "`closure` must return the loss:")

    return checked


def _check_is_a_loss(loss: Any, what: str) -> Any:
    """`loss` if it is a loss (a real tensor of one element or a real number), else a
    TypeError that says `what` should have been."""
    if isinstance(loss, Tensor) and loss.numel() == 1 and not loss.is_complex():
        if loss.dtype != torch.bool:
            return loss
    elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return loss
    raise TypeError(
        f"AcceleratedOptimizer.step: {what} a real tensor of one element or a real number, "
        f"got {type(loss).__name__}"
        + (f" of shape {tuple(loss.shape)}, {loss.dtype}" if isinstance(loss, Tensor) else "")
    )


def _check_safeguard(owner: str, safeguard: Any, store_each_nth: Any) -> None:
    """`safeguard` is one of the wrapper's; the deferred one reads the previous plain step
    from the window, so it needs every step stored."""
    if not isinstance(safeguard, str) or safeguard not in _SAFEGUARDS:
        raise ValueError(
            f"{owner}: `safeguard` must be 'loss_fn' (a closure safeguards each mix) or "
            f"'deferred' (the next step's loss judges the mix), got {safeguard!r}"
        )
    if safeguard == "deferred" and store_each_nth != 1:
        raise ValueError(
            f"{owner}: safeguard='deferred' needs store_each_nth=1 (got {store_each_nth!r}): "
            "a rejected mix goes back to the previous plain step, read from the window"
        )


def _marks(window: AndersonState) -> tuple[int, int]:
    """What a call of the core moves when it records an outcome: `count` (a step) or
    `num_rejected` (a reverted mix, which is not counted in `count`)."""
    return int(window.count), int(window.num_rejected)


def _torch_state(
    state: Any, params: list[Tensor], verdict: Tensor
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """`(tensor, copy, verdict)` for the wrapped optimizer's state tensors of `params`
    (momentum, moments, step counts): what a compiled step blends back where `verdict`
    rejects. Params without state have never been stepped, so no mix of theirs is pending."""
    return [
        (value, value.clone(), verdict)
        for p in params
        for value in state.get(p, {}).values()
        if isinstance(value, Tensor)
    ]


def _check_no_line_search(owner: str, line_search: object) -> None:
    """`line_search=True` searches with a forward-mode derivative of the loss along the mix;
    the closure sets the module's parameters in place, through which none flows."""
    if line_search is True:
        raise ValueError(
            f"{owner}: `line_search=True` is available in the functional API only "
            "(aa.anderson(..., line_search=True) with update(..., loss_fn=...)): a closure "
            "writes the candidate into the module's parameters, through which no "
            "forward-mode derivative flows"
        )


def _closure_loss(
    params: list[Tensor], closure: Callable[[], Any]
) -> Callable[[list[Tensor]], Tensor]:
    """`loss_fn` for the safeguard: the closure's loss with `params` set to a candidate."""

    def loss_fn(candidate: list[Tensor]) -> Tensor:
        with torch.no_grad():
            for p, value in zip(params, candidate):
                p.copy_(value)
        with torch.enable_grad():
            loss = closure()
        if isinstance(loss, Tensor):
            return loss.detach().reshape(())
        return torch.tensor(float(loss), dtype=torch.float64)

    return loss_fn


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

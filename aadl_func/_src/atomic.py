r"""What makes an in-place step safe to interrupt.

`update(..., inplace=True)` writes into the params and into the buffers of the state the
caller holds. For an exception thrown halfway (by `loss_fn`, a closure, or Ctrl-C) to leave
something usable, the step is split at a *commit point*:

1. the plain step: the inner optimizer's update (out of place: its new state is written at
   the commit), `y` in the params, `y` in the window;
2. commit: the state the caller passed is overwritten, tensor by tensor, with the state of a
   plain (unmixed) step (`write_back()`), so from here on the caller's objects describe
   a finished plain step;
3. the mix, the moving average and the safeguard (`loss_fn`), which only read the window
   until every decision is made; then the final writes and a second `write_back()`.

`Progress` records how far the call has written, so that an exception of any type
raised anywhere is turned into one complete outcome (`exec.inplace.recover`): before 1 nothing
changed; during 1 the plain step is completed with the window restarted; during a commit
(2, or the final one) the commit is finished; during the rest of 3 the caller gets exactly
the plain step back. `InterruptGuard` turns a
Ctrl-C that arrives outside the user's callbacks into one raised at the next safe point.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import optree
from torch import Tensor

from aadl_func._src import tree

__all__ = ["InterruptGuard", "Progress", "guarded", "write_back"]

# The C functions behind `signal.signal` / `signal.getsignal`: their wrappers in signal.py
# convert to and from enums, ~12 us of a small model's step for the three calls a guarded step
# makes (~1 us here). Same handlers, same semantics.
try:
    import _signal

    _set_handler, _get_handler = _signal.signal, _signal.getsignal
except ImportError:  # a Python without CPython's module layout
    _set_handler, _get_handler = signal.signal, signal.getsignal
_SIGINT = int(signal.SIGINT)


class Progress:
    """How far an eager in-place call has written the caller's tensors, so that an exception
    raised anywhere in it can be turned into one complete outcome (`exec.inplace.recover`).

    Attributes:
      param_versions: the params' version counters before the first write of the call (None
        until the writes begin; None for an inference tensor, which keeps none); a leaf whose
        counter moved has had its plain step added.
      stepped: the params leaves that have had their plain step added, in order.
      plain: the commit point was passed (the caller holds the finished plain step).
      undo: after the commit point, `(targets, sources)` lists of copies that put the plain
        step back into tensors written since (the params mixed into, the window's newest
        entry moved).
      pending: the state being committed (plain, final or skipped), None between commits.
      writes: the `(dst, src)` copies of the params that go with `pending`.
    """

    __slots__ = ("param_versions", "stepped", "plain", "undo", "pending", "writes")

    def __init__(self) -> None:
        self.param_versions: list[int | None] | None = None
        self.stepped: list[Tensor] = []
        self.plain = False
        self.undo: list[tuple[list[Tensor], list[Tensor]]] = []
        self.pending: Any = None
        self.writes: list[tuple[Tensor, Tensor]] = []


def write_back(target: Any, source: Any) -> None:
    """Copies every tensor leaf of `source` into the matching leaf of `target` in place.

    Leaves (and NamedTuple fields) that already are the same object are skipped (the window's
    slots, written in place); a Python int or float in `source` (a counter's value, the
    pending loss) fills its tensor.
    Both trees must have one structure; `target`'s non-tensor leaves cannot be updated, so
    the exception guarantee covers states whose changing leaves are tensors (every state of
    this package and torchopt's).
    """
    if target is source:
        return
    if isinstance(target, Tensor) and isinstance(source, Tensor):
        target.copy_(source)
        return
    if isinstance(target, Tensor) and type(source) in (int, float):
        # A counter's new value, known as a Python int (the eager executor), or a float64
        # field's (`pending_loss` in the steady call): one write.
        target.fill_(source)
        return
    if type(target) is type(source) and hasattr(target, "_fields"):
        # A NamedTuple (the state): field by field, so that a field the step left as it was
        # (the same object, e.g. a window written in place) costs nothing.
        for dst, src in zip(target, source):
            if dst is not src:
                write_back(dst, src)
        return
    targets, target_spec = optree.tree_flatten(target, none_is_leaf=True)
    sources, source_spec = optree.tree_flatten(source, none_is_leaf=True)
    if not tree.same_structure(target_spec, source_spec):
        raise RuntimeError("internal: the state changed structure during an in-place step")
    for dst, src in zip(targets, sources):
        if isinstance(dst, Tensor) and isinstance(src, Tensor) and dst is not src:
            dst.copy_(src)


class InterruptGuard:
    """Defers SIGINT (Ctrl-C) while an in-place step writes its buffers.

    Active only in the main thread and while Python's default SIGINT handler is installed (a
    program with its own handler keeps it, untouched). A Ctrl-C received while the guard
    holds is raised as `KeyboardInterrupt` at the next `checkpoint()` or
    `callbacks()` block, or when the guard exits; inside `callbacks()` (the user's
    `loss_fn`) Ctrl-C acts at once.

    Held through `guarded()`, the guard's handler is never left installed after the
    guarded call, and Ctrl-C never swallowed, whatever one exception is raised where:

    * `__enter__` installs its handler as its last step and takes it out again if anything
      is raised after (its `return` included);
    * `__exit__` puts the default handler back first, and only if its own handler is still
      the installed one (a handler the user installed meanwhile, e.g. in `loss_fn`, stays);
    * `guarded()` does that again when an exception skipped `__exit__` (raised at the
      line event of the `with` statement's end) or cut it short.

    A second line of defence, for a second exception during that clean-up: a handler left
    behind notices on the next SIGINT that the call that installed it has returned (its
    frame is no longer on the stack): it puts the default handler back and raises
    `KeyboardInterrupt` at once, as the default handler would. The next guard also takes
    such a stale handler for the default one (while a live one, an outer guard's, is left in
    place: the outer guard then defers Ctrl-C for both).
    """

    def __init__(self) -> None:
        self.pending = False
        self._active = False
        self._frame: Any = None

    def _owns(self, handler: Any) -> bool:
        """Whether `handler` is this guard's `_record`. Told by its owner and function, not
        by identity with a bound method the guard keeps: a guard holding its own bound
        method is a reference cycle, which only the garbage collector frees (one per
        in-place call: a collection every couple of hundred steps, for this alone)."""
        return (
            getattr(handler, "__self__", None) is self
            and getattr(handler, "__func__", None) is InterruptGuard._record
        )

    def _record(self, signum: int, frame: Any) -> None:
        if self._holds(frame):
            self.pending = True
            return
        # Stale: the guarded call ended without __exit__. Behave as the default handler.
        if self._owns(_get_handler(_SIGINT)):
            _set_handler(_SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt

    def _holds(self, frame: Any) -> bool:
        """Whether the guarded call is still running (its frame is on the stack)."""
        while frame is not None:
            if frame is self._frame:
                return True
            frame = frame.f_back
        return False

    def __enter__(self) -> InterruptGuard:
        # `return self` inside the `try`: its line event can raise (another signal's
        # handler, a trace function) after the handler is in, and __exit__ would not run.
        try:
            if threading.current_thread() is threading.main_thread() and _is_default(
                _get_handler(_SIGINT)
            ):
                self._frame = sys._getframe(1)  # the guarded call's frame (see _record)
                _set_handler(_SIGINT, self._record)
                self._active = True
            return self
        except BaseException:
            self.release()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
        if self.pending and exc_info[0] is None:
            self.pending = False
            raise KeyboardInterrupt

    def release(self) -> None:
        """Puts the default handler back if the guard's own is installed; nothing else (a
        deferred Ctrl-C stays pending). Idempotent: `guarded()` calls it again when an
        exception may have skipped `__exit__` or cut it short."""
        if self._owns(_get_handler(_SIGINT)):
            _set_handler(_SIGINT, signal.default_int_handler)
        self._active, self._frame = False, None

    def checkpoint(self) -> None:
        """Raises a deferred Ctrl-C now (the caller is at a consistent point)."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    @contextmanager
    def callbacks(self) -> Iterator[None]:
        """Runs the user's code interruptible, as it would run outside `update`."""
        self.checkpoint()
        if not self._active:
            yield
            return
        _set_handler(_SIGINT, signal.default_int_handler)
        try:
            yield
        finally:
            # Back to recording, unless the user's code installed a handler of its own.
            if _get_handler(_SIGINT) is signal.default_int_handler:
                _set_handler(_SIGINT, self._record)


def guarded(guard: InterruptGuard | None, run: Callable[[], Any]) -> Any:
    """`run()` with `guard` held (None: unguarded), its handler taken out however it ends.

    The `except` is there for what `with` alone misses. CPython (3.11) emits a line event
    for a `with` statement's line as its block ends, *before* it calls `__exit__` and
    outside the block's exception handler, so an exception raised there (by another signal's
    handler, a trace function) skips `__exit__`; one raised inside `__exit__` before it
    put the default handler back cuts it short. Either way `InterruptGuard.release()`
    runs here. (A deferred Ctrl-C raised by `__exit__` passes through: released already.)
    """
    if guard is None:
        return run()
    try:
        with guard:
            return run()
    except BaseException:
        guard.release()
        raise


def _is_default(handler: Any) -> bool:
    """Python's default SIGINT handler, or a guard's handler left behind (see
    `InterruptGuard`), which behaves as the default one once its call has ended."""
    if handler is signal.default_int_handler:
        return True
    owner = getattr(handler, "__self__", None)
    # A guard whose call is still running (an outer one: the wrapper's around the core's)
    # keeps its handler; the inner guard then stands aside and the outer one defers for both.
    return isinstance(owner, InterruptGuard) and not owner._holds(sys._getframe())

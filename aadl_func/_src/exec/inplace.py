"""The in-place protocol of an eager `update` call: its commits and its recovery.

An eager in-place call writes the caller's own tensors, split at a commit point
(`aadl_func._src.atomic`, which also holds the `Progress` record and the interrupt guard).
Here are the writes that follow that protocol, for the general path and the eager executor
alike: `commit()` and `commit_to()` make a state the caller's, `begin_writes()` and
`undo_later()` record what `recover()` needs, and `recover()` turns an exception raised
anywhere in the call into one complete outcome (docs/reliability.md, "The exception
guarantee"); `callbacks()` is where the user's `loss_fn` runs under the guard.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import optree
from torch import Tensor

from aadl_func._src import deferred, protocols
from aadl_func._src.atomic import Progress, write_back
from aadl_func._src.state import AndersonState

if TYPE_CHECKING:
    from aadl_func._src.update_call import Call

__all__ = [
    "adopt",
    "begin_writes",
    "callbacks",
    "commit",
    "commit_to",
    "recover",
    "restart_window",
    "undo_later",
]


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
    leaf by leaf; leaves of another shape, dtype or device, and 0-d ones (a counter, whose
    memory the steady call writes through a pointer: `exec.plan`), are copied. Doing it
    again is a no-op, so an interrupted adoption is finished by repeating it."""
    targets = optree.tree_leaves(target, none_is_leaf=True)
    sources = optree.tree_leaves(source, none_is_leaf=True)
    for dst, src in zip(targets, sources):
        if isinstance(dst, Tensor) and isinstance(src, Tensor) and dst is not src:
            if (
                dst.ndim
                and dst.shape == src.shape
                and dst.dtype == src.dtype
                and (dst.device == src.device)
            ):
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

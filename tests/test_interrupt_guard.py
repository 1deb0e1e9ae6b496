"""The interrupt guard of in-place steps (``aadl_func._src.atomic.InterruptGuard``) never leaves
Ctrl-C swallowed and never replaces a handler of the user's.

An exception is injected (``sys.settrace``) at every line event of the guard's own code during
an in-place ``update`` with ``loss_fn`` (so ``__enter__``, ``callbacks``, ``checkpoint`` and
``__exit__`` all run); after each, a real SIGINT must raise ``KeyboardInterrupt`` at once and
leave Python's default handler installed.
"""

from __future__ import annotations

import signal
import sys

import pytest
import torch
from faults import LineFaults

import aadl_func as aa
from aadl_func._src import atomic

GUARD_FILE = atomic.__file__


def _problem():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, generator=gen, dtype=torch.float64)}

    def loss(p):
        return (p["w"] ** 2).sum()

    return params, loss


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def assert_ctrl_c_works():
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _in_guard(code) -> bool:
    """The guard's own code: its methods and the ``callbacks`` generator."""
    return code.co_filename == GUARD_FILE and "Guard" in code.co_qualname


def _steps(faults, calls=4):
    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    params, loss = _problem()

    def run():
        nonlocal params
        state = opt.init(params)
        for _ in range(calls):
            grads = torch.func.grad(loss)(params)
            params, state = opt.update(state, params, grads, inplace=True, loss_fn=loss)

    faults.run(run)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="co_qualname")
@pytest.mark.parametrize("error", [RuntimeError, SystemExit, KeyboardInterrupt])
@pytest.mark.usefixtures("default_sigint")
def test_an_exception_at_any_line_of_the_guard_leaves_ctrl_c_working(error):
    counter = LineFaults(_in_guard)
    _steps(counter)
    assert counter.count > 20  # every method of the guard ran (4 calls, mixing ones too)
    for at in range(counter.count):
        faults = LineFaults(_in_guard, error, at)
        _steps(faults)
        assert faults.fired
        assert_ctrl_c_works()


@pytest.mark.usefixtures("default_sigint")
def test_a_handler_left_behind_behaves_as_the_default_one():
    """A guard whose call ended without ``__exit__`` (the worst case above): its handler
    raises KeyboardInterrupt at the next SIGINT and hands back the default handler; a new
    guard before that takes it over and restores the default on exit."""

    def abandoned():
        atomic.InterruptGuard().__enter__()

    abandoned()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert_ctrl_c_works()
    abandoned()
    with atomic.InterruptGuard() as guard:
        signal.raise_signal(signal.SIGINT)  # deferred
        assert guard.pending
        guard.pending = False
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class SignalingSgd:
    """aa.sgd whose update delivers a real SIGINT mid-step."""

    def __init__(self):
        self.inner = aa.sgd(0.1)

    def init(self, params):
        return self.inner.init(params)

    def update(self, updates, state, params=None, inplace=False):
        signal.raise_signal(signal.SIGINT)
        return self.inner.update(updates, state, params=params, inplace=inplace)


def test_a_users_own_sigint_handler_is_kept_and_called():
    """With the user's handler installed the guard stands aside: the handler stays, sees the
    SIGINT raised mid-step, and the step completes."""
    seen = []

    def handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        opt = aa.anderson(SignalingSgd(), history_depth=3)
        params, loss = _problem()
        state = opt.init(params)
        for _ in range(4):
            params, state = opt.update(
                state, params, torch.func.grad(loss)(params), inplace=True, loss_fn=loss
            )
        assert signal.getsignal(signal.SIGINT) is handler
        assert seen == [signal.SIGINT] * 4
        assert int(state.count) == 4
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
def test_a_handler_installed_by_loss_fn_is_kept():
    """``loss_fn`` runs with the default handler (Ctrl-C acts at once there); a handler it
    installs is the user's and is not replaced when the step ends."""

    def handler(signum, frame):
        pass

    calls = []

    def loss_installing(p):
        calls.append(1)
        signal.signal(signal.SIGINT, handler)
        return loss(p)

    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    params, loss = _problem()
    state = opt.init(params)
    for _ in range(5):
        before = len(calls)
        params, state = opt.update(
            state, params, torch.func.grad(loss)(params), inplace=True, loss_fn=loss_installing
        )
        expected = handler if len(calls) > before else signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is expected
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert len(calls) >= 4  # the safeguard ran on the mixing calls

"""Fault injection for the exception-safety tests: ``sys.settrace`` raising an exception at one
line event of selected frames (one fault per run)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType


class LineFaults:
    """A trace function that raises ``error`` at line event number ``at`` (0-based) of the
    frames ``traced(code)`` selects, and counts those events (with ``at=None``, it only
    counts). Install with :meth:`installed`."""

    def __init__(self, traced: Callable, error: type | None = None, at: int | None = None):
        self.traced, self.error, self.at = traced, error, at
        self.count, self.fired = 0, False

    def global_trace(self, frame: FrameType, event: str, arg: object):
        return self.local_trace if self.traced(frame.f_code) else None

    def local_trace(self, frame: FrameType, event: str, arg: object):
        if event == "line":
            if not self.fired and self.count == self.at:
                self.fired = True
                raise self.error("injected")
            self.count += 1
        return self.local_trace

    def run(self, fn: Callable[[], object]) -> None:
        """``fn()`` traced; the injected exception is swallowed, any other propagates.

        Nothing of the process is repaired afterwards (torch's grad mode, the SIGINT handler):
        the library must leave them as they were, and the tests check it."""
        sys.settrace(self.global_trace)
        try:
            fn()
        except BaseException as exc:
            sys.settrace(None)
            if not (self.fired and type(exc) is self.error):
                raise
        finally:
            sys.settrace(None)

"""``torch.compile(optimizer.step)`` of :class:`aadl_func.AcceleratedOptimizer` (issue 24).

What is pinned down here, on the CPU, with a recording backend that runs the traced graphs as
they are (dynamo only, like ``backend="eager"``):

* the compiled step breaks the graph only where ``torch.optim`` and the user's closure do:
  every graph break dynamo reports (its ``graph_breaks`` log, the one ``TORCH_LOGS`` prints)
  lies in torch's files or in this test's closure, none in ``aadl_func``, except the one
  deliberate break of a step with a closure (the safeguard, docs/compiling.md);
* the wrapper's own frames are compiled, not skipped: the traced graphs hold ops from
  ``wrapper.py`` (the snapshot of the params) and from the core's modules;
* the compiled step gives the eager wrapper's params and counters. The reference for Adam is
  the eager wrapper around a compiled ``Adam.step``: torch's compiled Adam differs from its
  eager one by rounding (its step count stays a float32 tensor), which the acceleration
  amplifies; SGD compiles bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import aadl_func as aa

# Compiling ``update`` needs torch 2.12 (docs/compatibility.md, tests/test_compile.py).
pytestmark = [
    pytest.mark.skipif(
        torch.__version__ < (2, 12), reason="torch.compile of update needs torch 2.12+"
    ),
    # torch's own code warns while dynamo traces torch.optim's step and resumes the closure
    # after its ``backward`` (reading the loss's ``.grad``); warnings are errors in this suite.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]

PACKAGE = os.path.dirname(aa.__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
STEPS = 6


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Recording:
    """What dynamo did while compiling: graph breaks as ``(file, line, reason)`` and the
    user frames ``(file, function)`` the ops of the traced graphs come from."""

    def __init__(self) -> None:
        self.breaks: list[tuple[str, int, str]] = []
        self.sources: set[tuple[str, str]] = set()

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        for node in gm.graph.nodes:
            trace = node.meta.get("stack_trace") or ""
            self.sources.update(re.findall(r'File "([^"]+)", line \d+, in (\w+)', trace))
        return gm.forward

    def breaks_in(self, directory: str) -> list[tuple[str, int, str]]:
        return [b for b in self.breaks if b[0].startswith(directory)]


class _BreakLog(logging.Handler):
    # Both of dynamo's graph-break lines read "... in user code at FILE:LINE\n... Reason: ...".
    _WHERE = re.compile(r"in user code at (.+?):(\d+)")

    def __init__(self, recording: Recording) -> None:
        super().__init__(logging.DEBUG)
        self.recording = recording

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        found = self._WHERE.search(message)
        assert found is not None, f"unrecognised graph-break log line: {message[:200]}"
        reason = message.split("Graph Break Reason:", 1)[-1].strip()
        self.recording.breaks.append((found.group(1), int(found.group(2)), reason))


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Records the graph breaks (dynamo's ``graph_breaks`` artifact log) meanwhile."""
    result = Recording()
    handler = _BreakLog(result)
    torch._logging.set_logs(graph_breaks=True)
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch._dynamo") and name.endswith("__graph_breaks")
    ]
    assert loggers, "dynamo's graph-break log was not found"
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield result
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        torch._logging.set_logs()


# -- problem -------------------------------------------------------------------------------
def model_and_data(groups: int = 1) -> tuple[torch.nn.Module, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1)
    ).double()
    params = list(model.parameters())
    param_groups = (
        params if groups == 1 else [{"params": params[:2]}, {"params": params[2:], "lr": 0.02}]
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=g, dtype=torch.float64)
    y = torch.randn(48, 1, generator=g, dtype=torch.float64)
    return model, param_groups, x, y


def make_torch_optimizer(kind: str, param_groups: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(param_groups, lr=0.05, momentum=0.9)
    return torch.optim.Adam(param_groups, lr=1e-2)


def run(
    kind: str,
    *,
    compiled: Callable[..., Any] | None,
    with_closure: bool,
    groups: int = 1,
    via_accelerate: bool = False,
    **options: Any,
) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    """``STEPS`` wrapper steps; ``compiled`` is the backend of ``torch.compile(opt.step)``, or
    None for the eager reference (around a compiled ``Adam.step``, see the module doc)."""
    model, param_groups, x, y = model_and_data(groups)
    torch_optimizer = make_torch_optimizer(kind, param_groups)
    if compiled is None and kind == "adam":
        torch_optimizer.step = torch.compile(torch_optimizer.step, backend="eager")
    if via_accelerate:
        wrapper = aa.accelerate(torch_optimizer, relaxation=1.0, history_depth=5, **options)
        step = torch_optimizer.step
    else:
        wrapper = aa.AcceleratedOptimizer(torch_optimizer, history_depth=5, **options)
        step = wrapper.step
    if compiled is not None:
        step = torch.compile(step, backend=compiled)

    def closure() -> torch.Tensor:
        for p in model.parameters():  # not opt.zero_grad(): torch.optim's is never traced
            p.grad = None
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(STEPS):
        if with_closure:
            step(closure)
        elif options.get("safeguard") == "deferred":
            step(loss=closure().detach())
        else:
            closure()
            step()
    counters = [
        (int(s.count), int(s.num_mixed), int(s.num_rejected), int(s.num_averaged))
        for s in wrapper.anderson_states
    ]
    return [p.detach().clone() for p in model.parameters()], counters


def assert_same_run(compiled_run: Any, eager_run: Any) -> None:
    (params, counters), (ref_params, ref_counters) = compiled_run, eager_run
    assert counters == ref_counters
    mixes = counters[0][1] + counters[0][2]  # taken or rejected by the safeguard
    assert mixes > 0, "no mix was formed: the comparison would not test the core"
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p, ref, rtol=1e-12, atol=1e-14)


def assert_ours_compiled(record: Recording) -> None:
    """The wrapper's step was traced, not run eagerly (dynamo skips a frame that names no
    ``torch`` and holds no tensor): the snapshot of the params is in a graph, and so is the
    core's update."""
    source = os.path.join(PACKAGE, "_src", "{}.py").format
    assert (source("wrapper"), "_step") in record.sources, "the wrapper's step ran eagerly"
    assert (source("anderson"), "update") in record.sources, "the core ran eagerly"


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_compiled_step_breaks_only_in_torch_optim(kind: str) -> None:
    with recording() as record:
        compiled = run(kind, compiled=record.backend, with_closure=False)
    assert record.breaks_in(PACKAGE) == []
    # The breaks there are: torch.optim's own (``_use_grad`` breaks around each step).
    assert record.breaks, "torch.optim's step breaks the graph: the log was not recorded"
    assert all(b[0].startswith(TORCH) for b in record.breaks), record.breaks
    assert_ours_compiled(record)
    assert_same_run(compiled, run(kind, compiled=None, with_closure=False))


def test_compiled_step_two_groups_through_accelerate() -> None:
    """AADL's path (``optimizer.step`` patched by ``accelerate``), one window per group."""
    with recording() as record:
        compiled = run(
            "sgd", compiled=record.backend, with_closure=False, groups=2, via_accelerate=True
        )
    assert record.breaks_in(PACKAGE) == []
    assert_ours_compiled(record)
    reference = run("sgd", compiled=None, with_closure=False, groups=2, via_accelerate=True)
    assert len(compiled[1]) == 2
    assert_same_run(compiled, reference)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_compiled_step_with_closure_breaks_once_of_ours(kind: str) -> None:
    """With a closure the safeguard evaluates it inside the core: the core then runs eagerly,
    behind the one deliberate break of ours (``wrapper._eagerly``); the closure's own break
    (``backward``) is the user's."""
    with recording() as record:
        compiled = run(kind, compiled=record.backend, with_closure=True)
    ours = record.breaks_in(PACKAGE)
    assert ours, "expected the deliberate break around the core"
    assert all("disable" in reason for _, _, reason in ours), ours
    assert {os.path.basename(file) for file, _, _ in ours} == {"wrapper.py"}
    users = [b for b in record.breaks if b[0] == __file__]
    assert users and all("backward" in reason for _, _, reason in users), users
    others = [b for b in record.breaks if b not in ours and b not in users]
    assert all(b[0].startswith(TORCH) for b in others), others
    reference = run(kind, compiled=None, with_closure=True)
    assert_same_run(compiled, reference)
    assert compiled[1][0][2] > 0, "no mix was rejected: the safeguard was not exercised"


def test_skip_nonfinite_breaks_once_at_the_finiteness_check() -> None:
    """Whether the torch optimizer steps at all depends on the gradients' values: one host
    read, the only break of ours without a closure (docs/compiling.md)."""
    with recording() as record:
        compiled = run("sgd", compiled=record.backend, with_closure=False, skip_nonfinite=True)
    ours = record.breaks_in(PACKAGE)
    assert ours and {(os.path.basename(f), line) for f, line, _ in ours} == {
        (os.path.basename(ours[0][0]), ours[0][1])
    }, ours
    assert all("item()" in reason or "bool" in reason for _, _, reason in ours), ours
    assert_same_run(compiled, run("sgd", compiled=None, with_closure=False, skip_nonfinite=True))


@pytest.mark.parametrize("with_closure", [False, True], ids=["loss", "closure"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_deferred_safeguard_adds_no_break_of_ours(kind: str, with_closure: bool) -> None:
    """``safeguard="deferred"``: the verdict has no value while tracing, so every group is
    stepped and a rejected group's torch state is blended back (no host read); the core runs
    compiled (no closure inside it), and the only breaks are torch.optim's and the user's
    ``backward``. Two groups; the same params and counters as the eager wrapper."""
    options = dict(safeguard="deferred", mode="classic", groups=2)
    with recording() as record:
        compiled = run(kind, compiled=record.backend, with_closure=with_closure, **options)
    assert record.breaks_in(PACKAGE) == []
    users = [b for b in record.breaks if b[0] == __file__]
    assert all("backward" in reason for _, _, reason in users), users
    others = [b for b in record.breaks if b not in users]
    assert all(b[0].startswith(TORCH) for b in others), others
    assert_ours_compiled(record)
    reference = run(kind, compiled=None, with_closure=with_closure, **options)
    assert_same_run(compiled, reference)
    assert compiled[1][0][2] > 0, "no mix was rejected: the verdict was not exercised"

"""Fault injection into ``update(..., inplace=True)``: an exception raised at any line of the
package's code during a call leaves one complete outcome (docs/reliability.md, "The exception
guarantee").

``sys.settrace`` counts the line events of the package's own frames during one call, then
raises an exception at a sample of them (one fault per trial), for several exception types
(``RuntimeError`` as an out-of-memory error would be, ``SystemExit`` as from a SIGTERM
handler, ``KeyboardInterrupt`` as from a user's own SIGINT handler) and option sets. After
each trial the params and the state the caller holds must equal, bit for bit, one of:

* ``before``: the call never happened;
* ``final``: the uninterrupted call's result;
* ``plain``: the plain step ``y`` of the call, mix dropped uncounted (reference: the core's
  ``step(..., mix=False)``, the wrapper's plain recovery);
* ``restart``: the plain step with the window restarted from ``y`` (params, inner state and
  counters as ``plain``, ``window_size`` 1 in mode "aadl" and 0 in "classic", Grams zero,
  anchor ``y``, ``head`` one slot on); its ring slots are outside the window, so the
  reference has them zeroed.

Then ``Q + 1`` more calls from the outcome (``Q`` ring slots) give the params of the same calls
from that reference at every call, and the same state at the end (for ``restart``: whatever
the stale slots held), and Ctrl-C works (raises ``KeyboardInterrupt`` at once).
``AADL_FAULT_STRIDE=1`` injects at every line (about 1,500 trials per option set and type).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import optree
import pytest
import torch
from faults import LineFaults
from test_exception_safety import _problem

import aadl_func as aa
from aadl_func._src.anderson import step
from aadl_func._src.options import AndersonOptions

PACKAGE = str(Path(aa.__file__).resolve().parent)
WARM = 6
SAMPLES = 16  # injection points per (option set, exception type); AADL_FAULT_STRIDE overrides
TAIL = 8  # and the last line events of the call, where its writes are


CONFIGS = {
    "aadl-safeguard": dict(inner=lambda: aa.sgd(0.3, momentum=0.5), relaxation=0.5, guard=True),
    "aadl-into-params": dict(inner=lambda: aa.sgd(0.3, momentum=0.5), guard=False),
    "aadl-average-adam": dict(
        inner=lambda: aa.adam(0.05), average=True, average_tol=0.05, guard=True
    ),
    "classic-safeguard": dict(inner=lambda: aa.sgd(0.3), mode="classic", guard=True),
    "classic-skip_nonfinite": dict(
        inner=lambda: aa.sgd(0.3, momentum=0.5), mode="classic", skip_nonfinite=True, guard=False
    ),
    "aadl-skipped-call": dict(
        inner=lambda: aa.adam(0.05), skip_nonfinite=True, nan_grads=True, guard=True
    ),
    # The deferred safeguard (``loss=``) on every call; the faulted call's loss rejects the
    # mix the warm-up's last call returned: a reverted call (its writes: params and counters).
    "classic-deferred-reverted": dict(
        inner=lambda: aa.adam(0.05), mode="classic", guard=False, deferred=True
    ),
    "aadl-deferred-kept": dict(
        inner=lambda: aa.sgd(0.3, momentum=0.5), guard=False, deferred=True, keep=True
    ),
    # Mode "classic" without a safeguard: the eager executor's in-place classic step.
    "classic-executor": dict(inner=lambda: aa.adam(0.05), mode="classic", guard=False),
    # Float32 params, mode "aadl", a full window, no loss, each leaf's ring slots rows of one
    # buffer as `init` lays them out: the steady call (aadl_func._src.exec.steady).
    "aadl-steady": dict(
        inner=lambda: aa.adam(0.05), guard=False, dtype=torch.float32, init_layout=True
    ),
    "classic-steady": dict(
        inner=lambda: aa.adam(0.05),
        mode="classic",
        guard=False,
        dtype=torch.float32,
        init_layout=True,
    ),
}
# The steady sets with the faulted call (number WARM + 1 = 7) storing without mixing
# (frequency 2): a steady call that only stores.
for _name in ("aadl-steady", "classic-steady"):
    CONFIGS[f"{_name}-store"] = {**CONFIGS[_name], "frequency": 2}
# And with the deferred safeguard (`loss=` on every call), the faulted call keeping the pending
# mix (a steady call that judges, clears and sets the bar) or rejecting it (a steady revert).
for _name in ("aadl-steady", "classic-steady"):
    CONFIGS[f"{_name}-deferred-kept"] = {**CONFIGS[_name], "deferred": True, "keep": True}
    CONFIGS[f"{_name}-deferred-reverted"] = {**CONFIGS[_name], "deferred": True}
# And with the faulted call (number 11) off `store_each_nth` = 2, mixing the window without
# storing: a steady call that does not store (calls 7-10 are steady too).
for _name in ("aadl-steady", "classic-steady"):
    CONFIGS[f"{_name}-unstored"] = {
        **CONFIGS[_name],
        "store_each_nth": 2,
        "history_depth": 3,
        "warm": 10,
    }
# Plain SGD in the steady call: its update formed in the append's pass from the grads (which
# are only read), and formed again by the recovery where the append did not run.
CONFIGS["aadl-steady-sgd"] = {**CONFIGS["aadl-steady"], "inner": lambda: aa.sgd(0.05)}
ERRORS = [RuntimeError, SystemExit, KeyboardInterrupt]


def _clone(tree):
    return optree.tree_map(lambda t: t.clone(), tree)


def _leaves(tree):
    return optree.tree_leaves(tree)


def _equal(a, b) -> bool:
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb)
    )


class Setup:
    """One option set warmed up for ``WARM`` calls, and the faulted call's references."""

    def __init__(self, name):
        config = dict(CONFIGS[name])
        self.guard = config.pop("guard")
        nan_grads = config.pop("nan_grads", False)
        self.deferred = config.pop("deferred", False)
        keep = config.pop("keep", False)
        make_inner = config.pop("inner")
        dtype = config.pop("dtype", torch.float64)
        self.init_layout = config.pop("init_layout", False)
        warm = config.pop("warm", WARM)
        self.options = {"history_depth": 4, **config}
        self.opt = aa.anderson(make_inner(), **self.options)
        self.core = AndersonOptions(make_inner(), **self.options)
        params, self.loss = _problem(dtype)
        state = self.opt.init(params)
        for _ in range(warm):
            params, state = self.opt.update(
                state, params, self._grads(params), inplace=True, **self._kw(params)
            )
        self.start = _clone((params, state))
        self.grads = self._grads(params)
        self.faulted_kw = self._kw(params)
        if self.deferred:
            assert float(state.pending_loss) < float("inf")  # a mix is pending: judged now
            # A loss above the pending one rejects it; below it keeps it (the losses here
            # are positive).
            assert float(state.pending_loss) > 0
            pending = state.pending_loss
            self.faulted_kw = {"loss": pending * 0.5 if keep else pending * 2.0 + 1.0}
        if nan_grads:
            self.grads["v"][0, 0] = float("nan")  # the faulted call is a skipped one
        self.before = _clone(self.start)
        self.final = self._call(
            lambda s, p, g: self.opt.update(s, p, g, inplace=True, **self.faulted_kw)
        )
        if self.deferred:  # the faulted call is the kept or the reverted one it is named for
            rejected = int(self.final[1].num_rejected) - int(self.start[1].num_rejected)
            assert rejected == (0 if keep else 1), (name, rejected)
        self.plain = self._call(
            lambda s, p, g: step(self.core, s, p, g, inplace=True, mix=False, **self.faulted_kw)
        )
        self.restart = self._restarted(self.plain)

    def _loss_fn(self):
        return self.loss if self.guard else None

    def _kw(self, params):
        if self.deferred:
            return {"loss": self.loss(params)}
        return {"loss_fn": self._loss_fn()}

    def _grads(self, params):
        return torch.func.grad(self.loss)(params)

    def _call(self, fn):
        params, state = self.clone_start()
        return fn(state, params, _clone(self.grads))

    def clone_start(self):
        """A copy of the faulted call's params and state; with `init_layout`, the state's
        tensors laid out as `init` lays them out (a leaf's ring slots rows of one buffer)."""
        params, state = _clone(self.start)
        if self.init_layout:
            state = optree.tree_map(lambda new, old: new.copy_(old), self.opt.init(params), state)
        return params, state

    def _restarted(self, plain):
        params, state = _clone(plain)
        q = len(state.residuals)
        zeros = lambda tree: optree.tree_map(torch.zeros_like, tree)  # noqa: E731
        state = state._replace(
            anchor={k: v.clone() for k, v in params.items()},
            residuals=tuple(zeros(r) for r in state.residuals),
            iterates=tuple(zeros(r) for r in state.iterates),
            gram=torch.zeros_like(state.gram),
            dr_gram=torch.zeros_like(state.dr_gram),
            dr_rhs=torch.zeros_like(state.dr_rhs),
            head=(self.before[1].head + 1) % q,
            window_size=torch.tensor(0 if self.options.get("mode") == "classic" else 1),
        )
        return params, state

    def outcome(self, result):
        """The name of the reference ``result`` equals (ring slots free for ``restart``)."""
        for name in ("before", "final", "plain"):
            if _equal(result, getattr(self, name)):
                return name
        params, state = result
        ref_params, ref_state = self.restart
        free = dict(residuals=ref_state.residuals, iterates=ref_state.iterates)
        if _equal((params, state._replace(**free)), self.restart):
            return "restart"
        return None

    def continue_from(self, result):
        """The params after each of the next calls, and the final state: calls until
        ``(Q + 1) store_each_nth`` more steps are counted (a deferred rejection counts none), so
        that every ring slot was rewritten and stale slots and their Gram entries are gone."""
        params, state = result
        trajectory = []
        steps = (len(state.residuals) + 1) * self.options.get("store_each_nth", 1)
        end = int(state.count) + steps
        for _ in range(10 * steps):
            if int(state.count) >= end:
                break
            params, state = self.opt.update(
                state, params, self._grads(params), inplace=True, **self._kw(params)
            )
            trajectory.append(_clone(params))
        return trajectory, state


def _in_package(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def _run_traced(setup, faults):
    params, state = setup.clone_start()
    grads = _clone(setup.grads)
    faults.run(lambda: setup.opt.update(state, params, grads, inplace=True, **setup.faulted_kw))
    return params, state


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test (a process started in the background may
    inherit SIGINT ignored, and the guard then stands aside)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def assert_ctrl_c_works():
    """Python's default SIGINT handler is installed (the guard's is gone) and Ctrl-C raises
    KeyboardInterrupt now; torch's grad mode is on, as the tests run."""
    assert torch.is_grad_enabled(), "grad mode was left disabled"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, (
        "the guard's SIGINT handler was left installed"
    )
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.usefixtures("default_sigint")
def test_an_exception_at_any_line_leaves_one_complete_outcome(name, error):
    setup = Setup(name)
    counter = LineFaults(_in_package)
    _run_traced(setup, counter)
    lines = counter.count
    assert lines > 200  # the call ran through the package's code
    stride = int(os.environ.get("AADL_FAULT_STRIDE", "0")) or max(1, lines // SAMPLES)
    offset = ERRORS.index(error) * stride // len(ERRORS)  # each type hits other lines
    # The strided sample, plus the call's last line events: its writes come last, after the
    # checks, and a call whose checks are most of its lines could otherwise be sampled only
    # before its first write.
    points = sorted({*range(offset, lines, stride), *range(max(0, lines - TAIL), lines)})
    seen = {}
    for at in points:
        result = _run_traced(setup, LineFaults(_in_package, error, at))
        outcome = setup.outcome(result)
        assert outcome is not None, f"line event {at} of {lines}: a torn state"
        assert_ctrl_c_works()
        seen[outcome] = seen.get(outcome, 0) + 1
        reference = getattr(setup, outcome)
        assert _equal(setup.continue_from(result), setup.continue_from(_clone(reference))), (
            f"line event {at}: the run from the {outcome} outcome diverges from its reference"
        )
    assert sum(seen.values()) >= min(SAMPLES, lines) - 1
    # The sample reaches the writes (not only the checks before them); a skipped call's
    # only write is its short commit of two counters.
    assert len(seen) >= 2 or "nan_grads" in CONFIGS[name], seen
    if name == "classic-deferred-reverted":
        assert int(setup.final[1].num_rejected) == int(setup.before[1].num_rejected) + 1


# -- the torch.optim wrapper ---------------------------------------------------------------


def _wrapped(seed=0, warm=WARM, safeguard="loss_fn", late=0):
    """Two param groups under SGD with momentum, wrapped, warmed up with the safeguard. With
    `late` steps: a third group (an output scale, in the model as `model.scale`) added after
    the warm-up and stepped `late` times with the others, so that its window is younger."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model.double()
    model.scale = torch.nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=late > 0)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}]
    opt = aa.AcceleratedOptimizer(
        torch.optim.SGD(groups, lr=0.1, momentum=0.9), history_depth=4, safeguard=safeguard
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(30, 2, generator=gen, dtype=torch.float64)

    def closure():
        opt.zero_grad()
        loss = ((model(x) * model.scale - y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(warm):
        opt.step(closure)
    if late:
        opt.add_param_group({"params": [model.scale], "lr": 0.01})
        for _ in range(late):
            opt.step(closure)
    return model, opt, closure


def _momenta(opt):
    return [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups for p in g["params"]]


def _in_executor(code) -> bool:
    """The eager executor and the wrapper's inner map: where a float64 wrapper once held
    `stepped - start` in its params between the torch step and the core's first write."""
    return code.co_filename.endswith(
        (os.path.join("exec", "eager.py"), "wrapper_groups.py", "anderson.py")
    )


def _stepping(how, opt, closure):
    """The step under test: ``step(closure)`` (the safeguard, on copies of the params), or
    ``step()`` after the closure set the grads (mode "aadl": the core on the params)."""
    if how == "closure":
        return lambda: opt.step(closure)
    closure()
    return opt.step


@pytest.mark.parametrize("how", ["closure", "grads"])
@pytest.mark.parametrize(
    ("error", "traced"),
    [(e, _in_package) for e in ERRORS] + [(RuntimeError, _in_executor)],
    ids=[e.__name__ for e in ERRORS] + ["RuntimeError-every-executor-line"],
)
@pytest.mark.usefixtures("default_sigint")
def test_wrapper_step_ends_consistent_whatever_is_raised_in_its_code(error, traced, how):
    """An exception at a line of the package's code during ``AcceleratedOptimizer.step``
    (the wrapper, the core, the guard; not torch.optim's own loop): either nothing changed,
    or the torch optimizer took its step and every group's window recorded it, with each
    group's params at its window's newest entry, that entry the torch optimizer's plain
    step or the uninterrupted step's outcome, and Grams consistent with the ring. The
    package's lines are sampled (`AADL_FAULT_STRIDE=1`: all); the executor's are all taken.
    With the closure the core works on copies of the params; without (the grads set
    before the step) on the params themselves."""
    from window_invariant import state_gram_errors

    model, opt, closure = _wrapped()
    before = ([p.clone() for p in model.parameters()], _momenta(opt), opt.anderson_states)
    counts = [int(s.count) for s in before[2]]
    reference_model, reference, _ = _wrapped()
    reference._plain_step(closure)  # only the torch step (closure of the other model is fine:
    stepped = _momenta(reference)  # it sets the other model's grads, the same values)
    # The params an outcome may leave in each group: the torch optimizer's plain step, or the
    # whole step's (a group after the one interrupted ends at its plain step).
    plain = [[p.detach().clone() for p in g["params"]] for g in reference.param_groups]
    finished_model, finished, finished_closure = _wrapped()
    _stepping(how, finished, finished_closure)()
    outcomes = list(
        zip(plain, [[p.detach().clone() for p in g["params"]] for g in finished.param_groups])
    )
    del reference_model, finished_model
    counter = LineFaults(traced)
    counter.run(_stepping(how, opt, closure))
    lines = counter.count
    stride = int(os.environ.get("AADL_FAULT_STRIDE", "0")) or max(1, lines // SAMPLES)
    if traced is _in_executor:
        stride = 1
    seen = {"before": 0, "stepped": 0}
    for at in range(ERRORS.index(error) * stride // len(ERRORS), lines, stride):
        model, opt, closure = _wrapped()
        LineFaults(traced, error, at).run(_stepping(how, opt, closure))
        assert_ctrl_c_works()
        momenta, windows = _momenta(opt), opt.anderson_states
        params = [p.detach() for p in model.parameters()]
        if _equal(momenta, before[1]):
            seen["before"] += 1
            assert _equal(params, before[0]), f"line event {at}: params moved, torch did not"
            assert [int(w.count) for w in windows] == counts, f"line event {at}"
            continue
        seen["stepped"] += 1
        assert _equal(momenta, stepped), f"line event {at}: torch's state torn"
        for group, group_outcomes in zip(opt.param_groups, outcomes):
            group_params = [p.detach() for p in group["params"]]
            assert any(_equal(group_params, o) for o in group_outcomes), (
                f"line event {at}: params at neither the plain step nor the step's outcome"
            )
        for group, window, count, (plain_step, _) in zip(
            opt.param_groups, windows, counts, outcomes
        ):
            assert int(window.count) == count + 1, f"line event {at}: a step not recorded"
            group_params = [p.detach() for p in group["params"]]
            if how == "closure":  # the safeguard puts a kept mix in the window
                assert _equal(group_params, window.anchor), (
                    f"line event {at}: params are not the window's newest entry"
                )
            else:  # the plain step is the newest entry, the params at it or at the mix
                assert _equal(window.anchor, plain_step), (
                    f"line event {at}: the window's newest entry is not the plain step"
                )
            errors = state_gram_errors(window, "aadl")
            assert max(errors.values()) < 1e-12, f"line event {at}: Gram off the ring {errors}"
        for _ in range(2):  # and the run goes on
            assert torch.isfinite(opt.step(closure))
    assert seen["stepped"] > 0, seen


# Warm-up steps after which the deferred wrapper has a mix pending in both groups (every
# other step of this problem rejects the previous mix).
DEFERRED_WARM = 5


def _marks(opt):
    return [(int(w.count), int(w.num_rejected)) for w in opt.anderson_states]


@pytest.mark.parametrize("verdict", ["kept", "rejected", "mixed"])
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.usefixtures("default_sigint")
def test_wrapper_deferred_step_ends_consistent_whatever_is_raised_in_its_code(error, verdict):
    """``safeguard="deferred"``, a mix pending in both groups, ``step(loss=value)`` with a
    loss below it (kept: the torch optimizer steps both groups) or above it (rejected: it
    steps neither, and both go back to their previous plain step); mixed: both rejected and a
    third, younger group with no mix pending, which the torch optimizer steps (the rejected
    groups' grads hidden from it meanwhile). After a fault: nothing changed, or every group
    ended recorded, with its params at the uninterrupted step's or at its window's newest
    entry, the torch state stepped exactly where the mix was kept; the user's grads are as
    they were, and the run goes on."""
    from window_invariant import state_gram_errors

    late = 2 if verdict == "mixed" else 0
    model, opt, closure = _wrapped(warm=DEFERRED_WARM, safeguard="deferred", late=late)
    pending = [float(w.pending_loss) for w in opt.anderson_states]
    # a mix pending in each group (mixed: in the first two, none in the young one)
    assert all(p < float("inf") for p in pending[:2]), pending
    assert pending[2:] == ([float("inf")] if late else []), pending
    loss = min(pending) * 0.5 if verdict == "kept" else max(pending[:2]) * 2.0 + 1.0
    before = ([p.clone() for p in model.parameters()], _momenta(opt), _marks(opt))
    closure()  # the grads at the params, as the loop computes them with its loss
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    reference_model, reference, reference_closure = _wrapped(
        warm=DEFERRED_WARM, safeguard="deferred", late=late
    )
    reference_closure()
    reference.step(loss=loss)
    stepped, recorded = _momenta(reference), _marks(reference)
    finals = [[p.detach().clone() for p in g["params"]] for g in reference.param_groups]
    assert recorded != before[2]
    del reference_model
    counter = LineFaults(_in_package)
    counter.run(lambda: opt.step(loss=loss))
    lines = counter.count
    stride = int(os.environ.get("AADL_FAULT_STRIDE", "0")) or max(1, lines // SAMPLES)
    seen = {"before": 0, "recorded": 0}
    for at in range(ERRORS.index(error) * stride // len(ERRORS), lines, stride):
        model, opt, closure = _wrapped(warm=DEFERRED_WARM, safeguard="deferred", late=late)
        closure()
        LineFaults(_in_package, error, at).run(lambda: opt.step(loss=loss))  # noqa: B023
        assert_ctrl_c_works()
        kept = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None for g in kept), f"line event {at}: a grad lost"
        assert _equal(kept, grads), f"line event {at}: the grads changed"
        params = [p.detach() for p in model.parameters()]
        if _marks(opt) == before[2]:
            seen["before"] += 1
            assert _equal(params, before[0]), f"line event {at}: params moved, windows did not"
            assert _equal(_momenta(opt), before[1]), f"line event {at}: torch stepped"
            continue
        seen["recorded"] += 1
        assert _marks(opt) == recorded, f"line event {at}: {_marks(opt)} != {recorded}"
        assert _equal(_momenta(opt), stepped), f"line event {at}: torch's state torn"
        for group, window, final in zip(opt.param_groups, opt.anderson_states, finals):
            # The uninterrupted step's params (a kept mix's new mix is not in the window in
            # the deferred mode), or the window's newest entry (a plain or reverted step).
            group_params = [p.detach() for p in group["params"]]
            assert _equal(group_params, final) or _equal(group_params, window.anchor), (
                f"line event {at}: params are neither the step's nor the window's newest entry"
            )
            errors = state_gram_errors(window, "aadl")
            assert max(errors.values()) < 1e-12, f"line event {at}: Gram off the ring {errors}"
        for _ in range(2):  # and the run goes on
            assert torch.isfinite(opt.step(closure))
    assert seen["recorded"] > 0, seen


# -- what a call leaves in the process: grad mode, the SIGINT handler ------------------------
# Every line event of the frames that set them and put them back (the sample above may miss
# the few that matter: the line event CPython emits for a ``with`` statement's line as its
# block ends, before ``__exit__``, where an exception skips ``__exit__``).
FRAMES = {
    "anderson.py": ("init", "update", "step", "call_guarded", "_without_graph"),
    "grad_mode.py": ("kept",),
    "atomic.py": ("__enter__", "__exit__", "release", "guarded"),
    "wrapper.py": ("step", "_step_without_grad"),
    # The user's closure, run interruptible inside the step (`wrapper_loss.interruptible`).
    "wrapper_loss.py": ("run",),
}


def _sets_process_state(code) -> bool:
    return code.co_filename.startswith(PACKAGE) and code.co_name in FRAMES.get(
        Path(code.co_filename).name, ()
    )


def _every_line_event(run, traced=_sets_process_state):
    """Line events of ``run(faults)`` in the frames ``traced`` selects, counted once without
    a fault."""
    counter = LineFaults(traced)
    run(counter)
    assert counter.count > 0, counter.count
    return range(counter.count)


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("name", ["aadl-safeguard", "classic-deferred-reverted"])
@pytest.mark.usefixtures("default_sigint")
def test_update_leaves_grad_mode_and_sigint_as_they_were_whatever_is_raised(name, error):
    setup = Setup(name)
    for at in _every_line_event(lambda faults: _run_traced(setup, faults)):
        faults = LineFaults(_sets_process_state, error, at)
        result = _run_traced(setup, faults)
        assert faults.fired
        assert setup.outcome(result) is not None, f"line event {at}: a torn state"
        assert_ctrl_c_works()


def _wrapper_or_guard(code) -> bool:
    """The wrapper's ``step`` and the guard's frames (the core's are covered above)."""
    name = Path(code.co_filename).name
    wrapper = ("wrapper.py", "wrapper_loss.py")
    return _sets_process_state(code) and name in (*wrapper, "atomic.py", "grad_mode.py")


@pytest.mark.usefixtures("default_sigint")
def test_wrapper_step_leaves_grad_mode_and_sigint_as_they_were_whatever_is_raised():
    # Three warm-up steps: the faulted step is the first to mix (each trial rebuilds it).
    _, opt, closure = _wrapped(warm=3)
    run = lambda faults: faults.run(lambda: opt.step(closure))  # noqa: E731
    for at in _every_line_event(run, _wrapper_or_guard):
        _, opt, closure = _wrapped(warm=3)
        faults = LineFaults(_wrapper_or_guard, RuntimeError, at)
        faults.run(lambda: opt.step(closure))  # noqa: B023
        assert faults.fired
        assert_ctrl_c_works()


def _in_files(*names: str):
    """Every frame of the package's files ``names``."""
    return lambda code: (
        code.co_filename.startswith(PACKAGE) and Path(code.co_filename).name in (names)
    )


def assert_grad_mode_kept(run, traced) -> None:
    """``run(faults)`` with a ``RuntimeError`` injected at each line event of the frames
    ``traced`` selects in turn: afterwards grad mode is on every time."""
    for at in _every_line_event(run, traced):
        faults = LineFaults(traced, RuntimeError, at)
        run(faults)
        assert faults.fired
        assert torch.is_grad_enabled(), f"line event {at}: grad mode left disabled"


def test_rna_averager_leaves_grad_mode_as_it_was_whatever_is_raised():
    # The averager copies candidates into the module (and back, and BatchNorm statistics) with
    # autograd off: a fault at any line of rna.py or grad_mode.py leaves grad mode on.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    data = torch.randn(8, 3)
    averager = aa.RNAAverager(net, history_depth=3)
    for _ in range(4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * torch.randn_like(p))
        averager.snapshot()

    def held_out():
        with torch.no_grad():
            return net(data).square().mean()

    run = lambda faults: faults.run(  # noqa: E731
        lambda: averager.extrapolate(held_out, load=False, bn_loader=[data])
    )
    traced = _in_files("rna.py", "grad_mode.py")
    assert_grad_mode_kept(run, traced)


def test_solver_leaves_grad_mode_as_it_was_whatever_is_raised():
    # The solver iterates with autograd off: a fault at any line of its entry point (the
    # loop's own frames excepted: they run inside it) leaves grad mode on.
    x0 = torch.zeros(3, dtype=torch.float64)
    g = lambda x: torch.cos(x) / 2  # noqa: E731
    run = lambda faults: faults.run(lambda: aa.fixed_point(g, x0, max_iter=3))  # noqa: E731
    entry = ("_solve", "iterate", "<lambda>")

    def traced(code) -> bool:
        in_solver = _in_files("solver.py")(code) and code.co_name in entry
        return in_solver or _in_files("grad_mode.py")(code)

    assert_grad_mode_kept(run, traced)


def test_init_leaves_grad_mode_as_it_was_whatever_is_raised():
    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    params = {"w": torch.ones(3)}
    assert_grad_mode_kept(lambda faults: faults.run(lambda: opt.init(params)), _sets_process_state)

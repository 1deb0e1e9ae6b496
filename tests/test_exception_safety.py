"""Exception safety of ``update`` and ``AcceleratedOptimizer.step``, and ``skip_nonfinite``.

The guarantee (docs/reliability.md, section "Interrupted steps"): an exception from
``loss_fn`` / the closure (or Ctrl-C) during an in-place step leaves the params and the state
the caller holds exactly as after the plain step of that call; a pure step leaves its inputs
as they were. The references are independent of the exception path: a clean run in which the
interrupted safeguard call returns NaN instead (a NaN loss always rejects the mix, whichever
side it is on), so its state differs only in ``num_rejected``; and for the wrapper, a plain
``torch.optim`` step taken by a copy of the optimizer.
"""

from __future__ import annotations

import copy
import signal

import optree
import pytest
import torch

import aadl_func as aa

STEPS = 9


def _problem(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(40, 4, generator=gen, dtype=dtype)
    target = torch.randn(40, 2, generator=gen, dtype=dtype)
    params = {
        "w": 0.3 * torch.randn(4, 6, generator=gen, dtype=dtype),
        "v": 0.3 * torch.randn(6, 2, generator=gen, dtype=dtype),
    }

    def loss(p):
        return ((torch.tanh(data @ p["w"]) @ p["v"] - target) ** 2).mean()

    return params, loss


CONFIGS = [
    pytest.param({"mode": "aadl", "relaxation": 0.5}, id="aadl"),
    pytest.param({"mode": "aadl", "average": True, "average_tol": 0.05}, id="aadl-average"),
    pytest.param({"mode": "classic"}, id="classic"),
]


def _make(options):
    return aa.anderson(aa.sgd(0.3, momentum=0.5), history_depth=4, **options)


class Faulty:
    """``loss_fn`` whose call number ``at`` (0-based, over the whole run) raises ``error`` or,
    with ``error=None``, returns NaN."""

    def __init__(self, loss, at=None, error=None):
        self.loss, self.at, self.error, self.calls = loss, at, error, 0

    def __call__(self, p):
        index, self.calls = self.calls, self.calls + 1
        if index == self.at:
            if self.error is not None:
                raise self.error("injected")
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.loss(p)


def _clone(tree):
    return optree.tree_map(lambda t: t.clone(), tree)


def _leaves(tree):
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _assert_bitwise(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def _without_rejections(state):
    return state._replace(num_rejected=torch.zeros((), dtype=torch.int64))


def _count_safeguard_calls(options):
    opt = _make(options)
    params, loss = _problem()
    counter = Faulty(loss)
    state = opt.init(params)
    for _ in range(STEPS):
        params, state = opt.update(state, params, torch.func.grad(loss)(params), loss_fn=counter)
    return counter.calls


def _run(options, loss_fn, *, inplace, steps=STEPS, start=None):
    """Runs ``steps`` calls; returns per-call snapshots and the live (params, state)."""
    opt = _make(options)
    params, loss = _problem()
    state = opt.init(params) if start is None else start[1]
    params = params if start is None else start[0]
    history = []
    for _ in range(steps):
        grads = torch.func.grad(loss)(params)
        params, state = opt.update(state, params, grads, inplace=inplace, loss_fn=loss_fn)
        history.append(_clone((params, state)))
    return history, (params, state)


@pytest.mark.parametrize("options", CONFIGS)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_in_place_step_interrupted_by_loss_fn_is_a_plain_step(options, error):
    """At every loss_fn call of a run: the interrupted in-place call leaves params and state
    as the clean run whose safeguard rejected that mix (NaN loss), but for num_rejected; the
    run then continues bit for bit like the clean one."""
    calls = _count_safeguard_calls(options)
    assert calls >= 6  # the run does mix under the safeguard
    opt = _make(options)
    for at in range(calls):
        _, loss = _problem()
        faulty = Faulty(loss, at, error)
        params, _ = _problem()
        state = opt.init(params)
        failed_at = None
        history = []
        for k in range(STEPS):
            grads = torch.func.grad(loss)(params)
            try:
                params, state = opt.update(state, params, grads, inplace=True, loss_fn=faulty)
            except error:
                failed_at = k  # params and state are the caller's objects, written in place
            history.append(_clone((params, state)))
        assert failed_at is not None
        reference, _ = _run(options, Faulty(loss, at), inplace=True)
        for k, ((p, s), (p_ref, s_ref)) in enumerate(zip(history, reference)):
            _assert_bitwise(p, p_ref)
            _assert_bitwise(_without_rejections(s), _without_rejections(s_ref))
            # The interrupted mix is dropped uncounted; the clean run counts a rejection.
            assert int(s.num_rejected) == int(s_ref.num_rejected) - (k >= failed_at)


@pytest.mark.parametrize("options", CONFIGS)
def test_pure_step_interrupted_by_loss_fn_changes_nothing(options):
    calls = _count_safeguard_calls(options)
    opt = _make(options)
    for at in range(0, calls, 3):
        _, loss = _problem()
        faulty = Faulty(loss, at, KeyboardInterrupt)
        params, _ = _problem()
        state = opt.init(params)
        for _ in range(STEPS):
            before = _clone((params, state))
            grads = torch.func.grad(loss)(params)
            try:
                params, state = opt.update(state, params, grads, loss_fn=faulty)
            except KeyboardInterrupt:
                _assert_bitwise((params, state), before)
                break
        else:
            pytest.fail("the injected error was not raised")


class SignalingSgd:
    """aa.sgd whose update on call ``at`` delivers a real SIGINT (Ctrl-C) mid-step."""

    def __init__(self, at):
        self.inner, self.at, self.calls = aa.sgd(0.3, momentum=0.5), at, 0

    def init(self, params):
        return self.inner.init(params)

    def update(self, updates, state, params=None, inplace=False):
        self.calls += 1
        if self.calls == self.at:
            signal.raise_signal(signal.SIGINT)
        return self.inner.update(updates, state, params=params, inplace=inplace)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test. A process started in the background by a
    non-interactive shell inherits SIGINT ignored, and then Python installs no handler, so the
    guard (active only over the default handler) stands aside and a raised SIGINT does
    nothing: the test would fail for the launcher's reason, not the package's."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_inside_the_step_is_deferred_to_a_consistent_point(mode):
    """A real SIGINT delivered while the in-place step writes its buffers is raised once the
    plain step is committed: the caller holds exactly the plain step of that call."""
    options = {"mode": mode}
    at = 6
    opt = aa.anderson(SignalingSgd(at), history_depth=4, **options)
    params, loss = _problem()
    state = opt.init(params)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(STEPS):
            grads = torch.func.grad(loss)(params)
            params, state = opt.update(state, params, grads, inplace=True, loss_fn=loss)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert int(state.count) == at
    # Reference: the clean run whose call ``at`` rejects its mix (both losses NaN).
    reference_opt = _make(options)
    ref_params, _ = _problem()
    ref_state = reference_opt.init(ref_params)
    for k in range(1, at + 1):
        grads = torch.func.grad(loss)(ref_params)
        loss_fn = (lambda p: torch.tensor(float("nan"))) if k == at else loss
        ref_params, ref_state = reference_opt.update(
            ref_state, ref_params, grads, inplace=True, loss_fn=loss_fn
        )
    _assert_bitwise(params, ref_params)
    _assert_bitwise(_without_rejections(state), _without_rejections(ref_state))


# -- skip_nonfinite --------------------------------------------------------------------------


def _grads_with_nan(loss, params, k, bad):
    grads = torch.func.grad(loss)(params)
    if k in bad:
        grads["w"] = grads["w"].clone()
        grads["w"][0, 0] = float("nan")
    return grads


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_skip_nonfinite_equals_the_run_without_that_step(mode, inplace, inner):
    """Calls with a NaN gradient are skipped: the run equals the run that never made them
    (params, window, inner state, counters), and they are counted."""
    make_inner = (lambda: aa.sgd(0.3, momentum=0.5)) if inner == "sgd" else (lambda: aa.adam(0.05))
    bad = {3, 4, 8}
    opt = aa.anderson(make_inner(), history_depth=4, mode=mode, skip_nonfinite=True)
    ref = aa.anderson(make_inner(), history_depth=4, mode=mode)
    params, loss = _problem()
    ref_params = _clone(params)
    state, ref_state = opt.init(params), ref.init(ref_params)
    for k in range(12):
        before = _clone((params, state))
        grads = _grads_with_nan(loss, params, k, bad)
        params, state = opt.update(state, params, grads, inplace=inplace, loss_fn=loss)
        if k in bad:
            _assert_bitwise(params, before[0])
            assert int(state.skip_streak) == int(before[1].skip_streak) + 1
            continue
        ref_grads = torch.func.grad(loss)(ref_params)
        ref_params, ref_state = ref.update(
            ref_state, ref_params, ref_grads, inplace=inplace, loss_fn=loss
        )
        _assert_bitwise(params, ref_params)
        counted = state._replace(
            num_skipped=torch.zeros((), dtype=torch.int64),
            skip_streak=torch.zeros((), dtype=torch.int64),
        )
        _assert_bitwise(counted, ref_state._replace(num_skipped=torch.zeros((), dtype=torch.int64)))
        assert int(state.skip_streak) == 0
    assert int(state.num_skipped) == len(bad)
    assert int(state.num_mixed) > 0


def test_skip_nonfinite_catches_an_overflowing_inner_update():
    """Finite grads whose float32 inner step overflows (|lr * g| > float32 max) are skipped."""
    opt = aa.anderson(aa.sgd(1e10), skip_nonfinite=True)
    params = {"x": torch.ones(3)}
    state = opt.init(params)
    grads = {"x": torch.tensor([1.0, 3e38, -1.0])}
    out, state = opt.update(state, params, grads, inplace=True)
    assert torch.equal(out["x"], torch.ones(3)) and int(state.num_skipped) == 1
    assert int(state.count) == 0 and int(state.inner_state.count) == 0


@pytest.mark.parametrize("inplace", [False, True])
def test_max_consecutive_skips_raises_and_changes_nothing(inplace):
    opt = aa.anderson(aa.adam(0.1), skip_nonfinite=True, max_consecutive_skips=2)
    params, loss = _problem()
    state = opt.init(params)
    params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=inplace)
    for _ in range(2):
        params, state = opt.update(state, params, _grads_with_nan(loss, params, 0, {0}))
    assert int(state.skip_streak) == 2
    before = _clone((params, state))
    with pytest.raises(FloatingPointError, match="max_consecutive_skips=2"):
        opt.update(state, params, _grads_with_nan(loss, params, 0, {0}), inplace=inplace)
    _assert_bitwise((params, state), before)
    # A finite step resets the streak, and skipping may resume.
    params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=inplace)
    assert int(state.skip_streak) == 0 and int(state.num_skipped) == 2


def test_skip_nonfinite_under_vmap_skips_only_the_bad_member():
    """An ensemble of 3: member 1 gets NaN grads at call 2; the others are unaffected and
    member 1 equals its own run without that call."""
    opt = aa.anderson(aa.sgd(0.3, momentum=0.5), history_depth=4, skip_nonfinite=True)
    ref = aa.anderson(aa.sgd(0.3, momentum=0.5), history_depth=4)
    _, loss = _problem()
    members = [optree.tree_map(lambda t, s=s: t * (1 + 0.1 * s), _problem()[0]) for s in range(3)]
    stacked = optree.tree_map(lambda *ts: torch.stack(ts), *members)
    state = torch.func.vmap(opt.init)(stacked)
    refs = [(m, ref.init(m)) for m in members]
    for k in range(6):
        grads = torch.func.vmap(torch.func.grad(loss))(stacked)
        if k == 2:
            grads["v"] = grads["v"].clone()
            grads["v"][1, 0, 0] = float("inf")
        stacked, state = torch.func.vmap(opt.update)(state, stacked, grads)
        for i, (p, s) in enumerate(refs):
            if not (k == 2 and i == 1):
                refs[i] = ref.update(s, p, torch.func.grad(loss)(p))
    for i, (p, _) in enumerate(refs):
        for key in p:
            # Batched and single reductions round differently (~1e-12 relative over the run,
            # amplified by the mixing); a skipped or unskipped member would differ by ~1e-2.
            torch.testing.assert_close(stacked[key][i], p[key], rtol=1e-9, atol=1e-11)
    assert state.num_skipped.tolist() == [0, 1, 0]


def test_skip_options_are_validated():
    with pytest.raises(TypeError, match="`skip_nonfinite` must be a bool"):
        aa.anderson(aa.sgd(0.1), skip_nonfinite=1)
    with pytest.raises(ValueError, match="`max_consecutive_skips` must be >= 0"):
        aa.anderson(aa.sgd(0.1), skip_nonfinite=True, max_consecutive_skips=-1)
    with pytest.raises(ValueError, match="`max_consecutive_skips` needs `skip_nonfinite=True`"):
        aa.anderson(aa.sgd(0.1), max_consecutive_skips=3)


# -- the torch.optim wrapper -----------------------------------------------------------------


def _model(seed=0):
    # float32: the wrapper's plain step reproduces torch's bit for bit (its displacement is
    # exact in float64), so the plain-step reference can be torch itself.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(40, 4, generator=gen, dtype=torch.float32), torch.randn(
        40, 2, generator=gen, dtype=torch.float32
    )


class Closure:
    """The usual closure (zero_grad, loss, backward), counting its calls over the run: call
    ``raise_at`` raises ``error``; calls in ``nan_at`` return NaN without a backward pass."""

    def __init__(self, model, optimizer, raise_at=None, error=None, nan_at=()):
        self.model, self.optimizer = model, optimizer
        self.raise_at, self.error, self.nan_at = raise_at, error, set(nan_at)
        self.calls = 0
        self.X, self.Y = _data()

    def __call__(self):
        index, self.calls = self.calls, self.calls + 1
        if index == self.raise_at:
            raise self.error("injected")
        if index in self.nan_at:
            return torch.tensor(float("nan"))
        self.optimizer.zero_grad()
        loss = ((self.model(self.X) - self.Y) ** 2).mean()
        loss.backward()
        return loss


def _wrapped(two_groups, average, seed=0):
    model = _model(seed)
    first, second = list(model[0].parameters()), list(model[2].parameters())
    groups = (
        [{"params": first}, {"params": second, "lr": 0.1}]
        if two_groups
        else [{"params": first + second}]
    )
    torch_opt = torch.optim.SGD(groups, lr=0.2, momentum=0.5)
    options = {"average": True, "average_tol": 0.05} if average else {"relaxation": 0.5}
    return model, aa.AcceleratedOptimizer(torch_opt, history_depth=4, **options)


def _snapshot(model, opt):
    return (
        _clone(dict(model.state_dict())),
        copy.deepcopy(opt.optimizer.state_dict()["state"]),
        _clone([w for w in opt.anderson_states if w is not None]),
    )


def _assert_same(a, b):
    _assert_bitwise(a[0], b[0])
    _assert_bitwise(a[1], b[1])
    wa, wb = a[2], b[2]
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        _assert_bitwise(_without_rejections(x), _without_rejections(y))


WRAPPER_CASES = [
    pytest.param(False, False, id="one-group"),
    pytest.param(False, True, id="one-group-average"),
    pytest.param(True, False, id="two-groups"),
]


def _wrapper_calls(two_groups, average):
    """Closure calls per step of a clean run (step index of each call)."""
    model, opt = _wrapped(two_groups, average)
    closure = Closure(model, opt)
    step_of = {}
    for k in range(STEPS):
        start = closure.calls
        opt.step(closure)
        step_of.update({i: k for i in range(start, closure.calls)})
    return step_of


@pytest.mark.parametrize("two_groups, average", WRAPPER_CASES)
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_wrapper_step_interrupted_by_the_closure(two_groups, average, error):
    """At every closure call: an error in the wrapped optimizer's own evaluation changes
    nothing; an error in the safeguard leaves the groups not yet decided at the plain torch
    step (params and torch optimizer state equal a copy that took a plain step) and the windows
    as the clean run whose remaining safeguard calls of that step return NaN (but for
    num_rejected); afterwards the run continues bit for bit like that clean run."""
    step_of = _wrapper_calls(two_groups, average)
    assert len(step_of) >= STEPS + 6  # the safeguard evaluated mixes
    first_call_of_step = {}
    for index, k in sorted(step_of.items()):
        first_call_of_step.setdefault(k, index)
    for at in range(len(step_of)):
        model, opt = _wrapped(two_groups, average)
        closure = Closure(model, opt, raise_at=at, error=error)
        snapshots, failed_at = [], None
        for k in range(STEPS):
            if k == step_of[at]:
                before = _snapshot(model, opt)
                plain_model, plain_opt = copy.deepcopy((model, opt.optimizer))
            try:
                opt.step(closure)
            except error:
                failed_at = k
                if at == first_call_of_step[k]:
                    _assert_same(_snapshot(model, opt), before)  # nothing changed
                else:
                    plain_opt.step(Closure(plain_model, plain_opt))
                    # The last group was still undecided: its params are the plain step.
                    for p, q in zip(
                        list(model.parameters())[-2:], list(plain_model.parameters())[-2:]
                    ):
                        assert torch.equal(p, q)
                    _assert_bitwise(
                        opt.optimizer.state_dict()["state"], plain_opt.state_dict()["state"]
                    )
            snapshots.append(_snapshot(model, opt))
        assert failed_at == step_of[at]
        if at == first_call_of_step[failed_at]:
            continue  # the caller would retry that step: no clean run to compare with
        ref_model, ref_opt = _wrapped(two_groups, average)
        rest_of_step = {i for i, k in step_of.items() if k == failed_at and i >= at}
        ref_closure = Closure(ref_model, ref_opt, nan_at=rest_of_step)
        for k in range(STEPS):
            ref_opt.step(ref_closure)
            _assert_same(snapshots[k], _snapshot(ref_model, ref_opt))


def test_wrapper_skip_nonfinite_leaves_model_and_optimizer_untouched():
    model, _ = _wrapped(False, False)
    torch_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = aa.AcceleratedOptimizer(
        torch_opt, history_depth=4, skip_nonfinite=True, max_consecutive_skips=1
    )
    closure = Closure(model, opt)
    for _ in range(4):
        opt.step(closure)
    before = _snapshot(model, opt)

    def nan_closure():
        loss = closure()
        next(model.parameters()).grad[0, 0] = float("nan")
        return loss

    opt.step(nan_closure)
    after = _snapshot(model, opt)
    _assert_bitwise(after[:2], before[:2])
    assert int(opt.anderson_states[0].num_skipped) == 1
    with pytest.raises(FloatingPointError, match="max_consecutive_skips=1"):
        opt.step(nan_closure)
    _assert_bitwise(_snapshot(model, opt)[:2], before[:2])
    opt.step(closure)
    assert int(opt.anderson_states[0].skip_streak) == 0

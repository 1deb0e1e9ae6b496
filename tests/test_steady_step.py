"""The steady in-place call (`aadl_func._src.exec.steady`) against the eager executor.

A steady call runs the executor's operations on a plan kept with the state: it must give the
executor's bits, params and every byte of the state, call by call; notice whatever wrote the
state between calls; leave the calls it does not fit to the executor (which checks them); and
end an exception raised inside it as the executor does.
"""

from __future__ import annotations

import optree
import pytest
import torch
from test_eager_executor import _bytes, _problem

import aadl_func as aa
from aadl_func._src import anderson as anderson_module
from aadl_func._src import native, native_blas
from aadl_func._src.core import weights
from aadl_func._src.exec import passes, plan, steady


def _counted(monkeypatch) -> list[int]:
    """Counts the calls the steady path takes (`[0]`) and the calls whose window was full
    and without a skip streak when they began (`[1]`, `plan.steady_window()`)."""
    taken, original = [0, 0], anderson_module.steady.run

    def counted(*args, **kwargs):
        options, state = args[0], args[1]
        taken[1] += isinstance(state, aa.AndersonState) and plan.steady_window(options, state)
        result = original(*args, **kwargs)
        taken[0] += result is not None
        return result

    monkeypatch.setattr(anderson_module.steady, "run", counted)
    return taken


def _count_calls(monkeypatch, original, *targets) -> list[int]:
    """Counts the calls of `original`, put in its place at each `(module, name)`."""
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    for module, name in targets:
        monkeypatch.setattr(module, name, counting)
    return calls


def _count_checks(monkeypatch) -> list[int]:
    """Counts the calls of `check_update_inputs`, by the executor and the steady path."""
    from aadl_func._src import checks

    targets = [(anderson_module, "check_update_inputs"), (steady, "check_update_inputs")]
    return _count_calls(monkeypatch, checks.check_update_inputs, *targets)


def _run(
    monkeypatch,
    options,
    make_inner,
    *,
    steady_on,
    steps=40,
    between=None,
    grads_at=None,
    deferred=False,
    states=None,
):
    """Every call's params and state bytes, with the steady path on or off (`deferred`:
    each call brings the loss at its params, `update(..., loss=value)`; `states`: a list
    the last state is appended to)."""
    if not steady_on:
        monkeypatch.setattr(anderson_module.steady, "run", lambda *a, **k: None)
    opt = aa.anderson(make_inner(), **options)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    grad = torch.func.grad(loss)
    history = []
    for k in range(steps):
        grads = grad(params) if grads_at is None else grads_at(k, params, grad)
        judge = {"loss": loss(params)} if deferred else {}
        out, state = opt.update(state, params, grads, inplace=True, **judge)
        assert all(out[n] is params[n] for n in params)  # in place: the tensors passed
        params = out
        history.append(_bytes((params, state)))
        if between is not None:
            params = between(k, params, state)
    monkeypatch.undo()
    if states is not None:
        states.append(state)
    return history


INNERS = {
    "adam": lambda: aa.adam(0.01),
    "sgd-momentum": lambda: aa.sgd(2e-3, 0.5),
    "sgd": lambda: aa.sgd(2e-3),  # no buffers: updated in place into the grads
}
CASES = [
    {},
    {"history_depth": 3},
    {"history_depth": 6, "relaxation": 0.5, "reg": 1e-6},
    {"wait_iterations": 7, "store_each_nth": 2, "frequency": 3},
    {"store_each_nth": 2, "history_depth": 4},  # calls that mix without storing
    {"store_each_nth": 3, "history_depth": 3, "relaxation": 0.5},
    {"history_depth": 20, "reg_relative": 1e-4},  # the recommended full-batch window
    {"reg_relative": 0.3, "reg": 1e-6, "store_each_nth": 2},
]


def _compare(monkeypatch, options, inner, **kwargs) -> tuple[int, int]:
    """The steady calls of a run with the steady path on and the calls that began with a full
    window, after checking every call's bytes against the executor's."""
    taken = _counted(monkeypatch)
    fast = _run(monkeypatch, options, INNERS[inner], steady_on=True, **kwargs)
    calls = tuple(taken)
    executor = _run(monkeypatch, options, INNERS[inner], steady_on=False, **kwargs)
    for k, (a, b) in enumerate(zip(fast, executor)):
        assert a == b, f"call {k + 1} differs"
    return calls


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("options", CASES, ids=[str(o) for o in CASES])
def test_steady_calls_give_the_executor_bits(monkeypatch, options, inner, mode):
    options = {"mode": mode, **options}
    calls, eligible = _compare(monkeypatch, options, inner)
    # Every call that begins with a full window is steady, whatever the trajectory (some of
    # these runs diverge, and where a non-finite Gram row restarts the window depends on the
    # CPU's rounding: on one machine a run had one full-window call fewer than on another).
    assert calls == eligible, (calls, eligible)
    # And most calls begin with one: every call from the first full window on, unless the
    # run restarted its window. Mode "aadl" fills q + 1 slots, "classic" q pairs.
    nth = options.get("store_each_nth", 1)
    full = nth * (options.get("history_depth", 10) + 1)  # calls to fill the window, about
    assert eligible >= (40 - full) // 2, eligible


def _transposed_steps(lr: float) -> aa.InnerOptimizer:
    """Gradient descent whose updates of a matrix are laid out column by column (not
    contiguous): the append's pass cannot read them as its plain step."""

    def update(updates, state, params=None, inplace=False):
        scaled = {k: -lr * (u.t().contiguous().t() if u.dim() == 2 else u)
                  for k, u in updates.items()}  # fmt: skip
        return scaled, state

    return aa.InnerOptimizer(init=lambda params: (), update=update)


def _negative_view_steps(lr: float) -> aa.InnerOptimizer:
    """Gradient descent whose updates are negative views (`torch._neg_view`) of `lr * g`:
    their memory holds the opposite of their values."""

    def update(updates, state, params=None, inplace=False):
        return {k: torch._neg_view(lr * u) for k, u in updates.items()}, state

    return aa.InnerOptimizer(init=lambda params: (), update=update)


INNERS["transposed"] = lambda: _transposed_steps(2e-3)
INNERS["negative views"] = lambda: _negative_view_steps(2e-3)
# Plain SGD whose learning rate is a number at each call (a schedule's float), and one whose
# learning rate is a tensor (its update is not one known number: the grads are scaled first).
INNERS["sgd, schedule"] = lambda: aa.sgd(lambda count: 2e-3 / (1.0 + 0.1 * float(count)))
INNERS["sgd, tensor lr"] = lambda: aa.sgd(torch.tensor(2e-3, dtype=torch.float64))
_SCHEDULED = {2e-3 / (1.0 + 0.1 * k) for k in range(40)}


@pytest.mark.parametrize(
    "inner, joined, scale",
    [
        ("sgd", True, {-2e-3}),  # its update formed in the append: the grads times -lr
        ("sgd, schedule", True, {-lr for lr in _SCHEDULED}),
        ("sgd, tensor lr", True, {1.0}),
        ("adam", True, {1.0}),
        ("transposed", False, {1.0}),
        ("negative views", False, {1.0}),
    ],
)
def test_the_plain_step_joins_the_append_where_the_updates_allow(monkeypatch, inner, joined, scale):
    """Mode "aadl": `y = x + u` is the append's pass where the updates are contiguous
    float32 tensors of their own (the built-ins' are); others are added first, as before.
    Plain SGD with a learning rate that is a number passes its grads and `-lr` (the append
    forms `u`). Either way every call gives the executor's bytes."""
    with_steps, scales, original = [], set(), native.LeafRows.append

    def spied(self, slot, newest, steps=(), scale=1.0):
        with_steps.append(bool(steps))
        scales.add(scale)
        return original(self, slot, newest, steps, scale)

    monkeypatch.setattr(native.LeafRows, "append", spied)
    calls, eligible = _compare(monkeypatch, {"history_depth": 4}, inner)
    assert calls == eligible >= 25
    assert len(with_steps) == calls and set(with_steps) == {joined}
    assert scales <= scale and len(scales) == min(len(scale), calls)


@pytest.mark.parametrize("store_each_nth", [1, 2])
def test_plain_sgd_in_the_append_only_reads_the_grads(monkeypatch, store_each_nth):
    """A steady call that forms plain SGD's update in its append leaves the grads as they
    were passed (the in-place `update` may overwrite them: its inner update scales them
    first); a call off `store_each_nth`, which takes its plain step without the append,
    scales them as before."""
    opt = aa.anderson(aa.sgd(1e-2), history_depth=3, store_each_nth=store_each_nth)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    taken, read_only, written = _counted(monkeypatch), 0, 0
    for _ in range(20):
        grads = torch.func.grad(loss)(params)
        passed, steady_calls = {k: v.clone() for k, v in grads.items()}, taken[0]
        params, state = opt.update(state, params, grads, inplace=True)
        if taken[0] > steady_calls:
            same = all(torch.equal(grads[k], passed[k]) for k in grads)
            read_only, written = read_only + same, written + (not same)
    assert read_only >= 20 // store_each_nth - 8
    if store_each_nth == 1:
        assert written == 0
    else:  # every other steady call stores
        assert abs(written - read_only) <= 1


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_params_that_are_negative_views_are_taken_at_their_values(mode):
    """A param that is a negative view (`torch._neg_view`, e.g. the imaginary part of a
    conjugate view), whose memory holds the opposite of its values, steps as a plain tensor
    of those values: the native kernels, which read memory, decline it (from the first call,
    and when such a tensor replaces a planned one)."""
    opt = aa.anderson(aa.sgd(0.1), history_depth=3, mode=mode)

    def run(negative_from):
        generator = torch.Generator().manual_seed(1)
        params = [torch.randn(64, generator=generator)]
        state = opt.init(params)
        for k in range(12):
            if k == negative_from:
                params = [torch._neg_view(-params[0])]
                assert params[0].is_neg()
            grads = [torch.randn(64, generator=generator)]
            params, state = opt.update(state, params, grads, inplace=True)
        return params[0].clone()  # (the values, resolved)

    plain = run(None)
    assert torch.equal(run(0), plain) and torch.equal(run(8), plain)


@pytest.mark.parametrize("n", [1000, 2**18])  # a window mixed by `native_blas.Mixer`; addmv_
def test_a_mix_that_overflows_is_caught_though_its_bound_is_not_read(monkeypatch, n):
    """Mode "aadl" skips the finiteness pass where the window's maxima bound the mix
    (`LeafRows.mix_bounded()`, in the mixer's native call the same test); where they do
    not, the pass runs: weights that make the mix overflow leave the plain step in the
    params and count a non-finite mix."""
    mixed_natively = n == 1000
    opt = aa.anderson(aa.sgd(1e-2), history_depth=3)
    generator = torch.Generator().manual_seed(n)
    params = [torch.randn(n, generator=generator)]
    state = opt.init(params)
    bounded, original = [], native.LeafRows.mix_bounded

    def spied(self, weights):
        bounded.append(original(self, weights))
        return bounded[-1]

    monkeypatch.setattr(native.LeafRows, "mix_bounded", spied)
    for _ in range(12):
        grads = [1e4 * torch.randn(n, generator=generator)]
        params, state = opt.update(state, params, grads, inplace=True)
    # The maxima known from the plan's first call (read from the window): no pass.
    assert bounded == [] if mixed_natively else all(bounded)
    solve = native_blas.Solver.weights

    def huge(self, *args):
        out = solve(self, *args)
        return None if out is None else out.fill_(1e37)  # x slot values of about 100: inf

    monkeypatch.setattr(native_blas.Solver, "weights", huge)
    taken = _counted(monkeypatch)
    nonfinite = int(state.num_nonfinite)
    plain = params[0] - 1e-2 * (grads := 1e4 * torch.randn(n, generator=generator))
    params, state = opt.update(state, params, [grads], inplace=True)
    assert taken[0] == 1 and (mixed_natively or bounded[-1] is False)
    assert int(state.num_nonfinite) == nonfinite + 1
    assert torch.equal(params[0], plain)  # y = x + u, not the mix


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_a_write_between_calls_is_noticed(monkeypatch, mode):
    """The caller writes the state between calls (the Grams, a counter, the anchor, the inner
    optimizer's buffers and count): the next call reads the tensors again, as the executor
    does (a plan kept across such a write would solve the wrong problem, or step Adam with
    stale moments or bias corrections)."""

    def between(k, params, state):
        if k == 20:
            state.gram.mul_(2.0)
        if k == 22:
            state.inner_state.exp_avg["w"].mul_(0.5)
        if k == 25:
            state.num_mixed.zero_()
        if k == 27:
            state.inner_state.count.add_(3)
        if k == 30:
            state.anchor["w"].add_(1e-3)
        return params

    calls, _ = _compare(monkeypatch, {"mode": mode, "history_depth": 5}, "adam", between=between)
    assert calls >= 25


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_a_window_not_laid_out_as_init_lays_it_out_goes_the_checked_way(monkeypatch, mode):
    """A state whose ring slots are separate tensors (not rows of one buffer, as `init` lays
    them out: a state rebuilt slot by slot) makes no plan: its calls take the executor's
    path, with its bytes, and nothing fails while the plan is tried."""
    opt = aa.anderson(aa.adam(0.01), history_depth=3, mode=mode)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    grad = torch.func.grad(loss)
    for _ in range(8):  # a full window
        params, state = opt.update(state, params, grad(params), inplace=True)

    def separate(ring):
        return tuple({n: t.clone() for n, t in slot.items()} for slot in ring)

    state = state._replace(residuals=separate(state.residuals), iterates=separate(state.iterates))
    taken = _counted(monkeypatch)
    steady_state = state
    executor_state = optree.tree_map(torch.clone, state)
    fast_params, slow_params = params, {n: p.clone() for n, p in params.items()}
    for _ in range(3):
        fast_params, steady_state = opt.update(
            steady_state, fast_params, grad(fast_params), inplace=True
        )
    assert taken[0] == 0
    monkeypatch.setattr(anderson_module.steady, "run", lambda *a, **k: None)
    for _ in range(3):
        slow_params, executor_state = opt.update(
            executor_state, slow_params, grad(slow_params), inplace=True
        )
    assert _bytes((fast_params, steady_state)) == _bytes((slow_params, executor_state))


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_new_params_tensors_and_a_poisoned_append(monkeypatch, mode):
    """New params tensors (a copy of the params dict's leaves) take the executor's call, then
    a plan of their own; an Inf gradient (a non-finite Gram row) restarts the window in the
    steady call as in the executor."""

    def between(k, params, state):
        return {n: p.clone() for n, p in params.items()} if k == 15 else params

    def grads_at(k, params, grad):
        grads = grad(params)
        return {**grads, "b": torch.full_like(grads["b"], float("inf"))} if k == 30 else grads

    options = {"mode": mode, "history_depth": 4}
    calls, _ = _compare(monkeypatch, options, "sgd", between=between, grads_at=grads_at)
    assert calls >= 15


def test_grads_the_steady_call_does_not_fit_go_the_checked_way(monkeypatch):
    """Grads in a params leaf's memory, or of another dtype: the steady call declines (no
    write) and the checked path raises or casts as it always did."""
    opt = aa.anderson(aa.adam(0.01), history_depth=3)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    for _ in range(6):
        params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    taken = _counted(monkeypatch)
    params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    assert taken[0] == 1
    before = _bytes((params, state))
    with pytest.raises(ValueError, match="shares memory with"):
        opt.update(state, params, {"w": params["w"], "b": params["b"] * 0}, inplace=True)
    assert _bytes((params, state)) == before
    grads = {k: v.double() for k, v in torch.func.grad(loss)(params).items()}
    opt.update(state, params, grads, inplace=True)  # cast, by the executor
    assert taken[0] == 1


# Where a fault is injected (the function raises once, in call 15; the steady call and the
# executor call the same one): after the commit point, during the mix, before the commit point
# (the window written, not yet committed: the plain step with the window restarted).
FAULTS = {
    "solve": lambda: [
        (plan, "known_gamma"),  # the steady call's, without the direct LAPACK calls
        (native_blas.Solver, "gamma_of"),  # ... with them, and a relative ridge
        (native_blas.Solver, "weights"),  # ... with them, in one native call
        (weights, "solve_known"),  # the executor's
    ],
    "mix": lambda: [
        (passes, "finite"),
        (native.LeafRows, "finite"),
        (native.LeafRows, "mix_bounded"),
        (native_blas.Mixer, "mix"),
    ],
    # Before the append's pass (the steady call's has the plain step in it: the kernel's
    # mark then says not done) ...
    "before the append": lambda: [(native.LeafRows, "append"), (native, "append_differences")],
    # ... and after it (done).
    "append": lambda: [(native.LeafRows, "known_rows"), (passes, "known_rows")],
}


@pytest.mark.parametrize("inner", ["adam", "sgd"])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("where", list(FAULTS))
def test_an_exception_inside_ends_as_in_the_executor(monkeypatch, where, error, mode, inner):
    """An exception raised inside a steady call leaves the caller what the executor leaves
    (the same bytes), and the runs go on alike. (Plain SGD: mode "aadl"'s append forms its
    update from the grads, which `_recover()` forms again where the append did not run.)"""
    if where == "before the append" and mode == "classic":
        pytest.skip("mode 'classic' stores its pair by copies, not by the fused append")
    armed = [False]

    def failing(original):
        def fail_once(*args):
            if armed[0]:
                armed[0] = False
                raise error("injected")
            return original(*args)

        return fail_once

    def run(steady_on):
        taken = _counted(monkeypatch) if steady_on else [0]
        if not steady_on:
            monkeypatch.setattr(anderson_module.steady, "run", lambda *a, **k: None)
        for module, name in FAULTS[where]():
            monkeypatch.setattr(module, name, failing(getattr(module, name)))
        opt = aa.anderson(INNERS[inner](), history_depth=4, mode=mode)
        params, loss = _problem(torch.float32)
        state = opt.init(params)
        history, raised = [], 0
        for k in range(25):
            armed[0] = k == 15
            grads = torch.func.grad(loss)(params)
            try:
                params, state = opt.update(state, params, grads, inplace=True)
            except error:
                raised += 1
            history.append(_bytes((params, state)))
        monkeypatch.undo()
        assert raised == 1
        return history, taken[0]

    (fast, steady_calls), (executor, _) = run(True), run(False)
    assert steady_calls >= 15
    assert fast == executor


DEFERRED_CASES = [  # (options, the fewest steady calls of the 60, rejections expected)
    ({"history_depth": 20, "reg_relative": 1e-4}, 20, True),  # the recommended full-batch line
    ({"history_depth": 4, "relaxation": 1.5}, 50, True),  # rejections are steady reverts
    ({"history_depth": 3, "frequency": 2, "wait_iterations": 6}, 40, False),
    ({"history_depth": 4, "relaxation": 1.5, "restart_on_reject": True}, 0, True),  # general's
]


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("inner", ["adam", "sgd"])
@pytest.mark.parametrize("case", DEFERRED_CASES, ids=[str(c[0]) for c in DEFERRED_CASES])
def test_deferred_calls_give_the_executor_bits(monkeypatch, case, inner, mode):
    """The deferred safeguard (`loss=` on every call): a call whose verdict keeps the pending
    mix (or finds none) is a steady one, the bar cleared at its commit point and set to its
    loss when it returns a mix, and so is a rejection, which reverts to the previous plain
    step on the same plan (with `restart_on_reject` it is the general path's). Every call's
    bytes are the general path's and the executor's, over runs that keep and reject mixes."""
    options, fewest, rejections = case
    options = {"mode": mode, **options}
    taken, states = _counted(monkeypatch), []
    fast = _run(monkeypatch, options, INNERS[inner], steady_on=True, steps=60, deferred=True,
                states=states)  # fmt: skip
    calls = taken[0]
    executor = _run(monkeypatch, options, INNERS[inner], steady_on=False, steps=60, deferred=True)
    for k, (a, b) in enumerate(zip(fast, executor)):
        assert a == b, f"call {k + 1} differs"
    assert calls >= fewest, calls
    assert int(states[0].num_mixed) > 0
    assert int(states[0].num_rejected) > 0 or not rejections


@pytest.mark.parametrize("store_each_nth, safeguard", [(1, None), (2, None), (1, "deferred")])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_the_wrappers_steps_give_the_executor_bits(monkeypatch, mode, store_each_nth, safeguard):
    """`AcceleratedOptimizer` passes fresh copies of the params each call: steady calls take
    them (checked as the executor checks them), with the executor's bits for the model and
    the optimizer's state (`store_each_nth=2`: every other call off the store schedule;
    `safeguard="deferred"`: `step(loss=value)`, kept and reverted mixes)."""

    def run(steady_on):
        taken = _counted(monkeypatch) if steady_on else [0]
        if not steady_on:
            monkeypatch.setattr(anderson_module.steady, "run", lambda *a, **k: None)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        data, target = torch.randn(32, 8), torch.randn(32, 2)
        opt = aa.AcceleratedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.0, 0.999)),
            mode=mode,
            history_depth=4,
            store_each_nth=store_each_nth,
            **({} if safeguard is None else {"safeguard": safeguard}),
        )
        history = []
        for _ in range(40):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            opt.step(**({} if safeguard is None else {"loss": loss}))
            history.append(_bytes((list(model.parameters()), opt.state_dict())))
        monkeypatch.undo()
        return history, taken[0]

    (fast, steady_calls), (executor, _) = run(True), run(False)
    assert steady_calls >= 20
    assert fast == executor


def test_a_state_whose_calls_cannot_be_steady_is_not_checked_twice(monkeypatch):
    """Float64 params (the native kernel takes float32): past the first full window the
    steady path declines at once, so each call runs the checks once (the executor's), and
    turning the kernel off and on again takes it out of and back into the steady path."""
    from aadl_func._src import native

    counted = _count_checks(monkeypatch)
    opt = aa.anderson(aa.adam(0.01), history_depth=3)
    params, loss = _problem(torch.float64)
    state = opt.init(params)
    for _ in range(10):
        params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    counted[0] = 0
    for _ in range(5):
        params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    assert counted[0] == 5
    taken = _counted(monkeypatch)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    previous = native.set_enabled(False)
    try:
        for _ in range(8):
            params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
        assert taken[0] == 0
    finally:
        native.set_enabled(previous)
    params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    assert taken[0] == 1


@pytest.mark.parametrize(
    "options, steady_calls, plans_made",
    [
        ({"frequency": 5}, 20, 0),  # calls that only store are steady: one plan serves all
        ({"frequency": 3, "wait_iterations": 30}, 20, 0),  # storing while waiting, then mixing
        ({"store_each_nth": 2, "frequency": 2}, 20, 0),  # calls that neither store nor mix
        ({"store_each_nth": 2}, 20, 0),  # calls that mix the window without storing
        ({"store_each_nth": 3, "mode": "classic"}, 20, 0),
    ],
)
def test_calls_off_the_gates_are_steady_on_one_plan(monkeypatch, options, steady_calls, plans_made):
    """A call that stores without mixing (off the `frequency`, or within `wait_iterations`),
    or that does not store (off `store_each_nth`: it commits its plain step and mixes the
    window as it is) is a steady one, on the same plan. Each call's inputs are checked at
    most once."""
    plans = _count_calls(monkeypatch, plan.new_plan, (plan, "new_plan"))
    checked = _count_checks(monkeypatch)
    taken = _counted(monkeypatch)
    opt = aa.anderson(aa.adam(0.01), history_depth=3, **options)
    params, loss = _problem(torch.float32)
    state = opt.init(params)
    for _ in range(20):  # the window full
        params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    plans[0] = checked[0] = taken[0] = 0
    mixed = int(state.num_mixed)
    for _ in range(20):
        params, state = opt.update(state, params, torch.func.grad(loss)(params), inplace=True)
    assert taken[0] == steady_calls
    assert plans[0] == plans_made
    assert checked[0] == (20 - steady_calls) + plans_made  # the executor's, and each plan's
    assert int(state.num_mixed) > mixed

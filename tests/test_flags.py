"""The eager fast paths of a step: decisions as shared constants, counters advanced in one
operation, finiteness from one reduction.

Each shortcut must give the tensor expression's value (checked against it, and under vmap,
where the shortcut is not taken), must never let a shared constant reach a state or a
caller, and must keep a steady-state eager step within its operation budget.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aadl_func as aa
from aadl_func._src import flags
from aadl_func._src.update_call import advance as _advance

BOOLS = [False, True]


def as_flag(value: bool, constant: bool) -> torch.Tensor:
    """The decision ``value`` as a shared constant or as a fresh tensor."""
    return flags.known(value) if constant else torch.tensor(value)


@pytest.mark.parametrize("a", BOOLS)
@pytest.mark.parametrize("b", BOOLS)
@pytest.mark.parametrize("constant_a", BOOLS)
@pytest.mark.parametrize("constant_b", BOOLS)
def test_logic_equals_the_tensor_operations(a, b, constant_a, constant_b):
    x, y = as_flag(a, constant_a), as_flag(b, constant_b)
    assert bool(flags.both(x, y)) == (a and b)
    assert bool(flags.either(x, y)) == (a or b)
    assert bool(flags.negate(x)) == (not a)
    assert flags.value(flags.both(x, y)) == (a and b)
    counter = torch.tensor(7)
    assert int(flags.add_if(counter, x)) == 7 + a
    # A known False adds nothing and is the counter itself (nothing to write back).
    if not a:
        assert flags.add_if(counter, x) is counter


def test_logic_on_batched_flags_matches_elementwise():
    a = torch.tensor([True, False, True, False])
    b = torch.tensor([True, True, False, False])
    for constant in (flags.TRUE, flags.FALSE):
        got = torch.vmap(lambda x, c=constant: flags.both(x, c))(a)
        assert torch.equal(got, a & constant)
        got = torch.vmap(lambda x, c=constant: flags.either(c, x))(a)
        assert torch.equal(got, a | constant)
    assert torch.equal(torch.vmap(flags.both)(a, b), a & b)
    assert torch.equal(torch.vmap(flags.negate)(a), ~a)


def test_settle_reads_eager_flags_and_keeps_batched_ones():
    assert flags.settle(torch.tensor(True)) is flags.TRUE
    assert flags.settle(torch.tensor(False)) is flags.FALSE
    batched = torch.vmap(lambda x: flags.settle(x > 0))(torch.tensor([1.0, -1.0]))
    assert batched.tolist() == [True, False]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "bad", [None, math.nan, math.inf, -math.inf], ids=["finite", "nan", "inf", "-inf"]
)
@pytest.mark.parametrize("position", [0, 5, 12])
def test_all_finite_matches_isfinite(dtype, bad, position):
    t = torch.linspace(-3.0, 3.0, 13, dtype=dtype)
    if bad is not None:
        t[position] = bad
    expected = bool(torch.isfinite(t).all())
    eager = flags.all_finite(t)
    assert eager is flags.known(expected)  # read eagerly: a constant
    assert flags.value(flags.all_finite(t, torch.device("cpu"))) is expected
    # Under vmap the shortcut is not taken: the tensor expression decides per member.
    members = torch.stack([t, torch.zeros_like(t)])
    batched = torch.vmap(flags.all_finite)(members)
    assert batched.tolist() == [expected, True]


def test_all_finite_of_an_empty_tensor_is_true():
    assert flags.all_finite(torch.empty(0)) is flags.TRUE


@pytest.mark.parametrize("value", [0, 1, 3, 4, 9])
@pytest.mark.parametrize(
    "options",
    [
        {"step": 1},
        {"step": 1, "modulo": 4},
        {"step": -1, "low": 0},
        {"step": 1, "high": 4},
        {"step": 1, "low": 2, "high": 5},
    ],
)
def test_advance_equals_the_tensor_chain(value, options):
    counter = torch.tensor(value)
    eager, known = _advance(counter, **options)
    # The same chain applied to a batch of one, where no value is read.
    batched = torch.vmap(lambda c: _advance(c, **options)[0])(counter.reshape(1))
    assert known == int(batched[0])
    assert eager.dtype == torch.int64 and eager.dim() == 0 and int(eager) == known


def public_and_state_tensors(mode: str, inplace: bool, **options):
    """Every tensor a few eager steps hand back: the params, the state, the weights."""
    torch.manual_seed(0)
    opt = aa.anderson(aa.sgd(0.1), history_depth=4, mode=mode, **options)
    params = {"w": torch.randn(6), "b": torch.randn(3)}
    state = opt.init(params)
    for _ in range(8):
        grads = {k: 0.5 * v + 0.01 for k, v in params.items()}
        params, state = opt.update(state, params, grads, inplace=inplace)
    leaves = [*params.values(), *torch.utils._pytree.tree_leaves(state)]
    gram = torch.eye(4, dtype=torch.float64) + 0.1
    weights = aa.solve_weights(gram, 4)
    return leaves + list(weights[:2]) + [weights.ok]


@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize("inplace", BOOLS)
@pytest.mark.parametrize("options", [{}, {"average": True}, {"restart_on_reject": True}])
def test_no_shared_constant_reaches_a_caller(mode, inplace, options):
    if options.get("average") and mode == "classic":
        pytest.skip("average is defined for mode 'aadl' only")
    constants = (flags.TRUE, flags.FALSE)
    for t in public_and_state_tensors(mode, inplace, **options):
        # A constant in a state would be overwritten by the next in-place commit.
        assert all(t is not c for c in constants)
    assert bool(flags.TRUE) and not bool(flags.FALSE)


def test_public_weights_can_be_written_without_touching_later_calls():
    gram = torch.eye(4, dtype=torch.float64) + 0.1
    first = aa.solve_weights(gram, 4)
    first.ok.fill_(False)
    assert bool(aa.solve_weights(gram, 4).ok)
    assert bool(flags.TRUE)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode, budget", [("aadl", 120), ("classic", 134)])
def test_steady_state_eager_step_stays_within_its_operation_budget(mode, budget):
    """A full window, in place, one leaf: the fixed per-call work of a small model's step.

    Wall-clock time is not asserted; the number of operations dispatched is what the eager
    shortcuts reduce (168 in mode "aadl" and 164 in mode "classic" before the last round of
    them, 104 and 116 after). The budget leaves ~15% for small changes, not for losing a
    group of shortcuts."""
    torch.manual_seed(0)
    opt = aa.anderson(aa.sgd(0.01), history_depth=5, relaxation=0.5, mode=mode)
    params = torch.randn(4096)
    state = opt.init(params)
    for _ in range(10):
        params, state = opt.update(state, params, 0.01 * params + 0.001, inplace=True)
    mixed = int(state.num_mixed)
    grads = 0.01 * params + 0.001
    with _CountOps() as counter:
        params, state = opt.update(state, params, grads, inplace=True)
    assert int(state.num_mixed) == mixed + 1  # the counted step mixed
    assert counter.count <= budget, counter.count

"""Memory of ``anderson``: what the state keeps and what a step allocates, measured on CPU.

* Storage: the bytes of the distinct storages behind the state's window tensors (views of
  one buffer count once), after the window is full: mode "aadl" keeps the newest entry plus
  ``history_depth - 1`` differences, at most ``history_depth + 1`` parameter-sized buffers;
  a bf16 history halves the differences.
* Temporaries: every CPU allocation and free during one steady-state step, recorded by
  ``torch.profiler`` (``profile_memory=True`` reports each allocator call with its size and
  time). The peak of the running sum is the step's high-water mark above what existed
  before it; the largest single allocation shows that nothing window-sized (a stack of the
  window, a float64 copy of it) is ever built.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import optree
import pytest
import torch

import aadl_func as aa
from aadl_func import sgd

N = 1 << 20  # the size: 4 MiB of float32 per parameter-sized buffer
DEPTH = 10  # history_depth = m


@pytest.fixture(autouse=True)
def one_thread():
    """Allocations do not depend on the thread count; one thread keeps these steps quick on
    a busy machine (many short parallel regions stall when the cores are oversubscribed)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load_benchmark():
    """``examples/benchmark.py`` as a module (``examples/`` is not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("aadl_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The benchmark's allocation tracker, so that the calibration below also vouches for the
# peaks the benchmark reports.
allocation_profile = load_benchmark().allocation_profile


def test_allocation_profile_sees_known_allocations():
    """Calibration: the tracker reports what a plain torch program allocates."""
    size = N * 4

    def program():
        a = torch.empty(N)
        b = torch.empty(2 * N)
        del a
        c = torch.empty(N)
        del b, c

    peak, total, largest = allocation_profile(program)
    assert peak == 3 * size
    assert total == 4 * size
    assert largest == 2 * size


def window_bytes(state: aa.AndersonState, fields=("anchor", "residuals", "iterates")) -> int:
    """Bytes of the distinct storages behind the given state fields."""
    storages = {}
    for name in fields:
        for leaf in optree.tree_leaves(getattr(state, name)):
            storage = leaf.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(opt, params, steps: int, inplace: bool):
    generator = torch.Generator().manual_seed(0)
    state = opt.init(params)
    for _ in range(steps):
        grads = optree.tree_map(
            lambda p: 1e-2 * torch.randn(p.shape, generator=generator, dtype=p.dtype), params
        )
        params, state = opt.update(state, params, grads, inplace=inplace)
    return params, state


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("history_dtype", [None, torch.bfloat16, torch.float16], ids=str)
def test_steady_state_window_storage(history_dtype, inplace):
    n = 1 << 12
    params = {"w": torch.zeros(n // 4, 4), "b": torch.zeros(n // 2)}
    numel = sum(p.numel() for p in params.values())
    opt = aa.anderson(sgd(0.1), history_depth=DEPTH, history_dtype=history_dtype)
    _, state = run(opt, params, 2 * DEPTH + 3, inplace)
    slot_size = torch.empty((), dtype=history_dtype or torch.float32).element_size()
    anchor = window_bytes(state, ("anchor",))
    ring = window_bytes(state, ("residuals",))
    assert anchor == numel * 4  # the newest entry keeps the params' dtype
    assert ring == (DEPTH - 1) * numel * slot_size
    assert anchor + ring <= (DEPTH + 1) * numel * slot_size
    assert window_bytes(state, ("iterates",)) == 0
    assert state.gram.numel() == (DEPTH - 1) ** 2


def test_bf16_history_halves_the_stored_differences():
    params = torch.zeros(1 << 12)
    states = {
        dtype: run(aa.anderson(sgd(0.1), history_dtype=dtype), params.clone(), 15, True)[1]
        for dtype in (None, torch.bfloat16)
    }
    full = window_bytes(states[None], ("residuals",))
    half = window_bytes(states[torch.bfloat16], ("residuals",))
    assert 2 * half == full
    assert states[torch.bfloat16].gram.dtype == torch.float64


@pytest.mark.parametrize("history_dtype", [None, torch.bfloat16], ids=str)
def test_inplace_step_allocates_at_most_six_parameter_sized_buffers(history_dtype):
    """n = 2^20, m = 10, float32 params, SGD inner optimizer, a step that mixes."""
    opt = aa.anderson(sgd(0.01), history_depth=DEPTH, relaxation=0.5, history_dtype=history_dtype)
    params, state = run(opt, torch.randn(N), 2 * DEPTH, inplace=True)
    grads = 1e-2 * torch.randn(N)
    before = int(state.num_mixed)
    result = {}

    def step():
        result["out"] = opt.update(state, params, grads, inplace=True)

    peak, total, largest = allocation_profile(step)
    assert int(result["out"][1].num_mixed) == before + 1  # the measured step did mix
    param_bytes = N * 4
    assert peak <= 6 * param_bytes, peak / param_bytes
    assert total <= 6 * param_bytes, total / param_bytes
    assert largest <= param_bytes, largest / param_bytes


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_wrapper_step_allocates_no_parameter_sized_buffer_in_mode_aadl(mode):
    """`AcceleratedOptimizer(SGD)` on one float32 param of n = 2^20, history 10, a step that
    mixes. Mode "aadl" runs the core on the stepped params themselves: not one
    parameter-sized buffer (SGD without momentum allocates none). Mode "classic" keeps the
    params before the torch step and the displacement in float64 (3), on top of the core's
    own in-place step (at most 6, above): 7 measured."""
    param = torch.nn.Parameter(torch.randn(N))
    opt = aa.AcceleratedOptimizer(
        torch.optim.SGD([param], lr=0.01), history_depth=DEPTH, relaxation=0.5, mode=mode
    )
    generator = torch.Generator().manual_seed(0)
    for _ in range(2 * DEPTH):
        param.grad = 1e-2 * torch.randn(N, generator=generator)
        opt.step()
    before = int(opt.anderson_states[0].num_mixed)
    param.grad = 1e-2 * torch.randn(N, generator=generator)
    peak, total, largest = allocation_profile(opt.step)
    assert int(opt.anderson_states[0].num_mixed) == before + 1  # the measured step did mix
    param_bytes = N * 4
    if mode == "aadl":
        assert total < param_bytes / 4, total / param_bytes
    else:
        assert 3 * param_bytes <= peak <= (3 + 6) * param_bytes, peak / param_bytes


def test_pure_step_copies_one_slot_not_the_window():
    """inplace=False may not mutate the state, so it allocates the new slot, the new anchor,
    the step and the mix -- a handful of parameter-sized buffers, never the window."""
    opt = aa.anderson(sgd(0.01), history_depth=DEPTH, relaxation=0.5)
    params, state = run(opt, torch.randn(N), 2 * DEPTH, inplace=False)
    grads = 1e-2 * torch.randn(N)
    peak, total, largest = allocation_profile(lambda: opt.update(state, params, grads))
    param_bytes = N * 4
    assert largest <= param_bytes
    assert total <= 8 * param_bytes < (DEPTH - 1) * param_bytes, total / param_bytes
    assert peak <= total


def test_benchmark_quick_configuration(tmp_path, capsys):
    """examples/benchmark.py --quick: the table's numbers come out and are self-consistent."""
    benchmark = load_benchmark()
    out = tmp_path / "bench.json"
    # torch.compile is left out here (test_compile.py covers it; compiling each row would
    # take most of this test's time).
    args = ["--quick", "--no-compile", "--ensemble", "3,10,4", "--out", str(out)]
    assert benchmark.main(args) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert all("compiled_ms" not in r for r in rows)
    point = result["ensemble"]
    assert (point["members"], point["log2_n"], point["m"]) == (3, 10, 4)
    for name in ("vmap", "loop_pure", "loop_inplace"):
        assert point[f"{name}_ms"] > 0
    assert [(r["log2_n"], r["m"]) for r in rows] == [(10, 3), (10, 5), (12, 3), (12, 5)]
    for r in rows:
        assert r["aadl_func_ms"] > 0 and r["bound_ms"] > 0 and r["aadl_style_ms"] > 0
        assert r["ratio_to_bound"] > 0  # the median of the step-by-step pairs' ratios
        # Both keep m parameter-sized float32 buffers (aadl_func: anchor + m - 1 differences).
        assert r["aadl_func_state_P"] == r["aadl_style_state_P"] == r["m"]
        assert r["aadl_style_step_peak_P"] > r["m"]  # the stacked window and DX/DR copies
    # The AADL-style step computes the same iteration (float32 lstsq vs float64 solve).
    assert result["agreement_relative_difference"] < 1e-4
    loop = [r for r in result["small_step"] if r["step"] == "AcceleratedOptimizer, in a loop"]
    assert len(loop) == 1 and loop[0]["against"] == "Adam, in a loop"
    assert loop[0]["ratio"] == pytest.approx(loop[0]["us"] / loop[0]["against_us"])
    assert "aadl_func" in capsys.readouterr().out


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="torch.compile of update needs 2.12+")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated")
def test_compiled_inplace_step_allocates_at_most_one_parameter_sized_buffer():
    """The benchmark's compiled step (inductor, in place, n = 2^18, m = 5): at most one
    parameter-sized buffer during a mixing step (a check of ``grads`` in ``update``'s own
    frame once cost a second one under torch 2.13)."""
    n, depth = 1 << 18, 5
    opt = aa.anderson(sgd(0.01), history_depth=depth)
    step = torch.compile(lambda s, p, g: opt.update(s, p, g, inplace=True), fullgraph=True)
    params, state = torch.randn(n), None
    state = opt.init(params)
    for _ in range(depth + 2):
        params, state = step(state, params, 1e-2 * torch.randn(n))
    grads = 1e-2 * torch.randn(n)
    before = int(state.num_mixed)
    result = {}

    def one():
        result["out"] = step(state, params, grads)

    peak, _, _ = allocation_profile(one)
    assert int(result["out"][1].num_mixed) == before + 1
    assert peak <= 1.25 * 4 * n, peak / (4 * n)

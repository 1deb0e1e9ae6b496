"""``torch.compile`` of ``update`` and of whole user steps (issue 15).

What is pinned down here, on the CPU:

* ``torch.compile(..., fullgraph=True)`` traces ``update`` in one graph (a graph break raises)
  for modes "aadl" and "classic", inner sgd (momentum, weight decay) / adam / adamw,
  ``average=True``, ``inplace`` True and False, float32/float64 params and a bf16 history;
* 50 compiled steps equal 50 eager steps to rounding (float64: 1e-9 relative; float32: the
  same decisions and 1e-4), with at most one recompilation;
* the traced graph holds no host synchronisation (no ``.cpu()``, ``.item()``, ``bool()``), and
  a compiled step on params on the ``meta`` device -- a stand-in accelerator without data, on
  which any device-to-host copy raises -- runs, its counters staying on that device;
* ``vmap`` composes with ``torch.compile`` (an ensemble step compiled in one graph);
* under ``vmap`` members that step together write their windows at one slot index: a step
  replaces one slot and keeps the other slots' buffers (O(n) writes per member).

Most checks compile with the ``aot_eager`` backend (dynamo + AOT autograd's functionalization,
without code generation), which is what decides graph breaks, guards and the semantics of
in-place writes, at a fraction of inductor's compile time; one test runs inductor itself on a
whole user step. The CUDA variant (``mode="reduce-overhead"``, CUDA graphs) is in
``test_gpu.py``-style at the end, skipped without CUDA.
"""

from __future__ import annotations

import copy
import dataclasses

import optree
import pytest
import torch
from torch.func import vmap

import aadl_func as aa

STEPS = 50

# Compiling ``update`` needs torch 2.12 (docs/compatibility.md): dynamo 2.8-2.9 cannot trace
# ``optree.tree_flatten``, and 2.11 fails inside dynamo on the step's NamedTuples. The eager
# tests of the in-place slot write below run on every release.
needs_compile = pytest.mark.skipif(
    torch.__version__ < (2, 12), reason="torch.compile of update needs torch 2.12+"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo's caches and its per-code-object state
    (automatic dynamic scalars, cache size limits) would otherwise carry over between
    parametrizations, which share the code objects of ``update``."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- problem -------------------------------------------------------------------------------
@dataclasses.dataclass
class Quadratic:
    """f(p) = 0.5 sum_leaf sum_i h_i (p_i - t_i)^2 over a dict of a matrix and a vector."""

    h: dict
    target: dict
    x0: dict

    def loss(self, params):
        total = 0.0
        for k in params:
            d = params[k] - self.target[k]
            total = total + 0.5 * (self.h[k] * d * d).sum()
        return total

    def grad(self, params):
        return {k: self.h[k] * (params[k] - self.target[k]) for k in params}


def quadratic(dtype: torch.dtype, seed: int = 0) -> Quadratic:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (6, 5), "b": (5,)}

    def draw(scale=1.0, shift=0.0):
        return {
            k: (scale * torch.rand(s, generator=g, dtype=torch.float64) + shift).to(dtype)
            for k, s in shapes.items()
        }

    return Quadratic(h=draw(2.0, 0.1), target=draw(2.0, -1.0), x0=draw(2.0, -1.0))


def clone(tree):
    return optree.tree_map(torch.clone, tree)


def rel(a, b) -> float:
    num = sum(float((x.double() - y.double()).norm() ** 2) for x, y in zip(a.values(), b.values()))
    den = sum(float(y.double().norm() ** 2) for y in b.values())
    return (num / max(den, 1e-300)) ** 0.5


# -- a backend that records what dynamo traced -------------------------------------------
class Recorder:
    """A torch.compile backend: records every FX graph dynamo hands over (one per compile,
    so ``len(graphs) - 1`` is the number of recompilations), then runs it as traced
    (``"eager"``), through AOT autograd's functionalization (``"aot_eager"``) or inductor."""

    def __init__(self, kind: str = "aot_eager") -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.kind = kind

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        if self.kind == "eager":
            return gm.forward
        if self.kind == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


# Method and function names that read a tensor's value on the host: on an accelerator each
# waits for the device (and a CUDA graph cannot contain them). ``.to(device)`` is not in the
# list: on a CPU run the compute device is the CPU, so it cannot tell a move to the host
# from a no-op; test_compiled_step_on_a_device_without_data covers that direction.
HOST_READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def host_reads(graphs) -> list[str]:
    found = []
    for gm in graphs:
        for node in gm.graph.nodes:
            target = node.target
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            if node.op in ("call_method", "call_function") and name in HOST_READS:
                found.append(f"{node.op} {name}: {node.meta.get('stack_trace', '')[-300:]}")
    return found


# -- compiled update == eager update -----------------------------------------------------
CASES = {
    "aadl-sgd-momentum-wd-inplace-safeguard": dict(
        dtype=torch.float64,
        inner=lambda: aa.sgd(0.2, momentum=0.5, weight_decay=1e-3),
        options={},
        inplace=True,
        safeguard=True,
    ),
    "aadl-adam-pure-safeguard": dict(
        dtype=torch.float64,
        inner=lambda: aa.adam(0.05, weight_decay=1e-3),
        options=dict(relaxation=0.7),
        inplace=False,
        safeguard=True,
    ),
    "aadl-adamw-average-inplace": dict(
        dtype=torch.float64,
        inner=lambda: aa.adamw(0.05),
        options=dict(average=True, average_tol=0.05),
        inplace=True,
        safeguard=False,
    ),
    "aadl-sgd-schedule-pure": dict(
        dtype=torch.float64,
        inner=lambda: aa.sgd(0.2),
        options=dict(store_each_nth=3, frequency=5, wait_iterations=3, skip_nonfinite=True),
        inplace=False,
        safeguard=False,
    ),
    "aadl-float32-bf16-history-inplace-safeguard": dict(
        dtype=torch.float32,
        inner=lambda: aa.sgd(0.2, momentum=0.3),
        options=dict(history_dtype=torch.bfloat16),
        inplace=True,
        safeguard=True,
    ),
    "classic-sgd-nesterov-inplace-safeguard-skip": dict(
        dtype=torch.float64,
        inner=lambda: aa.sgd(0.2, momentum=0.5, nesterov=True),
        options=dict(mode="classic", skip_nonfinite=True),
        inplace=True,
        safeguard=True,
        nan_at=(10, 11),  # calls whose grads hold a NaN: skipped, in place, under tracing
    ),
    "classic-adamw-float32-pure": dict(
        dtype=torch.float32,
        inner=lambda: aa.adamw(0.05, weight_decay=1e-2),
        options=dict(mode="classic", relaxation=0.5),
        inplace=False,
        safeguard=False,
    ),
}


@needs_compile
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_update_is_one_graph_and_equals_eager(case):
    spec = CASES[case]
    problem = quadratic(spec["dtype"])
    opt = aa.anderson(spec["inner"](), history_depth=5, **spec["options"])
    loss_fn = problem.loss if spec["safeguard"] else None

    def step(state, params, grads):
        return opt.update(state, params, grads, inplace=spec["inplace"], loss_fn=loss_fn)

    backend = Recorder()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_params, compiled_params = clone(problem.x0), clone(problem.x0)
    eager_state, compiled_state = opt.init(eager_params), opt.init(compiled_params)
    worst = 0.0

    def gradient(params, k):
        grads = problem.grad(params)
        if k in spec.get("nan_at", ()):
            grads["b"] = grads["b"].clone().index_fill_(0, torch.tensor([1]), float("nan"))
        return grads

    counters = ("count", "window_size", "num_mixed", "num_rejected", "num_averaged")
    for k in range(STEPS):
        grads = gradient(eager_params, k)
        # Every call is compared from the same state and params: a whole trajectory need
        # not be (without the safeguard some cases diverge, and there the two runs' float32
        # roundings, fused in another order, part within a few calls).
        inputs = (clone(eager_state), clone(eager_params), clone(grads))
        before = copy.deepcopy(inputs) if not spec["inplace"] and k < 8 else None
        params, state = compiled(*inputs)
        if before is not None:  # pure: the inputs are left as they were
            for x, y in zip(optree.tree_leaves(inputs), optree.tree_leaves(before)):
                assert torch.equal(x, y)
        eager_params, eager_state = step(eager_state, eager_params, grads)
        worst = max(worst, rel(params, eager_params))
        for name in (*counters, "num_skipped"):
            assert int(getattr(state, name)) == int(getattr(eager_state, name)), (k, name)
        # The compiled step also threads its own state from call to call.
        grads = gradient(compiled_params, k)
        compiled_params, compiled_state = compiled(compiled_state, compiled_params, grads)
    tolerance = 1e-9 if spec["dtype"] == torch.float64 else 1e-5
    assert worst < tolerance, f"compiled differs from eager by {worst:.1e}"
    assert int(compiled_state.count) == int(eager_state.count)  # skipped calls are not counted
    if spec["safeguard"]:
        assert 0 < int(eager_state.num_mixed) and 0 < int(eager_state.num_rejected)
    else:
        assert int(eager_state.num_mixed) > 0
    if spec["options"].get("average"):
        assert int(eager_state.num_averaged) > 0
    assert int(eager_state.num_skipped) == len(spec.get("nan_at", ()))
    # fullgraph=True already raised on any graph break; at most one recompilation.
    assert 1 <= len(backend.graphs) <= 2
    assert host_reads(backend.graphs) == []


# -- no device-to-host copy: params on a device without data ------------------------------
@needs_compile
def test_compiled_update_names_params_of_another_structure():
    """The structure check's message walks the two specs; under dynamo those are its Python
    analog of optree's spec, which has no `kind` (this raised AttributeError)."""
    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    state = opt.init({"a": torch.zeros(3), "b": torch.zeros(2)})
    compiled = torch.compile(lambda s, p, g: opt.update(s, p, g), backend="eager")
    with pytest.raises(ValueError, match=r"`params` is a dict with keys \['a'\] where"):
        compiled(state, {"a": torch.zeros(3)}, {"a": torch.zeros(3)})


@needs_compile
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_compiled_step_on_a_device_without_data(mode):
    """On the ``meta`` device every tensor is shape only: reading a value on the host (a
    ``.cpu()`` copy, ``.item()``, ``bool()``) raises. The eager step reads its flags there
    and fails; the compiled step runs, all decisions staying on the device with the params,
    and its counters move there too (no host copy of device data, as a GPU step needs for
    ``mode="reduce-overhead"``)."""
    meta = torch.device("meta")
    opt = aa.anderson(aa.adam(0.1), history_depth=4, mode=mode, skip_nonfinite=True)
    params = {"w": torch.zeros(6, 5, device=meta), "b": torch.zeros(5, device=meta)}

    def loss(p):
        return sum((v * v).sum() for v in p.values())

    def step(state, p):
        grads = {k: 2 * v for k, v in p.items()}
        return opt.update(state, p, grads, inplace=True, loss_fn=loss)

    state = opt.init(params)
    with pytest.raises(NotImplementedError, match="meta"):
        step(opt.init(params), params)
    compiled = torch.compile(step, fullgraph=True, backend=Recorder("eager"))
    for _ in range(4):
        params, state = compiled(state, params)
    assert params["w"].device == meta
    for name in ("count", "head", "window_size", "num_mixed", "num_rejected", "num_skipped"):
        assert getattr(state, name).device == meta, name


# -- vmap ---------------------------------------------------------------------------------
def ensemble(
    mode: str, dtype: torch.dtype = torch.float64, inplace: bool = False, safeguard: bool = True
):
    """Three members of the quadratic (scaled starts), the optimizer and a member's step."""
    problem = quadratic(dtype)
    scales = torch.tensor([1.0, 0.5, 2.0], dtype=dtype)
    stacked = {k: v[None] * scales.reshape(-1, *[1] * v.dim()) for k, v in problem.x0.items()}
    opt = aa.anderson(aa.sgd(0.2, momentum=0.3), history_depth=4, mode=mode)
    loss_fn = problem.loss if safeguard else None

    def step(state, params):
        return opt.update(state, params, problem.grad(params), loss_fn=loss_fn, inplace=inplace)

    return opt, step, stacked


@needs_compile
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace-copy_if"])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_vmapped_ensemble_compiles_and_equals_eager_vmap(mode, inplace, request):
    """``torch.compile(vmap(step))`` in one graph, equal to the eager vmapped steps. In place,
    every window write goes through ``copy_if_`` and its vmap rule (members sharing the slot
    index take one mask), functionalised by AOT autograd as the real compiler does."""
    if inplace:
        request.getfixturevalue("copy_if_everywhere")
    opt, step, stacked = ensemble(mode, inplace=inplace)
    backend = Recorder("aot_eager" if inplace else "eager")  # pure: nothing to functionalise
    compiled = torch.compile(vmap(step), fullgraph=True, backend=backend)
    eager_params, eager_state = clone(stacked), vmap(opt.init)(clone(stacked))
    params, state = clone(stacked), vmap(opt.init)(clone(stacked))
    worst = 0.0
    for _ in range(20):
        eager_params, eager_state = vmap(step)(eager_state, eager_params)
        params, state = compiled(state, params)
        worst = max(worst, rel(params, eager_params))
    assert worst < 1e-9
    assert torch.equal(state.num_mixed.cpu(), eager_state.num_mixed.cpu())
    assert int(eager_state.num_mixed.min()) > 0 and int(eager_state.num_rejected.max()) > 0
    assert 1 <= len(backend.graphs) <= 2 and host_reads(backend.graphs) == []
    assert (_calls(backend.graphs, "copy_if_") > 0) == inplace


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_vmapped_members_stepping_together_write_one_slot(mode):
    """The ring slot is a counter every member shares: vmap hands it back broadcast (stride
    0), the next call writes that one slot for all members, and the other slots of the
    returned state are the input's own buffers (O(n) per member, no blend of the window)."""
    opt, step, stacked = ensemble(mode)
    params, state = stacked, vmap(opt.init)(stacked)
    members = [clone({k: v[i] for k, v in stacked.items()}) for i in range(3)]
    expected = [(p, opt.init(p)) for p in members]  # each member run on its own
    for k in range(8):
        previous = state
        params, state = vmap(step)(state, params)
        expected = [step(s, p) for p, s in expected]
        assert state.head.stride() == (0,) and state.count.stride() == (0,)
        if k >= 1:
            rings = [(previous.residuals, state.residuals)]
            if mode == "classic":
                rings.append((previous.iterates, state.iterates))
            for before, after in rings:
                kept = [
                    all(x.data_ptr() == y.data_ptr() for x, y in zip(b.values(), a.values()))
                    for b, a in zip(before, after)
                ]
                assert kept.count(False) == 1, kept
    for i, (p, s) in enumerate(expected):
        assert rel({k: v[i] for k, v in params.items()}, p) < 1e-12
        assert int(state.num_mixed[i]) == int(s.num_mixed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_vmapped_inplace_ensemble_from_vmapped_init(mode, dtype):
    """``vmap(opt.init)`` then in-place vmapped steps: the members share their head, so each
    step writes one slot of the window in place (the other slots' values untouched, every
    buffer kept), and every member follows its own in-place run (the default mode used to
    fail here: the in-place append took ``out=`` and raw pointers, which batched tensors do
    not have)."""
    opt, step, stacked = ensemble(mode, dtype, inplace=True, safeguard=False)
    params, state = clone(stacked), vmap(opt.init)(clone(stacked))
    members = [clone({k: v[i] for k, v in stacked.items()}) for i in range(3)]
    expected = [(p, opt.init(p)) for p in members]
    pointers = [t.data_ptr() for slot in state.residuals for t in slot.values()]
    for k in range(10):
        before = [clone(slot) for slot in state.residuals]
        params, state = vmap(step)(state, params)
        expected = [step(s, p) for p, s in expected]
        assert [t.data_ptr() for slot in state.residuals for t in slot.values()] == pointers
        changed = [
            not all(torch.equal(a[key], b[key]) for key in a)
            for a, b in zip(state.residuals, before)
        ]
        if k >= 1:  # (mode "aadl" appends its first difference on the second call)
            assert changed.count(True) == 1, (k, changed)
    # float64: rounding (the members' slots are summed in other groupings than a member's
    # own ring buffer), which ten unsafeguarded mixes amplify.
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for i, (p, s) in enumerate(expected):
        assert rel({k: v[i] for k, v in params.items()}, p) < tolerance
        assert int(state.num_mixed[i]) == int(s.num_mixed) > 0


# -- inductor on a whole user step ---------------------------------------------------------
# torch's own code warns while inductor compiles (warnings are errors in this suite). The
# category of a deprecation changes between releases, so none is named.
INDUCTOR_WARNINGS = [
    "ignore:`torch.jit.script_method` is deprecated",
    "ignore:`torch._prims_common.check` is deprecated",
]


def user_step_with_inductor(opt, problem: Quadratic):
    """A user's whole in-place step (grads by ``torch.func.grad``, ``update`` with the
    safeguard), eager and compiled by inductor under a recording backend."""

    def step(state, params):
        grads = torch.func.grad(problem.loss)(params)
        return opt.update(state, params, grads, inplace=True, loss_fn=problem.loss)

    backend = Recorder("inductor")
    return step, torch.compile(step, fullgraph=True, backend=backend), backend


@needs_compile
@pytest.mark.filterwarnings(*INDUCTOR_WARNINGS)
def test_whole_user_step_compiles_with_inductor():
    """grads (torch.func.grad), update with the safeguard and in-place buffers, in one
    inductor graph: 50 steps equal the eager ones to float32 rounding, one compilation."""
    problem = quadratic(torch.float32)
    opt = aa.anderson(aa.sgd(0.2, momentum=0.3, weight_decay=1e-3), history_depth=5)
    step, compiled, backend = user_step_with_inductor(opt, problem)
    eager_params, params = clone(problem.x0), clone(problem.x0)
    eager_state, state = opt.init(eager_params), opt.init(params)
    worst = 0.0
    for _ in range(STEPS):
        eager_params, eager_state = step(eager_state, eager_params)
        params, state = compiled(state, params)
        worst = max(worst, rel(params, eager_params))
    assert worst < 1e-4
    for name in ("count", "num_mixed", "num_rejected"):
        assert int(getattr(state, name)) == int(getattr(eager_state, name)), name
    assert int(eager_state.num_mixed) > 0 and int(eager_state.num_rejected) > 0
    assert len(backend.graphs) == 1 and host_reads(backend.graphs) == []


# -- CUDA: CUDA graphs and no host synchronisation (skipped without CUDA) ------------------
@needs_compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings(*INDUCTOR_WARNINGS)
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_cuda_step_runs_as_cuda_graph_without_host_sync(mode):
    """``mode="reduce-overhead"``: the compiled step is replayed as a CUDA graph, and once
    warm no step synchronises the host with the device (``set_sync_debug_mode("error")``
    raises on any synchronising call); 50 steps equal the eager CUDA steps to rounding."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    problem = quadratic(torch.float32)
    problem = Quadratic(*(optree.tree_map(lambda t: t.to(cuda), getattr(problem, f.name))
                          for f in dataclasses.fields(problem)))  # fmt: skip
    opt = aa.anderson(aa.sgd(0.2, momentum=0.3), history_depth=5, mode=mode)

    def step(state, params):
        grads = torch.func.grad(problem.loss)(params)
        return opt.update(state, params, grads, loss_fn=problem.loss)

    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    eager_params, params = clone(problem.x0), clone(problem.x0)
    eager_state, state = opt.init(eager_params), opt.init(params)
    worst = 0.0
    for k in range(STEPS):
        eager_params, eager_state = step(eager_state, eager_params)
        torch.compiler.cudagraph_mark_step_begin()
        if k >= 5:  # compiled, recompiled once (counters move to the GPU), recorded
            torch.cuda.set_sync_debug_mode("error")
        try:
            params, state = compiled(state, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        worst = max(worst, rel(params, eager_params))
    assert worst < 1e-4
    assert int(state.num_mixed) == int(eager_state.num_mixed) > 0
    assert counters["inductor"]["cudagraph_skips"] == 0


# -- large slots: the in-place slot write that skips missed slots -------------------------
@pytest.fixture
def copy_if_everywhere(monkeypatch):
    """Every compiled in-place ring write of these small problems takes ``traced.copy_if_``
    (by default only leaves of 2^18 elements or more do, where it pays for its calls)."""
    from aadl_func._src import window

    monkeypatch.setattr(window, "_TRACED_COPY_MIN_NUMEL", 0)


def _calls(graphs, name: str) -> int:
    return sum(name in str(node.target) for gm in graphs for node in gm.graph.nodes)


@needs_compile
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c]["inplace"]])
def test_compiled_inplace_with_copy_if_equals_eager(case, copy_if_everywhere):
    """The same comparison as above with every ring write going through ``copy_if_``
    (functionalised by AOT autograd as the real compiler does): equal to eager, one graph."""
    test_compiled_update_is_one_graph_and_equals_eager(case)


@needs_compile
@pytest.mark.parametrize("case", ["aadl-sgd-momentum-wd-inplace-safeguard"])
def test_compiled_inplace_with_copy_if_for_large_leaves_only(case, monkeypatch):
    """Leaves decide one by one: the 6 x 5 matrix takes ``copy_if_``, the 5-vector the masked
    rewrite, in the same step."""
    from aadl_func._src import window

    monkeypatch.setattr(window, "_TRACED_COPY_MIN_NUMEL", 10)
    test_compiled_update_is_one_graph_and_equals_eager(case)


def test_copy_if_writes_only_on_a_hit():
    from aadl_func._src.traced import copy_if_

    dst = torch.arange(6.0).reshape(2, 3)
    src = torch.full((2, 3), -1.0)
    pointer = dst.data_ptr()
    copy_if_(dst, torch.tensor(False), src)
    assert torch.equal(dst, torch.arange(6.0).reshape(2, 3))
    copy_if_(dst, torch.tensor(True), src)
    assert torch.equal(dst, src) and dst.data_ptr() == pointer
    low = torch.zeros(3, dtype=torch.bfloat16)  # the history dtype may be narrower
    copy_if_(low, torch.tensor(True), torch.tensor([1.0, 2.5, 3.0]))
    assert low.tolist() == [1.0, 2.5, 3.0]
    # A mask off the CPU is never read on the host: the masked blend runs on its device.
    meta = torch.empty(3, device="meta")
    copy_if_(meta, torch.tensor(True, device="meta"), torch.empty(3, device="meta"))


def test_copy_if_under_vmap_masks_each_member():
    from aadl_func._src.traced import copy_if_

    dst = torch.zeros(3, 4)
    src = torch.arange(12.0).reshape(3, 4)
    hits = torch.tensor([True, False, True])

    def write(d, h, s):
        copy_if_(d, h, s)
        return d

    vmap(write)(dst, hits, src)
    expected = torch.where(hits[:, None], src, torch.zeros(3, 4))
    assert torch.equal(dst, expected)
    shared = torch.zeros(3, 4)
    vmap(write, in_dims=(0, None, None))(shared, torch.tensor(True), src[0])
    assert torch.equal(shared, src[0].expand(3, 4))


@needs_compile
@pytest.mark.filterwarnings(*INDUCTOR_WARNINGS)
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_inductor_inplace_step_rewrites_one_slot(mode, copy_if_everywhere):
    """Inductor keeps ``copy_if_`` in place on the window's own buffers: after every step the
    state holds the same buffers, and once the window is full exactly one residual slot
    changed; 30 steps equal the eager ones to float32 rounding, one compilation."""
    problem = quadratic(torch.float32)
    opt = aa.anderson(aa.sgd(0.2, momentum=0.3), history_depth=4, mode=mode)
    step, compiled, backend = user_step_with_inductor(opt, problem)
    eager_params, params = clone(problem.x0), clone(problem.x0)
    eager_state, state = opt.init(eager_params), opt.init(params)
    pointers = [t.data_ptr() for slot in state.residuals for t in slot.values()]
    worst = 0.0
    for k in range(30):
        before = [clone(slot) for slot in state.residuals]
        eager_params, eager_state = step(eager_state, eager_params)
        params, state = compiled(state, params)
        worst = max(worst, rel(params, eager_params))
        assert [t.data_ptr() for slot in state.residuals for t in slot.values()] == pointers
        if k >= 6:
            changed = [
                not all(torch.equal(a[key], b[key]) for key in a)
                for a, b in zip(state.residuals, before)
            ]
            assert changed.count(True) == 1, (k, changed)
    assert worst < 1e-4
    assert int(state.num_mixed) == int(eager_state.num_mixed) > 0
    assert len(backend.graphs) == 1 and _calls(backend.graphs, "copy_if_") > 0

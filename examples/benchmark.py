r"""Time and memory of one accelerated step: aadl_func vs the obvious AADL-style step vs the bound.

Three contenders, measured side by side in one process on the same data:

* **aadl_func** -- ``aa.anderson(aa.sgd(0.01), history_depth=m, relaxation=0.5)``,
  ``update(..., inplace=True)``: a ring of residuals with incremental float64 Gram matrices,
  two streaming passes over the window per step (on the CPU the first is the native kernel
  of ``aadl_func/_src/_dots.c`` when it could be built; ``--no-native`` measures the torch
  pass instead; the JSON's ``machine.gram_kernel`` says which ran).
* **AADL-style** -- the step written the obvious way, as AADL does it: ``torch.optim.SGD``
  steps, a ``collections.deque`` of flattened parameter vectors, ``torch.stack`` of the
  window, ``DX``/``DR`` by ``torch.diff``, ``torch.linalg.lstsq``, and the relaxed formula
  of ``docs/background.md``, written back with ``vector_to_parameters``.
* **bound** -- what any Anderson step must at least do: two passes over an ``(m + 1) x n``
  float32 matrix, ``torch.mv`` with the matrix and with its transpose (BLAS, no overhead).
* **compiled** -- the same aadl_func step under ``torch.compile(..., fullgraph=True)``
  (inductor; compiled once per row, the first call's time is the ``compile_s`` of the JSON);
  ``--no-compile`` skips it.

Then one ensemble point (``--ensemble MEMBERS,LOG2_N,M``, default 8 members of n = 2^17,
m = 10, mode "classic"; ``--ensemble none`` skips it): one ``vmap(update)`` step for all
members, a Python loop of the members' own pure steps and of their in-place steps, and the
vmapped step compiled.

``m`` is ``history_depth``, the number of window entries, as in the issue; ``m = 2`` is
replaced by 3, the smallest window that can mix. Every step mixes (``frequency=1``, the
window is filled before timing). Times are medians over repeats after warm-up (aadl_func and
the bound called in turn, step by step, and ``/bound`` the median of the pairs' ratios); the peak is
the high-water mark of the memory allocated during one step (CPU: ``torch.profiler``
allocation events; CUDA: ``torch.cuda.max_memory_allocated``), in units of one
parameter-sized float32 buffer ``P = 4 n`` bytes, next to the bytes each keeps between steps.

Usage::

    python examples/benchmark.py                  # full table, n = 2^16..2^24 (~2 min)
    python examples/benchmark.py --quick          # a tiny configuration (seconds)
    python examples/benchmark.py --device cuda --threads 16 --out bench_results/gpu.json
    python examples/benchmark.py --sizes 16 --depths 5 --ensemble none   # one row

A second table, the **small-model row**, measures the other end: the per-step cost of
``aa.AcceleratedOptimizer`` (default options) around ``torch.optim.Adam`` / ``SGD`` on a
digits-sized MLP (64-32-10, 2,410 parameters) trained on minibatches of 32, against the plain
optimizer on an identical model, and of the functional API (``aa.anderson(aa.adam(...))``,
grads from ``torch.func.grad``). There the window is tiny and a step costs what its Python
does; the row reports the median time of a whole training step (``zero_grad``, forward,
backward, ``step``) and of ``step`` alone, the contenders timed in turn step by step so that a
change in machine load hits all of them.

A third table, the **solver rows**, times ``aa.fixed_point``/``aa.root`` per evaluation of the
map at equal evaluation counts, side by side in interleaved rounds: on a 40-dimensional map
against ``scipy.optimize.anderson`` (``M=5``, ``w0=0``, no line search, the same recurrence)
and on a 64 x 128 DEQ layer (float32) against torchdeq 0.1.0's ``anderson_solver`` (``m=6``;
skipped when torchdeq is not installed: ``pip install --no-deps torchdeq``), plain
iteration, and ``batch_dims=1`` (also through the core's ``update`` under ``vmap``, the route
before ``solver_batched.py``). The "loop" column is the solver loop's own time per
evaluation (the core's ``update`` replaced by ``x + r``); ``--solver-only`` runs these rows
alone.
Last, the **import time**: ``import torch`` and, on top of it, ``import aadl_func`` (and, for
scale, ``import torch._dynamo``, which aadl_func leaves to the first compile), each in a fresh
interpreter, best of ``--import-rounds`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.profiler import ProfilerActivity, profile

import aadl_func as aa
from aadl_func._src import native

LR, RELAXATION = 0.01, 0.5


# -- the contenders ----------------------------------------------------------------------
class AadlStyle:
    """AADL's step written the obvious way (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], history_depth: int) -> None:
        self.params = params
        self.optimizer = torch.optim.SGD(params, lr=LR)
        self.history = collections.deque(maxlen=history_depth)

    def step(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        with torch.no_grad():
            self.history.append(parameters_to_vector(self.params))
            if len(self.history) < 3:
                return
            X = torch.stack(list(self.history), dim=1)
            DX = torch.diff(X, dim=1)
            DR = torch.diff(DX, dim=1)
            gamma = torch.linalg.lstsq(DR, DX[:, -1:]).solution[:, 0]
            extr = X[:, -2] + DX[:, -1] - (DX[:, :-1] + DR) @ gamma
            alpha = torch.cat([gamma[:1], gamma[1:] - gamma[:-1], 1.0 - gamma[-1:]])
            relaxed = RELAXATION * extr + (1.0 - RELAXATION) * X[:, :-1] @ alpha
            vector_to_parameters(relaxed, self.params)

    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.history)


class AadlFunc:
    def __init__(self, params: torch.Tensor, history_depth: int) -> None:
        self.opt = aa.anderson(aa.sgd(LR), history_depth=history_depth, relaxation=RELAXATION)
        self.params = params
        self.state = self.opt.init(params)

    def step(self, grads: torch.Tensor) -> None:
        self.params, self.state = self.opt.update(self.state, self.params, grads, inplace=True)

    def state_bytes(self) -> int:
        storages = {}
        for leaf in [self.state.anchor, *self.state.residuals]:
            storages[leaf.untyped_storage().data_ptr()] = leaf.untyped_storage().nbytes()
        return sum(storages.values())


class Compiled(AadlFunc):
    """The aadl_func step compiled whole (``fullgraph=True``: a graph break would raise)."""

    def __init__(self, params: torch.Tensor, history_depth: int) -> None:
        super().__init__(params, history_depth)
        self.compiled = torch.compile(
            lambda s, p, g: self.opt.update(s, p, g, inplace=True), fullgraph=True
        )

    def step(self, grads: torch.Tensor) -> None:
        self.params, self.state = self.compiled(self.state, self.params, grads)


class Bound:
    """Two BLAS passes over an (m + 1) x n float32 matrix: with it and with its transpose."""

    def __init__(self, n: int, m: int, device: torch.device) -> None:
        self.matrix = torch.randn(m + 1, n, device=device)
        self.vector = torch.randn(n, device=device)
        self.weights = torch.randn(m + 1, device=device)

    def step(self) -> None:
        torch.mv(self.matrix, self.vector)
        torch.mv(self.matrix.mT, self.weights)


# -- measurement -------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(step, device: torch.device, repeats: int, budget_s: float) -> float:
    """Median seconds of ``step()`` over up to ``repeats`` calls (at least 3, within budget)."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() - started < budget_s):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_times(
    step, other, device: torch.device, repeats: int, budget_s: float
) -> tuple[float, float, float]:
    """``step()`` and ``other()`` called in turn, up to ``repeats`` pairs (at least 3, within
    budget): the median seconds of each and the median of the pairs' ratios."""
    pairs: list[tuple[float, float]] = []
    started = time.perf_counter()
    while len(pairs) < repeats and (len(pairs) < 3 or time.perf_counter() - started < budget_s):
        times = []
        for call in (step, other):
            synchronize(device)
            t0 = time.perf_counter()
            call()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        pairs.append((times[0], times[1]))
    return (
        statistics.median(a for a, _ in pairs),
        statistics.median(b for _, b in pairs),
        statistics.median(a / b for a, b in pairs),
    )


def step_peak_bytes(step, device: torch.device) -> int:
    """High-water mark of the memory allocated while ``step()`` runs, above the start."""
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return allocation_profile(step)[0]


def allocation_profile(fn) -> tuple[int, int, int]:
    """``(peak, total, largest)`` bytes allocated on the CPU while ``fn()`` runs.

    ``peak``: maximum over time of (bytes allocated - bytes freed) since the start;
    ``total``: sum of all allocations; ``largest``: the biggest single allocation. From
    ``torch.profiler``'s allocator events (``tests/test_memory.py`` calibrates it).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = total = largest = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
        if nbytes > 0:
            total += nbytes
            largest = max(largest, nbytes)
    return peak, total, largest


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def measure(n: int, m: int, device: torch.device, args) -> dict:
    generator = torch.Generator(device=device).manual_seed(n + m)
    param_bytes = 4 * n
    grads = [1e-2 * torch.randn(n, device=device, generator=generator) for _ in range(4)]
    row = {"n": n, "log2_n": int(math.log2(n)), "m": m, "history_depth": m}

    # aadl_func: fill the window with real steps, warm up, then time. inplace=True may write
    # the gradient buffer (the inner SGD scales it in place until the window is full; then
    # the append forms -lr * g), so every step gets a fresh copy, made before the clock starts.
    fresh = [grads[i % 4].clone() for i in range(m + 3 + args.repeats)]
    ours = AadlFunc(torch.randn(n, device=device, generator=generator), m)
    for _ in range(m + 1):
        ours.step(fresh.pop())
    peak = step_peak_bytes(lambda: ours.step(fresh.pop()), device)
    ours.step(fresh.pop())
    # Against the bound step by step: a change in the machine's load hits both alike.
    bound = Bound(n, m, device)
    bound.step()
    ours_s, bound_s, ratios = paired_times(
        lambda: ours.step(fresh.pop()), bound.step, device, args.repeats, args.budget
    )
    row["aadl_func_ms"], row["bound_ms"] = 1e3 * ours_s, 1e3 * bound_s
    row["ratio_to_bound"] = ratios
    row["aadl_func_state_P"] = ours.state_bytes() / param_bytes
    row["aadl_func_step_peak_P"] = peak / param_bytes
    assert int(ours.state.num_mixed) > 0
    ours = fresh = bound = None  # free the window before the next contender

    if args.compile:
        fresh = [grads[i % 4].clone() for i in range(m + 4 + args.repeats)]
        # A fresh compilation per row: after a recompilation for another shape dynamo would
        # make the changed sizes dynamic, which is another program than a user's.
        torch._dynamo.reset()
        compiled = Compiled(torch.randn(n, device=device, generator=generator), m)
        synchronize(device)
        started = time.perf_counter()
        compiled.step(fresh.pop())
        synchronize(device)
        row["compile_s"] = time.perf_counter() - started
        for _ in range(m + 1):
            compiled.step(fresh.pop())
        row["compiled_step_peak_P"] = (
            step_peak_bytes(lambda: compiled.step(fresh.pop()), device) / param_bytes
        )
        row["compiled_ms"] = 1e3 * median_time(
            lambda: compiled.step(fresh.pop()), device, args.repeats, args.budget
        )
        assert int(compiled.state.num_mixed) > 0
        compiled = fresh = None

    # AADL-style: roughly stack + two diffs + lstsq's copies + the formula, ~6 window sizes.
    need = 6 * m * param_bytes
    if need > args.memory_fraction * available_bytes(device):
        row["aadl_style_skipped"] = f"needs ~{need / 2**30:.1f} GiB"
    else:
        params = [torch.randn(n, device=device, generator=generator)]
        style = AadlStyle(params, m)
        for _ in range(m - 1):  # a full window without paying m slow steps
            style.history.append(params[0].detach().clone() + 1e-2 * torch.randn_like(params[0]))
        # torch.optim.SGD only reads p.grad: the same gradient tensors serve every step.
        peak = step_peak_bytes(lambda: style.step([grads[0]]), device)
        row["aadl_style_ms"] = 1e3 * median_time(
            lambda: style.step([grads[1]]), device, args.style_repeats, args.budget
        )
        row["aadl_style_state_P"] = style.state_bytes() / param_bytes
        row["aadl_style_step_peak_P"] = peak / param_bytes
        row["speedup_vs_aadl_style"] = row["aadl_style_ms"] / row["aadl_func_ms"]
        del style, params
    if "compiled_ms" in row:
        row["compiled_ratio_to_bound"] = row["compiled_ms"] / row["bound_ms"]
    return row


class _Functional:
    """The functional API on the same model: ``grad`` of a ``functional_call`` loss, then
    ``aa.anderson(inner).update(..., inplace=True)``, with a ``zero_grad``/``step`` face so that
    it is timed like the torch.optim contenders (``prepare`` computes the grads)."""

    def __init__(self, model: torch.nn.Module, inner: aa.InnerOptimizer) -> None:
        self.model = model
        self.params = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.opt = aa.anderson(inner)
        self.state = self.opt.init(self.params)
        self.grads = None

    def prepare(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        def loss(params):
            logits = torch.func.functional_call(self.model, params, (features,))
            return torch.nn.functional.cross_entropy(logits, labels)

        self.grads = torch.func.grad(loss)(self.params)

    def step(self) -> None:
        self.params, self.state = self.opt.update(self.state, self.params, self.grads, inplace=True)


def minibatches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The small-model rows' data: 16 minibatches of 32 digits-sized inputs (64 features)
    with labels in 0..9, made from seed 0; step k trains on minibatch k % 16."""
    generator = torch.Generator(device=device).manual_seed(0)
    features = torch.randn(32 * 16, 64, device=device, generator=generator)
    labels = torch.randint(0, 10, (32 * 16,), device=device, generator=generator)
    return list(zip(features.split(32), labels.split(32)))


def small_model_overhead(device: torch.device, steps: int) -> list[dict]:
    """Microseconds per minibatch step: plain torch.optim, wrapped, functional (see the
    module docstring).

    Each contender's step is timed twice: wall clock, and the CPU time of the calling thread
    (``time.thread_time``), which a busy machine inflates much less (a descheduled thread
    accrues no CPU time) and which is what Python overhead costs. Medians over the steps.
    """
    batches = minibatches(device)
    optimizers = {
        "adam": (lambda params: torch.optim.Adam(params, lr=1e-3), lambda: aa.adam(1e-3)),
        "sgd": (lambda params: torch.optim.SGD(params, lr=0.05), lambda: aa.sgd(0.05)),
    }
    clocks = {"wall": time.perf_counter, "cpu": time.thread_time}
    rows = []
    for name, (make, make_inner) in optimizers.items():
        contenders = {}
        for kind in ("plain", "wrapped", "functional"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)
            ).to(device)
            if kind == "functional":
                contenders[kind] = (model, _Functional(model, make_inner()))
                continue
            optimizer = make(model.parameters())
            if kind == "wrapped":
                optimizer = aa.AcceleratedOptimizer(optimizer)
            contenders[kind] = (model, optimizer)
        samples: dict[str, list[float]] = collections.defaultdict(list)
        warmup = 20
        for step in range(warmup + steps):
            features, labels = batches[step % len(batches)]
            for kind, (model, optimizer) in contenders.items():
                synchronize(device)
                t0 = {c: clock() for c, clock in clocks.items()}
                if kind == "functional":
                    optimizer.prepare(features, labels)
                else:
                    optimizer.zero_grad()
                    logits = model(features)
                    torch.nn.functional.cross_entropy(logits, labels).backward()
                synchronize(device)
                t1 = {c: clock() for c, clock in clocks.items()}
                optimizer.step()
                synchronize(device)
                t2 = {c: clock() for c, clock in clocks.items()}
                if step >= warmup:
                    for c in clocks:
                        samples[f"{kind}_step_{c}_us"].append(1e6 * (t2[c] - t0[c]))
                        samples[f"{kind}_optimizer_step_{c}_us"].append(1e6 * (t2[c] - t1[c]))
        row: dict = {"optimizer": name, "params": sum(p.numel() for p in model.parameters())}
        row.update({key: statistics.median(values) for key, values in samples.items()})
        for c in clocks:
            row[f"ratio_{c}"] = row[f"wrapped_step_{c}_us"] / row[f"plain_step_{c}_us"]
        row["num_mixed"] = int(contenders["wrapped"][1].anderson_states[0].num_mixed)
        rows.append(row)
    return rows


def small_model_table(rows: list[dict]) -> str:
    head = (
        f"{'inner':>5} {'clock':>5} | {'plain':>8} {'wrapped':>8} {'ratio':>6} "
        f"{'functional':>10} | {'plain':>8} {'wrapped':>8} {'functional':>10}"
    )
    lines = [
        f"{'':>11} | {'whole step (zero_grad/grad + step)':^36} | {'optimizer step alone':^28}",
        head,
        "-" * len(head),
    ]
    for r in rows:
        for c in ("cpu", "wall"):
            lines.append(
                f"{r['optimizer']:>5} {c:>5} | {r[f'plain_step_{c}_us']:>6.0f}us "
                f"{r[f'wrapped_step_{c}_us']:>6.0f}us {r[f'ratio_{c}']:>5.2f}x "
                f"{r[f'functional_step_{c}_us']:>8.0f}us | "
                f"{r[f'plain_optimizer_step_{c}_us']:>6.0f}us "
                f"{r[f'wrapped_optimizer_step_{c}_us']:>6.0f}us "
                f"{r[f'functional_optimizer_step_{c}_us']:>8.0f}us"
            )
    lines.append(
        f"MLP 64-32-10 ({rows[0]['params']} params), minibatch 32, median per step; plain = "
        "torch.optim, wrapped = AcceleratedOptimizer (defaults), functional = anderson(aa.adam "
        "/ aa.sgd).update(inplace=True) with torch.func.grad; cpu = the calling thread's CPU time"
    )
    return "\n".join(lines)


def ensemble_point(members: int, n: int, m: int, device: torch.device, args) -> dict:
    """One step of an ensemble of ``members`` models (n params each, mode "classic",
    history_depth m): vmap(update), the members' own pure steps in a loop, their in-place
    steps in a loop, and the vmapped step compiled. Steps are timed interleaved."""
    generator = torch.Generator(device=device).manual_seed(members + n + m)
    opt = aa.anderson(aa.sgd(LR), history_depth=m, relaxation=RELAXATION, mode="classic")
    h = torch.rand(members, n, device=device, generator=generator) + 0.5
    target = torch.randn(members, n, device=device, generator=generator)
    start = torch.randn(members, n, device=device, generator=generator)

    def grad(p, i=None):
        return h * (p - target) if i is None else h[i] * (p - target[i])

    def pure(s, p, g):
        return opt.update(s, p, g)

    batched = torch.func.vmap(pure)
    contenders = {
        "vmap": [start.clone(), torch.func.vmap(opt.init)(start.clone())],
        "loop_pure": [[start[i].clone() for i in range(members)], None],
        "loop_inplace": [[start[i].clone() for i in range(members)], None],
    }
    contenders["loop_pure"][1] = [opt.init(p) for p in contenders["loop_pure"][0]]
    contenders["loop_inplace"][1] = [opt.init(p) for p in contenders["loop_inplace"][0]]
    if args.compile:
        torch._dynamo.reset()
        contenders["compiled_vmap"] = [start.clone(), torch.func.vmap(opt.init)(start.clone())]
        compiled = torch.compile(batched, fullgraph=True)

    def run(name: str) -> None:
        entry = contenders[name]
        if name in ("vmap", "compiled_vmap"):
            step = batched if name == "vmap" else compiled
            entry[0], entry[1] = step(entry[1], entry[0], grad(entry[0]))
            return
        inplace = name == "loop_inplace"
        for i in range(members):
            entry[0][i], entry[1][i] = opt.update(
                entry[1][i], entry[0][i], grad(entry[0][i], i), inplace=inplace
            )

    point = {"members": members, "n": n, "log2_n": int(math.log2(n)), "m": m}
    if args.compile:
        synchronize(device)
        started = time.perf_counter()
        run("compiled_vmap")
        synchronize(device)
        point["compile_s"] = time.perf_counter() - started
    for _ in range(m + 2):  # fill the windows
        for name in contenders:
            run(name)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name in contenders:
            synchronize(device)
            t0 = time.perf_counter()
            run(name)
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    for name, values in times.items():
        point[f"{name}_ms"] = 1e3 * statistics.median(values)
    point["vmap_over_loop_pure"] = point["vmap_ms"] / point["loop_pure_ms"]
    if args.compile:
        point["compiled_vmap_over_loop_pure"] = point["compiled_vmap_ms"] / point["loop_pure_ms"]
    vmapped = contenders["vmap"][1].num_mixed
    assert int(vmapped.min()) > 0
    return point


def agreement(device: torch.device) -> float:
    """Relative difference of aadl_func and AADL-style after the same 8 steps (n = 4096, m =
    5): the two compute the same iteration (float64 vs float32 least squares)."""
    generator = torch.Generator(device=device).manual_seed(0)
    n, m = 4096, 5
    x0 = torch.randn(n, device=device, generator=generator)
    target = torch.randn(n, device=device, generator=generator)
    ours = AadlFunc(x0.clone(), m)
    params = [x0.clone()]
    style = AadlStyle(params, m)
    for _ in range(8):  # gradient of 0.5 ||x - target||^2 at the current point of each
        ours.step(ours.params - target)
        style.step([params[0].detach() - target])
    return float((ours.params - params[0]).norm() / params[0].norm())


# -- reporting ---------------------------------------------------------------------------
def fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec``; a missing value is a dash of the same width."""
    if value is None:
        return format("-", spec.split(".")[0])
    return format(value, spec)


def table(rows: list[dict]) -> str:
    head = (
        f"{'n':>6} {'m':>3} | {'aadl_func':>10} {'compiled':>9} {'AADL-style':>11} "
        f"{'bound':>9} | {'speedup':>8} {'/bound':>7} {'c/bound':>7} | {'state P':>7} "
        f"{'peak P':>7} {'c. peak':>7} | {'style st.':>9} {'style pk':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        style_ms = r.get("aadl_style_ms")
        lines.append(
            f"{'2^' + str(r['log2_n']):>6} {r['m']:>3} | "
            f"{r['aadl_func_ms']:>8.2f}ms "
            + f"{fmt(r.get('compiled_ms'), '>7.2f')}ms "
            + (f"{style_ms:>9.1f}ms " if style_ms is not None else f"{'skipped':>11} ")
            + f"{r['bound_ms']:>7.2f}ms | "
            f"{fmt(r.get('speedup_vs_aadl_style'), '>7.1f')}x {r['ratio_to_bound']:>6.2f}x "
            f"{fmt(r.get('compiled_ratio_to_bound'), '>6.2f')}x | "
            f"{r['aadl_func_state_P']:>7.1f} {r['aadl_func_step_peak_P']:>7.2f} "
            f"{fmt(r.get('compiled_step_peak_P'), '>7.2f')} | "
            f"{fmt(r.get('aadl_style_state_P'), '>9.1f')} "
            f"{fmt(r.get('aadl_style_step_peak_P'), '>8.2f')}"
        )
    lines.append(
        "times: median per step; speedup = AADL-style / aadl_func; /bound = aadl_func / bound; "
        "c/bound = compiled / bound; state/peak in parameter-sized float32 buffers P (kept "
        "between steps / allocated during an eager step; c. peak: during a compiled step)"
    )
    skipped = [r for r in rows if "aadl_style_skipped" in r]
    for r in skipped:
        lines.append(
            f"AADL-style skipped at n=2^{r['log2_n']}, m={r['m']}: {r['aadl_style_skipped']}"
        )
    return "\n".join(lines)


# The import of each, timed in a fresh interpreter, rounds interleaved so that a change in the
# machine's load hits all of them; ``torch._dynamo`` is what aadl_func must not import eagerly.
IMPORTS = {
    "torch": "import torch",
    "aadl_func": "import aadl_func",
    "torch._dynamo": "import torch._dynamo",
}
_TIME_IMPORT = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); {}; "
    "print(t1 - t0, time.perf_counter() - t1)"
)


def import_times(rounds: int) -> dict:
    """Seconds of ``import torch`` and of each other import on top of it: best of ``rounds``
    fresh interpreters (the minimum: the least disturbed run, files in the page cache)."""
    seconds: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(rounds):
        for name, statement in IMPORTS.items():
            code = _TIME_IMPORT.format("pass" if name == "torch" else statement)
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout.split()
            torch_s, on_top_s = float(out[0]), float(out[1])
            seconds[name].append(torch_s if name == "torch" else on_top_s)
    return {name: min(values) for name, values in seconds.items()}


def import_table(times: dict) -> str:
    return (
        f"import torch {times['torch']:.2f} s; on top of it: import aadl_func "
        f"{times['aadl_func']:.3f} s, import torch._dynamo {times['torch._dynamo']:.2f} s "
        "(best of the rounds, each in a fresh interpreter)"
    )


def machine(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "gram_kernel": native.status(),
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if "model name" in line]
            info["cpu"] = names[0] if names else info["cpu"]
        except OSError:
            pass
    return info


def write_markdown(
    path: Path,
    info: dict,
    rows: list[dict],
    point: dict | None,
    relative_difference: float | None,
    small: list[dict],
    imports: dict,
    solver: list[dict] | None = None,
    steps: list[dict] | None = None,
) -> None:
    """The run's tables as a Markdown page (``make bench`` writes docs/benchmark_results.md,
    which docs/performance.md quotes instead of retyping figures)."""
    parts = [
        "# Benchmark results",
        "",
        "Written by `make bench` (`examples/benchmark.py --markdown`); do not edit by hand.",
        "",
        f"Machine: torch {info.get('torch')}, {info.get('cpu')}, {info.get('cores')} cores, "
        f"{info.get('threads')} threads, device {info.get('device')}, "
        f"Gram kernel: {'native' if 'native' in str(info.get('gram_kernel')) else 'torch'}; "
        f"load average at the start {tuple(round(v, 1) for v in info.get('load_average', ()))}.",
        "",
    ]
    if rows:
        parts += ["## One step: time and memory", "", "```text", table(rows), "```", ""]
    if point is not None:
        parts += [
            "## A vmap ensemble",
            "",
            f"{point['members']} members x n = 2^{point['log2_n']}, m = {point['m']} (classic): "
            f"vmap {point['vmap_ms']:.1f} ms, a loop of the members' pure steps "
            f"{point['loop_pure_ms']:.1f} ms (vmap / loop {point['vmap_over_loop_pure']:.2f}x), "
            f"a loop of in-place steps {point['loop_inplace_ms']:.1f} ms.",
            "",
        ]
    if relative_difference is not None:
        parts += [
            f"aadl_func and the AADL-style step agree after 8 steps to a relative difference "
            f"of {relative_difference:.1e}.",
            "",
        ]
    parts += ["## A small model's whole step", "", "```text", small_model_table(small), "```", ""]
    if steps:
        parts += ["## One small step", "", "```text", step_table(steps), "```", ""]
    if solver:
        parts += ["## The solvers, per evaluation", "", "```text", solver_table(solver), "```", ""]
    parts += ["## Import time", "", import_table(imports) + ".", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    print(f"wrote {path}")


def _map40() -> tuple:
    """A 40-dimensional root problem F(x) = tanh(A x + c) - x (||A|| = 0.9), NumPy and torch."""
    import numpy as np

    rng = np.random.default_rng(0)
    A = rng.standard_normal((40, 40))
    A, c = 0.9 * A / np.linalg.norm(A, 2), rng.standard_normal(40)
    At, ct = torch.from_numpy(A), torch.from_numpy(c)
    return (lambda x: np.tanh(A @ x + c) - x), (lambda x: torch.tanh(At @ x + ct) - x)


def _per_evaluation(run) -> float:
    """Seconds per evaluation of one solve; ``run(count)`` solves, ``count()`` each call."""
    calls = [0]

    def count() -> None:
        calls[0] += 1

    start = time.perf_counter()
    run(count)
    return (time.perf_counter() - start) / max(calls[0], 1)


def _trivial_update(opt):
    """The core's update replaced by ``x + r``: what is left is the solver loop's own time."""
    from aadl_func._src import tree

    def update(state, x, r, inplace=False):  # the loop's own x + r, whatever `inplace`
        xs, spec = tree.flatten(x, "x")
        return tree.unflatten(spec, [a + b for a, b in zip(xs, tree.flatten(r, "r")[0])]), state

    return type(opt)(opt.init, update)


def _loop_alone(run):
    """``run`` with the solvers' Anderson step replaced by ``x + r`` (:func:`_trivial_update`;
    the eager loop's own window, ``solver_eager``, switched off so that it takes that)."""
    from aadl_func._src import solver as solver_module
    from aadl_func._src import solver_eager

    def alone(count):
        accelerator, supports = solver_module._accelerator, solver_eager.supports
        solver_module._accelerator = lambda *a, **k: _trivial_update(accelerator(*a, **k))
        solver_eager.supports = lambda *args: False
        try:
            run(count)
        finally:
            solver_module._accelerator, solver_eager.supports = accelerator, supports

    return alone


def _vmap_route(run):
    """``run`` with ``batch_dims=1`` through the core's update under ``vmap`` (the route
    before ``solver_batched``, kept for the options the batched step does not implement)."""
    from aadl_func._src import solver_batched

    def through_vmap(count):
        supports = solver_batched.supports
        solver_batched.supports = lambda *args: False
        try:
            run(count)
        finally:
            solver_batched.supports = supports

    return through_vmap


def solver_rows(rounds: int) -> list[dict]:
    """Milliseconds per evaluation at equal evaluation counts (medians over interleaved
    rounds, one thread): the 40-dimensional map against SciPy, the DEQ layer against torchdeq
    and plain iteration (see the module docstring)."""
    try:
        from scipy.optimize import anderson as scipy_anderson
    except ImportError:
        scipy_anderson = None

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    F_np, F_t = _map40()
    evaluations = 50

    def ours40(count):
        aa.root(lambda x: count() or F_t(x), torch.zeros(40, dtype=torch.float64), alpha=-1.0,
                tol=0.0, max_iter=evaluations - 1)  # fmt: skip

    def scipy40(count):
        try:
            scipy_anderson(lambda x: count() or F_np(x), [0.0] * 40, alpha=-1.0, M=5, w0=0,
                           maxiter=evaluations, f_tol=1e-300, line_search=None)  # fmt: skip
        except Exception:  # NoConvergence at the fixed budget: the time is what we want
            pass

    generator = torch.Generator().manual_seed(0)
    W = torch.randn(128, 128, generator=generator)
    W = 0.9 * W / torch.linalg.matrix_norm(W, 2)
    injection = torch.randn(64, 128, generator=generator)
    layer = lambda z: torch.tanh(z @ W.T + injection)  # noqa: E731
    z0 = torch.zeros(64, 128)
    budget = 30
    try:
        from torchdeq.solver.anderson import anderson_solver
    except ImportError:
        anderson_solver = None

    def ours_deq(count, **kw):
        with torch.no_grad():
            aa.fixed_point(lambda z: count() or layer(z), z0, tol=0.0, max_iter=budget - 1,
                           history_depth=6, **kw)  # fmt: skip

    def torchdeq_deq(count):
        with torch.no_grad():
            anderson_solver(lambda z: count() or layer(z), z0, max_iter=budget, tol=0.0, m=6)

    def plain_deq(count):
        with torch.no_grad():
            z = z0
            for _ in range(budget):
                count()
                z = layer(z)

    contenders = {
        "map40": {"aadl_func": ours40, "loop": _loop_alone(ours40)},
        "deq64x128": {
            "aadl_func": ours_deq,
            "plain": plain_deq,
            "loop": _loop_alone(ours_deq),
            "batch_dims=1": lambda count: ours_deq(count, batch_dims=1),
            "batch_dims=1 (vmap)": _vmap_route(lambda count: ours_deq(count, batch_dims=1)),
        },  # fmt: skip
    }
    if scipy_anderson is not None:
        contenders["map40"]["scipy"] = scipy40
    if anderson_solver is not None:
        contenders["deq64x128"]["torchdeq"] = torchdeq_deq
    samples: dict = collections.defaultdict(list)
    for _ in range(rounds + 1):  # the first round warms up
        for problem, runs in contenders.items():
            for name, run in runs.items():
                samples[(problem, name)].append(_per_evaluation(run))
    torch.set_num_threads(threads)
    rows = []
    for problem, runs in contenders.items():
        row = {"problem": problem, "evaluations": evaluations if problem == "map40" else budget}
        for name in runs:
            row[f"{name}_ms"] = 1e3 * statistics.median(samples[(problem, name)][1:])
        if "batch_dims=1" in runs:  # per round, side by side: robust to the machine's drift
            ratios = [
                b / w
                for b, w in zip(
                    samples[(problem, "batch_dims=1")][1:], samples[(problem, "aadl_func")][1:]
                )
            ]
            row["batch_over_whole"] = [statistics.median(ratios), min(ratios), max(ratios)]
        rows.append(row)
    return rows


def _count_ops(step) -> int:
    """The torch operations (aten calls) of one ``step()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.calls


def _small_mlp() -> torch.nn.Module:
    """The 64-32-10 MLP of the small-model row (2,410 params), with fixed gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    for p in model.parameters():
        p.grad = 1e-2 * torch.randn_like(p)
    return model


def step_rows(rounds: int, n: int = 1 << 10, history_depth: int = 5) -> list[dict]:
    """Small steps against their plain counterparts, side by side in one process (medians of
    interleaved rounds, one thread), with the torch operations of one call:

    * the eager in-place ``anderson(aa.adam)`` step in each mode on a one-leaf tensor of
      ``n`` elements, against ``torch.optim.Adam(foreach=True).step()`` on the same tensor;
    * the same aadl step on that MLP's 4 leaves (a tree), and
      ``AcceleratedOptimizer(Adam).step()`` on the small-model row's MLP (2,410 params, fixed
      gradients), each against that Adam's own ``step()`` on the same model;
    * ``aa.fixed_point`` per evaluation on the 40-dimensional map of the solver rows
      (50 evaluations), against ``scipy.optimize.anderson``'s (M=5, w0=0) on it.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    start, grad = torch.randn(n, generator=generator), 1e-2 * torch.randn(n, generator=generator)
    param = torch.nn.Parameter(start.clone())
    param.grad = grad.clone()
    adam = torch.optim.Adam([param], lr=1e-3, foreach=True)
    # name: (one call, the name of the call it is measured against, calls per timing)
    steps: dict = {"torch.optim.Adam": (adam.step, None, 100)}
    for mode in ("classic", "aadl"):
        opt = aa.anderson(aa.adam(1e-3), history_depth=history_depth, mode=mode)
        x = start.clone()
        holder = [opt.init(x)]

        def step(opt=opt, x=x, holder=holder) -> None:
            holder[0] = opt.update(holder[0], x, grad, inplace=True)[1]

        steps[f"anderson {mode}"] = (step, "torch.optim.Adam", 100)
    plain, wrapped = _small_mlp(), _small_mlp()
    steps["Adam on the MLP"] = (
        torch.optim.Adam(plain.parameters(), lr=1e-3, foreach=True).step,
        None,
        100,
    )
    # The functional step on the MLP's leaves (a tree of 4 tensors), against the same Adam.
    functional = aa.anderson(aa.adam(1e-3), history_depth=history_depth)
    model = _small_mlp()
    leaves = [p.detach().clone() for p in model.parameters()]
    leaf_grads = [p.grad.clone() for p in model.parameters()]
    tree_state = [functional.init(leaves)]

    def tree_step() -> None:
        tree_state[0] = functional.update(tree_state[0], leaves, leaf_grads, inplace=True)[1]

    steps["anderson aadl, MLP"] = (tree_step, "Adam on the MLP", 100)
    accelerated = aa.AcceleratedOptimizer(
        torch.optim.Adam(wrapped.parameters(), lr=1e-3, foreach=True)
    )
    steps["AcceleratedOptimizer"] = (accelerated.step, "Adam on the MLP", 100)
    evaluations = 50
    F_np, F_t = _map40()
    # The solver rows' call: root with alpha = -1 is fixed_point on x + F(x) (same loop).
    steps["root/fixed_point eval"] = (
        lambda: aa.root(
            F_t, torch.zeros(40, dtype=torch.float64), alpha=-1.0, tol=0.0, max_iter=evaluations - 1
        ),
        "scipy anderson" if _scipy_anderson() is not None else None,
        1,
    )
    if _scipy_anderson() is not None:
        steps["scipy anderson"] = (lambda: _scipy40(F_np, evaluations), None, 1)
    for step, _, _ in steps.values():
        for _ in range(30):  # past the window's filling: every call mixes
            step()
    samples: dict = collections.defaultdict(list)
    for _ in range(rounds):
        for name, (step, _, calls) in steps.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            per = calls if calls > 1 else evaluations  # a solve: per evaluation
            samples[name].append((time.perf_counter() - t0) / per * 1e6)
    torch.set_num_threads(threads)
    rows = []
    for name, (step, against, calls) in steps.items():
        if against is None:
            continue
        us = statistics.median(samples[name])
        reference = statistics.median(samples[against])
        ops = _count_ops(step) if calls > 1 else None
        rows.append({"step": name, "us": us, "against": against, "against_us": reference,
                     "ratio": us / reference, "torch_ops": ops,
                     "n": n, "history_depth": history_depth})  # fmt: skip
    return rows


def loop_rows(rounds: int, iterations: int = 100) -> list[dict]:
    """``AcceleratedOptimizer(Adam).step()`` where a training loop runs it: after
    ``zero_grad``, a forward and a backward on a minibatch of 32 (the small-model row's MLP
    and data), against ``torch.optim.Adam(foreach=True).step()`` in the same loop; only the
    steps are timed (one thread, the two loops interleaved step by step, medians of the
    rounds' medians).

    A step in a loop of its own finds the code and data of the previous one warm; here each
    follows the forward and backward, as in training (measured: Adam's step right after the
    wrapper's costs about 1.4x Adam's step right after another)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    batches = minibatches(torch.device("cpu"))
    models = {"Adam": _small_mlp(), "AcceleratedOptimizer": _small_mlp()}
    optimizers = {
        "Adam": torch.optim.Adam(models["Adam"].parameters(), lr=1e-3, foreach=True),
        "AcceleratedOptimizer": aa.AcceleratedOptimizer(
            torch.optim.Adam(models["AcceleratedOptimizer"].parameters(), lr=1e-3, foreach=True)
        ),
    }
    medians: dict = collections.defaultdict(list)
    for _ in range(rounds):
        samples: dict = collections.defaultdict(list)
        for step in range(10 + iterations):  # the first 10: warm-up (the window fills)
            features, labels = batches[step % len(batches)]
            for name, optimizer in optimizers.items():
                optimizer.zero_grad()
                logits = models[name](features)
                torch.nn.functional.cross_entropy(logits, labels).backward()
                t0 = time.perf_counter()
                optimizer.step()
                samples[name].append(time.perf_counter() - t0)
        for name, values in samples.items():
            medians[name].append(statistics.median(values[10:]) * 1e6)
    torch.set_num_threads(threads)
    us, against = (statistics.median(medians[k]) for k in ("AcceleratedOptimizer", "Adam"))
    return [{"step": "AcceleratedOptimizer, in a loop", "us": us, "against": "Adam, in a loop",
             "against_us": against, "ratio": us / against, "torch_ops": None,
             "n": None, "history_depth": None}]  # fmt: skip


def _scipy_anderson():
    try:
        from scipy.optimize import anderson
    except ImportError:
        return None
    return anderson


def _scipy40(F_np, evaluations: int) -> None:
    try:
        _scipy_anderson()(F_np, [0.0] * 40, alpha=-1.0, M=5, w0=0, maxiter=evaluations,
                          f_tol=1e-300, line_search=None)  # fmt: skip
    except Exception:  # NoConvergence at the fixed budget: the time is what we want
        pass


def step_table(rows: list[dict]) -> str:
    head = f"{'step':>31} {'us':>8} {'against':>18} {'us':>8} {'ratio':>7} {'torch ops':>9}"
    lines = [head]
    for r in rows:
        ops = "" if r["torch_ops"] is None else str(r["torch_ops"])
        lines.append(
            f"{r['step']:>31} {r['us']:>8.1f} {r['against']:>18} {r['against_us']:>8.1f} "
            f"{r['ratio']:>6.2f}x {ops:>9}"
        )
    r = rows[0]
    lines.append(
        f"anderson: one leaf of {r['n']} float32 values, history_depth {r['history_depth']}, "
        "eager update(..., inplace=True) with aa.adam(1e-3), against torch.optim.Adam"
        "(foreach=True).step(); 'anderson aadl, MLP': the same on the 4 leaves of the "
        "64-32-10 MLP (2,410 params, fixed grads), and AcceleratedOptimizer(Adam(foreach=True))"
        ".step() on that MLP, against that Adam's step(); root/fixed_point: "
        "microseconds per evaluation of a 50-evaluation aa.root(alpha=-1) of the solver rows' "
        "40-dimensional map, against scipy.optimize.anderson(M=5, w0=0); 'in a loop': "
        "the two steps in a training loop on that MLP (zero_grad, forward and backward of a "
        "minibatch of 32 before each, untimed); one thread, medians of interleaved rounds"
    )
    return "\n".join(lines)


def solver_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        ours = r["aadl_func_ms"]
        others = ", ".join(
            f"{k[:-3]} {v:.3f} ms ({ours / v:.2f}x)"
            for k, v in r.items()
            if k.endswith("_ms") and k != "aadl_func_ms"
        )
        lines.append(
            f"{r['problem']:>10}: aadl_func {ours:.3f} ms per evaluation; {others} "
            f"[{r['evaluations']} evaluations; (x) = aadl_func / that]"
        )
        if "batch_over_whole" in r:
            median, low, high = r["batch_over_whole"]
            lines.append(
                f"{'':>10}  batch_dims=1 / aadl_func (the whole batch as one problem), per "
                f"round: {median:.2f}x [{low:.2f}, {high:.2f}]"
            )
    lines.append(
        "map40: root on tanh(A x + c) - x, float64, vs scipy.optimize.anderson(M=5, w0=0); "
        "deq64x128: fixed_point on tanh(z W^T + x), float32, vs torchdeq anderson_solver(m=6), "
        "plain iteration, batch_dims=1 and batch_dims=1 through the core's update under vmap "
        "(the route before solver_batched.py); loop = the solver loop alone (update replaced by "
        "x + r); one thread, medians of interleaved rounds"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration (seconds)")
    parser.add_argument("--out", default="bench_results/benchmark.json", help="JSON output")
    parser.add_argument(
        "--markdown", default=None, help="also write the tables as a Markdown page (docs/)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--sizes", default="16,18,20,22,24", help="log2 of n, comma-separated")
    parser.add_argument("--depths", default="3,5,10,20", help="m = history_depth values")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps (at most)")
    parser.add_argument("--style-repeats", type=int, default=5, help="timed AADL-style steps")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per timing, soft")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.35,
        help="skip AADL-style when it would need more than this fraction of free memory",
    )
    parser.add_argument(
        "--small-steps", type=int, default=500, help="timed steps of the small-model row"
    )
    parser.add_argument(
        "--small-only", action="store_true", help="measure only the small-model row"
    )
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="skip torch.compile"
    )
    parser.add_argument(
        "--import-rounds", type=int, default=7, help="fresh interpreters per timed import"
    )
    parser.add_argument(
        "--ensemble",
        default="8,17,10",
        help="MEMBERS,LOG2_N,M of the vmap ensemble point, or 'none'",
    )
    parser.add_argument(
        "--solver-rounds", type=int, default=7, help="rounds of the solver rows (0: skip)"
    )
    parser.add_argument(
        "--step-rounds", type=int, default=15, help="rounds of the small-step rows (0: skip)"
    )
    parser.add_argument(
        "--solver-only", action="store_true", help="measure and print only the solver rows"
    )
    parser.add_argument(
        "--no-native",
        action="store_true",
        help="use the torch Gram-row pass instead of the native kernel (for comparison)",
    )
    args = parser.parse_args(argv)
    # torch's own code warns while inductor compiles; nothing for a reader of this table.
    warnings.filterwarnings("ignore", message="`torch._prims_common.check` is deprecated")
    warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated")
    if args.no_native:
        native.set_enabled(False)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.depths, args.repeats, args.style_repeats = "10,12", "3,5", 5, 3
        args.small_steps, args.import_rounds = 30, 2
        args.solver_rounds = min(args.solver_rounds, 1)
        args.step_rounds = min(args.step_rounds, 3)
        args.ensemble = "4,10,5" if args.ensemble == "8,17,10" else args.ensemble
    if args.solver_only:  # one section alone (a shared machine): printed, no files
        print(solver_table(solver_rows(args.solver_rounds)))
        return 0
    device = torch.device(args.device)
    sizes = [] if args.small_only else [1 << int(s) for s in args.sizes.split(",")]
    depths = [max(3, int(m)) for m in args.depths.split(",")]

    info = machine(device)
    print(f"# {info}", flush=True)
    started = time.perf_counter()
    rows = []
    for n in sizes:
        for m in depths:
            rows.append(measure(n, m, device, args))
            r = rows[-1]
            print(
                f"  n=2^{r['log2_n']} m={m}: aadl_func {r['aadl_func_ms']:.2f} ms, "
                f"compiled {fmt(r.get('compiled_ms'), '.2f')} ms, "
                f"AADL-style {fmt(r.get('aadl_style_ms'), '.1f')} ms, "
                f"bound {r['bound_ms']:.2f} ms",
                flush=True,
            )
    point = None
    if args.ensemble != "none" and not args.small_only:
        members, log2_n, m = (int(v) for v in args.ensemble.split(","))
        point = ensemble_point(members, 1 << log2_n, m, device, args)
    relative_difference = None if args.small_only else agreement(device)
    small = small_model_overhead(device, args.small_steps)
    steps = step_rows(args.step_rounds) + loop_rows(args.step_rounds) if args.step_rounds else []
    solver = solver_rows(args.solver_rounds) if args.solver_rounds else []
    imports = import_times(args.import_rounds)
    if rows:
        print()
        print(table(rows))
    if point is not None:
        print(
            f"ensemble of {point['members']} x n=2^{point['log2_n']}, m={point['m']} (classic): "
            f"vmap {point['vmap_ms']:.1f} ms, loop of pure steps {point['loop_pure_ms']:.1f} ms, "
            f"loop of in-place steps {point['loop_inplace_ms']:.1f} ms"
            + (
                f", compiled vmap {point['compiled_vmap_ms']:.1f} ms"
                if "compiled_vmap_ms" in point
                else ""
            )
            + f"; vmap / loop of pure steps {point['vmap_over_loop_pure']:.2f}x"
        )
    if relative_difference is not None:
        print(
            f"aadl_func vs AADL-style after 8 steps: relative difference {relative_difference:.1e}"
        )
    print()
    print(small_model_table(small))
    if steps:
        print()
        print(step_table(steps))
    print(import_table(imports))
    if solver:
        print()
        print(solver_table(solver))
    if args.markdown is not None:
        write_markdown(
            Path(args.markdown),
            info,
            rows,
            point,
            relative_difference,
            small,
            imports,
            solver,
            steps,
        )
    result = {
        "machine": info,
        "settings": {
            "inner": f"sgd(lr={LR})",
            "relaxation": RELAXATION,
            "dtype": "float32",
            "m": "history_depth (window entries)",
            "aadl_func": "update(..., inplace=True)",
            "compiled": "torch.compile(update(..., inplace=True), fullgraph=True), inductor",
            "ensemble": "mode classic; vmap(update) vs loops of update / update(inplace=True)",
            "bound": "torch.mv with and with the transpose of an (m + 1) x n float32 matrix",
            "units": "P = one parameter-sized float32 buffer (4 n bytes)",
        },
        "rows": rows,
        "small_model": small,
        "small_step": steps,
        "solver": solver,
        "import_seconds": imports,
        "ensemble": point,
        "agreement_relative_difference": relative_difference,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

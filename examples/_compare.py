"""Comparing optimizers on a full-batch problem: evaluations, seconds, seeds and tuning.

Shared by ``digits_demo.py`` and ``pinn.py``. Every method starts from the same initial weights
of a seed and runs until it has spent a budget of *gradient-equivalents*:

    gradient-equivalents = gradient evaluations + forward_cost * forward-only loss evaluations

A gradient evaluation is one ``loss_and_grad`` call (forward and backward over the full batch):
one per plain or accelerated step, one per closure call of ``torch.optim.LBFGS`` (its strong
Wolfe line search calls the closure once per trial point). Forward-only evaluations are the
safeguard's ``loss_fn`` calls (two per mixing call of ``aa.anderson``); ``forward_cost`` is a
fixed convention per problem, stated in each example next to the measured time ratio.

A *trace* records, for each iterate whose loss became known, the evaluations spent so far
(including the one that computed that loss), the training seconds so far, and the loss. For
gradient methods the iterate is ``x_k`` and its loss comes with the gradient at ``x_k``; for
L-BFGS it is the best point evaluated so far, which is the point the line search accepts.
Seconds count the evaluations and the optimizer's own work; bookkeeping (per-iterate metrics,
test accuracy) is not timed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from _common import PlainOptimizer, finite_or_none, format_table
from torch import Tensor
from tqdm import tqdm

import aadl_func as aa


@dataclass
class Problem:
    """One seed's instance of a full-batch problem.

    ``loss_and_grad(params) -> (grads, loss)``; ``loss(params)``: the same loss without a graph
    (forward only); ``evaluate(params) -> dict``: untimed metrics of the final params (test
    accuracy, solution error); ``track(params) -> float``: an optional untimed metric recorded
    for every iterate of the trace (``None``: not tracked). ``clock``: the process's CPU time
    by default. With one torch thread it equals the wall time on an idle machine, and other
    jobs on a shared machine do not inflate it (pass ``time.perf_counter`` for wall time).
    ``stop(trace) -> bool``: ends a run before its budget once it returns True (the
    full-batch suite stops at its last target; ``None``: runs spend the whole budget).
    """

    initial: dict[str, Tensor]
    loss_and_grad: Callable
    loss: Callable
    evaluate: Callable
    forward_cost: float
    track: Callable | None = None
    clock: Callable[[], float] = time.process_time
    stop: Callable[[Trace], bool] | None = None

    def params(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.initial.items()}


@dataclass
class Trace:
    """Per known iterate: steps (updates or L-BFGS iterations), gradient and forward-only
    evaluations spent, training seconds, loss, and the tracked metric (or None)."""

    forward_cost: float
    steps: list[int] = field(default_factory=list)
    grads: list[int] = field(default_factory=list)
    forwards: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    metric: list[float | None] = field(default_factory=list)
    elapsed: float = 0.0  # training seconds so far, including work after the last entry

    def append(self, step, grads, forwards, seconds, loss, metric=None) -> None:
        self.steps.append(step)
        self.grads.append(grads)
        self.forwards.append(forwards)
        self.seconds.append(seconds)
        self.loss.append(loss)
        self.metric.append(metric)

    def equivalents(self, i: int) -> float:
        """Gradient-equivalents spent at entry ``i``."""
        return self.grads[i] + self.forward_cost * self.forwards[i]

    def first(self, values: Sequence[float | None], below: float) -> dict[str, Any] | None:
        """The costs at the first iterate whose value is below ``below`` (None if never)."""
        for i, value in enumerate(values):
            if value is not None and value < below:
                return {
                    "steps": self.steps[i],
                    "grads": self.grads[i],
                    "forwards": self.forwards[i],
                    "equivalents": self.equivalents(i),
                    "seconds": self.seconds[i],
                }
        return None


@dataclass(frozen=True)
class Method:
    """A row of the comparison. ``kind``: ``"functional"`` (``make()`` returns an object with
    ``init``/``update(state, params, grads, inplace=..., loss_fn=...)``; ``safeguard`` passes
    the forward-only loss as ``loss_fn``, ``deferred`` the loss computed with the gradient as
    ``loss=``, the deferred safeguard), ``"wrapper"`` (``make(params)`` returns a
    ``torch.optim``-style optimizer over the params' tensors, stepped as
    ``step(loss=value)`` after the gradients are written into ``.grad``), ``"lbfgs"``
    (``options`` for ``torch.optim.LBFGS``: ``lr``, ``history_size``, ``max_iter`` per
    ``step`` call), or ``"then-lbfgs"`` (``make()``
    for ``options["first_steps"]`` updates, then L-BFGS with ``options["lbfgs"]``)."""

    label: str
    kind: str
    make: Callable[[], Any] | None = None
    safeguard: bool = False
    deferred: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""


# The baselines both full-batch comparisons run (digits_demo.py, pinn.py).
def adam_method(lr: float, betas: tuple[float, float]) -> Method:
    return Method(
        "Adam",
        "functional",
        make=lambda: PlainOptimizer(aa.adam(lr, betas=betas)),
        options={"lr": lr, "betas": list(betas)},
        description=f"aa.adam({lr:g}, betas={betas})",
    )


def lbfgs_method(lr: float, history_size: int) -> Method:
    return Method(
        "L-BFGS",
        "lbfgs",
        options={"lr": lr, "history_size": history_size, "max_iter": 20},
        description=(
            f"torch.optim.LBFGS(lr={lr:g}, history_size={history_size}, max_iter=20, "
            'line_search_fn="strong_wolfe")'
        ),
    )


# The short recurrence's one setting for every full-batch problem: around Adam without
# momentum at this lr, chosen on the full-batch suite's tuning seeds
# (benchmarks/fullbatch/methods.py); the demo's ``--short`` runs it untuned.
ST_AM_LR = 0.03


def st_am_method(lr: float, label: str, inner: str = "adam", max_wait: int = 0) -> Method:
    """``aa.short_recurrence`` around ``aa.adam(lr, betas=(0.0, 0.999))`` (or, with
    ``inner="sgd"``, ``aa.sgd(lr)``), judged by the deferred safeguard
    (``update(..., loss=train_loss)``), with the waits after rejections of ``max_wait``."""
    text = f"aa.adam({lr:g}, betas=(0.0, 0.999))" if inner == "adam" else f"aa.sgd({lr:g})"
    waits = f", max_wait={max_wait}" if max_wait else ""

    def make():
        step = aa.adam(lr, betas=(0.0, 0.999)) if inner == "adam" else aa.sgd(lr)
        return aa.short_recurrence(step, max_wait=max_wait)

    return Method(
        label,
        "functional",
        make=make,
        deferred=True,
        options={"inner": text, "safeguard": "deferred", "max_wait": max_wait},
        description=f"aa.short_recurrence({text}{waits}), update(..., loss=train_loss)",
    )


# The safeguards of the AA rows: none, the deferred one (``update(..., loss=value)``, the
# loss computed with the gradient) and the ``loss_fn`` one (two forward passes per mix).
SAFEGUARDS = {
    "none": ("AA", ", no safeguard"),
    "deferred": ("AA + deferred safeguard", ", update(..., loss=train_loss)"),
    "loss_fn": ("AA + loss_fn safeguard", ", update(..., loss_fn=train_loss)"),
}


def aa_row(safeguard: str) -> tuple[str, str, dict[str, bool]]:
    """An AA row's label, the words its description ends with and its :class:`Method` flags."""
    label, usage = SAFEGUARDS[safeguard]
    return label, usage, {"safeguard": safeguard == "loss_fn", "deferred": safeguard == "deferred"}


def _track(problem: Problem, params) -> float | None:
    return None if problem.track is None else problem.track(params)


def _stopped(problem: Problem, trace: Trace) -> bool:
    return problem.stop is not None and bool(trace.grads) and problem.stop(trace)


def _trace(
    problem: Problem,
    params: dict[str, Tensor],
    budget: float,
    step: Callable[[dict[str, Tensor], dict[str, Tensor], Tensor], dict[str, Tensor]],
    forwards: Callable[[], int] = lambda: 0,
    max_steps: int | None = None,
) -> tuple[Trace, dict[str, Tensor]]:
    """The loop of the full-batch runs: the loss and gradients at ``params``, then
    ``params = step(params, grads, loss)`` (timed with them), until ``budget``
    gradient-equivalents are spent, the loss is not finite, the problem stops the run, or
    ``max_steps`` steps were taken (the last params not evaluated then). ``forwards()``: the
    forward-only evaluations spent so far. Returns the trace and the last params."""
    trace = Trace(problem.forward_cost)
    clock = problem.clock
    k = 0
    while True:
        start = clock()
        grads, loss = problem.loss_and_grad(params)
        value = loss.item()
        trace.elapsed += clock() - start
        trace.append(k, k + 1, forwards(), trace.elapsed, value, _track(problem, params))
        if trace.equivalents(-1) >= budget or not math.isfinite(value):
            break
        if _stopped(problem, trace):
            break
        start = clock()
        params = step(params, grads, loss)
        trace.elapsed += clock() - start
        k += 1
        if k == max_steps:  # params: x_k, not evaluated yet
            break
    return trace, params


def run_functional(
    problem: Problem,
    optimizer: Any,
    budget: float,
    *,
    safeguard: bool = False,
    deferred: bool = False,
    max_steps: int | None = None,
) -> tuple[Trace, dict[str, Tensor], dict[str, int]]:
    """Full-batch updates from the problem's initial weights until ``budget``
    gradient-equivalents are spent (or after ``max_steps`` updates)."""
    params = problem.params()
    forwards = [0]

    def loss_fn(p):
        forwards[0] += 1
        return problem.loss(p)

    state = optimizer.init(params)

    def step(params, grads, loss):
        nonlocal state
        judge = {"loss_fn": loss_fn} if safeguard else {"loss": loss} if deferred else {}
        params, state = optimizer.update(state, params, grads, inplace=True, **judge)
        return params

    trace, params = _trace(problem, params, budget, step, lambda: forwards[0], max_steps)
    counters = {}
    if isinstance(state, aa.AndersonState):
        names = ("num_mixed", "num_rejected", "num_nonfinite")
        counters = {name: int(getattr(state, name)) for name in names}
    elif isinstance(state, aa.ShortRecurrenceState):
        counters = {name: int(getattr(state, name)) for name in ("num_rejected", "num_restarts")}
    return trace, params, counters


def run_wrapper(
    problem: Problem, make: Callable[[list[Tensor]], Any], budget: float
) -> tuple[Trace, dict[str, Tensor], dict[str, int]]:
    """Full-batch steps of a ``torch.optim``-style optimizer (``aa.AcceleratedOptimizer``
    with ``safeguard="deferred"``) from the problem's initial weights until ``budget``
    gradient evaluations are spent: the gradients are written into ``.grad`` and the loss
    computed with them is passed as ``step(loss=value)``, as a training loop would."""
    params = problem.params()
    leaves = list(params.values())
    optimizer = make(leaves)

    def step(params, grads, loss):
        for p, g in zip(leaves, grads.values()):
            p.grad = g
        optimizer.step(loss=loss)
        return params

    trace, params = _trace(problem, params, budget, step)
    names = ("num_mixed", "num_rejected", "num_nonfinite")
    states = [s for s in optimizer.anderson_states if s is not None]
    counters = {name: sum(int(getattr(s, name)) for s in states) for name in names}
    return trace, params, counters


def run_lbfgs(
    problem: Problem,
    budget: float,
    *,
    lr: float = 1.0,
    history_size: int = 10,
    max_iter: int = 20,
    params: dict[str, Tensor] | None = None,
    trace: Trace | None = None,
    first_step: int = 0,
) -> tuple[Trace, dict[str, Tensor], dict[str, int]]:
    """``torch.optim.LBFGS`` with the strong Wolfe line search: ``step(closure)`` is called
    with ``max_iter`` iterations (and at most ``max_iter * 5 // 4`` closure calls, torch's
    default, capped by what is left of the budget) until the budget is spent or L-BFGS stops
    moving (its tolerances). Each closure call is one gradient evaluation, counted; the
    trace's loss is the lowest loss evaluated so far (the accepted point).

    ``params``, ``trace`` and ``first_step`` continue a run that another optimizer began
    (the trace's counts and seconds go on from where it stopped)."""
    params = problem.params() if params is None else params
    leaves = list(params.values())
    optimizer = torch.optim.LBFGS(
        leaves, lr=lr, history_size=history_size, max_iter=max_iter,
        line_search_fn="strong_wolfe",
    )  # fmt: skip
    trace = Trace(problem.forward_cost) if trace is None else trace
    clock = problem.clock
    grads0 = trace.grads[-1] if trace.grads else 0
    forwards0 = trace.forwards[-1] if trace.forwards else 0
    calls = [0]
    best = [math.inf, None]
    since = [0.0]  # when the current timed stretch began

    def closure():
        grads, loss = problem.loss_and_grad(params)
        for p, g in zip(leaves, grads.values()):
            p.grad = g
        value = loss.item()
        trace.elapsed += clock() - since[0]
        calls[0] += 1
        if value < best[0]:
            best[:] = [value, _track(problem, params)]
        iteration = optimizer.state[leaves[0]].get("n_iter", 0)
        trace.append(first_step + iteration, grads0 + calls[0], forwards0, trace.elapsed, *best)
        since[0] = clock()  # tracking is not timed
        return loss

    while (not trace.grads or trace.equivalents(-1) < budget) and not _stopped(problem, trace):
        left = budget - (trace.equivalents(-1) if trace.grads else 0.0)
        optimizer.param_groups[0]["max_eval"] = max(1, min(max_iter * 5 // 4, math.ceil(left)))
        before = calls[0]
        since[0] = clock()
        optimizer.step(closure)
        trace.elapsed += clock() - since[0]
        if calls[0] == before + 1:  # converged to its tolerances: it no longer moves
            break
    return trace, params, {"closure_calls": calls[0]}


def run_method(method: Method, problem: Problem, budget: float):
    """Runs ``method`` on ``problem``; returns ``(trace, final params, counters)``."""
    if method.kind == "functional":
        return run_functional(
            problem, method.make(), budget, safeguard=method.safeguard, deferred=method.deferred
        )
    if method.kind == "wrapper":
        return run_wrapper(problem, method.make, budget)
    if method.kind == "lbfgs":
        return run_lbfgs(problem, budget, **method.options)
    if method.kind == "then-lbfgs":
        steps = method.options["first_steps"]
        trace, params, _ = run_functional(problem, method.make(), budget, max_steps=steps)
        return run_lbfgs(
            problem, budget, params=params, trace=trace, first_step=steps,
            **method.options["lbfgs"],
        )  # fmt: skip
    raise ValueError(f"unknown kind {method.kind!r}")


def run_seed(method: Method, problem: Problem, budget: float, targets: dict[str, Sequence]):
    """One run, summarised: costs to each target, final loss and the problem's metrics.

    ``targets``: ``{"loss": [...], "metric": [...]}`` thresholds on the trace's loss and on
    its tracked metric."""
    trace, params, counters = run_method(method, problem, budget)
    with torch.no_grad():
        final_loss = problem.loss(params).item()
    result: dict[str, Any] = {
        "final_loss": finite_or_none(final_loss),
        **{name: finite_or_none(v) for name, v in problem.evaluate(params).items()},
        "steps": trace.steps[-1],
        "grads": trace.grads[-1],
        "forwards": trace.forwards[-1],
        "equivalents": trace.equivalents(-1),
        "seconds": trace.elapsed,
        **counters,
    }
    for kind, values in (("loss", trace.loss), ("metric", trace.metric)):
        for target in targets.get(kind, ()):
            result[f"{kind}<{target:g}"] = trace.first(values, target)
    result["curve"] = {
        "equivalents": [trace.equivalents(i) for i in range(len(trace.grads))],
        "seconds": trace.seconds,
        "loss": [finite_or_none(v) for v in trace.loss],
        **({"metric": [finite_or_none(v) for v in trace.metric]} if problem.track else {}),
    }
    return result


# -- statistics over seeds -----------------------------------------------------------------
def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and sample standard deviation of the values that are not None, and their count."""
    got = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(got) if got else None,
        "std": statistics.stdev(got) if len(got) > 1 else 0.0 if got else None,
        "count": len(got),
        "of": len(values),
    }


def median_range(values: Sequence[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    return {
        "median": statistics.median(got) if got else None,
        "min": min(got) if got else None,
        "max": max(got) if got else None,
        "count": len(got),
        "of": len(values),
    }


def summarize(runs: Sequence[dict[str, Any]], target_keys: Sequence[str], metrics: Sequence[str]):
    """Statistics of one method over seeds: counts as mean +- std over the seeds that reach
    each target (with how many did), seconds as median [min, max], the final loss as median
    [min, max], the metrics as mean +- std."""
    stats: dict[str, Any] = {}
    for key in target_keys:
        reached = [r[key] for r in runs]
        stats[key] = {
            cost: mean_std([None if x is None else x[cost] for x in reached])
            for cost in ("steps", "grads", "forwards", "equivalents")
        }
        stats[key]["seconds"] = median_range([None if x is None else x["seconds"] for x in reached])
    stats["final_loss"] = median_range([r["final_loss"] for r in runs])
    for metric in metrics:
        stats[metric] = mean_std([r[metric] for r in runs])
    stats["seconds"] = median_range([r["seconds"] for r in runs])
    return stats


def fmt_mean(stat: dict[str, Any], spec: str = ".0f", scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "-"
    text = f"{scale * stat['mean']:{spec}} ± {scale * stat['std']:{spec}}"
    if stat["count"] < stat["of"]:
        text += f" ({stat['count']}/{stat['of']})"
    return text


def fmt_median(stat: dict[str, Any], spec: str = ".2f") -> str:
    if stat["median"] is None:
        return "-"
    text = f"{stat['median']:{spec}} [{stat['min']:{spec}}, {stat['max']:{spec}}]"
    if stat["count"] < stat["of"]:
        text += f" ({stat['count']}/{stat['of']})"
    return text


# -- tuning --------------------------------------------------------------------------------
def tuning_score(runs: Sequence[dict[str, Any]], target_key: str) -> tuple[float, float, float]:
    """The key tuning sorts by (lower is better): first, how many tuning seeds miss the target
    loss; then the mean gradient-equivalents to it; then the mean log10 of the final loss."""
    missed = sum(r[target_key] is None for r in runs)
    spent = [r[target_key]["equivalents"] for r in runs if r[target_key] is not None]
    finals = [r["final_loss"] for r in runs]
    if any(f is None for f in finals):  # diverged
        return (missed, statistics.fmean(spent) if spent else math.inf, math.inf)
    mean_log = statistics.fmean(math.log10(max(f, 1e-30)) for f in finals)
    return (missed, statistics.fmean(spent) if spent else math.inf, mean_log)


def measure_forward_ratio(problem: Problem, repeats: int = 20) -> float:
    """Seconds of a forward-only loss over seconds of a gradient evaluation, at the initial
    weights (medians of ``repeats`` calls each)."""
    params = problem.params()

    def median_seconds(fn) -> float:
        times = []
        for _ in range(repeats):
            start = problem.clock()
            fn(params)
            times.append(problem.clock() - start)
        return statistics.median(times)

    problem.loss_and_grad(params)
    with torch.no_grad():
        problem.loss(params)
        forward = median_seconds(problem.loss)
    return forward / median_seconds(problem.loss_and_grad)


# -- the comparison: runs, statistics, report, tuning, plot -----------------------------------
@dataclass(frozen=True)
class Comparison:
    """What an example compares: targets on the training loss (and on the tracked metric),
    the tuning target, the final metrics to show, and which rows are baselines and which are
    accelerated (for the verdict, taken at ``verdict_key``, e.g. ``"loss<0.01"``)."""

    loss_targets: tuple[float, ...]
    tune_target: float
    verdict_key: str
    baselines: tuple[str, ...]
    accelerated: tuple[str, ...]
    final_metrics: dict[str, tuple[str, float, str]]  # key -> (header, scale, format spec)
    metric_targets: tuple[float, ...] = ()
    metric_name: str = ""
    table_keys: tuple[str, ...] = ()  # the targets of the Markdown table (default: all)

    @property
    def target_keys(self) -> list[str]:
        return [f"loss<{t:g}" for t in self.loss_targets] + [
            f"metric<{t:g}" for t in self.metric_targets
        ]

    def targets(self) -> dict[str, Sequence[float]]:
        return {"loss": self.loss_targets, "metric": self.metric_targets}


def run_all(
    rows: dict[str, Method],
    problems: dict[int, Problem],
    budget: float,
    comparison: Comparison,
    progress: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Every method on every seed, seed by seed (so that load on the machine spreads over the
    methods), after an untimed warm-up of each method (first-call allocations, kernel
    selection, aadl_func's C kernel)."""
    first = next(iter(problems.values()))
    for method in rows.values():
        run_seed(method, first, 3, {})
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in rows}
    pairs = [(seed, key) for seed in problems for key in rows]
    for seed, key in tqdm(pairs, desc="runs", disable=not progress, leave=False):
        result = run_seed(rows[key], problems[seed], budget, comparison.targets())
        runs[key].append({"seed": seed, **result})
    return runs


def verdict(stats: dict[str, Any], comparison: Comparison) -> dict[str, Any]:
    """The accelerated rows against the best baseline at ``comparison.verdict_key``: mean
    gradient-equivalents and median seconds, over rows that get there on every seed."""
    key = comparison.verdict_key

    def cost(name: str, what: str) -> float | None:
        stat = stats[name][key][what]
        if stat["count"] < stat["of"]:
            return None
        return stat["mean"] if what == "equivalents" else stat["median"]

    result: dict[str, Any] = {"target": key}
    for what in ("equivalents", "seconds"):
        baselines = {n: cost(n, what) for n in comparison.baselines}
        baselines = {n: c for n, c in baselines.items() if c is not None}
        best = min(baselines, key=baselines.get) if baselines else None
        entry: dict[str, Any] = {"best_baseline": best, "best_baseline_cost": baselines.get(best)}
        for name in comparison.accelerated:
            c = cost(name, what)
            entry[name] = c
            entry[f"{name}_wins"] = c is not None and (best is None or c <= baselines[best])
        result[what] = entry
    return result


def summarize_runs(
    runs: dict[str, list[dict[str, Any]]], comparison: Comparison
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-row statistics over seeds, and the verdict."""
    stats = {
        key: summarize(rs, comparison.target_keys, list(comparison.final_metrics))
        for key, rs in runs.items()
    }
    return stats, verdict(stats, comparison)


def _target_label(key: str, comparison: Comparison) -> str:
    kind, value = key.split("<")
    return f"loss {value}" if kind == "loss" else f"{comparison.metric_name} {value}"


def report(summary: dict[str, Any], rows: dict[str, Method], comparison: Comparison) -> None:
    """Prints the settings, the table over seeds, the per-seed table and the verdict."""
    stats, runs, config = summary["stats"], summary["runs"], summary["config"]
    print(
        f"\n{len(config['seeds'])} seed(s), budget {config['budget']:g} gradient-equivalents "
        f"(a forward-only loss counts {config['forward_cost']:.3g}; measured time ratio "
        f"forward/gradient: {config['measured_forward_ratio']:.2f}); "
        f"seconds are {config['clock']}\n"
    )
    for method in rows.values():
        print(f"{method.label:>15}: {method.description}")
    print(
        "\ncosts to each target: mean ± std over the seeds that reach it (count if not all); "
        "seconds: median [min, max]\n"
    )
    header = ["method", "target", "grad-eq", "grads + fwd", "steps", "seconds"]
    table = []
    for key, method in rows.items():
        s = stats[key]
        for k in comparison.target_keys:
            grads, forwards = s[k]["grads"]["mean"], s[k]["forwards"]["mean"]
            table.append([
                method.label, _target_label(k, comparison), fmt_mean(s[k]["equivalents"], ".1f"),
                "-" if grads is None else f"{grads:.1f} + {forwards:.1f}",
                fmt_mean(s[k]["steps"], ".1f"), fmt_median(s[k]["seconds"]),
            ])  # fmt: skip
    print(format_table(header, table))
    header = ["method", "final loss", *(h for h, _, _ in comparison.final_metrics.values())]
    header += ["seconds for the budget"]
    table = []
    for key, method in rows.items():
        s = stats[key]
        table.append([
            method.label, fmt_median(s["final_loss"], ".1e"),
            *(fmt_mean(s[m], spec, scale) for m, (_, scale, spec) in
              comparison.final_metrics.items()),
            fmt_median(s["seconds"]),
        ])  # fmt: skip
    print()
    print(format_table(header, table))

    print("\nper seed: gradient-equivalents / seconds to each target")
    per_seed = []
    for key, method in rows.items():
        for run in runs[key]:
            cells = [method.label, run["seed"]]
            for k in comparison.target_keys:
                hit = run[k]
                cells += ["-", "-"] if hit is None else [hit["equivalents"], hit["seconds"]]
            cells.append(run["final_loss"])
            for metric, (_, scale, _) in comparison.final_metrics.items():
                cells.append(scale * run[metric])
            if "num_mixed" in run:
                cells.append(f"{run['num_mixed']} kept / {run['num_rejected']} rejected")
            elif "closure_calls" in run:
                cells.append(f"{run['closure_calls']} L-BFGS closure calls")
            else:
                cells.append("")
            per_seed.append(cells)
    header = ["method", "seed"]
    for k in comparison.target_keys:
        header += [f"{k}: grad-eq", "seconds"]
    header += ["final loss"] + [h for h, _, _ in comparison.final_metrics.values()] + [""]
    print(format_table(header, per_seed))

    v = summary["verdict"]
    for what, unit in (("equivalents", "gradient-equivalents (mean)"), ("seconds", "s (median)")):
        r = v[what]
        best = r["best_baseline"]
        line = f"\nto {_target_label(v['target'], comparison)}, {unit}: best baseline "
        line += "none" if best is None else f"{rows[best].label} {r['best_baseline_cost']:.3g}"
        for name in comparison.accelerated:
            c = r[name]
            won = "wins" if r[f"{name}_wins"] else "loses"
            line += f"; {rows[name].label} {'-' if c is None else f'{c:.3g}'} ({won})"
        print(line)


def markdown(summary: dict[str, Any], rows: dict[str, Method], comparison: Comparison) -> str:
    """The comparison as a Markdown table (the README's and docs/benchmarks.md's tables):
    gradient-equivalents to each target (gradient + forward-only evaluations where there are
    forward-only ones), steps and seconds to the verdict's target, the final loss and metrics.
    Mean ± std over seeds (a count where not every seed got there); seconds and the final loss:
    median [min, max]."""
    stats = summary["stats"]
    keys = list(comparison.table_keys or comparison.target_keys)
    header = ["method"]
    for k in keys:
        name = _target_label(k, comparison)
        header.append(f"grad-eq to {name}")
        if k == comparison.verdict_key:
            header += [f"steps to {name}", f"seconds to {name}"]
    header += ["final loss", *(h for h, _, _ in comparison.final_metrics.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, method in rows.items():
        s = stats[key]
        cells = [method.label]
        for k in keys:
            grads, forwards = s[k]["grads"]["mean"], s[k]["forwards"]["mean"]
            equivalents = fmt_mean(s[k]["equivalents"], ".1f")
            if grads is not None and forwards:
                equivalents += f" ({grads:.1f} + {forwards:.1f})"
            cells.append(equivalents)
            if k == comparison.verdict_key:
                cells += [fmt_mean(s[k]["steps"], ".1f"), fmt_median(s[k]["seconds"])]
        cells.append(fmt_median(s["final_loss"], ".1e"))
        cells += [fmt_mean(s[m], spec, scale) for m, (_, scale, spec) in
                  comparison.final_metrics.items()]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tune(
    grids: dict[str, list[Method]],
    problems: dict[int, Problem],
    budget: float,
    comparison: Comparison,
    progress: bool = False,
) -> dict[str, Any]:
    """Runs every setting of every grid on the tuning problems, prints each grid by
    :func:`tuning_score` and returns the results (the first setting of each is the chosen)."""
    key = f"loss<{comparison.tune_target:g}"
    results: dict[str, Any] = {}
    for family, grid in grids.items():
        scored = []
        for method in tqdm(grid, desc=family, disable=not progress, leave=False):
            runs = [
                run_seed(method, p, budget, {"loss": [comparison.tune_target]})
                for p in problems.values()
            ]
            for r in runs:
                del r["curve"]
            scored.append((tuning_score(runs, key), method, runs))
        scored.sort(key=lambda x: x[0])
        results[family] = {
            "chosen": scored[0][1].description,
            "settings": [
                {
                    "description": method.description,
                    "options": method.options,
                    "score": [finite_or_none(x) for x in score],
                    "runs": runs,
                }
                for score, method, runs in scored
            ],
        }
        print(f"\n{family}: seeds {list(problems)}, budget {budget:g}, best first")
        header = ["setting", f"seeds missing {key}", f"grad-eq to {key}", "mean log10 final loss"]
        rows = [[m.description, *score] for score, m, _ in scored]
        print(format_table(header, rows))
    return results


def plot(
    path: str,
    rows: dict[str, Method],
    runs: dict[str, list[dict[str, Any]]],
    comparison: Comparison,
) -> None:
    """Training loss (and the tracked metric, if any) against gradient-equivalents and
    seconds, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("loss", "equivalents"), ("loss", "seconds")]
    if comparison.metric_name:
        panels.append(("metric", "equivalents"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    for i, (key, method) in enumerate(rows.items()):
        for j, run in enumerate(runs[key]):
            curve = run["curve"]
            for ax, (y, x) in zip(axes, panels):
                values = [float("nan") if v is None else v for v in curve[y]]
                label = method.label if j == 0 and ax is axes[0] else None
                ax.semilogy(curve[x], values, color=f"C{i}", lw=1, label=label)
    names = {"equivalents": "gradient-equivalents", "seconds": "training seconds"}
    for ax, (y, x) in zip(axes, panels):
        for t in comparison.loss_targets if y == "loss" else comparison.metric_targets:
            ax.axhline(t, color="gray", linestyle=":", lw=1)
        ylabel = "full-batch training loss" if y == "loss" else comparison.metric_name
        ax.set(xlabel=names[x], ylabel=ylabel, title=f"{ylabel} (one line per seed)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

r"""The full-batch suite: every problem, every row tuned alike, 3 seeds; a table per problem,
``results.json`` and the page ``docs/fullbatch.md``.

Usage (from the repository root; ``make fullbatch``)::

    python -m benchmarks.fullbatch.run                      # the suite (about 30 minutes)
    python -m benchmarks.fullbatch.run --quick              # 1 seed, tiny budgets and grids
    python -m benchmarks.fullbatch.run --recompute-f-star   # the long float64 runs first
    python -m benchmarks.fullbatch.run --problems a,b --out part.json  # a part; --combine

What is counted: every gradient evaluation (one per step of GD, Adam and AA, including the ones
at mixes the deferred safeguard then rejects; one per closure call of L-BFGS, its line search
included) and forward-only loss evaluations (none of these rows makes one), each through a
counting wrapper around the objective that must agree with what the run's trace reports; and
the process's CPU seconds of the run (one torch thread). Costs to a target are those at the
first evaluated point that meets it (for L-BFGS, the best point so far). A run stops at its
budget or once it meets its last target.

Targets: the relative suboptimality $(f - f^*)/|f^*| \le 10^{-2}, 10^{-4}, 10^{-6}$ on the loss
problems ($f^*$: ``f_star.json``, see ``reference.py``), the relative $L^2$ error
$\le 10^{-2}, 10^{-3}$ on the PINNs. Tuning: each family's grid (``methods.py``) on the tuning
seeds with the tuning budget, by the middle target (PINNs: the last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from _common import finite_or_none, format_table, write_json
from _compare import Method, Problem, mean_std, run_method, tuning_score

from . import (
    autoencoder,
    burgers_pinn,
    digits_cnn,
    methods,
    mlp_regression,
    poisson_pinn,
    reference,
    rosenbrock,
    softmax,
)
from .problem import Spec

HERE = os.path.dirname(os.path.abspath(__file__))
F_STAR_PATH = os.path.join(HERE, "f_star.json")
SPECS = {
    spec.key: spec
    for spec in (
        digits_cnn.SPEC, softmax.SPEC, mlp_regression.SPEC, autoencoder.SPEC,
        rosenbrock.SPEC, poisson_pinn.SPEC, burgers_pinn.SPEC,
    )
}  # fmt: skip
SEEDS = (0, 1, 2)
TUNING_SEEDS = (100, 101)
LOSS_TOLERANCES = (1e-2, 1e-4, 1e-6)
L2_TOLERANCES = (1e-2, 1e-3)
BUDGET = 1000  # gradient evaluations per reported run
TUNING_BUDGET = 300
# The CNN's gradient costs ~10x the others' (1,347 images through two convolutions).
CNN_BUDGET, CNN_TUNING_BUDGET = 200, 80
# Evaluations of the long float64 L-BFGS runs (reference.py); the CNN's cost ~0.2 s each.
F_STAR_EVALS = {"digits_cnn": 600, "autoencoder": 8000}  # the others: 3000


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a run from one seed is judged by: ``labels`` and, per trace entry, the ``value``
    compared with each threshold (relative suboptimality against the seed's ``f_star``, or the
    relative L2 error)."""

    spec: Spec
    f_star: float | None

    @property
    def tolerances(self) -> tuple[float, ...]:
        return L2_TOLERANCES if self.spec.pinn else LOSS_TOLERANCES

    @property
    def labels(self) -> list[str]:
        name = "L2 error" if self.spec.pinn else "rel. subopt."
        return [f"{name} {t:.0e}" for t in self.tolerances]

    @property
    def tuning_index(self) -> int:
        return -1 if self.spec.pinn else 1

    def denominator(self) -> float:
        return self.spec.scale if self.spec.zero_minimum else abs(self.f_star)

    def value(self, loss: float | None, metric: float | None) -> float | None:
        if self.spec.pinn:
            return metric
        if loss is None or not math.isfinite(loss):
            return None
        return (loss - self.f_star) / self.denominator()

    def stop_at(self, tolerance: float):
        """``Problem.stop``: the trace's last entry meets ``tolerance``."""

        def stop(trace) -> bool:
            value = self.value(trace.loss[-1], trace.metric[-1])
            return value is not None and value <= tolerance

        return stop


def counted(problem: Problem) -> tuple[Problem, dict[str, int]]:
    """The problem with its gradient and forward-only evaluations counted outside the
    comparison machinery (the count the trace must agree with)."""
    counts = {"gradients": 0, "forwards": 0}

    def loss_and_grad(params):
        counts["gradients"] += 1
        return problem.loss_and_grad(params)

    def loss(params):
        counts["forwards"] += 1
        return problem.loss(params)

    return dataclasses.replace(problem, loss_and_grad=loss_and_grad, loss=loss), counts


def run_once(method: Method, problem: Problem, budget: float, targets: Targets, stop_tol: float):
    """One counted run: costs to each target, the best value reached, the counts."""
    problem, counts = counted(dataclasses.replace(problem, stop=targets.stop_at(stop_tol)))
    trace, params, counters = run_method(method, problem, budget)
    values = [targets.value(loss, metric) for loss, metric in zip(trace.loss, trace.metric)]
    reached: dict[str, Any] = {}
    for label, tolerance in zip(targets.labels, targets.tolerances):
        hit = next((i for i, v in enumerate(values) if v is not None and v <= tolerance), None)
        # A target's cost in gradient-equivalents: a forward-only loss evaluation (the
        # line search's) counts `forward_cost` (1 in this suite), so rows are compared alike.
        reached[label] = None if hit is None else {
            "gradients": trace.equivalents(hit), "forwards": trace.forwards[hit],
            "seconds": trace.seconds[hit],
        }  # fmt: skip
    finite = [v for v in trace.loss if math.isfinite(v)]
    result = {
        "gradients": trace.grads[-1],
        "forwards": trace.forwards[-1],
        "counted_gradients": counts["gradients"],
        "counted_forwards": counts["forwards"],
        "seconds": trace.elapsed,
        "lowest_loss": finite_or_none(min(finite)) if finite else None,
        "best_value": finite_or_none(min((v for v in values if v is not None), default=None)),
        "targets": reached,
        **counters,
    }
    if "num_rejected" in counters:
        # With the deferred safeguard a rejected mix costs the gradient taken at it.
        result["rejected_share"] = counters["num_rejected"] / trace.grads[-1]
    return result


def targets_of(spec: Spec, f_star: dict[str, float] | None, seed: int) -> Targets:
    return Targets(spec, None if f_star is None else f_star[str(seed)])


def tune(
    spec: Spec, f_star, seeds, budget: float, quick: bool, families: Sequence[str] | None = None
) -> dict[str, Any]:
    """Each family's grid (or the ``families``' only) on the tuning seeds; the chosen
    setting first."""
    problems = [(spec.make(seed, spec.dtype), targets_of(spec, f_star, seed)) for seed in seeds]
    tolerance = problems[0][1].tolerances[problems[0][1].tuning_index]
    label = problems[0][1].labels[problems[0][1].tuning_index]
    chosen: dict[str, Any] = {}
    for family, grid in methods.grids(spec).items():
        if families is not None and family not in families:
            continue
        if quick:
            grid = grid[::3]
        scored = []
        for method in grid:
            runs = []
            for problem, targets in problems:
                r = run_once(method, problem, budget, targets, tolerance)
                # tuning_score's fields: the cost to the target and the final loss.
                hit = r["targets"][label]
                runs.append({
                    "target": None if hit is None else {"equivalents": hit["gradients"]},
                    "final_loss": r["lowest_loss"],
                })  # fmt: skip
            scored.append((tuning_score(runs, "target"), method))
        scored.sort(key=lambda x: x[0])
        chosen[family] = {
            "method": scored[0][1],
            "grid": [
                {"description": m.description, "score": [finite_or_none(x) for x in score]}
                for score, m in scored
            ],
        }
    return chosen


# The accelerated rows without tuning, by key.
DEFAULTS = {
    "aa_default": methods.aa_default,
    "aa_sufficient": methods.aa_sufficient,
    "aa_line_search": methods.aa_line_search,
    "aa_float64_window": methods.aa_float64_window,
    "aa_restart": methods.aa_restart,
    "aa_lbfgs_default": methods.aa_lbfgs_default,
    "st_am_default": methods.st_am_default,
    "st_am_waits": methods.st_am_waits,
}


def rows_for(spec: Spec, chosen: dict[str, Any]) -> dict[str, Method]:
    """The peers as tuned, then the accelerated rows in the suite's order."""
    rows = {k: e["method"] for k, e in chosen.items() if k not in methods.TUNED_ROWS}
    for key in methods.ACCELERATED:
        rows[key] = DEFAULTS[key]() if key in DEFAULTS else chosen[key]["method"]
    return rows


def run_problem(spec: Spec, f_star, args: argparse.Namespace) -> dict[str, Any]:
    """Tuning, then every row on every reported seed. ``f_star``: per seed (None: a PINN)."""
    start = time.perf_counter()
    targets = targets_of(spec, f_star, args.seeds[0])  # the seed-independent parts
    cnn = spec.key == "digits_cnn"
    budget = args.budget or (CNN_BUDGET if cnn else BUDGET)
    tuning_budget = args.tuning_budget or (CNN_TUNING_BUDGET if cnn else TUNING_BUDGET)
    chosen = tune(spec, f_star, args.tuning_seeds, tuning_budget, args.quick)
    rows = rows_for(spec, chosen)
    problems = {seed: spec.make(seed, spec.dtype) for seed in args.seeds}
    for method in rows.values():  # warm-up, untimed: first-call allocations, the C kernel
        run_once(method, problems[args.seeds[0]], 3, targets, 0.0)
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in rows}
    for seed, problem in problems.items():  # seed by seed: load on the machine spreads
        seed_targets = targets_of(spec, f_star, seed)
        for key, method in rows.items():
            result = run_once(method, problem, budget, seed_targets, targets.tolerances[-1])
            runs[key].append({"seed": seed, **result})
    return {
        "title": spec.title,
        "kind": "pinn" if spec.pinn else "loss",
        "dtype": str(spec.dtype).removeprefix("torch."),
        "num_params": sum(p.numel() for p in problems[args.seeds[0]].initial.values()),
        "f_star": f_star,
        "denominator": spec.scale if spec.zero_minimum else None,  # None: |f*|
        "budget": budget,
        "tuning_budget": tuning_budget,
        "targets": targets.labels,
        "tuning_target": targets.labels[targets.tuning_index],
        "methods": {
            key: {"label": m.label, "description": m.description} for key, m in rows.items()
        },
        "tuning": {
            family: {"chosen": entry["method"].description, "grid": entry["grid"]}
            for family, entry in chosen.items()
        },
        "runs": runs,
        "stats": {key: statistics_of(rs, targets.labels) for key, rs in runs.items()},
        "suite_seconds": time.perf_counter() - start,
    }


def statistics_of(runs: Sequence[dict[str, Any]], labels: Sequence[str]) -> dict[str, Any]:
    """Per target: gradients and seconds, mean ± std over the seeds that reach it."""
    stats: dict[str, Any] = {}
    for label in labels:
        hits = [r["targets"][label] for r in runs]
        stats[label] = {
            what: mean_std([None if h is None else h[what] for h in hits])
            for what in ("gradients", "seconds")
        }
    stats["best_value"] = statistics.median(
        [r["best_value"] if r["best_value"] is not None else math.inf for r in runs]
    )
    shares = [r["rejected_share"] for r in runs if "rejected_share" in r]
    stats["rejected_share"] = statistics.fmean(shares) if shares else None
    return finite_dict(stats)


def finite_dict(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: finite_dict(v) for k, v in value.items()}
    if isinstance(value, float):
        return finite_or_none(value)
    return value


# -- report ----------------------------------------------------------------------------------
def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """A row per method: per target, evaluations and seconds (mean ± std over the seeds that
    reach it, their count if not all), the median best value reached, AA's rejected share."""
    header = ["method", *result["targets"], "best reached", "rejected"]
    rows = []
    for key, method in result["methods"].items():
        s = result["stats"][key]
        cells = [method["label"]]
        for label in result["targets"]:
            evals = s[label]["gradients"]
            if evals["mean"] is None:
                cells.append("not reached")
            else:
                seconds = s[label]["seconds"]
                text = f"{evals['mean']:.0f} ± {evals['std']:.0f}, "
                text += f"{seconds['mean']:.2f} ± {seconds['std']:.2f} s"
                if evals["count"] < evals["of"]:
                    text += f" ({evals['count']}/{evals['of']})"
                cells.append(text)
        best = s["best_value"]
        cells.append("-" if best is None else f"{best:.1e}")
        share = s["rejected_share"]
        cells.append("" if share is None else f"{100 * share:.0f}%")
        rows.append(cells)
    return header, rows


def comparisons(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target and AA row: the best peer (fewest mean evaluations; fewest mean seconds)
    among the peers that reach it on every seed, and the AA row's costs against it."""

    def full(key: str, label: str, what: str) -> float | None:
        s = result["stats"][key][label][what]
        return s["mean"] if s["count"] == s["of"] else None

    out = []
    for label in result["targets"]:
        entry: dict[str, Any] = {"target": label}
        for what in ("gradients", "seconds"):
            peers = {k: full(k, label, what) for k in result["methods"] if k in methods.PEERS}
            peers = {k: v for k, v in peers.items() if v is not None}
            best = min(peers, key=peers.get) if peers else None
            entry[what] = {"best_peer": best, "best_peer_cost": peers.get(best)}
            for key in accelerated(result):
                cost = full(key, label, what)
                entry[what][key] = cost
                entry[what][f"{key}_wins"] = cost is not None and (
                    best is None or cost <= peers[best]
                )
        out.append(entry)
    return out


def accelerated(result: dict[str, Any]) -> list[str]:
    """The accelerated rows a problem's result holds, in the suite's order (a results file
    made before a row joined the suite does not hold it)."""
    return [key for key in methods.ACCELERATED if key in result["methods"]]


def verdicts(results: dict[str, Any]) -> dict[str, list[str]]:
    """One line per problem and target, sorted into where AA default loses (to the best peer,
    in evaluations or in seconds, or by not reaching the target on every seed where a peer
    does), where an AA row wins, and where no row reached it on every seed."""
    out: dict[str, list[str]] = {"loses": [], "wins": [], "nobody": []}
    for result in results.values():
        labels = {k: m["label"] for k, m in result["methods"].items()}
        name = result["title"].split(" (")[0]
        keys = accelerated(result)
        for c in result["comparisons"]:
            g, s = c["gradients"], c["seconds"]
            where = f"{name}, {c['target']}"
            if g["best_peer"] is None and all(g[k] is None for k in keys):
                out["nobody"].append(where)
                continue
            if g["best_peer"] is None:
                peer = "no peer reached it on every seed"
            else:
                peer = (
                    f"best peer {labels[g['best_peer']]} {g['best_peer_cost']:.0f} evaluations, "
                    f"{labels[s['best_peer']]} {s['best_peer_cost']:.2f} s"
                )
            rows = []
            for key in keys:
                if g[key] is None:
                    rows.append(f"{labels[key]} not on every seed")
                elif g["best_peer"] is None:
                    rows.append(f"{labels[key]} {g[key]:.0f} evaluations, {s[key]:.2f} s")
                else:
                    rows.append(
                        f"{labels[key]} {g[key] / g['best_peer_cost']:.2f}x the evaluations, "
                        f"{s[key] / s['best_peer_cost']:.2f}x the seconds"
                    )
            line = f"- {where}: {peer}; " + "; ".join(rows)
            wins = [k for k in keys if g[f"{k}_wins"] and s[f"{k}_wins"]]
            out["wins" if wins else "loses"].append(line)
            if wins and "aa_default" not in wins:
                out["loses"].append(line)
    return out


def markdown_page(payload: dict[str, Any]) -> str:
    """docs/fullbatch.md: where AA loses, where it wins, the regime in words
    (``summary.md``, written from the measurements), then a table per problem."""
    config, results = payload["config"], payload["problems"]
    out = [
        "# The full-batch suite",
        "",
        "<!-- Generated by `make fullbatch` (benchmarks/fullbatch/run.py) from "
        "benchmarks/fullbatch/results.json; edit benchmarks/fullbatch/summary.md for the "
        "words. -->",
        "",
        f"{len(results)} full-batch problems, {len(config['seeds'])} seed(s) of initial weights "
        f"({', '.join(map(str, config['seeds']))}), every row tuned on a grid of 6 settings on "
        f"other seeds ({', '.join(map(str, config['tuning_seeds']))}); every gradient "
        "evaluation counted (L-BFGS's line search and the gradients AA takes at mixes its "
        "safeguard rejects included). One torch thread, CPU seconds of the process, "
        f"on {config['machine']}.",
        "",
        "**AA default** is the line [guide.md](guide.md) recommends for full-batch training, "
        "the same on every problem: "
        '`aa.anderson(aa.adam(0.05, betas=(0.0, 0.999)), mode="classic", history_depth=20, '
        "reg_relative=1e-4)` called as `update(state, params, grads, loss=value)`. "
        "**AA tuned** is the same with its learning rate tuned like the peers'. "
        "**AA default, sufficient decrease** is AA default judged by Armijo's condition "
        "with the plain step as the yardstick: `" + methods.aa_sufficient().description + "`. "
        "**AA default, line search** is AA default with N-GMRES's step, the loss searched "
        "along the mix (every loss evaluation counted, the forward-mode derivative's too): `"
        + methods.aa_line_search().description
        + "`. "
        "**AA default, float64 window** is AA default with its window (residuals, iterates, "
        "Grams) in float64, the params and the inner step in the problem's dtype: `"
        + methods.aa_float64_window().description
        + "`. "
        + (
            "**AA default, restart on reject** is AA default whose window restarts from its "
            "newest pair whenever the safeguard rejects a mix: `"
            + methods.aa_restart().description
            + "`. "
            if any("aa_restart" in r["methods"] for r in results.values())
            else ""
        )
        + "**AA-L-BFGS default** is AA around the L-BFGS inner transformation (`aa.lbfgs`, no "
        "line search), the same on every problem: `"
        + methods.aa_lbfgs_default().description
        + "`; **AA-L-BFGS tuned** the same with its lr tuned, and **L-BFGS inner alone** "
        "the transformation without AA, its lr tuned. "
        "**ST-AM default** is short-term recurrence Anderson mixing (`aa.short_recurrence`: "
        "two conjugate pairs, preconditioned CG's iterates on a quadratic) around Adam, the "
        "same on every "
        "problem: `" + methods.st_am_default().description + "`; **ST-AM default, waits** "
        "the same with waits after rejected mixes (`max_wait`): `"
        + methods.st_am_waits().description
        + "`; **ST-AM tuned** the same as ST-AM default "
        "with its lr tuned on AA's grid, and **ST-AM-GD tuned** around gradient descent "
        "(`aa.sgd(lr)`), its lr tuned on a grid of its own.",
        "",
    ]
    lines = verdicts(results)
    out += [
        "## Where AA loses",
        "",
        "Per problem and target, against the best peer that reaches it on every seed (the "
        "fewest mean evaluations; the fewest mean seconds, each peer's own), where AA default "
        "loses in either:",
        "",
        *(lines["loses"] or ["- nowhere"]),
        "",
        "No row reached these on every seed within the budget: "
        + ("; ".join(lines["nobody"]) if lines["nobody"] else "none")
        + ".",
        "",
        "## Where AA wins",
        "",
    ]
    summary_path = os.path.join(HERE, "summary.md")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            out += [f.read().strip(), ""]
    out += [
        "Where an AA row needs no more evaluations and no more seconds than the best peer "
        "(a line can be in both lists: another AA row wins where AA default loses):",
        "",
        *(lines["wins"] or ["- nowhere"]),
        "",
    ]
    below = below_f_star(results)
    if below:
        out += [
            "Runs that ended below their seed's $f^*$ (a lower minimum than the long float64 "
            "run found from the same start): " + "; ".join(below) + ".",
            "",
        ]
    out += [
        "## The problems",
        "",
        "Per target: gradient evaluations (no row makes forward-only ones) and CPU seconds to "
        "it, mean ± std over the seeds that reach it, with their count where not all do; "
        "*best reached*: the median over seeds of the lowest relative suboptimality (PINNs: "
        "relative L2 error) reached; *rejected*: the share of AA's gradient "
        "evaluations spent at mixes the deferred safeguard rejected. Runs stop at the budget "
        "or at the last target.",
        "",
    ]
    for key, result in results.items():
        header, rows = table_rows(result)
        out += [f"### {result['title']}", ""]
        if result["kind"] == "loss":
            out += [
                f"$f^*$ per seed: {f_star_text(result)} ({payload['f_star'][key]['how']}"
                f"{f_star_gain(payload['f_star'][key])}); "
                f"relative suboptimality $(f - f^*)/{denominator_text(result)}$. "
                f"Budget {result['budget']:g} evaluations (tuning: {result['tuning_budget']:g}, "
                f"by {result['tuning_target']}).",
                "",
            ]
        else:
            out += [
                f"Budget {result['budget']:g} evaluations (tuning: {result['tuning_budget']:g}, "
                f"by {result['tuning_target']}).",
                "",
            ]
        out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(row) + " |" for row in rows]
        out += ["", "Chosen settings:", ""]
        for family, entry in result["tuning"].items():
            out.append(f"- {family}: `{entry['chosen']}`")
        out.append("")
    return "\n".join(out)


def below_f_star(results: dict[str, Any]) -> list[str]:
    """The runs whose relative suboptimality went below 0 by more than rounding."""
    found = []
    for result in results.values():
        if result["kind"] != "loss":
            continue
        slack = 1e-12 if result["dtype"] == "float64" else 1e-5
        for key, runs in result["runs"].items():
            for r in runs:
                if r["best_value"] is not None and r["best_value"] < -slack:
                    found.append(
                        f"{result['title'].split(' (')[0]}, {result['methods'][key]['label']}, "
                        f"seed {r['seed']}: {r['best_value']:.1e}"
                    )
    return found


def f_star_gain(f_star: dict[str, Any]) -> str:
    """How converged the long runs were: the largest relative gain of their last tenth (none
    where $f^* = 0$ is known)."""
    if f_star["how"].startswith("0 (known)"):
        return ""
    gains = [
        (r["loss_a_tenth_before"] - r["final_loss"]) / abs(r["final_loss"])
        for r in f_star["runs"]
        if r["final_loss"] != 0
    ]
    return f"; their last tenth still gained at most {max(gains):.0e} relative" if gains else ""


def f_star_text(result: dict[str, Any]) -> str:
    return ", ".join(f"{result['f_star'][str(r['seed'])]:.10g}" for r in result["runs"]["gd"])


def denominator_text(result: dict[str, Any]) -> str:
    return "|f^*|" if result["denominator"] is None else f"{result['denominator']:.6g}"


# -- main ------------------------------------------------------------------------------------
def load_f_star(args: argparse.Namespace) -> dict[str, Any]:
    cached = {}
    if os.path.exists(F_STAR_PATH):
        with open(F_STAR_PATH) as f:
            cached = json.load(f)
    if args.recompute_f_star:
        seeds = sorted(set(SEEDS) | set(TUNING_SEEDS))
        for key in args.problems:
            spec = SPECS[key]
            if not spec.pinn:
                cached[key] = reference.compute(spec, seeds, F_STAR_EVALS.get(key, 3000))
                write_json(F_STAR_PATH, cached)
                print(f"f* of {key} per seed: {cached[key]['f_star']}")
    missing = [k for k in args.problems if not SPECS[k].pinn and k not in cached]
    if missing:
        raise SystemExit(f"no f* for {missing}: run with --recompute-f-star")
    return cached


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default=",".join(SPECS), help="a,b,...: these only")
    parser.add_argument("--quick", action="store_true", help="1 seed, tiny budgets and grids")
    parser.add_argument("--recompute-f-star", action="store_true", help="the long runs first")
    parser.add_argument("--budget", type=float, default=None, help="evaluations per run")
    parser.add_argument("--tuning-budget", type=float, default=None)
    parser.add_argument("--out", default=None, help="the JSON (default: results.json here)")
    parser.add_argument("--markdown", default=None, help="write the docs page here")
    parser.add_argument(
        "--combine", default=None, help="a.json,b.json: merge runs of parts of the suite instead"
    )
    parser.add_argument(
        "--add-rows",
        default=None,
        help="a,b: run only these accelerated rows (e.g. st_am_default, st_am_tuned; a tuned "
        "one is tuned first) on the reported seeds and put them into the results file "
        "(--out), the other rows kept as they are",
    )
    args = parser.parse_args(argv)
    args.problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in args.problems if p not in SPECS]
    if unknown:
        parser.error(f"--problems: unknown {unknown}; known: {list(SPECS)}")
    args.seeds, args.tuning_seeds = list(SEEDS), list(TUNING_SEEDS)
    if args.quick:
        args.seeds, args.tuning_seeds = [0], [100]
        args.budget = args.budget or 20.0
        args.tuning_budget = args.tuning_budget or 10.0
        args.out = args.out or os.path.join("runs", "fullbatch_quick.json")
    args.out = args.out or os.path.join(HERE, "results.json")
    return args


def combine(paths: Sequence[str]) -> dict[str, Any]:
    """The payloads of runs of parts of the suite (``--problems``, e.g. in two processes) as
    one, the problems in the suite's order."""
    payloads = []
    for path in paths:
        with open(path) as f:
            payloads.append(json.load(f))
    problems = {k: v for p in payloads for k, v in p["problems"].items()}
    f_star = {k: v for p in payloads for k, v in p["f_star"].items()}
    return {
        "config": payloads[0]["config"],
        "f_star": {k: f_star[k] for k in SPECS if k in f_star},
        "problems": {k: problems[k] for k in SPECS if k in problems},
    }


def add_rows(payload: dict[str, Any], keys: Sequence[str], args: argparse.Namespace) -> None:
    """Runs the accelerated rows ``keys`` on the payload's reported seeds for
    ``args.problems`` (a tuned row's family tuned first, on the payload's tuning seeds with
    the problem's tuning budget, as the full run tunes it) and puts their runs, statistics,
    tuning and comparisons into ``payload`` in place; the other rows are kept as measured."""
    for key in args.problems:
        spec, result = SPECS[key], payload["problems"][key]
        f_star = None if spec.pinn else payload["f_star"][key]["f_star"]
        seeds = payload["config"]["seeds"]
        targets = targets_of(spec, f_star, seeds[0])
        tuned = [row for row in keys if row not in DEFAULTS]
        chosen = tune(
            spec, f_star, payload["config"]["tuning_seeds"], result["tuning_budget"],
            payload["config"]["quick"], tuned,
        ) if tuned else {}  # fmt: skip
        for family, entry in chosen.items():
            result["tuning"][family] = {
                "chosen": entry["method"].description, "grid": entry["grid"],
            }  # fmt: skip
        for row in keys:
            method = DEFAULTS[row]() if row in DEFAULTS else chosen[row]["method"]
            run_once(method, spec.make(seeds[0], spec.dtype), 3, targets, 0.0)  # warm-up
            runs = []
            for seed in seeds:
                seed_targets = targets_of(spec, f_star, seed)
                problem = spec.make(seed, spec.dtype)
                runs.append({"seed": seed, **run_once(
                    method, problem, result["budget"], seed_targets, targets.tolerances[-1]
                )})  # fmt: skip
            result["methods"][row] = {"label": method.label, "description": method.description}
            result["runs"][row] = runs
            result["stats"][row] = statistics_of(runs, targets.labels)
        # The table's order: the peers as they were, then the AA rows in the suite's order.
        order = [k for k in result["methods"] if k not in methods.ACCELERATED]
        order += [k for k in methods.ACCELERATED if k in result["methods"]]
        for field in ("methods", "runs", "stats"):
            result[field] = {k: result[field][k] for k in order}
        result["comparisons"] = comparisons(result)
        header, rows = table_rows(result)
        print(f"\n{result['title']}")
        print(format_table(header, rows))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.combine:
        payload = combine(args.combine.split(","))
        write_outputs(payload, args)
        return payload
    torch.set_num_threads(1)
    if args.add_rows:
        with open(args.out) as f:
            payload = json.load(f)
        add_rows(payload, args.add_rows.split(","), args)
        write_outputs(payload, args)
        return payload
    f_stars = load_f_star(args)
    results = {}
    for key in args.problems:
        spec = SPECS[key]
        f_star = None if spec.pinn else f_stars[key]["f_star"]
        result = run_problem(spec, f_star, args)
        result["comparisons"] = comparisons(result)
        results[key] = result
        header, rows = table_rows(result)
        print(f"\n{result['title']} ({result['suite_seconds']:.0f} s)")
        print(format_table(header, rows))
    payload = {
        "config": {
            "seeds": args.seeds,
            "tuning_seeds": args.tuning_seeds,
            "quick": args.quick,
            "threads": 1,
            "clock": "CPU seconds of the process",
            "machine": machine(),
            "torch": torch.__version__,
        },
        "f_star": {k: v for k, v in f_stars.items() if k in args.problems},
        "problems": results,
    }
    write_outputs(payload, args)
    return payload


def write_outputs(payload: dict[str, Any], args: argparse.Namespace) -> None:
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_page(payload))
        print(f"wrote {args.markdown}")


def machine() -> str:
    """The CPU's model name and core count, as the page states them."""
    name = "an unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()

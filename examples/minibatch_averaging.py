r"""Averaging and extrapolation in minibatch training, at equal gradient budget: SWA, EMA,
schedule-free AdamW and RNA (``aa.rna``) against tuned Adam, SGD-momentum and the best online
Anderson variant, in ``minibatch.py``'s framework.

The same three offline data sets, splits, models, batch size (256), epochs (30), float32, one
thread and fixed targets as ``examples/minibatch.py`` (docs/minibatch.md). The rows:

``adam``, ``sgdm``      the base runs, at the settings committed in ``minibatch_tuned.json``
``stochastic-adam``     the best online AA variant of that table (fewest epochs summed over the
                        three sets, 31.4 against classic-heldout's 33.0, and the higher final
                        accuracy on two of them), at its committed setting
``swa-<base>``          ``torch.optim.swa_utils.AveragedModel`` (equal weights) of the base
                        run's end-of-epoch snapshots from epoch ``start`` on (extra: ``start``);
                        before ``start`` the row is the base model
``ema-<base>``          ``AveragedModel`` with ``get_ema_multi_avg_fn(decay)``, updated after
                        every step (extra: ``decay``)
``rna-<base>``          ``aa.rna(depth)`` over the base run's end-of-epoch snapshots (epoch 0
                        included), extrapolated at every epoch end with :math:`\lambda` chosen
                        from ``aa``'s default grid (``1e-8 ... 1, inf``; ``inf`` is SWA over
                        the window) by the cross-entropy on the **validation** split (extra:
                        ``depth``); before two snapshots, the base model
``sf-adamw``            ``schedulefree.AdamWScheduleFree(lr)`` (Defazio et al. 2024; PyPI
                        ``schedulefree``, optional: its row is skipped when it is missing),
                        evaluated at its averaged point ``x`` (``optimizer.eval()``), weight
                        decay 0, the package's other defaults

Every row takes the same gradients as its base run or, for ``sf-adamw``, the same number of
gradients (one minibatch per step): SWA, EMA and RNA watch the base run (the observers of
``minibatch.train_run``) and change nothing in it, so ``swa-adam``, ``ema-adam``,
``rna-adam`` and ``adam`` are four readings of the same five runs.

**Equal tuning** (``--tune``, validation split, tuning seeds 100, ...), the protocol of
``minibatch.py``: the score of a setting is the mean number of epochs to the fixed validation
target (a miss counting ``2 * epochs``), ties broken by the higher mean final validation
accuracy; a coordinate search from a start point moves to the better neighbour until none is
better. The base runs keep their committed learning rates (the averaging rows read the same
runs, as the comparison requires); each averaging row searches its one lattice
(:data:`LATTICES`, start :data:`START`); ``sf-adamw`` searches ``minibatch.LR_GRID`` from
1e-2. All lattice points of SWA, EMA and RNA are scored from the same tuning runs (they only
watch), the search then reads those scores. That score rewards reaching the target early,
which favours averaging that stays close to the last iterate; since this comparison is about
the final accuracy, ``--score final`` repeats the search with the mean final validation
accuracy first (then the epochs). Choices: ``<out-dir>/<run>/tuning.json``; the committed
copy, ``examples/minibatch_averaging_tuned.json``, holds both (``choices``,
``choices_final``); ``--score final`` on the report reads the second.

**The report** (the default): every row at its tuned setting on ``--seeds`` seeds, on the
test split: final accuracy and epochs to the target (mean ± std over seeds), the
:math:`\lambda` RNA chose at the end, and the goal of issue 35, fixed before the runs: on
every data set the better RNA row's mean final accuracy is >= the better SWA row's and the
better EMA row's, and on at least one data set it exceeds tuned Adam's by more than the
larger of the two standard deviations.

Usage::

    python examples/minibatch_averaging.py                 # the report (minutes)
    python examples/minibatch_averaging.py --score final   # tuned for the final accuracy
    python examples/minibatch_averaging.py --tune          # the tuning (--score final too)
    python examples/minibatch_averaging.py --quick         # seconds, for smoke tests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import minibatch as mb  # noqa: E402
from _common import format_table, write_json  # noqa: E402

try:
    import schedulefree
except ImportError:  # optional: the sf-adamw row is skipped
    schedulefree = None

BASES = ("adam", "sgdm")
AVERAGERS = ("swa", "ema", "rna")
ROWS = (
    "adam", "sgdm", "stochastic-adam", "swa-adam", "ema-adam", "rna-adam",
    "swa-sgdm", "ema-sgdm", "rna-sgdm", "sf-adamw",
)  # fmt: skip
#: The extra hyperparameter of each averaging row: name and lattice.
LATTICES: dict[str, tuple[str, tuple[float, ...]]] = {
    "swa": ("start", (1, 2, 5, 10, 15, 20, 25, 28)),
    "ema": ("decay", (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)),
    "rna": ("depth", (2, 3, 5, 8, 12, 20)),
}
#: Where the coordinate search starts.
START = {"swa": 15, "ema": 0.95, "rna": 5, "sf-adamw": 1e-2}
TUNED_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "minibatch_averaging_tuned.json"
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default=",".join(mb.DATASETS))
    parser.add_argument("--rows", default=",".join(ROWS))
    mb.add_run_arguments(parser)
    parser.add_argument(
        "--score",
        choices=("epochs", "final"),
        default="epochs",
        help="tuning objective: minibatch.py's (epochs to target, then final accuracy) or "
        "the final validation accuracy first (then epochs)",
    )
    parser.add_argument("--settings", default=TUNED_FILE)
    parser.add_argument("--base-settings", default=mb.TUNED_FILE)
    parser.add_argument("--run", default=None, help="default: averaging[-tune][-final]")
    args = parser.parse_args(argv)
    mb.check_run_arguments(parser, args)
    args.rows = mb._names(parser, "--rows", args.rows, ROWS)
    if args.run is None:
        args.run = ("averaging-tune" if args.tune else "averaging") + (
            "-final" if args.score == "final" else ""
        )
    return args


# -- what the observers evaluate --------------------------------------------------------------
class Evaluator:
    """Accuracy on the reported split and cross-entropy on the validation split, of params
    given as a dict (``functional_call`` on the model's structure)."""

    def __init__(self, data: mb.Dataset, hidden: int, split: str) -> None:
        self.model = mb.make_model(data, hidden, 0).to("meta")
        self.split, self.val = getattr(data, split), data.val

    @torch.no_grad()
    def accuracy(self, params: dict[str, Tensor]) -> float:
        logits = functional_call(self.model, params, (self.split.x,))
        return (logits.argmax(dim=1) == self.split.y).double().mean().item()

    @torch.no_grad()
    def val_loss(self, params: dict[str, Tensor]) -> float:
        return F.cross_entropy(
            functional_call(self.model, params, (self.val.x,)), self.val.y
        ).item()


class Averaged:
    """SWA (``kind="swa"``: equal weights over end-of-epoch snapshots from epoch ``start``)
    or EMA (``kind="ema"``: ``get_ema_multi_avg_fn(decay)`` after every step), one
    ``torch.optim.swa_utils.AveragedModel`` per setting, fed through a real copy of the
    model (``host``)."""

    def __init__(self, kind: str, settings: Sequence[float], evaluator: Evaluator, host) -> None:
        self.kind, self.evaluator, self.host = kind, evaluator, host
        fn = {s: get_ema_multi_avg_fn(s) for s in settings} if kind == "ema" else {}
        self.models = {s: AveragedModel(host, multi_avg_fn=fn.get(s)) for s in settings}
        self.fed = dict.fromkeys(settings, False)
        self.curves: dict[float, list[float]] = {s: [] for s in settings}
        self.epoch_index = 0

    def _feed(self, params: dict[str, Tensor], setting: float) -> None:
        with torch.no_grad():
            for name, p in self.host.named_parameters():
                p.copy_(params[name])
        self.models[setting].update_parameters(self.host)
        self.fed[setting] = True

    def step(self, params: dict[str, Tensor], grads: Any) -> None:
        if self.kind == "ema":
            for setting in self.models:
                self._feed(params, setting)

    def epoch(self, params: dict[str, Tensor]) -> None:
        base = None
        for setting, model in self.models.items():
            if self.kind == "swa" and self.epoch_index >= setting:
                self._feed(params, setting)
            if self.fed[setting]:
                value = self.evaluator.accuracy(dict(model.module.named_parameters()))
            else:
                base = self.evaluator.accuracy(params) if base is None else base
                value = base
            self.curves[setting].append(value)
        self.epoch_index += 1


class Extrapolated:
    """RNA over the end-of-epoch snapshots, one window per ``depth``; at each epoch the
    extrapolation with the lowest validation loss over ``aa``'s default lambda grid."""

    def __init__(self, depths: Sequence[int], evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self.rnas = {d: aa.rna(int(d)) for d in depths}
        self.states: dict[int, Any] = {}
        self.curves: dict[float, list[float]] = {d: [] for d in depths}
        self.lambdas: dict[float, list[float | str | None]] = {d: [] for d in depths}

    def step(self, params: dict[str, Tensor], grads: Any) -> None:
        pass

    def epoch(self, params: dict[str, Tensor]) -> None:
        base = None
        for depth, rna in self.rnas.items():
            state = self.states.get(depth) or rna.init(params)
            state = self.states[depth] = rna.snapshot(state, params)
            if int(state.num_snapshots) >= 2:
                best, choice = rna.select(state, self.evaluator.val_loss)
                lam = choice.lam if math.isfinite(choice.lam) else "inf"  # JSON has no inf
                value = self.evaluator.accuracy(best)
            else:
                base = self.evaluator.accuracy(params) if base is None else base
                value, lam = base, None
            self.curves[depth].append(value)
            self.lambdas[depth].append(lam)


class ScheduleFreeStep:
    """``schedulefree.AdamWScheduleFree`` behind ``minibatch``'s ``init`` / ``update`` calls:
    the params dict's tensors are the optimizer's parameters (its ``y``, where the gradients
    are taken); :meth:`evaluation_params` reads its averaged point ``x``."""

    def __init__(self, lr: float) -> None:
        self.lr, self.opt = lr, None

    def init(self, params: dict[str, Tensor]) -> tuple:
        self.opt = schedulefree.AdamWScheduleFree(list(params.values()), lr=self.lr)
        self.opt.train()
        return ()

    def update(self, state: tuple, params: dict[str, Tensor], grads: Any, **_: Any):
        for name, p in params.items():
            p.grad = grads[name]
        self.opt.step()
        return params, state

    def evaluation_params(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        self.opt.eval()
        x = {k: v.detach().clone() for k, v in params.items()}
        self.opt.train()
        return x


class ScheduleFreeEval:
    """The accuracy of schedule-free's ``x`` at every epoch end."""

    def __init__(self, step: ScheduleFreeStep, evaluator: Evaluator) -> None:
        self.sf, self.evaluator, self.curve = step, evaluator, []

    def step(self, params: dict[str, Tensor], grads: Any) -> None:
        pass

    def epoch(self, params: dict[str, Tensor]) -> None:
        self.curve.append(self.evaluator.accuracy(self.sf.evaluation_params(params)))


# -- runs -------------------------------------------------------------------------------------
def _pad(curve: list[float], epochs: int) -> list[float]:
    """A diverged run stops early; its curve keeps its last value (as ``train_run`` does)."""
    return curve + [curve[-1]] * (epochs + 1 - len(curve))


def base_run(data, base: str, lr: float, seed: int, split: str, args, settings) -> dict:
    """One base run (``adam`` or ``sgdm`` at ``lr``) with SWA, EMA and RNA watching at the
    given ``settings`` (``{"swa": [...], "ema": [...], "rna": [...]}``). Returns
    ``{row: {setting: run}}`` (``None`` the base's setting), each run with its accuracy curve;
    RNA runs also with the lambda chosen at each epoch."""
    evaluator = Evaluator(data, args.hidden, split)
    host = mb.make_model(data, args.hidden, seed)
    swa = Averaged("swa", settings["swa"], evaluator, host)
    ema = Averaged("ema", settings["ema"], evaluator, host)
    rna = Extrapolated(settings["rna"], evaluator)
    run = mb.train_run(data, mb.make_variant(base, lr, None), seed, args.epochs, split, args,
                       observers=(swa, ema, rna))  # fmt: skip
    out: dict[str, dict[Any, dict]] = {base: {None: run}}
    for kind, watcher in (("swa", swa), ("ema", ema), ("rna", rna)):
        out[f"{kind}-{base}"] = {
            s: {"seed": seed, "accuracy": _pad(curve, args.epochs)}
            for s, curve in watcher.curves.items()
        }
    for depth, lams in rna.lambdas.items():
        out[f"rna-{base}"][depth]["lambda"] = lams
    return out


def sf_run(data, lr: float, seed: int, split: str, args) -> dict:
    step = ScheduleFreeStep(lr)
    watcher = ScheduleFreeEval(step, Evaluator(data, args.hidden, split))
    variant = mb.Variant("sf-adamw", lr, None, lambda: step, False)
    run = mb.train_run(data, variant, seed, args.epochs, split, args, observers=(watcher,))
    return {"seed": seed, "accuracy": _pad(watcher.curve, args.epochs), "steps": run["steps"]}


def plain_run(data, name: str, lr: float, extra, seed: int, split: str, args) -> dict:
    run = mb.train_run(data, mb.make_variant(name, lr, extra), seed, args.epochs, split, args)
    return {"seed": seed, "accuracy": run["accuracy"]}


# -- tuning -----------------------------------------------------------------------------------
def objective(score: tuple, kind: str) -> tuple:
    """What the search minimises, from ``minibatch.tuning_score``'s ``(mean epochs, -mean
    final accuracy)``: as is (``"epochs"``), or the final accuracy first (``"final"``)."""
    return score if kind == "epochs" else (score[1], score[0])


def _search_1d(scores: dict[float, tuple], lattice: Sequence[float], start: float, kind) -> float:
    chosen = mb.coordinate_search(lambda p: objective(scores[lattice[p[0]]], kind),
                                  [len(lattice)], (lattice.index(start),))  # fmt: skip
    return lattice[chosen[0]]


def tune_dataset(data: mb.Dataset, base_settings, seeds: list[int], args) -> dict[str, Any]:
    target, variants = mb.TARGETS[data.name], {}
    full = {kind: LATTICES[kind][1] for kind in AVERAGERS}
    for base in BASES:
        if not any(f"{k}-{base}" in args.rows for k in AVERAGERS):
            continue
        lr = base_settings[data.name][base][0]
        runs = [base_run(data, base, lr, s, "val", args, full) for s in seeds]
        for kind in AVERAGERS:
            row = f"{kind}-{base}"
            if row not in args.rows:
                continue
            name, lattice = LATTICES[kind]
            scores = {
                v: mb.tuning_score([r[row][v] for r in runs], target, args.epochs) for v in lattice
            }
            chosen = _search_1d(scores, lattice, START[kind], args.score)
            variants[row] = {
                "lr": lr, "extra": chosen, "extra_name": name,
                "at_lattice_end": [name] if chosen in (lattice[0], lattice[-1]) else [],
                "evaluated": [{"lr": lr, "extra": v, "score": scores[v]} for v in lattice],
            }  # fmt: skip
            print(f"{data.name} {row}: chose {name} {chosen:g}", flush=True)
    if "sf-adamw" in args.rows and schedulefree is not None:
        cache: dict[tuple[int, ...], Any] = {}

        def score(point: tuple[int, ...]) -> tuple:
            if point not in cache:
                lr = mb.LR_GRID[point[0]]
                runs = [sf_run(data, lr, s, "val", args) for s in seeds]
                cache[point] = {"lr": lr, "extra": None,
                                "score": mb.tuning_score(runs, target, args.epochs)}  # fmt: skip
            return objective(cache[point]["score"], args.score)

        chosen = mb.coordinate_search(score, [len(mb.LR_GRID)],
                                      (mb.LR_GRID.index(START["sf-adamw"]),))  # fmt: skip
        edge = ["lr"] if chosen[0] in (0, len(mb.LR_GRID) - 1) else []
        variants["sf-adamw"] = {
            "lr": mb.LR_GRID[chosen[0]], "extra": None, "extra_name": None,
            "at_lattice_end": edge, "evaluated": sorted(cache.values(), key=lambda c: c["lr"]),
        }  # fmt: skip
        print(f"{data.name} sf-adamw: chose lr {mb.LR_GRID[chosen[0]]:g}", flush=True)
    return {"seeds": seeds, "epochs": args.epochs, "target": target, "variants": variants}


# -- the report -------------------------------------------------------------------------------
def load_settings(path: str, score: str = "epochs") -> dict[str, dict[str, Any]]:
    """``{data set: {row: entry}}`` from a tuning.json (its ``choices``, or ``choices_final``
    for ``score="final"`` when it has them); the start points where it lacks one."""
    chosen: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            tuning = json.load(f)
        key = "choices_final" if score == "final" and "choices_final" in tuning else "choices"
        chosen = {d: c["variants"] for d, c in tuning[key].items()}
    out: dict[str, dict[str, Any]] = {}
    for d in mb.DATASETS:
        out[d] = {}
        for row in ROWS:
            entry = chosen.get(d, {}).get(row)
            if entry is None and row == "sf-adamw":
                entry = {"lr": START["sf-adamw"], "extra": None}
            elif entry is None and row.split("-")[0] in AVERAGERS:
                entry = {"lr": None, "extra": START[row.split("-")[0]]}
            out[d][row] = entry
    return out


def label(row: str, lr: float | None, extra: Any) -> str:
    kind = row.split("-")[0]
    if kind in AVERAGERS:
        return f"lr={lr:g} {LATTICES[kind][0]}={extra:g}"
    return f"lr={lr:g}" + ("" if extra is None else f" extra={extra:g}")


def report_dataset(data: mb.Dataset, base_settings, settings, args) -> dict[str, Any]:
    """Every row at its tuned setting on seeds 0, 1, ... (test split)."""
    results: dict[str, list] = {r: [] for r in args.rows}
    labels: dict[str, str] = {}
    for seed in range(args.seeds):
        for base in BASES:
            rows = [r for r in (base, *(f"{k}-{base}" for k in AVERAGERS)) if r in args.rows]
            if not rows:
                continue
            lr = base_settings[data.name][base][0]
            chosen = {k: [settings[data.name][f"{k}-{base}"]["extra"]] for k in AVERAGERS}
            out = base_run(data, base, lr, seed, "test", args, chosen)
            for row in rows:
                setting = None if row == base else chosen[row.split("-")[0]][0]
                results[row].append(out[row][setting])
                labels[row] = label(row, lr, setting)
        if "stochastic-adam" in args.rows:
            lr, extra = base_settings[data.name]["stochastic-adam"]
            results["stochastic-adam"].append(
                plain_run(data, "stochastic-adam", lr, extra, seed, "test", args)
            )
            labels["stochastic-adam"] = f"lr={lr:g} relaxation={extra:g}"
        if "sf-adamw" in args.rows and schedulefree is not None:
            lr = settings[data.name]["sf-adamw"]["lr"]
            results["sf-adamw"].append(sf_run(data, lr, seed, "test", args))
            labels["sf-adamw"] = f"lr={lr:g}"
    results = {r: runs for r, runs in results.items() if runs}
    target = mb.TARGETS[data.name]
    stats = {
        row: {
            "epochs_to_target": mb.mean_std([mb.epochs_to(r["accuracy"], target) for r in runs]),
            "final_accuracy": mb.mean_std([r["accuracy"][-1] for r in runs]),
        }
        for row, runs in results.items()
    }
    for row, runs in results.items():
        if row.startswith("rna"):
            finals = [r["lambda"][-1] for r in runs]
            counts = {str(v): finals.count(v) for v in sorted(set(finals), key=str)}
            stats[row]["final_lambda"] = counts
    return {"target": target, "labels": labels, "stats": stats, "runs": results}


def goal(datasets: dict[str, Any]) -> dict[str, Any]:
    """Issue 35's goal, fixed before the runs (see the module docstring)."""

    def best(stats, kind):
        rows = [r for r in stats if r.startswith(f"{kind}-")]
        return max(rows, key=lambda r: stats[r]["final_accuracy"]["mean"]) if rows else None

    per_set, above_adam = {}, []
    for name, d in datasets.items():
        s = d["stats"]
        rna, swa, ema = best(s, "rna"), best(s, "swa"), best(s, "ema")
        if rna is None:
            continue
        acc = {r: s[r]["final_accuracy"] for r in (rna, swa, ema, "adam") if r in s}
        not_below = all(acc[rna]["mean"] >= acc[r]["mean"] for r in (swa, ema) if r in acc)
        margin = spread = None
        if "adam" in acc:
            margin = acc[rna]["mean"] - acc["adam"]["mean"]
            spread = max(acc[rna]["std"], acc["adam"]["std"])
            if margin > spread:
                above_adam.append(name)
        per_set[name] = {"rna": rna, "swa": swa, "ema": ema, "not_below_swa_and_ema": not_below,
                         "margin_over_adam": margin, "spread": spread}  # fmt: skip
    met = bool(per_set) and all(v["not_below_swa_and_ema"] for v in per_set.values())
    return {"per_dataset": per_set, "above_adam_by_more_than_spread": above_adam,
            "met": met and bool(above_adam)}  # fmt: skip


def markdown(summary: dict[str, Any]) -> str:
    lines = []
    for name, d in summary["datasets"].items():
        seeds = len(next(iter(d["runs"].values())))
        lines += [
            f"\n**{name}** (test split, target {100 * d['target']:.0f}%, {seeds} seeds)\n",
            "| row | setting | final acc. % | epochs to target | RNA's final lambda |",
            "|---|---|---|---|---|",
        ]
        for row, s in d["stats"].items():
            lam = ", ".join(f"{k}: {v}" for k, v in s.get("final_lambda", {}).items()) or "-"
            cells = [row, d["labels"][row], mb._pm(s["final_accuracy"], 100),
                     mb._pm(s["epochs_to_target"], digits=1), lam]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines += mb.per_seed_table(d["runs"], d["target"], seeds, "row")
    g = summary["goal"]
    lines.append("\n**Goal** (issue 35): " + ("met" if g["met"] else "not met"))
    for name, v in g["per_dataset"].items():
        margin = "-" if v["margin_over_adam"] is None else f"{100 * v['margin_over_adam']:+.2f}"
        spread = "-" if v["spread"] is None else f"{100 * v['spread']:.2f}"
        lines.append(
            f"- {name}: best RNA row `{v['rna']}` >= best SWA (`{v['swa']}`) and EMA "
            f"(`{v['ema']}`): {'yes' if v['not_below_swa_and_ema'] else 'no'}; over tuned Adam "
            f"{margin} points (spread {spread})"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if schedulefree is None and "sf-adamw" in args.rows:
        print("schedulefree is not installed: the sf-adamw row is skipped "
              "(pip install schedulefree)")  # fmt: skip
    datasets = {name: mb.load_dataset(name) for name in args.datasets}
    base_settings = mb.load_settings(args.base_settings)
    out = os.path.join(args.out_dir, args.run)
    os.makedirs(out, exist_ok=True)
    for name in args.datasets:  # warm-up, as in minibatch.py
        mb.train_run(datasets[name], mb.make_variant("adam", 1e-3, None), 0, 1, "val", args)
    started = time.perf_counter()
    if args.tune:
        seeds = list(range(100, 100 + args.tune_seeds))
        choices = {
            d: tune_dataset(data, base_settings, seeds, args) for d, data in datasets.items()
        }
        tuning = {"score": args.score, "choices": choices}
        tuning["total_seconds"] = time.perf_counter() - started
        write_json(os.path.join(out, "tuning.json"), tuning)
        with open(os.path.join(out, "tuning.md"), "w") as f:
            f.write(mb.tuning_markdown(tuning))
        print(f"\ntuning took {tuning['total_seconds']:.0f} s; wrote {out}/tuning.json")
        return tuning
    settings = load_settings(args.settings, args.score)
    summaries = {}
    for d, data in datasets.items():
        summaries[d] = report_dataset(data, base_settings, settings, args)
        s = summaries[d]
        rows = [
            [r, s["labels"][r], mb._pm(v["final_accuracy"], 100), mb._pm(v["epochs_to_target"])]
            for r, v in s["stats"].items()
        ]
        print(f"\n== {d}: test target {100 * s['target']:.0f}% ({args.seeds} seeds) ==")
        print(format_table(["row", "setting", "final acc %", "epochs to target"], rows))
    summary = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("no_progress", "out_dir", "run")},
            "evaluated_on": "test",
            "rna_lambda_chosen_on": "validation cross-entropy",
            "targets": {d: mb.TARGETS[d] for d in datasets},
            "schedulefree": None if schedulefree is None else "installed",
            "total_seconds": time.perf_counter() - started,
        },
        "datasets": summaries,
    }
    summary["goal"] = goal(summaries)
    write_json(os.path.join(out, "summary.json"), summary)
    text = markdown(summary)
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(text)
    print(text)
    mb.plot(os.path.join(out, "test_accuracy.png"), summaries,
            {d: s["runs"] for d, s in summaries.items()})  # fmt: skip
    print(f"{summary['config']['total_seconds']:.0f} s; wrote {out}/summary.json")
    return summary


if __name__ == "__main__":
    main()

r"""Minibatch training, held-out accuracy: plain Adam and SGD-momentum vs Anderson acceleration.

Where deep-learning users train: shuffled minibatches, Adam or SGD with momentum, and the
accuracy on data the model never saw. Two offline data sets (nothing is downloaded):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes);
* ``tabular``: a generated tabular task, ``sklearn.datasets.make_classification`` (3,000
  rows, 20 standardised features, 3 classes, 2% label noise, fixed ``random_state``).

Each is split once (stratified, seed 0) into train / validation / test (60 / 20 / 20%). A
small MLP (inputs -> 64 tanh -> classes) is trained with ``torch.func.functional_call`` and
``torch.func.grad`` on minibatches of a fresh permutation each epoch, with these variants, all
with the same learning rate (per inner optimizer) and the same batch size:

``adam``            plain ``aa.adam(lr)``
``sgdm``            plain ``aa.sgd(sgd_lr, momentum=0.9)``
``aadl-average``    AADL's own defaults (``aa.accelerate``: relaxation 0.1, wait 1, depth 15,
                    store/mix every step) with ``average=True``, around Adam, no safeguard
``classic-heldout`` ``mode="classic"``, depth 5, relaxation 1, around Adam; the safeguard
                    ``loss_fn`` is the loss on a held-out minibatch (below)
``stochastic-adam`` the stochastic variant around Adam: ``mode="classic"``, depth 5,
                    ``relaxation=5`` (over-relaxed), ``restart_on_reject=True``, the same
                    held-out-minibatch safeguard
``stochastic-sgdm`` the same options around SGD-momentum (at ``sgd_lr``)

The held-out minibatch of step ``i`` is minibatch ``i + 1`` of the same epoch (the next one;
the first for the last step): data the step's gradient did not see, already in memory, so the
safeguard costs two forward passes of one minibatch per mixing call and no extra pass over the
data. ``restart_on_reject`` cuts the window to its newest pair whenever the safeguard rejects a
mix (see :func:`aadl_func.anderson`).

Every variant runs over ``--seeds`` seeds (seed s: initial weights and the minibatch order);
after each epoch the accuracy on the evaluation split and the mean loss on the whole training
split are recorded. The table gives mean +- std over seeds of the epochs each seed needs to
reach plain Adam's and plain SGD-momentum's final mean accuracy, of the final accuracy, of
the final training loss and of the training wall time (evaluation excluded). The *goal* lines
compare mean curves: the first epoch at which a variant's seed-mean accuracy reaches the
baseline's final seed-mean accuracy, against the epoch at which the baseline itself did.

Settings were chosen on the validation split only (``--split val``); the default run reports
the test split. See the README section "Minibatch training" for the measured results and the
settings tried.

Usage::

    python examples/minibatch.py                      # the default run (a few minutes)
    python examples/minibatch.py --split val          # the same on the validation split
    python examples/minibatch.py --quick              # seconds, for smoke tests
    python examples/minibatch.py --datasets digits --variants adam,stochastic-adam --seeds 3

Writes ``<out-dir>/<run>/summary.json`` and ``<out-dir>/<run>/test_accuracy.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad
from tqdm import tqdm

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PlainOptimizer, finite_or_none, format_table, write_json  # noqa: E402

DATASETS = ("digits", "tabular")
VARIANTS = (
    "adam",
    "sgdm",
    "aadl-average",
    "classic-heldout",
    "stochastic-adam",
    "stochastic-sgdm",
)
BASELINES = ("adam", "sgdm")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--sgd-lr", type=float, default=0.03)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--relaxation", type=float, default=5.0, help="stochastic variants")
    parser.add_argument("--reg-relative", type=float, default=0.0, help="stochastic variants")
    parser.add_argument(
        "--no-restart", action="store_true", help="stochastic variants without restart_on_reject"
    )
    parser.add_argument(
        "--split", choices=("test", "val"), default="test", help="the split accuracy is read on"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="3 epochs, 2 seeds")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--run", default="minibatch")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 3, 2
    args.datasets = _names(parser, "--datasets", args.datasets, DATASETS)
    args.variants = _names(parser, "--variants", args.variants, VARIANTS)
    for name in ("seeds", "epochs", "batch_size", "hidden", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("adam_lr", "sgd_lr", "relaxation"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.reg_relative < 0:
        parser.error("--reg-relative must be >= 0")
    return args


def _names(parser: argparse.ArgumentParser, flag: str, text: str, known: tuple) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        parser.error(f"{flag}: expected a comma-separated subset of {', '.join(known)}")
    return names


# -- data -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    x: Tensor
    y: Tensor


@dataclass(frozen=True)
class Dataset:
    name: str
    description: str
    train: Split
    val: Split
    test: Split
    num_classes: int


def load_dataset(name: str) -> Dataset:
    """One of :data:`DATASETS`, split 60/20/20 (stratified, seed 0), float32."""
    import numpy as np
    from sklearn.model_selection import train_test_split

    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        features, labels = bunch.data / 16.0, bunch.target
        description = "sklearn load_digits (bundled): 8x8 images scaled to [0, 1], 10 classes"
    elif name == "tabular":
        from sklearn.datasets import make_classification

        features, labels = make_classification(
            n_samples=3000,
            n_features=20,
            n_informative=10,
            n_redundant=4,
            n_classes=3,
            n_clusters_per_class=2,
            class_sep=1.0,
            flip_y=0.02,
            random_state=0,
        )
        description = (
            "sklearn make_classification (generated, random_state=0): 3000 rows, 20 "
            "standardised features (10 informative, 4 redundant), 3 classes, 2% label noise"
        )
    else:
        raise ValueError(f"unknown data set {name!r}; expected one of {DATASETS}")
    index = np.arange(len(labels))
    train, rest = train_test_split(index, test_size=0.4, random_state=0, stratify=labels)
    val, test = train_test_split(rest, test_size=0.5, random_state=0, stratify=labels[rest])
    if name == "tabular":
        # Standardised with the training rows' statistics only.
        mean, std = features[train].mean(0), features[train].std(0) + 1e-8
        features = (features - mean) / std

    def split(rows: Any) -> Split:
        return Split(
            torch.tensor(features[rows], dtype=torch.float32),
            torch.tensor(labels[rows], dtype=torch.int64),
        )

    return Dataset(name, description, split(train), split(val), split(test), int(labels.max()) + 1)


def make_model(num_inputs: int, num_classes: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(num_inputs, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


# -- the variants -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    label: str
    make: Callable[[], Any]  # -> an object with init / update(state, params, grads, ...)
    safeguard: bool  # whether update gets the held-out-minibatch loss_fn
    baseline: str  # the plain run with the same inner optimizer and learning rate


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    adam = aa.adam(args.adam_lr)
    sgdm = aa.sgd(args.sgd_lr, momentum=0.9)
    stochastic = dict(
        mode="classic",
        history_depth=5,
        relaxation=args.relaxation,
        reg_relative=args.reg_relative,
        restart_on_reject=not args.no_restart,
    )
    options = ", ".join(f"{k}={v!r}" for k, v in stochastic.items())
    return {
        "adam": Variant(f"Adam lr={args.adam_lr:g}", lambda: PlainOptimizer(adam), False, "adam"),
        "sgdm": Variant(
            f"SGD lr={args.sgd_lr:g} momentum=0.9", lambda: PlainOptimizer(sgdm), False, "sgdm"
        ),
        "aadl-average": Variant(
            "Adam + AADL defaults (relaxation=0.1, wait_iterations=1, history_depth=15), "
            "average=True, no safeguard",
            lambda: aa.anderson(
                adam, relaxation=0.1, wait_iterations=1, history_depth=15, average=True
            ),
            False,
            "adam",
        ),
        "classic-heldout": Variant(
            "Adam + AA classic, history_depth=5, relaxation=1, held-out-minibatch safeguard",
            lambda: aa.anderson(adam, mode="classic", history_depth=5),
            True,
            "adam",
        ),
        "stochastic-adam": Variant(
            f"Adam + AA ({options}), held-out-minibatch safeguard",
            lambda: aa.anderson(adam, **stochastic),
            True,
            "adam",
        ),
        "stochastic-sgdm": Variant(
            f"SGD-momentum + AA ({options}), held-out-minibatch safeguard",
            lambda: aa.anderson(sgdm, **stochastic),
            True,
            "sgdm",
        ),
    }


# -- one run ----------------------------------------------------------------------------------
def train_run(
    data: Dataset, variant: Variant, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Trains one seed; returns per-epoch curves (index 0: before training)."""
    evaluation = data.val if args.split == "val" else data.test
    model = make_model(data.train.x.shape[1], data.num_classes, args.hidden, seed)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model = model.to("meta")  # functional_call needs its structure only

    def loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    gradient = grad(loss)

    def held_out_loss(rows: Tensor) -> Callable[[dict[str, Tensor]], Tensor]:
        x_held, y_held = data.train.x[rows], data.train.y[rows]
        return lambda p: loss(p, x_held, y_held)

    def record() -> None:
        with torch.no_grad():
            logits = functional_call(model, params, (evaluation.x,))
            accuracy.append((logits.argmax(dim=1) == evaluation.y).double().mean().item())
            train_loss.append(loss(params, data.train.x, data.train.y).item())

    optimizer = variant.make()
    state = optimizer.init(params)
    order = torch.Generator().manual_seed(10_000 + seed)
    n = len(data.train.y)
    accuracy: list[float] = []
    train_loss: list[float] = []
    record()
    seconds = 0.0
    elapsed = [0.0]  # training seconds after each epoch
    for _ in range(args.epochs):
        start = time.perf_counter()
        permutation = torch.randperm(n, generator=order)
        batches = [permutation[i : i + args.batch_size] for i in range(0, n, args.batch_size)]
        for i, rows in enumerate(batches):
            grads = gradient(params, data.train.x[rows], data.train.y[rows])
            loss_fn = None
            if variant.safeguard:
                loss_fn = held_out_loss(batches[(i + 1) % len(batches)])
            with torch.no_grad():
                params, state = optimizer.update(
                    state, params, grads, inplace=True, loss_fn=loss_fn
                )
        seconds += time.perf_counter() - start
        elapsed.append(seconds)
        record()
    counters = {}
    if isinstance(state, aa.AndersonState):
        counters = {
            name: int(getattr(state, name))
            for name in ("num_mixed", "num_rejected", "num_nonfinite", "num_averaged")
        }
    return {
        "seed": seed,
        "accuracy": accuracy,
        "train_loss": [finite_or_none(v) for v in train_loss],
        "wall_seconds": seconds,
        "elapsed_seconds": elapsed,
        "steps": args.epochs * math.ceil(n / args.batch_size),
        **counters,
    }


# -- statistics -------------------------------------------------------------------------------
def epochs_to(curve: Sequence[float], target: float) -> int | None:
    """First epoch (1-based; 0 is the initial model) whose accuracy is >= ``target``."""
    # Rounded so that a curve ending exactly at a mean of its own values still counts.
    return next((e for e, v in enumerate(curve) if v >= target - 1e-12), None)


def _seconds_to(run: dict[str, Any], target: float) -> float | None:
    epoch = epochs_to(run["accuracy"], target)
    return None if epoch is None else run["elapsed_seconds"][epoch]


def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(known) if known else None,
        "std": statistics.stdev(known) if len(known) > 1 else (0.0 if known else None),
        "count": len(known),
    }


def mean_curve(runs: list[dict[str, Any]], key: str = "accuracy") -> list[float]:
    return [statistics.fmean(values) for values in zip(*(r[key] for r in runs))]


def summarise(
    results: dict[str, list[dict[str, Any]]], table: dict[str, Variant], epochs: int
) -> dict[str, Any]:
    """Targets, per-variant statistics and the goal's comparison, for one data set: each
    accelerated variant against the plain run of its inner optimizer (same learning rate)."""
    targets = {b: mean_curve(results[b])[-1] for b in BASELINES if b in results}
    stats: dict[str, Any] = {}
    for name, runs in results.items():
        curve = mean_curve(runs)
        own = table[name].baseline
        stats[name] = {
            "final_accuracy": mean_std([r["accuracy"][-1] for r in runs]),
            "final_train_loss": mean_std([r["train_loss"][-1] for r in runs]),
            "wall_seconds": mean_std([r["wall_seconds"] for r in runs]),
            "epochs_to": {
                b: mean_std([epochs_to(r["accuracy"], t) for r in runs]) for b, t in targets.items()
            },
            "mean_curve_epochs_to": {b: epochs_to(curve, t) for b, t in targets.items()},
            # Training seconds until each seed reaches its own baseline's target.
            "seconds_to_baseline_target": mean_std(
                [_seconds_to(r, targets[own]) if own in targets else None for r in runs]
            ),
            "mean_accuracy_curve": curve,
        }
        for counter in ("num_mixed", "num_rejected", "num_averaged"):
            if counter in runs[0]:
                stats[name][counter] = mean_std([r[counter] for r in runs])
    goal: dict[str, Any] = {}
    for baseline, target in targets.items():
        reference = stats[baseline]["mean_curve_epochs_to"][baseline]
        rows = {}
        for name in results:
            if name in BASELINES or table[name].baseline != baseline:
                continue
            reached = stats[name]["mean_curve_epochs_to"][baseline]
            speedup = reference / reached if reached else None
            not_worse = (
                stats[name]["final_accuracy"]["mean"] >= stats[baseline]["final_accuracy"]["mean"]
            )
            rows[name] = {
                "epochs": reached,
                "speedup": speedup,
                "final_not_worse": not_worse,
                "goal_met": speedup is not None and speedup >= 1.3 and not_worse,
            }
        goal[baseline] = {"target": target, "baseline_epochs": reference, "variants": rows}
    return {"targets": targets, "stats": stats, "goal": goal, "epochs": epochs}


# -- output -----------------------------------------------------------------------------------
def _pm(entry: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    if entry["mean"] is None:
        return "-"
    return f"{scale * entry['mean']:.{digits}f} ± {scale * entry['std']:.{digits}f}"


def report(name: str, summary: dict[str, Any], args: argparse.Namespace, seeds: int) -> None:
    stats, targets = summary["stats"], summary["targets"]
    split = "validation" if args.split == "val" else "test"
    print(f"\n== {name} ({split} accuracy; mean ± std over {seeds} seeds) ==")
    header = ["variant"]
    header += [f"epochs to {b} final {100 * t:.2f}%" for b, t in targets.items()]
    header += ["final acc %", "final train loss", "wall s", "s to own target", "kept/rejected"]
    rows = []
    for variant, s in stats.items():
        row = [variant]
        for b in targets:
            e = s["epochs_to"][b]
            text = _pm(e, digits=1)
            row.append(text if e["count"] == seeds else f"{text} ({e['count']}/{seeds})")
        row += [
            _pm(s["final_accuracy"], 100),
            _pm(s["final_train_loss"], digits=4),
            _pm(s["wall_seconds"], digits=1),
            _pm(s["seconds_to_baseline_target"], digits=2)
            + (
                ""
                if s["seconds_to_baseline_target"]["count"] == seeds
                else f" ({s['seconds_to_baseline_target']['count']}/{seeds})"
            ),
            (
                f"{s['num_mixed']['mean']:.0f}/{s['num_rejected']['mean']:.0f}"
                if "num_mixed" in s
                else "-"
            ),
        ]
        rows.append(row)
    print(format_table(header, rows))
    for baseline, goal in summary["goal"].items():
        print(
            f"goal vs {baseline} (mean curve reaches {100 * goal['target']:.2f}%: "
            f"{baseline} at epoch {goal['baseline_epochs']}):"
        )
        for variant, g in goal["variants"].items():
            speedup = "-" if g["speedup"] is None else f"{g['speedup']:.2f}x"
            print(
                f"  {variant:>16}: epoch {g['epochs']}, {speedup} fewer epochs, final "
                f"{'not worse' if g['final_not_worse'] else 'WORSE'} -> "
                f"{'met' if g['goal_met'] else 'not met'}"
            )


def plot(path: str, summaries: dict[str, Any], results: dict[str, Any], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 4.6), squeeze=False)
    for ax, (name, summary) in zip(axes[0], summaries.items()):
        for variant, runs in results[name].items():
            curves = [[100 * v for v in r["accuracy"]] for r in runs]
            mean = [statistics.fmean(v) for v in zip(*curves)]
            std = [statistics.pstdev(v) for v in zip(*curves)]
            epochs = range(len(mean))
            (line,) = ax.plot(epochs, mean, label=variant, lw=1.6)
            ax.fill_between(
                epochs,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=line.get_color(),
                alpha=0.18,
            )
        for target in summary["targets"].values():
            ax.axhline(100 * target, color="gray", ls=":", lw=0.9)
        finals = [100 * s["final_accuracy"]["mean"] for s in summary["stats"].values()]
        ax.set_ylim(max(0.0, min(finals) - 15), min(100.0, max(finals) + 3))
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{'validation' if args.split == 'val' else 'test'} accuracy (%)")
        ax.set_title(
            f"{name}: batch {args.batch_size}, Adam lr {args.adam_lr:g}, SGD lr {args.sgd_lr:g}"
            f" ({args.seeds} seeds, mean ± std)",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    table = variants(args)
    datasets = {name: load_dataset(name) for name in args.datasets}
    jobs = [(d, v, s) for d in args.datasets for v in args.variants for s in range(args.seeds)]
    # Warm-up (first-call allocations of functional_call and grad), so that no run's wall
    # time pays for it.
    warm = argparse.Namespace(**{**vars(args), "epochs": 1})
    for name in args.datasets:
        train_run(datasets[name], table[args.variants[-1]], 0, warm)
    results: dict[str, dict[str, list]] = {d: {v: [] for v in args.variants} for d in datasets}
    started = time.perf_counter()
    bar = tqdm(jobs, desc="runs", disable=args.no_progress)
    for dataset, variant, seed in bar:
        bar.set_postfix_str(f"{dataset} {variant} seed {seed}")
        run = train_run(datasets[dataset], table[variant], seed, args)
        results[dataset][variant].append(run)
    bar.close()
    total = time.perf_counter() - started

    summaries = {d: summarise(results[d], table, args.epochs) for d in datasets}
    for d in datasets:
        report(d, summaries[d], args, args.seeds)
    out = os.path.join(args.out_dir, args.run)
    os.makedirs(out, exist_ok=True)
    summary = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("no_progress", "out_dir", "run")},
            "model": f"MLP inputs -> {args.hidden} tanh -> classes (torch.func.functional_call)",
            "evaluated_on": "validation" if args.split == "val" else "test",
            "held_out_minibatch": "minibatch i + 1 of the same epoch (the next one)",
            "variants": {v: table[v].label for v in args.variants},
            "torch_threads": torch.get_num_threads(),
            "total_seconds": total,
        },
        "datasets": {
            d: {
                "description": datasets[d].description,
                "sizes": {s: len(getattr(datasets[d], s).y) for s in ("train", "val", "test")},
                **summaries[d],
                "runs": results[d],
            }
            for d in datasets
        },
    }
    write_json(os.path.join(out, "summary.json"), summary)
    plot(os.path.join(out, "test_accuracy.png"), summaries, results, args)
    print(f"\n{len(jobs)} runs in {total:.0f} s; wrote {out}/summary.json and test_accuracy.png")
    return summary


if __name__ == "__main__":
    main()

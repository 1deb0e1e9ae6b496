r"""Minibatch training with equal tuning: plain Adam / SGD-momentum, a no-mixing control,
Anderson acceleration and AdaSAM, to a fixed held-out accuracy.

Three offline data sets (nothing is downloaded), each split once (stratified, seed 0) into
train / validation / test (60 / 20 / 20%):

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes), an MLP
  (64 -> 64 tanh -> 10);
* ``tabular``: ``sklearn.datasets.make_classification`` (3,000 rows, 20 standardised
  features, 3 classes, 2% label noise, ``random_state=0``), an MLP (20 -> 64 tanh -> 3);
* ``textures``: 2,400 16x16 grey images drawn by this script (:func:`make_textures`, fixed
  seed): six kinds of noisy sinusoidal texture (horizontal, vertical, diagonal, antidiagonal,
  checker, rings) of random period, phase and amplitude; a small CNN (conv 1->8 3x3, tanh,
  2x2 average pool, conv 8->16 3x3, tanh, 2x2 average pool, linear; 2,790 parameters).

Training: ``torch.func.functional_call`` + ``grad`` on minibatches of 256 from a fresh
permutation each epoch (seed s: initial weights and minibatch order), float32, one thread.
The variants, each with a learning rate ``lr`` and at most one extra hyperparameter:

``adam``             plain ``aa.adam(lr)``
``sgdm``             plain ``aa.sgd(lr, momentum=0.9)``
``control-adam``     the **guarded long step**, no mixing: from the plain step ``u`` of Adam,
                     ``y = x + u`` and ``z = x + factor * u``; ``z`` is kept when the next
                     minibatch's loss is lower at ``z`` than at ``y`` (extra: ``factor``)
``control-sgdm``     the same around SGD-momentum
``stochastic-adam``  ``aa.anderson(adam, mode="classic", history_depth=5, relaxation,
                     restart_on_reject=True)`` with the same next-minibatch safeguard
                     (extra: ``relaxation``)
``stochastic-sgdm``  the same around SGD-momentum
``classic-heldout``  ``aa.anderson(adam, mode="classic", history_depth=5)`` (relaxation 1)
                     with the safeguard (no extra)
``aadl-average``     ``aa.anderson(adam, history_depth=15, wait_iterations=1,
                     average=True, relaxation)``: AADL's defaults but the relaxation, no
                     safeguard (extra: ``relaxation``)
``adasam``           ``aa.adasam(lr)`` (Wei, Bao and Liu, NeurIPS 2021; ``lr`` is its
                     ``beta``), the paper's other defaults except ``damp`` (extra: ``damp``)

The safeguard's and the control's "next minibatch" is minibatch ``i + 1`` of the same epoch
(the first for the last step): data the step's gradient did not see, already in memory; both
cost two forward passes of one minibatch per step.

**Equal tuning** (``--tune``, validation split only): every variant searches the same
learning-rate lattice :data:`LR_GRID` and its extra hyperparameter's lattice
(:data:`EXTRA`) by coordinate search: from a start point it moves along one axis to the best
neighbour until no neighbour is better, then along the other, until neither moves; so the
chosen value is better than both its neighbours, i.e. interior (a choice at a lattice end is
flagged). The score of a setting, over ``--tune-seeds`` seeds (100, 101, ...): the mean
number of epochs to the fixed validation accuracy :data:`TARGETS` (a seed that misses counts
``2 * epochs``), ties broken by the higher mean final validation accuracy. The choices are
written to ``<out-dir>/<run>/tuning.json``; the committed copy
``examples/minibatch_tuned.json`` is what the default run uses.

**The default run** trains every variant at its tuned setting on ``--seeds`` seeds (0, 1, ...)
and reports on the test split: epochs and training seconds (CPU time of this process) to the
fixed target accuracy, final accuracy and final training loss (mean ± std over seeds), and
the goal of issue 22: a variant reaches the target in >= 1.2x fewer epochs than tuned Adam
and than the better control, on every seed, and is no slower in seconds than either.

Usage::

    python examples/minibatch.py                      # the tuned comparison (a few minutes)
    python examples/minibatch.py --tune               # the tuning (tens of minutes)
    python examples/minibatch.py --quick              # seconds, for smoke tests
    python examples/minibatch.py --datasets digits --variants adam,adasam --seeds 3

Writes ``<out-dir>/<run>/summary.json`` and ``test_accuracy.png`` (or ``tuning.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad
from tqdm import tqdm

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PlainOptimizer, finite_or_none, format_table, write_json  # noqa: E402

DATASETS = ("digits", "tabular", "textures")
VARIANTS = (
    "adam",
    "sgdm",
    "control-adam",
    "control-sgdm",
    "stochastic-adam",
    "stochastic-sgdm",
    "classic-heldout",
    "aadl-average",
    "adasam",
)
BASELINES = ("adam", "sgdm")
CONTROLS = ("control-adam", "control-sgdm")
#: Fixed absolute accuracy targets, set before any tuning run (read on the validation split
#: when tuning, on the test split when reporting).
TARGETS = {"digits": 0.96, "tabular": 0.85, "textures": 0.85}
#: The learning-rate lattice, the same for every variant.
LR_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
_LONG = (1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0)
#: Extra hyperparameter of each variant that has one: its name and lattice.
EXTRA: dict[str, tuple[str, tuple[float, ...]]] = {
    "control-adam": ("factor", _LONG),
    "control-sgdm": ("factor", _LONG),
    "stochastic-adam": ("relaxation", _LONG),
    "stochastic-sgdm": ("relaxation", _LONG),
    "aadl-average": ("relaxation", (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)),
    "adasam": ("damp", (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)),
}
#: Where the coordinate search starts: (lr, extra).
START = {
    "adam": (1e-2, None),
    "sgdm": (0.1, None),
    "control-adam": (1e-2, 3.0),
    "control-sgdm": (0.1, 3.0),
    "stochastic-adam": (1e-2, 3.0),
    "stochastic-sgdm": (0.1, 3.0),
    "classic-heldout": (1e-2, None),
    "aadl-average": (1e-2, 0.1),
    "adasam": (0.3, 1e-2),
}
TUNED_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minibatch_tuned.json")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    add_run_arguments(parser)
    parser.add_argument(
        "--settings", default=TUNED_FILE, help="the tuned settings the default run uses"
    )
    parser.add_argument("--run", default=None, help="default: minibatch or minibatch-tune")
    args = parser.parse_args(argv)
    check_run_arguments(parser, args)
    args.variants = _names(parser, "--variants", args.variants, VARIANTS)
    if args.run is None:
        args.run = "minibatch-tune" if args.tune else "minibatch"
    return args


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a run, shared with ``minibatch_averaging.py``."""
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tune", action="store_true", help="tune on the validation split")
    parser.add_argument("--tune-seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="3 epochs, 2 seeds")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out-dir", default="runs")


def check_run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--quick``, ``--datasets`` and the counts of :func:`add_run_arguments`."""
    if args.quick:
        args.epochs, args.seeds, args.tune_seeds = 3, 2, 1
    args.datasets = _names(parser, "--datasets", args.datasets, DATASETS)
    for name in ("seeds", "epochs", "batch_size", "hidden", "threads", "tune_seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


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


TEXTURES = ("horizontal", "vertical", "diagonal", "antidiagonal", "checker", "rings")


def make_textures(
    n: int = 2400, size: int = 16, seed: int = 0, noise: float = 0.6
) -> tuple[Any, Any]:
    """``n`` grey ``size`` x ``size`` texture images of the six kinds :data:`TEXTURES`
    (balanced labels), drawn with NumPy from ``seed``: a sinusoidal pattern of random period
    (3-6 px), phase and amplitude (0.3-1), its orientation jittered (by up to a quarter of its
    wave vector), plus Gaussian noise of std ``noise``; ``rings`` are concentric about a random
    point. Returns ``(images (n, 1, size, size) float32, labels (n,) int64)``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(TEXTURES)
    rng.shuffle(labels)
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    images = np.empty((n, 1, size, size), dtype=np.float32)
    for i, label in enumerate(labels):
        k = 2 * np.pi / rng.uniform(3, 6)
        phase = rng.uniform(0, 2 * np.pi)
        jitter = rng.uniform(-0.25, 0.25)
        kind = TEXTURES[label]
        if kind == "horizontal":
            pattern = np.sin(k * (yy + jitter * xx) + phase)
        elif kind == "vertical":
            pattern = np.sin(k * (xx + jitter * yy) + phase)
        elif kind == "diagonal":
            pattern = np.sin(k * (1 + jitter) * (xx + yy) / np.sqrt(2) + phase)
        elif kind == "antidiagonal":
            pattern = np.sin(k * (1 + jitter) * (xx - yy) / np.sqrt(2) + phase)
        elif kind == "checker":
            pattern = np.sin(k * xx + phase) * np.sin(k * yy + 0.7 * phase)
        else:  # rings
            cy, cx = rng.uniform(0, size, size=2)
            pattern = np.cos(k * np.hypot(xx - cx, yy - cy) + phase)
        amplitude = rng.uniform(0.3, 1.0)
        images[i, 0] = amplitude * pattern + rng.normal(0, noise, size=pattern.shape)
    return images, labels.astype(np.int64)


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
    elif name == "textures":
        features, labels = make_textures()
        description = (
            "2400 16x16 grey images drawn by make_textures (seed 0): six sinusoidal textures "
            "(horizontal, vertical, diagonal, antidiagonal, checker, rings) of random period, "
            "phase and amplitude, Gaussian noise std 0.6"
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


def make_model(data: Dataset, hidden: int, seed: int) -> nn.Module:
    """An MLP (inputs -> hidden tanh -> classes) for flat features, a small CNN for images."""
    torch.manual_seed(seed)
    x = data.train.x
    if x.dim() == 2:
        return nn.Sequential(
            nn.Linear(x.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, data.num_classes)
        )
    side = x.shape[-1] // 4
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side * side, data.num_classes),
    )


# -- the control and the adapters -------------------------------------------------------------
class ControlState(NamedTuple):
    """State of :class:`GuardedLongStep`: the inner optimizer's and two counters."""

    inner: Any
    num_mixed: Tensor  # long steps kept
    num_rejected: Tensor  # long steps rejected (the plain step taken)


class GuardedLongStep:
    """The no-mixing control: the inner optimizer's update ``u`` from ``x`` gives the plain
    step ``y = x + u`` and the long step ``z = x + factor * u``; ``z`` is returned when
    ``loss_fn(z) < loss_fn(y)`` (the next minibatch's loss), else ``y``. Without
    ``loss_fn`` it returns ``y``. Same cost as the Anderson safeguard: two forward passes."""

    def __init__(self, inner: Any, factor: float) -> None:
        self.inner, self.factor = inner, factor

    def init(self, params: Any) -> ControlState:
        zero = torch.zeros((), dtype=torch.int64)
        return ControlState(self.inner.init(params), zero, zero.clone())

    def update(self, state: ControlState, params: Any, grads: Any, *, inplace=False, loss_fn=None):
        updates, inner = self.inner.update(grads, state.inner, params=params, inplace=inplace)
        plain = optree.tree_map(torch.add, params, updates)
        if loss_fn is None:
            return plain, state._replace(inner=inner)
        long = optree.tree_map(lambda p, u: p + self.factor * u, params, updates)
        keep = bool(loss_fn(long) < loss_fn(plain))
        kept, rejected = state.num_mixed + keep, state.num_rejected + (not keep)
        return (long if keep else plain), ControlState(inner, kept, rejected)


class AdaSAMStep:
    """:func:`aadl_func.adasam` behind the example's ``update(..., inplace, loss_fn)`` call
    (AdaSAM has no loss-based acceptance: ``loss_fn`` is never passed)."""

    def __init__(self, lr: float, damp: float) -> None:
        self.opt = aa.adasam(lr, damp=damp)

    def init(self, params: Any) -> aa.AdaSAMState:
        return self.opt.init(params)

    def update(self, state: aa.AdaSAMState, params: Any, grads: Any, **_: Any):
        return self.opt.update(state, params, grads)


@dataclass(frozen=True)
class Variant:
    name: str
    lr: float
    extra: float | None
    make: Callable[[], Any]  # -> an object with init / update(state, params, grads, ...)
    safeguard: bool  # whether update gets the next-minibatch loss_fn

    @property
    def label(self) -> str:
        text = f"{self.name} lr={self.lr:g}"
        if self.extra is not None:
            text += f" {EXTRA[self.name][0]}={self.extra:g}"
        return text


def make_variant(name: str, lr: float, extra: float | None) -> Variant:
    """The variant ``name`` at learning rate ``lr`` and extra hyperparameter ``extra``."""
    inner = aa.sgd(lr, momentum=0.9) if name.endswith("sgdm") else aa.adam(lr)
    if name in BASELINES:
        return Variant(name, lr, None, lambda: PlainOptimizer(inner), False)
    if name in CONTROLS:
        return Variant(name, lr, extra, lambda: GuardedLongStep(inner, extra), True)
    if name.startswith("stochastic"):
        options = dict(mode="classic", history_depth=5, relaxation=extra, restart_on_reject=True)
        return Variant(name, lr, extra, lambda: aa.anderson(inner, **options), True)
    if name == "classic-heldout":
        return Variant(
            name, lr, None, lambda: aa.anderson(inner, mode="classic", history_depth=5), True
        )
    if name == "aadl-average":
        options = dict(relaxation=extra, wait_iterations=1, history_depth=15, average=True)
        return Variant(name, lr, extra, lambda: aa.anderson(inner, **options), False)
    if name == "adasam":
        return Variant(name, lr, extra, lambda: AdaSAMStep(lr, extra), False)
    raise ValueError(f"unknown variant {name!r}")


# -- one run ----------------------------------------------------------------------------------
def train_run(
    data: Dataset,
    variant: Variant,
    seed: int,
    epochs: int,
    split: str,
    args: argparse.Namespace,
    observers: Sequence[Any] = (),
) -> dict[str, Any]:
    """Trains one seed; returns per-epoch curves (index 0: before training). Seconds: the
    process's CPU time in training (evaluation excluded), which other jobs on a shared
    machine do not inflate (one thread). ``observers`` (e.g. the averaging of
    ``minibatch_averaging.py``) watch the run without changing it: ``observer.step(params,
    grads)`` after every update and ``observer.epoch(params)`` at epoch 0 and after every
    epoch; their time is not counted in the seconds."""
    evaluation = getattr(data, split)
    model = make_model(data, args.hidden, seed)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model = model.to("meta")  # functional_call needs its structure only

    def loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    gradient = grad(loss)

    def held_out_loss(rows: Tensor) -> Callable[[dict[str, Tensor]], Tensor]:
        x_held, y_held = data.train.x[rows], data.train.y[rows]
        return lambda p: loss(p, x_held, y_held)

    accuracy: list[float] = []
    train_loss: list[float] = []

    def record() -> None:
        with torch.no_grad():
            logits = functional_call(model, params, (evaluation.x,))
            accuracy.append((logits.argmax(dim=1) == evaluation.y).double().mean().item())
            train_loss.append(loss(params, data.train.x, data.train.y).item())

    optimizer = variant.make()
    state = optimizer.init(params)
    order = torch.Generator().manual_seed(10_000 + seed)
    n = len(data.train.y)
    record()
    for observer in observers:
        observer.epoch(params)
    seconds = 0.0
    elapsed = [0.0]  # training seconds after each epoch
    steps = 0
    for _ in range(epochs):
        start = time.process_time()
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
            steps += 1
            if observers:
                watching = time.process_time()
                for observer in observers:
                    observer.step(params, grads)
                start += time.process_time() - watching
        seconds += time.process_time() - start
        elapsed.append(seconds)
        record()
        for observer in observers:
            observer.epoch(params)
        if not math.isfinite(train_loss[-1]):  # diverged: the rest of the curve is chance
            break
    while len(accuracy) < epochs + 1:
        accuracy.append(accuracy[-1])
        train_loss.append(train_loss[-1])
        elapsed.append(seconds)
    counters = {
        name: int(getattr(state, name))
        for name in ("num_mixed", "num_rejected", "num_fallback", "num_averaged")
        if hasattr(state, name)
    }
    return {
        "seed": seed,
        "accuracy": accuracy,
        "train_loss": [finite_or_none(v) for v in train_loss],
        "wall_seconds": seconds,
        "elapsed_seconds": elapsed,
        "steps": steps,
        **counters,
    }


# -- statistics -------------------------------------------------------------------------------
def epochs_to(curve: Sequence[float], target: float) -> int | None:
    """First epoch (0 is the initial model) whose accuracy is >= ``target``, or None."""
    return next((e for e, v in enumerate(curve) if v >= target), None)


def seconds_to(run: dict[str, Any], target: float) -> float | None:
    epoch = epochs_to(run["accuracy"], target)
    return None if epoch is None else run["elapsed_seconds"][epoch]


def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(known) if known else None,
        "std": statistics.stdev(known) if len(known) > 1 else (0.0 if known else None),
        "count": len(known),
        "of": len(values),
    }


def tuning_score(runs: Sequence[dict[str, Any]], target: float, epochs: int) -> tuple:
    """Lower is better: mean epochs to ``target`` (a miss counts ``2 * epochs``), then the
    negated mean final accuracy."""
    reached = [epochs_to(r["accuracy"], target) for r in runs]
    mean_epochs = statistics.fmean(2 * epochs if e is None else e for e in reached)
    return (mean_epochs, -statistics.fmean(r["accuracy"][-1] for r in runs))


def summarise(results: dict[str, list[dict[str, Any]]], target: float) -> dict[str, Any]:
    """Per-variant statistics and the goal, for one data set."""
    stats: dict[str, Any] = {}
    for name, runs in results.items():
        stats[name] = {
            "epochs_to_target": mean_std([epochs_to(r["accuracy"], target) for r in runs]),
            "seconds_to_target": mean_std([seconds_to(r, target) for r in runs]),
            "final_accuracy": mean_std([r["accuracy"][-1] for r in runs]),
            "final_train_loss": mean_std([r["train_loss"][-1] for r in runs]),
            "seconds_per_epoch": mean_std(
                [r["wall_seconds"] / (len(r["accuracy"]) - 1) for r in runs]
            ),
        }
        for counter in ("num_mixed", "num_rejected", "num_fallback", "num_averaged"):
            if counter in runs[0]:
                stats[name][counter] = mean_std([r[counter] for r in runs])
    return {"target": target, "stats": stats, "goal": goal(stats)}


def goal(stats: dict[str, Any]) -> dict[str, Any]:
    """Issue 22's goal for each variant that is neither a baseline nor a control: every seed
    reaches the target; mean epochs >= 1.2x fewer than tuned Adam's and than the better
    control's (fewer mean epochs); mean seconds to the target no more than either's."""

    def cost(name: str, key: str) -> float | None:
        s = stats[name][key]
        return s["mean"] if s["count"] == s["of"] else None

    references = {}
    if "adam" in stats:
        references["adam"] = "adam"
    controls = [c for c in CONTROLS if c in stats and cost(c, "epochs_to_target") is not None]
    if controls:
        references["control"] = min(controls, key=lambda c: cost(c, "epochs_to_target"))
    rows: dict[str, Any] = {}
    for name in stats:
        if name in BASELINES or name in CONTROLS:
            continue
        epochs, seconds = cost(name, "epochs_to_target"), cost(name, "seconds_to_target")
        row: dict[str, Any] = {"epochs": epochs, "seconds": seconds}
        met = epochs is not None and len(references) == 2
        for role, ref in references.items():
            ref_epochs, ref_seconds = cost(ref, "epochs_to_target"), cost(ref, "seconds_to_target")
            ratio = ref_epochs / epochs if epochs and ref_epochs is not None else None
            faster = seconds is not None and (ref_seconds is None or seconds <= ref_seconds)
            row[role] = {"name": ref, "epoch_ratio": ratio, "not_slower_in_seconds": faster}
            met = met and (ratio is None or ratio >= 1.2) and faster
            if ratio is None and ref_epochs is not None:
                met = False
        row["met"] = met
        rows[name] = row
    return {"references": references, "variants": rows}


# -- tuning -----------------------------------------------------------------------------------
def coordinate_search(
    score: Callable[[tuple[int, ...]], tuple], sizes: Sequence[int], start: tuple[int, ...]
) -> tuple[int, ...]:
    """Coordinate search on a lattice of ``sizes``: along each axis in turn, move to the best
    of the point and its two neighbours until the point is the best; repeat over the axes
    until no axis moves. ``score`` (lower is better) is called once per point (cached by the
    caller). The result beats its neighbours on every axis, so it is interior unless it sits
    at a lattice end."""
    point = tuple(start)
    moved = True
    while moved:
        moved = False
        for axis, size in enumerate(sizes):
            while True:
                candidates = [point]
                for step in (-1, 1):
                    index = point[axis] + step
                    if 0 <= index < size:
                        candidates.append(point[:axis] + (index,) + point[axis + 1 :])
                best = min(candidates, key=score)
                if best == point:
                    break
                point, moved = best, True
    return point


def evaluate(
    data: Dataset, name: str, lr: float, extra: float | None, seeds: list[int], args
) -> dict[str, Any]:
    """One tuning point: ``name`` at ``(lr, extra)`` on the validation split, over ``seeds``."""
    target = TARGETS[data.name]
    variant = make_variant(name, lr, extra)
    runs = [train_run(data, variant, s, args.epochs, "val", args) for s in seeds]
    point = {
        "lr": lr,
        "extra": extra,
        "score": tuning_score(runs, target, args.epochs),
        "final_accuracy": [r["accuracy"][-1] for r in runs],
        "epochs_to_target": [epochs_to(r["accuracy"], target) for r in runs],
        "seconds_to_target": [seconds_to(r, target) for r in runs],
    }
    if not args.no_progress:
        print(f"  {data.name} {variant.label}: {point['score']}", flush=True)
    return point


def tune_variant(data: Dataset, name: str, seeds: list[int], args) -> dict[str, Any]:
    """The coordinate search for one variant on one data set."""
    grids = [LR_GRID] + ([EXTRA[name][1]] if name in EXTRA else [])
    lr0, extra0 = START[name]
    start = (LR_GRID.index(lr0),) + ((grids[1].index(extra0),) if name in EXTRA else ())
    cache: dict[tuple[int, ...], Any] = {}

    def score(point: tuple[int, ...]) -> tuple:
        if point not in cache:
            extra = grids[1][point[1]] if len(point) > 1 else None
            cache[point] = evaluate(data, name, grids[0][point[0]], extra, seeds, args)
        return cache[point]["score"]

    chosen = coordinate_search(score, [len(g) for g in grids], start)
    edge = ["lr"] if chosen[0] in (0, len(LR_GRID) - 1) else []
    if len(chosen) > 1 and chosen[1] in (0, len(grids[1]) - 1):
        edge.append(EXTRA[name][0])
    entry = {
        "lr": cache[chosen]["lr"],
        "extra": cache[chosen]["extra"],
        "extra_name": EXTRA[name][0] if name in EXTRA else None,
        "at_lattice_end": edge,
        "evaluated": sorted(cache.values(), key=lambda c: c["score"]),
    }
    label = make_variant(name, entry["lr"], entry["extra"]).label
    note = f" (at the lattice end: {edge})" if edge else ""
    print(f"{data.name} {name}: chose {label} after {len(cache)} settings{note}", flush=True)
    return entry


def tune(args: argparse.Namespace, datasets: dict[str, Dataset]) -> dict[str, Any]:
    seeds = list(range(100, 100 + args.tune_seeds))
    choices = {
        d: {
            "seeds": seeds,
            "epochs": args.epochs,
            "target": TARGETS[d],
            "variants": {name: tune_variant(data, name, seeds, args) for name in args.variants},
        }
        for d, data in datasets.items()
    }
    return {"choices": choices}


def _setting(entry: dict[str, Any]) -> tuple[float, float | None]:
    return entry["lr"], entry["extra"]


def load_settings(path: str) -> dict[str, dict[str, tuple[float, float | None]]]:
    """``{data set: {variant: (lr, extra)}}`` from a tuning.json; the start points for any
    pair it lacks."""
    chosen: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            chosen = {d: c["variants"] for d, c in json.load(f)["choices"].items()}
    return {
        d: {v: _setting(chosen[d][v]) if v in chosen.get(d, {}) else START[v] for v in VARIANTS}
        for d in DATASETS
    }


# -- output -----------------------------------------------------------------------------------
def _pm(entry: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    if entry["mean"] is None:
        return f"- (0/{entry['of']})"
    text = f"{scale * entry['mean']:.{digits}f} ± {scale * entry['std']:.{digits}f}"
    return text if entry["count"] == entry["of"] else f"{text} ({entry['count']}/{entry['of']})"


def report(name: str, summary: dict[str, Any], labels: dict[str, str], seeds: int) -> None:
    stats = summary["stats"]
    print(f"\n== {name}: test accuracy target {100 * summary['target']:.0f}% ({seeds} seeds) ==")
    header = ["variant", "setting", "epochs to target", "s to target", "final acc %"]
    header += ["final train loss", "s/epoch", "kept/rejected"]
    rows = []
    for variant, s in stats.items():
        kept = "-"
        if "num_mixed" in s:
            other = s.get("num_rejected", s.get("num_fallback"))
            kept = f"{s['num_mixed']['mean']:.0f}/{other['mean']:.0f}" if other else "-"
        rows.append([
            variant, labels[variant].split(" ", 1)[1], _pm(s["epochs_to_target"], digits=1),
            _pm(s["seconds_to_target"]), _pm(s["final_accuracy"], 100),
            _pm(s["final_train_loss"], digits=4), _pm(s["seconds_per_epoch"], digits=3), kept,
        ])  # fmt: skip
    print(format_table(header, rows))
    g = summary["goal"]
    refs = ", ".join(f"{role}: {ref}" for role, ref in g["references"].items())
    print(f"goal (>= 1.2x fewer epochs and no more seconds than {refs}):")
    for variant, row in g["variants"].items():
        parts = []
        for role in g["references"]:
            r = row[role]
            ratio = "-" if r["epoch_ratio"] is None else f"{r['epoch_ratio']:.2f}x"
            slower = "" if r["not_slower_in_seconds"] else "slower in "
            parts.append(f"vs {role} {ratio} epochs, {slower}seconds")
        print(f"  {variant:>16}: {'; '.join(parts)} -> {'met' if row['met'] else 'not met'}")


def markdown(summary: dict[str, Any]) -> str:
    """The default run as Markdown (docs/minibatch.md's tables): per data set, the table over
    seeds, the goal and the per-seed epochs to the target / final accuracy."""
    lines = []
    for name, data in summary["datasets"].items():
        stats, labels = data["stats"], summary["config"]["variants"][name]
        seeds = summary["config"]["seeds"]
        lines += [
            f"\n**{name}** (test split, target {100 * data['target']:.0f}%, {seeds} seeds)\n",
            "| variant | setting | epochs to target | s to target | final acc. % "
            "| final train loss | s/epoch |",
            "|---|---|---|---|---|---|---|",
        ]
        for variant, s in stats.items():
            cells = [
                variant, labels[variant].split(" ", 1)[1], _pm(s["epochs_to_target"], digits=1),
                _pm(s["seconds_to_target"]), _pm(s["final_accuracy"], 100),
                _pm(s["final_train_loss"], digits=3), _pm(s["seconds_per_epoch"], digits=3),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines += per_seed_table(data["runs"], data["target"], seeds, "variant")
    return "\n".join(lines) + "\n"


def per_seed_table(runs: dict[str, list], target: float, seeds: int, first: str) -> list[str]:
    """Markdown lines: per row and seed, the epochs to the target / final accuracy %."""
    lines = ["", f"| {first} | " + " | ".join(f"seed {i}" for i in range(seeds)) + " |"]
    lines.append("|---|" + "---|" * seeds)
    for name, row in runs.items():
        cells = []
        for r in row:
            e = epochs_to(r["accuracy"], target)
            cells.append(f"{'-' if e is None else e} / {100 * r['accuracy'][-1]:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("\n(per seed: epochs to the target / final test accuracy %)")
    return lines


def tuning_markdown(tuning: dict[str, Any]) -> str:
    """The tuning as Markdown: per data set and variant, the choice and every setting tried
    (mean epochs to the target on validation, a miss counting twice the epochs; mean final
    validation accuracy)."""
    lines = []
    for name, entry in tuning["choices"].items():
        lines += [
            f"\n**{name}** (validation, target {100 * entry['target']:.0f}%, seeds "
            f"{entry['seeds']}, {entry['epochs']} epochs)\n",
            "| variant | chosen | settings tried: lr[, extra] -> score (epochs, final val. %) |",
            "|---|---|---|",
        ]
        for variant, v in entry["variants"].items():
            chosen = f"lr {v['lr']:g}" + (
                f", {v['extra_name']} {v['extra']:g}" if v["extra"] is not None else ""
            )
            if v["at_lattice_end"]:
                chosen += f" (lattice end: {', '.join(v['at_lattice_end'])})"
            tried = "; ".join(
                f"{e['lr']:g}" + ("" if e["extra"] is None else f", {e['extra']:g}")
                + f" -> {e['score'][0]:.1f}, {-100 * e['score'][1]:.1f}"
                for e in sorted(v["evaluated"], key=lambda e: (e["lr"], e["extra"] or 0))
            )  # fmt: skip
            lines.append(f"| {variant} | {chosen} | {tried} |")
    return "\n".join(lines) + "\n"


def plot(path: str, summaries: dict[str, Any], results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 4.6), squeeze=False)
    for ax, (name, summary) in zip(axes[0], summaries.items()):
        for variant, runs in results[name].items():
            curves = [[100 * v for v in r["accuracy"]] for r in runs]
            mean = [statistics.fmean(v) for v in zip(*curves)]
            ax.plot(range(len(mean)), mean, label=variant, lw=1.4)
        ax.axhline(100 * summary["target"], color="gray", ls=":", lw=0.9)
        ax.set_ylim(max(0.0, 100 * summary["target"] - 25), 100.0)
        ax.set(xlabel="epoch", ylabel="test accuracy (%)", title=f"{name} (seed mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    datasets = {name: load_dataset(name) for name in args.datasets}
    out = os.path.join(args.out_dir, args.run)
    os.makedirs(out, exist_ok=True)
    # Warm-up (first-call allocations of functional_call and grad), so that no run's time
    # pays for it.
    for name in args.datasets:
        train_run(datasets[name], make_variant("adam", 1e-3, None), 0, 1, "val", args)
    started = time.perf_counter()
    if args.tune:
        tuning = tune(args, datasets)
        tuning["total_seconds"] = time.perf_counter() - started
        write_json(os.path.join(out, "tuning.json"), tuning)
        with open(os.path.join(out, "tuning.md"), "w") as f:
            f.write(tuning_markdown(tuning))
        print(f"\ntuning took {tuning['total_seconds']:.0f} s; wrote {out}/tuning.json")
        return tuning
    settings = load_settings(args.settings)
    table = {d: {v: make_variant(v, *settings[d][v]) for v in args.variants} for d in datasets}
    jobs = [(d, v, s) for d in args.datasets for v in args.variants for s in range(args.seeds)]
    results: dict[str, dict[str, list]] = {d: {v: [] for v in args.variants} for d in datasets}
    bar = tqdm(jobs, desc="runs", disable=args.no_progress)
    for dataset, variant, seed in bar:
        bar.set_postfix_str(f"{dataset} {variant} seed {seed}")
        run = train_run(datasets[dataset], table[dataset][variant], seed, args.epochs, "test", args)
        results[dataset][variant].append(run)
    bar.close()
    total = time.perf_counter() - started
    summaries = {d: summarise(results[d], TARGETS[d]) for d in datasets}
    for d in datasets:
        report(d, summaries[d], {v: table[d][v].label for v in args.variants}, args.seeds)
    summary = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("no_progress", "out_dir", "run")},
            "evaluated_on": "test",
            "targets": {d: TARGETS[d] for d in datasets},
            "held_out_minibatch": "minibatch i + 1 of the same epoch (the next one)",
            "variants": {d: {v: table[d][v].label for v in args.variants} for d in datasets},
            "seconds": "CPU time of this process in training (time.process_time, one thread)",
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
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(markdown(summary))
    plot(os.path.join(out, "test_accuracy.png"), summaries, results)
    print(f"\n{len(jobs)} runs in {total:.0f} s; wrote {out}/summary.json and test_accuracy.png")
    return summary


if __name__ == "__main__":
    main()

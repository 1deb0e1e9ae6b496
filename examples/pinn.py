r"""A physics-informed network for the 1-D Poisson equation, full batch: Adam, L-BFGS, Adam then
L-BFGS, and Anderson acceleration.

The problem (data made here, nothing downloaded):

.. math::

    -u''(x) = f(x) \text{ on } (0, 1), \quad u(0) = u(1) = 0, \qquad
    u^*(x) = \sin(\pi x) + 0.2 \sin(4 \pi x),

with :math:`f = -{u^*}''`. An MLP ``1 -> 20 -> 20 -> 1`` (tanh; 481 parameters) is trained on
the loss

.. math::

    L = \frac{\operatorname{mean}_i (u''(x_i) + f(x_i))^2}{\operatorname{mean}_i f(x_i)^2}
        + \tfrac12 (u(0)^2 + u(1)^2)

over 64 equispaced interior collocation points (full batch); ``u''`` comes from two nested
``torch.func.grad`` calls over the batch. The tracked metric is the relative L2 error of ``u``
against :math:`u^*` on 1,001 points (computed for every iterate, not timed).

Rows, all from the same initial weights per seed and with the same budget of
gradient-equivalents (a forward-only loss counts 1/2 here: it includes the two derivative
passes; the script prints the measured time ratio):

* ``GD``, ``Adam`` and ``L-BFGS`` (``torch.optim.LBFGS``, strong Wolfe), each tuned;
* ``Adam -> L-BFGS``: the usual PINN recipe, Adam for a number of steps then L-BFGS (tuned);
* ``AA``, ``AA + deferred safeguard`` and ``AA + loss_fn safeguard``: the best configurations
  of ``aa.anderson`` without a safeguard, with the deferred one (``update(..., loss=value)``)
  and with the ``loss_fn`` one (tuned).

How the settings were chosen (``--tune``): a grid per method (16 settings; GD: 8 learning
rates), three tuning seeds (100, 101, 102; the reported seeds are 0, 1, 2), the full budget;
kept is the setting that reaches a training loss of 1e-4 on all tuning seeds in the fewest
gradient-equivalents (then: lowest final training loss). The values chosen are the constants
below; the grids are :func:`tuning_grids`.

Usage::

    python examples/pinn.py            # 7 methods x 3 seeds (about two minutes)
    python examples/pinn.py --quick    # 1 seed, 300 gradient-equivalents: smoke test
    python examples/pinn.py --tune     # the tuning sweeps

Writes ``<out-dir>/<run>/summary.json`` and ``<out-dir>/<run>/curves.png`` (``--tune``:
``tune.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PlainOptimizer, write_json  # noqa: E402
from _compare import (  # noqa: E402
    Comparison,
    Method,
    Problem,
    aa_row,
    adam_method,
    lbfgs_method,
    markdown,
    measure_forward_ratio,
    plot,
    report,
    run_all,
    summarize_runs,
)
from _compare import tune as run_tuning  # noqa: E402

FORWARD_COST = 0.5
SEEDS = (0, 1, 2)
TUNING_SEEDS = (100, 101, 102)
BUDGET = 2000  # gradient-equivalents per run
COLLOCATION = 64
WIDTH = 20

COMPARISON = Comparison(
    loss_targets=(1e-3, 1e-4),
    tune_target=1e-4,
    verdict_key="metric<0.001",
    baselines=("adam", "lbfgs", "adam_lbfgs"),
    accelerated=("aa", "aa_deferred", "aa_safeguard"),
    final_metrics={"l2_error": ("rel. L2 error", 1.0, ".1e")},
    metric_targets=(1e-2, 1e-3),
    metric_name="rel. L2 error",
    table_keys=("loss<0.0001", "metric<0.001"),
)

# Chosen by `--tune` (grids in tuning_grids(); criterion in the module docstring). Mean
# gradient-equivalents to loss 1e-4 over the tuning seeds: GD never (lr 0.1: the lowest final
# loss, 0.3 diverged); Adam 629 (lr 0.01: 698, 0.1 missed on 2 seeds of 3; beta1 = 0 never);
# L-BFGS 286 (history 50, the largest of the grid; lr 1, history 20: 418); Adam -> L-BFGS 225
# (200 steps of Adam 0.01: 297); AA without the safeguard never (the setting below had the
# lowest final loss; around Adam with beta1 = 0.9 it diverged; an earlier grid at lr 0.003
# did worse); AA + loss_fn safeguard 1164; AA + deferred safeguard 939 (depth 5: 1209; around
# Adam without momentum it never got there).
GD = {"lr": 0.1}
ADAM = {"lr": 0.03, "betas": (0.9, 0.999)}
LBFGS = {"lr": 0.3, "history_size": 50}
ADAM_LBFGS = {"lr": 0.03, "first_steps": 100}
AA = {"lr": 0.01, "beta1": 0.0, "history_depth": 5, "wait_iterations": 200}
AA_SAFEGUARD = {"lr": 0.01, "beta1": 0.9, "history_depth": 5, "wait_iterations": 200}
AA_DEFERRED = {"lr": 0.01, "beta1": 0.9, "history_depth": 10, "wait_iterations": 200}


def exact(x: Tensor) -> Tensor:
    return torch.sin(math.pi * x) + 0.2 * torch.sin(4 * math.pi * x)


def source(x: Tensor) -> Tensor:
    """f = -u*''."""
    return math.pi**2 * torch.sin(math.pi * x) + 0.2 * (4 * math.pi) ** 2 * torch.sin(
        4 * math.pi * x
    )


def make_model(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(1, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    )
    return model.to(dtype)


def pointwise(model: nn.Module) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    """`u(params, points)`: the network as a function of its params and a 1-d batch of
    points, one output per point."""

    def u(params: dict[str, Tensor], points: Tensor) -> Tensor:
        return functional_call(model, params, (points.reshape(-1, 1),)).reshape(-1)

    return u


def derivatives(
    u: Callable[[dict[str, Tensor], Tensor], Tensor], params: dict[str, Tensor], x: Tensor
) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """`(du, d2u)`: the function `points -> u'(points)` and `u''(x)`. Each output depends on
    its own input only, so the gradient of the sum over the batch is the batch of
    derivatives."""

    def du(points: Tensor) -> Tensor:
        return grad(lambda p: u(params, p).sum())(points)

    return du, grad(lambda p: du(p).sum())(x)


def make_problem(seed: int, dtype: torch.dtype = torch.float32, wall_clock: bool = False):
    model = make_model(seed, dtype)
    x = torch.linspace(0, 1, COLLOCATION + 2, dtype=dtype)[1:-1]
    f = source(x)
    f_scale = (f**2).mean()
    boundary = torch.tensor([[0.0], [1.0]], dtype=dtype)
    x_test = torch.linspace(0, 1, 1001, dtype=dtype)
    u_test = exact(x_test)

    u = pointwise(model)

    def train_loss(params: dict[str, Tensor]) -> Tensor:
        _, d2u = derivatives(u, params, x)
        residual = ((d2u + f) ** 2).mean() / f_scale
        edge = functional_call(model, params, (boundary,))
        return residual + 0.5 * (edge**2).sum()

    def forward_loss(params: dict[str, Tensor]) -> Tensor:
        with torch.no_grad():  # torch.func.grad still differentiates in x inside
            return train_loss(params)

    def l2_error(params: dict[str, Tensor]) -> float:
        with torch.no_grad():
            return ((u(params, x_test) - u_test).norm() / u_test.norm()).item()

    return Problem(
        initial={n: p.detach().clone() for n, p in model.named_parameters()},
        loss_and_grad=grad_and_value(train_loss),
        loss=forward_loss,
        evaluate=lambda params: {"l2_error": l2_error(params)},
        forward_cost=FORWARD_COST,
        track=l2_error,
        clock=time.perf_counter if wall_clock else time.process_time,
    )


# -- methods ---------------------------------------------------------------------------------
def gd_method(lr: float) -> Method:
    return Method(
        "GD",
        "functional",
        make=lambda: PlainOptimizer(aa.sgd(lr)),
        options={"lr": lr},
        description=f"aa.sgd({lr:g})",
    )


def adam_lbfgs_method(lr: float, first_steps: int) -> Method:
    lbfgs = {"lr": 1.0, "history_size": 20, "max_iter": 20}
    return Method(
        "Adam -> L-BFGS",
        "then-lbfgs",
        make=lambda: PlainOptimizer(aa.adam(lr)),
        options={"adam_lr": lr, "first_steps": first_steps, "lbfgs": lbfgs},
        description=f"{first_steps} steps of aa.adam({lr:g}), then L-BFGS(lr=1, history_size=20)",
    )


def aa_method(
    lr: float, beta1: float, history_depth: int, wait_iterations: int, safeguard: str
) -> Method:
    def make():
        return aa.anderson(
            aa.adam(lr, betas=(beta1, 0.999)),
            history_depth=history_depth,
            mode="classic",
            wait_iterations=wait_iterations,
        )

    label, usage, flags = aa_row(safeguard)
    return Method(
        label,
        "functional",
        make=make,
        **flags,
        options={
            "inner": f"aa.adam({lr:g}, betas=({beta1:g}, 0.999))",
            "mode": "classic",
            "history_depth": history_depth,
            "wait_iterations": wait_iterations,
            "safeguard": safeguard,
        },
        description=(
            f'aa.anderson(aa.adam({lr:g}, betas=({beta1:g}, 0.999)), mode="classic", '
            f"history_depth={history_depth}, wait_iterations={wait_iterations}){usage}"
        ),
    )


def methods() -> dict[str, Method]:
    return {
        "gd": gd_method(**GD),
        "adam": adam_method(**ADAM),
        "lbfgs": lbfgs_method(**LBFGS),
        "adam_lbfgs": adam_lbfgs_method(**ADAM_LBFGS),
        "aa": aa_method(**AA, safeguard="none"),
        "aa_deferred": aa_method(**AA_DEFERRED, safeguard="deferred"),
        "aa_safeguard": aa_method(**AA_SAFEGUARD, safeguard="loss_fn"),
    }


def tuning_grids() -> dict[str, list[Method]]:
    grids: dict[str, list[Method]] = {
        "gd": [gd_method(lr) for lr in (3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)],
        "adam": [
            adam_method(lr, (beta1, 0.999))
            for beta1 in (0.9, 0.0)
            for lr in (3e-4, 1e-3, 3e-3, 5e-3, 0.01, 0.02, 0.03, 0.1)
        ],
        "lbfgs": [
            lbfgs_method(lr, history_size)
            for lr in (0.1, 0.3, 1.0, 3.0)
            for history_size in (5, 10, 20, 50)
        ],
        "adam_lbfgs": [
            adam_lbfgs_method(lr, first_steps)
            for lr in (3e-3, 0.01, 0.03, 0.1)
            for first_steps in (50, 100, 200, 400)
        ],
    }
    for key, safeguard in (
        ("aa", "none"),
        ("aa_deferred", "deferred"),
        ("aa_safeguard", "loss_fn"),
    ):
        grids[key] = [
            aa_method(lr, beta1, history_depth, wait, safeguard)
            for beta1 in (0.9, 0.0)
            for wait in (0, 200)
            for history_depth in (5, 10)
            for lr in (0.01, 0.03)
        ]
    return grids


# -- main ------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="initial weights")
    parser.add_argument("--budget", type=float, default=BUDGET, help="gradient-equivalents")
    parser.add_argument("--tune", action="store_true", help="run the tuning sweeps instead")
    parser.add_argument("--families", default=None, help="--tune: these grids only (a,b,...)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--run", default="pinn", help="results go to <out-dir>/<run>/")
    parser.add_argument(
        "--quick", action="store_true", help="seed 0, 300 gradient-equivalents (tune: 2 settings)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--wall-clock", action="store_true", help="time in wall seconds instead of CPU seconds"
    )
    args = parser.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error("--seeds: a comma-separated list of integers")
    if args.quick:
        args.seeds, args.budget = [0], 300.0
    if not args.seeds or args.budget < 1 or args.threads < 1:
        parser.error("--seeds must not be empty, --budget and --threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = os.path.join(args.out_dir, args.run)
    os.makedirs(out, exist_ok=True)
    seeds = (TUNING_SEEDS[:1] if args.quick else TUNING_SEEDS) if args.tune else args.seeds
    problems = {seed: make_problem(seed, wall_clock=args.wall_clock) for seed in seeds}
    if args.tune:
        grids = tuning_grids()
        if args.families:
            grids = {f: grids[f] for f in args.families.split(",")}
        if args.quick:
            grids = {family: grid[:2] for family, grid in grids.items()}
        results = run_tuning(grids, problems, args.budget, COMPARISON, not args.no_progress)
        summary = {
            "config": {"seeds": seeds, "budget": args.budget, "target": COMPARISON.tune_target},
            "families": results,
        }
        write_json(os.path.join(out, "tune.json"), summary)
        print(f"\nwrote {os.path.join(out, 'tune.json')}")
        return summary

    forward_ratio = measure_forward_ratio(next(iter(problems.values())))
    rows = methods()
    runs = run_all(rows, problems, args.budget, COMPARISON, not args.no_progress)
    stats, verdict = summarize_runs(runs, COMPARISON)
    summary = {
        "config": {
            "problem": "-u'' = f on (0, 1), u(0) = u(1) = 0, u = sin(pi x) + 0.2 sin(4 pi x)",
            "model": f"MLP 1-{WIDTH}-{WIDTH}-1 tanh",
            "num_params": sum(p.numel() for p in problems[seeds[0]].initial.values()),
            "collocation_points": COLLOCATION,
            "seeds": seeds,
            "budget": args.budget,
            "forward_cost": FORWARD_COST,
            "measured_forward_ratio": forward_ratio,
            "threads": args.threads,
            "clock": "wall seconds" if args.wall_clock else "CPU seconds of the process",
        },
        "methods": {
            key: {"label": m.label, "options": m.options, "description": m.description}
            for key, m in rows.items()
        },
        "runs": runs,
        "stats": stats,
        "verdict": verdict,
    }
    write_json(os.path.join(out, "summary.json"), summary)
    plot(os.path.join(out, "curves.png"), rows, runs, COMPARISON)
    report(summary, rows, COMPARISON)
    table = markdown(summary, rows, COMPARISON)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    print(f"wrote {os.path.join(out, 'summary.json')}, curves.png and table.md")
    return summary


if __name__ == "__main__":
    main()

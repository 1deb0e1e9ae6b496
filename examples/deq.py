r"""A small deep-equilibrium (DEQ) classifier on the 8x8 digits: Anderson vs plain iteration.

The layer is the fixed point

.. math::

    z^* = f(z^*, \theta) = \tanh(z^* W^\top + x U^\top + b), \qquad
    W = \gamma\, V / \|V\|_2 ,

whose weight is spectrally normalised (``gamma = 0.9`` by default), so ``f`` is a contraction
in ``z`` with constant at most ``gamma`` (``tanh`` is 1-Lipschitz) and the fixed point exists
and is unique; the logits are ``z* A^T + c``. The whole minibatch is one fixed-point problem
(the rows do not interact; the residual norm is over the batch matrix).

Training (Adam on the cross-entropy) differentiates through ``z*`` by the implicit function
theorem with :func:`aadl_func.implicit_fixed_point`: the backward pass solves the adjoint fixed
point ``u = J_f^T u + dL/dz*`` with Anderson acceleration, and no forward iteration is stored.
Two runs from the same initial weights and the same minibatches differ only in the *forward*
solver:

* ``anderson``: :func:`aadl_func.fixed_point` (classic mode) inside ``implicit_fixed_point``;
* ``plain``: the iteration ``z <- f(z)``, whose result is handed to ``implicit_fixed_point``
  with ``max_iter=0`` (so the backward pass is the same for both).

Both stop at the first iterate with ``||f(z) - z|| <= rtol ||f(z_0) - z_0||`` (``z_0 = 0``).
The table reports the forward iterations per step, the seconds spent in forward solves and in
the whole training, the final training loss and the test accuracy.

Measured (one CPU thread, shared 2-core machine, defaults: hidden 64, 20 epochs of batch 128,
float32, rtol 1e-4): Anderson needs 9.5 forward iterations per step (at most 14) against 15.3
(at most 23) for plain iteration, and both train the same model (loss 0.0085, test accuracy
97.3%). In time Anderson still loses here, by less: 0.56 s of forward solves against 0.25 s
(torchdeq: 2.5 s), 1.7 s of training against 1.2 s (measured with the solver's own eager
window, docs/solver.md "Speed"; through the core's update it was 3.1 s against 0.34 s). This
layer is cheap (an evaluation of f on the 128 x 64 batch costs ~0.05 ms) and easy (tanh's
saturation makes it contract much faster than ``gamma``), while one Anderson step of those
8,192 numbers costs ~0.1 ms: acceleration pays when an evaluation of f costs more than the
step and the plain iteration needs many steps (``--gamma 0.99``, ``--hidden 256`` change the
iteration counts little: 10.6 against 16.3).

With torchdeq 0.1.0 installed (``pip install --no-deps torchdeq``) a third run, ``torchdeq``,
takes its ``anderson_solver`` (``m = depth - 1``, its ``lam = 1e-4``) as the forward solver,
with the same implicit backward. torchdeq tests each row of the batch (its 2-norm, stopping
when every row passes), so it is given ``rtol ||f(z_0) - z_0|| / sqrt(batch)`` per row, which
implies our whole-batch test and is stricter; the ``evals/step`` column counts the calls of
``f`` of each solver (``--quick``, measured: Anderson 13.6, plain 18.8, torchdeq 41.5; the
three train the same model).

Usage::

    python examples/deq.py            # 20 epochs, hidden 64 (about half a minute)
    python examples/deq.py --quick    # the test's size
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
import torch.nn.functional as F
from torch import Tensor

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import format_table, load_digits, write_json  # noqa: E402

try:  # torchdeq 0.1.0 (pip install --no-deps torchdeq): its anderson_solver as a third run
    from torchdeq.solver.anderson import anderson_solver
except ImportError:
    anderson_solver = None
SOLVERS = ("anderson", "plain") + (("torchdeq",) if anderson_solver is not None else ())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--gamma", type=float, default=0.9, help="spectral norm of W")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rtol", type=float, default=1e-4, help="forward and adjoint solves")
    parser.add_argument("--depth", type=int, default=6, help="history_depth of the solver")
    parser.add_argument("--max-iter", type=int, default=500)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 epochs, hidden 32 (tests)")
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--run", default="deq")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.hidden = 2, 32
    return args


def init_params(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    h = args.hidden

    def uniform(*shape: int, fan_in: int) -> Tensor:
        bound = fan_in**-0.5
        return (2 * torch.rand(*shape, generator=g, dtype=dtype) - 1) * bound

    return {
        "V": uniform(h, h, fan_in=h),
        "U": uniform(h, 64, fan_in=64),
        "b": uniform(h, fan_in=64),
        "A": uniform(10, h, fan_in=h),
        "c": uniform(10, fan_in=h),
    }


def layer(z: Tensor, theta: dict[str, Tensor]) -> Tensor:
    """f(z, theta) = tanh(z W^T + injection): the injection x U^T + b is computed once per
    batch, outside the solver, and enters as a parameter like W."""
    return torch.tanh(z @ theta["W"].T + theta["injection"])


def plain_iteration(
    f: Callable[[Tensor], Tensor], z0: Tensor, rtol: float, max_iter: int
) -> tuple[Tensor, int]:
    """z <- f(z) until ||f(z) - z|| <= rtol ||f(z0) - z0||; returns (z, iterations)."""
    z, fz = z0, f(z0)
    threshold = rtol * float((fz - z0).norm())
    for k in range(max_iter):
        if float((fz - z).norm()) <= threshold:
            return z, k
        z, fz = fz, f(fz)
    return z, max_iter


def torchdeq_forward(
    f: Callable[[Tensor], Tensor], z0: Tensor, rtol: float, max_iter: int, depth: int
) -> tuple[Tensor, int, bool]:
    """torchdeq's ``anderson_solver`` (``m = depth - 1`` differences, as ours, its default
    ``lam = 1e-4``) stopping when every row's residual is below ``rtol ||f(z0) - z0|| /
    sqrt(batch)``, which implies our whole-batch test; returns its point (the lowest-residual
    iterate's ``f(z)``), the evaluations of ``f`` and whether our test holds there."""
    calls = [0]

    def counted(z: Tensor) -> Tensor:
        calls[0] += 1
        return f(z)

    threshold = rtol * float((f(z0) - z0).norm())
    z, _, _ = anderson_solver(
        counted, z0, max_iter=max_iter, tol=threshold / math.sqrt(z0.shape[0]), m=depth - 1
    )
    return z, calls[0] + 1, float((f(z) - z).norm()) <= threshold


def forward(
    params: dict[str, Tensor], x: Tensor, solver: str, args: argparse.Namespace, stats: dict
) -> Tensor:
    """The logits; records the forward solve's iterations and seconds in ``stats``."""
    W = args.gamma * params["V"] / torch.linalg.matrix_norm(params["V"], 2)
    theta = {"W": W, "injection": x @ params["U"].T + params["b"]}
    z0 = torch.zeros(x.shape[0], args.hidden, dtype=x.dtype)
    tol = dict(tol=0.0, rtol=args.rtol, max_iter=args.max_iter)
    adjoint = dict(tol=0.0, rtol=args.rtol, max_iter=args.max_iter, history_depth=args.depth)
    start = time.perf_counter()
    if solver == "anderson":
        z, info = aa.implicit_fixed_point(
            layer, z0, theta, history_depth=args.depth, adjoint_options=adjoint, **tol
        )
        iterations, converged = int(info.iterations), bool(info.converged)
        evaluations = int(info.evaluations)
    elif solver == "torchdeq":
        with torch.no_grad():
            frozen = {k: v.detach() for k, v in theta.items()}
            z0, evaluations, converged = torchdeq_forward(
                lambda z: layer(z, frozen), z0, args.rtol, args.max_iter, args.depth
            )
        iterations = evaluations - 1
        z, _ = aa.implicit_fixed_point(
            layer, z0, theta, max_iter=0, adjoint_options=adjoint, on_nonconvergence="ignore"
        )
    else:
        with torch.no_grad():
            frozen = {k: v.detach() for k, v in theta.items()}
            z0, iterations = plain_iteration(
                lambda z: layer(z, frozen), z0, args.rtol, args.max_iter
            )
        converged = iterations < args.max_iter
        evaluations = iterations + 1
        # max_iter=0: no forward step, just the implicit-function gradient at the plain z*
        # (whose convergence the plain iteration reported).
        z, _ = aa.implicit_fixed_point(
            layer, z0, theta, max_iter=0, adjoint_options=adjoint, on_nonconvergence="ignore"
        )
    stats["forward_seconds"] += time.perf_counter() - start
    stats["iterations"].append(iterations)
    stats["evaluations"].append(evaluations)
    stats["converged"] &= converged
    return z @ params["A"].T + params["c"]


def train(args: argparse.Namespace, solver: str, data: Any, dtype: torch.dtype) -> dict[str, Any]:
    params = {k: v.requires_grad_() for k, v in init_params(args, dtype).items()}
    optimizer = torch.optim.Adam(params.values(), lr=args.lr)
    x_train = data.x_train.reshape(len(data.x_train), -1)
    order = torch.Generator().manual_seed(args.seed + 1)
    stats: dict[str, Any] = {
        "forward_seconds": 0.0, "iterations": [], "evaluations": [], "converged": True
    }  # fmt: skip
    start = time.perf_counter()
    for _ in range(args.epochs):
        for batch in torch.randperm(len(x_train), generator=order).split(args.batch_size):
            loss = F.cross_entropy(forward(params, x_train[batch], solver, args, stats),
                                   data.y_train[batch])  # fmt: skip
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    seconds = time.perf_counter() - start
    evaluation = {"forward_seconds": 0.0, "iterations": [], "evaluations": [], "converged": True}
    with torch.no_grad():
        train_loss = F.cross_entropy(forward(params, x_train, solver, args, evaluation),
                                     data.y_train)  # fmt: skip
        logits = forward(
            params, data.x_test.reshape(len(data.x_test), -1), solver, args, evaluation
        )
    iterations = stats["iterations"]
    return {
        "mean_forward_iterations": sum(iterations) / len(iterations),
        "max_forward_iterations": max(iterations),
        "mean_forward_evaluations": sum(stats["evaluations"]) / len(iterations),
        "all_converged": stats["converged"] and evaluation["converged"],
        "forward_seconds": stats["forward_seconds"],
        "train_seconds": seconds,
        "train_loss": float(train_loss),
        "test_accuracy": float((logits.argmax(1) == data.y_test).double().mean()),
        "steps": len(iterations),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    data = load_digits(dtype=dtype, seed=args.seed)
    results = {solver: train(args, solver, data, dtype) for solver in SOLVERS}
    rows = [
        [solver, r["mean_forward_iterations"], r["max_forward_iterations"],
         r["mean_forward_evaluations"], r["forward_seconds"], r["train_seconds"],
         r["train_loss"], 100 * r["test_accuracy"]]
        for solver, r in results.items()
    ]  # fmt: skip
    print(
        f"DEQ on digits: hidden {args.hidden}, ||W||_2 = {args.gamma}, {args.epochs} epochs of "
        f"batch {args.batch_size}, {args.dtype}, forward/adjoint rtol {args.rtol:g}"
    )
    header = ["forward solver", "iters/step", "max iters", "evals/step", "forward s", "train s",
              "train loss", "test acc %"]  # fmt: skip
    print(format_table(header, rows))
    summary = {"config": vars(args), **results}
    write_json(os.path.join(args.out_dir, args.run, "summary.json"), summary)
    return summary


if __name__ == "__main__":
    main()

r"""Deterministic fixed-point problems: plain iteration vs Anderson acceleration vs GMRES/L-BFGS.

(a) Gradient descent on a quadratic :math:`f(x) = \tfrac12 x^\top A x - b^\top x`, ``A``
symmetric positive definite (``n = 100``, eigenvalues log-spaced in ``[1, kappa]``), step
:math:`\eta = 1/\lambda_{\max}`. The map is affine,

.. math::

    g(x) = x - \eta (A x - b) = M x + c, \qquad M = I - \eta A, \quad c = \eta b,

so plain iteration contracts by :math:`1 - 1/\kappa` per step, and type-II Anderson
acceleration with full history and relaxation 1 is GMRES on :math:`(I - M) x = c` in disguise:
:math:`x^{AA}_{k+1} = g(x^{GMRES}_k)` (Walker & Ni, 2011). GMRES here is written out with NumPy
(Arnoldi, modified Gram-Schmidt, float64), independent of aadl_func. The count is the number
of evaluations of ``g`` (gradients; matrix-vector products for GMRES) until the fixed-point
residual :math:`\|g(x) - x\|` is below ``tol`` times its value at :math:`x_0 = 0`.

(b) Multinomial logistic regression on the 8x8 digits (64 pixels + bias, 10 classes, L2 weight
``1e-3``, so strongly convex), full-batch gradient descent with the step :math:`1/L` from the
bound :math:`L \le \tfrac12 \lambda_{\max}(\tilde X^\top \tilde X)/N + \lambda` (the Hessian
of log-sum-exp is at most 1/2). The map is nonlinear, so the accelerated runs use the loss
safeguard. The count is gradient evaluations until :math:`\|\nabla f\|` drops below ``tol``
times its initial value; ``f - f*`` is measured against a tight SciPy L-BFGS reference, which
also appears in the table (its count is function+gradient evaluations).

Usage::

    python examples/fixed_point.py               # both problems (seconds)
    python examples/fixed_point.py --n 40 --max-iter 600 --skip-logistic
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import grad_and_value

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PlainOptimizer, format_table, load_digits, write_json  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100, help="quadratic: dimension")
    parser.add_argument("--kappa", type=float, default=100.0, help="quadratic: condition number")
    parser.add_argument("--tol", type=float, default=1e-8, help="quadratic: relative residual")
    parser.add_argument("--depth", type=int, default=10, help="windowed AA: history_depth")
    parser.add_argument("--max-iter", type=int, default=2000, help="quadratic: iteration cap")
    parser.add_argument("--logistic-tol", type=float, default=1e-5)
    parser.add_argument("--logistic-max-iter", type=int, default=1000)
    parser.add_argument("--skip-logistic", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--run", default="fixed_point")
    return parser.parse_args(argv)


def iterate(
    optimizer: Any,
    params: Any,
    loss_and_grad: Callable,
    residual: Callable[[Any, Any], float],
    threshold: float,
    max_iter: int,
    loss_fn: Callable | None = None,
) -> tuple[int | None, list[float], Any, Any]:
    """Runs ``update`` until ``residual(params, grads) <= threshold``.

    Returns ``(k, residuals, params, state)``: ``k`` is the number of updates after which the
    params met the threshold (None if ``max_iter`` updates did not), counting ``g``'s
    evaluations the way GMRES counts matrix-vector products; ``residuals[j]`` is the residual
    after ``j`` updates; ``params`` are the last ones measured.
    """
    state = optimizer.init(params)
    history = []
    for k in range(max_iter + 1):
        grads, _ = loss_and_grad(params)
        history.append(residual(params, grads))
        if history[-1] <= threshold:
            return k, history, params, state
        if k == max_iter:
            break
        params, state = optimizer.update(state, params, grads, inplace=True, loss_fn=loss_fn)
    return None, history, params, state


def gmres(
    matrix: np.ndarray, rhs: np.ndarray, tol: float, max_iter: int
) -> tuple[int | None, list]:
    """Unrestarted GMRES from ``x0 = 0`` (float64 NumPy). Returns the first ``k`` with
    ``||rhs - matrix @ x_k|| <= tol * ||rhs||`` (``k`` matrix-vector products), and the true
    residual norms ``||rhs - matrix @ x_k||``."""
    n = rhs.shape[0]
    beta = np.linalg.norm(rhs)
    basis = np.zeros((n, max_iter + 1))
    hessenberg = np.zeros((max_iter + 1, max_iter))
    basis[:, 0] = rhs / beta
    norms = [beta]
    for k in range(1, max_iter + 1):
        w = matrix @ basis[:, k - 1]
        for i in range(k):  # modified Gram-Schmidt
            hessenberg[i, k - 1] = basis[:, i] @ w
            w = w - hessenberg[i, k - 1] * basis[:, i]
        hessenberg[k, k - 1] = np.linalg.norm(w)
        e1 = np.zeros(k + 1)
        e1[0] = beta
        y = np.linalg.lstsq(hessenberg[: k + 1, :k], e1, rcond=None)[0]
        x = basis[:, :k] @ y
        norms.append(float(np.linalg.norm(rhs - matrix @ x)))
        if norms[-1] <= tol * beta:
            return k, norms
        if hessenberg[k, k - 1] <= 1e-14 * beta:  # lucky breakdown: x is exact
            return k, norms
        basis[:, k] = w / hessenberg[k, k - 1]
    return None, norms


def quadratic(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    q, _ = np.linalg.qr(rng.standard_normal((args.n, args.n)))
    eigenvalues = np.logspace(0.0, np.log10(args.kappa), args.n)
    a = (q * eigenvalues) @ q.T
    b = rng.standard_normal(args.n)
    lr = 1.0 / eigenvalues[-1]

    a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)

    def loss(x: Tensor) -> Tensor:
        return 0.5 * x @ (a_t @ x) - b_t @ x

    loss_and_grad = grad_and_value(loss)
    # Fixed-point residual g(x) - x = -lr * grad, measured in NumPy from the params themselves.
    residual = lambda x, _grads: lr * float(np.linalg.norm(a @ x.numpy() - b))  # noqa: E731
    threshold = args.tol * lr * float(np.linalg.norm(b))

    full = args.n + 2  # a window that never forgets within n + 1 steps (GMRES's horizon)
    methods = {
        "plain GD": PlainOptimizer(aa.sgd(lr)),
        f"AA aadl, depth {args.depth}": aa.anderson(aa.sgd(lr), history_depth=args.depth),
        f"AA aadl, depth {args.depth}, frequency 10": aa.anderson(
            aa.sgd(lr), history_depth=args.depth, frequency=10
        ),
        f"AA classic, depth {args.depth}": aa.anderson(
            aa.sgd(lr), history_depth=args.depth, mode="classic"
        ),
        f"AA classic, depth {full} (full)": aa.anderson(
            aa.sgd(lr), history_depth=full, mode="classic"
        ),
    }
    levels = sorted({1e-2, 1e-4, 1e-6, args.tol}, reverse=True)
    rows, results = [], {}

    def record(name: str, relative: list[float], seconds: float) -> None:
        crossings = [next((k for k, r in enumerate(relative) if r <= t), None) for t in levels]
        results[name] = {
            "iterations": crossings[-1],
            "iterations_to": {f"{t:g}": c for t, c in zip(levels, crossings)},
            "final_relative_residual": relative[-1],
            "relative_residuals": relative,
        }
        rows.append([name, *crossings, relative[-1], seconds])

    for name, optimizer in methods.items():
        start = time.perf_counter()
        x0 = torch.zeros(args.n, dtype=torch.float64)
        _, history, _, _ = iterate(optimizer, x0, loss_and_grad, residual, threshold, args.max_iter)
        record(name, [r / history[0] for r in history], time.perf_counter() - start)
    start = time.perf_counter()
    _, norms = gmres(lr * a, lr * b, args.tol, min(args.max_iter, args.n + 1))
    record("GMRES (NumPy)", [r / norms[0] for r in norms], time.perf_counter() - start)
    print(
        f"(a) GD on a quadratic, n={args.n}, kappa={args.kappa:g}, lr=1/lambda_max: "
        f"evaluations of g until ||g(x)-x|| <= tol ||g(x0)-x0|| (- : not within {args.max_iter})"
    )
    header = ["method", *(f"tol {t:g}" for t in levels), "final rel. res.", "seconds"]
    print(format_table(header, rows))
    return results


def logistic(args: argparse.Namespace) -> dict[str, Any]:
    from scipy.optimize import minimize

    data = load_digits(dtype=torch.float64, seed=args.seed)
    features = data.x_train.reshape(len(data.x_train), -1)
    labels = data.y_train
    n, d = features.shape
    classes, weight_decay = 10, 1e-3
    x_np = np.hstack([features.numpy(), np.ones((n, 1))])
    y_np = np.eye(classes)[labels.numpy()]
    smoothness = 0.5 * np.linalg.eigvalsh(x_np.T @ x_np)[-1] / n + weight_decay
    lr = 1.0 / smoothness

    def loss(params: dict[str, Tensor]) -> Tensor:
        logits = features @ params["weight"] + params["bias"]
        penalty = 0.5 * weight_decay * ((params["weight"] ** 2).sum() + (params["bias"] ** 2).sum())
        return torch.nn.functional.cross_entropy(logits, labels) + penalty

    # The same objective in NumPy for the reference solution and for measuring f - f*.
    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w = theta.reshape(d + 1, classes)
        z = x_np @ w
        z = z - z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        value = -(y_np * log_p).sum() / n + 0.5 * weight_decay * (w**2).sum()
        gradient = x_np.T @ (np.exp(log_p) - y_np) / n + weight_decay * w
        return value, gradient.ravel()

    reference = minimize(
        objective, np.zeros((d + 1) * classes), jac=True, method="L-BFGS-B",
        options={"maxiter": 10000, "gtol": 1e-12, "ftol": 0.0},
    )  # fmt: skip
    f_star = reference.fun

    def as_vector(params: dict[str, Tensor]) -> np.ndarray:
        return torch.cat([params["weight"], params["bias"][None]]).numpy().ravel()

    loss_and_grad = grad_and_value(loss)
    _, g0 = objective(np.zeros((d + 1) * classes))
    threshold = args.logistic_tol * float(np.linalg.norm(g0))
    residual = lambda p, _grads: float(np.linalg.norm(objective(as_vector(p))[1]))  # noqa: E731

    methods = {
        "plain GD": (PlainOptimizer(aa.sgd(lr)), None),
        f"AA aadl, depth {args.depth}, safeguard": (
            aa.anderson(aa.sgd(lr), history_depth=args.depth),
            loss,
        ),
        f"AA classic, depth {args.depth}, safeguard": (
            aa.anderson(aa.sgd(lr), history_depth=args.depth, mode="classic"),
            loss,
        ),
    }
    rows, results = [], {}
    for name, (optimizer, loss_fn) in methods.items():
        params = {
            "weight": torch.zeros(d, classes, dtype=torch.float64),
            "bias": torch.zeros(classes, dtype=torch.float64),
        }
        start = time.perf_counter()
        k, history, params, state = iterate(
            optimizer, params, loss_and_grad, residual, threshold, args.logistic_max_iter, loss_fn
        )
        seconds = time.perf_counter() - start
        gap = objective(as_vector(params))[0] - f_star
        results[name] = {
            "iterations": k,
            "final_relative_gradient": history[-1] / history[0],
            "f_minus_f_star": gap,
            "num_mixed": int(state.num_mixed) if isinstance(state, aa.AndersonState) else None,
        }
        rows.append([name, k, history[-1] / history[0], gap, seconds])
    _, g_ref = objective(reference.x)
    rows.append(
        ["L-BFGS (SciPy, reference)", reference.nfev, float(np.linalg.norm(g_ref)) / history[0],
         0.0, None]
    )  # fmt: skip
    print(
        f"\n(b) multinomial logistic regression on digits ({n} images, L2 {weight_decay:g}), GD "
        f"lr=1/L={lr:.3g}: gradients until ||grad f|| <= {args.logistic_tol:g} ||grad f(0)||"
    )
    print(format_table(["method", "iterations", "rel. gradient", "f - f*", "seconds"], rows))
    results["f_star"] = f_star
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    summary: dict[str, Any] = {"config": vars(args), "quadratic": quadratic(args)}
    if not args.skip_logistic:
        summary["logistic"] = logistic(args)
    write_json(os.path.join(args.out_dir, args.run, "summary.json"), summary)
    return summary


if __name__ == "__main__":
    main()

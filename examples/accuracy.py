r"""How accurately aadl_func solves the mixing problem, and what the accurate path costs.

(a) **Windows with a prescribed cond(DR)** (``n`` coordinates, ``k = 10`` iterates, so ``m = 8``
second differences ``DR``), of two kinds: *converging* (steps ``DX_j = rho^j u_j``, ``u_j``
random unit vectors: the steps of a converging iteration shrink, so ``DR``'s columns are
graded and cond(DR) ~ ``rho^-m``) and *rotated* (``DR = U diag(sigma) V^T`` with random
orthogonal ``U, V``, ``sigma`` log-spaced: small singular directions in random positions,
where every float64 solver loses ``eps * cond``). Each window is mixed (relaxation 1) by:

* ``mix`` (float64 window): Householder QR of ``[DR | DX[:, -1]]`` and an SVD of its factor;
* ``update``, float64 window: the same through the incremental ring (streamed TSQR);
* ``update``, float32 window (float64 params, ``history_dtype=torch.float32``): the ``O(m n)``
  float64 Gram route, normal equations solved by an eigen-decomposition;
* for comparison, float64 normal equations solved as the library did before (eigh of
  ``DR^T DR``, eigenvalues below ``1e-13 max ||DX_j||^2`` dropped; NumPy).

The reference is a float64 Householder QR least-squares solution (LAPACK's ``geqrf`` through
``numpy.linalg.qr``, then a triangular solve) of the very data each path sees (for the float32
window: its differences as stored, whose own cond(DR) is printed too; a rotated window's
rounding to float32 perturbs DR by ~6e-8 and so caps it). The table gives the error of the
extrapolation step, ``||x - x_ref|| / ||x_ref - x_newest||`` (max over trials), for cond(DR)
from 1e2 to 1e10.

(b) **Full-history mode "classic" vs GMRES** on ``g(x) = x - (A x - b) / lambda_max``: the
largest ``||x^AA_{k+1} - g(x^GMRES_k)|| / ||g(x^GMRES_k)||`` while GMRES's relative residual
is above 1e-10, and the first iteration whose error exceeds 1e-10. A NumPy AA with a LAPACK QR
solve is run beside it: where it too leaves GMRES, the AA recurrence itself (whose residual
differences are a badly conditioned Krylov basis) is the limit, not the solver.

(c) **Cost**: milliseconds per ``update(..., inplace=True)`` step that mixes (``m = 10``,
``sgd``), float64 params with a float64 window (QR route, ``O(m^2 n)``) or a float32 window
(Gram route, ``O(m n)``), and ``mix`` on an explicit float64 window.

Usage::

    python examples/accuracy.py                   # ~3 min on two cores
    python examples/accuracy.py --quick           # seconds
    python examples/accuracy.py --threads 1 --out bench_results/accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import torch

import aadl_func as aa

CONDITIONS = [1e2, 1e4, 1e6, 1e8, 1e10]


# -- windows and references --------------------------------------------------------------
def window(rng: np.random.Generator, kind: str, n: int, k: int, cond: float) -> np.ndarray:
    """An ``(n, k)`` window (columns oldest first) with cond(DR) ~ ``cond``."""
    m = k - 2
    if kind == "converging":
        rho = cond ** (-1.0 / m)
        u = rng.standard_normal((n, k - 1))
        dx = u / np.linalg.norm(u, axis=0) * rho ** np.arange(k - 1.0)
        x0 = rng.standard_normal(n) / np.sqrt(n)
        return np.concatenate([x0[:, None], x0[:, None] + np.cumsum(dx, axis=1)], axis=1)
    sigma = np.logspace(0.0, -np.log10(cond), m)
    if kind == "graded":
        dr = rng.standard_normal((n, m)) / np.sqrt(n) * sigma[None, :]
    else:
        u = np.linalg.qr(rng.standard_normal((n, m)))[0]
        v = np.linalg.qr(rng.standard_normal((m, m)))[0]
        dr = u @ np.diag(sigma) @ v.T
    d0 = rng.standard_normal(n) / np.sqrt(n)
    dx = np.concatenate([d0[:, None], d0[:, None] + np.cumsum(dr, axis=1)], axis=1)
    x0 = rng.standard_normal(n) / np.sqrt(n)
    return np.concatenate([x0[:, None], x0[:, None] + np.cumsum(dx, axis=1)], axis=1)


def qr_gamma(DR: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Householder QR least squares (LAPACK geqrf via NumPy, then back substitution)."""
    Q, R = np.linalg.qr(DR)
    return scipy.linalg.solve_triangular(R, Q.T @ f)


def previous_gamma(DR: np.ndarray, f: np.ndarray, unit: float) -> np.ndarray:
    """The previous solver: eigh of DR^T DR (scaled by max ||DX_j||^2), cut at 1e-13."""
    H = DR.T @ DR / unit
    w, V = np.linalg.eigh(H)
    keep = w > 1e-13
    return V @ np.where(keep, (V.T @ (DR.T @ f / unit)) / np.where(keep, w, 1.0), 0.0)


def point(X_last: np.ndarray, DX: np.ndarray, gamma: np.ndarray, relaxation=1.0) -> np.ndarray:
    """AADL's relaxed point, ``x_last - sum_j c_j DX_j`` with ``c = cumsum(alpha) - beta alpha``."""
    alpha = np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])
    return X_last - (np.cumsum(alpha) - relaxation * alpha) @ DX.T


class Feed:
    """An inner "optimizer" whose step is the given update: with params 0, ``u`` itself is the
    next window entry (exactly: ``0 + u`` rounds to ``u``)."""

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return updates, state


def update_mix(X: np.ndarray, history_dtype: torch.dtype) -> np.ndarray:
    """The point ``update`` returns after its window has received the columns of ``X``
    (float64 params; the window stores their differences in ``history_dtype``)."""
    k = X.shape[1]
    opt = aa.anderson(Feed(), history_depth=k, history_dtype=history_dtype)
    zero = torch.zeros(X.shape[0], dtype=torch.float64)
    state = opt.init(zero)
    for j in range(k):
        out, state = opt.update(state, zero.clone(), torch.from_numpy(X[:, j].copy()))
    assert int(state.num_mixed) >= 1
    return out.numpy()


def stored(X: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The window as a ``dtype`` ring holds it: the newest entry (float64 params) and the
    differences rounded to ``dtype``; returns ``(DX as stored, X rebuilt from it)``."""
    DX = torch.from_numpy(np.diff(X, axis=1)).to(dtype).double().numpy()
    rebuilt = X[:, -1:] - np.concatenate(
        [np.cumsum(DX[:, ::-1], axis=1)[:, ::-1], np.zeros((X.shape[0], 1))], axis=1
    )
    return DX, rebuilt


def accuracy_table(n: int, trials: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    paths = [
        ("mix, float64 window (QR)", "mix", torch.float64),
        ("update, float64 window (streamed QR)", "update", torch.float64),
        ("update, float32 window (Gram)", "update", torch.float32),
        ("previous solver, float64 (normal eqs.)", "previous", torch.float64),
    ]
    for kind in ("converging", "rotated"):
        errors = {name: [] for name, _, _ in paths}
        conds = {torch.float64: [], torch.float32: []}
        for cond in CONDITIONS:
            worst = dict.fromkeys(errors, 0.0)
            measured = {torch.float64: [], torch.float32: []}
            for _ in range(trials):
                # The newest iterate at the origin: the mixed point is then the step itself,
                # not a small change of a large vector rounded away in the output.
                X = window(rng, kind, n, 10, cond)
                X = X - X[:, -1:]
                for name, how, dtype in paths:
                    DX, Xs = stored(X, dtype)
                    DR = np.diff(DX, axis=1)
                    measured[dtype].append(np.linalg.cond(DR))
                    reference = point(Xs[:, -1], DX, qr_gamma(DR, DX[:, -1]))
                    if how == "mix":
                        got = aa.mix(torch.from_numpy(Xs.T.copy())).numpy()
                    elif how == "update":
                        got = update_mix(X, dtype)
                    else:
                        unit = float(np.max(np.sum(DX**2, axis=0)))
                        got = point(Xs[:, -1], DX, previous_gamma(DR, DX[:, -1], unit))
                    step = np.linalg.norm(reference - Xs[:, -1])
                    worst[name] = max(worst[name], np.linalg.norm(got - reference) / step)
            for name in errors:
                errors[name].append(worst[name])
            for dtype in conds:
                conds[dtype].append(float(np.median(measured[dtype])))
        for name, _, dtype in paths:
            rows.append({"kind": kind, "path": name, "conds": conds[dtype], "errors": errors[name]})
    return rows


# -- GMRES -------------------------------------------------------------------------------
def gmres_iterates(A: np.ndarray, b: np.ndarray, x0: np.ndarray, steps: int) -> list:
    """``(x_k, relative residual)`` for k = 0..steps: Arnoldi (MGS, reorthogonalised) and the
    Hessenberg least squares by ``lstsq``."""
    r0 = b - A @ x0
    beta = np.linalg.norm(r0)
    V = np.zeros((len(b), steps + 1))
    H = np.zeros((steps + 1, steps))
    V[:, 0] = r0 / beta
    out = [(x0.copy(), 1.0)]
    for j in range(steps):
        w = A @ V[:, j]
        for _ in range(2):
            h = V[:, : j + 1].T @ w
            H[: j + 1, j] += h
            w = w - V[:, : j + 1] @ h
        H[j + 1, j] = np.linalg.norm(w)
        e1 = np.zeros(j + 2)
        e1[0] = beta
        y = np.linalg.lstsq(H[: j + 2, : j + 1], e1, rcond=None)[0]
        x = x0 + V[:, : j + 1] @ y
        out.append((x, float(np.linalg.norm(b - A @ x) / beta)))
        if H[j + 1, j] <= 1e-14 * beta:
            break
        V[:, j + 1] = w / H[j + 1, j]
    return out


def numpy_classic(g, x0: np.ndarray, steps: int) -> list[np.ndarray]:
    """Full-history type-II AA in NumPy, consecutive differences, LAPACK QR solve."""
    xs, gs, out = [x0], [], []
    for _ in range(steps):
        gs.append(g(xs[-1]))
        F = np.stack(gs, axis=1) - np.stack(xs, axis=1)
        if F.shape[1] == 1:
            x = gs[-1]
        else:
            gamma = qr_gamma(np.diff(F, axis=1), F[:, -1])
            alpha = np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])
            x = np.stack(gs, axis=1) @ alpha
        xs.append(x)
        out.append(x)
    return out


def linear_problem(name: str):
    rng = np.random.default_rng(11)
    if name.startswith("spd"):
        d, spectrum = 60, np.linspace(1.0, 30.0, 60)
    elif name.startswith("fixed_point"):
        d, spectrum = 100, np.logspace(0.0, 2.0, 100)
    else:
        d, spectrum = 12, np.logspace(0.0, 2.0, 12)
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    A = q @ np.diag(spectrum) @ q.T
    return A, rng.standard_normal(d), rng.standard_normal(d)


PROBLEMS = {
    "spd_60 (linspace 1..30)": 60,
    "fixed_point_100 (logspace 1..100)": 100,
    "issue_12 (logspace 1..100)": 12,
}


def gmres_table(problems: list[str]) -> list[dict]:
    rows = []
    for name in problems:
        steps = PROBLEMS[name]
        A, b, x0 = linear_problem(name)
        lr = 1.0 / np.linalg.norm(A, 2)
        iterates = gmres_iterates(lr * A, lr * b, x0, steps)

        def g(x, A=A, b=b, lr=lr):
            return x - lr * (A @ x - b)

        opt = aa.anderson(Feed(), mode="classic", history_depth=len(iterates) + 1)
        x = torch.from_numpy(x0.copy())
        state = opt.init(x)
        library, numpy_aa = [], numpy_classic(g, x0, len(iterates))
        for _ in iterates:
            x, state = opt.update(state, x, torch.from_numpy(g(x.numpy()) - x.numpy()))
            library.append(x.numpy().copy())
        row = {"problem": name, "iterations": len(iterates) - 1}
        for label, run in (("library", library), ("numpy_qr", numpy_aa)):
            errors = []
            for (xg, residual), xa in zip(iterates, run):
                if residual < 1e-10:
                    break
                expected = g(xg)
                errors.append(np.linalg.norm(xa - expected) / np.linalg.norm(expected))
            first = next((k for k, e in enumerate(errors) if e > 1e-10), None)
            row[f"{label}_max_error"] = max(errors)
            row[f"{label}_first_above_1e-10"] = first
            row[f"{label}_residual_there"] = None if first is None else iterates[first][1]
        row["checked_iterations"] = len(errors)
        row["library_vs_numpy_qr_max"] = max(
            np.linalg.norm(a - c) / np.linalg.norm(c) for a, c in zip(library, numpy_aa)
        )
        rows.append(row)
    return rows


# -- cost --------------------------------------------------------------------------------
def median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def update_ms(n: int, m: int, history_dtype: torch.dtype | None, repeats: int) -> float:
    """Median ms of a mixing ``update(..., inplace=True)`` on float64 params of size ``n``."""
    opt = aa.anderson(aa.sgd(0.01), history_depth=m, history_dtype=history_dtype)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, dtype=torch.float64, generator=gen) for _ in range(4)]
    box = [torch.randn(n, dtype=torch.float64, generator=gen)]
    box.append(opt.init(box[0]))
    calls = [0]

    def step() -> None:
        calls[0] += 1
        box[0], box[1] = opt.update(box[1], box[0], grads[calls[0] % 4], inplace=True)

    for _ in range(m + 2):  # fill the window
        step()
    return median_ms(step, repeats)


def cost_table(sizes: list[int], m: int, repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        row = {"log2_n": int(np.log2(n)), "m": m}
        row["float64_window_qr_ms"] = update_ms(n, m, None, repeats)
        row["float32_window_gram_ms"] = update_ms(n, m, torch.float32, repeats)
        history = torch.randn(m, n, dtype=torch.float64).cumsum(0)
        row["mix_float64_ms"] = median_ms(lambda h=history: aa.mix(h), max(3, repeats // 2))
        rows.append(row)
        print(
            f"  n=2^{row['log2_n']}: float64 window {row['float64_window_qr_ms']:.1f} ms, "
            f"float32 window {row['float32_window_gram_ms']:.1f} ms, "
            f"mix {row['mix_float64_ms']:.1f} ms",
            flush=True,
        )
    return rows


# -- output ------------------------------------------------------------------------------
def _where(row: dict, label: str) -> str:
    first = row[f"{label}_first_above_1e-10"]
    if first is None:
        return "none"
    return f"iteration {first}, GMRES residual {row[f'{label}_residual_there']:.0e}"


def print_tables(accuracy: list[dict], gmres: list[dict], cost: list[dict]) -> None:
    print("\n(a) error of the extrapolation step vs float64 Householder QR, max over trials")
    header = "  ".join(f"{c:>8.0e}" for c in CONDITIONS)
    for kind in ("converging", "rotated"):
        print(f"\n{kind + ' windows, cond(DR) ~':>40}  {header}")
        rows = [r for r in accuracy if r["kind"] == kind]
        for r in rows:
            cells = "  ".join(f"{e:8.1e}" for e in r["errors"])
            print(f"{r['path']:>40}  {cells}")
        stored_conds = next(r["conds"] for r in rows if "float32" in r["path"])
        cells = "  ".join(f"{c:8.1e}" for c in stored_conds)
        print(f"{'(cond(DR) of the float32 window)':>40}  {cells}")
    print("\n(b) full-history mode 'classic' vs g(x_GMRES), while GMRES residual >= 1e-10")
    for r in gmres:
        print(
            f"{r['problem']:>34}: {r['checked_iterations']} iterations; library max "
            f"{r['library_max_error']:.1e} (first > 1e-10 at {_where(r, 'library')}); "
            f"NumPy AA + QR max {r['numpy_qr_max_error']:.1e} "
            f"(first > 1e-10 at {_where(r, 'numpy_qr')}); library vs NumPy AA "
            f"{r['library_vs_numpy_qr_max']:.1e}"
        )
    print("\n(c) ms per mixing update(inplace=True), float64 params, m = 10")
    for r in cost:
        print(
            f"  n=2^{r['log2_n']:<3} float64 window (QR) {r['float64_window_qr_ms']:9.2f}   "
            f"float32 window (Gram) {r['float32_window_gram_ms']:9.2f}   "
            f"mix (explicit float64 window) {r['mix_float64_ms']:9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--out", default="bench_results/accuracy.json", help="JSON output")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--n", type=int, default=400, help="(a): coordinates per window")
    parser.add_argument("--trials", type=int, default=4, help="(a): windows per cell")
    parser.add_argument("--sizes", default="14,17,20,22", help="(c): log2 of n")
    parser.add_argument("--repeats", type=int, default=7, help="(c): timed steps")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    problems = list(PROBLEMS)
    if args.quick:
        args.n, args.trials, args.sizes, args.repeats = 60, 1, "10,12", 3
        problems = [p for p in problems if not p.startswith("fixed_point")]
    started = time.perf_counter()
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
    }
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    print(f"# {info}", flush=True)
    accuracy = accuracy_table(args.n, args.trials)
    gmres = gmres_table(problems)
    cost = cost_table([1 << int(s) for s in args.sizes.split(",")], 10, args.repeats)
    print_tables(accuracy, gmres, cost)
    result = {
        "machine": info,
        "settings": {"n": args.n, "trials": args.trials, "k": 10, "relaxation": 1.0},
        "accuracy": accuracy,
        "gmres": gmres,
        "cost": cost,
        "seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

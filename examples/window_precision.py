r"""How much a low-precision window costs: each mode and ``history_dtype`` against float64.

Both optimizers see the same inputs: at every call the float64-window run's params and grads
are fed to an optimizer with a float32, bf16 or fp16 window as well, so the two differ only by
what their windows store. The error of a call is measured in units of the call's own move,

.. math::

    e_k = \frac{\| x^{\mathrm{low}}_{k+1} - x^{64}_{k+1} \|}{\| x^{64}_{k+1} - x_k \|},

which is what a low-precision window must keep small: an error of the order of the step
(``e ~ 1``) means the mix no longer knows where it is going. The problem is a float32 quadratic
(condition number 100) stepped by SGD with steps of about 1e-3 of ``||x||``, the regime of a
large model whose weights move little per step.

Usage::

    python examples/window_precision.py            # prints the table, writes JSON
    python examples/window_precision.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

import aadl_func as aa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def problem(n: int = 512, seed: int = 0):
    """A float32 quadratic ``0.5 x^T A x - b^T x`` far from its minimum (``||x|| >> step``)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    a = (q * torch.logspace(0, -2, n, dtype=torch.float64)) @ q.T
    x_star = 100.0 + torch.randn(n, generator=g, dtype=torch.float64)
    b = a @ x_star
    x0 = x_star + torch.randn(n, generator=g, dtype=torch.float64)
    return a.float(), b.float(), x0.float()


def errors(mode: str, dtype: torch.dtype, steps: int = 30, depth: int = 5) -> list[float]:
    """``e_k`` of every mixing call of ``steps`` calls (see the module docstring)."""
    a, b, x = problem()
    options = dict(history_depth=depth, mode=mode, relaxation=1.0)
    exact = aa.anderson(aa.sgd(0.5), history_dtype=torch.float64, **options)
    low = aa.anderson(aa.sgd(0.5), history_dtype=dtype, **options)
    s_exact, s_low = exact.init(x), low.init(x)
    out = []
    for _ in range(steps):
        grad = a @ x - b
        mixed = int(s_exact.num_mixed)
        x_exact, s_exact = exact.update(s_exact, x, grad)
        x_low, s_low = low.update(s_low, x, grad)
        move = (x_exact.double() - x.double()).norm()
        if int(s_exact.num_mixed) > mixed and move > 0:
            out.append(float((x_low.double() - x_exact.double()).norm() / move))
        x = x_exact
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = {}
    print(f"{'mode':8s} {'window':9s} {'median e':>10s} {'90% e':>10s} {'max e':>10s}")
    for mode in ("aadl", "classic"):
        for name, dtype in DTYPES.items():
            e = torch.tensor(errors(mode, dtype), dtype=torch.float64)
            row = {
                "median": float(e.median()),
                "p90": float(e.quantile(0.9)),
                "max": float(e.max()),
            }
            table[f"{mode}/{name}"] = row
            print(
                f"{mode:8s} {name:9s} {row['median']:10.1e} {row['p90']:10.1e} {row['max']:10.1e}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)


if __name__ == "__main__":
    main()

r"""The extended Rosenbrock function in float64, $n = 100$:

$$ f(x) = \sum_{i=1}^{n/2} 100 (x_{2i} - x_{2i-1}^2)^2 + (1 - x_{2i-1})^2, $$

minimum $f^* = 0$ at $x = (1, \dots, 1)$. Seed $s$ starts at the standard point
$(-1.2, 1, -1.2, 1, \dots)$ plus $0.1$ times standard normal noise drawn with seed $s$; the
relative suboptimality divides by $f$ at the standard point ($24.2 \cdot n/2 = 1210$), since
$f^* = 0$."""

from __future__ import annotations

import torch

from .problem import Spec, full_batch

N = 100


def standard_start(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([-1.2, 1.0], dtype=dtype).repeat(N // 2)


def rosenbrock(x: torch.Tensor) -> torch.Tensor:
    odd, even = x[0::2], x[1::2]
    return (100.0 * (even - odd**2) ** 2 + (1.0 - odd) ** 2).sum()


def make(seed: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(N, generator=generator, dtype=torch.float64).to(dtype)
    return full_batch({"x": standard_start(dtype) + 0.1 * noise}, lambda p: rosenbrock(p["x"]))


SPEC = Spec(
    key="rosenbrock",
    title=f"extended Rosenbrock, n = {N}, float64",
    make=make,
    gd_lrs=(1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 5e-3),
    dtype=torch.float64,
    zero_minimum=True,
    scale=float(rosenbrock(standard_start(torch.float64))),
)

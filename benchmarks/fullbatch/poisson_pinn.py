r"""The project's PINN, unchanged: ``examples/pinn.py``'s 1-D Poisson problem
$-u'' = f$ on $(0, 1)$, $u(0) = u(1) = 0$, $u^* = \sin(\pi x) + 0.2 \sin(4 \pi x)$, an MLP
``1 -> 20 -> 20 -> 1`` (481 parameters) on 64 collocation points; judged by the relative $L^2$
error of $u$ against $u^*$ on 1,001 points."""

from __future__ import annotations

import pinn

from .problem import Spec

SPEC = Spec(
    key="poisson_pinn",
    title="PINN, 1-D Poisson (examples/pinn.py; 481 parameters, 64 points)",
    make=lambda seed, dtype: pinn.make_problem(seed, dtype),
    gd_lrs=(1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3),
    pinn=True,
)

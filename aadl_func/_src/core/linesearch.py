r"""Backtracking (Armijo) line search along a direction, one for every caller.

`armijo()` finds a step length $s$ with sufficient decrease,
$\phi(s) \le \phi(0) + c_1 s \phi'(0)$, from $s = 1$ by quadratic then cubic
interpolation. The solvers ([`aadl_func.root()`][aadl_func.root] with `line_search=True`)
search $\phi(s) = \|F(x + s d)\|^2$ along the Anderson step, and
[`aadl_func.anderson()`][aadl_func.anderson] with `line_search=True` searches the loss along
the mix, $\phi(s) = \ell(y + s (x - y))$; it works on Python floats, so the caller decides
how $\phi$ is evaluated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import Tensor

__all__ = ["along", "armijo", "is_descent"]


def armijo(
    phi: Callable[[float], float], phi0: float, derphi0: float, c1: float = 1e-4, amin: float = 1e-2
) -> float | None:
    """`scipy.optimize._linesearch.scalar_search_armijo` (BSD licence), as SciPy's `nonlin`
    calls it: the first `s` found with $\\phi(s) \\le \\phi(0) + c_1 s \\phi'(0)$, trying
    `s = 1`, then the minimiser of a quadratic, then of cubic interpolants through the last
    two trials, down to `amin`; None if none is found. Kept line for line, SciPy's
    safeguard included: its two conditions together always hold, so after each rejected cubic
    trial the next interpolation starts from half the previous step.

    Args:
      phi: $\\phi(s)$, the merit function along the direction (a Python float; `inf` for a
        point where it is not finite).
      phi0: $\\phi(0)$.
      derphi0: $\\phi'(0)$, negative for a descent direction.
      c1: the sufficient-decrease constant.
      amin: the smallest step length tried.
    """
    alpha0 = 1.0
    phi_a0 = phi(alpha0)
    if phi_a0 <= phi0 + c1 * alpha0 * derphi0:
        return alpha0
    alpha1 = -derphi0 * alpha0**2 / 2.0 / (phi_a0 - phi0 - derphi0 * alpha0)
    phi_a1 = phi(alpha1)
    if phi_a1 <= phi0 + c1 * alpha1 * derphi0:
        return alpha1
    while alpha1 > amin:  # alpha > 0 is assumed a descent direction, as SciPy does
        factor = alpha0**2 * alpha1**2 * (alpha1 - alpha0)
        a = alpha0**2 * (phi_a1 - phi0 - derphi0 * alpha1) - alpha1**2 * (
            phi_a0 - phi0 - derphi0 * alpha0
        )
        a = a / factor
        b = -(alpha0**3) * (phi_a1 - phi0 - derphi0 * alpha1) + alpha1**3 * (
            phi_a0 - phi0 - derphi0 * alpha0
        )
        b = b / factor
        alpha2 = (-b + math.sqrt(abs(b**2 - 3 * a * derphi0))) / (3.0 * a)
        phi_a2 = phi(alpha2)
        if phi_a2 <= phi0 + c1 * alpha2 * derphi0:
            return alpha2
        if (alpha1 - alpha2) > alpha1 / 2.0 or (1 - alpha2 / alpha1) < 0.96:
            alpha2 = alpha1 / 2.0
        alpha0, alpha1 = alpha1, alpha2
        phi_a0, phi_a1 = phi_a1, phi_a2
    return None


def is_descent(derphi0: float) -> bool:
    r"""Whether $\phi'(0)$ says the direction descends (finite and negative): else
    N-GMRES restarts instead of searching."""
    return math.isfinite(derphi0) and derphi0 < 0.0


def along(y: Sequence[Tensor], x: Sequence[Tensor], s: float) -> list[Tensor]:
    r"""The point $y + s\,(x - y)$ per leaf; $x$ itself for $s = 1$ (the mix, unrounded)."""
    if s == 1.0:
        return list(x)
    return [yi + s * (xi - yi) for yi, xi in zip(y, x)]

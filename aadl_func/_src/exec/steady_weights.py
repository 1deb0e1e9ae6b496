r"""The steady call's mixing weights (`aadl_func._src.exec.steady`), from its plan's window.

For the newest residual in slot `head` of a full window, the affine weights `alpha` of the
small problem `solve_known()` solves (`aadl_func._src.core.lstsq`), and from them the float32
weights the mix takes in ring order: mode "aadl"'s `-c` (`aadl_coefficients()` negated),
mode "classic"'s points' weights `classic_coefficients()` and steps' `relaxation * alpha`.
Where the plan read every Gram value finite, natively: the system read from the committed
Grams by the kernel (`native.System`) and, where torch's LAPACK and BLAS can be called
directly, solved and weighed in one call (`native_blas.Solver`); else on Python floats, and
where a value is not finite by the executor's tensor route, which decides (or raises) as it
does there. The same bytes on every route (tests/test_native_blas.py, tests/test_native.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src.core.grams import Grams
from aadl_func._src.core.lstsq import known_ridge, solve_known, solve_known_scaled
from aadl_func._src.core.scalars import float32_tensor
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.exec import passes
from aadl_func._src.exec import plan as plans
from aadl_func._src.state import AndersonState

__all__ = ["affine_weights", "aadl_weights", "classic_weights", "float32_weights"]


def float32_weights(head: int, *chrono: list[float] | Tensor) -> Tensor:
    """`passes.ring_order(head, *chrono)` in float32, the window's dtype: from known values
    (lists) each rounded once, as the float64 vector's conversion rounds it."""
    if isinstance(chrono[0], list):
        return float32_tensor(passes.ring_list(head, *chrono))
    return passes.ring_order(head, *chrono).to(torch.float32)


def affine_weights(
    plan: plans.Plan, state: AndersonState, head: int
) -> tuple[list[float] | Tensor, Any]:
    """The affine weights of the full window whose newest residual is in slot `head`
    (`passes.mixing_weights()`, whose Python-float route this is: `solve_known()`'s
    arithmetic on the committed Grams' values), and whether the solve succeeded."""
    options = plan.options
    if plan.finite:
        known = solve_known_scaled(*_system(plan, head), plan.system.cutoff_inverse)
    else:  # a value the plan found not finite: the lists, which `solve_known()` checks
        q = plan.q
        gram, dr_gram, dr_rhs = (t.tolist() for t in (state.gram, state.dr_gram, state.dr_rhs))
        slots = [(head + 1 + j) % q for j in range(q)]  # oldest first
        later = slots[1:]  # the newer ends of the differences (the columns of gamma)
        known = solve_known(
            [[dr_gram[i][j] for j in later] for i in later],
            [dr_rhs[i] for i in later],
            [gram[s][s] for s in slots],
            known_ridge(options, [dr_gram[i][i] for i in later]),
        )
    if known is not None:
        return known[1], True
    # A value that is not finite: the tensor route decides, as in the executor.
    return passes.mixing_weights(options, plan.ring(), Grams.of(state), head, plan.q)


def aadl_weights(plan: plans.Plan, state: AndersonState, head: int) -> tuple[Tensor, Any]:
    """Mode "aadl"'s float32 mixing weights in ring order (`-c`, `aadl_coefficients()`
    negated), and whether the solve succeeded: in the native kernel from the solve's
    gamma where the plan reads the system natively, else from `affine_weights()`."""
    weights = _native_weights(plan, head, classic=False) if plan.finite else None
    if weights is not None:
        return weights, True
    alpha, solved = affine_weights(plan, state, head)  # (a gamma that is not finite)
    minus_c = aadl_coefficients(alpha, plan.options.relaxation, negated=True)
    return float32_weights(head, minus_c), solved


def classic_weights(plan: plans.Plan, state: AndersonState, head: int) -> tuple[Tensor, Any]:
    """Mode "classic"'s float32 mixing weights in ring order (the points' weights
    `classic_coefficients()`, then the steps' `relaxation * alpha`), and whether the solve
    succeeded: natively from gamma as `aadl_weights()`, else from `affine_weights()`."""
    relaxation = plan.options.relaxation
    weights = _native_weights(plan, head, classic=True) if plan.finite else None
    if weights is not None:
        return weights, True
    alpha, solved = affine_weights(plan, state, head)  # (a gamma that is not finite)
    scaled = [relaxation * a for a in alpha] if isinstance(alpha, list) else relaxation * alpha
    return float32_weights(head, classic_coefficients(alpha), scaled), solved


def _native_weights(plan: plans.Plan, head: int, classic: bool) -> Tensor | None:
    """The float32 mixing weights in ring order from the committed Grams (which the plan
    knows finite), natively: in one call where the plan has a `native_blas` solver and the
    ridge is a number, else the plan's gamma (`known_gamma()` or the solver's) of the
    system the kernel reads and the kernel's weights. None when a gamma is not finite or
    LAPACK failed: the tensor route then answers (or raises), as the executor's would."""
    options, system, solver = plan.options, plan.system, plan.solver
    if solver is not None and options.reg_relative == 0.0:
        return solver.weights(system, head, options.reg, options.relaxation, classic)
    # (A relative ridge: torch sums the system's diagonal, then the plan's gamma.)
    if (gamma := plan.gamma_of(*_system(plan, head))) is None:
        return None  # LAPACK failed: the torch route raises its error
    mixing_weights = system.classic_weights if classic else system.aadl_weights
    return mixing_weights(gamma, options.relaxation, head)


def _system(plan: plans.Plan, head: int) -> tuple[Tensor, Tensor, float]:
    """The scaled small system `(h, c, reg)` read from the committed Grams by the native
    kernel (one division per value, as `solve_known()` does on the lists)."""
    system, options = plan.system, plan.options
    unit = system.read(head)
    diag = system.diag.tolist() if options.reg_relative else ()
    return system.h, system.c, known_ridge(options, diag) / unit

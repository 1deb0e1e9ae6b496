r"""The solvers' masked fixed-budget loop (`vmap`, `torch.compile`, `batch_dims`): every
decision a mask, one per problem of a batch; a problem that has stopped keeps its `x`.
Eagerly on the CPU the masks are read once a round where that is free, so that while every
problem runs and accepts no selection is made (`known_all()`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.solver_info import CONVERGED, MAX_ITER, NONFINITE, SolverInfo

__all__ = ["masked_loop", "per_problem"]


def per_problem(value: Any, t: Tensor) -> Any:
    """`value` (a number, or a tensor of one per problem of a batch) broadcast against the
    leaf `t` whose leading dimensions are the batch's."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    return value.reshape(value.shape + (1,) * (t.dim() - value.dim()))


def _where(flag: Tensor, a: list[Tensor], b: list[Tensor], every: bool = False) -> list[Tensor]:
    """`a` where `flag` (one per problem) holds, else `b`, leaf by leaf; `a` itself where
    `flag` is known to hold for every problem (`every`, read by `_known_all()`): the same
    values without a pass over the leaves."""
    if every:
        return a
    return [torch.where(per_problem(flag, ai), ai, bi) for ai, bi in zip(a, b)]


def _known_all(flag: Tensor) -> bool:
    """Whether `flag` holds for every problem of the batch, when that can be read without a
    graph break or a device synchronisation (eager vmap over CPU flags, or no transform);
    False where it cannot be read."""
    if tree.tracing():
        return False
    if _functorch.is_batchedtensor(flag):
        return tree.uniform_value(flag) is True
    if _functorch.is_functorch_wrapped_tensor(flag) or not flag.is_cpu:
        return False
    return bool(flag.all())


def _lowest(
    best: tuple[list[Tensor], Tensor, Tensor],
    accept: Tensor,
    every: bool,
    x: list[Tensor],
    norm: Tensor,
    iterations: Tensor,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The masked loop's lowest iterates `(x, norm, iteration)` per problem after a step
    that accepted `x` (with its `norm`) where `accept` holds (everywhere when `every`)."""
    best_x, best_norm, returned = best
    lower = norm < best_norm if every else accept & (norm < best_norm)
    if _known_all(lower):
        return x, norm, iterations
    return (
        _where(lower, x, best_x),
        torch.where(lower, norm, best_norm),
        torch.where(lower, iterations, returned),
    )


def masked_loop(
    problem: Callable, x: list[Tensor], opt: Any, options: Any, spec: Any
) -> tuple[list[Tensor], SolverInfo]:
    """A fixed budget of `max_iter` rounds in which every decision is a mask: a problem
    that has stopped keeps its `x` (its evaluations are computed and discarded), so a
    `vmap` batch stops problem by problem and `torch.compile` sees one straight graph.
    `problem(x)` gives `(step, norm, value)` (`solver._Problem`), `opt` is the Anderson
    update, `options` the solver's `solver_options.Options`."""
    step, norm, value = problem(x)
    scaled, tol = options.rtol * norm, options.tol
    threshold = (
        torch.maximum(scaled, tol) if isinstance(tol, Tensor) else torch.clamp(scaled, min=tol)
    )

    def met(norm: Tensor, value: Tensor | None) -> Tensor:
        if value is None:
            return norm <= threshold
        return norm <= torch.maximum(threshold, options.gtol * value)

    finite = torch.isfinite(norm)
    converged = finite & met(norm, value)
    status = torch.where(converged, CONVERGED, torch.where(finite, MAX_ITER, NONFINITE))
    done = converged | ~finite
    iterations = torch.zeros_like(status)
    evaluations = torch.ones_like(status)
    norms = [norm]
    best_x, best_norm, returned = x, norm, iterations
    state = opt.init(tree.unflatten(spec, x))
    for _ in range(options.max_iter):
        if _known_all(done):
            break
        proposal, state = opt.update(state, tree.unflatten(spec, x), tree.unflatten(spec, step))
        proposal = tree.flatten(proposal, "x")[0]
        new_step, new_norm, new_value = problem(proposal)
        active = ~done
        accept = active & (new_norm < math.inf)  # a norm is finite when below Inf (NaN is not)
        # Read once per step where that is free (eagerly, on the CPU): while every problem
        # runs and accepts, no mask below needs a pass over the problems.
        every = _known_all(accept)
        x = _where(accept, proposal, x, every)
        step = _where(accept, new_step, step, every)
        norm = new_norm if every else torch.where(accept, new_norm, norm)
        iterations = iterations + accept  # int64 + bool: counts the True ones
        evaluations = evaluations + active
        status, done = _after_round(status, done, met(norm, new_value), accept, active, every)
        norms.append(norm)
        if options.return_best:
            best_x, best_norm, returned = _lowest(
                (best_x, best_norm, returned), accept, every, x, norm, iterations
            )
        if options.callback is not None:
            options.callback(len(norms) - 1, tree.unflatten(spec, x), norm)
    if options.return_best:
        # A converged problem's last iterate is its lowest (every earlier one failed the test).
        x = _where(status == CONVERGED, x, best_x)
        returned = torch.where(status == CONVERGED, iterations, returned)
    else:
        returned = iterations
    info = SolverInfo(
        iterations=iterations,
        evaluations=evaluations,
        residual_norms=torch.stack(norms, dim=-1),  # (problems..., rounds), as vmap's
        converged=status == CONVERGED,
        status=status,
        returned_iteration=returned,
    )
    return x, info


def _after_round(
    status: Tensor, done: Tensor, met: Tensor, accept: Tensor, active: Tensor, every: bool
) -> tuple[Tensor, Tensor]:
    """The masked loop's status codes and stopped mask after a round in which the problems
    `active` ran, `accept` of them to a finite norm, and `met` says which now meet their
    tolerance; `every`: known that every problem ran and accepted (nothing to select)."""
    if every:  # none had stopped, none is bad
        return torch.where(met, CONVERGED, status), met
    converged = accept & met
    bad = active ^ accept  # running, with a norm that is not finite
    status = torch.where(converged, CONVERGED, torch.where(bad, NONFINITE, status))
    return status, done | converged | bad

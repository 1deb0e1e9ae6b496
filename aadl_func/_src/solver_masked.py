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

# A count per problem: a Python int while every problem's is the same one (`masked_loop`).
Count = int | Tensor


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
    best: tuple[list[Tensor], Tensor, Count],
    accept: Tensor,
    every: bool,
    x: list[Tensor],
    norm: Tensor,
    iterations: Count,
) -> tuple[list[Tensor], Tensor, Count]:
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
    update, `options` the solver's `solver_options.Options`.

    Eagerly on the CPU, the first rounds are in lockstep while that is known on the host
    (`_running_on()`: one `aminmax` a round): every problem runs, reaches a finite
    norm and none meets its tolerance, so no status changes, nothing is selected, and the
    counts, the same for every problem, are Python ints. The first round that is not in
    lockstep turns them into tensors, and the masks take over."""
    step, norm, value = problem(x)
    tolerance = _tolerances(options, norm)
    finite = torch.isfinite(norm)
    converged = finite & (norm <= tolerance(value))
    status = torch.where(converged, CONVERGED, torch.where(finite, MAX_ITER, NONFINITE))
    done = converged | ~finite
    lockstep = _known_none(done)
    # The counts per problem: Python ints while in lockstep (one value for all).
    iterations: Count = 0 if lockstep else torch.zeros_like(status)
    evaluations: Count = 1 if lockstep else torch.ones_like(status)
    norms = [norm]
    best = (x, norm, iterations)
    state = opt.init(tree.unflatten(spec, x))
    for _ in range(options.max_iter):
        if not lockstep and _known_all(done):
            break
        proposal, state = opt.update(state, tree.unflatten(spec, x), tree.unflatten(spec, step))
        proposal = tree.flatten(proposal, "x")[0]
        new_step, new_norm, new_value = problem(proposal)
        limit = tolerance(new_value)
        if lockstep and _running_on(new_norm, limit):
            x, step, norm = proposal, new_step, new_norm
            iterations, evaluations = iterations + 1, evaluations + 1
            accept, every = done, True  # `accept` is not read when `every`
        else:
            if lockstep:  # the counts become one per problem
                iterations = torch.full_like(status, iterations)
                evaluations = torch.full_like(status, evaluations)
                lockstep = False
            active = ~done
            accept = active & (new_norm < math.inf)  # finite when below Inf (NaN is not)
            # Read once per step where that is free (eagerly, on the CPU): while every
            # problem runs and accepts, no mask below needs a pass over the problems.
            every = _known_all(accept)
            x = _where(accept, proposal, x, every)
            step = _where(accept, new_step, step, every)
            norm = new_norm if every else torch.where(accept, new_norm, norm)
            iterations = iterations + accept  # int64 + bool: counts the True ones
            evaluations = evaluations + active
            met = new_norm <= limit
            status, done = _after_round(status, done, met, accept, active, every)
        norms.append(norm)
        if options.return_best:
            best = _lowest(best, accept, every, x, norm, iterations)
        if options.callback is not None:
            options.callback(len(norms) - 1, tree.unflatten(spec, x), norm)
    return _finish(options, x, best, status, iterations, evaluations, norms)


def _running_on(norm: Tensor, limit: Tensor) -> bool:
    """Whether every problem's new `norm` is finite and above its tolerance `limit` (none
    has converged), read on the host (False where it cannot be: traced, or not on the CPU):
    every gap `norm - limit` in `(0, inf)`, from its least and largest (a NaN anywhere
    makes both NaN, which fails both tests)."""
    if not _on_host(norm):
        return False
    low, high = torch.aminmax(norm - limit)
    return low.item() > 0 and high.item() < math.inf


def _known_none(flag: Tensor) -> bool:
    """Whether `flag` is known on the host to hold for no problem of the batch (False
    where it cannot be read without a graph break or a device synchronisation). Only for
    a batch of plain tensors (`batch_dims`): under `vmap` the loop keeps its masks."""
    if not _on_host(flag):
        return False
    return not bool(flag.any())


def _on_host(t: Tensor) -> bool:
    """Whether `t`'s values can be read on the host for free: eagerly, a plain CPU tensor
    (not traced, not under a torch.func transform, no device synchronisation)."""
    return not tree.tracing() and t.is_cpu and not _functorch.is_functorch_wrapped_tensor(t)


def _tolerances(options: Any, norm0: Tensor) -> Callable:
    r"""`tolerance(value)`: each problem's tolerance, a problem having converged where
    $\|r\| \le \max(\mathrm{tol}, \mathrm{rtol} \|r_0\|, \mathrm{gtol} \|g(x)\|)$,
    with $\|r_0\|$ = `norm0` and $\|g(x)\|$ = `value` (None without `gtol`)."""
    scaled, tol = options.rtol * norm0, options.tol
    threshold = (
        torch.maximum(scaled, tol) if isinstance(tol, Tensor) else torch.clamp(scaled, min=tol)
    )

    def tolerance(value: Tensor | None) -> Tensor:
        if value is None:
            return threshold
        return torch.maximum(threshold, options.gtol * value)

    return tolerance


def _finish(
    options: Any,
    x: list[Tensor],
    best: tuple[list[Tensor], Tensor, Count],
    status: Tensor,
    iterations: Count,
    evaluations: Count,
    norms: list[Tensor],
) -> tuple[list[Tensor], SolverInfo]:
    """The masked loop's result: with `return_best`, each problem's lowest iterate (its
    last where it converged: every earlier one failed the test), and its `SolverInfo`
    (a count still a Python int made one per problem)."""
    iterations, evaluations = (
        torch.full_like(status, c) if isinstance(c, int) else c for c in (iterations, evaluations)
    )
    returned = iterations
    if options.return_best:
        best_x, _, lowest = best
        x = _where(status == CONVERGED, x, best_x)
        returned = torch.where(status == CONVERGED, iterations, lowest)
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

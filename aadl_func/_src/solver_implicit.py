r"""Implicit differentiation of a fixed point: `implicit_fixed_point()`.

The forward solve is [`fixed_point()`][aadl_func.fixed_point] with no graph through its
iterations; the backward pass either solves the adjoint fixed point
$u = J_z f(z^*, \theta)^\top u + \bar z$ with the same solver and returns
$J_\theta f(z^*, \theta)^\top u$ (the implicit function theorem, `_ImplicitFixedPoint`),
or differentiates a few damped steps recorded from $z^*$ (torchdeq's phantom gradient,
`_phantom()`). A solve that does not converge is reported by `on_nonconvergence`
(`_report()`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import grad_mode, solver_options, tree
from aadl_func._src.solver import axpy, fixed_point, masked_wanted
from aadl_func._src.solver_info import SolverInfo
from aadl_func._src.validation import check_callable, check_choice, check_float, check_int

__all__ = ["implicit_fixed_point"]

PyTree = Any


class _ImplicitFixedPoint(torch.autograd.Function):
    """`z* = f(z*, theta)` forward by [`fixed_point()`][aadl_func.fixed_point]; backward by the
    implicit function theorem. Inputs: the static
    `(f, z_spec, theta_spec, n_z, options, adjoint_options)`, then the leaves of `z0` and of
    `theta`; outputs: the leaves of `z*`, then the [`SolverInfo`][aadl_func.SolverInfo] fields (not
    differentiable)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        f: Callable, z_spec: Any, theta_spec: Any, n_z: int, options: dict, adjoint: dict,
        *leaves: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        theta = tree.unflatten(theta_spec, list(leaves[n_z:]))
        z0 = tree.unflatten(z_spec, list(leaves[:n_z]))
        options = dict(options)
        first = [options.pop("_first", None)]  # f(z0, theta), computed by the caller

        def g(z: PyTree) -> PyTree:  # the solver's first evaluation is at z0
            known, first[0] = first[0], None
            return f(z, theta) if known is None else known

        z, info = fixed_point(g, z0, **options)
        # An input returned as is (z0 already converged, max_iter=0) cannot be saved for
        # backward by setup_context: return a copy.
        z_leaves = [
            t.clone() if any(t is i for i in leaves) else t for t in tree.flatten(z, "z")[0]
        ]
        return (*z_leaves, *info)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        f, z_spec, theta_spec, n_z, _, adjoint, *leaves = inputs
        ctx.save_for_backward(*output[:n_z], *leaves[n_z:])
        ctx.mark_non_differentiable(*output[n_z:])
        ctx.static = (f, z_spec, theta_spec, n_z, adjoint)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        f, z_spec, theta_spec, n_z, adjoint = ctx.static
        adjoint = dict(adjoint)
        on_failure = adjoint.pop("on_nonconvergence")
        saved = ctx.saved_tensors
        z_star = tree.unflatten(z_spec, list(saved[:n_z]))
        theta = tree.unflatten(theta_spec, list(saved[n_z:]))
        cotangent = [torch.zeros_like(z) if g is None else g for g, z in zip(grads[:n_z], saved)]
        u = _adjoint(f, z_star, theta, z_spec, cotangent, adjoint, on_failure)
        _, vjp_theta = torch.func.vjp(lambda th: f(z_star, th), theta)
        (grad_theta,) = vjp_theta(u)
        theta_leaves = tree.flatten(grad_theta, "theta")[0]
        return (None,) * (6 + n_z) + tuple(theta_leaves)


def _adjoint(
    f: Callable,
    z_star: PyTree,
    theta: PyTree,
    spec: Any,
    cotangent: list[Tensor],
    options: dict,
    on_failure: str,
) -> PyTree:
    r"""The adjoint fixed point $u = J_z f(z^*, \theta)^\top u + \bar z$ by
    [`fixed_point()`][aadl_func.fixed_point] (the map is affine, so classic Anderson acceleration is
    GMRES on $(I - J^\top) u = \bar z$); a solve that does not converge is reported by
    `on_failure` (`_report()`)."""
    _, vjp_z = torch.func.vjp(lambda z: f(z, theta), z_star)
    rhs = tree.unflatten(spec, cotangent)

    def adjoint_map(u: PyTree) -> PyTree:
        (ju,) = vjp_z(u)
        return tree.unflatten(spec, axpy(1.0, tree.flatten(ju, "u")[0], cotangent))

    # First derivatives only: no graph through the adjoint iterations.
    u, info = grad_mode.kept(lambda: fixed_point(adjoint_map, rhs, **options))
    if not masked_wanted(options.get("masked"), cotangent):
        _report(
            on_failure, info, "the adjoint fixed point u = J^T u + dL/dz*",
            "is f a contraction in z at z*? Raise `max_iter` or loosen `tol` in "
            "`adjoint_options`",
        )  # fmt: skip
    return u


def _report(on_failure: str, info: SolverInfo, what: str, hint: str) -> None:
    """A solve that did not converge, by `on_nonconvergence`: a `RuntimeWarning`
    ("warn"), a `RuntimeError` ("raise"), or nothing ("ignore"; `info` says it)."""
    if on_failure == "ignore" or bool(info.converged.all()):
        return
    if info.converged.dim():  # a batch (batch_dims)
        failed = int((~info.converged).sum())
        outcome = f"for {failed} of {info.converged.numel()} problems"
    else:
        outcome = f"({info.reason} after {int(info.iterations)} steps)"
    residual = float(info.residual_norms[..., -1].max())
    message = (
        f"implicit_fixed_point: {what} did not converge {outcome}, residual {residual:.3g}; " + hint
    )
    if on_failure == "raise":
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def implicit_fixed_point(
    f: Callable[[PyTree, PyTree], PyTree],
    z0: PyTree,
    theta: PyTree,
    *,
    adjoint_options: dict[str, Any] | None = None,
    gradient: str = "implicit",
    phantom_steps: int = 1,
    phantom_damping: float = 1.0,
    on_nonconvergence: str = "warn",
    **options: Any,
) -> tuple[PyTree, SolverInfo]:
    r"""The fixed point $z^* = f(z^*, \theta)$, differentiable in $\theta$ (and in
    the parameters of `f` when it is an `torch.nn.Module`); returns `(z*, info)`.

    The forward solve is [`fixed_point()`][aadl_func.fixed_point] on $z \mapsto f(z, \theta)$ from
    `z0` with `options`; no iteration is recorded for autograd. `gradient="implicit"`
    (default): the backward pass, given $\bar z = \partial L / \partial z^*$, solves
    the adjoint fixed point

    $$
    u = J_z f(z^*, \theta)^\top u + \bar z \quad \big(\text{i.e. } u = (I - J_z^\top)^{-1}
    \bar z\big), \qquad \frac{\partial L}{\partial \theta} = J_\theta f(z^*, \theta)^\top u,
    $$

    with the same solver (`adjoint_options`, default: `options`), the products
    $J^\top v$ being `torch.func.vjp()` of `f` at $(z^*, \theta)$. This is
    exact at an exact fixed point where $I - J_z$ is invertible (e.g. `f` a
    contraction in `z`); its error follows the two tolerances. It is a
    `torch.autograd.Function` (with `setup_context` and a generated vmap rule), so
    `loss.backward()`, `torch.func.grad()`/`vjp` and `torch.func.vmap()` of either
    work. Only first derivatives: the backward pass is not itself differentiable.

    `gradient="phantom"`: the cheap backward of torchdeq (Geng et al., 2021), no adjoint
    solve: from $z_0 = z^*$ (constant) it records `phantom_steps` $= k$ damped
    steps $z_{i+1} = (1 - \tau) z_i + \tau f(z_i, \theta)$, $\tau$ =
    `phantom_damping`, and returns $z_k$, so that autograd differentiates those
    $k$ steps only. With $\tau = 1$ its gradient is
    $J_\theta^\top \sum_{i<k} (J_z^\top)^i \bar z$, the truncated Neumann series of
    the implicit one; $k = 1$ is the Jacobian-free gradient (Fung et al., 2022),
    $J_\theta^\top \bar z$. It costs $k$ evaluations and vjps of `f`.

    Args:
      f: `f(z, theta) -> z`. Every tensor whose gradient you want comes in through
        `theta`, or is a parameter of `f` when `f` is an `torch.nn.Module`
        (called through `torch.func.functional_call()`, so its parameters are inputs of
        the backward pass). A tensor that requires grad and that `f` closes over otherwise
        (`lambda z, x: layer(z, x)` around a module) would get no gradient: this is
        refused with a `ValueError` (checked on the first evaluation of `f`, which the
        solve reuses, whenever autograd records).
      z0: the starting point (no gradient flows to it: $z^*$ does not depend on it).
      theta: a pytree of tensors, the parameters (or the layer's input `x`).
      adjoint_options: [`fixed_point()`][aadl_func.fixed_point] options for the adjoint solve
        (default: the forward's). Checked, like the forward's `options`, before `f` is first
        called (not in the backward pass), with errors that start
        `` implicit_fixed_point: `adjoint_options`: ``; `on_nonconvergence` is not one of
        them (this function's own argument covers both solves).
      gradient: `"implicit"` (default) or `"phantom"` (above).
      phantom_steps: $k \ge 1$, the recorded steps of `gradient="phantom"`.
      phantom_damping: $\tau \in (0, 1]$ of `gradient="phantom"`.
      on_nonconvergence: a forward or adjoint solve that does not converge (eager loop):
        `"warn"` (default, a `RuntimeWarning`; `info` says it too), `"raise"` (a
        `RuntimeError`) or `"ignore"`.
      **options: [`fixed_point()`][aadl_func.fixed_point] options for the forward solve.

    Returns:
      `(z*, info)`: `z*` like `z0` (with `"phantom"`, $z_k$), and the forward
      solve's [`SolverInfo`][aadl_func.SolverInfo] (with `"phantom"`, its evaluations include the
      $k$ recorded ones).
    """
    owner = "implicit_fixed_point"
    check_callable(owner, "f", f)
    z_leaves, z_spec = solver_options.check_x0(owner, z0, name="z0")
    theta_leaves, theta_spec = tree.flatten(theta, "theta", owner=owner)
    if adjoint_options is not None and not isinstance(adjoint_options, dict):
        raise TypeError(
            f"{owner}: `adjoint_options` must be None or a dict of fixed_point options, "
            f"got {type(adjoint_options).__name__}"
        )
    gradient = check_choice(owner, "gradient", gradient, ("implicit", "phantom"))
    steps = check_int(owner, "phantom_steps", phantom_steps, 1)
    damping = check_float(owner, "phantom_damping", phantom_damping, minimum=0.0, strict=True)
    if damping > 1.0:
        raise ValueError(f"{owner}: `phantom_damping` must be in (0, 1], got {damping}")
    on_failure = check_choice(
        owner, "on_nonconvergence", on_nonconvergence, ("warn", "raise", "ignore")
    )
    # Both solves' options, checked before `f` is first called (the adjoint solve's would
    # otherwise be checked only in the backward pass, after the forward solve).
    _check_solve_options(owner, options)
    if adjoint_options is not None:
        _check_solve_options(f"{owner}: `adjoint_options`", adjoint_options)
    adjoint = dict(options if adjoint_options is None else adjoint_options)
    adjoint["on_nonconvergence"] = on_failure
    if gradient == "phantom":
        z, info = _phantom(f, z0, theta, options, steps, damping)
    else:
        z, info = _implicit(f, z_spec, z_leaves, theta, options, adjoint)
    if not masked_wanted(options.get("masked"), z_leaves + theta_leaves):
        hint = "raise `max_iter` or loosen `tol`; the gradient is that of the returned point"
        _report(on_failure, info, "the forward fixed point z* = f(z*, theta)", hint)
    return z, info


# `fixed_point`'s own keyword options and their defaults; any other is one of `anderson`'s.
_SOLVE_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(fixed_point).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _check_solve_options(where: str, options: dict[str, Any]) -> None:
    """`options` for a [`fixed_point()`][aadl_func.fixed_point] solve, validated as
    `fixed_point` validates them (`solver_options`), in the name `where`
    (`implicit_fixed_point`, or `` implicit_fixed_point: `adjoint_options` ``), before any
    solve runs. `on_nonconvergence` is `implicit_fixed_point`'s own, for both solves."""
    for name in options:
        if not isinstance(name, str):
            raise TypeError(f"{where}: option names must be str, got {type(name).__name__}")
    if "on_nonconvergence" in options:
        raise TypeError(
            f"{where}: unexpected keyword argument `on_nonconvergence`; pass it to "
            "implicit_fixed_point itself (it covers the forward and the adjoint solve)"
        )
    known = {name: options.get(name, default) for name, default in _SOLVE_DEFAULTS.items()}
    rest = {name: value for name, value in options.items() if name not in _SOLVE_DEFAULTS}
    batch_dims = check_int(where, "batch_dims", known["batch_dims"], 0)
    solver_options.options(
        where, known["tol"], known["rtol"], known["max_iter"], known["line_search"],
        known["callback"], known["masked"], known["return_best"], known["gtol"], batch_dims,
    )  # fmt: skip
    solver_options.anderson_options(
        where, known["history_depth"], known["relaxation"], known["reg"],
        known["reg_relative"], known["mode"], rest,
    )  # fmt: skip


def _implicit(
    f: Callable, z_spec: Any, z_leaves: list[Tensor], theta: PyTree, options: dict, adjoint: dict
) -> tuple[PyTree, SolverInfo]:
    """The forward solve and the implicit backward (`_ImplicitFixedPoint`); an
    `torch.nn.Module` `f` takes its parameters as inputs, through
    `torch.func.functional_call()`."""
    if isinstance(f, torch.nn.Module):
        module = f
        params = {k: p for k, p in module.named_parameters() if p.requires_grad}
        theta = (theta, params)

        def f(z: PyTree, both: tuple) -> PyTree:  # noqa: F811  (the module, functionally)
            return torch.func.functional_call(module, both[1], (z, both[0]))

    theta_leaves, theta_spec = tree.flatten(theta, "theta", owner="implicit_fixed_point")
    first = _first_evaluation(f, z_spec, z_leaves, theta)
    out = _ImplicitFixedPoint.apply(
        f, z_spec, theta_spec, len(z_leaves), {**options, "_first": first}, adjoint,
        *z_leaves, *theta_leaves,
    )  # fmt: skip
    n_z = len(z_leaves)
    return tree.unflatten(z_spec, list(out[:n_z])), SolverInfo(*out[n_z:])


def _first_evaluation(
    f: Callable, z_spec: Any, z_leaves: list[Tensor], theta: PyTree
) -> PyTree | None:
    """`f(z0, theta)` evaluated with autograd on and `theta` detached, when autograd
    records (not under `torch.func` transforms): an output that still requires grad
    depends on a tensor that `f` closes over, which would get no gradient, and is refused.
    The value (detached) is the forward solve's first evaluation, so the check costs none."""
    if not torch.is_grad_enabled() or _functorch.maybe_current_level() is not None:
        return None
    z0 = tree.unflatten(z_spec, [t.detach() for t in z_leaves])
    leaves, spec = tree.flatten(theta, "theta")
    out = f(z0, tree.unflatten(spec, [t.detach() for t in leaves]))
    out_leaves, out_spec = tree.flatten(out, "f(z, theta)", owner="implicit_fixed_point")
    if any(t.requires_grad for t in out_leaves):
        raise ValueError(
            "implicit_fixed_point: f(z, theta) depends on a tensor that requires grad but is "
            "neither in `theta` nor a parameter of `f` (e.g. a module that f closes over): it "
            "would get no gradient. Pass the nn.Module itself as `f` (its parameters are then "
            "differentiated), or pass the tensors through `theta`"
        )
    return tree.unflatten(out_spec, [t.detach() for t in out_leaves])


def _phantom(
    f: Callable, z0: PyTree, theta: PyTree, options: dict, steps: int, damping: float
) -> tuple[PyTree, SolverInfo]:
    """The forward solve without a graph, then `steps` damped steps from $z^*$ with
    one (torchdeq's phantom gradient; a module `f` is called as it is)."""
    z, info = grad_mode.kept(lambda: fixed_point(lambda z: f(z, theta), z0, **options))
    leaves, spec = tree.flatten(z, "z")
    z = tree.unflatten(spec, [t.detach() for t in leaves])
    for _ in range(steps):
        fz = tree.flatten(f(z, theta), "f(z, theta)", owner="implicit_fixed_point")[0]
        zl = tree.flatten(z, "z")[0]
        if damping == 1.0:
            z = tree.unflatten(spec, fz)
        else:
            z = tree.unflatten(spec, [(1 - damping) * a + damping * b for a, b in zip(zl, fz)])
    return z, info._replace(evaluations=info.evaluations + steps)

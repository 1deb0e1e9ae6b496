r"""Anderson acceleration as a solver: fixed points $g(x) = x$ and roots $F(x) = 0$.

Both solvers drive the package's own [`aadl_func.anderson()`][aadl_func.anderson] update (mode
`"classic"` by default) around an *identity* inner optimizer: the "gradient" handed to `update` is
the step $r(x) = g(x) - x$ (fixed point) or $\alpha F(x)$ (root), the identity turns it into
the update, so the inner step is $y = x + r(x) = g(x)$ and type-II Anderson acceleration
of the map $g$ follows. Two routes write that recurrence for speed, each held to the core's
update by its tests: the eager loop's own window for one problem
(`aadl_func._src.solver_eager`) and the batched per-sample step
(`aadl_func._src.solver_batched`). This module adds the loops, the stopping test, the
bookkeeping, SciPy's backtracking line search and the masked fixed-budget variant for
`vmap`/`torch.compile`; the arguments are checked in `aadl_func._src.solver_options`, and
implicit differentiation is `aadl_func._src.solver_implicit`.

Residual norm: the 2-norm over all leaves of the pytree,
$\|r\| = (\sum_\ell \sum_i |r_{\ell,i}|^2)^{1/2}$, accumulated in float64, of
$g(x) - x$ (`fixed_point`) or of $F(x)$ (`root`). The solver stops at the first
iterate with $\|r_k\| \le \max(\mathrm{tol}, \mathrm{rtol}\,\|r_0\|)$.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import (
    grad_mode,
    solver_batched,
    solver_eager,
    solver_masked,
    solver_options,
    tree,
)
from aadl_func._src.anderson import Anderson, functions
from aadl_func._src.checks import differentiating
from aadl_func._src.core.linesearch import armijo
from aadl_func._src.core.scalars import wide
from aadl_func._src.options import AndersonOptions
from aadl_func._src.solver_info import CALLBACK, CONVERGED, MAX_ITER, NONFINITE, REASONS, SolverInfo
from aadl_func._src.solver_masked import per_problem
from aadl_func._src.validation import check_callable, check_devices_like, check_float, check_int

__all__ = ["REASONS", "SolverInfo", "fixed_point", "root"]

PyTree = Any


# -- the update ------------------------------------------------------------------------------
def _accelerator(settings: AndersonOptions) -> Anderson:
    """The [`aadl_func.anderson()`][aadl_func.anderson] update for `settings`."""
    return Anderson(*functions(settings))


# -- pytree arithmetic -----------------------------------------------------------------------
def _norm(leaves: list[Tensor], batch_dims: int = 0) -> Tensor:
    r"""The 2-norm over all leaves, accumulated in float64 (a 0-d tensor; with `batch_dims`,
    one per problem of the batch, over the other dimensions); of a complex leaf, that of its
    moduli, $(\sum_i |z_i|^2)^{1/2}$ (accumulated in complex128, whose norm is real)."""
    if batch_dims:
        squares = [
            torch.linalg.vector_norm(t, dim=tuple(range(batch_dims, t.dim())), dtype=wide(t.dtype))
            .square() for t in leaves
        ]  # fmt: skip
        if len(squares) == 1:  # the same value without the stack and the sum
            return squares[0].sqrt()
        return torch.stack(squares).sum(0).sqrt()
    squares = [torch.linalg.vector_norm(t, dtype=wide(t.dtype)).square() for t in leaves]
    if len(squares) == 1:  # the same value without the stack and the sum (a loop's overhead)
        return squares[0].sqrt()
    return torch.stack(squares).sum().sqrt()


def axpy(a: Any, x: list[Tensor], y: list[Tensor]) -> list[Tensor]:
    """`a * x + y` leaf by leaf (`a` a number or a 0-d tensor)."""
    return [(a * xi).to(yi.dtype) + yi for xi, yi in zip(x, y)]


def masked_wanted(masked: bool | None, leaves: list[Tensor]) -> bool:
    """The masked fixed-budget loop under `torch.compile` or `vmap`, where the stopping
    test cannot be read on the host; `masked` overrides the choice."""
    if masked is not None:
        return masked
    if tree.tracing():
        return True
    if _functorch.maybe_current_level() is not None:
        stack = _functorch.get_interpreter_stack() or ()
        if any(i.key() == _functorch.TransformType.Vmap for i in stack):
            return True
    return any(_functorch.is_batchedtensor(t) for t in leaves)


# -- the residual of a problem ---------------------------------------------------------------
class _Problem:
    r"""Evaluates a problem's residual at `x`: the step handed to `update` and its norm.

    `residual(x)` is $g(x) - x$ or $F(x)$; the step is `scale` times it (the
    root's $\alpha$, fixed once from the first evaluation); the norm is the residual's.
    With `value_norms` a call also returns $\|g(x)\|$ (`gtol`'s scale), else None.
    """

    def __init__(
        self,
        owner: str,
        fn: Callable,
        spec: Any,
        ref: list[Tensor],
        kind: str,
        value_norms: bool,
        batch_dims: int = 0,
    ):
        self.owner, self.fn, self.spec, self.ref, self.kind = owner, fn, spec, ref, kind
        self.value_norms, self.batch_dims = value_norms, batch_dims
        self.scale: Any = 1.0
        # (x, residual) computed ahead of the loop (the root's alpha rule), handed to the
        # loop's first evaluation of that same x instead of calling fn again.
        self.known: tuple[list[Tensor], list[Tensor]] | None = None

    def evaluate(self, x: list[Tensor]) -> tuple[list[Tensor], Tensor | None]:
        r"""The residual at `x` and, with `value_norms`, $\|g(x)\|$."""
        if self.known is not None and self.known[0] is x:
            r, self.known = self.known[1], None
            return r, None
        out = self.fn(tree.unflatten(self.spec, x))
        name = "g(x)" if self.kind == "fixed_point" else "F(x)"
        leaves, spec = tree.flatten(out, name, owner=self.owner)
        tree.check_like(name, leaves, spec, self.ref, self.spec, "x0", owner=self.owner)
        if any(o.dtype != r.dtype or o.device != r.device for o, r in zip(leaves, self.ref)):
            _check_cast(self.owner, name, leaves, self.ref, self.spec)
        leaves = [o if o.dtype == r.dtype else o.to(r.dtype) for o, r in zip(leaves, self.ref)]
        value = _norm(leaves, self.batch_dims) if self.value_norms else None
        if self.kind == "fixed_point":
            return [o - xi for o, xi in zip(leaves, x)], value
        return leaves, value

    def residual(self, x: list[Tensor]) -> list[Tensor]:
        return self.evaluate(x)[0]

    def __call__(self, x: list[Tensor]) -> tuple[list[Tensor], Tensor, Tensor | None]:
        r, value = self.evaluate(x)
        if _is_one(self.scale):
            step = r
        else:
            step = [_cast(per_problem(self.scale, t) * t, t.dtype) for t in r]
        return step, _norm(r, self.batch_dims), value


def _check_cast(owner: str, name: str, leaves: list[Tensor], ref: list[Tensor], spec: Any) -> None:
    """The map's values of another dtype than `x0`'s are cast to it, but not from complex to
    real (the imaginary parts would be dropped), and none may be on another device."""
    for i, (o, r) in enumerate(zip(leaves, ref)):
        if o.is_complex() and not r.is_complex():
            raise TypeError(
                f"{owner}: `{tree.leaf_path(spec, i, name)}` is complex ({o.dtype}) where "
                f"`{tree.leaf_path(spec, i, 'x0')}` is real ({r.dtype}): its imaginary part "
                "would be dropped; pass a complex `x0`"
            )
    check_devices_like(owner, name, leaves, spec, ref, "x0")


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _is_one(value: Any) -> bool:
    return isinstance(value, numbers.Real) and value == 1.0


# -- SciPy's backtracking line search --------------------------------------------------------
def _line_search(
    problem: _Problem, x: list[Tensor], proposal: list[Tensor], norm: float
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor | None, int]:
    """SciPy `nonlin`'s Armijo search on $\\phi(s) = \\|r(x + s d)\\|^2$ along the
    Anderson step $d$ = `proposal - x`, with $\\phi'(0)$ taken as
    $-\\phi(0)$ (exact for a Newton direction), `c1 = 1e-4` and `amin = 1e-2`. When
    no step length qualifies the full step is taken, as SciPy does.

    Returns the new point, its step, norm and $\\|g\\|$ (or None), and the number of
    evaluations spent.
    """
    direction = [p - xi for p, xi in zip(proposal, x)]
    trials: dict[float, tuple[list[Tensor], list[Tensor], Tensor, Tensor | None]] = {}

    def point(s: float) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor | None]:
        if s not in trials:
            xs = proposal if s == 1.0 else axpy(s, direction, x)
            trials[s] = (xs, *problem(xs))
        return trials[s]

    def phi(s: float) -> float:
        value = float(point(s)[2])
        return value * value if math.isfinite(value) else math.inf

    phi0 = norm * norm
    s = armijo(phi, phi0, -phi0)
    return (*point(1.0 if s is None else s), len(trials))


# -- the loops -------------------------------------------------------------------------------
def _eager_loop(
    problem: _Problem,
    x: list[Tensor],
    accelerate: Callable,
    options: solver_options.Options,
    spec: Any,
) -> tuple[list[Tensor], SolverInfo]:
    """Python control flow: stops at the first iterate that meets the tolerance.
    `accelerate(x, step)` is the Anderson step (`solver_eager.accelerator_step()`)."""
    tol, rtol, gtol = (float(t) for t in (options.tol, options.rtol, options.gtol))
    step, norm_t, value = problem(x)
    norm = float(norm_t)
    norms, evaluations, iterations = [norm], 1, 0
    threshold = max(tol, rtol * norm)
    best = (norm, x, 0)  # the lowest residual so far: (norm, iterate, step)
    status = NONFINITE if not math.isfinite(norm) else MAX_ITER
    while status != NONFINITE:
        if _met(norm, threshold, gtol, value):
            status = CONVERGED
            break
        if iterations == options.max_iter:
            break
        proposal = accelerate(x, step)
        if options.line_search:
            new_x, new_step, new_norm_t, new_value, spent = _line_search(problem, x, proposal, norm)
        else:
            (new_step, new_norm_t, new_value), new_x, spent = problem(proposal), proposal, 1
        evaluations += spent
        new_norm = float(new_norm_t)
        if not math.isfinite(new_norm):
            status = NONFINITE  # the step is not taken: x stays the last finite iterate
            break
        x, step, norm, value = new_x, new_step, new_norm, new_value
        iterations += 1
        norms.append(norm)
        if norm < best[0]:
            best = (norm, x, iterations)
        if options.callback is not None and options.callback(
            iterations, tree.unflatten(spec, x), norm
        ):
            status = CONVERGED if _met(norm, threshold, gtol, value) else CALLBACK
            break
    returned = iterations
    if options.return_best and status != CONVERGED:
        _, x, returned = best
    info = SolverInfo(
        iterations=torch.tensor(iterations),
        evaluations=torch.tensor(evaluations),
        residual_norms=torch.tensor(norms, dtype=torch.float64),
        converged=torch.tensor(status == CONVERGED),
        status=torch.tensor(status),
        returned_iteration=torch.tensor(returned),
    )
    return x, info


def _met(norm: float, threshold: float, gtol: float, value: Tensor | None) -> bool:
    r"""The eager stopping test: $\|r\| \le \max(\text{threshold},
    \mathrm{gtol}\,\|g(x)\|)$, threshold being $\max(\mathrm{tol}, \mathrm{rtol}
    \|r_0\|)$."""
    if norm <= threshold:
        return True
    return value is not None and norm <= gtol * float(value)


def _solve(
    owner: str,
    kind: str,
    fn: Callable,
    x0: PyTree,
    alpha: Any,
    options: solver_options.Options,
    settings: AndersonOptions,
    mode: str,
    batch_dims: int = 0,
) -> tuple[PyTree, SolverInfo]:
    leaves, spec = solver_options.check_x0(owner, x0, mode)
    opt = _accelerator(settings)
    if batch_dims:
        solver_options.check_batch(owner, leaves, spec, options, batch_dims)
        opt = _per_sample(opt, settings, leaves, batch_dims)
    if torch.is_grad_enabled() and differentiating():
        # Unrolled through the core's update the gradient is not usable (NaN where the
        # window degenerates), and torch.no_grad here would make it silently zero.
        raise RuntimeError(
            f"{owner}: torch.func.grad/vjp/jvp around the solver would differentiate through "
            "its iterations, which is not supported: use aa.implicit_fixed_point for the "
            "gradient of a fixed point, or call the solver under torch.no_grad()"
        )
    grad_on = torch.is_grad_enabled()

    def iterate() -> tuple[list[Tensor], SolverInfo, bool]:
        x = [t.detach() if t.requires_grad else t for t in leaves]
        value_norms = isinstance(options.gtol, Tensor) or options.gtol > 0
        problem = _Problem(owner, fn, spec, x, kind, value_norms, batch_dims)
        masked = batch_dims > 0 or masked_wanted(options.masked, x + options.tensors())
        if masked and options.line_search:
            raise ValueError(
                f"{owner}: `line_search` needs the eager loop; it is not available under vmap, "
                "torch.compile, masked=True or batch_dims"
            )
        recorded = grad_on and _depends_on_grad(problem, x)
        if kind == "root":
            problem.scale = _root_alpha(problem, x, alpha, masked)
        if masked:
            return (*solver_masked.masked_loop(problem, x, opt, options, spec), recorded)
        accelerate = solver_eager.accelerator_step(opt, settings, x, spec)
        return (*_eager_loop(problem, x, accelerate, options, spec), recorded)

    # No graph through the iterations (nor through the window).
    x, info, recorded = grad_mode.kept(iterate)
    if recorded:
        x = list(_NoGradient.apply(owner, _ANCHOR, *x))
    return tree.unflatten(spec, x), info


def _per_sample(
    opt: Anderson, settings: AndersonOptions, leaves: list[Tensor], batch_dims: int
) -> Anderson:
    """The same update, one window per problem of the batch: the batched recurrence of
    `aadl_func._src.solver_batched` where it implements the options (mode "classic", float32
    or float64 leaves; each problem its own weights from its own $m \times m$ solve,
    batched), else `opt`'s `init` and `update` under `batch_dims` nested ``vmap``s."""
    if batch_dims == 1 and solver_batched.supports(settings, leaves):
        return solver_batched.batched_anderson(settings)
    init, update = opt.init, opt.update
    for _ in range(batch_dims):
        init, update = torch.func.vmap(init), torch.func.vmap(update)
    return Anderson(init, update)


def _depends_on_grad(problem: _Problem, x: list[Tensor]) -> bool:
    """Whether the map depends on a tensor that requires grad (a parameter it closes over),
    from its first evaluation, made with autograd on when autograd records (and handed to
    the loop, so it costs no evaluation); such a result is marked by `_NoGradient`."""
    if tree.tracing() or _functorch.maybe_current_level() is not None:
        return False
    with torch.enable_grad():
        r = problem.residual(x)
    problem.known = (x, [t.detach() for t in r])
    return any(t.requires_grad for t in r)


class _NoGradient(torch.autograd.Function):
    """The solvers' result when the map depends on tensors that require grad: the values as
    they are, and a backward that explains, instead of torch's "element 0 of tensors does not
    require grad", why there is no gradient and where to get one."""

    @staticmethod
    def forward(ctx: Any, owner: str, anchor: Tensor, *leaves: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.owner = owner
        return tuple(t.view_as(t) for t in leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        raise RuntimeError(
            f"{ctx.owner}: its result carries no gradient (the iterations are not recorded), "
            "but the map depends on tensors that require grad: differentiate the fixed point "
            "with aa.implicit_fixed_point(f, z0, theta) (or gradient='phantom'), or .detach() "
            "the result if no gradient should flow through it"
        )


# A tensor that requires grad, the input that makes `_NoGradient`'s outputs require it.
_ANCHOR = torch.zeros((), requires_grad=True)


def _root_alpha(problem: _Problem, x: list[Tensor], alpha: Any, masked: bool) -> Any:
    r"""The root solver's $\alpha$ (the map is $x + \alpha F(x)$): as given, or
    SciPy's rule $\alpha = \tfrac12 \max(\|x_0\|, 1) / \|F(x_0)\|$ (1 when
    $F(x_0) = 0$). The loop's first evaluation reuses this $F(x_0)$: every call
    of $F$ is one of `info.evaluations`."""
    if alpha is not None:
        return alpha
    r0 = problem.residual(x)
    problem.known = (x, r0)
    f0 = _norm(r0, problem.batch_dims)
    x0 = _norm(x, problem.batch_dims)
    if masked:
        return torch.where(f0 > 0, 0.5 * torch.clamp(x0, min=1.0) / f0, 1.0)
    f0, x0 = float(f0), float(x0)
    return 0.5 * max(x0, 1.0) / f0 if f0 > 0 else 1.0


# -- public entry points ---------------------------------------------------------------------


def fixed_point(
    g: Callable[[PyTree], PyTree],
    x0: PyTree,
    *,
    tol: float | Tensor = 1e-6,
    rtol: float | Tensor = 0.0,
    gtol: float | Tensor = 0.0,
    max_iter: int = 100,
    history_depth: int = 6,
    relaxation: float = 1.0,
    reg: float = 0.0,
    reg_relative: float = 0.0,
    mode: str = "classic",
    line_search: bool | str | None = None,
    callback: Callable | None = None,
    masked: bool | None = None,
    return_best: bool = True,
    batch_dims: int = 0,
    **anderson_options: Any,
) -> tuple[PyTree, SolverInfo]:
    r"""Solves $x = g(x)$ by Anderson acceleration; returns `(x, info)`.

    Each step evaluates $g$ once at the current $x_k$ and calls
    [`aadl_func.anderson()`][aadl_func.anderson]'s `update` (an identity inner optimizer, so its
    plain step is $g(x_k)$). In mode `"classic"` over the last `history_depth` pairs:

    $$
    x_{k+1} = \sum_i \alpha_i \big((1 - \beta) x_i + \beta g(x_i)\big), \qquad
    \alpha = \arg\min_{\sum_i \alpha_i = 1} \Big\| \sum_i \alpha_i (g(x_i) - x_i) \Big\|,
    $$

    $\beta$ = `relaxation`; with `reg`/`reg_relative` the least-squares problem in
    its difference form gets the ridge $\lambda \|\gamma\|^2$, $\lambda$ =
    `reg` + `reg_relative` times the mean squared norm of the residual differences (see
    [`aadl_func.anderson()`][aadl_func.anderson]). It stops at the first $x_k$ with

    $$
    \|g(x_k) - x_k\| \le \max\big(\mathrm{tol},\; \mathrm{rtol}\,\|g(x_0) - x_0\|,\;
    \mathrm{gtol}\,\|g(x_k)\|\big),
    $$

    the 2-norm over all leaves of the pytree (in float64): absolute, relative to the first
    residual (SciPy's `f_rtol`, in the 2-norm), relative to the map's value (torchdeq's
    `stop_mode="rel"`, without its $10^{-9}$ in the denominator).

    Mode `"classic"` is the default because it is Anderson's method for equations: the
    pairs $(x_i, g(x_i))$ are taken as they are, so it is a multisecant (Broyden-like)
    method, GMRES on an affine map. Mode `"aadl"` is meant for optimizer steps: its residual
    proxy $x_{i+1} - x_i$ is the true residual only when $x_i$ was a plain step, so
    as a root finder it is a weaker method, which diverges on SciPy's pressure-network and
    linear test problems and is 10-20x slower on others (issue 25).

    Args:
      g: the map, pytree -> pytree of the structure, shapes (and dtypes, after a cast) of
        `x0`.
      x0: the starting point, a pytree of real floating tensors, or (mode "classic") of
        complex ones: the norm is then that of the moduli (docs/solver.md, "Complex tensors").
      tol: absolute tolerance (`>= 0`) on the residual norm: a real number, or a 0-d
        tensor (under `vmap`, a batched one gives each problem its own).
      rtol: tolerance relative to the first residual, $\mathrm{rtol}\,\|r_0\|$
        (`>= 0`, a number or a 0-d tensor).
      gtol: tolerance relative to the map's value, $\mathrm{gtol}\,\|g(x_k)\|$
        (`>= 0`, a number or a 0-d tensor; torchdeq's `"rel"`); 0 (default) skips it.
      max_iter: the most steps (`>= 0`); the eager loop stops earlier.
      history_depth: pairs in the window; SciPy's `M` (differences) is
        `history_depth - 1`. Mode "classic" takes `>= 2`: `history_depth=2` is AA(1),
        SciPy's `M=1` (the same iterates), often the best depth; mode "aadl" `>= 3`.
      relaxation: $\beta > 0$, 1 undamped.
      reg: absolute Tikhonov weight, `>= 0`.
      reg_relative: Tikhonov weight relative to the window, `>= 0`.
      mode: `"classic"` (default, see above) or `"aadl"`.
      line_search: None/False (default) or True/`"armijo"`: SciPy `nonlin`'s backtracking
        search on $\|g(x) - x\|^2$ along the Anderson step (eager loop only).
      callback: `callback(k, x, residual_norm)` after each step `k = 1, 2, ...`; eagerly
        a truthy return stops the solve (status `"callback"`); in the masked loop it is
        called once per round with tensors and its return value is ignored.
      masked: None (default) picks the masked fixed-budget loop under `vmap` and
        `torch.compile` and the eager loop otherwise; True/False force one.
      return_best: True (default): a solve that does not converge returns the iterate with
        the lowest residual norm seen (`info.returned_iteration` says which), not the last
        one; a converged solve returns its last iterate either way. False: the last iterate.
      batch_dims: 0 (default): `x0` is one problem. 1: the first dimension of every leaf
        indexes independent problems (a DEQ batch), solved per problem as under
        `vmap` (each its own window weights, norm, stopping test and best iterate; frozen
        once stopped) while `g` is called on the whole batch; the tolerances may hold one
        value per problem; `info`'s fields have the batch shape in front. The masked loop.
      **anderson_options: any other option of [`aadl_func.anderson()`][aadl_func.anderson] (e.g.
        `history_dtype`, `compute_device`, or `reg_column`, the per-column
        regularisation: SciPy's `w0` is `reg_column = w0**2`), passed through.

    Returns:
      `(x, info)`: the returned iterate (of `x0`'s structure; see `return_best`) and a
      [`SolverInfo`][aadl_func.SolverInfo].

    Composition. Eagerly the loop reads the residual norm on the host once per step. Under
    `torch.func.vmap` a batch of problems runs the masked loop: each stops on its own (its
    `x` is frozen once it meets the tolerance), and the loop ends when all have stopped (or
    after `max_iter` rounds if that cannot be read without a device synchronisation). Under
    `torch.compile` the masked loop runs the full budget of `max_iter` rounds in one graph.
    The line search needs the eager loop. The result carries no autograd graph; to
    differentiate through the fixed point use
    [`implicit_fixed_point()`][aadl_func.implicit_fixed_point] (under `torch.func.grad`/`vjp`/`jvp`
    the solver raises `RuntimeError` rather than differentiate through its iterations).
    """
    owner = "fixed_point"
    check_callable(owner, "g", g)
    batch_dims = check_int(owner, "batch_dims", batch_dims, 0)
    options = solver_options.options(
        owner, tol, rtol, max_iter, line_search, callback, masked, return_best, gtol, batch_dims
    )
    settings = solver_options.anderson_options(
        owner, history_depth, relaxation, reg, reg_relative, mode, anderson_options
    )
    return _solve(owner, "fixed_point", g, x0, None, options, settings, mode, batch_dims)


def root(
    F: Callable[[PyTree], PyTree],
    x0: PyTree,
    *,
    alpha: float | None = None,
    tol: float | Tensor = 1e-6,
    rtol: float | Tensor = 0.0,
    max_iter: int = 100,
    history_depth: int = 6,
    relaxation: float = 1.0,
    reg: float = 0.0,
    reg_relative: float = 0.0,
    mode: str = "classic",
    line_search: bool | str | None = None,
    callback: Callable | None = None,
    masked: bool | None = None,
    return_best: bool = True,
    batch_dims: int = 0,
    **anderson_options: Any,
) -> tuple[PyTree, SolverInfo]:
    r"""Solves $F(x) = 0$ by Anderson acceleration of $g(x) = x + \alpha F(x)$.

    This is `scipy.optimize.anderson`'s method: SciPy's initial Jacobian guess is
    $-1/\alpha$ (so the plain step is $x + \alpha F(x)$, with SciPy's sign), and
    with `history_depth = M + 1`, `relaxation = 1`, no regularisation (SciPy's
    `w0 = 0`) and no line search the iterates are SciPy's. `alpha=None` takes SciPy's
    default $\tfrac12 \max(\|x_0\|, 1) / \|F(x_0)\|$; a negative `alpha` suits an
    $F$ whose Jacobian is near a positive multiple of the identity. The tolerance is on
    $\|F(x_k)\|$ (2-norm over all leaves, float64; SciPy defaults to the max-norm).
    The default mode is `"classic"`, for the reason [`fixed_point()`][aadl_func.fixed_point] gives.

    Args:
      F: the function, pytree -> pytree of `x0`'s structure and shapes.
      x0: the starting point, as [`fixed_point()`][aadl_func.fixed_point]'s.
      alpha: None (SciPy's rule) or a finite non-zero real number.
      line_search: None/False (default) or True/`"armijo"`: SciPy `nonlin`'s default
        backtracking search on $\|F\|^2$ (`scipy.optimize.anderson` uses it unless
        given `line_search=None`).
      tol: as [`fixed_point()`][aadl_func.fixed_point]'s, on $\|F(x)\|$. (`gtol` has no meaning
        here.)
      rtol: as [`fixed_point()`][aadl_func.fixed_point]'s.
      max_iter: as [`fixed_point()`][aadl_func.fixed_point]'s.
      history_depth: as [`fixed_point()`][aadl_func.fixed_point]'s.
      relaxation: as [`fixed_point()`][aadl_func.fixed_point]'s.
      reg: as [`fixed_point()`][aadl_func.fixed_point]'s.
      reg_relative: as [`fixed_point()`][aadl_func.fixed_point]'s.
      mode: as [`fixed_point()`][aadl_func.fixed_point]'s.
      callback: as [`fixed_point()`][aadl_func.fixed_point]'s.
      masked: as [`fixed_point()`][aadl_func.fixed_point]'s.
      return_best: as [`fixed_point()`][aadl_func.fixed_point]'s.
      batch_dims: as [`fixed_point()`][aadl_func.fixed_point]'s.
      **anderson_options: as [`fixed_point()`][aadl_func.fixed_point]'s.

    Returns:
      `(x, info)`, as [`fixed_point()`][aadl_func.fixed_point].
    """
    owner = "root"
    check_callable(owner, "F", F)
    if alpha is not None:
        alpha = check_float(owner, "alpha", alpha, minimum=-math.inf)
        if alpha == 0.0:
            raise ValueError(f"{owner}: `alpha` must be non-zero (the step is x + alpha F(x))")
    batch_dims = check_int(owner, "batch_dims", batch_dims, 0)
    options = solver_options.options(
        owner, tol, rtol, max_iter, line_search, callback, masked, return_best, 0.0, batch_dims
    )
    settings = solver_options.anderson_options(
        owner, history_depth, relaxation, reg, reg_relative, mode, anderson_options
    )
    return _solve(owner, "root", F, x0, alpha, options, settings, mode, batch_dims)

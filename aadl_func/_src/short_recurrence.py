r"""Short-term recurrence Anderson mixing (ST-AM; Wei, Bao and Liu, ICLR 2022): type-I
Anderson mixing whose window is two conjugate pairs, which on a strictly convex quadratic does
what full-memory type-I mixing does, and so follows (preconditioned) conjugate gradients.

The map is one step of the inner optimizer, $r_k = u(x_k)$, $x \mapsto x + r(x)$, taken
from the gradient $g_k$. Call $k$ turns the newest secant triple $p = x_k - x_{k-1}$,
$q = r_k - r_{k-1}$, $y = g_k - g_{k-1}$ into a conjugate one by one modified Gram-Schmidt
sweep against the two kept ones $(p_i, q_i, y_i)$ (older first):

$$
\zeta_i = \frac{p_i^\top y}{p_i^\top y_i}, \qquad
(p, q, y) \leftarrow (p, q, y) - \zeta_i (p_i, q_i, y_i),
$$

so that $p_i^\top y = 0$ for both; it scales the triple to $\|p\| = 1$ and drops the older
one. With $P = [p_{k-1}, p_k]$ and likewise $Q$, $Y$, the Galerkin condition on the
gradient's secant model, $P^\top (g_k - Y\Gamma) = 0$, makes $P^\top Y$ lower triangular,
solved by substitution, and

$$
\bar x_k = x_k - P\Gamma, \qquad \bar r_k = r_k - Q\Gamma, \qquad
x_{k+1} = \bar x_k + \beta \bar r_k ,
$$

$\beta$ the relaxation: $\bar x_k$ minimizes the quadratic model of the loss over
$x_k - \mathrm{span}\, P$, and $\bar r_k$ is the inner step's model there. Why two pairs are
enough: for a quadratic with Hessian $A$ and an inner step $u = -D g$, $D$ fixed and
symmetric positive definite (gradient descent: $D = \mathrm{lr}\, I$), $\bar x_k$ is the
minimizer over $x_0 + \mathcal K_k(DA, D g_0)$, which is preconditioned conjugate gradients'
$k$-th iterate $c_k$; that $g_k$ and the next $\Delta x$ are conjugate to every pair but the
last two is the Lanczos argument (the module's tests hold $x_{k+1} = c_k - \beta D\,g(c_k)$
to a float64 NumPy PCG). The published ST-AM makes the residual $r$ play the gradient's part
($P^\top(r_k - Q\Gamma) = 0$); the two coincide for gradient descent, and with another inner
step (Adam's changing diagonal) the gradient's condition is the one that minimizes the model,
which did better on the full-batch suite's convex and smooth problems.

What keeps it safe away from that case:

* a triple is kept only if it is finite and $p^\top y > \epsilon \|p\| \|y\|$ (positive
  curvature along $p$); any other restarts the window, and the call takes the plain step
  $x_k + \beta r_k$;
* a mix that is not finite is replaced by the plain step, with a restart;
* the triples are combinations of earlier ones, so their rounding errors compound (CG resets
  its own with a fresh product $Ap$ every step; a short recurrence has none): each carries
  an estimate of its error, and above `drift_tol` the window starts again from the raw
  secant triple (without this, gradient descent at relaxation 0.5 on a quadratic of
  condition 100 loses the secant relation $y = A p$ of its pairs within 100 calls, and then
  stalls or diverges);
* with `loss=` the deferred safeguard of [`anderson()`][aadl_func.anderson]: a returned mix
  whose loss (passed with the next call's gradient) is not below the loss at the point it was
  made from is rejected: that call returns the plain step $x_{k-1} + \beta r_{k-1}$ it
  replaced, restarts the window and discards the rejected point's gradient (the inner
  optimizer's state is kept as it was before it);
* with `max_wait > 0`, after a rejection the next mixes wait: the following call takes the
  plain step (the window grows as usual), after a second rejection in a row the next two
  calls, then four, up to `max_wait`; a kept mix starts the count again. Each rejection
  spends a gradient at a point that is thrown away. The waits trust the inner step alone
  meanwhile, which is what the mixes made safe where it is unstable (gradient descent at a
  large step), so they are off by default; docs/fullbatch.md measures both.

Without a loss nothing judges a mix, and type-I mixing does not minimize a residual as a
windowed type-II one does: near and past convergence, where the secant triples are mostly
the rounding of the gradients, it can diverge. On the tests' quadratic (condition 100,
float64) it reaches the rounding floor in about 200 calls; whether and when it leaves it
then is up to the last bits of the rounding (starts a unit in the last place apart, or
another CPU's kernels: at relaxation 1 about 60% of runs rise above what the loss can tell
from the floor within the next 100 calls, at relaxation 0.5 nearly all). With `loss=` the
rejected mixes restart it there (300 calls, both relaxations, no point the run keeps above
that level).

A step that is not finite (the inner update of a NaN gradient) is returned as the inner
optimizer alone would return it, but it is never stored: the window and the previous point
stay finite, and the next triple starts before it.

The vectors are flat, as in [`lbfgs()`][aadl_func.lbfgs]: the leaves are concatenated into
one vector of their promoted dtype and the inner products are taken over every leaf at once
(in that dtype, then float64). Eagerly the scalar work is Python arithmetic and the choices
are branches (`_Arith`); under `torch.func.vmap()` (an ensemble, each member with its own
window) and `torch.compile` every choice is a `torch.where` on 0-d tensors, which round
alike. The state holds nine parameter-sized vectors besides the inner optimizer's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.core import accept
from aadl_func._src.lbfgs import _compute_dtype, _flat, _unflat
from aadl_func._src.leaf_memory import check_writable
from aadl_func._src.state import allow_weights_only
from aadl_func._src.validation import (
    check_bool,
    check_devices_like,
    check_field_shapes,
    check_float,
    check_int,
    check_state_type,
    flatten_like,
)

__all__ = ["ShortRecurrence", "ShortRecurrenceState", "short_recurrence"]

PyTree = Any
_OWNER = "short_recurrence"


class ShortRecurrenceState(NamedTuple):
    r"""State of [`short_recurrence()`][aadl_func.short_recurrence]; $N$ is the number of
    parameter entries.

    Attributes:
        count: 0-d `int64` tensor, the number of updates done so far.
        num_pairs: 0-d `int64` tensor, the conjugate pairs in the window (0, 1 or 2); row 1
            of `directions` and `residual_changes` is the newest, row 0 the older.
        num_restarts: 0-d `int64` tensor, the updates that emptied the window (a rejected
            pair, a mix that was not finite, or a rejected mix).
        num_rejected: 0-d `int64` tensor, the mixes the deferred safeguard rejected.
        cooldown: 0-d `int64` tensor, the calls left that return the plain step after a
            rejected mix (see `max_wait`).
        backoff: 0-d `int64` tensor, the cooldown the next rejection starts.
        pending_loss: 0-d `float64` tensor, the loss at the point the returned mix was made
            from, which the next call's loss must beat; $+\infty$ when no mix is pending.
        pair_errors: `float64` tensor of shape `(2,)`, the estimated errors of the rows'
            pairs (see `drift_tol`).
        inner: the inner optimizer's state.
        directions: `(2, N)` tensor, the conjugate steps $p_i$.
        residual_changes: `(2, N)` tensor, the matching changes $q_i$ of the inner update.
        grad_changes: `(2, N)` tensor, the matching gradient changes $y_i$.
        params: `(N,)` tensor, $x_{k-1}$: the params of the previous update, flattened.
        residual: `(N,)` tensor, $r_{k-1}$: the inner optimizer's update there.
        grads: `(N,)` tensor, $g_{k-1}$: the gradient there.
    """

    count: Tensor
    num_pairs: Tensor
    num_restarts: Tensor
    num_rejected: Tensor
    cooldown: Tensor
    backoff: Tensor
    pending_loss: Tensor
    pair_errors: Tensor
    inner: Any
    directions: Tensor
    residual_changes: Tensor
    grad_changes: Tensor
    params: Tensor
    residual: Tensor
    grads: Tensor


allow_weights_only(ShortRecurrenceState)


class ShortRecurrence(NamedTuple):
    """`state = init(params)`; `params, state = update(state, params, grads, loss=None)`."""

    init: Callable[[PyTree], ShortRecurrenceState]
    update: Callable[..., tuple[PyTree, ShortRecurrenceState]]


class _Arith:
    """The scalar arithmetic of one call. Eagerly the scalars are Python numbers and the
    choices Python branches: a 0-d tensor operation costs a few microseconds, more than
    the vector work of a small model. Under vmap and torch.compile (no values to read)
    they are 0-d float64 tensors and masks. Both round alike (IEEE double), and the vector
    operations are the same, so the two give the same bits."""

    def __init__(self, eager: bool) -> None:
        self.eager = eager

    def read(self, t: Tensor) -> Any:
        """A 0-d state tensor's value (eager) or the tensor."""
        return t.item() if self.eager else t

    def dot(self, a: Tensor, b: Tensor) -> Any:
        """$a^\top b$, in the vectors' dtype, as a float64 number."""
        d = torch.dot(a, b)
        return d.item() if self.eager else d.to(torch.float64)

    def ratio(self, num: Any, den: Any, valid: Any) -> Any:
        """`num / den` where `valid`, else 0; a zero `den` where `valid` (a pair whose
        curvature underflowed on a diverging run) gives Inf or NaN, as the masks do."""
        if self.eager:
            return self.div(num, den) if valid else 0.0
        return torch.where(valid, num / torch.where(valid, den, 1.0), 0.0)

    def div(self, num: Any, den: Any) -> Any:
        """`num / den` as IEEE division (a zero `den` gives Inf or NaN, not an exception)."""
        if not self.eager or den != 0:
            return num / den
        return math.nan if num == 0 or math.isnan(num) else math.copysign(math.inf, num * den)

    def where(self, flag: Any, a: Any, b: Any) -> Any:
        if self.eager:
            return a if flag else b
        return torch.where(flag, a, b)

    def finite(self, v: Any) -> Any:
        return math.isfinite(v) if self.eager else torch.isfinite(v)

    def all_finite(self, t: Tensor) -> Any:
        flag = torch.isfinite(t).all()
        return bool(flag) if self.eager else flag

    def sqrt(self, v: Any) -> Any:
        return math.sqrt(v) if self.eager else torch.sqrt(v)

    def negate(self, flag: Any) -> Any:
        return (not flag) if self.eager else ~flag

    def coefficient(self, v: Any, dtype: torch.dtype) -> Any:
        """A scalar that multiplies a vector: rounded to its dtype either way."""
        return v if self.eager else v.to(dtype)

    def count(self, flag: Any) -> Any:
        """A flag as 0 or 1, to add to a counter."""
        return int(flag) if self.eager else flag.to(torch.int64)

    def tensor(self, v: Any, like: Tensor) -> Tensor:
        """A state field's new value (a number, or a list of them) as a tensor like `like`."""
        if self.eager:
            return torch.tensor(v, dtype=like.dtype, device=like.device)
        return torch.stack(v) if isinstance(v, list) else v


class _Window(NamedTuple):
    """The window after this call's pair: its rows, their error estimates, how many of them
    hold pairs, and whether it was emptied."""

    directions: Tensor
    residual_changes: Tensor
    grad_changes: Tensor
    pair_errors: list[Any]
    num_pairs: Any
    restarted: Any


def _conjugate_pair(
    ar: _Arith,
    state: ShortRecurrenceState,
    x: Tensor,
    r: Tensor,
    g: Tensor,
    eps: float,
    drift_tol: float,
) -> _Window:
    r"""The window with this call's secant triple made conjugate to the kept ones and
    appended, or emptied (`restarted`) when there is no previous update or the triple fails
    the test $p^\top y > \epsilon \|p\| \|y\|$ (finite, positive curvature along $p$).

    The sweep subtracts the kept triples' errors along with them, and divides by how much of
    the triple survives it: the newest one's error is estimated as
    $e = (u \|\Delta x\| + |\zeta_0| e_0 + |\zeta_1| e_1) / \|p\|$ ($u$ the dtype's
    epsilon, $e_i$ the kept triples' estimates; every kept $\|p\| = 1$). Left alone it grows
    geometrically (the short recurrence has no fresh Jacobian product to reset it, as CG
    has), so above `drift_tol` the window restarts from the raw triple instead."""
    raw = (x - state.params, r - state.residual, g - state.grads)
    (p, q, y), error = raw, 0.0
    num_pairs, errors = ar.read(state.num_pairs), state.pair_errors
    errors = errors.tolist() if ar.eager else list(errors.unbind())
    for row, valid in enumerate((num_pairs >= 2, num_pairs >= 1)):  # older, newer
        if ar.eager and not valid:
            continue
        p_i, q_i, y_i = state.directions[row], state.residual_changes[row], state.grad_changes[row]
        # A row that holds no pair is finite (zeros or an old pair): zeta = 0 leaves it.
        zeta = ar.ratio(ar.dot(p_i, y), ar.dot(p_i, y_i), valid)
        error = error + abs(zeta) * errors[row]
        zeta = ar.coefficient(zeta, p.dtype)
        p, q, y = p - zeta * p_i, q - zeta * q_i, y - zeta * y_i
    raw_norm, norm = ar.sqrt(ar.dot(raw[0], raw[0])), ar.sqrt(ar.dot(p, p))
    unit = torch.finfo(p.dtype).eps
    error = ar.div(unit * raw_norm + error, norm)
    # The raw triple when the conjugate one has drifted (or is not finite): a window of one.
    fresh = ar.negate(error <= drift_tol)
    p, q, y = (ar.where(fresh, a, b) for a, b in zip(raw, (p, q, y)))
    norm, error = ar.where(fresh, raw_norm, norm), ar.where(fresh, unit, error)
    py, yy = ar.dot(p, y), ar.dot(y, y)
    good = (ar.read(state.count) > 0) & ar.finite(py) & ar.finite(norm) & ar.finite(yy)
    good = good & (py > eps * norm * ar.sqrt(yy))
    # Unit steps keep the 2 x 2 system's scale near the gradient's; a rejected triple is
    # replaced by zeros, so that no branch of a `where` carries a non-finite number.
    scale = ar.coefficient(ar.ratio(1.0, norm, good), p.dtype)
    p, q, y = (ar.where(good, v * scale, torch.zeros_like(v)) for v in (p, q, y))
    grown = ar.where(fresh, 1, _at_most_two(num_pairs + 1))
    return _Window(
        torch.stack([state.directions[1], p]),
        torch.stack([state.residual_changes[1], q]),
        torch.stack([state.grad_changes[1], y]),
        [errors[1], ar.where(good, error, 0.0)],
        ar.where(good, grown, 0),
        ar.negate(good),
    )


def _waits(ar: _Arith, state: Any, cooldown: Any, kept: Any, max_wait: int) -> dict[str, Any]:
    """The `cooldown` and `backoff` after a call that rejected nothing: one call less to
    wait, and after a kept mix (`kept`) the shortest wait again. Eagerly a field that keeps
    its value is the state's own tensor (no operation)."""
    if not ar.eager:
        backoff = torch.where(kept, min(1, max_wait), state.backoff)
        return {"cooldown": torch.clamp(state.cooldown - 1, min=0), "backoff": backoff}
    return {
        "cooldown": state.cooldown if cooldown <= 0 else ar.tensor(cooldown - 1, state.cooldown),
        "backoff": ar.tensor(min(1, max_wait), state.backoff) if kept else state.backoff,
    }


def _at_most_two(n: Any) -> Any:
    return min(n, 2) if isinstance(n, int) else torch.clamp(n, max=2)


def _galerkin_mix(
    ar: _Arith, window: _Window, plain: Tensor, g: Tensor, relaxation: float
) -> Tensor:
    r"""$x + \beta r - (P + \beta Q)\Gamma$ with $P^\top Y \Gamma = P^\top g$, by forward
    substitution: $P^\top Y$ is lower triangular (the newest $y$ is orthogonal to both $p$).
    `plain` is the plain step $x + \beta r$."""
    (p0, p1), (q0, q1), (y0, y1) = window.directions, window.residual_changes, window.grad_changes
    valid0, valid1 = window.num_pairs >= 2, window.num_pairs >= 1
    if ar.eager and not valid1:
        return plain
    gamma0 = ar.ratio(ar.dot(p0, g), ar.dot(p0, y0), valid0)
    gamma1 = ar.ratio(ar.dot(p1, g) - ar.dot(p1, y0) * gamma0, ar.dot(p1, y1), valid1)
    g0, g1 = ar.coefficient(gamma0, plain.dtype), ar.coefficient(gamma1, plain.dtype)
    return plain - (p0 + relaxation * q0) * g0 - (p1 + relaxation * q1) * g1


class _Config(NamedTuple):
    """`short_recurrence`'s options, checked."""

    relaxation: float
    eps: float
    drift_tol: float
    max_wait: int


def _update(
    inner: Any,
    config: _Config,
    state: ShortRecurrenceState,
    params: PyTree,
    grads: PyTree,
    loss: Any,
    inplace: bool,
) -> tuple[PyTree, ShortRecurrenceState]:
    """One call; the numbered steps are those of `short_recurrence`'s docstring."""
    # 0. Everything is checked before anything is computed or written.
    p_leaves, spec, g_leaves = _check_update(state, params, grads, inplace)
    loss_given = loss is not None
    loss = _checked_loss(loss, state.pending_loss)
    dtype = state.params.dtype
    # Eagerly the scalars are read (`_Arith`); under vmap or torch.compile (where every
    # tensor counts as transformed) they are masks.
    inputs = (state.params, *p_leaves, *g_leaves, loss)
    ar = _Arith(not any(tree.is_transformed(t) for t in inputs))
    # 1. The deferred verdict on the previous call's mix (none without a loss); eagerly, a
    # rejection skips the rest (step 4).
    pending, loss = ar.read(state.pending_loss), ar.read(loss)
    rejected = loss_given & accept.rejects_pending(pending, loss)
    if ar.eager and rejected:
        return _returned(*_went_back(state, config), p_leaves, spec, inplace)
    # 2. The inner step r_k = u(x_k), out of place: a rejected point's update is discarded.
    updates, inner_state = inner.update(grads, state.inner, params=params, inplace=False)
    x, r = _flat(p_leaves, dtype), _flat(list(optree.tree_leaves(updates)), dtype)
    g = _flat(g_leaves, dtype)
    # 3. The triple, the window and the mix; a mix that is not finite gives way to the plain
    # step.
    window = _conjugate_pair(ar, state, x, r, g, config.eps, config.drift_tol)
    plain = x + config.relaxation * r
    mix = _galerkin_mix(ar, window, plain, g, config.relaxation)
    finite = ar.all_finite(mix)
    cooldown = ar.read(state.cooldown)  # > 0: a recent rejection, the plain step (step 4)
    out = ar.where(finite & (cooldown <= 0), mix, plain)
    restarted = window.restarted | ar.negate(finite)
    mixed = finite & (cooldown <= 0) & (window.num_pairs > 0)
    kept = loss_given & (pending < accept.INF)  # the previous call's mix, judged and kept
    store = ar.all_finite(r) & ar.all_finite(g)  # no secant ends at a non-finite step
    new_state = ShortRecurrenceState(
        count=state.count + 1,
        num_pairs=ar.tensor(ar.where(restarted, 0, window.num_pairs), state.num_pairs),
        num_restarts=state.num_restarts + ar.count(restarted),
        num_rejected=state.num_rejected,
        **_waits(ar, state, cooldown, kept, config.max_wait),
        pending_loss=ar.tensor(
            ar.where(mixed, accept.judged_loss(loss), accept.INF), state.pending_loss
        ),
        pair_errors=ar.tensor(window.pair_errors, state.pair_errors),
        inner=inner_state,
        directions=window.directions,
        residual_changes=window.residual_changes,
        grad_changes=window.grad_changes,
        params=ar.where(store, x, state.params),
        residual=ar.where(store, r, state.residual),
        grads=ar.where(store, g, state.grads),
    )
    if not ar.eager:  # 4. A rejected mix, as a mask.
        back, kept = _went_back(state, config)
        out = torch.where(rejected, back, out)
        new_state = optree.tree_map(
            lambda old, new: torch.where(rejected, old, new), kept, new_state
        )
    return _returned(out, new_state, p_leaves, spec, inplace)


def _went_back(state: ShortRecurrenceState, config: _Config) -> tuple[Tensor, Any]:
    """Step 4: the plain step $x_{k-1} + \beta r_{k-1}$ a rejected mix replaced, and the
    state as it was before that mix, with an empty window, the rejection counted and the
    next `backoff` calls returning the plain step (the one after, twice as many)."""
    one = state.num_rejected.new_ones(())
    kept = state._replace(
        count=state.count + 1,
        cooldown=state.backoff.clone(),
        backoff=torch.clamp(2 * state.backoff, max=config.max_wait),
        num_pairs=torch.zeros_like(state.num_pairs),
        num_restarts=state.num_restarts + one,
        num_rejected=state.num_rejected + one,
        pending_loss=torch.full_like(state.pending_loss, accept.INF),
    )
    return state.params + config.relaxation * state.residual, kept


def _returned(
    out: Tensor, new_state: ShortRecurrenceState, p_leaves: list[Tensor], spec: Any, inplace: bool
) -> tuple[PyTree, ShortRecurrenceState]:
    """The flat point as the params' pytree (written into them in place), and the state."""
    new_leaves = _unflat(out, p_leaves)
    if inplace:
        new_leaves = [leaf.copy_(new) for leaf, new in zip(p_leaves, new_leaves)]
    return optree.tree_unflatten(spec, new_leaves), new_state


def _checked_loss(loss: Any, like: Tensor) -> Tensor:
    """`loss` as a 0-d float64 tensor on the state's device; None (no safeguard): NaN, which
    beats nothing and is judged by nothing."""
    if loss is None:
        return torch.full_like(like, float("nan"))
    if isinstance(loss, bool) or not isinstance(loss, (Tensor, int, float)):
        raise TypeError(
            f"short_recurrence.update: `loss` must be a number or a 0-d real tensor, got "
            f"{type(loss).__name__}"
        )
    if isinstance(loss, Tensor):
        if loss.numel() != 1 or loss.is_complex():
            raise ValueError(
                f"short_recurrence.update: `loss` must be one real value, got a {loss.dtype} "
                f"tensor of shape {tuple(loss.shape)}"
            )
        return loss.detach().reshape(()).to(like)
    return torch.full_like(like, float(loss))


def _init(inner: Any, max_wait: int, params: PyTree) -> ShortRecurrenceState:
    """The state before any update: an empty window, zero vectors like the flat params."""
    leaves, _ = tree.flatten(params, "params", owner="short_recurrence.init")
    x = _flat(leaves, _compute_dtype("short_recurrence.init", leaves))
    if leaves:
        x = x.to(leaves[0].device)
    count = x.new_zeros((), dtype=torch.int64)
    rows = x.new_zeros((2, x.shape[0]))
    return ShortRecurrenceState(
        count=count,
        num_pairs=count.clone(),
        num_restarts=count.clone(),
        num_rejected=count.clone(),
        cooldown=count.clone(),
        backoff=torch.full_like(count, min(1, max_wait)),
        pending_loss=x.new_full((), accept.INF, dtype=torch.float64),
        pair_errors=x.new_zeros((2,), dtype=torch.float64),
        inner=inner.init(params),
        directions=rows,
        residual_changes=rows.clone(),
        grad_changes=rows.clone(),
        params=torch.zeros_like(x),
        residual=torch.zeros_like(x),
        grads=torch.zeros_like(x),
    )


def _check_update(
    state: Any, params: PyTree, grads: PyTree, inplace: Any
) -> tuple[list[Tensor], Any, list[Tensor]]:
    """`update`'s arguments but `loss`, from their metadata alone: the state's type and
    vectors, `grads` against `params` (structure, then each leaf's shape, dtype and device:
    nothing is broadcast or cast), and `inplace` (a bool; if True, params leaves that can be
    written once each). Returns `(params leaves, params spec, grads leaves)`."""
    owner = "short_recurrence.update"
    check_state_type(_OWNER, state, ShortRecurrenceState, "state", owner)
    check_bool(owner, "inplace", inplace)
    p_leaves, spec = tree.flatten(params, "params", owner=owner)
    g_leaves = flatten_like(owner, "grads", grads, spec)
    _check_state(state, p_leaves)
    for i, g in enumerate(g_leaves):
        if not isinstance(g, Tensor):
            raise TypeError(
                f"{owner}: `grads` must be a pytree of tensors; "
                f"`{tree.leaf_path(spec, i, 'grads')}` is {type(g).__name__}"
            )
    # Same spec: the grads' key paths are the params'. Shapes: ValueError; dtypes: TypeError.
    tree.check_like("grads", g_leaves, spec, p_leaves, spec, check_dtype=True, owner=owner)
    check_devices_like(owner, "grads", g_leaves, spec, p_leaves)
    if inplace and not tree.any_transformed(p_leaves):
        # An expanded leaf (or an inference tensor) would fail its write after the leaves
        # before it were written.
        check_writable(owner, "params", p_leaves, spec)
    return p_leaves, spec, g_leaves


def _check_state(state: ShortRecurrenceState, leaves: list[Tensor]) -> None:
    """The state's vectors fit the params `leaves` (their number and promoted dtype)."""
    owner = "short_recurrence.update"
    n, dtype = sum(leaf.numel() for leaf in leaves), _compute_dtype(owner, leaves)
    rows = {name: (2, n) for name in ("directions", "residual_changes", "grad_changes")}
    shapes = {**rows, "params": (n,), "residual": (n,), "grads": (n,)}
    check_field_shapes(owner, state, "state", shapes, dtype, "was it made for other params?")


def short_recurrence(
    inner: Any,
    *,
    relaxation: float = 1.0,
    curvature_eps: float = 1e-10,
    drift_tol: float = 1e-3,
    max_wait: int = 0,
) -> ShortRecurrence:
    r"""Short-term recurrence Anderson mixing (ST-AM) around the inner optimizer `inner`.

    Each `update(state, params, grads, loss=None, inplace=False)`:

    1. takes the inner step $r_k = u(x_k)$ from `grads` (the residual of the map
       $x \mapsto x + u(x)$);
    2. with `loss`, the loss at `params` computed with `grads`, judges the previous call's
       mix (the deferred safeguard): rejected when `loss` is not below the loss at the
       point it was made from;
    3. makes the secant triple $(x_k - x_{k-1}, r_k - r_{k-1}, g_k - g_{k-1})$ conjugate
       to the two kept ones and appends it (or restarts the window: a first call, a triple
       that is not finite or without positive curvature along its step), then returns the
       type-I mix $x_k + \beta r_k - (P + \beta Q)\Gamma$, $P^\top Y\Gamma = P^\top g_k$ (the
       plain step $x_k + \beta r_k$ with an empty window or a mix that is not finite);
    4. a rejected mix returns instead the plain step $x_{k-1} + \beta r_{k-1}$ it replaced,
       with an empty window, and keeps the state as it was before the rejected point; with
       `max_wait > 0` the next call then returns the plain step, after a second rejection
       in a row the next two, then four, ..., at most `max_wait` (a kept mix starts again
       at one).

    On a strictly convex quadratic with an inner step $u = -D\nabla f$, $D$ fixed ($D =
    \mathrm{lr}\, I$: `aa.sgd(lr)`), the mix before relaxation is preconditioned conjugate
    gradients' iterate: $x_{k+1} = c_k - \beta D \nabla f(c_k)$. See the module docstring
    (`aadl_func._src.short_recurrence`) for the recurrence and its safeguards.

    Args:
        inner: an inner optimizer in the torchopt protocol (`aa.sgd`, `aa.adam`, ...).
        relaxation: $\beta > 0$, the step along the mixed residual (1: the plain step
            is the inner optimizer's own).
        curvature_eps: $\epsilon \ge 0$ of the test $p^\top y > \epsilon \|p\| \|y\|$.
        drift_tol: the estimated error of the newest conjugate triple above which the
            window restarts from the raw secant triple ($> 0$).
        max_wait: the most calls that return the plain step after a rejected mix (an int
            $\ge 0$; 0, the default: the next call mixes at once).

    Returns:
        A `ShortRecurrence` of `init(params)` and `update(state, params, grads, *,
        loss=None, inplace=False) -> (params, state)`; `inplace=True` writes the new
        params into the `params` tensors as well.

    Raises:
        TypeError: `inner` lacks `init`/`update`, or an argument has the wrong type.
        ValueError: `relaxation <= 0`, `curvature_eps < 0` (or not finite), or
            `max_wait < 0`.

    `update` checks its arguments before the inner optimizer runs or anything is written,
    naming the argument: `state` (its type, and vectors that fit the params), `grads` (the
    params' pytree structure, and each leaf their shape, dtype and device: grads are neither
    broadcast nor cast, so integer, complex or differently-typed grads are a `TypeError`),
    `loss`, and `inplace` (a bool; with True, a params leaf whose elements share memory, as
    an `expand`-ed tensor's do, is a `ValueError`).
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"{_OWNER}: `inner` must be an inner optimizer with `init` and `update` "
            f"(aa.sgd, aa.adam, ...), got {type(inner).__name__}"
        )
    beta = check_float(_OWNER, "relaxation", relaxation, minimum=0.0, strict=True)
    eps = check_float(_OWNER, "curvature_eps", curvature_eps, minimum=0.0)
    drift_tol = check_float(_OWNER, "drift_tol", drift_tol, minimum=0.0, strict=True)
    config = _Config(beta, eps, drift_tol, check_int(_OWNER, "max_wait", max_wait, minimum=0))

    def update(
        state: ShortRecurrenceState,
        params: PyTree,
        grads: PyTree,
        *,
        loss: Any = None,
        inplace: bool = False,
    ) -> tuple[PyTree, ShortRecurrenceState]:
        return _update(inner, config, state, params, grads, loss, inplace)

    return ShortRecurrence(functools.partial(_init, inner, max_wait), update)

r"""Extrapolated averaging: Regularized Nonlinear Acceleration (RNA) of training snapshots.

Damien Scieur, Alexandre d'Aspremont and Francis Bach, "Regularized Nonlinear Acceleration",
NeurIPS 2016 (arXiv:1606.04133); applied to the snapshots of SGD on deep networks by Scieur,
Oyallon, d'Aspremont and Bach, "Nonlinear Acceleration of Deep Neural Networks" (2018,
arXiv:1805.09639). The base run is untouched: the method only reads snapshots of it.

**The window.** Snapshots $x_0, x_1, \dots$ are taken every `every` optimizer steps
(or whenever `RNA.snapshot()` is called, e.g. at the end of each epoch). The window holds
the last $p \le m$ (`history_depth`) pairs $(x_i, r_i)$, oldest first, where the
residual $r_i$ of snapshot $x_i$ is, as in the papers, either

* `residual="difference"`: $r_i = x_{i+1} - x_i$ (the fixed-point residual of the
  map "train for one period"), or
* `residual="gradient"`: the mean of the gradients passed to `update` between snapshots
  $x_i$ and $x_{i+1}$ (for SGD without momentum the same direction as the
  difference; the 2018 paper's choice for momentum methods is the difference).

The newest snapshot waits in `state.last` until the next one gives it a residual.

**The extrapolation**, on demand, for a regularisation $\lambda \ge 0$: with
$R = [r_0, \dots, r_{p-1}]$ and the float64 Gram $G = R^\top R$,

$$
z = \left(\frac{G}{\|G\|_2} + \lambda I\right)^{-1} \mathbf{1}, \qquad
c = \frac{z}{\mathbf{1}^\top z}, \qquad
\hat x_\lambda = \sum_{i=0}^{p-1} c_i\, x_i .
$$

$c$ minimises $\|R c\|^2 / \|G\|_2 + \lambda \|c\|^2$ over $\mathbf{1}^\top c
= 1$. The small solve is a symmetric eigen-decomposition of $G / \|G\|_2$ in float64
on the CPU (`eigh`); at $\lambda = 0$,
where $G$ may be singular, $c$ is the package's unregularised Anderson weights
([`aadl_func.solve_weights()`][aadl_func.solve_weights]' `alpha`, the same minimiser, defined for
any window). As $\lambda \to \infty$, $c \to \mathbf{1}/p$: the uniform average of the window,
which is stochastic weight averaging (SWA) over it; `lam=math.inf` gives it exactly.
`RNA.select()` chooses $\lambda$ from a grid (`LAMBDAS`, `inf` included)
by a held-out loss the caller supplies, so on that loss the choice is never worse than SWA
over the same window.

**Online variant** (the 2016 paper's online scheme): continue training *from*
$\hat x_\lambda$ and call `RNA.restart_at()` with it, so that the next residual is
measured from the extrapolated point ($r = g(\hat x) - \hat x$, the next snapshot minus
the point training restarted from) instead of across the jump. The window keeps its pairs.
The offline use (extrapolate, evaluate, keep training the base run) is the 2018 paper's for
deep networks: it never changes the base run.

**BatchNorm**: running statistics are not parameters and are not extrapolated; recompute
them for the extrapolated weights with [`recompute_bn()`][aadl_func.recompute_bn]
(`torch.optim.swa_utils.update_bn` on a module loaded with them), as SWA does.

Memory: the window holds $2m + 1$ parameter-sized buffers ($2m + 2$ with
gradient residuals), in `dtype` on `device` (default: the params'); the Gram and the
combination accumulate in float64, a block of columns at a time. `update` and
`snapshot` are pure unless `inplace=True` (then they write one ring slot in place and
cost $O(n)$); neither branches in Python on tensor values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor, nn

from aadl_func._src import grad_mode, tree
from aadl_func._src.core.lstsq import solve_weights
from aadl_func._src.exec.ops import OPS
from aadl_func._src.state import allow_weights_only
from aadl_func._src.validation import (
    check_bool,
    check_callable,
    check_choice,
    check_device,
    check_dtype,
    check_int,
    check_leaf_devices,
    check_state_type,
    float_leaves,
)

__all__ = ["LAMBDAS", "RNA", "RNAAverager", "RNAChoice", "RNAState", "recompute_bn", "rna"]

_OWNER = "rna"
Params = Any

#: The default grid of $\lambda$ for `RNA.select()` (relative to
#: $\|G\|_2$), `inf` being the uniform average (SWA over the window).
LAMBDAS = (1e-8, 1e-6, 1e-4, 1e-2, 1.0, math.inf)
_RESIDUALS = ("difference", "gradient")
_BLOCK = 1 << 18  # columns per float64 block of the Gram and the combination


class RNAState(NamedTuple):
    """State of [`rna()`][aadl_func.rna]: tensors only (`torch.save` works on it).

    Attributes:
        count: 0-d int64, `update` calls so far.
        num_snapshots: 0-d int64, snapshots taken so far.
        points: pytree like the params, each leaf with a leading dimension `history_depth`:
            the ring of snapshots $x_i$ whose residual is known.
        residuals: the same for their residuals $r_i$.
        last: pytree like the params, the newest snapshot (its residual not known yet).
        grad_sum: pytree like the params, the gradients summed since `last` (gradient
            residuals only; `()` otherwise).
        grad_count: 0-d int64, how many gradients `grad_sum` holds.
    """

    count: Tensor
    num_snapshots: Tensor
    points: Any
    residuals: Any
    last: Any
    grad_sum: Any
    grad_count: Tensor


allow_weights_only(RNAState)


class RNAChoice(NamedTuple):
    """What `RNA.select()` chose: `lam` (a float, `inf` for the uniform average),
    `weights` (`(p,)` float64, oldest first), `losses` (`{lam: held-out loss}`, one
    float per candidate; `nan` where the loss was not finite)."""

    lam: float
    weights: Tensor
    losses: dict[float, float]


class RNA(NamedTuple):
    """`state = init(params)`; `state = update(state, params, grads)` after each optimizer
    step; `state = snapshot(state, params)`; `weights(state, lam)`,
    `extrapolate(state, lam)`, `select(state, loss_fn, lambdas)`,
    `restart_at(state, params)` (the online variant)."""

    init: Callable[[Params], RNAState]
    update: Callable[..., RNAState]
    snapshot: Callable[..., RNAState]
    weights: Callable[[RNAState, float], Tensor]
    extrapolate: Callable[[RNAState, float], Params]
    select: Callable[..., tuple[Params, RNAChoice]]
    restart_at: Callable[..., RNAState]


def rna(
    history_depth: int = 10,
    *,
    every: int | None = None,
    residual: str = "difference",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> RNA:
    r"""Regularized Nonlinear Acceleration of a run's snapshots; see the module docstring for
    the equations.

    Args:
        history_depth: $m \ge 2$, the most snapshot pairs the window keeps.
        every: take a snapshot in `update` every `every` calls (`None`: only when
            `snapshot` is called, e.g. once per epoch).
        residual: `"difference"` ($x_{i+1} - x_i$) or `"gradient"` (the mean of the
            gradients given to `update` between two snapshots).
        device: where the window lives (`None`: the params' device); a GPU run can keep it
            on the CPU.
        dtype: the window's floating dtype (`None`: each leaf's own).

    The `params` (and `grads`) given to `update`, `snapshot` and `restart_at` must have the
    pytree structure and shapes of the params given to `init`, and their dtypes (devices)
    unless the window has a `dtype` (`device`) of its own, into which every leaf is cast
    (moved); otherwise a `ValueError` or, for a dtype, a `TypeError` names the leaf, raised
    before anything is written.

    Returns:
        `RNA`, the functions over an [`RNAState`][aadl_func.RNAState].
    """
    m = check_int(_OWNER, "history_depth", history_depth, 2)
    if every is not None:
        every = check_int(_OWNER, "every", every, 1)
    residual = check_choice(_OWNER, "residual", residual, _RESIDUALS)
    device = check_device(_OWNER, "device", device)
    dtype = check_dtype(_OWNER, "dtype", dtype)
    window = _Window(m, residual == "gradient", device, dtype)

    def init(params: Params) -> RNAState:
        return _init(window, params)

    def update(
        state: RNAState, params: Params, grads: Params = None, *, inplace: bool = False
    ) -> RNAState:
        """One optimizer step was taken (`params`: after it; `grads`: the gradient it
        used, required with gradient residuals). Takes a snapshot of `params` when the
        count reaches a multiple of `every`."""
        _check_state(state, window)
        check_bool(_OWNER, "inplace", inplace)
        leaves = _check_like(window, state, params, "params")
        if window.use_grads:
            state = _add_grads(window, state, grads, inplace)
        state = state._replace(count=state.count + 1)
        if every is None:
            return state
        take = torch.remainder(state.count, every) == 0
        return _take(window, state, leaves, take, inplace)

    def snapshot(state: RNAState, params: Params, *, inplace: bool = False) -> RNAState:
        """Takes a snapshot of `params` now."""
        _check_state(state, window)
        check_bool(_OWNER, "inplace", inplace)
        leaves = _check_like(window, state, params, "params")
        return _take(window, state, leaves, torch.ones((), dtype=torch.bool), inplace)

    def restart_at(state: RNAState, params: Params) -> RNAState:
        """The online variant: training continues from `params` (an extrapolation), so the
        next residual is measured from it: `last` becomes `params` and the gradient sum
        restarts. The ring keeps its pairs."""
        _check_state(state, window)
        return _restart_at(window, state, _check_like(window, state, params, "params"))

    def weights(state: RNAState, lam: float) -> Tensor:
        """The coefficients $c$ (`(p,)` float64 on the CPU, oldest first)."""
        _check_state(state, window)
        lam = _check_lambda("lam", lam)
        order = _order(state, m)
        return _coefficients(_gram(_leaves(state.residuals), order), lam)

    def extrapolate(state: RNAState, lam: float) -> Params:
        r"""$\hat x_\lambda = \sum_i c_i x_i$, a pytree like the params (leaves in the
        window's dtype and on its device)."""
        c = weights(state, lam)
        return _like(state.points, _combine(_leaves(state.points), _order(state, m), c))

    def select(
        state: RNAState, loss_fn: Callable[[Params], Any], lambdas: Sequence[float] = LAMBDAS
    ) -> tuple[Params, RNAChoice]:
        r"""The extrapolation with the lowest `loss_fn` over `lambdas` (ties: the first
        in the grid); `loss_fn(params)` returns a held-out loss (a number or a 0-d tensor).
        The window's Gram is computed once for the whole grid. Raises if no
        candidate's loss is finite."""
        _check_state(state, window)
        check_callable(_OWNER, "loss_fn", loss_fn)
        return _lowest_loss(state, loss_fn, _check_lambdas(lambdas), _order(state, m))

    return RNA(init, update, snapshot, weights, extrapolate, select, restart_at)


# -- the window's updates ----------------------------------------------------------------------
class _Window(NamedTuple):
    """What `rna`'s options fix: the ring's depth `m`, the kind of residual, and the device
    and dtype the snapshots are stored in (None: each leaf's own)."""

    m: int
    use_grads: bool
    device: torch.device | None
    dtype: torch.dtype | None

    def store(self, leaf: Tensor) -> Tensor:
        return leaf.detach().to(device=self.device or leaf.device, dtype=self.dtype or leaf.dtype)


def _init(window: _Window, params: Params) -> RNAState:
    """The empty window for `params`: `last` a copy of them, the rings and the gradient sum
    zero."""
    leaves, spec = float_leaves(_OWNER, "params", params)
    last = [window.store(x).clone() for x in leaves]
    rings = [[x.new_zeros((window.m, *x.shape)) for x in last] for _ in range(2)]
    grad_sum = optree.tree_unflatten(spec, [torch.zeros_like(x) for x in last])
    zero = torch.zeros((), dtype=torch.int64, device=last[0].device)
    return RNAState(
        count=zero,
        num_snapshots=zero.clone(),
        points=optree.tree_unflatten(spec, rings[0]),
        residuals=optree.tree_unflatten(spec, rings[1]),
        last=optree.tree_unflatten(spec, last),
        grad_sum=grad_sum if window.use_grads else (),
        grad_count=zero.clone(),
    )


def _add_grads(window: _Window, state: RNAState, grads: Params, inplace: bool) -> RNAState:
    """`grads` added to the gradient sum (gradient residuals)."""
    if grads is None:
        raise ValueError(f"{_OWNER}: `grads` is required with residual='gradient'")
    g = _check_like(window, state, grads, "grads")
    sums = _leaves(state.grad_sum)
    store = window.store
    add = (lambda s, x: s.add_(store(x))) if inplace else (lambda s, x: s + store(x))
    return state._replace(
        grad_sum=_like(state.last, [add(s, x) for s, x in zip(sums, g)]),
        grad_count=state.grad_count + 1,
    )


def _take(
    window: _Window, state: RNAState, leaves: list[Tensor], take: Tensor, inplace: bool
) -> RNAState:
    """The snapshot `x` (written only where `take`): the pair (`last`, its
    residual) enters the ring slot `(num_snapshots - 1) mod m`; `x` becomes
    `last`."""
    x = [window.store(leaf) for leaf in leaves]
    last = _leaves(state.last)
    if window.use_grads:
        n = state.grad_count.clamp(min=1).to(x[0].dtype)
        r = [s / n.to(s.device) for s in _leaves(state.grad_sum)]
    else:
        r = [a - b for a, b in zip(x, last)]
    take = take.to(last[0].device)
    pair = take & (state.num_snapshots > 0)
    slot = torch.remainder(state.num_snapshots - 1, window.m).view(1)
    points = _write_slot(_leaves(state.points), slot, last, pair, inplace)
    residuals = _write_slot(_leaves(state.residuals), slot, r, pair, inplace)
    new_last = _select(take, x, last, inplace)
    grad_sum = state.grad_sum
    if window.use_grads:
        zeros = [torch.zeros_like(s) for s in _leaves(grad_sum)]
        grad_sum = _like(state.last, _select(take, zeros, _leaves(grad_sum), inplace))
    return state._replace(
        num_snapshots=state.num_snapshots + take.long(),
        points=_like(state.points, points),
        residuals=_like(state.residuals, residuals),
        last=_like(state.last, new_last),
        grad_sum=grad_sum,
        grad_count=torch.where(take, torch.zeros_like(state.grad_count), state.grad_count),
    )


def _restart_at(window: _Window, state: RNAState, leaves: list[Tensor]) -> RNAState:
    """`last` set to `leaves`, the gradient sum restarted; the ring kept."""
    grad_sum = state.grad_sum
    if window.use_grads:
        grad_sum = _like(state.last, [torch.zeros_like(s) for s in _leaves(grad_sum)])
    last = _like(state.last, [window.store(x).clone() for x in leaves])
    return state._replace(
        last=last, grad_sum=grad_sum, grad_count=torch.zeros_like(state.grad_count)
    )


def _lowest_loss(
    state: RNAState, loss_fn: Callable[[Params], Any], grid: tuple[float, ...], order: list[int]
) -> tuple[Params, RNAChoice]:
    """`select`'s search: the extrapolation of each `lam` of `grid` from one Gram, and the
    first with the lowest finite `loss_fn`."""
    gram = _gram(_leaves(state.residuals), order)
    points = _leaves(state.points)
    best, losses = None, {}
    for lam in grid:
        c = _coefficients(gram, lam)
        candidate = _like(state.points, _combine(points, order, c))
        value = float(loss_fn(candidate))
        losses[lam] = value if math.isfinite(value) else math.nan
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, lam, c, candidate)
    if best is None:
        raise FloatingPointError(
            f"{_OWNER}: `loss_fn` was not finite at any extrapolation (lambdas {grid})"
        )
    return best[3], RNAChoice(best[1], best[2], losses)


# -- the solve -------------------------------------------------------------------------------
def _coefficients(gram: Tensor, lam: float) -> Tensor:
    r"""`c` from the float64 Gram `G` (`p x p`) and `lam`.

    * `lam > 0`: the eigen-decomposition $G / \|G\|_2 = V \operatorname{diag}(w)
      V^\top$ gives $z = V \operatorname{diag}(1 / (w + \lambda)) V^\top \mathbf{1}$,
      normalised to sum to one ($w + \lambda \ge \lambda > 0$: nothing to drop);
    * `lam = 0`: the minimiser of $\|R c\|$ over $\mathbf{1}^\top c = 1$, the
      package's unregularised Anderson weights
      ([`aadl_func.solve_weights()`][aadl_func.solve_weights]' `alpha`), which stays defined when
      $G$ is singular (where $G^{-1}\mathbf{1}$ is not);
    * `lam = inf`, a zero or non-finite window, or a degenerate sum: the uniform
      $\mathbf{1} / p$.
    """
    p = gram.shape[0]
    uniform = torch.full((p,), 1.0 / p, dtype=torch.float64)
    if math.isinf(lam) or p == 1 or not torch.isfinite(gram).all():
        return uniform
    if lam == 0:
        weights = solve_weights(gram, p, ops=OPS)
        return weights.alpha if bool(weights.ok) else uniform
    w, v = torch.linalg.eigh(gram)
    top = w.max()
    if not top > 0:
        return uniform
    # G / ||G||_2: the Gram is positive semidefinite, its 2-norm its largest eigenvalue.
    shifted = (w / top).clamp(min=0.0) + lam
    z = v @ ((v.T @ torch.ones(p, dtype=torch.float64)) / shifted)
    total = z.sum()
    if not (torch.isfinite(total) and total.abs() > 0):
        return uniform
    return z / total


def _gram(residuals: list[Tensor], order: list[int]) -> Tensor:
    """`R^T R` (`p x p`, float64 on the CPU) of the ring rows `order`, a block of
    columns at a time."""
    index = torch.tensor(order, dtype=torch.long)
    total = torch.zeros(len(order), len(order), dtype=torch.float64)
    for leaf in residuals:
        rows = leaf.index_select(0, index.to(leaf.device)).reshape(len(order), -1)
        for start in range(0, rows.shape[1], _BLOCK):
            block = rows[:, start : start + _BLOCK].to(torch.float64)
            total += (block @ block.T).cpu()
    return total


def _combine(points: list[Tensor], order: list[int], c: Tensor) -> list[Tensor]:
    """`sum_i c_i points[order[i]]` per leaf, accumulated in float64 a block at a time,
    returned in the window's dtype."""
    index = torch.tensor(order, dtype=torch.long)
    out = []
    for leaf in points:
        rows = leaf.index_select(0, index.to(leaf.device)).reshape(len(order), -1)
        coeffs = c.to(device=leaf.device)
        flat = torch.empty(rows.shape[1], dtype=leaf.dtype, device=leaf.device)
        for start in range(0, rows.shape[1], _BLOCK):
            block = rows[:, start : start + _BLOCK].to(torch.float64)
            flat[start : start + _BLOCK] = (coeffs @ block).to(leaf.dtype)
        out.append(flat.reshape(leaf.shape[1:]))
    return out


def _order(state: RNAState, m: int) -> list[int]:
    """Ring slots of the valid pairs, oldest first. Raises if there is none yet."""
    taken = int(state.num_snapshots)
    pairs = min(taken - 1, m)
    if pairs < 1:
        raise ValueError(
            f"{_OWNER}: the window holds no snapshot pair yet ({taken} snapshot(s) taken; "
            "an extrapolation needs at least 2)"
        )
    newest = taken - 2
    return [(newest - pairs + 1 + j) % m for j in range(pairs)]


# -- helpers ---------------------------------------------------------------------------------
def _leaves(tree: Any) -> list[Tensor]:
    return optree.tree_leaves(tree)


def _like(tree: Any, leaves: list[Tensor]) -> Any:
    return optree.tree_unflatten(optree.tree_structure(tree), leaves)


def _write_slot(
    ring: list[Tensor], slot: Tensor, rows: list[Tensor], mask: Tensor, inplace: bool
) -> list[Tensor]:
    """Ring row `slot` set to `rows` where `mask` (one row read and written)."""
    out = []
    for leaf, row in zip(ring, rows):
        index = slot.to(leaf.device)
        old = leaf.index_select(0, index)
        new = torch.where(mask.to(leaf.device), row.unsqueeze(0).to(leaf.dtype), old)
        out.append(leaf.index_copy_(0, index, new) if inplace else leaf.index_copy(0, index, new))
    return out


def _select(mask: Tensor, new: list[Tensor], old: list[Tensor], inplace: bool) -> list[Tensor]:
    if inplace:
        return [o.copy_(torch.where(mask.to(o.device), n, o)) for n, o in zip(new, old)]
    return [torch.where(mask.to(o.device), n, o) for n, o in zip(new, old)]


def _check_state(state: Any, window: _Window) -> None:
    check_state_type("rna", state, RNAState, "state", _OWNER)
    ring = _leaves(state.points)
    if not ring or ring[0].shape[0] != window.m:
        raise ValueError(
            f"{_OWNER}: `state` was made with another history_depth (expected {window.m} slots)"
        )
    if window.use_grads != (state.grad_sum != ()):
        raise ValueError(f"{_OWNER}: `state` was made with another `residual`")


def _check_like(window: _Window, state: RNAState, value: Any, name: str) -> list[Tensor]:
    """`value`'s leaves, checked against `state.last` (laid out as the params given to `init`)
    before anything is written: pytree structure and shapes, and, where the window keeps
    each leaf's own dtype or device (`dtype` or `device` None), dtypes or devices (a leaf
    of another would pass it to `last` but not to the rings)."""
    leaves, spec = float_leaves(_OWNER, name, value)
    last, ref = optree.tree_flatten(state.last)
    tree.check_like(name, leaves, spec, last, ref, "state.last", window.dtype is None, _OWNER)
    if window.device is None:
        check_leaf_devices(_OWNER, name, leaves, [x.device for x in last], "like state.last", spec)
    return leaves


def _check_lambda(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_OWNER}: `{name}` must be a real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{_OWNER}: `{name}` must be >= 0 (inf allowed), got {value}")
    return value


def _check_lambdas(values: Any) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{_OWNER}: `lambdas` must be a sequence of numbers >= 0")
    grid = tuple(_check_lambda("lambdas", v) for v in values)
    if not grid:
        raise ValueError(f"{_OWNER}: `lambdas` must not be empty")
    return grid


# -- BatchNorm and the torch.optim face -------------------------------------------------------
def recompute_bn(
    loader: Iterable[Any],
    module: nn.Module,
    params: dict[str, Tensor] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """BatchNorm running statistics for `params` (`{name: tensor}` as
    `nn.Module.named_parameters()` names them; `None`: the module's own), computed by
    `torch.optim.swa_utils.update_bn(loader, module, device)` after copying `params` into
    `module` (which must hold real tensors, not `meta` ones). Returns the module's buffers
    (`{name: tensor}`), ready for `torch.func.functional_call(module, (params, buffers),
    ...)`.

    Each value of `params` is copied as `load_state_dict` copies it: of the param's shape
    (never broadcast), cast to its dtype (an extrapolation in the window's dtype loads into a
    module of another), and copied to its device. Every entry is checked before the first
    copy, so a bad one leaves the module as it was.

    Raises:
      TypeError: `params` is not a dict, or a value is not a floating-point tensor holding
        values (an integer tensor, a `meta` one).
      ValueError: a name the module's parameters lack, or a value of another shape.
    """
    from torch.optim.swa_utils import update_bn

    _copy_all(_checked_pairs(module, {} if params is None else params))
    update_bn(loader, module, device=device)
    return dict(module.named_buffers())


def _checked_pairs(module: nn.Module, params: Any) -> list[tuple[Tensor, Tensor]]:
    """`(module's param, value)` per entry of `params`, every one checked before the first
    copy. As in `load_state_dict`, a value has the param's shape and is cast to its dtype and
    copied to its device; it is never broadcast, and must be floating (not an integer) and
    hold values (not on the meta device)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"recompute_bn: `params` must be a dict, got {type(params).__name__}")
    own = dict(module.named_parameters())
    if unknown := sorted(params.keys() - own.keys(), key=str):
        raise ValueError(f"recompute_bn: `params` has names the module lacks: {unknown}")
    for name, value in params.items():
        where, shape = f"recompute_bn: `params[{name!r}]`", tuple(own[name].shape)
        if not (isinstance(value, Tensor) and value.is_floating_point() and not value.is_meta):
            got = f"{value.dtype} on {value.device}" if isinstance(value, Tensor) else type(value)
            raise TypeError(f"{where} must be a floating-point tensor with values, got {got}")
        if value.shape != shape:
            raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {shape}")
    return [(own[name], value) for name, value in params.items()]


def _copy_all(pairs: Iterable[tuple[Tensor, Tensor]]) -> None:
    """Each `(target, value)`: `target.copy_(value)`, recording no graph, with torch's grad
    mode put back however it ends (`grad_mode.kept`)."""

    def run() -> None:
        for target, value in pairs:
            target.copy_(value)

    grad_mode.kept(run)


class RNAAverager:
    """RNA for `torch.optim` users: the window of [`rna()`][aadl_func.rna] over a module's (or a
    list of) parameters.

    `snapshot()` after an epoch (or `step()` after each `optimizer.step()` with
    `every`); `extrapolate(held_out_loss)` loads the extrapolation with the lowest
    `held_out_loss()` (called with the candidate loaded) over `lambdas` and returns the
    [`RNAChoice`][aadl_func.RNAChoice]; `load=False` puts the parameters (and buffers) back
    afterwards. `bn_loader`: recompute BatchNorm statistics
    ([`recompute_bn()`][aadl_func.recompute_bn]) for every candidate before its loss. `online=True`:
    training continues from the extrapolation (the online variant; see [`rna()`][aadl_func.rna]).
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Tensor],
        history_depth: int = 10,
        *,
        every: int | None = None,
        residual: str = "difference",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.module = params if isinstance(params, nn.Module) else None
        self.params = list(params.parameters() if self.module is not None else params)
        if not self.params:
            raise ValueError("RNAAverager: `params` is empty")
        self.rna = rna(history_depth, every=every, residual=residual, device=device, dtype=dtype)
        self.gradient = residual == "gradient"
        self.state = self.rna.init(self._values())

    def _values(self) -> list[Tensor]:
        return [p.detach() for p in self.params]

    def step(self) -> None:
        """After `optimizer.step()`: counts the step (snapshot every `every`) and, with
        gradient residuals, adds the parameters' `.grad`."""
        grads = None
        if self.gradient:
            missing = [i for i, p in enumerate(self.params) if p.grad is None]
            if missing:
                raise ValueError(f"RNAAverager.step: parameters {missing} have no .grad")
            grads = [p.grad.detach() for p in self.params]
        self.state = self.rna.update(self.state, self._values(), grads, inplace=True)

    def snapshot(self) -> None:
        """Takes a snapshot of the parameters now."""
        self.state = self.rna.snapshot(self.state, self._values(), inplace=True)

    def _load(self, values: Sequence[Tensor]) -> None:
        _copy_all(zip(self.params, values))

    def extrapolate(
        self,
        held_out_loss: Callable[[], Any] | None = None,
        lambdas: Sequence[float] = LAMBDAS,
        *,
        load: bool = True,
        bn_loader: Iterable[Any] | None = None,
        online: bool = False,
    ) -> RNAChoice:
        """Chooses $\\lambda$ by `held_out_loss()` (`None`: the first of
        `lambdas`, no evaluation) and loads the extrapolation (`load`)."""
        check_bool("RNAAverager", "load", load)
        check_bool("RNAAverager", "online", online)
        if bn_loader is not None and self.module is None:
            raise ValueError("RNAAverager: `bn_loader` needs the averager built on a module")
        if online and not load:
            raise ValueError("RNAAverager: `online=True` continues from the extrapolation, so "
                             "it needs `load=True`")  # fmt: skip
        if held_out_loss is not None:
            check_callable("RNAAverager", "held_out_loss", held_out_loss)
        saved = [p.detach().clone() for p in self.params]
        buffers = self._buffers()

        def loss_fn(candidate: list[Tensor]) -> Any:
            self._load(candidate)
            if bn_loader is not None:
                recompute_bn(bn_loader, self.module)
            return held_out_loss()

        try:
            if held_out_loss is None:
                grid = _check_lambdas(lambdas)
                best = self.rna.extrapolate(self.state, grid[0])
                choice = RNAChoice(grid[0], self.rna.weights(self.state, grid[0]), {})
            else:
                best, choice = self.rna.select(self.state, loss_fn, lambdas)
        except BaseException:
            self._restore(saved, buffers)
            raise
        if not load:
            self._restore(saved, buffers)
            return choice
        self._load(best)
        if bn_loader is not None:
            recompute_bn(bn_loader, self.module)
        if online:
            self.state = self.rna.restart_at(self.state, self._values())
        return choice

    def _buffers(self) -> dict[str, Tensor]:
        if self.module is None:
            return {}
        return {k: b.detach().clone() for k, b in self.module.named_buffers()}

    def _restore(self, saved: list[Tensor], buffers: dict[str, Tensor]) -> None:
        self._load(saved)
        if buffers:
            own = dict(self.module.named_buffers())
            _copy_all((own[k], b) for k, b in buffers.items())

r"""An L-BFGS inner transformation: the direction $-H_k \nabla f(x_k)$ without a line search.

[`lbfgs()`][aadl_func.lbfgs] follows optax's `scale_by_lbfgs` in the torchopt protocol of
`aadl_func._src.inner`: it keeps a ring of the last `memory_size` curvature pairs, made from
the params and gradients the transformation sees, and returns $-\mathrm{lr}\, H_k g_k$ by the
two-loop recursion. Under [`aadl_func.anderson()`][aadl_func.anderson] the params it sees are
sometimes mixes, not its own steps; the pair from a mix is still a secant pair of the same
gradient, so it is kept when it passes the curvature test.

The vectors are handled flat, as `torch.optim.LBFGS` does: the leaves are concatenated into
one vector of their promoted dtype, so an inner product is one `dot` over every leaf and the
recursion runs `2 memory_size` vector operations whatever the number of leaves.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.inner import InnerOptimizer, check_update_shapes, holds_updates
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

__all__ = ["LbfgsState", "lbfgs"]

PyTree = Any


class LbfgsState(NamedTuple):
    r"""State of [`lbfgs()`][aadl_func.lbfgs]; $N$ is the number of parameter entries.

    Attributes:
        count: 0-d `int64` tensor, the number of updates done so far.
        num_pairs: 0-d `int64` tensor, the number of curvature pairs stored so far (pairs
            that failed the curvature test are not counted); the next one goes to slot
            `num_pairs % memory_size`.
        gamma: 0-d `float64` tensor, the initial inverse-Hessian scale
            $\gamma = s^\top y / y^\top y$ of the newest stored pair (1 before any, and always
            1 with `scale_init_precond=False`).
        rho: `float64` tensor of shape `(memory_size,)`, $1 / s_i^\top y_i$ per slot (0 in a
            slot never written, which makes that slot a no-op in the recursion).
        s_memory: `(memory_size, N)` tensor, the steps $s_i = x_{i+1} - x_i$ by slot.
        y_memory: `(memory_size, N)` tensor, the gradient changes $y_i = g_{i+1} - g_i$.
        params: `(N,)` tensor, the params of the previous update, flattened.
        grads: `(N,)` tensor, the gradients of the previous update, flattened.
    """

    count: Tensor
    num_pairs: Tensor
    gamma: Tensor
    rho: Tensor
    s_memory: Tensor
    y_memory: Tensor
    params: Tensor
    grads: Tensor


allow_weights_only(LbfgsState)


def _flat(leaves: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The leaves as one new `dtype` vector (`cat` copies, so it never aliases a leaf)."""
    if not leaves:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([leaf.reshape(-1).to(dtype) for leaf in leaves])


def _unflat(flat: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    """`flat` cut into tensors shaped and typed like `leaves`."""
    pieces = torch.split(flat, [leaf.numel() for leaf in leaves])
    return [p.reshape(leaf.shape).to(leaf.dtype) for p, leaf in zip(pieces, leaves)]


def _compute_dtype(fn: str, leaves: list[Tensor]) -> torch.dtype:
    """The promoted dtype of the leaves, which must be real floating point on one device."""
    for leaf in leaves:
        if not leaf.is_floating_point():
            raise TypeError(f"{fn}: `params` must be real floating-point tensors, got {leaf.dtype}")
        if leaf.device != leaves[0].device:
            raise ValueError(
                f"{fn}: `params` must be on one device, got {leaf.device} and {leaves[0].device}"
            )
    dtypes = [leaf.dtype for leaf in leaves] or [torch.get_default_dtype()]
    return functools.reduce(torch.promote_types, dtypes)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    r"""$a^\top b$ as a float64 0-d tensor."""
    return torch.dot(a, b).to(torch.float64)


def two_loop(
    grad: Tensor, s_memory: Tensor, y_memory: Tensor, rho: Tensor, gamma: Tensor, order: Tensor
) -> Tensor:
    r"""$H g$ by the two-loop recursion (Nocedal & Wright, Algorithm 7.4).

    With the pairs taken newest first ($j = 0, \dots, m - 1$, slots `order`):

    $$
    q &\leftarrow g; \quad \alpha_j = \rho_j s_j^\top q, \quad q \leftarrow q - \alpha_j y_j
        \quad (j = 0, \dots, m - 1) \\
    r &\leftarrow \gamma q; \quad \beta_j = \rho_j y_j^\top r, \quad
        r \leftarrow r + (\alpha_j - \beta_j) s_j \quad (j = m - 1, \dots, 0)
    $$

    A slot with $\rho_j = 0$ (never written) leaves $q$ and $r$ as they are, so the
    recursion needs no count of the stored pairs.
    """
    s = s_memory.index_select(0, order)
    y = y_memory.index_select(0, order)
    rho = rho.index_select(0, order)
    q, alphas = grad, []
    for j in range(s.shape[0]):
        alpha = rho[j] * _dot(s[j], q)
        q = q - alpha.to(q.dtype) * y[j]
        alphas.append(alpha)
    r = gamma.to(q.dtype) * q
    for j in reversed(range(s.shape[0])):
        beta = rho[j] * _dot(y[j], r)
        r = r + (alphas[j] - beta).to(r.dtype) * s[j]
    return r


class _Pair(NamedTuple):
    """The curvature pair of one update and whether it is stored."""

    s: Tensor
    y: Tensor
    rho: Tensor
    gamma: Tensor
    accept: Tensor


def _new_pair(state: LbfgsState, x: Tensor, g: Tensor, eps: float, scale: bool) -> _Pair:
    r"""$s = x - x_{prev}$, $y = g - g_{prev}$, stored iff this is not the first update, both
    inner products are finite and $s^\top y > \epsilon\, y^\top y$ (which keeps $H$ positive
    definite). The values of a rejected pair are replaced by finite ones, so that no branch
    of a `where` computes a non-finite number."""
    s, y = x - state.params, g - state.grads
    sy, yy = _dot(s, y), _dot(y, y)
    accept = (state.count > 0) & torch.isfinite(sy) & torch.isfinite(yy) & (sy > eps * yy)
    one = torch.ones_like(sy)
    sy, yy = torch.where(accept, sy, one), torch.where(accept, yy, one)
    gamma = torch.where(accept, sy / yy, state.gamma) if scale else state.gamma
    return _Pair(s, y, 1.0 / sy, gamma, accept)


def _store(state: LbfgsState, pair: _Pair, x: Tensor, g: Tensor, inplace: bool) -> LbfgsState:
    """The state with the pair written to slot `num_pairs % memory_size` if it is accepted,
    and `x`, `g` as the previous params and gradients. In place, the state's buffers are
    written; otherwise new ones are made."""
    memory_size = state.rho.shape[0]
    slot = (state.num_pairs % memory_size).reshape(1)
    s_row = torch.where(pair.accept, pair.s, state.s_memory.index_select(0, slot)[0])
    y_row = torch.where(pair.accept, pair.y, state.y_memory.index_select(0, slot)[0])
    rho = torch.where(pair.accept, pair.rho, state.rho.index_select(0, slot)[0])
    # Under vmap `index_copy_` has no batching rule (a slow per-member fallback): the
    # out-of-place write there, which `inplace` allows ("may" overwrite).
    if inplace and not tree.is_transformed(state.s_memory):
        s_memory = state.s_memory.index_copy_(0, slot, s_row.unsqueeze(0))
        y_memory = state.y_memory.index_copy_(0, slot, y_row.unsqueeze(0))
        rhos = state.rho.index_copy_(0, slot, rho.reshape(1))
        params, grads = state.params.copy_(x), state.grads.copy_(g)
    else:
        s_memory = state.s_memory.index_copy(0, slot, s_row.unsqueeze(0))
        y_memory = state.y_memory.index_copy(0, slot, y_row.unsqueeze(0))
        rhos = state.rho.index_copy(0, slot, rho.reshape(1))
        params, grads = x, g
    return LbfgsState(
        state.count + 1,
        state.num_pairs + pair.accept.to(torch.int64),
        pair.gamma,
        rhos,
        s_memory,
        y_memory,
        params,
        grads,
    )


def _init(params: PyTree, memory_size: int) -> LbfgsState:
    r"""The state before any update: no pair, $\gamma = 1$, zero buffers like the params."""
    leaves, _ = tree.flatten(params, "params", owner="lbfgs")
    x = _flat(leaves, _compute_dtype("lbfgs", leaves))
    if leaves:
        x = x.to(leaves[0].device)
    count = x.new_zeros((), dtype=torch.int64)
    ring = x.new_zeros((memory_size, x.shape[0]))
    return LbfgsState(
        count,
        count.clone(),
        x.new_ones((), dtype=torch.float64),
        x.new_zeros((memory_size,), dtype=torch.float64),
        ring,
        ring.clone(),
        torch.zeros_like(x),
        torch.zeros_like(x),
    )


def _check_grads(grads: list[Tensor], params: list[Any], spec: Any) -> None:
    """Each gradient leaf fits its params leaf (a tensor): same shape, real floating point
    (an integer one would be truncated, a complex one lose its imaginary part) and same
    device. Checked before any buffer is written: a leaf of another shape would broadcast
    or fail after the state was written, and one of the same size would be returned in its
    own shape. Metadata only."""
    fn = "lbfgs"
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            where = tree.leaf_path(spec, i, "params")
            raise TypeError(
                f"{fn}: `params` must be a pytree of tensors; `{where}` is {type(p).__name__}"
            )
    check_update_shapes(fn, grads, spec, ["params"], [params])
    for i, g in enumerate(grads):
        if not g.is_floating_point():
            where, like = tree.leaf_path(spec, i, "updates"), tree.leaf_path(spec, i, "params")
            raise TypeError(
                f"{fn}: `{where}` must be real floating-point like `{like}`, got {g.dtype}"
            )
    check_devices_like(fn, "updates", grads, spec, params)


def _check_state(
    memory_size: int, state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str
) -> None:
    """`state` is an `LbfgsState` whose buffers fit `memory_size` and the params `leaves`."""
    check_state_type("lbfgs", state, LbfgsState, name, owner)
    n = sum(leaf.numel() for leaf in leaves)
    dtype = _compute_dtype(owner, leaves)
    expected = {"s_memory": (memory_size, n), "y_memory": (memory_size, n)}
    expected.update(params=(n,), grads=(n,))
    hint = "was it made by another configuration or for other params?"
    check_field_shapes(owner, state, name, expected, dtype, hint)


def lbfgs(
    lr: float = 1.0,
    memory_size: int = 10,
    scale_init_precond: bool = True,
    curvature_eps: float = 1e-10,
) -> InnerOptimizer:
    r"""L-BFGS's direction as an inner optimizer, without a line search (optax's
    `scale_by_lbfgs` then a fixed learning rate).

    Update $k = 0, 1, \dots$ at params $x_k$ with gradient $g_k$ first forms the pair
    $s = x_k - x_{k-1}$, $y = g_k - g_{k-1}$ (from the previous update's params and
    gradients, whatever moved the params in between: under
    [`aadl_func.anderson()`][aadl_func.anderson] a mix) and stores it, over the oldest of the
    last `memory_size` stored pairs, if

    $$
    s^\top y > \epsilon \, y^\top y ,
    $$

    the curvature condition that keeps $H_k$ positive definite (a pair that fails it is
    dropped and evicts nothing). Then it returns

    $$
    \Delta_k = -\mathrm{lr}\, H_k g_k, \qquad H_k^0 = \gamma I, \quad
    \gamma = \frac{s^\top y}{y^\top y} \text{ of the newest stored pair}
    $$

    with $H_k g_k$ by the two-loop recursion over the stored pairs. The first update (no
    pair yet) is the gradient step $-\mathrm{lr}\, g_0$. On a strictly convex quadratic with
    exact pairs and `memory_size` at least the dimension, $H_k$ is BFGS's inverse-Hessian
    approximation, which satisfies $H_k y_i = s_i$ for the stored pairs.

    The inner products sum over all leaves, in the leaves' promoted dtype, then in float64;
    the decisions use `torch.where`, not Python branches on values, so `update` runs under
    `torch.func.vmap()` (each member with its own pairs). The state holds
    $2\,\mathrm{memory\_size} + 2$ parameter-sized vectors.

    Args:
        lr: the step length $\mathrm{lr} > 0$ along $-H_k g_k$ (1 is the quasi-Newton step).
        memory_size: the number of pairs kept, $\ge 1$.
        scale_init_precond: scale $H_k^0$ by $\gamma$ (otherwise $H_k^0 = I$).
        curvature_eps: $\epsilon \ge 0$ of the curvature condition.

    Returns:
        An `InnerOptimizer` whose state is an `LbfgsState`; `update` requires `params`.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: `lr <= 0`, `memory_size < 1` or `curvature_eps < 0` (or not finite).
    """
    fn = "lbfgs"
    lr = check_float(fn, "lr", lr, minimum=0.0, strict=True)
    memory_size = check_int(fn, "memory_size", memory_size, minimum=1)
    if not isinstance(scale_init_precond, bool):
        raise TypeError(f"{fn}: `scale_init_precond` must be a bool, got {scale_init_precond!r}")
    eps = check_float(fn, "curvature_eps", curvature_eps, minimum=0.0)

    def init(params: PyTree) -> LbfgsState:
        return _init(params, memory_size)

    def update(
        updates: PyTree, state: LbfgsState, params: PyTree | None = None, inplace: bool = True
    ) -> tuple[PyTree, LbfgsState]:
        check_state_type(fn, state, LbfgsState, "state", fn)
        check_bool(fn, "inplace", inplace)
        g_leaves, spec = tree.flatten(updates, "updates", owner=fn)
        if params is None:
            raise ValueError(f"{fn}: `params` are required (the pairs are made from them)")
        p_leaves = flatten_like(fn, "params", params, spec)
        # Before any write: grads that do not fit the params, and a state made for another
        # memory or other params, are refused whole.
        _check_grads(g_leaves, p_leaves, spec)
        _check_state(memory_size, state, p_leaves, spec, name="state", owner=fn)
        dtype = state.s_memory.dtype
        x, g = _flat(p_leaves, dtype), _flat(g_leaves, dtype)
        pair = _new_pair(state, x, g, eps, scale_init_precond)
        new_state = _store(state, pair, x, g, inplace)
        order = (new_state.num_pairs - 1 - torch.arange(memory_size, device=x.device)) % memory_size
        direction = two_loop(
            g, new_state.s_memory, new_state.y_memory, new_state.rho, new_state.gamma, order
        )
        steps = _unflat(direction * -lr, g_leaves)
        if inplace:  # torchopt's semantics: the gradient buffers hold the returned updates
            # (where they can: an expanded one is left alone, its update is the new tensor)
            steps = [u.copy_(s) if holds_updates(u) else s for u, s in zip(g_leaves, steps)]
        return optree.tree_unflatten(spec, steps), new_state

    update.check_state = functools.partial(_check_state, memory_size)  # type: ignore[attr-defined]
    # It writes state buffers in place: anderson then asks for it out of place where an
    # exception must leave the state as it was, and adopts the new buffers.
    update.writes_state = True  # type: ignore[attr-defined]
    return InnerOptimizer(init=init, update=update)

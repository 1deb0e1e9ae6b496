r"""AdaSAM: stochastic Anderson mixing with damped projection and adaptive regularisation.

Fuchao Wei, Chenglong Bao and Yang Liu, "Stochastic Anderson Mixing for Nonconvex Stochastic
Optimization", NeurIPS 2021 (arXiv:2110.01543). The method, for a (stochastic) gradient
$g_k = \nabla f_{S_k}(x_k)$ and the residual $r_k = -(g_k + \lambda x_k)$
($\lambda$: weight decay), step $k = 0, 1, \dots$:

1. **Moving averages of the differences** (for $k \ge 1$):

   $$
   \overline{\Delta x}_k &= \gamma\, \overline{\Delta x}_{k-1}
       + (1 - \gamma)(x_k - x_{k-1}), \\
   \overline{\Delta r}_k &= \gamma\, \overline{\Delta r}_{k-1}
       + (1 - \gamma)(r_k - r_{k-1}),
   $$

   starting from zero. They become the newest columns of $X_k$ and $R_k$, which
   hold the last $m$ (`history_depth`) of them (unfilled columns are zero).

2. **Adaptive regularisation**:
   $\delta_k = c\, \|r_k\|^2 / (\|\overline{\Delta x}_k\|^2 + \epsilon)$.

3. **Coefficients** of the regularised least-squares problem
   $\min_\Gamma \|r_k - R_k \Gamma\|^2 + \delta_k \|X_k \Gamma\|^2$:

   $$
          \Gamma_k = (R_k^T R_k + \delta_k X_k^T X_k)^{+} R_k^T r_k
   $$

   (pseudo-inverse in float64: the unfilled zero columns get zero coefficients).

4. **Damped projection and mixing**:
   $\bar x_k = x_k - \alpha X_k \Gamma_k$, $\bar r_k = r_k - \alpha R_k \Gamma_k$,
   $x_{k+1} = \bar x_k + \beta \bar r_k$, i.e. the step

   $$
          p_k = \beta r_k - \alpha (X_k + \beta R_k) \Gamma_k .
   $$

5. **Positive-definiteness (descent) check**: $x_{k+1} = x_k + p_k$ only if
   $\langle p_k, r_k \rangle > \mu \beta \|r_k\|^2$ (the step is a descent direction
   for the sampled loss); otherwise, and on the first step, the plain step
   $x_{k+1} = x_k + \beta r_k$ (SGD with learning rate $\beta$). There is no
   loss-based acceptance.

The paper requires the matrix $H_k$ of $p_k = H_k r_k$ to be positive definite
and checks it through $\langle p_k, r_k \rangle$; the authors' reference code
(`optim/adasam.py` of github.com/wfc12/Stochastic_Anderson_Mixing) uses the simplified test
$\langle p_k, r_k \rangle > 0$, which is `mu=0` here (the default). The defaults
($\alpha = \beta = 1$, $m = 10$, $c = 10^{-2}$, $\gamma = 0.9$,
$\epsilon = 10^{-8}$) are that implementation's. The paper's preconditioned variant
(pAdaSAM) and its variance-reduced variant (AdaSAM-VR) are not implemented.

Functional like the rest of the package: `state = init(params)`,
`params, state = update(state, params, grads)`, pure (inputs are never mutated). The state
is an `AdaSAMState` of tensors only, with no Python branching on tensor values, so
`init` and `update` run under `torch.func.vmap()` (an ensemble) and the state saves
with `torch.save()`. The window costs $2m + 4$ parameter-sized buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.state import allow_weights_only
from aadl_func._src.validation import (
    check_counter,
    check_devices_like,
    check_float,
    check_int,
    float_leaves,
    same_device,
)

__all__ = ["AdaSAM", "AdaSAMState", "adasam"]

_OWNER = "adasam"
Params = Any


class AdaSAMState(NamedTuple):
    """State of [`adasam()`][aadl_func.adasam]: tensors only (`vmap` and `torch.save` work on it).

    Attributes:
        count: 0-d int64, `update` calls so far ($k$).
        prev_params: pytree like the params, $x_{k-1}$ (zeros at `init`).
        prev_residual: pytree like the params, $r_{k-1}$ (zeros at `init`).
        dx_avg: pytree like the params, $\\overline{\\Delta x}_{k-1}$.
        dr_avg: pytree like the params, $\\overline{\\Delta r}_{k-1}$.
        dxs: pytree like the params, each leaf with a leading dimension `history_depth`:
            the ring of averaged iterate differences (columns of $X$).
        drs: the same for the averaged residual differences (columns of $R$).
        num_mixed: 0-d int64, steps that took the mixed step $p_k$.
        num_fallback: 0-d int64, steps after the first whose descent check failed (the plain
            step $\\beta r_k$ was taken).
    """

    count: Tensor
    prev_params: Any
    prev_residual: Any
    dx_avg: Any
    dr_avg: Any
    dxs: Any
    drs: Any
    num_mixed: Tensor
    num_fallback: Tensor


allow_weights_only(AdaSAMState)


class AdaSAM(NamedTuple):
    """`state = init(params)`; `params, state = update(state, params, grads)`."""

    init: Callable[[Params], AdaSAMState]
    update: Callable[..., tuple[Params, AdaSAMState]]


def adasam(
    lr: float = 1.0,
    *,
    alpha: float = 1.0,
    history_depth: int = 10,
    damp: float = 1e-2,
    gamma: float = 0.9,
    mu: float = 0.0,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> AdaSAM:
    r"""AdaSAM (Wei, Bao and Liu, NeurIPS 2021) as a functional optimizer; see the module
    docstring for the equations.

    Args:
        lr: the mixing parameter $\beta > 0$, the step length along the residual: the
            plain (fallback) step is SGD with learning rate `lr`.
        alpha: the damping $\alpha \ge 0$ of the projection (0: plain SGD).
        history_depth: $m \ge 1$, the columns of $X$ and $R$.
        damp: $c \ge 0$ of the adaptive regularisation
            $\delta_k = c \|r_k\|^2 / (\|\overline{\Delta x}_k\|^2 + \epsilon)$.
        gamma: $\gamma \in [0, 1)$, the moving-average weight of the differences
            (0: the raw differences, as in classic Anderson mixing).
        mu: $\mu \ge 0$ of the descent check
            $\langle p_k, r_k \rangle > \mu \beta \|r_k\|^2$.
        eps: $\epsilon > 0$ in $\delta_k$'s denominator.
        weight_decay: $\lambda \ge 0$, added to the gradient (`r = -(g + lambda x)`).

    Returns:
        An `AdaSAM` `(init, update)`. `update(state, params, grads)` returns the new
        params and an `AdaSAMState`; it never mutates its inputs.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range, naming it (at
            construction); at `update`, before anything is computed: a `state` that is not
            an `AdaSAMState` (with 0-d int64 counters) or was made for params of another
            structure, shape, dtype or device or another `history_depth`, and `grads` whose
            pytree structure, shapes, dtypes or devices differ from `params`' (grads are not
            cast: float64 grads for float32 params are refused with a `TypeError`).

    Non-finite numbers: a NaN or infinite gradient (or params) makes the least-squares
    system non-finite; it is not solved (no `linalg` error), and the call takes the plain
    step $x_k + \beta r_k$, which carries the NaN into the returned
    params exactly as SGD with learning rate `lr` would; the mixed step is taken only when
    $\langle p_k, r_k \rangle$ is finite, so the mixing itself never turns finite inputs
    into non-finite params. The returned state records the non-finite point too (its
    averages keep it, so later calls take plain steps only): to skip such a batch, keep
    the `params` and `state` you passed in (`update` never changes them).
    """
    beta = check_float(_OWNER, "lr", lr, minimum=0.0, strict=True)
    alpha = check_float(_OWNER, "alpha", alpha, minimum=0.0)
    m = check_int(_OWNER, "history_depth", history_depth, 1)
    damp = check_float(_OWNER, "damp", damp, minimum=0.0)
    gamma = check_float(_OWNER, "gamma", gamma, minimum=0.0)
    if gamma >= 1.0:
        raise ValueError(f"{_OWNER}: `gamma` must be < 1, got {gamma}")
    mu = check_float(_OWNER, "mu", mu, minimum=0.0)
    eps = check_float(_OWNER, "eps", eps, minimum=0.0, strict=True)
    weight_decay = check_float(_OWNER, "weight_decay", weight_decay, minimum=0.0)

    hyper = _Hyper(beta, alpha, m, damp, gamma, mu, eps, weight_decay)

    def init(params: Params) -> AdaSAMState:
        return _init(m, params)

    def update(state: AdaSAMState, params: Params, grads: Params) -> tuple[Params, AdaSAMState]:
        return _update(hyper, state, params, grads)

    return AdaSAM(init, update)


# -- the step --------------------------------------------------------------------------------
class _Hyper(NamedTuple):
    """`adasam`'s hyperparameters, checked: `beta` is `lr`, `m` is `history_depth`."""

    beta: float
    alpha: float
    m: int
    damp: float
    gamma: float
    mu: float
    eps: float
    weight_decay: float


def _init(m: int, params: Params) -> AdaSAMState:
    r"""The state at $k = 0$: zero previous point, residual and averages, zero rings."""
    leaves, spec = float_leaves(_OWNER, "params", params)
    zeros = [torch.zeros_like(p) for p in leaves]

    def like() -> Any:
        return optree.tree_unflatten(spec, [z.clone() for z in zeros])

    ring = optree.tree_unflatten(spec, [p.new_zeros((m, *p.shape)) for p in leaves])
    counter = torch.zeros((), dtype=torch.int64, device=leaves[0].device)
    return AdaSAMState(
        counter,
        like(),
        like(),
        like(),
        like(),
        ring,
        optree.tree_map(torch.clone, ring),
        counter.clone(),
        counter.clone(),
    )


def _update(
    h: _Hyper, state: AdaSAMState, params: Params, grads: Params
) -> tuple[Params, AdaSAMState]:
    r"""One step, the module docstring's steps 1-5; the plain step $\beta r_k$ where the
    descent check fails (and always on the first call)."""
    x, spec = float_leaves(_OWNER, "params", params)
    g, g_spec = float_leaves(_OWNER, "grads", grads)
    _check(state, x, spec, g, g_spec)
    _check_state(state, x, spec, h.m)
    k = state.count
    first = k == 0
    r = [-(gi + h.weight_decay * xi) if h.weight_decay else -gi for gi, xi in zip(g, x)]
    dx_avg, dr_avg, dxs, drs = _record(h, state, x, r, first)
    rr = _dot(r, r)
    p = _mixed_step(h, r, rr, dx_avg, dxs, drs)
    # 5. the descent check; the plain step otherwise (and always on the first call).
    descent = _dot(p, r)
    ok = ~first & torch.isfinite(descent) & (descent > h.mu * h.beta * rr)
    new = [xi + torch.where(ok, pi, h.beta * ri) for xi, pi, ri in zip(x, p, r)]
    unflat = lambda leaves: optree.tree_unflatten(spec, leaves)  # noqa: E731
    new_state = AdaSAMState(
        k + 1,
        unflat(list(x)),
        unflat(r),
        unflat(dx_avg),
        unflat(dr_avg),
        unflat(dxs),
        unflat(drs),
        state.num_mixed + ok.long(),
        state.num_fallback + (~ok & ~first).long(),
    )
    return unflat(new), new_state


def _record(
    h: _Hyper, state: AdaSAMState, x: list[Tensor], r: list[Tensor], first: Tensor
) -> tuple[list[Tensor], ...]:
    """Step 1: the moving averages of the differences and the rings holding them, `(dx_avg,
    dr_avg, dxs, drs)`; on the first call there is no difference yet."""
    x_prev, r_prev, dx_avg, dr_avg, dxs, drs = [optree.tree_leaves(t) for t in state[1:7]]
    gamma = h.gamma
    dx_avg = [
        torch.where(first, a, gamma * a + (1 - gamma) * (xi - xp))
        for a, xi, xp in zip(dx_avg, x, x_prev)
    ]
    dr_avg = [
        torch.where(first, a, gamma * a + (1 - gamma) * (ri - rp))
        for a, ri, rp in zip(dr_avg, r, r_prev)
    ]
    # The newest column goes to slot (k - 1) mod m: a one-hot mask, not an index, so the
    # write is the same operation for every member of a vmap.
    k = state.count
    slot = torch.remainder(k - 1, h.m)
    write = (torch.arange(h.m, device=k.device) == slot) & ~first
    dxs = [_write(ring, a, write) for ring, a in zip(dxs, dx_avg)]
    drs = [_write(ring, a, write) for ring, a in zip(drs, dr_avg)]
    return dx_avg, dr_avg, dxs, drs


def _mixed_step(
    h: _Hyper,
    r: list[Tensor],
    rr: Tensor,
    dx_avg: list[Tensor],
    dxs: list[Tensor],
    drs: list[Tensor],
) -> list[Tensor]:
    r"""Steps 2-4: $\delta_k$ and $\Gamma_k$ in float64 ($rr = \|r_k\|^2$), then
    $p_k = \beta r_k - \alpha (X_k + \beta R_k) \Gamma_k$.

    A system that is not finite (a NaN or infinite gradient or params, an overflow) is
    replaced by zeros before the pseudo-inverse, whose eigensolver would raise on it; its
    $p_k$ is then not finite (or $\langle p_k, r_k \rangle$ is not), so the descent check
    takes the plain step. A mask, not a branch, so it also runs under vmap."""
    delta = h.damp * rr / (_dot(dx_avg, dx_avg) + h.eps)
    rtr = _gram(drs, drs)
    xtx = _gram(dxs, dxs)
    rtb = _gram(drs, [ri.unsqueeze(0) for ri in r])[:, 0]
    system = rtr + delta * xtx
    system = torch.where(torch.isfinite(system).all(), system, torch.zeros_like(system))
    coeffs = torch.linalg.pinv(system, hermitian=True) @ rtb
    return [
        h.beta * ri - h.alpha * _combine(xr + h.beta * rr_, coeffs)
        for ri, xr, rr_ in zip(r, dxs, drs)
    ]


# -- helpers ---------------------------------------------------------------------------------
def _check(state: Any, x: list[Tensor], spec: Any, g: list[Tensor], g_spec: Any) -> None:
    """Metadata checks, before any arithmetic: `state` is an `AdaSAMState` with 0-d int64
    counters, and `grads` has the pytree structure, shapes, dtypes and devices of `params`."""
    if not isinstance(state, AdaSAMState):
        raise TypeError(
            f"{_OWNER}: `state` must be an AdaSAMState (from this optimizer's init), got "
            f"{type(state).__name__}"
        )
    for name in ("count", "num_mixed", "num_fallback"):
        check_counter(_OWNER, f"state.{name}", getattr(state, name))
    # Structure, then each leaf's shape (ValueError) and dtype (TypeError), by key path.
    tree.check_like("grads", g, g_spec, x, spec, check_dtype=True, owner=_OWNER)
    check_devices_like(_OWNER, "grads", g, spec, x)


def _check_state(state: AdaSAMState, x: list[Tensor], spec: Any, m: int) -> None:
    """The state's parameter-like fields fit the params: their pytree structure, and each
    leaf's shape (with the leading `history_depth` of the rings), dtype and device."""
    for name, field in zip(AdaSAMState._fields[1:7], state[1:7]):
        leaves, field_spec = optree.tree_flatten(field)
        if not tree.same_structure(field_spec, spec):
            raise ValueError(
                f"{_OWNER}: `state.{name}` does not fit `params` (another model?): "
                + tree.structure_difference(field_spec, spec, f"state.{name}", "params")
            )
        window = name in ("dxs", "drs")
        for leaf, p in zip(leaves, x):
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{_OWNER}: `state.{name}` must hold tensors, got {type(leaf).__name__}"
                )
            shape = (m, *p.shape) if window else p.shape
            if leaf.shape != shape:
                raise ValueError(
                    f"{_OWNER}: `state.{name}` has a leaf of shape {tuple(leaf.shape)}, "
                    f"expected {tuple(shape)} (made for other params or another history_depth)"
                )
            if leaf.dtype != p.dtype:
                raise TypeError(
                    f"{_OWNER}: `state.{name}` has a leaf of dtype {leaf.dtype}, expected "
                    f"{p.dtype} like `params` (made for params of another dtype)"
                )
            if not same_device(leaf.device, p.device):
                raise ValueError(
                    f"{_OWNER}: `state.{name}` has a leaf on device {leaf.device}, expected "
                    f"{p.device} like `params` (made on another device)"
                )


def _write(ring: Tensor, column: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.view(-1, *([1] * column.dim())), column.unsqueeze(0), ring)


def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """`<a, b>` over all leaves, in float64."""
    return sum((ai.double() * bi.double()).sum() for ai, bi in zip(a, b))


def _gram(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """`A^T B` for rings `A`, `B` (columns: the leading dimension), in float64."""
    total = None
    for ai, bi in zip(a, b):
        flat_a, flat_b = ai.reshape(ai.shape[0], -1).double(), bi.reshape(bi.shape[0], -1).double()
        term = flat_a @ flat_b.T
        total = term if total is None else total + term
    return total


def _combine(ring: Tensor, coeffs: Tensor) -> Tensor:
    """`sum_j coeffs[j] ring[j]` in the ring's dtype."""
    return torch.tensordot(coeffs.to(ring.dtype), ring, dims=1)

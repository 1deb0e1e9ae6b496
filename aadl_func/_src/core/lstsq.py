r"""The small least-squares problem of Anderson acceleration, solved once, in float64.

Two routes lead to the same problem, $\gamma = \arg\min_\gamma \|f_{\mathrm{last}} -
\Delta F \gamma\|^2 + \mathrm{reg}\,\|\gamma\|^2$:

* from a **triangular factor** (`solve_factor()`, the accurate route): the float64 `R` of
  a Householder QR of $[\Delta F \mid f_{\mathrm{last}}]$ (built by
  `stack_factors()` from blocks of rows), then an SVD of its small `m x m` block. The
  condition number of $\Delta F$ enters once: the coefficients are accurate to about
  $\epsilon\,\mathrm{cond}(\Delta F)$, and to near $\epsilon$ when the
  ill-conditioning comes from the columns' scales (residuals decaying as an iteration
  converges, the common case). [`aadl_func.mix()`][aadl_func.mix] and float64 windows of
  [`aadl_func.anderson()`][aadl_func.anderson] (sharded or not) take it;
* from **float64 inner products** (`solve_differences()`,
  [`solve_weights()`][aadl_func.solve_weights]): the normal equations $\Delta F^\top \Delta F$,
  solved by a symmetric eigen-decomposition. They square the condition number, but the inner
  products of a float32 or bf16 window cost one $O(m n)$ pass; that window's own precision is the
  tighter limit (README, Numerics).

Both truncate in the same way: with $\sigma_i$ the singular values of
$\Delta F$ and $s$ the solver's scale (factor route: the largest column norm of
$[\Delta F \mid f_{\mathrm{last}}]$; Gram route: the largest residual norm
$\max_i \|f_i\|$), directions with
$\sigma_i^2 + \mathrm{reg} \le (\tau s)^2$ are dropped (a minimum-norm, truncated-SVD
answer: one well-defined result for rank-deficient windows, and bounded coefficients), with
$\tau$ = `RCOND` on the factor route and $\sqrt{\mathrm{RTOL}}$ on the Gram
route, whose eigenvalues carry rounding $\epsilon\, s^2$.

Keeping this in one place, with the SVD of the small factor always on the CPU (one LAPACK
routine whatever the device), is what makes CPU and GPU agree: AADL's users got different
answers from `torch.linalg.lstsq` on the two devices (pivoted QR on CPU, unpivoted QR on
CUDA) exactly when the window was rank deficient."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src.core.ops import PLAIN, Ops
from aadl_func._src.core.scalars import abs2, float64_tensor, wide

__all__ = [
    "MixingWeights",
    "solve_factor",
    "stack_factors",
    "solve_weights",
    "solve_coefficients",
    "solve_differences",
    "solve_known",
    "solve_known_scaled",
    "known_gamma",
    "solve_factor_known",
    "RCOND",
    "RTOL",
    "known_ridge",
    "ridge",
]

# Factor route: singular values of DF (shifted by reg) at or below RCOND * s are dropped, s the
# largest column norm of [DF | f_last]. A float64 QR perturbs them by at most a few eps64 * s
# (~1e-15 s), so every kept direction is resolved to ~1% or better (and to near eps64 when
# the small singular values come from small columns, as in a converging iteration). The
# coefficients stay below sqrt(m) ||f_last|| / (RCOND s) <= sqrt(m) / RCOND.
RCOND = 1e-13

# Gram route: eigenvalues of the projected Gram below RTOL * (largest residual norm squared)
# are treated as zero. Gram entries carry float64 rounding of order eps64 * ||f_i|| ||f_j||,
# so anything smaller than a few hundred eps64 is noise; 1e-13 keeps cond(DR) up to ~3e6
# meaningful.
RTOL = 1e-13
#: `known_gamma()`'s cut-off inverse of the eigenvalues: `(eigvals, reg) -> inverse`.
CutoffInverse = Callable[[Tensor, float], Tensor]


class MixingWeights(NamedTuple):
    """Solution of the mixing problem for residuals `f_0, ..., f_{q-1}` (oldest first).

    Attributes:
      gamma: `(q - 1,)` float64, the least-squares coefficients on the residual differences.
      alpha: `(q,)` float64 affine weights, `alpha = (gamma_0, gamma_1 - gamma_0, ...,
        1 - gamma_{q-2})`; they sum to one and minimise `||sum_i alpha_i f_i||`.
      residual_norm: 0-d float64, `||sum_i alpha_i f_i||` (the mixed residual); None
        where the caller did not ask for it (`update`).
      ok: 0-d bool, False when the Gram matrix or the factor was not finite (the weights
        then fall back to `alpha = e_last`, the plain iterate).
    """

    gamma: Tensor
    alpha: Tensor
    residual_norm: Tensor | None
    ok: Tensor


def stack_factors(blocks: Sequence[Tensor]) -> Tensor:
    r"""The triangular factor `R` (`q x q`, float64) of the rows of `blocks` stacked.

    Each block is a `(p_i, q)` matrix of rows of the same tall matrix $A$ (for example
    the `R` of some of its rows: a TSQR step); the result satisfies
    $R^\top R = \sum_i B_i^\top B_i = A^\top A$ and comes from a Householder QR, so it
    is backward stable whatever the grouping. Fewer than `q` rows are padded with zero rows
    (an already triangular block passes through exactly: its reflectors are the identity).
    """
    q = blocks[0].shape[-1]
    rows = [b.to(torch.float64) for b in blocks]
    missing = q - sum(b.shape[-2] for b in rows)
    if missing > 0:
        rows.append(rows[0].new_zeros(*rows[0].shape[:-2], missing, q))
    stacked = rows[0] if len(rows) == 1 else torch.cat(rows, dim=-2)
    # mode="reduced": differentiable (mode="r" has no derivative); the blocks are small.
    return torch.linalg.qr(stacked, mode="reduced").R


def _affine_weights(gamma: Tensor, ops: Ops) -> Tensor:
    """`alpha = (gamma_0, gamma_1 - gamma_0, ..., 1 - gamma_{m-1})`: the differences of
    `[0, gamma, 1]`, one operation (each difference rounded once)."""
    ends = ops.constant(0.0, gamma), ops.constant(1.0, gamma)
    return torch.diff(gamma, prepend=ends[0], append=ends[1])


def solve_factor(
    factor: Tensor, valid: Tensor, reg: float | Tensor = 0.0, *, ops: Ops = PLAIN
) -> MixingWeights:
    r"""Solves the regularised Anderson least-squares problem from a triangular factor.

    `factor` is the upper-triangular `R` (`(m + 1) x (m + 1)`, float64) of a QR
    factorisation of $A = [\Delta F \mid f]$ ($\Delta F$ the `m` columns of
    residual differences, oldest first, $f$ the newest residual), e.g. from
    `stack_factors()`. With $R = \begin{bmatrix} R_{11} & r_{12} \\ 0 & \rho
    \end{bmatrix}$, $\|f - \Delta F \gamma\|^2 = \|r_{12} - R_{11}\gamma\|^2 +
    \rho^2$, so with the SVD $R_{11} = U \Sigma V^\top$ and $b = U^\top r_{12}$

    $$
    \gamma = V \varphi(\Sigma)\, b, \qquad
    \varphi(\sigma) = \begin{cases} \sigma / (\sigma^2 + \mathrm{reg}) &
        \sigma^2 + \mathrm{reg} > (\mathrm{RCOND}\, s)^2 \\ 0 & \text{otherwise}
        \end{cases}, \qquad
    \|f - \Delta F\gamma\|^2 = \rho^2 + \sum_i (1 - \sigma_i \varphi(\sigma_i))^2
        b_i^2,
    $$

    $s$ being the largest column norm of $A$ (that of $R$). The condition
    number of $\Delta F$ enters once, not squared as in the normal equations. Dropped
    directions make a rank-deficient window's answer the minimum-norm one among the kept
    directions, and bound $\|\gamma\|_2 \le \sqrt{m}\, \|f\| / (\mathrm{RCOND}\, s)$.

    The SVD runs where `ops.small_device` says: `PLAIN` puts it on the CPU whatever
    `factor`'s device (`m x m` values, one LAPACK routine everywhere); `gamma` comes back
    on `factor`'s device.
    Columns where `valid` is False are zeroed first and get $\gamma_j = 0$. A
    non-finite factor gives `ok = False` and $\gamma = 0$. No data-dependent Python
    control flow: it runs under `torch.func.vmap`.

    Args:
      factor: `(m + 1, m + 1)` upper-triangular float64 `R` of $[\Delta F \mid f]$.
      valid: `(m,)` bool, the columns of $\Delta F$ that take part.
      reg: Tikhonov weight on $\gamma$ (`>= 0`): a number, or an `(m,)` tensor of
        one weight per column (solved as the augmented problem, see `ridge()`).

    Returns:
      [`MixingWeights`][aadl_func.MixingWeights], `residual_norm` being $\|f - \Delta F \gamma\|$.
    """
    q = factor.shape[-1]
    m = q - 1
    device = factor.device
    columns = torch.cat([valid.to(device), torch.ones(1, dtype=torch.bool, device=device)])
    r = torch.where(columns[None, :], factor.to(wide(factor.dtype)), 0.0)
    ok = torch.isfinite(r).all()
    r = torch.where(ok, r, 0.0)

    # Scaled to s = 1 (the largest column norm), so that nothing overflows or underflows in
    # the SVD or in sigma^2 + reg; the norms are taken of R / max|R| for the same reason.
    peak = r.abs().amax()
    peak = torch.where(peak > 0, peak, torch.ones_like(peak))
    scale = peak * torch.linalg.vector_norm(r / peak, dim=0).amax()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    r = r / scale
    if isinstance(reg, Tensor):  # reg_relative's weight, computed where the Gram lives
        reg = reg.to(device=scale.device, dtype=scale.dtype)
    shift = reg / scale / scale  # reg / s^2, without forming s^2 (which may underflow)

    # Where the answer to ops.small_device puts the m x m factorisation (see its docstring).
    small = ops.small_device(device)
    r11, rhs = r[:m, :m].to(small), r[:m, m].to(small)
    shift = shift.to(small)
    per_column = shift.dim() == 1
    if per_column:
        # A ridge per column (reg_column): min ||rhs - R11 g||^2 + sum_j shift_j g_j^2 is the
        # least-squares problem of [R11; diag(sqrt(shift))] against [rhs; 0], reduced by one
        # more QR to m x m; its SVD then needs no shift.
        ridge_rows = torch.diag(shift.clamp(min=0.0).sqrt()).to(r11.dtype)
        q_aug, r_aug = torch.linalg.qr(torch.cat([r11, ridge_rows]))
        u, sigma, vh = torch.linalg.svd(r_aug)
        b = u.mH @ (q_aug[:m].mH @ rhs)
        denominator = sigma * sigma
    else:
        u, sigma, vh = torch.linalg.svd(r11)
        b = u.mH @ rhs
        denominator = sigma * sigma + shift
    keep = denominator > RCOND * RCOND
    phi = torch.where(keep, sigma / torch.where(keep, denominator, 1.0), 0.0)
    gamma = vh.mH @ (phi * b)
    gamma = torch.where(valid.to(small), gamma, 0.0)
    if per_column:
        misfit = rhs - r11 @ gamma
        mixed_sq = abs2(r[m, m].to(small)) + abs2(misfit).sum()
    else:
        unresolved = (1.0 - sigma * phi) * b
        mixed_sq = abs2(r[m, m].to(small)) + abs2(unresolved).sum()

    gamma = gamma.to(device)
    ok = ok & torch.isfinite(gamma).all()
    gamma = torch.where(ok, gamma, 0.0)
    alpha = _affine_weights(gamma, ops)
    residual_norm = torch.where(ok, mixed_sq.to(device).sqrt() * scale, 0.0)
    return MixingWeights(gamma, alpha, residual_norm, ok)


def solve_weights(
    gram: Tensor, num_valid: Tensor | int, reg: float = 0.0, *, ops: Ops = PLAIN
) -> MixingWeights:
    r"""Solves the regularised Anderson least-squares problem from a residual Gram matrix.

    With residuals $F = [f_0, \dots, f_{q-1}]$ (oldest first), their differences
    $\Delta F = [f_1 - f_0, \dots, f_{q-1} - f_{q-2}] = F D$ and the Gram matrix
    $G = F^\top F$, this returns

    $$
    \gamma = \arg\min_\gamma \|f_{q-1} - \Delta F \gamma\|^2 + \mathrm{reg}\,\|\gamma\|^2
    = (D^\top G D + \mathrm{reg}\, I)^{+} D^\top G e_{q-1},
    $$

    the pseudo-inverse taken through a symmetric eigen-decomposition in float64 with
    eigenvalues below `RTOL * max_i G_ii` dropped. For a rank-deficient window this is the
    minimum-norm solution, a single well-defined answer on every device (pivoted and unpivoted
    QR return different ones). The float64 Gram squares the condition number of
    $\Delta F$; with 16 digits that still resolves cond(DF) up to ~1e6, far beyond the
    float32 data the window holds, and the Gram is never formed in the history's precision.

    Forming $D^\top G D$ from $G$ cancels when the residuals change little across
    the window: the entries of $G$ carry rounding of order
    $\epsilon \max_i \|f_i\|^2$, so $\gamma$ is accurate to about
    $\epsilon\, (\max_i \|f_i\| / \sigma_{\min}(\Delta F))^2$ rather than
    $\epsilon\, \mathrm{cond}(\Delta F)^2$. Callers holding the differences should
    use `solve_differences()`, as [`aadl_func.mix()`][aadl_func.mix] and the incremental window do.

    Only the last `num_valid` residuals take part (the window may not be full yet); the
    others get zero weight. Written without data-dependent Python control flow, so it runs
    under `torch.func.vmap`.

    Args:
      gram: `(q, q)` float64 Gram matrix of the residuals in chronological order.
      num_valid: how many of the newest residuals are valid (0-d tensor or int).
      reg: absolute Tikhonov weight on $\gamma$ (`reg >= 0`).

    Returns:
      [`MixingWeights`][aadl_func.MixingWeights].
    """
    q = gram.shape[-1]
    if q < 2:
        raise ValueError(f"the mixing problem needs at least 2 residuals, got a {q}x{q} Gram")
    dev = gram.device
    gram = gram.to(wide(gram.dtype))
    index = torch.arange(q, device=dev)
    num_valid = torch.as_tensor(num_valid, device=dev)
    valid = index >= q - num_valid
    pair = valid[:, None] & valid[None, :]
    ok = torch.isfinite(torch.where(pair, gram, 0.0)).all()
    g = torch.where(pair & ok, gram, 0.0)

    # Scaled to max_i ||f_i||^2 = 1 (|G_ij| <= 1), so differencing cannot overflow near the
    # float64 limit and eigh sees O(1) entries whatever the parameters' scale.
    gmax = torch.diagonal(g).real.max()
    unit = torch.where(gmax > 0, gmax, torch.ones_like(gmax))
    g = g / unit

    # D^T G D and D^T G e_last without forming D: differences of rows, then of columns.
    g_cols = g[:, 1:] - g[:, :-1]
    h = g_cols[1:, :] - g_cols[:-1, :]
    b = g[1:, -1] - g[:-1, -1]

    weights = solve_differences(h, b, torch.diagonal(g).real, num_valid, reg / unit, ops=ops)
    return weights._replace(residual_norm=weights.residual_norm * unit.sqrt(), ok=ok & weights.ok)


def solve_coefficients(
    dr_gram: Tensor,
    dr_rhs: Tensor,
    residual_scale: Tensor | float,
    reg: float = 0.0,
    valid: Tensor | None = None,
    *,
    ops: Ops = PLAIN,
) -> Tensor:
    r"""The regularised least-squares coefficients from the normal equations of $\Delta F$.

    Returns $\gamma = (H + \mathrm{reg}\, I)^{+} c$ with $H = \Delta F^\top \Delta F$
    (`dr_gram`) and $c = \Delta F^\top f_{q-1}$ (`dr_rhs`), the pseudo-inverse taken
    through a float64 symmetric eigen-decomposition whose eigenvalues below
    `RTOL * residual_scale` are dropped (`residual_scale` is $\max_i \|f_i\|^2$, so
    differences at the rounding level of the residuals never produce huge coefficients; a
    rank-deficient problem gets its minimum-norm solution).

    This is the single place where the small problem is solved; `solve_differences()`
    (validity masks, scaling, the affine weights) is its one caller, reached from explicit
    differences ([`aadl_func.mix()`][aadl_func.mix], the incremental window) or from a residual Gram
    matrix ([`solve_weights()`][aadl_func.solve_weights]).

    Args:
      dr_gram: `(m, m)` float64 $H$.
      dr_rhs: `(m,)` float64 $c$.
      residual_scale: 0-d float64, $\max_i \|f_i\|^2$ (1 is used when it is 0).
      reg: Tikhonov weight, `>= 0`: a number, or an `(m,)` tensor, one per unknown.
      valid: optional `(m,)` bool mask; the other unknowns are decoupled and get
        $\gamma_j = 0$.

    Returns:
      `(m,)` float64 $\gamma$.
    """
    if isinstance(residual_scale, Tensor):
        unit = torch.where(residual_scale > 0, residual_scale, torch.ones_like(residual_scale))
    else:
        unit = float(residual_scale) if residual_scale > 0 else 1.0
    h, b = dr_gram, dr_rhs
    if valid is not None:
        # Invalid unknowns get a decoupled diagonal of the problem's own scale: gamma_j = 0.
        h = torch.where(valid[:, None] & valid[None, :], h, 0.0)
        h = h + torch.diag(torch.where(valid, 0.0, torch.as_tensor(unit, dtype=h.dtype)))
        b = torch.where(valid, b, 0.0)

    if isinstance(reg, Tensor) and reg.dim() == 1:  # a ridge per column (reg_column)
        h = h + torch.diag(reg)
        reg = 0.0
    eigvals, eigvecs = torch.linalg.eigh(h)
    shifted = eigvals.clamp(min=0.0)
    if not (isinstance(reg, float) and reg == 0.0):  # + 0.0 could only flip the sign of a 0
        shifted = shifted + reg
    keep = shifted > RTOL * unit
    # 1 / inf = +0 for the dropped eigenvalues: no 1 / 0 (nor its gradient) anywhere.
    inverse = torch.where(keep, shifted, torch.inf).reciprocal()
    gamma = eigvecs @ (inverse * (eigvecs.mH @ b))
    if valid is not None:
        gamma = torch.where(valid, gamma, 0.0)
    # Inputs at the edge of the float64 range can still round to Inf/NaN: fall back to
    # gamma = 0, the plain newest iterate, rather than let them reach the parameters.
    return ops.where(ops.all_finite(gamma), gamma, 0.0)


def solve_differences(
    dr_gram: Tensor,
    dr_rhs: Tensor,
    residual_sq: Tensor,
    num_valid: Tensor | int,
    reg: float = 0.0,
    *,
    residual_norm: bool = True,
    ops: Ops = PLAIN,
) -> MixingWeights:
    r"""Solves the mixing problem from the inner products of the residual differences.

    The incremental window keeps, in float64, $H = \Delta F^\top \Delta F$,
    $c = \Delta F^\top f_{q-1}$ and $\|f_i\|^2$, each entry computed from the
    differences $f_{j+1} - f_j$ formed element by element (exact in float64 for float32
    data). Unlike differencing $F^\top F$ ([`solve_weights()`][aadl_func.solve_weights]), nothing
    cancels when the residuals change little across the window, so the weights agree with
    [`aadl_func.mix()`][aadl_func.mix] to $\epsilon\, \mathrm{cond}(\Delta F)^2$.

    Args:
      dr_gram: `(q - 1, q - 1)` float64 $H$, chronological.
      dr_rhs: `(q - 1,)` float64 $c$, chronological.
      residual_sq: `(q,)` float64 $\|f_i\|^2$, chronological.
      num_valid: how many of the newest residuals are valid (0-d tensor or int).
      reg: Tikhonov weight on $\gamma$, `>= 0`: a number or one per column.
      residual_norm: False skips computing it (`update` does not use it); the field is
        then None.

    Returns:
      [`MixingWeights`][aadl_func.MixingWeights]; `residual_norm` is
      $(\|f_{q-1}\|^2 - 2 \gamma^\top c + \gamma^\top H \gamma)^{1/2}$.
    """
    q = residual_sq.shape[-1]
    dev = residual_sq.device
    if not (isinstance(num_valid, Tensor) and num_valid.device == dev):
        num_valid = torch.as_tensor(num_valid, device=dev)
    if ops.value(num_valid) == q:
        # A known full window (the steady state): every mask below would be all True, and
        # torch.where with an all-True mask returns its input, so skipping them changes no
        # bit; it saves a dozen small operations per step.
        gamma_valid = None
        h, c, norms = dr_gram, dr_rhs, residual_sq
    else:
        valid = torch.arange(q, device=dev) >= q - num_valid
        gamma_valid = valid[:-1]
        pair = gamma_valid[:, None] & gamma_valid[None, :]
        h = torch.where(pair, dr_gram, 0.0)
        c = torch.where(gamma_valid, dr_rhs, 0.0)
        norms = torch.where(valid, residual_sq, 0.0)
    ok = ops.all_finite(torch.cat([h.reshape(-1), c, norms]))
    h, c, norms = (ops.where(ok, t, 0.0) for t in (h, c, norms))
    # Scaled to max_i ||f_i||^2 = 1, as in solve_weights: O(1) entries whatever the scale.
    unit = norms.max()
    known = ops.value(unit)
    if known is not None:
        # A known scale, as a Python float, which divides exactly as the 0-d tensor would
        # (one IEEE division), with fewer small operations.
        unit = known if known > 0 else 1.0
        one = 1.0
    else:
        unit = torch.where(unit > 0, unit, torch.ones_like(unit))
        one = torch.ones_like(unit)
    h, c = h / unit, c / unit
    gamma = solve_coefficients(h, c, one, reg / unit, valid=gamma_valid, ops=ops)
    alpha = _affine_weights(gamma, ops)
    if not residual_norm:
        return MixingWeights(gamma, alpha, None, ok)
    # Re(gamma^H c) and gamma^H H gamma (real data: conj() and .real leave them as they are).
    mixed_sq = norms[-1] / unit - 2.0 * (gamma.conj() @ c).real + (gamma.conj() @ h @ gamma).real
    return MixingWeights(gamma, alpha, (mixed_sq.clamp(min=0.0) * unit).sqrt(), ok)


def solve_known(
    dr_gram: Sequence[Sequence[float]],
    dr_rhs: Sequence[float],
    residual_sq: Sequence[float],
    reg: float = 0.0,
) -> tuple[Tensor, list[float]] | None:
    r"""`solve_differences()` for a full window of real values known as Python floats
    (an eager step on the CPU): `(gamma, alpha)`, `alpha` as a list, or None when a value
    is not finite (that function then answers, with its fallback).

    The same arithmetic, bit for bit: the elementwise `m`-sized steps (the scaling, the
    eigenvalue cut-off $\lambda_i \mapsto 1/\lambda_i$, the differences of
    $[0, \gamma, 1]$) are single IEEE double operations, which Python floats round exactly
    as torch's CPU kernels do; the eigen-decomposition and the two matrix-vector products
    stay torch operations on the same tensors. What it saves is the dozen tiny tensor
    operations (masks, finiteness reductions, comparisons) of the general route.

    Args:
      dr_gram: `(m, m)` float64 $H$, chronological, as nested lists.
      dr_rhs: `(m,)` $c$, chronological.
      residual_sq: `(m + 1,)` $\|f_i\|^2$, chronological.
      reg: the Tikhonov weight on $\gamma$, `>= 0` (a number).
    """
    values = [*residual_sq, *dr_rhs, *chain.from_iterable(dr_gram)]
    if not all(map(math.isfinite, values)):
        return None
    unit = max(residual_sq)
    unit = unit if unit > 0 else 1.0
    h = float64_tensor([v / unit for row in dr_gram for v in row], len(dr_gram))
    return _known_affine(known_gamma(h, [v / unit for v in dr_rhs], reg / unit))


def solve_known_scaled(
    h: Tensor, c: Tensor, reg: float = 0.0, cutoff_inverse: CutoffInverse | None = None
) -> tuple[Tensor, list[float]] | None:
    r"""`solve_known()` from its scaled system, for a caller that formed it (the steady call,
    with `native.System`: one IEEE division per entry, as here) and knows every value
    finite: `h` $= H / u$ (`(m, m)`) and `c` $= c / u$ (`(m,)`) contiguous float64 CPU
    tensors, `reg` $= \mathrm{reg} / u$, with $u = \max_i \|f_i\|^2$ (1 when it is 0). The
    same bits; None when the solve is not finite. `cutoff_inverse`: see `known_gamma()`."""
    return _known_affine(known_gamma(h, c, reg, cutoff_inverse))


def known_gamma(
    h: Tensor, c: list[float] | Tensor, reg: float, cutoff_inverse: CutoffInverse | None = None
) -> Tensor:
    r"""$\gamma$ of the scaled system (`solve_known_scaled()` before the affine weights,
    not checked finite): the eigendecomposition $h = V \Lambda V^\top$ and
    $\gamma = V \, \mathrm{inv}(\Lambda) V^\top c$, with `cutoff_inverse(eigvals, reg)`
    (`cutoff_inverse()` unless given, e.g. the native kernel's twin) giving
    $\mathrm{inv}(\lambda) = 1 / s$ for $s = \max(\lambda, 0) + \mathrm{reg} >$ `RTOL`,
    else 0."""
    if isinstance(c, list):
        c = float64_tensor(c)
    eigvals, eigvecs = torch.linalg.eigh(h)
    inverse = (cutoff_inverse or _cutoff_inverse)(eigvals, reg)
    # torch.mv is what `@` runs for a matrix and a vector, without its Python wrapper.
    return torch.mv(eigvecs, inverse * torch.mv(eigvecs.mT, c))


def _cutoff_inverse(eigvals: Tensor, reg: float) -> Tensor:
    """`known_gamma()`'s cut-off inverse on Python floats (each step one IEEE operation, as
    `solve_coefficients()`'s tensor operations round it)."""
    inverse = []
    for value in eigvals.tolist():
        shifted = max(value, 0.0)  # clamp(min=0): NaN stays NaN, and is dropped below
        if reg != 0.0:
            shifted = shifted + reg
        inverse.append(1.0 / shifted if shifted > RTOL else 0.0)
    return float64_tensor(inverse)


def solve_factor_known(
    factor: Tensor, reg: float = 0.0, *, tensor_ridge: bool = False
) -> tuple[Tensor, list[float]] | None:
    r"""`solve_factor()` for a full window (every column valid) whose real float64 factor
    is a plain CPU tensor (an eager step), and a number `reg`: `(gamma, alpha)`, `alpha` as
    a list, or None when a value is not finite (that function then answers).

    The same bits: the elementwise steps (the two scalings, $\sigma^2 + \mathrm{reg}$,
    $\varphi$, $\varphi b$, the affine weights) on Python floats, which round as torch's
    CPU kernels; the column norms, the SVD and the two matrix-vector products as torch
    operations on the same tensors, laid out alike (`R_11` and `r_12` views of the scaled
    factor, in `factor`'s row- or column-major order). The residual norm, which `update`
    does not use, is not formed. `tensor_ridge`: `reg` is the value of the 0-d tensor
    `ridge()` gives with `reg_relative`, which that function divides by the scale as a
    tensor (two true divisions) rather than as a number."""
    q = factor.shape[-1]
    m = q - 1
    # The scaled factors are laid out as `factor` is (QR's R is column-major), as the tensor
    # route's `torch.where` leaves them: LAPACK's SVD and BLAS's products round by the
    # layout they are given (on AVX-512 MKL a row-major copy gave other bits).
    column_major = q > 1 and factor.stride() == (1, q)
    flat = (factor.mT if column_major else factor).reshape(-1).tolist()
    if not all(map(math.isfinite, flat)):
        return None

    row, column = (1, q) if column_major else (q, 1)  # (i, j) at i * row + j * column
    peak = max(map(abs, flat))
    peak = peak if peak > 0 else 1.0
    unit = float64_tensor([v / peak for v in flat]).as_strided((q, q), (row, column))
    scale = peak * max(torch.linalg.vector_norm(unit, dim=0).tolist())
    scale = scale if scale > 0 else 1.0
    r = float64_tensor([v / scale for v in flat])  # the scaled factor, in memory order
    # `reg / scale` with a tensor `scale` is torch's `scale.reciprocal() * reg` (two
    # roundings), then a true division: the same two steps here.
    shift = reg / scale / scale if tensor_ridge else (1.0 / scale) * reg / scale
    # R_11 and r_12 as views (one call each: indexing costs more here than the products).
    u, sigma, vh = torch.linalg.svd(r.as_strided((m, m), (row, column)))
    weighted = []
    for s_i, b_i in zip(
        sigma.tolist(), torch.mv(u.mT, r.as_strided((m,), (row,), m * column)).tolist()
    ):
        denominator = s_i * s_i + shift
        phi = s_i / denominator if denominator > RCOND * RCOND else 0.0
        weighted.append(phi * b_i)
    return _known_affine(torch.mv(vh.mT, float64_tensor(weighted)))


def _known_affine(gamma: Tensor) -> tuple[Tensor, list[float]] | None:
    r"""`(gamma, alpha)` with `alpha` the differences of $[0, \gamma, 1]$ as Python floats,
    each rounded once (`_affine_weights()`'s), or None when `gamma` is not finite."""
    listed = gamma.tolist()
    if not all(map(math.isfinite, listed)):
        return None
    ends = [0.0, *listed, 1.0]
    return gamma, [b - a for a, b in zip(ends, ends[1:])]


def ridge(options: Any, dr_chrono: Tensor, num_valid: Tensor) -> float | Tensor:
    r"""The Tikhonov weight of the small problem for [`aadl_func.anderson()`][aadl_func.anderson]'s
    `options`: $\lambda_j = \mathrm{reg} + \mathrm{reg\_relative}\, \|\Delta F\|_F^2 / m
    + \mathrm{reg\_column}\, \|\Delta f_j\|^2$ on $\gamma_j$: a number, or with
    `reg_column` one weight per column (zero for invalid columns).

    $\Delta F$ holds the $m$ valid differences of consecutive residuals (the
    columns of $\gamma$), so the relative part is their mean squared norm, the
    diagonal of `dr_chrono` ($\Delta F^\top \Delta F$, chronological) over the
    valid columns: no pass over the window. Scaling every residual by $s$ scales
    both sides of the normal equations by $s^2$, so this part leaves
    $\gamma$ unchanged (scale-free, unlike the absolute `reg`). So does the
    per-column part, SciPy's `w0` (`reg_column = w0**2`: `scipy.optimize.anderson`
    adds $w_0^2 \|\Delta f_j\|^2$ to the diagonal), which damps each column by its
    own norm rather than by the window's mean.
    """
    if options.reg_relative == 0.0 and options.reg_column == 0.0:
        return options.reg
    m = dr_chrono.shape[0]
    # gamma_j (j = 0..m-1) is valid when residuals j and j + 1 both are (solve_differences).
    valid = torch.arange(m, device=dr_chrono.device) >= m + 1 - num_valid
    column_sq = torch.diagonal(dr_chrono).real  # ||Delta f_j||^2
    weight = options.reg
    if options.reg_relative != 0.0:
        mean_sq = torch.where(valid, column_sq, 0.0).sum() / valid.sum().clamp(min=1)
        weight = weight + options.reg_relative * mean_sq
    if options.reg_column != 0.0:
        # One weight per column (a vector): each column is damped by its own scale.
        weight = torch.where(valid, weight + options.reg_column * column_sq, 0.0)
    return weight


def known_ridge(options: Any, column_sq: Sequence[float]) -> float | None:
    r"""`ridge()` for a full window whose $\|\Delta f_j\|^2$ (the diagonal of
    $\Delta F^\top \Delta F$, chronological) are known Python floats: the same number, bit
    for bit, or None with `reg_column` (one weight per column, which only the tensor route
    takes).

    The relative part's sum is torch's, over the diagonal as a contiguous float64 vector
    (as `ridge()` sums it, after its `torch.where`): torch's CPU reduction adds in its own
    order, which a Python sum does not follow. The mean, the product and the sum with `reg`
    are single IEEE operations, the same in Python floats."""
    if options.reg_column != 0.0:
        return None
    if options.reg_relative == 0.0:
        return options.reg
    total = float64_tensor(list(column_sq)).sum().item()
    return options.reg + options.reg_relative * (total / len(column_sq))

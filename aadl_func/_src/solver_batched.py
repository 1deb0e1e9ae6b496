r"""Per-sample Anderson acceleration of a batch: the solvers' `batch_dims=1` route.

`fixed_point(g, x0, batch_dims=1)` solves each of the `B` problems of a batch (the first
dimension of every leaf of `x0`) as if it were alone: its own window, mixing weights and
stopping test. The core's `update` under `vmap` does that too, but its window passes run
member by member (`aadl_func._src.vmap_rules`), a Python loop over the batch. Here the same
recurrence (mode "classic", `aadl_func._src.classic_step`) is written for the batch: per
leaf, the window is one `(B, 2, Q, n)` tensor (the steps and the residuals, oldest first),
the small problems are `(B, ., .)` float64 tensors solved by batched `torch.linalg`
routines, and the combination is one `bmm`.

One call with the iterate $x_k$ and the residual $f_k = g(x_k) - x_k$, per sample:

1. append: the step $\Delta x_k = x_k - x_{k-1}$ and $f_k$ join the window (the oldest
   pair drops out) and $x_k$ becomes the anchor;
2. solve, over the newest $s = \min(k, Q)$ pairs (residuals $f_0, \dots, f_{s-1}$,
   oldest first, $\Delta F$ their differences):
   $\gamma = \arg\min_\gamma \|f_{s-1} - \Delta F \gamma\|^2 + \lambda \|\gamma\|^2$,
   $\alpha = (\gamma_0, \gamma_1 - \gamma_0, \dots, 1 - \gamma_{s-2})$;
3. combine: $x^+ = x_k + \sum_j w_j \Delta x_j + \beta \sum_i \alpha_i f_i$ with
   $w_j = -\sum_{i<j} \alpha_i$ (so $w_0 = 0$), $\beta$ = `relaxation`;
4. accept: $x^+$ where the solve and $x^+$ are finite, else the plain step $x_k + f_k$.

The small problem is solved as `aadl_func._src.core.lstsq` solves it, batched over the samples: a
float64 window through the QR factor of $[\Delta F \mid f_{s-1}]$ and the SVD of its
`m x m` block (`solve_factor()`), other windows through the float64 normal equations and a
symmetric eigendecomposition (`solve_differences()`), with the same scalings, cut-offs and
fallback (`gamma = 0`, the plain step, for a sample whose problem is not finite; one
sample's Inf or NaN never reaches another's weights). A sample whose normal equations are
certified to keep every eigenvalue (`normal_coefficients()`) is solved by Cholesky instead,
the same answer at a tenth of the cost, rounded apart by about
$\epsilon_{64}\,\mathrm{cond}(H + \lambda I)$. What rounds differently from one
solve per sample: the factor comes from one Householder QR of each sample's
`(n, s)` matrix instead of the core's streaming QR over chunks, and the normal equations
from products of the widened differences instead of the core's incrementally updated
Grams; both are backward stable, so the weights differ by about
$\epsilon_{64}\,\mathrm{cond}(\Delta F)$ (factor) and $\epsilon_{64}\,\mathrm{cond}(\Delta
F)^2$ (Gram) relative; the combination sums its `2Q + 1` terms in another order.

Every sample appends on every call, so the batch moves in lockstep: the number of pairs
and the call count are the same for all samples and are kept as Python ints (no tensor is
read on the host; under `torch.compile` the solver's fixed-budget loop is unrolled, so they
are constants of the graph). Options this route does not implement (`supports()`) keep the
core's `update` under `vmap`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.anderson import Anderson
from aadl_func._src.core.lstsq import RCOND, RTOL
from aadl_func._src.options import AndersonOptions

__all__ = ["BatchedWindow", "batched_anderson", "supports"]

PyTree = Any

# Leaf dtypes the route computes in: the window is kept in the leaf's dtype and the mix is
# computed in it (the core's compute dtype for these, `update_call._arithmetic`).
_REAL = (torch.float32, torch.float64)


class BatchedWindow(NamedTuple):
    r"""The windows of a batch of problems, in rings of `Q` slots (`update` writes them in
    place: a state passed to `update` is consumed).

    Attributes:
      anchor: per leaf, `(B, n)`, the newest iterate $x_k$ of every sample.
      ring: per leaf, `(B, 2, Q, n)` in the leaf's dtype: `[:, 0]` the steps
        $\Delta x$, `[:, 1]` the residuals $f$; slot `(count - 1) % Q` is the newest,
        slots not yet written hold zeros.
      wide: per leaf, a float64 copy of the residuals `(B, Q, n)`, from which `gram` is
        kept (empty for a float64 window, which needs no Gram).
      gram: `(B, Q, Q)` float64 $\langle f_i, f_j \rangle$ summed over leaves, in ring
        order (the normal equations' route); None for a float64 window (the QR route).
        Only row `i` is written when slot `i` is: the entries $G_{ij}$ with slot `j` no
        newer than `i` are current (the layout's maps read those), the others stale.
      count: calls of `update` so far (every sample's: the batch moves in lockstep).
      slots: per slot, the views `update` writes through (`_slot_views()`), made once.
    """

    anchor: list[Tensor]
    ring: list[Tensor]
    wide: list[Tensor]
    gram: Tensor | None
    count: int
    slots: list[_Slot]


class _Slot(NamedTuple):
    """One ring slot's views, per leaf (`wide` and `wide_row` empty without a Gram):
    `step` `ring[:, 0, k]`, `residual` `ring[:, 1, k]`, `wide` `wide[:, k]`, `wide_row`
    the same as `(B, 1, n)`, `wide_t` `wide` transposed `(B, n, Q)`; and `row`,
    `gram[:, k]` as `(B, 1, Q)` (None without a Gram)."""

    step: list[Tensor]
    residual: list[Tensor]
    wide: list[Tensor]
    wide_row: list[Tensor]
    wide_t: list[Tensor]
    row: Tensor | None


def _slot_views(ring: list[Tensor], wide: list[Tensor], gram: Tensor | None) -> list[_Slot]:
    """The `_Slot` of every slot of a window (views: a few small objects per slot, saving
    the selections each `update` would otherwise make)."""
    return [
        _Slot(
            [r[:, 0, k] for r in ring],
            [r[:, 1, k] for r in ring],
            [w[:, k] for w in wide],
            [w[:, k].unsqueeze(1) for w in wide],
            [w.mT for w in wide],
            None if gram is None else gram[:, k].unsqueeze(1),
        )
        for k in range(ring[0].shape[2])
    ]


def supports(options: AndersonOptions, leaves: list[Tensor]) -> bool:
    """Whether this route implements `options` for a batch with these leaves: mode
    "classic" storing every pair, with `history_depth`, `relaxation`, `reg`,
    `reg_relative`, `wait_iterations` and `frequency` as given and the other options at their
    defaults; float32/float64 leaves on one device."""
    defaults = (
        options.store_each_nth == 1
        and options.history_dtype is None
        and options.history_device is None
        and options.compute_device is None
        and not options.skip_nonfinite
        and not options.restart_on_reject
        and options.reg_column == 0.0
    )
    device = leaves[0].device
    return (
        options.mode == "classic"
        and defaults
        and all(t.dtype in _REAL and t.device == device for t in leaves)
    )


def batched_anderson(options: AndersonOptions) -> Anderson:
    """`init` and `update` with the interface of [`aadl_func.anderson()`][aadl_func.anderson]'s,
    one window per problem of the batch (the first dimension of every leaf)."""
    q = options.num_slots

    def init(params: PyTree) -> BatchedWindow:
        flat = [_rows(t) for t in tree.flatten(params, "x")[0]]
        ring = [t.new_zeros(t.shape[0], 2, q, t.shape[1]) for t in flat]
        wide, gram = [], None
        if not all(t.dtype == torch.float64 for t in flat):  # the normal equations' route
            wide = [r.new_zeros(r[:, 1].shape, dtype=torch.float64) for r in ring]
            gram = wide[0].new_zeros(wide[0].shape[0], q, q)
        anchor = [t.clone() for t in flat]
        return BatchedWindow(anchor, ring, wide, gram, 0, _slot_views(ring, wide, gram))

    def update(
        state: BatchedWindow, params: PyTree, updates: PyTree, *, inplace: bool = False
    ) -> tuple[PyTree, BatchedWindow]:
        # `inplace` is accepted for the interface's sake: the window is always written in
        # place, the params and updates never.
        leaves, spec = tree.flatten(params, "x")
        x = [_rows(t) for t in leaves]
        f = [_rows(t) for t in tree.flatten(updates, "r")[0]]
        count = state.count + 1
        head = (count - 1) % q
        slot = state.slots[head]
        traced = tree.tracing()
        for step, residual, anchor, xi, fi in zip(slot.step, slot.residual, state.anchor, x, f):
            if traced:  # Dynamo refuses an `out=` that is not contiguous
                step.copy_(xi - anchor)
            else:  # straight into the slot: no temporary, no copy
                torch.sub(xi, anchor, out=step)
            residual.copy_(fi)
        if state.gram is not None:
            _append_gram_row(slot, f)
        size = min(count, q)
        if size >= 2 and count > options.wait_iterations and count % options.frequency == 0:
            out = _mix(options, state, head, size, x, f)
        else:
            out = [xi + fi for xi, fi in zip(x, f)]  # the plain step g(x)
        shaped = [o if t.dim() == 2 else o.reshape(t.shape) for o, t in zip(out, leaves)]
        # The anchor is `x` itself, not a copy: the solvers' loops never write an iterate
        # they have handed over (each round makes new ones).
        return tree.unflatten(spec, shaped), state._replace(count=count, anchor=x)

    return Anderson(init, update)  # type: ignore[arg-type]


def _rows(t: Tensor) -> Tensor:
    """A leaf as `(B, n)`: one row per problem (a 2-d leaf itself)."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _append_gram_row(slot: _Slot, residual: list[Tensor]) -> None:
    r"""The float64 copy of the newest residual $f_s$ (`slot`) and its row
    $g_t = \langle f_t, f_s \rangle$ of the Gram matrix (every slot $t$, summed over
    leaves: the products of the widened values are exact, their sums float64's, as the
    core's Gram rows), written in place."""
    row = None
    for wide, wide_row, wide_t, fi in zip(slot.wide, slot.wide_row, slot.wide_t, residual):
        wide.copy_(fi)
        # As (B, 1, n) x (B, n, Q): a few times faster than (B, Q, n) x (B, n, 1) on the CPU
        # (and into a temporary: `bmm` into the strided row is several times slower).
        part = torch.bmm(wide_row, wide_t)  # (B, 1, Q)
        row = part if row is None else row + part
    slot.row.copy_(row)


def _mix(
    options: AndersonOptions,
    state: BatchedWindow,
    head: int,
    size: int,
    x: list[Tensor],
    f: list[Tensor],
) -> list[Tensor]:
    r"""Steps 2-4 of the module docstring: the weights of the newest `size` pairs, the
    combination $x + [w, \beta\alpha] \cdot [\Delta X; F]$ (the sum over the window
    first, the anchor last, as `classic_step.extrapolate()`), and per sample the mix where
    the solve and the mix are finite, else the plain step $x + f$. The mix is tested
    through its sum, which is finite only if every entry is (and otherwise only past the
    dtype's range)."""
    q = options.num_slots
    layout = _layout(q, head, size, state.anchor[0].device)
    gamma, ok, every = mixing_weights(options, state, head, size, layout)
    weights = torch.addmm(layout.offset, gamma, layout.weights)  # (B, 2Q), ring slots
    if options.relaxation != 1.0:
        weights = weights * layout.weights.new_tensor([1.0] * q + [options.relaxation] * q)
    weights = weights.reshape(-1, 1, 2 * q)
    cast = {torch.float64: weights}
    mixes = []
    for ring, xi in zip(state.ring, x):
        if ring.dtype not in cast:
            cast[ring.dtype] = weights.to(ring.dtype)
        window = ring.reshape(ring.shape[0], 2 * q, ring.shape[-1])
        mixes.append(torch.bmm(cast[ring.dtype], window).squeeze(1) + xi)
    if _all_finite(ok, every, mixes):  # read where free: no per-sample selection needed
        return mixes
    for mix in mixes:
        total = mix.sum(-1)
        ok = ok & (total - total == 0)  # False for an Inf or NaN total: NaN - NaN is NaN
    return [torch.where(ok[:, None], m, xi + fi) for m, xi, fi in zip(mixes, x, f)]


def _all_finite(ok: Tensor, every: bool, mixes: list[Tensor]) -> bool:
    """Whether every sample's solve was finite (`ok`, known when `every`) and every mix
    is, read on the host eagerly on the CPU (False where it cannot be read): through one
    sum per leaf, finite only if every entry is (and otherwise only past the dtype's range,
    where the per-sample test decides)."""
    if tree.tracing() or not ok.is_cpu or not (every or bool(ok.all())):
        return False
    return all(math.isfinite(mix.sum().item()) for mix in mixes)


class _Layout(NamedTuple):
    r"""Where the newest `s` pairs of a ring of `Q` slots are, as constant float64 maps
    (every entry 0 or $\pm 1$, so each product below rounds as the differences it forms).
    Chronological position `p` (oldest first, the newest at `Q - 1`) is slot
    `(head + 1 + p) % Q`; the window is the positions `Q - s .. Q - 1`.

    Attributes:
      differences: `(Q, s)` $T = [\Delta \mid e_{\mathrm{last}}]$: a ring of residuals
        times $T$ is $[\Delta F \mid f_{s-1}]$, so $T^\top G T$ is $A^\top A$ of the
        window's problem.
      products: `(Q * Q, s * s)` $T \otimes T$ with each coefficient of $G_{ij}$, `i`
        older than `j`, moved to $G_{ji}$ (the current one of the two equal entries,
        `BatchedWindow.gram`): the flattened $G$ times it is the flattened $T^\top G T$
        in one product, each entry the signed sum of the four Gram entries
        $G_{i+1,j+1} - G_{i,j+1} - G_{i+1,j} + G_{ij}$ (two for the last row and column).
      weights: `(s - 1, 2Q)` and `offset`: `(2Q,)`: `gamma @ weights + offset` is the
        combination's weights by slot, steps then residuals: with
        $g = [0, \dots, 0, \gamma, 1]$ by position, the steps' $w = -g_{p}$ and the
        residuals' $\alpha = g_{p+1} - g_p$, the differences of $[0, \gamma, 1]$ each
        rounded once (`core.lstsq._affine_weights()`). So $w_j = -\sum_{i<j} \alpha_i =
        -\gamma_{j-1}$, taken from $\gamma$ rather than summed back from the rounded
        $\alpha$ (`core.variants.classic.classic_coefficients()`); slots outside the window get 0.
    """

    differences: Tensor
    products: Tensor
    weights: Tensor
    offset: Tensor


_LAYOUTS: dict[tuple[int, int, int, torch.device], _Layout] = {}


def _newer_rows(products: Tensor, slot: list[int]) -> Tensor:
    """`products` `(Q * Q, k)`, a map of the flattened Gram matrix, reading $G_{ij}$
    from the row of the newer of slots `i` and `j` (`slot[p]`: the slot of chronological
    position `p`), where `update` keeps it current."""
    q = len(slot)
    position = {k: p for p, k in enumerate(slot)}
    moved = products.clone()
    for i in range(q):
        for j in range(q):
            if position[i] < position[j]:  # i older: G_ij is read as G_ji
                moved[j * q + i] += moved[i * q + j]
                moved[i * q + j] = 0.0
    return moved


def _layout(q: int, head: int, size: int, device: torch.device) -> _Layout:
    """The `_Layout` of the newest `size` pairs when slot `head` is the newest, cached for
    eager calls (a few `Q x Q` constants per device, read only); made in the graph when
    compiling."""
    key = (q, head, size, device)
    if key in _LAYOUTS and not tree.tracing():
        return _LAYOUTS[key]
    slot = [(head + 1 + p) % q for p in range(q)]  # slot of chronological position p
    first = q - size
    differences = torch.zeros(q, size, dtype=torch.float64)
    weights = torch.zeros(size - 1, 2 * q, dtype=torch.float64)
    for k in range(size - 1):  # gamma_k: the difference f_{k+1} - f_k of the window
        differences[slot[first + k + 1], k] = 1.0
        differences[slot[first + k], k] = -1.0
        weights[k, slot[first + k + 1]] = -1.0  # w of the step into position k + 1
        weights[k, q + slot[first + k]] = 1.0  # alpha_k = gamma_k - gamma_{k-1}
        weights[k, q + slot[first + k + 1]] = -1.0
    differences[slot[q - 1], size - 1] = 1.0
    offset = torch.zeros(2 * q, dtype=torch.float64)
    offset[q + slot[q - 1]] = 1.0  # alpha_{s-1} = 1 - gamma_{s-2}
    products = _newer_rows(torch.kron(differences, differences), slot)
    layout = _Layout(*(t.to(device) for t in (differences, products, weights, offset)))
    if not tree.tracing():
        _LAYOUTS[key] = layout
    return layout


def mixing_weights(
    options: AndersonOptions, state: BatchedWindow, head: int, size: int, layout: _Layout
) -> tuple[Tensor, Tensor, bool]:
    r"""The least-squares coefficients $\gamma$ `(B, s - 1)` (float64, oldest first) of each
    sample's newest `size` residuals, whether its problem was finite (`(B,)`; where not,
    $\gamma = 0$, the plain step), and whether that is known to hold for every sample
    (read on the way; False where not read).

    A float64 window is solved through the QR factor of $A = [\Delta F \mid f_{s-1}]$,
    the differences formed element by element (`solve_factor()`'s route); others through
    the normal equations $A^\top A = T^\top G T$ from the kept Gram matrix $G = F^\top F$
    (`solve_differences()`'s route, whose Grams the core keeps the same way). The ridge is
    $\lambda = \mathrm{reg} + \mathrm{reg\_relative}\,\|\Delta F\|_F^2 / (s - 1)$
    (`aadl_func._src.core.lstsq.ridge()`), per sample."""
    q = options.num_slots
    if state.gram is None:
        columns = []
        for ring in state.ring:
            f = ring[:, 1].roll(-(head + 1), 1)[:, ring.shape[2] - size :]  # oldest first
            columns.append(torch.cat([f.diff(dim=1), f[:, -1:]], dim=1))  # (B, s, n)
        a = columns[0] if len(columns) == 1 else torch.cat(columns, dim=-1)
        factor = torch.linalg.qr(a.mT, mode="r").R  # (B, min(n, s), s), R^T R = A^T A
        if factor.shape[-2] < size:
            # Fewer coordinates than columns: zero rows square the factor (R^T R is
            # unchanged), as the core's factor is padded; the solve then cuts the rank off.
            factor = torch.cat(
                [factor, factor.new_zeros(factor.shape[0], size - factor.shape[-2], size)], -2
            )
        reg = _ridge(options, lambda: (a[:, :-1] * a[:, :-1]).sum(-1))
        return (*factor_coefficients(factor, reg), False)
    b = state.gram.shape[0]
    # (B, s, s): [[H, c], [c^T, |f_{s-1}|^2]] = T^T G T
    products = (state.gram.reshape(b, q * q) @ layout.products).reshape(b, size, size)
    # ||f_i||^2 of every slot: those outside the window are not yet written (zero) or
    # belong to it (a full ring), so the largest and the finiteness are the window's.
    norms = torch.diagonal(state.gram, dim1=-2, dim2=-1)
    reg = _ridge(options, lambda: torch.diagonal(products, dim1=-2, dim2=-1)[:, :-1])
    return _normal_coefficients(products, norms, reg)


def _ridge(options: AndersonOptions, column_sq: Any) -> float | Tensor:
    """The Tikhonov weight per sample: `reg`, plus `reg_relative` times the mean of
    `column_sq()` (`(B, m)`, the squared norms of the differences) where it is set."""
    if options.reg_relative == 0.0:
        return options.reg
    squares = column_sq()
    return options.reg + options.reg_relative * (squares.sum(-1) / squares.shape[-1])


def factor_coefficients(factor: Tensor, reg: float | Tensor = 0.0) -> tuple[Tensor, Tensor]:
    r"""`aadl_func._src.core.lstsq.solve_factor()` for a batch of factors, every column valid:
    $\gamma$ `(B, m)` and whether each factor was finite `(B,)`.

    With $R = \begin{bmatrix} R_{11} & r_{12} \\ 0 & \rho \end{bmatrix}$ scaled by its
    largest column norm $s$, $R_{11} = U \Sigma V^\top$ and $b = U^\top r_{12}$:
    $\gamma = V \varphi(\Sigma) b$, $\varphi(\sigma) = \sigma / (\sigma^2 + \lambda /
    s^2)$ where $\sigma^2 + \lambda / s^2 > \mathrm{RCOND}^2$, else 0. A factor that is
    not finite gives $\gamma = 0$ (tested through the sum of its entries, which is finite
    only if every entry is, and otherwise only past the float64 range). The SVD runs on the
    CPU (on the factor's device while compiling), as `solve_factor()`'s.

    Args:
      factor: `(B, m + 1, m + 1)` float64 upper-triangular `R` of $[\Delta F \mid f]$.
      reg: the Tikhonov weight $\lambda \ge 0$: a number or one per sample `(B,)`.
    """
    device, m = factor.device, factor.shape[-1] - 1
    ok = torch.isfinite(factor.sum((-2, -1)))
    r = torch.where(ok[:, None, None], factor, 0.0)
    # Scaled to s = 1, the peak first, so that nothing overflows or underflows.
    peak = r.abs().amax((-2, -1), keepdim=True)
    peak = torch.where(peak > 0, peak, 1.0)
    scale = peak * torch.linalg.vector_norm(r / peak, dim=-2, keepdim=True).amax(-1, True)
    scale = torch.where(scale > 0, scale, 1.0)
    r = r / scale
    small = device if tree.tracing() else torch.device("cpu")
    u, sigma, vh = torch.linalg.svd(r[:, :m, :m].to(small))
    b = (u.mH @ r[:, :m, m:].to(small)).squeeze(-1)
    denominator = sigma * sigma
    if not (isinstance(reg, float) and reg == 0.0):  # + 0.0 could only flip the sign of a 0
        reg = reg[:, None, None] if isinstance(reg, Tensor) else reg
        denominator = denominator + (reg / scale / scale).squeeze(-1).to(small)  # lambda / s^2
    keep = denominator > RCOND * RCOND
    phi = torch.where(keep, sigma / torch.where(keep, denominator, 1.0), 0.0)
    gamma = (vh.mH @ (phi * b).unsqueeze(-1)).squeeze(-1)
    return gamma.to(device), ok


def normal_coefficients(
    products: Tensor, norms: Tensor, reg: float | Tensor = 0.0
) -> tuple[Tensor, Tensor]:
    r"""`aadl_func._src.core.lstsq.solve_differences()` for a batch, every residual valid:
    $\gamma = (H + \lambda I)^{+} c$ `(B, m)`, and whether each problem was finite `(B,)`.

    Scaled to $\max_i \|f_i\|^2 = 1$, $H = V \Lambda V^\top$ by a float64 symmetric
    eigendecomposition, $\gamma = V (\Lambda + \lambda)^{+} V^\top c$ with the
    eigenvalues $\le \mathrm{RTOL}$ (after clamping at 0 and the shift) dropped. A
    problem that is not finite gives $\gamma = 0$; it is tested through the sum of its
    entries and norms, which is finite only if every one is (and otherwise only past the
    float64 range, which the products of float32 values cannot reach).

    Where no eigenvalue would be dropped, $\gamma = (H + \lambda I)^{-1} c$ exactly, and
    a Cholesky solve gives it (a tenth of the eigendecomposition's time): the samples whose
    $H + \lambda I$ is certified (`_certified()`) take it, the others the
    eigendecomposition. The two round differently, by about
    $\epsilon_{64}\,\mathrm{cond}(H + \lambda I)$ relative, as two backward-stable solves of
    one system do.

    Args:
      products: `(B, m + 1, m + 1)` float64 $A^\top A$, $A = [\Delta F \mid f_{\mathrm{last}}]$:
        $H$ its leading `m x m` block, $c$ its last column's first `m` entries.
      norms: `(B, m + 1)` float64 $\|f_i\|^2$.
      reg: the Tikhonov weight $\lambda \ge 0$: a number or one per sample `(B,)`.
    """
    gamma, ok, _ = _normal_coefficients(products, norms, reg)
    return gamma, ok


def _normal_coefficients(
    products: Tensor, norms: Tensor, reg: float | Tensor
) -> tuple[Tensor, Tensor, bool]:
    """`normal_coefficients()`, and whether every problem is known to be finite (read on
    the host eagerly; False where not read)."""
    m = products.shape[-1] - 1
    peak = norms.amax(-1)  # NaN where a norm is (amax propagates NaN)
    # Scaled by the peak unguarded: where it is 0 or not finite, or the problem is not
    # finite, the system holds a NaN or an Inf and its Cholesky is not certified.
    scaled = products / peak.view(-1, 1, 1)
    shift = _shift(reg, peak)
    h = scaled[:, :m, :m]
    if shift is not None:
        h = torch.addcmul(h, shift[:, :, None], _identity(m, h.dtype, h.device))  # H + mu I
    # Without a ridge, tr(H) <= 4 m: each H_ii = |f_{i+1} - f_i|^2 / max_j |f_j|^2 <= 4 by
    # Cauchy-Schwarz (the Gram's float64 sums of exact products round far inside the 1e-3).
    factor, fast = _certified(h, 4.004 * m if shift is None else None)
    gamma = torch.cholesky_solve(scaled[:, :m, m:], factor).squeeze(-1)
    eager = not tree.tracing() and fast.is_cpu
    if eager and bool(fast.all()):
        # Every problem is then finite: a residual that is not puts an Inf or a NaN in the
        # peak or on the diagonal of H (through its differences), which no certified
        # system holds.
        return gamma, fast, True
    total = products.sum((-2, -1)) + peak
    ok = total - total == 0  # False for an Inf or NaN total: NaN - NaN is NaN
    fast = fast & ok
    if not eager:  # no host read: both solves, the certified samples' Cholesky answer kept
        slow = _eigen_coefficients(products, peak, ok, reg)
        return torch.where(fast[:, None], gamma, slow), ok, False
    rest = (~fast).nonzero().squeeze(-1)
    part = reg[rest] if isinstance(reg, Tensor) else reg
    gamma[rest] = _eigen_coefficients(products[rest], peak[rest], ok[rest], part)
    return gamma, ok, False


def _shift(reg: float | Tensor, unit: Tensor) -> Tensor | None:
    r"""The ridge of the scaled problem, $\lambda / u$ `(B, 1)`, or None for no ridge."""
    if isinstance(reg, float) and reg == 0.0:  # + 0.0 could only flip the sign of a 0
        return None
    return (reg[:, None] if isinstance(reg, Tensor) else reg) / unit[:, None]


def _eigen_coefficients(products: Tensor, peak: Tensor, ok: Tensor, reg: float | Tensor) -> Tensor:
    r"""$\gamma = V (\max(\Lambda, 0) + \mu)^{+} V^\top c$ `(B, m)`: the system of
    `normal_coefficients()` zeroed where not `ok`, scaled by the peak `unit` (1 where that
    is not positive), $H / u = V \Lambda V^\top$, $\mu = \lambda / u$, the shifted
    eigenvalues $\le \mathrm{RTOL}$ dropped."""
    m = products.shape[-1] - 1
    # 1 where not positive (a zero window; NaN): the problem is then zero, gamma = 0.
    unit = torch.where(peak > 0, peak, 1.0)
    # Zeroed where not finite (the eigendecomposition must not see a NaN), then scaled.
    scaled = torch.where(ok[:, None, None], products, 0.0) / unit[:, None, None]
    shifted, eigvecs = torch.linalg.eigh(scaled[:, :m, :m])
    # Without a shift, clamping at 0 decides nothing: a value <= 0 is dropped either way.
    shift = _shift(reg, unit)
    if shift is not None:
        shifted = shifted.clamp(min=0.0) + shift
    # 1 / inf = +0 for the dropped eigenvalues: no 1 / 0 anywhere.
    inverse = torch.where(shifted > RTOL, shifted, torch.inf).reciprocal()
    projected = eigvecs.mH @ scaled[:, :m, m:]
    return (eigvecs @ (inverse.unsqueeze(-1) * projected)).squeeze(-1)


def _certified(a: Tensor, trace_bound: float | None = None) -> tuple[Tensor, Tensor]:
    r"""The Cholesky factor of each symmetric `a` `(B, m, m)` (its lower triangle), and
    whether every eigenvalue of `a` is certified to exceed the cut-off `RTOL` by more than
    the eigendecomposition's rounding, so that `_eigen_coefficients()` would drop none `(B,)`.
    `trace_bound`: a number $T \ge \mathrm{tr}(a)$ the caller knows for every `a` of the
    batch, used for $t$ below (a larger $t$ only certifies less); None: each `a`'s own.

    The certificate is a second floating-point Cholesky, of $a - \tau I$ (Rump, *Verification
    of positive definiteness*, BIT 46, 2006): where it runs to completion, the computed
    factor satisfies $\tilde L \tilde L^\top = \mathrm{fl}(a - \tau I) + E$ with $|E| \le
    \gamma_{m+1} |\tilde L| |\tilde L^\top|$ (Demmel), and by Cauchy-Schwarz on the rows
    $\|E\|_2 \le \frac{\gamma_{m+1}}{1 - \gamma_{m+1}} \mathrm{tr}(a - \tau I)$; the
    subtraction rounds the diagonal by at most $u\,|a_{ii} - \tau|$. So
    $\lambda_{\min}(a) \ge \tau - 2 (m + 1) u\, t$, $t = \sum_i |a_{ii}|$ (for $(m + 1) u
    \le 0.1$; underflow could only add multiples of $2^{-1074}$). The eigendecomposition's
    eigenvalues are those of $a + E'$, $\|E'\|_2 \le p(m)\, u\, \|a\|_2$ with $p$ modest
    (LAPACK's backward stability), $\|a\|_2 \le t$, and forming $a = H + \lambda I$ rounded
    its diagonal by at most $u\, t$. With
    $\tau = \mathrm{RTOL} + 64 (m + 1)^2 u\, t$, a certified `a` has every computed
    eigenvalue above $\mathrm{RTOL}$ for any $p(m) \le 62 (m + 1)^2$ (LAPACK's eigensolver
    tests accept backward errors of tens of ulps times `m`). Typical windows clear it by
    orders of magnitude: $\tau \le 2 \cdot 10^{-11}$ for `m <= 8` ($t \le 4 m$ without a
    ridge), their smallest eigenvalues
    $10^{-5}$ and up on the DEQ bench."""
    m = a.shape[-1]
    margin = 64 * (m + 1) ** 2 * torch.finfo(a.dtype).eps / 2
    factor, info = torch.linalg.cholesky_ex(a)
    # a - tau I: the off-diagonal entries minus 0, exactly themselves.
    if trace_bound is not None:  # one tau for the batch: no trace to form
        tau = RTOL + margin * trace_bound
        lowered = torch.sub(a, _identity(m, a.dtype, a.device), alpha=tau)
    else:
        # The trace is t where `factor` exists: a factored `a` has a positive diagonal.
        t = torch.diagonal(a, dim1=-2, dim2=-1).sum(-1).view(-1, 1, 1)
        lowered = torch.addcmul(a, t * margin + RTOL, _identity(m, a.dtype, a.device), value=-1.0)
    _, lowered_info = torch.linalg.cholesky_ex(lowered)
    return factor, (info | lowered_info) == 0


_IDENTITIES: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _identity(m: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The `m x m` identity, cached for eager calls as `_layout()`'s constants."""
    key = (m, dtype, device)
    if key in _IDENTITIES and not tree.tracing():
        return _IDENTITIES[key]
    eye = torch.eye(m, dtype=dtype, device=device)
    if not tree.tracing():
        _IDENTITIES[key] = eye
    return eye

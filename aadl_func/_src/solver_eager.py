r"""The eager solver loop's own Anderson window: mode "classic" for one problem on the CPU.

`fixed_point` and `root` call an Anderson update once per evaluation of the map. The
core's [`aadl_func.anderson()`][aadl_func.anderson] `update` carries what a training step
needs (a state of tensors that vmap, torch.compile and `torch.save` can take, argument and
state checks, the in-place commit and its recovery), which on a small problem costs several
times the evaluation itself. The eager loop owns its window: nobody else sees it, so here the
same recurrence (`aadl_func._src.classic_step`) keeps its counters as Python ints, its Gram
matrices as Python floats and its slots as rows of one `(2, Q, n)` buffer (a float64
window adds the residuals' differences, the columns of its QR factor).

One call with the iterate $x_k$ and the residual $f_k$ (the map's step):

1. append: $\Delta x_k = x_k - x_{k-1}$ and $f_k$ go into slot `head` (the oldest pair
   drops out), and the row $\langle f_t, f_k \rangle$ of the float64 Gram matrix is
   computed (exact products, float64 sums: `aadl_func._src.native.float64_dots()`), with
   the rows of the differences' Gram from it (`aadl_func._src.window.known_rows()`). A
   row that is not finite empties the window (the core's poisoned append);
2. solve, over the newest $s$ pairs (chronological, $\Delta F$ the differences of the
   residuals): $\gamma = \arg\min \|f_k - \Delta F\gamma\|^2 + \lambda\|\gamma\|^2$ and
   $\alpha$ the differences of $[0, \gamma, 1]$, by the core's small solves for values
   known on the host (`aadl_func._src.core.lstsq.solve_known()` on the Grams;
   `solve_factor_known()` on the QR factor of $[\Delta F \mid f_k]$ for a float64 window,
   the accurate route); $\lambda$ = `reg` + `reg_relative` $\|\Delta F\|_F^2 / (s - 1)$;
3. combine: $x^+ = x_k + \sum_j w_j \Delta x_j + \beta \sum_i \alpha_i f_i$,
   $w_j = -\sum_{i<j}\alpha_i$ (`aadl_func._src.core.variants.classic`), one `addmv`;
4. accept: $x^+$ where the solve and $x^+$ are finite, else the plain step $x_k + f_k$.

What differs from the core's update is rounding only: a window that is not yet full is
solved as the smaller problem of its valid pairs (the core masks a full-size one), and
the factor comes from one Householder QR rather than the core's streamed one. The
solver tests check the iterates against SciPy's and against the core's update.

Which solves take it (`supports()`): eager (not vmap, not compiled, not masked), one
problem (`batch_dims=0`), real float32 or float64 leaves of one dtype on the CPU
(contiguous, not empty), and
of [`aadl_func.anderson()`][aadl_func.anderson]'s options only `history_depth`,
`relaxation`, `reg`, `reg_relative`, `wait_iterations` and `frequency` set (mode
"classic"). Others keep the core's update.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from aadl_func._src import native, tree
from aadl_func._src.anderson import Anderson
from aadl_func._src.checks import differentiating
from aadl_func._src.core.lstsq import solve_factor_known, solve_known
from aadl_func._src.core.scalars import float64_tensor
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.options import AndersonOptions
from aadl_func._src.window import known_rows

__all__ = ["EagerWindow", "accelerator_step", "supports"]

# The options this window implements as given; every other one must be at its default.
_IMPLEMENTED = frozenset(
    {"inner", "mode", "history_depth", "relaxation", "reg", "reg_relative"}
    | {"wait_iterations", "frequency"}
)
_REAL = (torch.float32, torch.float64)


def supports(options: AndersonOptions, leaves: list[Tensor]) -> bool:
    """Whether `EagerWindow` implements `options` for an eager solve from `leaves`."""
    if options.mode != "classic" or not leaves:
        return False
    for field in dataclasses.fields(options):
        if field.name not in _IMPLEMENTED and getattr(options, field.name) != field.default:
            return False
    dtype = leaves[0].dtype
    return dtype in _REAL and all(
        t.dtype == dtype and t.is_cpu and t.is_contiguous() and t.numel() > 0 for t in leaves
    )


def accelerator_step(
    opt: Anderson, settings: AndersonOptions, x: list[Tensor], spec: Any
) -> Callable:
    """`accelerate(x, step)`: the next iterate (leaves) after the iterate `x` and its step,
    for the eager loop: the solver's own window (`EagerWindow`) where it
    implements `settings`, else the core's `update` (`opt`), whose state it keeps."""
    if supports(settings, x):
        return EagerWindow(settings, x).step
    inplace = _updates_in_place(x)
    state = [opt.init(tree.unflatten(spec, x))]

    def accelerate(x: list[Tensor], step: list[Tensor]) -> list[Tensor]:
        # In place on a copy of x (x itself stays the iterate that `best` may hold): the
        # same bits as the pure call, with the window kept as `init` laid it out.
        start = [t.clone() for t in x] if inplace else x
        proposal, state[0] = opt.update(
            state[0], tree.unflatten(spec, start), tree.unflatten(spec, step), inplace=inplace
        )
        return tree.flatten(proposal, "x")[0]

    return accelerate


def _updates_in_place(x: list[Tensor]) -> bool:
    """Whether the eager loop may step copies of its iterates in place: outside the
    differentiating transforms (which refuse in-place steps) and autograd's graph."""
    return not differentiating() and not any(t.requires_grad for t in x)


class EagerWindow:
    r"""The window of one eager solve (mutable, private to the loop): `step(x, f)` returns
    the next iterate for the iterate `x` and its step `f` (lists of leaves like `x0`'s),
    leaving both as they were.

    Attributes:
      ring: `(2, Q, n)` in the leaves' dtype: `[0]` the steps $\Delta x$, `[1]` the
        residuals $f$, by ring slot (slot `head` the newest); a float64 window's is
        `(3, Q, n)`, `[2]` holding $d_t = f_t - f_{t-1}$ (the QR's columns).
      gram, dr_gram, dr_rhs: $\langle f_t, f_u \rangle$, $\langle d_t, d_u \rangle$ and
        $\langle d_t, f_{\mathrm{head}} \rangle$, $d_t = f_t - f_{t-1}$ (ring slots), as
        Python floats (the Gram route; a float64 window keeps none).
    """

    def __init__(self, options: AndersonOptions, x: list[Tensor]):
        self.options, self.q = options, options.num_slots
        self.shapes = [t.shape for t in x]
        flat = _flat(x)
        self.exact = flat.dtype == torch.float64
        # A float64 window also keeps each residual's difference from the one before it
        # (`[2]`), so that one `index_select` gathers the QR's columns `[dF | f_k]`.
        self.ring = flat.new_zeros(3 if self.exact else 2, self.q, flat.shape[0])
        self.factor_rows = self.ring[1:].view(-1, flat.shape[0])  # f by slot, then dF
        self.columns = self.ring[:2].view(2 * self.q, -1).mT  # steps, then f, by slot
        self.gathers: dict[tuple[int, int], Tensor] = {}  # (head, size): the rows to gather
        self.anchor = flat  # x_{k-1}; the loop never writes its iterates
        self.count, self.head, self.size = 0, self.q - 1, 0
        self.gram = [[0.0] * self.q for _ in range(self.q)]
        self.dr_gram = [[0.0] * self.q for _ in range(self.q)]
        self.dr_rhs = [0.0] * self.q

    def step(self, x: list[Tensor], f: list[Tensor]) -> list[Tensor]:
        """Steps 1-4 of the module docstring: the next iterate, as leaves like `x`."""
        options = self.options
        x_flat, f_flat = _flat(x), _flat(f)
        self.count += 1
        self.head = (self.head + 1) % self.q
        self._append(x_flat, f_flat)
        mixed = None
        if (
            self.size >= 2
            and self.count > options.wait_iterations
            and self.count % options.frequency == 0
        ):
            mixed = self._mix(x_flat)
        out = x_flat + f_flat if mixed is None else mixed
        return _leaves(out, self.shapes)

    def _append(self, x: Tensor, f: Tensor) -> None:
        steps, residuals = self.ring[0], self.ring[1]
        torch.sub(x, self.anchor, out=steps[self.head])
        if self.exact and self.size:  # f_k - f_{k-1}, as `diff` rounds it: a QR column
            torch.sub(f, residuals[(self.head - 1) % self.q], out=self.ring[2, self.head])
        residuals[self.head].copy_(f)
        self.anchor = x
        self.size = min(self.size + 1, self.q)
        if self.exact:
            return  # the factor is formed from the slots when solving
        g = native.float64_dots(list(residuals), f)
        if g is None:  # no native kernel: the same exact products, summed by BLAS
            g = torch.mv(residuals.to(torch.float64), f.to(torch.float64))
        q, head = self.q, self.head
        g, h, c = known_rows(g.tolist(), self.gram[(head - 1) % q], head)
        ages = [(head - t) % q for t in range(q)]
        if not all(
            math.isfinite(v) for row in (g, h, c) for v, a in zip(row, ages) if a < self.size
        ):
            # A row out of the float64 range: the window restarts (the core's poisoned append).
            self.ring[:, head].zero_()
            self.size = 0
            self.gram = [[0.0] * q for _ in range(q)]
            self.dr_gram = [[0.0] * q for _ in range(q)]
            self.dr_rhs = [0.0] * q
            return
        _set_row(self.gram, head, g)
        _set_row(self.dr_gram, head, h)
        self.dr_rhs = c

    def _slots(self) -> list[int]:
        """The ring slots of the window's pairs, oldest first."""
        return [(self.head - self.size + 1 + p) % self.q for p in range(self.size)]

    def _gather(self, later: list[int]) -> Tensor:
        r"""The rows of `factor_rows` holding $[\Delta F \mid f_k]$ for the window's
        `later` slots (oldest first): their differences, then the newest residual; one
        index tensor per window position, made once."""
        key = (self.head, self.size)
        rows = self.gathers.get(key)
        if rows is None:
            rows = torch.tensor([self.q + s for s in later] + [self.head])
            self.gathers[key] = rows
        return rows

    def _weights(self, slots: list[int]) -> list[float] | None:
        r"""$\alpha$ over the window's `slots` (oldest first; Python floats), or None when
        the problem is not finite."""
        reg = self.options.reg
        later = slots[1:]  # the newer end of each difference: the columns of gamma
        if self.exact:
            a = self.factor_rows.index_select(0, self._gather(later)).mT  # [DF | f_k]
            factor = torch.linalg.qr(a, mode="r").R
            if factor.shape[0] < factor.shape[1]:  # fewer coordinates than columns: square it
                factor = torch.nn.functional.pad(
                    factor, (0, 0, 0, factor.shape[1] - factor.shape[0])
                )
            if self.options.reg_relative:
                column_sq = torch.linalg.vector_norm(factor[:, :-1], dim=0).square()
                reg = reg + self.options.reg_relative * (column_sq.sum().item() / len(later))
            known = solve_factor_known(factor, reg)
        else:
            h = [[self.dr_gram[i][j] for j in later] for i in later]
            if self.options.reg_relative:
                reg = reg + self.options.reg_relative * (
                    sum(h[j][j] for j in range(len(h))) / len(h)
                )
            c = [self.dr_rhs[i] for i in later]
            known = solve_known(h, c, [self.gram[s][s] for s in slots], reg)
        return None if known is None else known[1]

    def _mix(self, x: Tensor) -> Tensor | None:
        """Steps 2-4: the mix, or None where the solve or the mix is not finite."""
        slots = self._slots()
        alpha = self._weights(slots)
        if alpha is None:
            return None
        q, relaxation = self.q, self.options.relaxation
        weights = [0.0] * (2 * q)
        for slot, w, a in zip(slots, classic_coefficients(alpha), alpha):
            weights[slot], weights[q + slot] = w, relaxation * a
        mixed = torch.addmv(x, self.columns, float64_tensor(weights).to(x.dtype))
        total = mixed.sum().item()
        return mixed if math.isfinite(total) else None


def _set_row(matrix: list[list[float]], slot: int, row: list[float]) -> None:
    """Row and column `slot` of a symmetric matrix kept as nested lists become `row`."""
    matrix[slot] = list(row)
    for i, value in enumerate(row):
        matrix[i][slot] = value


def _flat(leaves: list[Tensor]) -> Tensor:
    """The leaves as one flat vector (a view for a single contiguous leaf)."""
    if len(leaves) == 1:
        return leaves[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in leaves])


def _leaves(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """`flat` split into leaves of `shapes` (views)."""
    if len(shapes) == 1:
        return [flat.view(shapes[0])]
    sizes = [math.prod(s) for s in shapes]
    return [part.view(s) for part, s in zip(flat.split(sizes), shapes)]

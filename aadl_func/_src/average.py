r"""AADL's moving-average rule, computed from the difference window without a second copy.

With `average=True` AADL replaces the parameters by the mean of the window of plain iterates
when the window is noisy (stochastic oscillations defeat extrapolation). Here the window of
mode `"aadl"` is stored as the newest entry (the anchor $x_{k-1}$) plus the
differences $d_j = x_{j+1} - x_j$, $j = 0, \dots, k - 2$, with their float64
Gram matrix $G_{jl} = \langle d_j, d_l \rangle$. Every quantity of the rule follows from
these:

$$
x_i &= x_{k-1} - \sum_{j \ge i} d_j, \\
\bar x &= \frac{1}{k} \sum_{i=0}^{k-1} x_i = x_{k-1} - \sum_{j=0}^{k-2} w_j d_j,
    \quad w_j = \frac{j + 1}{k}, \\
x_i - \bar x &= \sum_j C_{ij} d_j, \quad C_{ij} = w_j - [j \ge i], \\
\sum_i \|x_i - \bar x\|^2 &= \sum_i C_{i:} \, G \, C_{i:}^\top .
$$

So the mean costs one streaming pass over the window (`aadl_func._src.window.combine()`),
the spread is an $O(k^3)$ quadratic form in the Gram matrix, and $\|\bar x\|$ is one
pass over the mean.

Where this differs from AADL (`AADL/accelerate.py`, `averaged_accelerated_step`):

* the spread: AADL compares `max(std) / max(mean)` over coordinates (a signed maximum of the
  mean) with 0.1; we compare the 2-norms (see `window_average()`);
* the window: AADL keeps a second deque of every plain step; we average the Anderson window
  itself (every `store_each_nth`-th plain step, the newest one replaced by an accepted mix);
* the order: AADL averages first, stores the average in its extrapolation window and lets a
  mix overwrite it; here (spec step 5) the window keeps the plain iterates and, on a call where
  the rule applies, the params are the mean and no mix is formed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.core import accept
from aadl_func._src.window import combine, gram_row

__all__ = ["window_average"]


def window_average(
    anchor: Sequence[Tensor],
    ring: Sequence[Sequence[Tensor]],
    gram: Tensor,
    head: Tensor,
    window_size: Tensor,
    *,
    tol: float,
    compute_dtypes: Sequence[torch.dtype],
) -> tuple[list[Tensor], Tensor]:
    r"""The window mean and whether AADL's moving-average rule replaces the params by it.

    For the $k$ = `window_size` entries $x_0, \dots, x_{k-1}$ of the window
    (oldest first; the parameter leaves together form one vector) the rule is

    $$
    \bar x = \frac{1}{k} \sum_i x_i, \qquad
    s_n = \sqrt{\frac{1}{k - 1} \sum_i (x_{i,n} - \bar x_n)^2}, \qquad
    \text{average} \iff k \ge 2 \ \text{and}\ \|s\|_2 > \mathrm{tol}\, \|\bar x\|_2,
    $$

    $s$ being the per-coordinate sample standard deviation (Bessel's correction, as
    `torch.std`), so $\|s\|_2^2 = \frac{1}{k-1} \sum_i \|x_i - \bar x\|^2$. A
    non-finite spread or mean never triggers the rule.

    AADL compares `max(std) / max(mean)` (both over coordinates, the maximum of the mean
    signed) with 0.1; its code also prints `norm(std) / norm(mean)`, the 2-norm form used
    here. The 2-norm version is invariant to the sign and order of the coordinates (a window
    whose largest mean coordinate is negative never averages in AADL) and, unlike a maximum
    over coordinates, follows from the Gram matrix without another per-coordinate pass.

    Args:
      anchor: per leaf, the newest window entry $x_{k-1}$.
      ring: `ring[slot][leaf]`, the `Q` difference slots (ring order).
      gram: `(Q, Q)` float64 Gram matrix of the slots, ring order.
      head: 0-d int64, ring slot of the newest difference.
      window_size: 0-d int64 $k$; the newest $k - 1$ slots are valid.
      tol: the relative spread above which the mean replaces the params (`average_tol`).
      compute_dtypes: per leaf, the accumulation dtype of the mean.

    Returns:
      `(mean, triggered)`: the mean per leaf (compute dtype, on the window's device, laid
      out like `anchor`) and a 0-d bool (on the CPU; see `tree.decision`).
    """
    q = gram.shape[-1]
    device = gram.device
    k = window_size.to(device)
    # Chronological position p (oldest 0 ... newest q - 1) of every ring slot s.
    slots = torch.arange(q, device=device)
    position = (slots - head.to(device) - 1) % q
    # Slot at position p holds d_j with j = p - (q - (k - 1)); valid when j >= 0.
    j = position - (q - (k - 1))
    valid = j >= 0
    k_safe = torch.clamp(k, min=1).to(torch.float64)
    weights = torch.where(valid, (j + 1).to(torch.float64) / k_safe, 0.0)

    mean = combine(anchor, [ring], -weights, compute_dtypes, anchor)

    # C[i, s] = w_s - [j_s >= i] for the k entries i (rows past k and invalid slots are zero).
    entries = torch.arange(q + 1, device=device)
    coefficients = weights[None, :] - (j[None, :] >= entries[:, None]).to(torch.float64)
    coefficients = torch.where(valid[None, :] & (entries[:, None] < k), coefficients, 0.0)
    finite_gram = torch.where(valid[:, None] & valid[None, :], gram, 0.0)
    scatter = torch.einsum("is,st,it->", coefficients, finite_gram, coefficients)

    mean_sq = gram_row([mean], mean, device)[0]
    variance_sum = scatter / torch.clamp(k - 1, min=1).to(torch.float64)
    return mean, tree.decision(accept.spread_exceeds(k, variance_sum, mean_sq, tol), device)

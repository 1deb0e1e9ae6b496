r"""The small problem of a window: its Grams (or its QR factor) gathered oldest first, the
ridge, and the weights, by the tensor routes or, for values Python may read, by the
Python-float routes with the same bits (`aadl_func._src.core.lstsq`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src.core.grams import Grams
from aadl_func._src.core.lstsq import (
    MixingWeights,
    known_ridge,
    ridge,
    solve_differences,
    solve_factor,
    solve_factor_known,
    solve_known,
)
from aadl_func._src.core.ops import PLAIN, Ops
from aadl_func._src.core.ring import chronological, chronological_slots, difference_valid

__all__ = ["known_weights", "window_weights"]


def window_weights(
    options: Any,
    q: int,
    grams: Grams,
    head: Tensor,
    num_residuals: Tensor,
    device: torch.device,
    *,
    exact: bool,
    factor: Tensor | None = None,
    ops: Ops = PLAIN,
) -> tuple[MixingWeights, Tensor | int, Tensor]:
    r"""`aadl_func._src.stages.solve()`'s small problem for the Grams `(gram, dr_gram,
    dr_rhs)` of a ring of `q` slots, whose newest residual is in slot `head`: the weights,
    the order for `to_ring_order()` and $\|f_i\|^2$ (chronological). `exact` (a float64
    window): solved through `factor`, the window's QR factor
    (`aadl_func._src.window.window_factor()`)."""
    gram, dr_gram, dr_rhs = grams
    newest = ops.value(head)
    if newest is not None:
        # A known newest slot: a cached index instead of index arithmetic on every call.
        slots, later = chronological_slots(q, newest, gram.device)
    else:
        slots = chronological(q, head).to(device)
        later = slots[1:]  # d at chronological position j + 1 is the column of gamma_j
    # ||f_i||^2, oldest first (real: `.real` of a real tensor is that tensor).
    residual_sq = torch.diagonal(gram).real.index_select(0, slots)
    dr_chrono = dr_gram.index_select(0, later).index_select(1, later)
    dr_rhs = dr_rhs.index_select(0, later)
    order = newest if newest is not None else slots
    num_valid = num_residuals.to(device)
    reg = ridge(options, dr_chrono, num_valid)
    if exact:
        valid = difference_valid(q, num_residuals).to(device)
        return solve_factor(factor, valid, reg, ops=ops), order, residual_sq
    weights = solve_differences(
        dr_chrono, dr_rhs, residual_sq, num_valid, reg, residual_norm=False, ops=ops
    )
    return weights, order, residual_sq


def known_weights(
    options: Any,
    grams: Grams,
    newest: int | None,
    num_residuals: int | None,
    factor: Tensor | None = None,
    *,
    ops: Ops = PLAIN,
) -> tuple[Tensor, list[float]] | None:
    """`window_weights()` by `aadl_func._src.core.lstsq.solve_known()` (the Gram route) or, given
    a float64 window's `factor`, `solve_factor_known()`: the same bits, `(gamma, alpha)`,
    `alpha` chronological as Python floats, for a full window whose Grams or factor are
    plain real CPU values (an eager call) and whose ridge is a number (`reg`, and
    `reg_relative`'s part: `known_ridge()`); otherwise, or when a value is not finite, None."""
    q = grams.gram.shape[-1]
    if newest is None or num_residuals != q or options.reg_column:
        return None
    values = grams if factor is None else (factor, grams.dr_gram)
    if any(t.dtype != torch.float64 for t in values) or not ops.values_known(*values):
        return None
    slots = [(newest + 1 + j) % q for j in range(q)]  # oldest first
    later = slots[1:]  # the newer ends of the differences (the columns of gamma)
    if factor is not None:
        diagonal = grams.dr_gram.diagonal().tolist() if options.reg_relative else []
        reg = known_ridge(options, [diagonal[i] for i in later] if diagonal else [])
        if reg is None:
            return None
        return solve_factor_known(factor, reg, tensor_ridge=options.reg_relative != 0.0)
    gram, dr_gram, dr_rhs = (t.tolist() for t in grams)
    reg = known_ridge(options, [dr_gram[i][i] for i in later])
    if reg is None:
        return None
    return solve_known(
        [[dr_gram[i][j] for j in later] for i in later],
        [dr_rhs[i] for i in later],
        [gram[s][s] for s in slots],
        reg,
    )

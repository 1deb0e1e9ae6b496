"""The invariant every execution path keeps: the state's Gram matrices are those of the window.

``AndersonState`` keeps float64 Gram matrices of its ring of residuals, updated one row per
stored entry. Whatever path wrote them (eager, in place, vmap, compiled, sharded), they must
be the Gram matrices of the values the ring *stores*, i.e. after rounding to the history
dtype. This module recomputes them from the stored values with NumPy in float64 (no
``aadl_func`` import), so the check is independent of the code under test.
"""

from __future__ import annotations

import numpy as np
import optree
import torch

# The window dtypes every path is checked in: (params dtype, ``history_dtype``).
WINDOWS = {
    "float64": (torch.float64, torch.float64),
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.float32, torch.bfloat16),
    "float16": (torch.float32, torch.float16),
}


def dot_roundoff(n: int) -> float:
    """``gamma_n = n u / (1 - n u)``, ``u = 2^-53``: a float64 inner product of ``n`` terms,
    summed in any order, is within ``gamma_n |x|.|y| <= gamma_n ||x|| ||y||`` of the exact one
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5)."""
    u = 2.0**-53
    return n * u / (1.0 - n * u)


def ring_matrix(state) -> np.ndarray:
    """The stored residuals as a float64 ``(Q, n)`` matrix, ring order (exact: every
    float32/bf16/fp16 value is a float64 value)."""
    rows = []
    for slot in state.residuals:
        leaves = optree.tree_leaves(slot)
        rows.append(
            np.concatenate([t.detach().to(torch.float64).reshape(-1).numpy() for t in leaves])
        )
    return np.stack(rows)


def num_residuals(window_size: int, mode: str) -> int:
    """Valid residuals in the ring: the window's entries (mode "classic": pairs), less the
    anchor in mode "aadl"."""
    return max(window_size - 1, 0) if mode == "aadl" else window_size


def expected_grams(ring: np.ndarray, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(G, H, c)``: ``G = F^T F``, ``H = D^T D``, ``c = D^T f_head`` with
    ``d_t = f_t - f_{t-1}`` (ring predecessor), everything in ring order."""
    diffs = ring - np.roll(ring, 1, axis=0)
    return ring @ ring.T, diffs @ diffs.T, diffs @ ring[head]


def state_gram_errors(state, mode: str) -> dict[str, float]:
    """:func:`gram_errors` of a state against its own stored ring."""
    grams = (state.gram, state.dr_gram, state.dr_rhs)
    valid = num_residuals(int(state.window_size), mode)
    return gram_errors(ring_matrix(state), int(state.head), valid, grams)


def gram_errors(ring: np.ndarray, head: int, num_valid: int, grams) -> dict[str, float]:
    """Largest error of the valid entries of ``grams = (gram, dr_gram, dr_rhs)`` against the
    Gram matrices of ``ring`` (``(Q, n)``, ring order, newest residual at ``head``, the
    ``num_valid`` newest slots valid), each relative to the scale of its entries
    (``||f_i|| ||f_j||``, ``||d_t|| ||d_u||``, ``||d_t|| ||f_head||``).

    A sharded window is every rank's :func:`ring_matrix` side by side, with the rows a rank
    keeps as its partial sums summed over ranks.
    """
    q = ring.shape[0]
    age = (head - np.arange(q)) % q
    valid = age < num_valid
    valid_d = age < num_valid - 1  # d_t needs f_t and f_{t-1}
    G, H, c = expected_grams(ring, head)
    gram, dr_gram, dr_rhs = (np.asarray(t.detach().cpu().double()) for t in grams)
    norms = np.linalg.norm(ring, axis=1)
    d_norms = np.linalg.norm(ring - np.roll(ring, 1, axis=0), axis=1)
    tiny = np.finfo(np.float64).tiny

    def worst(actual, expected, mask, scale) -> float:
        if not mask.any():
            return 0.0
        err = np.abs(actual - expected)[mask] / np.maximum(scale[mask], tiny)
        return float(err.max())

    return {
        "gram": worst(gram, G, valid[:, None] & valid[None, :], np.outer(norms, norms)),
        "dr_gram": worst(
            dr_gram, H, valid_d[:, None] & valid_d[None, :], np.outer(d_norms, d_norms)
        ),
        "dr_rhs": worst(dr_rhs, c, valid_d & valid[head], d_norms * norms[head]),
    }

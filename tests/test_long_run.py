"""Long runs: 10,000 steps in constant memory, with an incremental Gram matrix that never drifts.

The window's Gram matrix is updated one row per step. Each row is recomputed from the stored
vectors (never by an update formula), so its error must stay at the rounding level of a
single float64 dot product however long the run: we compare it with the Gram recomputed in
NumPy from the stored residuals against the a-priori bound of docs/reliability.md.
"""

from __future__ import annotations

import os

import numpy as np
import optree
import pytest
import torch

import aadl_func as aa
from aadl_func import sgd

STATM = "/proc/self/statm"


def _rss_bytes() -> int | None:
    if not os.path.exists(STATM):
        return None
    with open(STATM) as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state_bytes(state) -> tuple[int, int]:
    leaves = [t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    return len(leaves), sum(t.numel() * t.element_size() for t in leaves)


def _gram_check(state, num_valid: int) -> float:
    """Asserts |state.gram - R R^T| <= 2 gamma_n |R| |R|^T on the valid slots (Higham's dot
    product bound, for our sum and NumPy's); returns the largest error / max diagonal."""
    q = len(state.residuals)
    head = int(state.head)
    valid = [(head - age) % q for age in range(num_valid)]
    R = np.stack([state.residuals[s].double().numpy().ravel() for s in valid])
    exact = R @ R.T
    n = R.shape[1]
    gamma_n = n * 2.0**-53 / (1 - n * 2.0**-53)
    bound = 2 * gamma_n * (np.abs(R) @ np.abs(R).T)
    gram = state.gram.numpy()[np.ix_(valid, valid)]
    assert np.all(np.abs(gram - exact) <= bound), "the incremental Gram drifted"
    assert np.array_equal(state.gram.numpy(), state.gram.numpy().T)
    return float(np.abs(gram - exact).max() / np.abs(np.diag(exact)).max())


def _noisy_quadratic(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    curvature = torch.rand(n, generator=gen) + 0.1
    optimum = torch.randn(n, generator=gen)

    def grads(x):
        # Stochastic gradients keep the window's differences O(lr * noise) for the whole run.
        return curvature * (x - optimum) + 0.01 * torch.randn(n, generator=gen)

    return grads


def test_ten_thousand_steps():
    """n = 1000, history_depth = 5, in place: constant state size, RSS flat between steps
    1,000 and 10,000, the Gram within the rounding bound at every checkpoint, params finite."""
    n, steps = 1000, 10_000
    opt = aa.anderson(sgd(0.1), history_depth=5, relaxation=0.5)
    grads_of = _noisy_quadratic(n)
    x = torch.randn(n)
    state = opt.init(x)
    sizes, rss, drift = {}, {}, []
    for k in range(1, steps + 1):
        x, state = opt.update(state, x, grads_of(x), inplace=True)
        if k in (100, 1000, 2500, 5000, 7500, 10_000):
            sizes[k] = _state_bytes(state)
            rss[k] = _rss_bytes()
            drift.append(_gram_check(state, int(state.window_size) - 1))
            assert torch.isfinite(x).all()
    assert sizes[100] == sizes[10_000], "the state grew"
    assert len(set(sizes.values())) == 1
    # The window: the anchor and 4 differences (float32), and a 4x4 float64 Gram.
    window = _state_bytes((state.anchor, state.residuals, state.gram))
    assert window == (6, 5 * n * 4 + 16 * 8)
    assert int(state.num_mixed) == steps - 2 and int(state.num_nonfinite) == 0
    if rss[1000] is not None:
        # Tensors of a step are freed at once; leaking one small tensor per step (~250 B)
        # would add > 2 MiB over these 9,000 steps.
        growth = rss[10_000] - rss[1000]
        print(f"RSS growth {growth} B, max drift {max(drift):.2e}")
        assert growth <= 2 << 20, f"RSS grew {growth} bytes"
    assert max(drift) <= 1e-13


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_gram_does_not_drift_out_of_place(mode: str):
    """1,000 out-of-place steps in both modes (classic stores g(x) - x) with float64 params."""
    n = 200
    opt = aa.anderson(sgd(0.1, momentum=0.5), history_depth=6, mode=mode)
    grads_of = _noisy_quadratic(n, seed=1)
    x = torch.randn(n, dtype=torch.float64)
    state = opt.init(x)
    first = None
    for k in range(1, 1001):
        x, state = opt.update(state, x, grads_of(x.float()).double())
        if k % 250 == 0:
            num_valid = int(state.window_size) - (1 if mode == "aadl" else 0)
            assert _gram_check(state, num_valid) <= 1e-13
            first = first or _state_bytes(state)
            assert _state_bytes(state) == first
    assert torch.isfinite(x).all() and int(state.num_nonfinite) == 0

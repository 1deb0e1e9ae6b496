"""The operators aadl_func registers with ``torch.library``: ``torch.library.opcheck`` and
their ``vmap`` rules.

``aadl_func::gram_row``, ``aadl_func::difference_rows`` and ``aadl_func::combine`` (the
window's passes, run member by member under ``vmap``) and ``aadl_func::copy_if_`` (the masked
slot write of a compiled step) are reached through ``torch.ops``, as torch itself dispatches
them. For each, on realistic inputs (window slots as rows of one ring buffer and as separate
tensors; float32, float64 and bf16 windows; float32/float64 compute dtypes):

* ``opcheck``: the schema (mutation and aliasing as declared), the fake (meta) kernel against
  the real one, the autograd registration, and AOT dispatch with dynamic shapes;
* the values against float64 NumPy (the formulas of ``aadl_func/_src/vmap_rules.py``'s docstring);
* the ``vmap`` rule: a batched call equals the members' own calls bit for bit (the rule runs
  each member's eager pass), with batched and unbatched arguments mixed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import vmap

import aadl_func  # noqa: F401  (registers the operators)

OPS = torch.ops.aadl_func
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
Q, N = 4, 37  # slots, entries per slot (odd: no chunk or vector width divides it)


def slots(dtype: torch.dtype, layout: str, seed: int = 0, batch: tuple[int, ...] = ()):
    """``Q`` window slots of ``N`` entries: rows of one ``(Q, N)`` buffer (the ring's layout)
    or separate tensors; with ``batch``, each slot has those leading dimensions."""
    gen = torch.Generator().manual_seed(seed)
    ring = torch.randn(*batch, Q, N, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "ring":
        return list(ring.unbind(-2))
    return [ring[..., s, :].clone() for s in range(Q)]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def dot_tolerance(rows, vector) -> np.ndarray:
    """|fl(<a, b>) - <a, b>| <= n u |a|.|b| for float64 sums of exact products."""
    R = np.abs(np.stack([as_numpy(r) for r in rows]))
    return N * 2.0**-53 * (R @ np.abs(as_numpy(vector))) + 1e-300


# -- opcheck -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["ring", "separate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gram_row(dtype, layout):
    rows = slots(dtype, layout)
    vector = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.library.opcheck(OPS.gram_row, (rows, vector))
    got = OPS.gram_row(rows, vector)
    assert got.dtype == torch.float64 and got.shape == (Q,)
    expected = np.stack([as_numpy(r) for r in rows]) @ as_numpy(vector)
    assert np.all(np.abs(got.numpy() - expected) <= dot_tolerance(rows, vector))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("slot", [0, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_difference_rows(dtype, slot, exact):
    rows = slots(dtype, "ring")
    torch.library.opcheck(OPS.difference_rows, (rows, slot, exact))
    g, p = OPS.difference_rows(rows, slot, exact)
    R = np.stack([as_numpy(r) for r in rows])
    assert g.dtype == p.dtype == torch.float64 and g.shape == (Q,)
    assert np.all(np.abs(g.numpy() - R @ R[slot]) <= dot_tolerance(rows, rows[slot]))
    if exact:  # <r_t, r_s - r_{s-1}>, the ring predecessor of slot 0 being the last slot
        d = R[slot] - R[slot - 1]
        bound = N * 2.0**-53 * (np.abs(R) @ np.abs(d)) + 1e-300
        assert np.all(np.abs(p.numpy() - R @ d) <= 2 * bound)
    else:
        assert p.shape == (0,)


# (window dtype, compute dtype): the weights and the result are in the compute dtype (the
# params' dtype, or float32 for a bf16 window of float32 params).
COMBINE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float64),
]


@pytest.mark.parametrize("with_base", [False, True], ids=["no-base", "base"])
@pytest.mark.parametrize("layout", ["ring", "separate"])
@pytest.mark.parametrize("dtypes", COMBINE_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_combine(dtypes, layout, with_base):
    window, compute = dtypes
    rows = slots(window, layout)
    gen = torch.Generator().manual_seed(2)
    weights = torch.randn(Q, generator=gen, dtype=torch.float64).to(compute)
    base = torch.randn(N, generator=gen, dtype=torch.float64).to(compute) if with_base else None
    torch.library.opcheck(OPS.combine, (base, rows, weights))
    got = OPS.combine(base, rows, weights)
    assert got.dtype == compute and got.shape == (N,)
    R = np.stack([as_numpy(r) for r in rows])
    expected = as_numpy(weights) @ R + (as_numpy(base) if with_base else 0.0)
    # Accumulated in the compute dtype: Q + 1 roundings of terms up to |w|.|R|.
    scale = np.abs(as_numpy(weights)) @ np.abs(R) + (np.abs(as_numpy(base)) if with_base else 0)
    assert np.all(np.abs(as_numpy(got) - expected) <= (Q + 2) * torch.finfo(compute).eps * scale)


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_if(dtype, hit):
    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(Q, N, generator=gen).to(dtype)
    src = torch.randn(Q, N, generator=gen).to(dtype)
    mask = torch.tensor(hit)
    torch.library.opcheck(OPS.copy_if_, (dst.clone(), mask, src))
    before = dst.clone()
    assert OPS.copy_if_(dst, mask, src) is None
    assert torch.equal(dst, src if hit else before)


# -- the vmap rules ----------------------------------------------------------------------------

B = 3  # members


@pytest.mark.parametrize("batched_vector", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gram_row_vmap_runs_each_member(dtype, batched_vector):
    rows = slots(dtype, "ring", batch=(B,))
    vector = torch.randn(B, N, generator=torch.Generator().manual_seed(4)).to(dtype)
    if not batched_vector:
        vector = vector[0]
    in_dims = (0, 0 if batched_vector else None)
    got = vmap(OPS.gram_row, in_dims=in_dims)(rows, vector)
    for b in range(B):
        member = vector[b] if batched_vector else vector
        assert torch.equal(got[b], OPS.gram_row([r[b] for r in rows], member))


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_difference_rows_vmap_runs_each_member(dtype, exact):
    rows = slots(dtype, "ring", batch=(B,))
    g, p = vmap(OPS.difference_rows, in_dims=(0, None, None))(rows, 1, exact)
    assert g.shape == (B, Q) and p.shape == (B, Q if exact else 0)
    for b in range(B):
        g_b, p_b = OPS.difference_rows([r[b] for r in rows], 1, exact)
        assert torch.equal(g[b], g_b) and torch.equal(p[b], p_b)


@pytest.mark.parametrize("batched_weights", [True, False])
@pytest.mark.parametrize("dtypes", COMBINE_DTYPES, ids=lambda d: f"{d[0]}-{d[1]}")
def test_combine_vmap_runs_each_member(dtypes, batched_weights):
    window, compute = dtypes
    rows = slots(window, "ring", batch=(B,))
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(B, Q, generator=gen, dtype=torch.float64).to(compute)
    base = torch.randn(B, N, generator=gen, dtype=torch.float64).to(compute)
    if not batched_weights:
        weights = weights[0]
    in_dims = (0, 0, 0 if batched_weights else None)
    got = vmap(OPS.combine, in_dims=in_dims)(base, rows, weights)
    for b in range(B):
        w = weights[b] if batched_weights else weights
        assert torch.equal(got[b], OPS.combine(base[b], [r[b] for r in rows], w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_if_vmap_masks_each_member(dtype):
    gen = torch.Generator().manual_seed(6)
    dst = torch.randn(B, N, generator=gen).to(dtype)
    src = torch.randn(B, N, generator=gen).to(dtype)
    before = dst.clone()
    mask = torch.tensor([True, False, True])
    vmap(OPS.copy_if_, out_dims=None)(dst, mask, src)  # no output: it writes dst
    for b in range(B):
        assert torch.equal(dst[b], src[b] if mask[b] else before[b])
    # One mask for all members, and an unbatched source broadcast to every member.
    vmap(OPS.copy_if_, in_dims=(0, None, None), out_dims=None)(dst, torch.tensor(True), src[0])
    assert torch.equal(dst, src[0].expand(B, N))

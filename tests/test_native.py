"""The native Gram-row kernel (aadl_func/_src/_dots.c) against float64 NumPy references.

The kernel replaces, on the CPU, the torch pass that widens a float32/bf16 window to float64
before multiplying; it must give the exact products summed in float64 (so NumPy's float64
dot of the widened data, to summation rounding), the same result for any thread count, the
same residual bits as ``torch.sub``, and must fall back to the torch path -- not fail --
when it was not built at install time, does not load, or does not apply. It is loaded only
from the package's own directory, and nothing is built or written at run time.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optree
import pytest
import torch

import aadl_func as aa
from aadl_func._src import native
from aadl_func._src.core import lstsq
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.exec import steady_weights
from aadl_func._src.window import known_rows

HAS_COMPILER = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
KERNEL = aa.kernel_info()
needs_kernel = pytest.mark.skipif(KERNEL["kernel"] != "native", reason=KERNEL["reason"])

# Lengths around the block size and the 8-element inner step; row counts around the group of 4.
LENGTHS = [
    0,
    1,
    7,
    8,
    9,
    15,
    17,
    native.BLOCK - 1,
    native.BLOCK,
    native.BLOCK + 1,
    3 * native.BLOCK + 5,
]
ROWS = [1, 2, 3, 4, 5, 8, 9]


def reference_dots(rows: list[torch.Tensor], vector: torch.Tensor) -> np.ndarray:
    """float64 NumPy dot products of the widened data (exact products, float64 sums)."""
    matrix = np.stack([r.to(torch.float64).numpy() for r in rows]) if rows else np.zeros((0, 0))
    return matrix @ vector.to(torch.float64).numpy()


def random_rows(q: int, n: int, dtype: torch.dtype, seed: int, offset: int = 0) -> list:
    """``q`` rows of one buffer starting ``offset`` elements in (unaligned for odd offsets),
    with magnitudes spread over many binades so that the summation order matters."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.exp(4 * torch.randn(q * n + offset, generator=generator, dtype=torch.float64))
    data = (torch.randn(q * n + offset, generator=generator, dtype=torch.float64) * scale).to(dtype)
    return [data[offset + j * n : offset + (j + 1) * n] for j in range(q)]


def assert_dots_close(got: torch.Tensor, rows: list, vector: torch.Tensor) -> None:
    expected = reference_dots(rows, vector)
    # Summation rounding: each partial sum is off by at most n eps sum_i |r_i v_i|.
    magnitude = reference_dots([r.abs() for r in rows], vector.abs())
    n = max(vector.shape[0], 1)
    assert got.dtype == torch.float64 and got.shape == (len(rows),)
    np.testing.assert_array_less(
        np.abs(got.numpy() - expected), 4 * n * 2.0**-53 * magnitude + 1e-300
    )


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("q", ROWS)
def test_dots_match_numpy_float64(dtype, n, q):
    rows = random_rows(q, n, dtype, seed=q * 1000 + n, offset=q % 3)
    vector = rows[q // 2]
    assert_dots_close(native.float64_dots(rows, vector), rows, vector)
    other = random_rows(1, n, dtype, seed=n + 17)[0]
    assert_dots_close(native.float64_dots(rows, other), rows, other)


@needs_kernel
def test_dots_are_exact_where_float32_products_would_round():
    # 1 + 2^-23 squared = 1 + 2^-22 + 2^-46: a float32 product drops the 2^-46 term, a
    # float32 sum of (2^24 + 1) ones drops the last one; float64 keeps both.
    a = torch.tensor([1 + 2.0**-23], dtype=torch.float32)
    assert native.float64_dots([a], a).item() == (1 + 2.0**-23) ** 2
    ones = torch.ones(2**24 + 1, dtype=torch.float32)
    assert native.float64_dots([ones], ones).item() == 2**24 + 1


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dots_do_not_depend_on_thread_count(dtype):
    rows = random_rows(6, 300_001, dtype, seed=3)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(native.float64_dots(rows, rows[2]))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(results[0], r) for r in results[1:])


@needs_kernel
@pytest.mark.parametrize("n", [0, 5, native.BLOCK + 3, 50_001])
def test_append_differences_writes_torch_sub_bits_and_returns_the_row(n):
    q, slot = 5, 3
    rows = [r.clone() for r in random_rows(q, n, torch.float32, seed=n)]
    newest, anchor = random_rows(2, n, torch.float32, seed=n + 1)
    newest, anchor = newest.clone(), anchor.clone()
    expected_residual = torch.sub(newest, anchor)
    others = [r.clone() for r in rows]
    versions = (rows[slot]._version, anchor._version)

    (row,) = native.append_differences([(rows, newest, anchor)], slot)

    assert torch.equal(rows[slot], expected_residual)  # bit for bit
    assert torch.equal(anchor, newest)
    assert all(torch.equal(rows[j], others[j]) for j in range(q) if j != slot)
    assert_dots_close(row, rows, rows[slot])
    assert rows[slot]._version > versions[0] and anchor._version > versions[1]


def leaf_windows(sizes: list[int], q: int, seed: int) -> tuple[list, list, list]:
    """Per leaf of each size: ``q`` slots in one buffer (as ``anderson.init`` lays them
    out), a newest iterate and an anchor."""
    slots, newest, anchor = [], [], []
    for i, n in enumerate(sizes):
        slots.append([r.clone() for r in random_rows(q, n, torch.float32, seed=seed + i)])
        slots[-1] = list(torch.stack(slots[-1]).unbind(0))
        new, old = random_rows(2, n, torch.float32, seed=seed + 100 + i)
        newest.append(new.clone())
        anchor.append(old.clone())
    return slots, newest, anchor


@needs_kernel
@pytest.mark.parametrize("sizes", [[5], [native.BLOCK + 3, 7, 64], [50_001, 1, 3 * native.BLOCK]])
def test_leaf_rows_sum_the_leaves_rows_in_leaf_order(sizes):
    """`LeafRows` (one native call for a whole tree) against one `append_differences` /
    `float64_dots` per leaf added up in Python in leaf order (the steady call's sums before
    it): the same bytes in the window and the same row, for any thread count; and the row
    within summation rounding of NumPy's float64 dots."""
    q, slot = 5, 2
    slots, newest, anchor = leaf_windows(sizes, q, seed=len(sizes))
    ref_slots = [[s.clone() for s in leaf] for leaf in slots]
    ref_anchor = [a.clone() for a in anchor]
    parts = native.append_differences(list(zip(ref_slots, newest, ref_anchor)), slot)
    expected = parts[0].tolist()
    for part in parts[1:]:
        expected = [a + b for a, b in zip(expected, part.tolist())]
    dots = [0.0] * q
    for leaf in ref_slots:
        dots = [a + b for a, b in zip(dots, native.float64_dots(leaf, leaf[slot]).tolist())]
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            window = [[s.clone() for s in leaf] for leaf in slots]
            anchors = [a.clone() for a in anchor]
            rows = native.LeafRows(window, anchors)
            rows.append(slot, newest)
            assert rows.row() == expected
            rows.dots(slot)
            assert rows.row() == dots
            for got, want in zip(window + [anchors], ref_slots + [ref_anchor]):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        torch.set_num_threads(previous)
    flat = [torch.cat([leaf[j] for leaf in ref_slots]) for j in range(q)]
    assert_dots_close(torch.tensor(expected, dtype=torch.float64), flat, flat[slot])


@needs_kernel
@pytest.mark.parametrize("scale", [1.0, -2e-3, -1 / 3, 7e4])
@pytest.mark.parametrize("sizes", [[5], [native.BLOCK + 3, 7, 64], [50_001, 1, 3 * native.BLOCK]])
def test_leaf_rows_append_takes_the_plain_step_and_the_maxima_in_its_pass(sizes, scale):
    """`LeafRows.append` with steps: `newest += steps * scale` as torch's `mul_()` (a
    Python number taken as a float32) and `add_()` round it, then the append, in one pass:
    the bytes of the params, the window and the row of a `mul_()` and an `add_()` followed
    by the append, for any thread count, the steps as they were, and the kernel's mark;
    `maxima` the largest |value| of the new slot and of `y`."""
    q, slot = 4, 1
    slots, newest, anchor = leaf_windows(sizes, q, seed=7 + len(sizes))
    generator = torch.Generator().manual_seed(len(sizes))
    # Steps of every magnitude around the params' (every rounding of the addition), and -0.
    steps = [torch.randn(n, generator=generator) * torch.logspace(-9, 1, n) for n in sizes]
    steps[0][0] = -0.0
    ref_slots = [[t.clone() for t in leaf] for leaf in slots]
    ref_newest, ref_anchor = [t.clone() for t in newest], [t.clone() for t in anchor]
    for y, u in zip(ref_newest, steps):
        y.add_(u if scale == 1.0 else u.clone().mul_(scale))
    passed = [u.clone() for u in steps]
    ref_rows = native.LeafRows(ref_slots, ref_anchor)
    ref_rows.append(slot, ref_newest)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            window = [[t.clone() for t in leaf] for leaf in slots]
            params, anchors = [t.clone() for t in newest], [t.clone() for t in anchor]
            rows = native.LeafRows(window, anchors)
            assert rows.stepped.value == 0 and rows.maxima.isinf().all()
            rows.append(slot, params, steps, scale)
            assert rows.stepped.value == 1
            assert all(torch.equal(u, v) for u, v in zip(steps, passed))
            assert rows.row() == ref_rows.row()
            for got, want in zip(
                [params, anchors, *window], [ref_newest, ref_anchor, *ref_slots]
            ):  # fmt: skip
                assert [t.numpy().tobytes() for t in got] == [t.numpy().tobytes() for t in want]
            new_slot = torch.cat([leaf[slot] for leaf in window])
            assert rows.maxima[slot].item() == new_slot.abs().max().item()
            assert rows.maxima[q].item() == torch.cat(params).abs().max().item()
            others = [j for j in range(q) if j != slot]
            assert rows.maxima[others].isinf().all()  # (not appended since made)
            rows.measure(window)  # ... or read from the window as it is
            for j in range(q):
                want = torch.cat([leaf[j] for leaf in window]).abs().max().item()
                assert rows.maxima[j].item() == want
    finally:
        torch.set_num_threads(previous)
    window[-1][0][-1] = math.nan
    window[0][2][0] = -math.inf
    rows.measure(window)
    assert rows.maxima[0].isnan() and rows.maxima[2].item() == math.inf
    empty = native.LeafRows([[torch.zeros(0)] * q, [torch.ones(2)] * q], [torch.zeros(0)] * 2)
    empty.measure([[torch.zeros(0)] * q, [torch.ones(2)] * q])
    assert empty.maxima[:q].tolist() == [1.0] * q


@needs_kernel
def test_mix_bounded_says_finite_only_where_no_rounding_can_overflow():
    """`LeafRows.mix_bounded`: True exactly where max|y| + sum_j |w_j| max|s_j| is at most
    half of float32's largest value (then the mix, rounded in any order, is finite); not
    where a maximum is inf or NaN; and a mix it declines can overflow (the pass decides)."""
    big = torch.finfo(torch.float32).max
    q = 3
    slots = [[torch.zeros(4) for _ in range(q)]]
    rows = native.LeafRows(slots, [torch.zeros(4)])
    weights = torch.tensor([1.0, -2.0, 0.5])
    for scale, want in [(1e37, True), (big / 4, False), (big / 8, False), (big / 10, True)]:
        # bound: y + 1 * s_0 + 2 * s_1 + 0.5 * s_2 with every maximum `scale`: 4.5 scale
        rows.maxima.fill_(scale)
        assert rows.mix_bounded(weights) == (4.5 * scale <= big / 2) == want
    rows.maxima.fill_(1.0)
    for bad in (math.inf, math.nan):
        for j in range(q + 1):
            rows.maxima[j] = bad
            assert not rows.mix_bounded(weights)
            rows.maxima[j] = 1.0
        assert not rows.mix_bounded(torch.tensor([1.0, bad, 0.0]))
    # Within the bound's factor of 2 of overflowing, a mix can overflow: y + s, both big / 2.
    y, s = torch.full((4,), big / 2 * 1.5), torch.full((4,), big / 2 * 1.5)
    assert torch.isinf(y + s).all()
    rows.maxima.copy_(torch.tensor([big * 0.75, 0.0, 0.0, big * 0.75], dtype=torch.float64))
    assert not rows.mix_bounded(torch.tensor([1.0, 0.0, 0.0]))


@needs_kernel
@pytest.mark.skipif(not native.available() or not native._load()[0].aadl_dots_avx2(),
                    reason="the CPU has no AVX2")  # fmt: skip
@pytest.mark.parametrize("q", ROWS)
def test_avx2_dots_give_the_portable_bits(q):
    """The float32 dots in AVX2 (four float64 lanes) and in the portable code (two): the
    same lanes summed in the same order, so the same bytes, at every length around the
    8-element step and the block; and the append's element loop in either (the params,
    the window, the maxima)."""
    library = native._load()[0]
    generator = torch.Generator().manual_seed(q)
    try:
        for n in LENGTHS + [50_001]:
            rows = [torch.randn(n, generator=generator) * 10.0 ** (3 * (r % 3) - 3)
                    for r in range(q)]  # fmt: skip
            vector = torch.randn(n, generator=generator)
            got = []
            for portable in (1, 0):
                assert library.aadl_portable_dots(portable) == 1 - portable
                window, anchor = [[t.clone() for t in rows]], [vector.clone()]
                leaf = native.LeafRows(window, anchor)
                y = [vector * 3]
                leaf.append(q // 2, y, [vector * 1e-3], -1 / 3)  # (the element loop's too)
                got.append((
                    native.float64_dots(rows, vector).numpy().tobytes(),
                    leaf.row(),
                    [t.numpy().tobytes() for t in (*window[0], *anchor, *y, leaf.maxima)],
                ))  # fmt: skip
            assert got[0] == got[1]
    finally:
        library.aadl_portable_dots(0)


@needs_kernel
@pytest.mark.parametrize("q", [1, 2, 6])
def test_leaf_rows_known_rows_are_the_python_rows(q):
    """`LeafRows.known_rows` (the steady call's Gram rows of an append, natively) against
    `window.known_rows` on Python floats, for every slot: the same bytes, and whether they
    are finite (an infinity or a NaN in the new row or in the row before)."""
    generator = torch.Generator().manual_seed(q)
    rows = native.LeafRows([[torch.zeros(3) for _ in range(q)]], [torch.zeros(3)])
    before = torch.randn(q, generator=generator, dtype=torch.float64) * 1e3
    for bad in (None, float("inf"), float("nan")):
        for slot in range(q):
            g = torch.randn(q, generator=generator, dtype=torch.float64)
            if bad is not None:
                (g if slot % 2 or q == 1 else before)[slot - 1] = bad
            rows.out.copy_(g)
            finite = rows.known_rows(before.data_ptr(), slot)
            want = known_rows(g.tolist(), before.tolist(), slot)
            got = rows.values.view(3, q)
            assert [r.numpy().tobytes() for r in got] == [
                torch.tensor(r, dtype=torch.float64).numpy().tobytes() for r in want
            ]
            assert finite == all(math.isfinite(v) for r in want for v in r) == (bad is None)
            before[slot - 1] = 0.5  # (finite again)
    with pytest.raises(RuntimeError, match="slot"):
        rows.known_rows(before.data_ptr(), q)


@needs_kernel
def test_system_inverse_and_weights_are_the_python_steps():
    """`System.cutoff_inverse` and `System.aadl_weights` (the steady call's scalar steps of
    the small solve, natively) against their Python twins, byte for byte: the cut-off
    inverse (`lstsq._cutoff_inverse`) on eigenvalues negative, -0.0, NaN, below and above
    `RTOL`, with and without a ridge; the weights (`_known_affine`, `aadl_coefficients`
    negated, or mode "classic"'s `classic_coefficients` and scaled alpha, the ring order and
    the float32 rounding of `float32_weights`) for every slot,
    two relaxations and gammas whose weights overflow float32 or round to subnormals; None
    for a gamma that is not finite."""
    q = 6
    zeros = torch.zeros(q, q, dtype=torch.float64)
    system = native.System(zeros, zeros.clone(), torch.zeros(q, dtype=torch.float64))
    eigvals = torch.tensor([-1e-3, -0.0, float("nan"), 1e-14, 2.5], dtype=torch.float64)
    for reg in (0.0, 1e-13, 0.3):
        got = system.cutoff_inverse(eigvals, reg).numpy().tobytes()
        assert got == lstsq._cutoff_inverse(eigvals, reg).numpy().tobytes()
    generator = torch.Generator().manual_seed(0)
    gammas = [torch.randn(q - 1, generator=generator, dtype=torch.float64) * s
              for s in (1.0, 1e3, 1e-40, 1e39)]  # fmt: skip
    for gamma, relaxation, head in itertools.product(gammas, (1.0, 0.5), range(q)):
        alpha = [b - a for a, b in itertools.pairwise([0.0, *gamma.tolist(), 1.0])]
        minus_c = aadl_coefficients(alpha, relaxation, negated=True)
        want = steady_weights.float32_weights(head, minus_c).numpy().tobytes()
        assert system.aadl_weights(gamma, relaxation, head).numpy().tobytes() == want
        scaled = [relaxation * a for a in alpha]
        want = steady_weights.float32_weights(head, classic_coefficients(alpha), scaled)
        got = system.classic_weights(gamma, relaxation, head)
        assert got.numpy().tobytes() == want.numpy().tobytes()
    poisoned = torch.tensor([0.0, float("inf"), 0.0, 0.0, 1.0], dtype=torch.float64)
    assert system.aadl_weights(poisoned, 1.0, 0) is None
    assert system.classic_weights(poisoned.neg(), 1.0, 0) is None
    with pytest.raises(RuntimeError, match="slot"):
        system.aadl_weights(gammas[0], 1.0, q)


@needs_kernel
def test_commit_rows_writes_what_torch_writes():
    """`commit_rows` against the same writes done by torch: row and column `slot` of both
    Grams, `dr_rhs`, the counters; every other byte as it was."""
    q, slot = 6, 4
    generator = torch.Generator().manual_seed(0)
    gram, dr_gram = (torch.randn(q, q, generator=generator, dtype=torch.float64) for _ in "ab")
    dr_rhs = torch.randn(q, generator=generator, dtype=torch.float64)
    count, head = torch.tensor(41), torch.tensor(3)
    g, h, c = (torch.randn(q, generator=generator, dtype=torch.float64) for _ in "ghc")
    g[1], h[2], c[0] = -0.0, float("nan"), float("inf")  # stored as they are
    want = [t.clone() for t in (gram, dr_gram, dr_rhs)]
    for matrix, row in zip(want, (g, h)):
        matrix[slot], matrix[:, slot] = row, row
    want[2].copy_(c)
    values = (ctypes.c_double * (3 * q))(*g.tolist(), *h.tolist(), *c.tolist())
    native.commit_rows([gram, dr_gram, dr_rhs], slot, values,
                       native.pointers([count, head]), (ctypes.c_int64 * 2)(42, 5))  # fmt: skip
    for got, expected in zip((gram, dr_gram, dr_rhs), want):
        assert got.numpy().tobytes() == expected.numpy().tobytes()
    assert (int(count), int(head)) == (42, 5)


@needs_kernel
def test_finite_f32_flags_every_infinity_and_nan():
    """`finite_f32` against `torch.isfinite`: the largest finite value, subnormals and -0.0
    are finite; both infinities and NaNs of any payload and sign are not, wherever they sit
    (first, last, inside a block of 8), on one thread or several."""
    bits = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001]
    special = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32))
    finite = torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -0.0, 1.0])
    assert native.finite_f32(finite) and torch.isfinite(finite).all()
    for n in (1, 9, 1000, 1 << 17):  # the last one shared among threads
        base = torch.randn(n)
        assert native.finite_f32(base)
        for value in special:
            for at in {0, n // 2, n - 1}:
                x = base.clone()
                x[at] = value
                assert not native.finite_f32(x) and not torch.isfinite(x).all()


@needs_kernel
def test_append_differences_takes_contiguous_tensors_of_any_shape_as_their_flat_views():
    """A (32, 64) weight's window slots go to the kernel as they are (no flat view per slot):
    the same bits as the flat views; a channels_last tensor (not C-contiguous) is refused."""
    q, slot, shape = 4, 2, (32, 64)
    rows = [torch.randn(shape) for _ in range(q)]
    newest, anchor = torch.randn(shape), torch.randn(shape)
    flat = ([r.clone().reshape(-1) for r in rows], newest.reshape(-1), anchor.clone().reshape(-1))
    (row,) = native.append_differences([(rows, newest, anchor)], slot)
    (flat_row,) = native.append_differences([flat], slot)
    assert torch.equal(row, flat_row)
    assert all(torch.equal(r.reshape(-1), f) for r, f in zip(rows, flat[0]))
    assert torch.equal(anchor, newest)
    image = [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last) for _ in range(q)]
    y, a = (torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last) for _ in range(2))
    assert not native.can_append(image, slot, y, a)


@needs_kernel
def test_append_differences_refuses_overlaps_and_other_dtypes_without_writing():
    q, n = 3, 100
    buffer = torch.randn(q * n)
    rows = [buffer[j * n : (j + 1) * n] for j in range(q)]
    newest, anchor = torch.randn(n), torch.randn(n)
    before = buffer.clone(), newest.clone(), anchor.clone()
    refused = [
        (rows, 1, rows[1], anchor),  # newest is the slot
        (rows, 1, newest, buffer[n + 50 : 2 * n + 50]),  # anchor overlaps the slot
        (rows, 1, newest, newest),  # anchor is newest
        (rows, 3, newest, anchor),  # no such slot
        (rows, 1, newest.double(), anchor.double()),  # not float32
        (rows, 1, newest[::2], anchor[::2]),  # not stride 1, wrong length
    ]
    for rows_, slot, newest_, anchor_ in refused:
        assert not native.can_append(rows_, slot, newest_, anchor_)
        assert native.append_differences([(rows_, newest_, anchor_)], slot) is None
    # All or nothing: one refused leaf keeps the other, valid one from being written.
    fine = ([torch.zeros(n) for _ in range(q)], torch.randn(n), torch.randn(n))
    fine_before = [t.clone() for t in (*fine[0], fine[1], fine[2])]
    assert native.append_differences([fine, (rows, rows[1], anchor)], 1) is None
    assert all(torch.equal(a, b) for a, b in zip((*fine[0], fine[1], fine[2]), fine_before))
    assert torch.equal(buffer, before[0]) and torch.equal(newest, before[1])
    assert torch.equal(anchor, before[2])


@needs_kernel
def test_dots_decline_what_they_do_not_handle():
    x = torch.randn(10)
    assert native.float64_dots([x.double()], x.double()) is None  # float64: BLAS does it
    assert native.float64_dots([x.half()], x.half()) is None  # fp16: torch path
    assert native.float64_dots([x[::2]], x[::2]) is None  # strided
    assert native.float64_dots([x.reshape(2, 5)], x.reshape(2, 5)) is None  # not 1-d
    assert native.float64_dots([x.bfloat16()], x) is None  # mixed dtypes
    assert native.float64_dots([], x) is None


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")
def test_kernel_is_built_where_a_compiler_exists():
    # Guards against a silent fallback (a failed optional build at install time, a stale
    # in-place build of an editable install) making every run slow.
    info = aa.kernel_info()
    assert info["kernel"] == "native", info["reason"]
    assert info == {
        "kernel": "native",
        "library": str(native.LIBRARY),  # the package's own library
        "reason": f"native kernel: {native.LIBRARY}",
    }


def params_and_grads(seed: int):
    generator = torch.Generator().manual_seed(seed)
    params = {
        "conv": torch.randn(4, 3, 5, 5, generator=generator).contiguous(
            memory_format=torch.channels_last
        ),
        "bias": torch.randn(4099, generator=generator),
    }
    grads = [
        optree.tree_map(lambda p: torch.randn(p.shape, generator=generator).to(p), params)
        for _ in range(12)
    ]
    return params, grads


@needs_kernel
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("history_dtype", [None, torch.bfloat16], ids=["f32", "bf16"])
def test_anderson_with_and_without_kernel_agree(inplace, history_dtype):
    """The whole step on the kernel and on the torch path: Gram matrices equal to float64
    summation rounding, params equal to a float32 rounding of the mix."""
    runs = []
    for enabled in (True, False):
        previous = native.set_enabled(enabled)
        try:
            opt = aa.anderson(
                aa.sgd(0.05), history_depth=4, relaxation=0.5, history_dtype=history_dtype
            )
            params, grads = params_and_grads(0)
            params = optree.tree_map(lambda p: p.clone(), params)
            state = opt.init(params)
            for g in grads:
                g = optree.tree_map(lambda t: t.clone(), g)
                params, state = opt.update(state, params, g, inplace=inplace)
            runs.append((params, state))
        finally:
            native.set_enabled(previous)
    (p_on, s_on), (p_off, s_off) = runs
    assert int(s_on.num_mixed) == int(s_off.num_mixed) > 0
    for name in ("gram", "dr_gram", "dr_rhs"):
        a, b = getattr(s_on, name), getattr(s_off, name)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * float(s_off.gram.abs().max()))
    for a, b in zip(optree.tree_leaves(p_on), optree.tree_leaves(p_off)):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def run_fresh_python(code: str, env: dict, cwd=None) -> str:
    """Runs ``code`` in a new interpreter (a fresh kernel loader) and returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# Runs a few steps and reports which shared objects the process mapped.
FALLBACK_RUN = """
    import json, torch, aadl_func as aa
    params = torch.randn(5000)
    opt = aa.anderson(aa.sgd(0.1), history_depth=4)
    state = opt.init(params)
    for _ in range(8):
        params, state = opt.update(state, params, params.clone(), inplace=True)
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps if "_dots" in line})
    info = aa.kernel_info()
    print(info["kernel"] == "native", int(state.num_mixed), bool(torch.isfinite(params).all()))
    print(info["reason"])
    print(json.dumps(mapped))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize(
    "env,library,reason",
    [
        ({"AADL_FUNC_NATIVE": "0"}, None, "disabled"),
        ({}, "missing.so", "unavailable (not built when installed"),
        ({}, "garbage.so", "unavailable (OSError"),
    ],
    ids=["disabled", "not-built", "broken"],
)
def test_without_the_kernel_the_torch_path_runs(tmp_path, env, library, reason):
    code = textwrap.dedent(FALLBACK_RUN)
    if library is not None:  # as if the install had built none, or a broken one
        (tmp_path / "garbage.so").write_bytes(b"not a shared library")
        code = (
            "import pathlib\nfrom aadl_func._src import native\n"
            f"native.LIBRARY = pathlib.Path({str(tmp_path / library)!r})\n{code}"
        )
    first, second, mapped = run_fresh_python(code, env).strip().splitlines()
    assert first == "False 6 True"
    assert reason in second, second
    assert json.loads(mapped) == []  # nothing loaded


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_kernel_is_loaded_from_the_package_only_and_nothing_is_written(tmp_path):
    """The library comes from the package directory, whatever lies in the working directory,
    on the library path or on ``PYTHONPATH`` under the same name; no cache is written."""
    planted = tmp_path / "planted"
    planted.mkdir()
    shutil.copy(native.LIBRARY, planted / native.LIBRARY.name)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "LD_LIBRARY_PATH": str(planted),
        "PYTHONPATH": os.pathsep.join([str(planted), os.environ.get("PYTHONPATH", "")]),
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
    }
    first, second, mapped = run_fresh_python(FALLBACK_RUN, env, cwd=planted).splitlines()
    assert first == "True 6 True"
    assert second == f"native kernel: {native.LIBRARY}"
    assert json.loads(mapped) == [str(native.LIBRARY)]
    assert native.LIBRARY.parent == Path(native.__file__).parent
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["planted", native.LIBRARY.name, "home"]
    )


@needs_kernel
def test_fused_append_under_inference_mode():
    # Inference tensors keep no version counter; the kernel's version bump must cope.
    with torch.inference_mode():
        params, grads = params_and_grads(1)
        opt = aa.anderson(aa.sgd(0.05), history_depth=4)
        state = opt.init(params)
        for g in grads[:6]:
            params, state = opt.update(state, params, g, inplace=True)
    assert int(state.num_mixed) == 4
    assert all(torch.isfinite(p).all() for p in optree.tree_leaves(params))


OPENMP_RUN = """
    import json, os, torch
    from aadl_func._src import native

    def mapped():
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
        return sorted({f[5].strip() for f in fields if len(f) == 6})

    torch.ones(1 << 20).sum()  # torch starts its OpenMP runtime
    before = mapped()
    assert native.available(), native.status()
    print(json.dumps([before, mapped(), native.status()]))
"""


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_kernel_shares_torchs_openmp_runtime():
    # Loaded after torch, the kernel must bind to the OpenMP runtime torch loaded instead of
    # mapping another.
    out = run_fresh_python(OPENMP_RUN, {})
    before, after, status = json.loads(out.strip().splitlines()[-1])
    new = set(after) - set(before)
    assert not [p for p in new if "libgomp" in os.path.basename(p) or "libomp" in p], new
    assert str(native.LIBRARY) in new, new


@needs_kernel
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.99])
def test_a_truncated_library_is_refused_before_it_is_mapped(tmp_path, fraction):
    """A library cut short (a third of it made the loader die of SIGBUS) is refused from its
    ELF headers before ``dlopen``: the torch path runs and nothing is mapped."""
    data = native.LIBRARY.read_bytes()
    (tmp_path / "truncated.so").write_bytes(data[: int(len(data) * fraction)])
    code = (
        "import pathlib\nfrom aadl_func._src import native\n"
        f"native.LIBRARY = pathlib.Path({str(tmp_path / 'truncated.so')!r})\n"
        f"{textwrap.dedent(FALLBACK_RUN)}"
    )
    first, second, mapped = run_fresh_python(code, {}).strip().splitlines()
    assert first == "False 6 True"
    assert "is truncated" in second, second
    assert json.loads(mapped) == []


# Makes two states with CPU windows and reports the warnings and what kernel_info says.
WARNING_RUN = """
    import json, warnings, torch, aadl_func as aa
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = aa.anderson(aa.sgd(0.1), history_depth=4)
        opt.init(torch.randn(100))
        opt.init({"w": torch.randn(3, 3)})
    print(json.dumps([[w.category.__name__, str(w.message)] for w in caught]))
    print(json.dumps(aa.kernel_info()))
"""


@pytest.mark.parametrize(
    "env,library,warns",
    [
        ({}, None, False),
        ({"AADL_FUNC_NATIVE": "0"}, None, False),
        ({}, "missing.so", True),
        ({}, "garbage.so", True),
    ],
    ids=["built", "disabled", "not-built", "broken"],
)
def test_kernel_info_and_the_warning_when_it_is_missing(tmp_path, env, library, warns):
    """``aa.kernel_info()`` names the path that runs; a kernel that should be there and is not
    warns once per process, at the first ``init``; one turned off on purpose does not."""
    if library is None and not env and KERNEL["kernel"] != "native":
        pytest.skip(KERNEL["reason"])
    code = textwrap.dedent(WARNING_RUN)
    if library is not None:
        (tmp_path / "garbage.so").write_bytes(b"not a shared library")
        code = (
            "import pathlib\nfrom aadl_func._src import native\n"
            f"native.LIBRARY = pathlib.Path({str(tmp_path / library)!r})\n{code}"
        )
    caught, info = (json.loads(line) for line in run_fresh_python(code, env).splitlines()[-2:])
    if warns:
        assert len(caught) == 1, caught
        category, message = caught[0]
        assert category == "RuntimeWarning"
        assert "native CPU kernel is not in use" in message and "kernel_info" in message
    else:
        assert caught == []
    native_runs = not warns and not env
    assert info["kernel"] == ("native" if native_runs else "torch")
    assert info["library"] == (str(native.LIBRARY) if native_runs else None)
    assert ("native kernel:" if native_runs else "torch path") in info["reason"]

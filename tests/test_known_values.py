"""The eager step's small arithmetic on Python floats gives the tensor operations' bits.

An eager call on the CPU knows the window's small values (the Gram rows, the `m x m` problem,
the affine weights) and does their elementwise arithmetic in Python floats, IEEE doubles that
round each operation as torch's CPU kernels do; the eigen-decomposition and the
matrix-vector products stay torch operations. Each route is checked here against the tensor
route it replaces, which vmap and torch.compile still run, byte for byte, on windows that
exercise the edges: rank deficiency, a ridge, tiny and huge scales, negative zeros.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aadl_func as aa
from aadl_func._src import native
from aadl_func._src.core import lstsq as solve
from aadl_func._src.core.variants.aadl import aadl_coefficients
from aadl_func._src.core.variants.classic import classic_coefficients
from aadl_func._src.exec import passes
from aadl_func._src.window import known_rows, rows_from_dots


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.int64), b.contiguous().view(torch.int64))
    )


def _window(q: int, n: int, seed: int, *, rank: int | None = None, scale: float = 1.0):
    """Chronological `(H, c, ||f_i||^2)` of `q` random residuals in float64."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(q, n, generator=g, dtype=torch.float64)
    if rank is not None:  # residuals in a subspace: Delta F rank deficient
        f = torch.randn(q, rank, generator=g, dtype=torch.float64) @ f[:rank]
    f = f * scale * torch.logspace(0, -3, q, dtype=torch.float64)[:, None]
    d = f[1:] - f[:-1]
    return d @ d.T, d @ f[-1], (f * f).sum(1)


CASES = [
    dict(q=5, seed=0),
    dict(q=2, seed=1),
    dict(q=8, seed=2),
    dict(q=6, seed=3, rank=2),
    dict(q=5, seed=4, scale=1e-150),
    dict(q=5, seed=5, scale=1e150),
    dict(q=5, seed=6, reg=1e-3),
    dict(q=5, seed=7, rank=1, reg=1e-9),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_solve_known_gives_the_tensor_route_bits(case):
    case = dict(case)
    reg = case.pop("reg", 0.0)
    h, c, norms = _window(n=40, **case)
    expected = solve.solve_differences(h, c, norms, h.shape[0] + 1, reg, residual_norm=False)
    gamma, alpha = solve.solve_known(h.tolist(), c.tolist(), norms.tolist(), reg)
    assert _same_bits(gamma, expected.gamma)
    assert _same_bits(torch.tensor(alpha, dtype=torch.float64), expected.alpha)
    # The coefficients of both modes from the listed weights.
    for relaxation in (1.0, 0.7):
        for negated in (False, True):
            listed = aadl_coefficients(alpha, relaxation, negated=negated)
            tensor = aadl_coefficients(expected.alpha, relaxation, negated=negated)
            assert _same_bits(torch.tensor(listed, dtype=torch.float64), tensor)
    listed = classic_coefficients(alpha)
    assert _same_bits(
        torch.tensor(listed, dtype=torch.float64), classic_coefficients(expected.alpha)
    )


RIDGES = [
    dict(reg_relative=1e-4),
    dict(reg_relative=0.3, reg=1e-6),
    dict(reg_relative=1e-2, scale=1e-150),
    dict(reg_relative=1e-4, scale=1e150),
    dict(reg_relative=1e-3, rank=2),
]


@pytest.mark.parametrize("q", [2, 5, 21])
@pytest.mark.parametrize("case", RIDGES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_known_weights_with_a_relative_ridge_give_the_tensor_route_bits(case, q):
    """`reg_relative` (the recommended full-batch line's 1e-4): the ridge as a Python float
    (`known_ridge`, torch's sum of the diagonal) gives `window_weights()`'s bits, on the Gram
    route and on a float64 window's factor route, for every newest slot."""
    from aadl_func._src.core.grams import Grams
    from aadl_func._src.core.weights import known_weights, window_weights
    from aadl_func._src.exec.ops import OPS
    from aadl_func._src.options import AndersonOptions

    case = dict(case)
    options = AndersonOptions(
        aa.sgd(0.1), reg=case.pop("reg", 0.0), reg_relative=case.pop("reg_relative")
    )
    g = torch.Generator().manual_seed(q)
    f = torch.randn(q, 30, generator=g, dtype=torch.float64) * case.get("scale", 1.0)
    if "rank" in case:
        f = torch.randn(q, case["rank"], generator=g, dtype=torch.float64) @ f[: case["rank"]]
    for newest in range(q):
        ring = f.roll(newest + 1, 0)  # chronological position j in slot (newest + 1 + j) % q
        prev = ring.roll(1, 0)  # the residual before each one (slot s - 1)
        d = ring - prev
        grams = Grams(ring @ ring.T, d @ d.T, d @ ring[newest])
        head, num = torch.tensor(newest), torch.tensor(q)
        device = grams.gram.device
        expected, _, _ = window_weights(options, q, grams, head, num, device, exact=False)
        known = known_weights(options, grams, newest, q, ops=OPS)
        assert known is not None
        assert _same_bits(known[0], expected.gamma)
        assert _same_bits(torch.tensor(known[1], dtype=torch.float64), expected.alpha)
        a = torch.cat([d[(newest + 2 + torch.arange(q - 1)) % q].T, ring[newest : newest + 1].T], 1)
        factor = solve.stack_factors([a])
        expected, _, _ = window_weights(
            options, q, grams, head, num, device, exact=True, factor=factor
        )
        known = known_weights(options, grams, newest, q, factor, ops=OPS)
        assert known is not None
        assert _same_bits(known[0], expected.gamma)
        assert _same_bits(torch.tensor(known[1], dtype=torch.float64), expected.alpha)


def _factor(q: int, n: int, seed: int, *, rank: int | None = None, scale: float = 1.0):
    """The float64 `R` of `[DF | f_last]` for `q` random residuals (`solve.stack_factors`)."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(q, n, generator=g, dtype=torch.float64)
    if rank is not None:
        f = torch.randn(q, rank, generator=g, dtype=torch.float64) @ f[:rank]
    f = f * scale * torch.logspace(0, -3, q, dtype=torch.float64)[:, None]
    a = torch.cat([(f[1:] - f[:-1]).T, f[-1:].T], dim=1)
    return solve.stack_factors([a])


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_solve_factor_known_gives_the_tensor_route_bits(case):
    case = dict(case)
    reg = case.pop("reg", 0.0)
    factor = _factor(n=40, **case)
    valid = torch.ones(factor.shape[0] - 1, dtype=torch.bool)
    expected = solve.solve_factor(factor, valid, reg)
    gamma, alpha = solve.solve_factor_known(factor, reg)
    assert _same_bits(gamma, expected.gamma)
    assert _same_bits(torch.tensor(alpha, dtype=torch.float64), expected.alpha)


@pytest.mark.parametrize("reg", [1e-6, 1e-3, 0.3])
def test_solve_factor_known_rounds_the_ridge_as_torch_does(reg):
    # `reg / scale` with a tensor scale is `scale.reciprocal() * reg` in torch: two roundings,
    # which differ from one division for about one scale in three.
    for seed in range(40):
        factor = _factor(q=4, n=12, seed=seed, scale=1.0 + seed / 7)
        valid = torch.ones(3, dtype=torch.bool)
        expected = solve.solve_factor(factor, valid, reg)
        gamma, _ = solve.solve_factor_known(factor, reg)
        assert _same_bits(gamma, expected.gamma), seed


def test_solve_factor_known_hands_non_finite_factors_back():
    factor = _factor(q=4, n=10, seed=0)
    factor[0, 2] = float("nan")
    assert solve.solve_factor_known(factor) is None


def test_solve_known_hands_non_finite_windows_back():
    h, c, norms = _window(q=4, n=10, seed=0)
    h[1, 2] = float("nan")
    assert solve.solve_known(h.tolist(), c.tolist(), norms.tolist()) is None
    h, c, norms = _window(q=4, n=10, seed=0)
    norms[0] = float("inf")
    assert solve.solve_known(h.tolist(), c.tolist(), norms.tolist()) is None


@pytest.mark.parametrize("slot", [0, 1, 4])
def test_known_rows_give_the_masked_route_bits(slot):
    q = 5
    g_ = torch.Generator().manual_seed(slot)
    f = torch.randn(q, 30, generator=g_, dtype=torch.float64)
    gram = f @ f.T
    gram[2, 3] = gram[3, 2] = -0.0  # a negative zero survives as the tensor route leaves it
    g = torch.randn(q, generator=g_, dtype=torch.float64)
    g[(slot + 2) % q] = -0.0
    slot_t = torch.scalar_tensor(slot, dtype=torch.int64)
    # The route for an unknown slot (vmap, torch.compile): masks instead of Python indices.
    expected = rows_from_dots(g, None, gram, slot_t, None, torch.device("cpu"))
    rows = known_rows(g.tolist(), gram[(slot - 1) % q].tolist(), slot)
    for row, want in zip(rows, expected):
        assert _same_bits(torch.tensor(row, dtype=torch.float64), want)


@pytest.mark.parametrize("newest", [0, 2, 4])
def test_ring_order_of_lists_moves_like_roll(newest):
    a = torch.randn(5, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    assert _same_bits(passes.ring_order(newest, a.tolist()), a.roll(newest + 1))
    assert _same_bits(
        passes.ring_order(newest, a.tolist(), b.tolist()),
        torch.cat([a.roll(newest + 1), b.roll(newest + 1)]),
    )


def test_float32_tensor_rounds_as_torch_converts():
    """`float32_tensor()` (the steady call's mix weights) rounds each Python float as a
    float64 tensor's conversion to float32 does: ties to even, subnormals, overflow to
    infinity, NaN, signed zeros."""
    from aadl_func._src.core.scalars import float32_tensor

    tiny = 2.0**-149  # the smallest float32 subnormal
    values = [
        0.0, -0.0, 1.0, -1.0, 1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, 1.0 - 2.0**-25,
        3.4028235677973366e38, 3.4028236e38, -3.5e38, 1e300, -1e300, math.inf, -math.inf,
        math.nan, tiny, tiny / 2, 1.5 * tiny, 2.5 * tiny, -0.75 * tiny, 1e-50, 1.17549435e-38,
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    mantissas = torch.randn(2000, generator=gen, dtype=torch.float64)
    exponents = torch.randint(-160, 140, (2000,), generator=gen).to(torch.float64)
    values += (mantissas * torch.exp2(exponents)).tolist()
    want = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    got = float32_tensor(values)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("mode", "most"), [("aadl", 18), ("classic", 25)])
def test_small_in_place_step_runs_few_torch_operations(mode, most):
    # One leaf of 2^10, history 5, a full window: the steady state of a small model. The
    # count is deterministic (dispatched operations, not time); it was 107 (aadl) and 125
    # (classic) before the small arithmetic moved to Python floats, 49 and 63 before the
    # counters were written only when they change (a changed one filled with its value) and
    # the Gram row summed in Python floats, 34 and 46 before the mix's float32 weights were
    # rounded from Python floats (no float64 vector to convert), one-dimensional params were
    # mixed without a flat view and classic's new step was subtracted into its slot, 32 and
    # 44 before the commit point's Gram rows and counters and the finiteness test of the mix
    # were written and read by the native kernel, 22 and 33 before a built-in Adam ran by its
    # bound rule (no count tensor), the inner count was written natively and classic's mix
    # kept its matrices' and weights' views.
    opt = aa.anderson(aa.adam(1e-3), history_depth=5, mode=mode)
    x = torch.randn(1 << 10)
    grad = torch.randn(1 << 10) * 1e-2
    state = opt.init(x)
    for _ in range(30):
        _, state = opt.update(state, x, grad, inplace=True)
    assert state.num_mixed.item() > 20
    with _CountOps() as ops:
        _, state = opt.update(state, x, grad, inplace=True)
    assert sum(ops.count.values()) <= most, ops.count.most_common()


@pytest.mark.parametrize("mode", ["classic", "aadl"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_solver_loop_in_place_gives_the_pure_loop_bits(monkeypatch, mode, dtype):
    # The eager solver loop steps a copy of each iterate in place through the core's update
    # (the window keeps init's layout); the pure calls it replaced must give the same
    # iterates, bit for bit. (The loop's own window, solver_eager's, is switched off here:
    # it writes no iterate.)
    from aadl_func._src import solver_eager

    monkeypatch.setattr(solver_eager, "supports", lambda *args: False)

    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 40, generator=g, dtype=torch.float64)
    a = (0.9 * a / torch.linalg.matrix_norm(a, 2)).to(dtype)
    c = torch.randn(40, generator=g, dtype=dtype)

    def solve():
        return aa.fixed_point(
            lambda x: {"x": torch.tanh(a @ x["x"] + c)},
            {"x": torch.zeros(40, dtype=dtype)},
            tol=0.0,
            max_iter=25,
            mode=mode,
            reg=1e-6,
        )

    x_in_place, info_in_place = solve()
    monkeypatch.setattr(solver_eager, "_updates_in_place", lambda x: False)
    x_pure, info_pure = solve()
    assert _same_bits(x_in_place["x"].double(), x_pure["x"].double())
    assert _same_bits(info_in_place.residual_norms, info_pure.residual_norms)
    assert int(info_in_place.iterations) == 25


# The finiteness test of a mix (`passes.finite`): every element of every leaf within the
# params dtype's finite range, judged here by NumPy over every element.
_BAD = [float("nan"), float("inf"), -float("inf"), 1e39, -1e39]


def _numpy_finite(leaves, params) -> bool:
    return all(
        bool(np.all(np.abs(t.double().numpy()) <= np.finfo(np.dtype(str(p.dtype)[6:])).max))
        for t, p in zip(leaves, params)
    )


@pytest.mark.parametrize("bad", _BAD, ids=str)
@pytest.mark.parametrize("leaf", [0, 1, 2])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_finite_judges_every_element_of_every_leaf(bad, leaf, where):
    # float64 mixes of float32 params: 1e39 is finite in float64 yet past float32's range.
    g = torch.Generator().manual_seed(0)
    sizes = [1, 37, 1 << 12]
    leaves = [torch.randn(n, generator=g, dtype=torch.float64) for n in sizes]
    params = [torch.zeros(n, dtype=torch.float32) for n in sizes]
    index = {"first": 0, "middle": sizes[leaf] // 2, "last": sizes[leaf] - 1}[where]
    leaves[leaf][index] = bad
    assert _numpy_finite(leaves, params) is False
    assert passes.finite(leaves, params, True) is False
    leaves[leaf][index] = 0.0
    assert _numpy_finite(leaves, params) is True
    assert passes.finite(leaves, params, True) is True


def test_finite_takes_the_largest_float32_and_skips_empty_leaves():
    top = float(np.finfo(np.float32).max)
    leaves = [torch.tensor([top, -top], dtype=torch.float64), torch.zeros(0)]
    params = [torch.zeros(2), torch.zeros(0)]
    assert passes.finite(leaves, params, True) is _numpy_finite(leaves, params) is True
    assert passes.finite(leaves, params, False) is False  # the solve failed
    assert passes.finite([torch.zeros(0)], [torch.zeros(0)], True) is True


@pytest.mark.skipif(not native.available(), reason="the native kernel is not built")
@pytest.mark.parametrize("m", [1, 4, 9, 20])
@pytest.mark.parametrize("reg", [0.0, 1e-9])
@pytest.mark.parametrize("spread", [1.0, 1e-7], ids=["plain", "near-singular"])
def test_the_native_system_gives_the_list_route_bits(m, reg, spread):
    """The steady call's small system read from the window's Grams by the native kernel
    (`native.System`, in ring order, then `solve_known_scaled`) returns the bytes of
    `solve_known` on the chronological lists, for every position of the newest residual in
    the ring, on residuals whose differences are well or barely independent, with and
    without a ridge; the entries of the oldest slot, which no difference ends in, are not
    read."""
    generator = torch.Generator().manual_seed(m)
    f = torch.randn(50, 1, generator=generator, dtype=torch.float64) * 1e3
    f = f + spread * torch.randn(50, m + 1, generator=generator, dtype=torch.float64)
    df = f.diff(dim=1)
    h, c, gram_chrono = df.T @ df, df.T @ f[:, -1], f.T @ f
    residual_sq = torch.diagonal(gram_chrono).tolist()
    lists = solve.solve_known(h.tolist(), c.tolist(), residual_sq, reg)
    assert lists is not None
    q = m + 1
    for head in range(q):
        slot = [(head + 1 + j) % q for j in range(q)]  # of each residual, oldest first
        gram = torch.empty(q, q, dtype=torch.float64)
        gram[torch.tensor(slot)[:, None], torch.tensor(slot)] = gram_chrono
        dr_gram = torch.full((q, q), 1e300, dtype=torch.float64)  # the oldest slot: unused
        dr_rhs = torch.full((q,), -1e300, dtype=torch.float64)
        later = torch.tensor(slot[1:])
        dr_gram[later[:, None], later] = h
        dr_rhs[later] = c
        system = native.System(gram, dr_gram, dr_rhs)
        unit = system.read(head)
        assert unit == max(residual_sq)
        assert system.h.tolist() == [[v / unit for v in row] for row in h.tolist()]
        assert system.c.tolist() == [v / unit for v in c.tolist()]
        assert system.diag.tolist() == torch.diagonal(h).tolist()
        native_route = solve.solve_known_scaled(system.h, system.c, reg / unit)
        assert native_route is not None
        assert lists[0].numpy().tobytes() == native_route[0].numpy().tobytes()
        assert lists[1] == native_route[1]
    with pytest.raises(RuntimeError, match="slot"):
        system.read(q)

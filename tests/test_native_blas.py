"""The steady call's small solve and small mix in one native call each
(aadl_func/_src/native_blas.py), through the LAPACK and BLAS torch calls.

They must give torch's bytes (`torch.linalg.eigh` and two `torch.mv` for the solve, one
`addmv_` per leaf for the mix), checked here on systems and windows other than the ones
`native_blas` checks itself; they must not be used where a routine disagrees; and the
steady call must give the same bytes with them as without.
"""

from __future__ import annotations

import itertools
import platform
import sys

import pytest
import torch

import aadl_func as aa
from aadl_func._src import native, native_blas
from aadl_func._src.core import lstsq
from aadl_func._src.exec import steady
from aadl_func._src.verified_states import memo

# Where torch links MKL (the CPU wheels for x86-64 Linux) its symbols are exported and the
# direct calls must be found and agree; elsewhere they may not be, and the torch route runs.
MKL_LINUX = (
    torch.backends.mkl.is_available()
    and sys.platform == "linux"
    and platform.machine() in ("x86_64", "AMD64")
)
needs_kernel = pytest.mark.skipif(not native.available(), reason=native.status())


def _solver(m: int) -> native_blas.Solver:
    solver = native_blas.solver(m)
    if solver is None:
        if MKL_LINUX and native.available():
            pytest.fail("torch's LAPACK and BLAS were not found or disagree on MKL/Linux")
        pytest.skip("torch's LAPACK/BLAS not callable directly here: the torch route runs")
    return solver


def _random_systems(m: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Scaled systems as the steady call forms them, of kinds the check systems do not
    cover: residual differences of a converging iteration (geometric decay), an exactly
    singular Gram (a zero column), the zero matrix, and tiny and huge scales."""
    g = torch.Generator().manual_seed(seed)
    out = []
    n = 4 * m + 3
    for kind in range(5):
        x = torch.randn(n, m, generator=g, dtype=torch.float64)
        if kind == 0:
            x = x * (0.3 ** torch.arange(m, dtype=torch.float64))
        elif kind == 1 and m > 1:
            x[:, m // 2] = 0.0
        elif kind == 2:
            x = torch.zeros(n, m, dtype=torch.float64)
        elif kind == 3:
            x = x * 1e-150
        f = torch.randn(n, generator=g, dtype=torch.float64) * (1e-150 if kind == 3 else 1.0)
        h, c = x.mT @ x, x.mT @ f
        unit = max(h.diagonal().max().item(), f.dot(f).item())
        unit = unit if unit > 0 else 1.0
        for reg in (0.0, 1e-9, 0.5):
            out.append(((h / unit).contiguous(), (c / unit).contiguous(), reg / unit))
    return out


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 20])
def test_the_solve_gives_the_bytes_of_torchs_eigh_and_mv(m):
    """`Solver.gamma_of` against `core.lstsq.known_gamma` (torch.linalg.eigh, the cut-off
    inverse, torch.mv twice), byte for byte, and against float64 NumPy's least squares on
    a well-posed system (the math, not only torch's rounding)."""
    import numpy as np

    solver = _solver(m)
    for seed in range(4):
        for h, c, reg in _random_systems(m, seed):
            want = lstsq.known_gamma(h, c, reg)
            got = solver.gamma_of(h, c, reg)
            assert got is not None
            assert got.numpy().tobytes() == want.numpy().tobytes()
    # The math: the normal equations' solution, well conditioned and without a ridge.
    g = torch.Generator().manual_seed(m)
    x = torch.randn(5 * m, m, generator=g, dtype=torch.float64)
    f = torch.randn(5 * m, generator=g, dtype=torch.float64)
    gamma = solver.gamma_of((x.mT @ x).contiguous(), x.mT @ f, 0.0)
    reference = np.linalg.lstsq(x.numpy(), f.numpy(), rcond=None)[0]
    np.testing.assert_allclose(gamma.numpy(), reference, rtol=1e-9, atol=1e-12)


def _grams(q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Committed Grams of a full q-slot window of random residuals (in ring order: the
    differences' Gram and right-hand side as the window keeps them)."""
    g = torch.Generator().manual_seed(seed)
    residuals = torch.randn(q, 40, generator=g, dtype=torch.float64)
    residuals *= torch.logspace(0, -3, q, dtype=torch.float64)[:, None]
    gram = residuals @ residuals.mT
    differences = residuals - residuals.roll(1, dims=0)  # slot s: f_s - f_{s-1}
    dr_gram = differences @ differences.mT
    return gram.contiguous(), dr_gram.contiguous(), (differences @ residuals[0]).contiguous()


@needs_kernel
@pytest.mark.parametrize("q", [2, 3, 6, 9])
def test_the_one_call_weights_are_the_steps_they_replace(q):
    """`Solver.weights` (the system read, the solve and the weights in one call) against the
    steady call's three steps (`System.read`, `known_gamma`, `System.aadl_weights` or
    `classic_weights`), byte for byte, for every slot of the newest residual, ridges and
    relaxations; None for a system that is not finite (the torch route answers then)."""
    solver = _solver(q - 1)  # (skips where the routines are not callable)
    for seed, head, reg, relaxation in itertools.product(
        range(3), range(q), (0.0, 1e-3), (1.0, 0.5)
    ):
        gram, dr_gram, dr_rhs = _grams(q, seed)
        system = native.System(gram, dr_gram, dr_rhs)
        for classic in (False, True):
            unit = system.read(head)
            gamma = lstsq.known_gamma(system.h, system.c, reg / unit, system.cutoff_inverse)
            steps = system.classic_weights if classic else system.aadl_weights
            want = steps(gamma, relaxation, head).clone()
            got = solver.weights(system, head, reg, relaxation, classic)
            assert got.numpy().tobytes() == want.numpy().tobytes()
    # Values that are not finite (which the steady call never solves: its plan knows its
    # Grams finite) give what the steps give, or None where those raise (LAPACK failed to
    # converge; the caller's torch route then raises that error): None where gamma is not
    # finite.
    for poisoned in (dr_rhs, dr_gram):
        poisoned.fill_(float("nan"))
        system.read(0)
        try:
            gamma = lstsq.known_gamma(system.h, system.c, 0.0, system.cutoff_inverse)
        except torch.linalg.LinAlgError:
            assert solver.weights(system, 0, 0.0, 1.0, False) is None
            continue
        want = system.aadl_weights(gamma, 1.0, 0)
        want = None if want is None else want.clone()
        got = solver.weights(system, 0, 0.0, 1.0, False)
        assert (got is None) == (want is None)
        assert got is None or got.numpy().tobytes() == want.numpy().tobytes()
        if poisoned is dr_rhs:
            assert got is None  # (a NaN right-hand side: gamma is NaN)
    with pytest.raises(RuntimeError, match="slot"):
        solver.weights(system, q, 0.0, 1.0, False)


@needs_kernel
@pytest.mark.parametrize("sizes", [[1], [7, 2048, 33, 10], [4097, 5]])
@pytest.mark.parametrize("q", [2, 5, 9])
def test_the_mix_gives_addmvs_bytes_and_tells_nonfinite_values(sizes, q):
    """`Mixer.mix` against one `addmv_` per leaf over the leaf's slots, byte for byte, and
    its finiteness test against `torch.isfinite`: an infinity or a NaN in any leaf's mix."""
    g = torch.Generator().manual_seed(q)
    slots = [torch.randn(q, n, generator=g) * torch.logspace(-4, 4, q)[:, None] for n in sizes]
    columns = [s.mT for s in slots]
    rows = native.LeafRows([list(s) for s in slots], [torch.zeros(n) for n in sizes])
    mixer = native_blas.mixer(rows, columns)
    if mixer is None:
        assert not MKL_LINUX, "sgemv not found or disagreeing on MKL/Linux"
        pytest.skip("torch's sgemv not callable directly here: addmv_ runs")
    for _ in range(3):
        weights = torch.randn(q, generator=g)
        params = [torch.randn(n, generator=g) for n in sizes]
        want = [p.clone().addmv_(c, weights) for p, c in zip(params, columns)]
        assert mixer.mix(params, weights)
        for p, w in zip(params, want):
            assert p.numpy().tobytes() == w.numpy().tobytes()
    for bad in (float("inf"), float("nan")):
        slots[-1][0, -1] = bad
        params = [torch.zeros(n) for n in sizes]
        assert not mixer.mix(params, torch.ones(q))
        assert not all(torch.isfinite(p).all() for p in params)
        slots[-1][0, -1] = 0.0


@needs_kernel
def test_routines_that_disagree_with_torch_are_not_used(monkeypatch):
    """`solver()` and `mixer()` check the routines against torch first: where torch's
    answer differs by one ulp (as another library's would), they return None."""
    _solver(3)
    native_blas._agrees.cache_clear()
    native_blas._mixes_agree.cache_clear()
    try:

        def off_by_one_ulp(h, c, reg, cutoff_inverse=None):
            gamma = lstsq.known_gamma(h, c, reg, cutoff_inverse)
            return torch.nextafter(gamma, torch.full_like(gamma, float("inf")))

        monkeypatch.setattr(native_blas, "known_gamma", off_by_one_ulp)
        assert native_blas.solver(3) is None
        monkeypatch.undo()
        original = torch.Tensor.addmv_

        def addmv_off_by_one_ulp(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            return out.copy_(torch.nextafter(out, torch.full_like(out, float("inf"))))

        monkeypatch.setattr(torch.Tensor, "addmv_", addmv_off_by_one_ulp)
        slots = torch.randn(4, 30)
        rows = native.LeafRows([list(slots)], [torch.zeros(30)])
        assert native_blas.mixer(rows, [slots.mT]) is None
    finally:
        monkeypatch.undo()
        native_blas._agrees.cache_clear()
        native_blas._mixes_agree.cache_clear()
    assert native_blas.solver(3) is not None


def _run(mode: str, steps: int, **options) -> tuple[list[bytes], list]:
    """`steps` in-place updates of a small float32 model; the bytes of params and state
    after each, and the plans the steady calls kept."""
    torch.manual_seed(0)
    params = {"w": torch.randn(17, 5), "b": torch.randn(5)}
    target = torch.randn(17, 5)
    opt = aa.anderson(aa.adam(0.05), mode=mode, **options)
    state = opt.init(params)
    history, plans = [], []
    for _ in range(steps):
        grads = {"w": params["w"] - target + 0.1 * params["w"] ** 3, "b": params["b"].clone()}
        params, state = opt.update(state, params, grads, inplace=True)
        leaves = [*params.values(), *[t for t in state if isinstance(t, torch.Tensor)]]
        history.append(b"".join(t.numpy().tobytes() for t in leaves))
        plans.append(memo(state))
    return history, plans


@needs_kernel
@pytest.mark.parametrize("mode", ["aadl", "classic"])
@pytest.mark.parametrize(
    "options",
    [
        {"history_depth": 4},
        {"history_depth": 6, "relaxation": 0.5, "reg": 1e-6},
        {"history_depth": 5, "reg_relative": 1e-4},  # the solve alone (`Solver.gamma_of`)
    ],
    ids=["default", "relaxed", "relative-ridge"],
)
def test_steady_calls_give_the_same_bytes_with_and_without_them(monkeypatch, mode, options):
    """A run of steady calls with the one-call solve and mix (which this platform must have
    on MKL/Linux) and the same run without them (`solver()`/`mixer()` returning None):
    the same params and state, byte for byte, after every call."""
    fast, plans = _run(mode, 40, **options)
    used = [p for p in plans if isinstance(p, steady.plans.Plan)]
    assert len(used) >= 30
    if MKL_LINUX:
        assert all(p.solver is not None for p in used)
        assert all((p.mixer is None) == (mode == "classic") for p in used)
    monkeypatch.setattr(native_blas, "solver", lambda system: None)
    monkeypatch.setattr(native_blas, "mixer", lambda rows, columns: None)
    slow, plans = _run(mode, 40, **options)
    assert all(p.solver is None for p in plans if isinstance(p, steady.plans.Plan))
    assert fast == slow

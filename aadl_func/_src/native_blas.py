r"""The steady call's small solve and small mix in one native call each, through torch's own
LAPACK and BLAS.

The steady call (`aadl_func._src.exec.steady`) solves its scaled `m x m` system as
`core.lstsq.known_gamma()` does: `torch.linalg.eigh`, the cut-off inverse of the
eigenvalues and two `torch.mv`, then the mixing weights; it mixes with one `addmv_` per
leaf and tests the result finite. On a small model these are a dozen calls whose arithmetic
takes a few microseconds and whose overhead (argument parsing, output allocations, `eigh`'s
error check, the Python between them) takes most of the rest: in an `AcceleratedOptimizer`
step on a 2,410-parameter MLP, `eigh` alone took 20 us where a loop of it takes 8. The
kernel (`_dots.c`) makes the same LAPACK and BLAS calls itself, on inputs laid out as torch
lays them out, with the same IEEE steps between them: `aadl_solve_f32` (`dsyevd` with the
workspace `eigh` queries, `dgemv` with the transposes `torch.mv` passes) and `aadl_mix_f32`
(`sgemv` as `addmv_` calls it, then the finiteness test).

Same routines, same inputs, same bits: that holds only if the routines are the ones torch
runs. They are looked up by name in the library torch calls them in (`libtorch_cpu`, which
links MKL or OpenBLAS and exports its symbols), and checked before use: `solver()` solves a
fixed set of systems of the window's size both ways (well and badly conditioned, rank
deficient, with and without a ridge) and `mixer()` mixes random windows of each leaf's size
both ways, and each is only made when every byte agrees (once per size and process). Where
the library or a symbol is missing, or a byte differs, they return None and the steady call
keeps its torch route. The mix is taken natively for small windows only (`MIX_MAX` values),
where a call's overhead matters: a large leaf's `addmv_` costs what its memory costs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from aadl_func._src import native
from aadl_func._src.core.lstsq import RTOL, known_gamma

__all__ = ["MIX_MAX", "Mixer", "Solver", "mixer", "solver"]

#: The most window values (slots x leaf sizes, over the leaves) `mixer()` takes.
MIX_MAX = 1 << 18

# The library torch's CPU LAPACK and BLAS calls go to, by platform.
_TORCH_LIBRARIES = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")


class _Routines(ctypes.Structure):
    """`aadl_solver` of `_dots.c`: the routines and the working memory of one size `m`."""

    _fields_ = [
        ("syevd", ctypes.c_void_p),
        ("gemv", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("lwork", ctypes.c_int32),
        ("liwork", ctypes.c_int32),
        ("vectors", ctypes.c_void_p),
        ("eigvals", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
        ("projected", ctypes.c_void_p),
        ("gamma", ctypes.c_void_p),
        ("iwork", ctypes.c_void_p),
    ]


@functools.cache
def _addresses() -> tuple[int, int, int] | None:
    """The addresses of `dsyevd_`, `dgemv_` and `sgemv_` in torch's CPU library, or None."""
    folder = Path(torch.__file__).parent / "lib"
    for name in _TORCH_LIBRARIES:
        if (folder / name).is_file():
            try:
                library = ctypes.CDLL(str(folder / name))
                found = [ctypes.cast(getattr(library, s), ctypes.c_void_p).value
                         for s in ("dsyevd_", "dgemv_", "sgemv_")]  # fmt: skip
            except (OSError, AttributeError):
                return None
            return None if None in found else (found[0], found[1], found[2])
    return None


def _workspace(syevd: int, m: int) -> tuple[int, int]:
    """`dsyevd`'s workspace sizes for `m` (`jobz="V"`), from its query, as
    `torch.linalg.eigh` sizes them: `max(1, work[0])` and `max(1, iwork[0])`."""
    i32, c = ctypes.c_int32, ctypes.byref
    function = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 11)(syevd)
    n, info, query = i32(m), i32(0), i32(-1)
    work, iwork = ctypes.c_double(0.0), i32(0)
    a, w = (ctypes.c_double * (m * m))(), (ctypes.c_double * m)()
    function(b"V", b"L", c(n), a, c(n), w, c(work), c(query), c(iwork), c(query), c(info))
    if info.value != 0:
        raise OSError(f"dsyevd's workspace query failed (info {info.value})")
    return max(1, int(work.value)), max(1, iwork.value)


class Solver:
    """The small solve of size `m` (a window of `m + 1` slots) in one native call, with its
    own working memory: made by `solver()`, which checked it."""

    def __init__(self, m: int, addresses: tuple[int, int, int]) -> None:
        lwork, liwork = _workspace(addresses[0], m)
        f64, cpu = torch.float64, "cpu"
        self._buffers = [
            torch.empty(m * m, dtype=f64, device=cpu),
            *(torch.empty(m, dtype=f64, device=cpu) for _ in range(3)),
            torch.empty(lwork, dtype=f64, device=cpu),
            torch.empty(liwork, dtype=torch.int32, device=cpu),
        ]
        vectors, eigvals, projected, gamma, work, iwork = self._buffers
        self.gamma = gamma
        self.routines = _Routines(
            *addresses[:2], m, lwork, liwork, vectors.data_ptr(), eigvals.data_ptr(),
            work.data_ptr(), projected.data_ptr(), gamma.data_ptr(), iwork.data_ptr(),
        )  # fmt: skip
        self._address = ctypes.addressof(self.routines)

    def gamma_of(self, h: Tensor, c: Tensor, reg: float) -> Tensor | None:
        """`known_gamma(h, c, reg)` (contiguous float64 CPU `(m, m)` and `(m,)`) in the
        kernel, in a buffer this object keeps; None where LAPACK failed."""
        code = native._load()[0].aadl_gamma_f64(self._address, h.data_ptr(), c.data_ptr(),
                                                 reg, RTOL)  # fmt: skip
        return self.gamma if code == 0 else None

    def weights(
        self, system: native.System, head: int, reg: float, relaxation: float, classic: bool
    ) -> Tensor | None:
        """The float32 mixing weights in ring order for the newest residual in slot `head`
        of `system`'s window (`native.System`, of `m + 1` slots): the system read from the
        committed Grams (`system.read()`), gamma for the ridge `reg` (a number, the unscaled
        `known_ridge()`) and the weights of `system.aadl_weights()` (or with `classic`,
        `system.classic_weights()`), in `system`'s buffers. None when a gamma is not finite
        or LAPACK failed: the caller's torch route then answers (and raises torch's
        error)."""
        out = system.classic if classic else system.weights
        code = native._load()[0].aadl_solve_f32(
            self._address, *system.grams, system.q, head, reg, RTOL, relaxation, classic,
            *system.outputs, out.data_ptr(),
        )  # fmt: skip
        if code == -1:
            raise RuntimeError(f"aadl_func native kernel failed for slot {head}")
        return out if code == 1 else None


def solver(m: int) -> Solver | None:
    """A `Solver` of size `m`, if torch's LAPACK and BLAS are found and give `known_gamma()`'s
    bytes on the check systems (see the module docstring); else None."""
    addresses = _addresses() if native.available() and m >= 1 else None
    if addresses is None or not _agrees(addresses, m):
        return None
    return Solver(m, addresses)


@functools.cache
def _agrees(addresses: tuple[int, int, int], m: int) -> bool:
    """Whether the kernel's gamma is `known_gamma()`'s, byte for byte, on the check
    systems of size `m` (once per size and process)."""
    checker = Solver(m, addresses)
    for h, c, reg in _check_systems(m):
        want = known_gamma(h, c, reg)
        got = checker.gamma_of(h, c, reg)
        if got is None or got.numpy().tobytes() != want.numpy().tobytes():
            return False
    return True


def _check_systems(m: int) -> list[tuple[Tensor, Tensor, float]]:
    """Scaled systems `(h, c, reg)` of size `m` as the steady call forms them (a Gram of
    differences over the largest squared residual norm): well conditioned, columns of scales
    from 1 to 1e-7 (a converging iteration), and rank deficient (a repeated column); each
    without and with a ridge."""
    generator = torch.Generator().manual_seed(m)
    systems = []
    for kind in range(3):
        x = torch.randn(3 * m + 2, m, generator=generator, dtype=torch.float64, device="cpu")
        if kind == 1:
            x = x * torch.logspace(0, -7, m, dtype=torch.float64, device="cpu")
        if kind == 2 and m > 1:
            x[:, -1] = x[:, 0]
        f = torch.randn(3 * m + 2, generator=generator, dtype=torch.float64, device="cpu")
        h, c = x.mT @ x, x.mT @ f
        unit = max(h.diagonal().max().item(), f.dot(f).item())
        for reg in (0.0, 1e-3):
            systems.append(((h / unit).contiguous(), (c / unit).contiguous(), reg / unit))
    return systems


class Mixer:
    """The steady call's mix and its finiteness test, every leaf in one native call
    (`aadl_mix_f32`), over the window of `rows` (`native.LeafRows`) whose leaves' slots
    are the matrices `columns` (`plan.columns`: each leaf's `q` slots, one buffer, as
    `(n, q)` views): made by `mixer()`, which checked it."""

    def __init__(self, rows: native.LeafRows, columns: list[Tensor], sgemv: int) -> None:
        self.rows, self.sgemv, self.q = rows, sgemv, rows.q
        self._columns = columns  # kept alive: `bases` points into them
        self.bases = native.pointers(columns)

    def mix(self, params: list[Tensor], weights: Tensor) -> bool:
        """`p.view(-1).addmv_(columns, weights)` for every leaf `p` of `params` (contiguous
        float32, the window's leaf sizes, which the caller checked; they hold the newest
        entry of the window's last append), then whether they are all finite:
        `native.LeafRows.mix_bounded()`, else `native.LeafRows.finite()`."""
        rows = self.rows
        torch.autograd.graph.increment_version(params)  # written behind torch's back
        return native._load()[0].aadl_mix_f32(
            self.sgemv, rows.leaves, native.pointers(params), self.bases, rows.sizes, self.q,
            weights.data_ptr(), rows.maxima_address, torch.get_num_threads(),
            native.PARALLEL_MIN,
        ) == 1  # fmt: skip


def mixer(rows: native.LeafRows, columns: list[Tensor]) -> Mixer | None:
    """A `Mixer` for a window of at most `MIX_MAX` values whose every leaf's `addmv_` torch's
    `sgemv` reproduces byte for byte (checked once per leaf size and process; see the module
    docstring); else None."""
    sizes = [c.shape[0] for c in columns]
    if rows.q * sum(sizes) > MIX_MAX or not native.available():
        return None
    addresses = _addresses()
    if addresses is None or not all(_mixes_agree(addresses[2], n, rows.q) for n in sizes):
        return None
    return Mixer(rows, columns, addresses[2])


@functools.cache
def _mixes_agree(sgemv: int, n: int, q: int) -> bool:
    """Whether `aadl_mix_f32` gives `addmv_`'s bytes for a leaf of `n` values and `q`
    slots, on random values (scaled over many binades: every rounding is exercised)."""
    generator = torch.Generator().manual_seed(n * 64 + q)
    scales = torch.logspace(-3, 3, q, device="cpu")
    slots = torch.randn(q, n, generator=generator, device="cpu") * scales[:, None]
    weights = torch.randn(q, generator=generator, device="cpu")
    x = torch.randn(n, generator=generator, device="cpu")
    want = x.clone().addmv_(slots.mT, weights)
    got = x.clone()
    native._load()[0].aadl_mix_f32(
        sgemv, 1, native.pointers([got]), native.pointers([slots]), (ctypes.c_int64 * 1)(n), q,
        weights.data_ptr(), None, 1, native.PARALLEL_MIN,
    )  # fmt: skip
    return got.numpy().tobytes() == want.numpy().tobytes()

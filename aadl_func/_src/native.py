r"""An optional C kernel for the window's Gram-row pass on the CPU.

`float64_dots()` returns $\langle r_j, v \rangle$ for float32 or bfloat16 rows
$r_j$ and a vector $v$ of the same dtype, summed in float64. torch has no
operation that multiplies float32 data in float64 without first writing a float64 copy, and
on a CPU that copy costs more than reading the window (about twice a BLAS pass at
`n = 2^22`, `m = 10` on a 2-core machine). The kernel in `_dots.c` widens each element
in a register instead; it computes the same exact products (a product of two float32 numbers
is exact in float64) and sums them in float64 in a fixed order, so its result does not
depend on the number of threads.

For the steady call (`aadl_func._src.exec.steady`), whose window layout a plan keeps, the
kernel also does what would otherwise be a small torch operation each: the fused append and
Gram row of a whole params tree in one call (`LeafRows`), the commit point's stores into the
Grams and counters (`commit_rows()`) and the finiteness test of the mix (`finite_f32()`).

The C file is compiled when the package is installed (`setup.py`: an optional extension,
plain `-O3`, no CPU-specific flags) into a shared library next to this module, and loaded
from there with `ctypes` on first use; it is not a Python module. Nothing is built,
cached or written at run time: the library is part of the installed package, as trusted as
this file. Where the install had no compiler (the build only warns), with
`AADL_FUNC_NATIVE=0`, or if the library does not load, `float64_dots()` returns None
and the caller uses its torch path, which gives the same values up to float64 summation
order; `status()` (public: `aa.kernel_info()`) says which is in use. A kernel missing or
broken (not one turned off) warns once per process, when the first state with a CPU window is
made (`warn_if_missing()`).

The blocks of the pass are shared among `torch.get_num_threads()` OpenMP threads. The file
is built with `-fopenmp` and loaded after torch, so it binds to the OpenMP runtime torch
already loaded (the same `libgomp.so.1`) and runs on torch's own threads, which would
otherwise spin idle right after torch's previous operation and slow a second pool down (a
torch built on another OpenMP runtime leaves the kernel its own libgomp pool: the same
results, some thread contention). A compiler without OpenMP gives a single-threaded build.
ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import struct
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aadl_func._src.core.lstsq import RTOL

__all__ = [
    "LeafRows",
    "append_differences",
    "available",
    "can_append",
    "commit_rows",
    "finite_f32",
    "float64_dots",
    "kernel_info",
    "plain_vectors",
    "pointers",
    "set_enabled",
    "status",
    "warn_if_missing",
]

# Built by setup.py (the extension "aadl_func._src._dots") with the interpreter's suffix.
LIBRARY = Path(__file__).with_name("_dots" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
_VERSION = 11  # aadl_dots_version() of the source this module was written for

# Elements per block (at most the C side's AADL_MAX_BLOCK): the float64 copy of a vector
# block (16 KiB) stays in L1 while every row streams past it.
BLOCK = 2048
# Below this many row elements (rows x length), threads cost more than they save. The
# float64 products make the pass compute-bound well below memory speed on small windows:
# measured on this 2-core machine, the fused append of 4 rows takes 23 / 20 us with one /
# two threads at n = 2^12, 47 / 33 us at 2^14 and 132 / 77 us at 2^16.
PARALLEL_MIN = 1 << 14

_KERNELS = {torch.float32: "aadl_dots_f32", torch.bfloat16: "aadl_dots_bf16"}

_enabled = os.environ.get("AADL_FUNC_NATIVE", "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turns the kernel on or off for this process; returns the previous setting.

    Off, `float64_dots()` returns None (callers use their torch path). Tests use this to
    check both paths; `AADL_FUNC_NATIVE=0` sets the initial value.
    """
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def available() -> bool:
    """Whether the kernel is enabled and loaded (loading it on the first call)."""
    return _enabled and _load()[0] is not None


def status() -> str:
    """One line: the kernel in use (with its path) or why the torch path is used."""
    if not _enabled:
        return "disabled (AADL_FUNC_NATIVE=0 or set_enabled(False)): torch path"
    return _load()[1]


def kernel_info() -> dict[str, str | None]:
    """Which implementation runs the window's Gram-row pass on the CPU, and why.

    The pass reads every window entry once per step. Installing the package compiles a small
    C kernel for it (`aadl_func/_src/_dots.c`); where no compiler was found, the build only
    warned and the pass runs in torch instead: the same values up to the float64 summation
    order, about twice as slow on large windows (docs/performance.md). On other devices, and
    under `torch.compile` or `vmap`, the torch path runs anyway.

    Returns:
      A dict: `"kernel"`, `"native"` or `"torch"`; `"library"`, the loaded shared
      library's path, or None; `"reason"`, one line saying what was loaded or why not
      (`AADL_FUNC_NATIVE=0` turns the kernel off).

    Examples:
      >>> aa.kernel_info()["kernel"]
      'native'
    """
    line = status()
    native = available()
    return {
        "kernel": "native" if native else "torch",
        "library": str(LIBRARY) if native else None,
        "reason": line,
    }


_warned = False


def warn_if_missing(stacklevel: int) -> None:
    """Warns, once per process, where the kernel should run but is not there (not built, or
    broken; not where it is turned off): the window pass then costs about twice as much, and
    only a verbose `pip install` said why.

    Called where a state with a CPU window is made (`anderson.init`): a warning turned into
    an error there (`-W error`) stops the call before anything is written."""
    global _warned
    if torch.compiler.is_compiling() or _warned or not _enabled:
        return
    library, line = _load()
    if library is None:
        _warned = True
        warnings.warn(
            f"aadl_func: the native CPU kernel is not in use ({line}); the window pass "
            "runs in torch instead (same values, slower on large windows). Reinstall with a C "
            "compiler to build it, or set AADL_FUNC_NATIVE=0 to choose the torch path without "
            "this warning; aadl_func.kernel_info() says which runs.",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """The installed kernel (loaded once per process) and a line saying what was loaded, or
    None and why not."""
    if not LIBRARY.is_file():
        return None, f"unavailable (not built when installed: no {LIBRARY}): torch path"
    try:
        _check_complete(LIBRARY)
        return _bind(ctypes.CDLL(str(LIBRARY))), f"native kernel: {LIBRARY}"
    except (OSError, AttributeError) as error:  # a broken or stale build: use torch
        return None, f"unavailable ({type(error).__name__}: {error}): torch path"


def _check_complete(path: Path) -> None:
    """Raises `OSError` if `path` is an ELF file shorter than its own headers say.

    The dynamic loader maps a library's segments as its program headers describe them; a
    truncated file maps pages past its end, and the process dies of SIGBUS as soon as the
    loader touches them (a third of the file is enough). Comparing the headers' extents with
    the file's size first turns that into an error, and the torch path runs. (A file
    truncated after this check, or while mapped, is outside this: whoever can do that can
    replace this module too.) Other formats are left to the loader, which refuses them."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
        if (
            len(head) < 52
            or head[:4] != b"\x7fELF"
            or head[4] not in (1, 2)
            or head[5] not in (1, 2)
        ):
            return
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide:
            phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
        else:
            phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
        ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
        if ends[0] <= size:
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                if wide:
                    offset, _, _, filesz = struct.unpack_from(
                        order + "QQQQ", table, i * phentsize + 8
                    )
                else:
                    offset, _, _, filesz = struct.unpack_from(
                        order + "IIII", table, i * phentsize + 4
                    )
                ends.append(offset + filesz)
    if max(ends) > size:
        raise OSError(f"{path} is truncated ({size} bytes, its headers need {max(ends)})")


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """Checks the version and declares the argument types of the library's functions."""
    library.aadl_dots_version.restype = ctypes.c_int64
    if library.aadl_dots_version() != _VERSION:
        raise OSError(f"the library is not version {_VERSION} of the kernel")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _KERNELS.values():
        function = getattr(library, name)
        function.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr]
        function.restype = i64
    library.aadl_append_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr]
    library.aadl_append_f32.restype = i64
    library.aadl_commit_f64.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64]
    library.aadl_commit_f64.restype = i64
    library.aadl_leaves_f32.argtypes = [i64, ptr, i64, i64, ptr, ptr, ctypes.c_float, ptr, ptr,
                                        i64, i64, i64, ptr, ptr, ptr, ptr, ptr]  # fmt: skip
    library.aadl_leaves_f32.restype = i64
    library.aadl_finite_f32.argtypes = [ptr, i64, i64]
    library.aadl_finite_f32.restype = i64
    library.aadl_finite_leaves_f32.argtypes = [i64, ptr, ptr, i64, i64]
    library.aadl_finite_leaves_f32.restype = i64
    library.aadl_system_f64.argtypes = [ptr, ptr, ptr, i64, i64, ptr, ptr, ptr]
    library.aadl_system_f64.restype = ctypes.c_double
    library.aadl_rows_f64.argtypes = [ptr, ptr, i64, i64, ptr]
    library.aadl_rows_f64.restype = i64
    library.aadl_inverse_f64.argtypes = [ptr, i64, ctypes.c_double, ctypes.c_double, ptr]
    library.aadl_inverse_f64.restype = None
    library.aadl_weights_f32.argtypes = [ptr, i64, ctypes.c_double, i64, ptr]
    library.aadl_weights_f32.restype = i64
    library.aadl_classic_weights_f32.argtypes = [ptr, i64, ctypes.c_double, i64, ptr]
    library.aadl_classic_weights_f32.restype = i64
    library.aadl_gamma_f64.argtypes = [ptr, ptr, ptr, ctypes.c_double, ctypes.c_double]
    library.aadl_gamma_f64.restype = i64
    f64 = ctypes.c_double
    library.aadl_solve_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f64, f64, f64, i64, ptr,
                                       ptr, ptr, ptr]  # fmt: skip
    library.aadl_solve_f32.restype = i64
    library.aadl_mix_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64]
    library.aadl_mix_f32.restype = i64
    library.aadl_dots_avx2.restype = i64
    library.aadl_portable_dots.argtypes = [i64]
    library.aadl_portable_dots.restype = i64
    library.aadl_mix_bounded.argtypes = [ptr, ptr, i64]
    library.aadl_mix_bounded.restype = i64
    return library


def plain_vectors(tensors: Sequence[Tensor], dtype: torch.dtype, n: int) -> bool:
    """Plain CPU tensors of `dtype` whose `n` elements lie contiguously in memory (a 1-d
    stride-1 vector, or any C-contiguous tensor: the kernels only see a pointer and `n`), as
    their values (not a negative view, whose memory holds the opposite)."""
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.dtype != dtype
            or not t.is_cpu
            or t.numel() != n
            or not t.is_contiguous()
            or t.is_neg()
        ):
            return False
    return True


def _overlap(a: Tensor, b: Tensor) -> bool:
    start_a, start_b = a.data_ptr(), b.data_ptr()
    end_a = start_a + a.numel() * a.element_size()
    end_b = start_b + b.numel() * b.element_size()
    return start_a < end_b and start_b < end_a


def _threads(q: int, n: int, num_blocks: int) -> int:
    return max(1, min(torch.get_num_threads(), num_blocks, q * n // PARALLEL_MIN))


def pointers(tensors: Sequence[Tensor]) -> ctypes.Array:
    """The tensors' data pointers as a C array."""
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


class LeafRows:
    """The Gram row of a whole float32 window, leaf by leaf in one native call
    (`aadl_leaves_f32`), for a caller that keeps the window's layout between calls (the
    steady call's plan): `slots[l]` are leaf `l`'s `q` contiguous slots and `anchor[l]` its
    anchor. The same sums as one `_call()` per leaf added up in leaf order.

    `maxima` (`q + 1` doubles): the largest |value| of each slot as its last `append()`
    wrote it (or `measure()` read it), and of the newest entry `y` of that append (+inf
    before either; inf or NaN where a value is not finite): bounds on the
    terms of the mix that follows, with which `mix_bounded()` can tell it finite without
    reading it. They hold while only `append()` writes the slots (the steady call's plan,
    remade when anything else writes them)."""

    def __init__(self, slots: Sequence[Sequence[Tensor]], anchor: Sequence[Tensor]):
        self.leaves, self.q = len(slots), len(slots[0])
        self._slots = [pointers(s) for s in slots]  # kept alive: `rows` points into them
        self.rows = (ctypes.c_void_p * self.leaves)(*map(ctypes.addressof, self._slots))
        self.anchor = pointers(anchor)
        self.sizes = (ctypes.c_int64 * self.leaves)(*[s[0].numel() for s in slots])
        self._partial = [torch.empty(-(-s[0].numel() // BLOCK), self.q, dtype=torch.float64)
                         for s in slots]  # fmt: skip
        self.partial = pointers(self._partial)
        self.scratch, self.out = (
            torch.empty(self.q, dtype=torch.float64),
            torch.empty(self.q, dtype=torch.float64),
        )
        # The rows `known_rows()` makes, `[g, h, c]`, which the commit point stores.
        self.values = torch.empty(3 * self.q, dtype=torch.float64)
        self._out, self.values_address = self.out.data_ptr(), self.values.data_ptr()
        self.maxima = torch.full((self.q + 1,), math.inf, dtype=torch.float64)
        self.maxima_address = self.maxima.data_ptr()
        # Set to 1 by an `append()` with `steps` once they are all in `newest`.
        self.stepped = ctypes.c_int64(0)

    def append(
        self, slot: int, newest: Sequence[Tensor], steps: Sequence[Tensor] = (), scale: float = 1.0
    ) -> None:
        """`append_differences()` of every leaf (`rows[slot] = newest - anchor`, `anchor =
        newest`), the rows summed into `out`: `row_0 + row_1 + ...`; `maxima[slot]` and
        `maxima[q]` set. With `steps` (contiguous float32 leaves of the window's sizes that
        share no memory with `newest`, the anchor or the slots), the plain step first,
        in the same pass: `newest += steps * scale`, rounded as `steps.mul_(scale)` (the
        number `scale` taken as a float32, as torch takes it) then `add_()` round it (with a
        `scale` of 1, `steps` themselves), after which `stepped` is 1; `steps` are only
        read. The caller bumps the version counters."""
        self._run(slot, pointers(newest), pointers(steps) if steps else None, scale)

    def measure(self, slots: Sequence[Sequence[Tensor]]) -> None:
        """`maxima[:q]` read from `slots` (the window this object was made for) as they are
        now: one pass over the window, for a caller whose window was filled before (the
        steady call's plan), so that its first mixes need not wait for `q` appends."""
        largest = torch.zeros(self.q, dtype=torch.float64)
        for leaf in slots:
            if leaf[0].numel():  # (the largest of nothing: 0)
                leaf_max = torch.stack([torch.linalg.vector_norm(s, math.inf) for s in leaf])
                largest = torch.maximum(largest, leaf_max.double())  # (NaN stays NaN)
        self.maxima[: self.q] = largest

    def dots(self, slot: int) -> None:
        """The dots of every leaf's slot `slot` with its slots, summed from zero into `out`:
        `((0 + row_0) + row_1) + ...`."""
        self._run(slot, None, None, 1.0)

    def row(self) -> list[float]:
        """The last row summed (`append()`, `dots()`), as Python floats."""
        return self.out.tolist()

    def known_rows(self, before: int, slot: int) -> bool:
        """`window.known_rows()` for the last row summed as the new residual's in slot
        `slot` and `before` (the address of `q` doubles: the Gram's row of the slot before):
        `values` = `[g, h, c]` (`aadl_rows_f64`); whether they are all finite."""
        code = _load()[0].aadl_rows_f64(self._out, before, self.q, slot, self.values_address)
        if code < 0:
            raise RuntimeError(f"aadl_func native kernel failed for slot {slot}")
        return code == 1

    def finite(self, leaves: Sequence[Tensor]) -> bool:
        """Whether every value of `leaves` (float32, contiguous, of the window's leaf
        sizes, which the caller checked) is finite: `finite_f32()` of each, in one call."""
        library = _load()[0]
        return library.aadl_finite_leaves_f32(
            self.leaves, pointers(leaves), self.sizes, torch.get_num_threads(), PARALLEL_MIN
        ) == 1  # fmt: skip

    def mix_bounded(self, weights: Tensor) -> bool:
        """Whether `y + S^T weights` is finite whatever its roundings, for the newest entry
        `y` and the slots `S` of the last `append()` (`aadl_mix_bounded`: `maxima[q] +
        sum_j |weights[j]| maxima[j] <= FLT_MAX / 2`); False when only a pass can tell.
        `weights`: `q` contiguous float32 values."""
        return _load()[0].aadl_mix_bounded(weights.data_ptr(), self.maxima_address, self.q) == 1

    def _run(
        self, slot: int, newest: ctypes.Array | None, steps: ctypes.Array | None, scale: float
    ) -> None:
        code = _load()[0].aadl_leaves_f32(
            self.leaves, self.rows, self.q, slot, newest, steps, scale, self.anchor, self.sizes,
            BLOCK,
            torch.get_num_threads(), PARALLEL_MIN, self.partial, self.scratch.data_ptr(),
            self._out, self.maxima_address, ctypes.byref(self.stepped),
        )  # fmt: skip
        if code != 0:
            raise RuntimeError(f"aadl_func native kernel failed with code {code}")


def commit_rows(
    committed: Sequence[Tensor],
    slot: int,
    values: ctypes.Array | int,
    counters: ctypes.Array,
    counts: ctypes.Array,
) -> None:
    """The steady call's commit-point writes (`aadl_commit_f64` in _dots.c): with
    `committed` = `[gram, dr_gram, dr_rhs, *counters]` (contiguous float64 `(q, q)`,
    `(q, q)`, `(q,)` CPU tensors and int64 scalars), row and column `slot` of the two Grams
    set to `values[:q]` and `values[q:2q]`, `dr_rhs` to `values[2q:]` (`values`: a C array
    or the address of `3q` doubles, e.g. `LeafRows.values`'), and the counters at
    `counters` to `counts`. The caller checked the layouts (the steady call's plan) and
    bumps the version counters."""
    gram, dr_gram, dr_rhs = committed[:3]
    code = _load()[0].aadl_commit_f64(
        gram.data_ptr(), dr_gram.data_ptr(), dr_rhs.data_ptr(), dr_rhs.shape[0], slot, values,
        counters, counts, len(counts),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"aadl_func native kernel failed with code {code}")


class System:
    """The steady call's small system read from the committed Grams (`aadl_system_f64`):
    for a window of `q` slots, the buffers it fills, `h` (the `(q - 1, q - 1)` Gram of the
    residuals' differences in chronological order), `c` and `diag` (`(q - 1,)` each), all
    divided by `unit` = max of the residuals' squared norms except `diag` (the unscaled
    diagonal of `h`): `core.lstsq.solve_known()`'s arithmetic, with the Grams as tensors
    rather than lists. The caller keeps the Grams' layout (contiguous float64 `(q, q)`,
    `(q, q)`, `(q,)` CPU tensors) and knows their values finite."""

    def __init__(self, gram: Tensor, dr_gram: Tensor, dr_rhs: Tensor) -> None:
        q = dr_rhs.shape[0]
        self.q = q
        self.grams = (gram.data_ptr(), dr_gram.data_ptr(), dr_rhs.data_ptr())
        self.h = torch.empty(q - 1, q - 1, dtype=torch.float64)
        self.c = torch.empty(q - 1, dtype=torch.float64)
        self.diag = torch.empty(q - 1, dtype=torch.float64)
        # Where `read()` writes `h`, `c` and `diag` (`native_blas.Solver` writes them too).
        self.outputs = (self.h.data_ptr(), self.c.data_ptr(), self.diag.data_ptr())
        self.inverse = torch.empty(q - 1, dtype=torch.float64)
        self.weights = torch.empty(q, dtype=torch.float32)
        self.classic = torch.empty(2 * q, dtype=torch.float32)
        self._inverse = self.inverse.data_ptr()

    def read(self, head: int) -> float:
        """Fills `h`, `c` and `diag` for the newest residual in slot `head`; returns
        `unit`."""
        unit = _load()[0].aadl_system_f64(*self.grams, self.q, head, *self.outputs)
        if unit < 0:
            raise RuntimeError(f"aadl_func native kernel failed for slot {head}")
        return unit

    def cutoff_inverse(self, eigvals: Tensor, reg: float) -> Tensor:
        """`core.lstsq.known_gamma()`'s cut-off inverse of the `q - 1` eigenvalues
        `eigvals` (a contiguous float64 CPU vector), in the kernel (`aadl_inverse_f64`):
        the same values as the Python loop's, in a buffer this object keeps."""
        _check_length(eigvals, self.q - 1)
        _load()[0].aadl_inverse_f64(eigvals.data_ptr(), self.q - 1, reg, RTOL, self._inverse)
        return self.inverse

    def aadl_weights(self, gamma: Tensor, relaxation: float, head: int) -> Tensor | None:
        """Mode "aadl"'s float32 mixing weights in ring order from `gamma` (`q - 1`
        contiguous float64 values, chronological) for the newest residual in slot `head`
        (`aadl_weights_f32`: `aadl_coefficients(..., negated=True)` of the affine weights,
        each rounded once), in a buffer this object keeps; None when a gamma is not
        finite."""
        return self._mixing_weights("aadl_weights_f32", gamma, relaxation, head, self.weights)

    def classic_weights(self, gamma: Tensor, relaxation: float, head: int) -> Tensor | None:
        """Mode "classic"'s float32 mixing weights in ring order from `gamma`, as
        `aadl_weights()`: the points' (`classic_coefficients()` of the affine weights) then
        the steps' (`relaxation` times them), `2q` values (`aadl_classic_weights_f32`)."""
        return self._mixing_weights(
            "aadl_classic_weights_f32", gamma, relaxation, head, self.classic
        )

    def _mixing_weights(
        self, kernel: str, gamma: Tensor, relaxation: float, head: int, out: Tensor
    ) -> Tensor | None:
        _check_length(gamma, self.q - 1)
        code = getattr(_load()[0], kernel)(
            gamma.data_ptr(), self.q - 1, relaxation, head, out.data_ptr()
        )
        if code < 0:
            raise RuntimeError(f"aadl_func native kernel failed for slot {head}")
        return out if code == 1 else None


def _check_length(t: Tensor, n: int) -> None:
    """`t` is a contiguous float64 CPU vector of `n` values (the kernel reads them)."""
    if t.shape != (n,) or t.dtype != torch.float64 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"internal: expected {n} contiguous float64 CPU values, got {t!r}")


def finite_f32(t: Tensor) -> bool:
    """Whether every value of the contiguous float32 CPU tensor `t` is finite, in one pass
    (`passes.finite()`'s test of a float32 mix, without `aminmax` and its two reads)."""
    n = t.numel()
    # (A read-only pass breaks even on two threads near 2^14 elements too: measured 2.2 us
    # on one or two, 6.3 / 4.4 us at 2^16, 145 / 59 us at 2^20.)
    threads = max(1, min(torch.get_num_threads(), n // PARALLEL_MIN))
    return _load()[0].aadl_finite_f32(t.data_ptr(), n, threads) == 1


def _call(
    kernel: Callable, q: int, n: int, *leading: Any, buffers: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """Runs a kernel whose arguments end in `(n, block, threads, partial, out)`; returns
    `out`, the `(q,)` float64 sums. `buffers`: the `(partial, out)` tensors to write, of
    shapes `(ceil(n / BLOCK), q)` and `(q,)`, for a caller that keeps them between calls
    (`aadl_func._src.exec.steady`); else new ones."""
    if n == 0:
        return torch.zeros(q, dtype=torch.float64)
    num_blocks = -(-n // BLOCK)
    if buffers is None:
        partial = torch.empty(num_blocks, q, dtype=torch.float64)
        out = torch.empty(q, dtype=torch.float64)  # every entry written by the kernel
    else:
        partial, out = buffers
    threads = _threads(q, n, num_blocks)
    code = kernel(*leading, n, BLOCK, threads, partial.data_ptr(), out.data_ptr())
    if code != 0:
        raise RuntimeError(f"aadl_func native kernel failed with code {code}")
    return out


def float64_dots(rows: Sequence[Tensor], vector: Tensor) -> Tensor | None:
    r"""`out[j] = sum_i f64(rows[j][i]) * f64(vector[i])` as a `(len(rows),)` float64 tensor.

    Returns None when the kernel is off or unavailable, or when `vector` is not a 1-d,
    stride-1 CPU tensor of length `n` in float32 or bfloat16 and the rows contiguous CPU
    tensors of `n` elements of its dtype (the caller then takes its torch path). Plain
    tensors only: under a torch.func transform the caller never gets here.
    """
    if not _enabled or not rows or vector.dtype not in _KERNELS or vector.dim() != 1:
        return None
    q, n = len(rows), vector.shape[0]
    if not plain_vectors([*rows, vector], vector.dtype, n):
        return None
    library = _load()[0]
    if library is None:
        return None
    kernel = getattr(library, _KERNELS[vector.dtype])
    return _call(kernel, q, n, pointers(rows), q, vector.data_ptr())


def can_append(rows: Sequence[Tensor], slot: int, newest: Tensor, anchor: Tensor) -> bool:
    """Whether `append_differences()` applies to one leaf: float32 CPU tensors of one
    size, each contiguous (C order, any shape), the slot overlapping neither `newest` nor
    `anchor` nor these each other, and the kernel available."""
    if not _enabled or not rows or not 0 <= slot < len(rows):
        return False
    n = newest.numel()
    if not plain_vectors([*rows, newest, anchor], torch.float32, n):
        return False
    if n > 0 and (
        _overlap(rows[slot], newest) or _overlap(rows[slot], anchor) or _overlap(newest, anchor)
    ):
        return False
    return _load()[0] is not None


def append_differences(
    leaves: Sequence[tuple[Sequence[Tensor], Tensor, Tensor]], slot: int
) -> list[Tensor] | None:
    r"""For every leaf `(rows, newest, anchor)`, in one pass: `rows[slot] = newest -
    anchor`, `anchor = newest` (in place) and the float64 dots of every row with the new
    `rows[slot]`, as `float64_dots()` returns them (one `(q,)` tensor per leaf).

    The window's append step (a subtraction into the ring slot, the anchor copy and the
    Gram-row pass) fused for float32 windows; the subtraction rounds as `torch.sub` does.
    All or nothing: returns None, having written nothing, unless `can_append()` holds for
    every leaf.
    """
    if not all(can_append(rows, slot, newest, anchor) for rows, newest, anchor in leaves):
        return None
    results = []
    for rows, newest, anchor in leaves:
        q, n = len(rows), newest.numel()
        # Written behind torch's back: bump the version counters as an in-place op would.
        torch.autograd.graph.increment_version([rows[slot], anchor])
        kernel = _load()[0].aadl_append_f32
        rows_at = pointers(rows)
        results.append(_call(kernel, q, n, rows_at, q, slot, newest.data_ptr(), anchor.data_ptr()))
    return results

r"""An optional C kernel for the window's Gram-row pass on the CPU.

:func:`float64_dots` returns :math:`\langle r_j, v \rangle` for float32 or bfloat16 rows
:math:`r_j` and a vector :math:`v` of the same dtype, summed in float64. torch has no
operation that multiplies float32 data in float64 without first writing a float64 copy, and
on a CPU that copy costs more than reading the window (about twice a BLAS pass at
``n = 2^22``, ``m = 10`` on a 2-core machine). The kernel in ``_dots.c`` widens each element
in a register instead; it computes the same exact products (a product of two float32 numbers
is exact in float64) and sums them in float64 in a fixed order, so its result does not
depend on the number of threads.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; plain
``-O3``, no CPU-specific flags, about 0.2 s) into a cache directory
(``$AADL_FUNC_CACHE_DIR``, else ``$XDG_CACHE_HOME/aadl_func`` or ``~/.cache/aadl_func``),
under a name that hashes the source, the compiler and the flags, and loaded with
:mod:`ctypes`. Without a compiler, or with ``AADL_FUNC_NATIVE=0``, :func:`float64_dots`
returns None and the caller uses its torch path, which gives the same values up to float64
summation order; :func:`status` says which is in use.

The blocks of the pass are shared among ``torch.get_num_threads()`` OpenMP threads. The file
is built with ``-fopenmp`` and loaded after torch, so it binds to the OpenMP runtime torch
already loaded (the same ``libgomp.so.1``) and runs on torch's own threads, which would
otherwise spin idle right after torch's previous operation and slow a second pool down (a
torch built on another OpenMP runtime leaves the kernel its own libgomp pool: the same
results, some thread contention). A compiler without OpenMP gives a single-threaded build.
ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["append_differences", "available", "can_append", "float64_dots", "set_enabled", "status"]

_LOG = logging.getLogger("aadl_func")
_SOURCE = Path(__file__).with_name("_dots.c")
_VERSION = 3  # aadl_dots_version() of the source this module was written for
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
_OPENMP = "-fopenmp"

# Elements per block (at most the C side's AADL_MAX_BLOCK): the float64 copy of a vector
# block (16 KiB) stays in L1 while every row streams past it.
BLOCK = 2048
# Below this many row elements, threads cost more than they save.
_PARALLEL_MIN = 1 << 18

_KERNELS = {torch.float32: "aadl_dots_f32", torch.bfloat16: "aadl_dots_bf16"}

_lock = threading.Lock()
_attempted = False  # whether _load has tried to build/load the kernel (once per process)
_library: ctypes.CDLL | None = None
_status = "not loaded yet"
_enabled = os.environ.get("AADL_FUNC_NATIVE", "1") != "0"


def set_enabled(enabled: bool) -> bool:
    """Turns the kernel on or off for this process; returns the previous setting.

    Off, :func:`float64_dots` returns None (callers use their torch path). Tests use this to
    check both paths; ``AADL_FUNC_NATIVE=0`` sets the initial value.
    """
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def available() -> bool:
    """Whether the kernel is enabled and loaded (compiling it on the first call)."""
    return _enabled and _load() is not None


def status() -> str:
    """One line: the kernel in use (with its path) or why the torch path is used."""
    if not _enabled:
        return "disabled (AADL_FUNC_NATIVE=0 or set_enabled(False)): torch path"
    _load()
    return _status


def _cache_dirs() -> list[Path]:
    """Where the build may go, in order of preference (the first writable one is used)."""
    if os.environ.get("AADL_FUNC_CACHE_DIR"):
        return [Path(os.environ["AADL_FUNC_CACHE_DIR"])]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = getattr(os, "getuid", lambda: "user")()
    return [Path(base) / "aadl_func", Path(tempfile.gettempdir()) / f"aadl_func-{user}"]


def _compiler() -> list[str] | None:
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        if candidate:
            command = shlex.split(candidate)
            if command and shutil.which(command[0]):
                return command
    return None


def _load() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use), or None with the reason in ``_status``."""
    global _attempted, _library, _status
    if _attempted:
        return _library
    with _lock:
        if _attempted:
            return _library
        _attempted = True
        try:
            _library = _build_and_load()
            _status = f"native kernel: {_library._name}"
        except Exception as error:  # no compiler, read-only cache, ...: use torch
            _status = f"unavailable ({type(error).__name__}: {error}): torch path"
            _LOG.debug("aadl_func: %s", _status)
        return _library


def _build_and_load() -> ctypes.CDLL:
    if sys.platform == "win32":
        raise OSError("the native kernel is built on POSIX systems only")
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(compiler + _FLAGS).encode(), sys.platform.encode()])
    ).hexdigest()[:16]
    errors = []
    for directory in _cache_dirs():
        target = directory / f"dots-{key}.so"
        try:
            if not target.exists():
                _compile(compiler, directory, target)
            if hasattr(os, "getuid") and target.stat().st_uid != os.getuid():
                # Never load code another user could have placed (e.g. in a shared /tmp).
                raise OSError(f"{target} belongs to another user")
            break
        except OSError as error:  # e.g. a read-only home directory: try the next place
            errors.append(f"{directory}: {error}")
    else:
        raise OSError("; ".join(errors))
    library = ctypes.CDLL(str(target))
    library.aadl_dots_version.restype = ctypes.c_int64
    if library.aadl_dots_version() != _VERSION:
        raise OSError(f"{target} is not version {_VERSION} of the kernel")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _KERNELS.values():
        function = getattr(library, name)
        function.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr]
        function.restype = i64
    library.aadl_append_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr]
    library.aadl_append_f32.restype = i64
    return library


def _compile(compiler: list[str], directory: Path, target: Path) -> None:
    """Builds ``_dots.c`` into ``target``, with OpenMP if the compiler has it."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Built under a private name and renamed: processes compiling at once (e.g. the ranks of
    # a distributed job) never load a half-written file.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(handle)
    try:
        command = [*compiler, *_FLAGS, str(_SOURCE), "-o", partial]
        built = subprocess.run([*command, _OPENMP], capture_output=True, timeout=120)
        if built.returncode != 0:  # no OpenMP support: one thread
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _plain_vectors(tensors: Sequence[Tensor], dtype: torch.dtype, n: int) -> bool:
    """Plain 1-d, stride-1 CPU tensors of ``dtype`` and length ``n``."""
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.device.type != "cpu"
            or t.dtype != dtype
            or t.dim() != 1
            or t.shape[0] != n
            or (n > 1 and t.stride(0) != 1)
        ):
            return False
    return True


def _overlap(a: Tensor, b: Tensor) -> bool:
    start_a, start_b = a.data_ptr(), b.data_ptr()
    end_a = start_a + a.numel() * a.element_size()
    end_b = start_b + b.numel() * b.element_size()
    return start_a < end_b and start_b < end_a


def _threads(q: int, n: int, num_blocks: int) -> int:
    return max(1, min(torch.get_num_threads(), num_blocks, q * n // _PARALLEL_MIN))


def _pointers(rows: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(rows))(*[r.data_ptr() for r in rows])


def _call(kernel: Callable, q: int, n: int, *leading: Any) -> Tensor:
    """Runs a kernel whose arguments end in ``(n, block, threads, partial, out)``; returns
    ``out``, the ``(q,)`` float64 sums."""
    out = torch.zeros(q, dtype=torch.float64)
    if n == 0:
        return out
    num_blocks = -(-n // BLOCK)
    partial = torch.empty(num_blocks, q, dtype=torch.float64)
    threads = _threads(q, n, num_blocks)
    code = kernel(*leading, n, BLOCK, threads, partial.data_ptr(), out.data_ptr())
    if code != 0:
        raise RuntimeError(f"aadl_func native kernel failed with code {code}")
    return out


def float64_dots(rows: Sequence[Tensor], vector: Tensor) -> Tensor | None:
    r"""``out[j] = sum_i f64(rows[j][i]) * f64(vector[i])`` as a ``(len(rows),)`` float64 tensor.

    Returns None when the kernel is off or unavailable, or when the tensors are not all
    1-d, stride-1 CPU tensors of length ``n`` in float32 or bfloat16 (the caller then takes
    its torch path). Plain tensors only: under a torch.func transform the caller never gets
    here.
    """
    if not _enabled or not rows or vector.dtype not in _KERNELS or vector.dim() != 1:
        return None
    q, n = len(rows), vector.shape[0]
    if not _plain_vectors([*rows, vector], vector.dtype, n):
        return None
    library = _load()
    if library is None:
        return None
    kernel = getattr(library, _KERNELS[vector.dtype])
    return _call(kernel, q, n, _pointers(rows), q, vector.data_ptr())


def can_append(rows: Sequence[Tensor], slot: int, newest: Tensor, anchor: Tensor) -> bool:
    """Whether :func:`append_differences` applies to one leaf: float32 vectors as
    :func:`float64_dots` takes them, the slot overlapping neither ``newest`` nor ``anchor``
    nor these each other, and the kernel available."""
    if not _enabled or not rows or newest.dim() != 1 or not 0 <= slot < len(rows):
        return False
    n = newest.shape[0]
    if not _plain_vectors([*rows, newest, anchor], torch.float32, n):
        return False
    if n > 0 and (
        _overlap(rows[slot], newest) or _overlap(rows[slot], anchor) or _overlap(newest, anchor)
    ):
        return False
    return _load() is not None


def append_differences(
    leaves: Sequence[tuple[Sequence[Tensor], Tensor, Tensor]], slot: int
) -> list[Tensor] | None:
    r"""For every leaf ``(rows, newest, anchor)``, in one pass: ``rows[slot] = newest -
    anchor``, ``anchor = newest`` (in place) and the float64 dots of every row with the new
    ``rows[slot]``, as :func:`float64_dots` returns them (one ``(q,)`` tensor per leaf).

    The window's append step (a subtraction into the ring slot, the anchor copy and the
    Gram-row pass) fused for float32 windows; the subtraction rounds as ``torch.sub`` does.
    All or nothing: returns None, having written nothing, unless :func:`can_append` holds for
    every leaf.
    """
    if not all(can_append(rows, slot, newest, anchor) for rows, newest, anchor in leaves):
        return None
    results = []
    for rows, newest, anchor in leaves:
        q, n = len(rows), newest.shape[0]
        # Written behind torch's back: bump the version counters as an in-place op would.
        torch.autograd.graph.increment_version([rows[slot], anchor])
        pointers = _pointers(rows)
        results.append(
            _call(
                _library.aadl_append_f32,
                q,
                n,
                pointers,
                q,
                slot,
                newest.data_ptr(),
                anchor.data_ptr(),
            )
        )
    return results

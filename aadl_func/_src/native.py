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
(``$AADL_FUNC_CACHE_DIR``, else ``$XDG_CACHE_HOME/aadl_func`` or ``~/.cache/aadl_func``, else
``<tmp>/aadl_func-<uid>``), under a name that hashes the source, the compiler and the flags,
next to the SHA-256 of the build, and loaded with :mod:`ctypes`. A local attacker gets
nothing from the cache: a directory is used only if it is private to the user (else the
kernel is built in a fresh temporary directory and not cached), the file is opened without
following links and checked on its descriptor, its hash must match the recorded one (else it
is rebuilt), and what gets loaded is a sealed in-memory copy of the hashed bytes (see the
loader below and docs/reliability.md, "Threat model"). Without a compiler, or with
``AADL_FUNC_NATIVE=0``, :func:`float64_dots` returns None and the caller uses its torch path,
which gives the same values up to float64 summation order; :func:`status` says which is in
use.

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
import errno
import hashlib
import logging
import os
import secrets
import shlex
import shutil
import stat
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
# Below this many row elements (rows x length), threads cost more than they save. The
# float64 products make the pass compute-bound well below memory speed on small windows:
# measured on this 2-core machine, the fused append of 4 rows takes 23 / 20 us with one /
# two threads at n = 2^12, 47 / 33 us at 2^14 and 132 / 77 us at 2^16.
_PARALLEL_MIN = 1 << 14

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


def _library_stem(compiler: list[str]) -> str:
    """``dots-<key>``: the key hashes the source, the compiler command and the flags."""
    key = hashlib.sha256(
        b"\0".join(
            [_SOURCE.read_bytes(), " ".join(compiler + _FLAGS).encode(), sys.platform.encode()]
        )
    ).hexdigest()[:16]
    return f"dots-{key}"


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
            _library, where = _build_and_load()
            _status = f"native kernel: {where}"
        except Exception as error:  # no compiler, no usable directory, ...: use torch
            _status = f"unavailable ({type(error).__name__}: {error}): torch path"
            _LOG.debug("aadl_func: %s", _status)
        return _library


# Loading native code safely. Anyone who can write the file we load, or the directory it is
# in, runs code in this process; so a file is trusted only when it sits in a directory private
# to this user (created here with mode 0700, or found as a real directory owned by the user
# with no group/other bits), was opened without following a symbolic link, passes fstat checks
# on that very descriptor, and hashes to the SHA-256 recorded when it was built. What gets
# mapped is then an anonymous, sealed copy of exactly the hashed bytes. Every file operation
# goes through descriptors of directories already checked, so renaming a path afterwards
# changes nothing. docs/reliability.md ("Threat model") lists the guarantees and their tests.

_MAX_LIBRARY_BYTES = 16 << 20  # a build is about 30 KiB; anything far larger is not one
_MAX_CHECKSUM_BYTES = 256


class _UnsafeError(OSError):
    """A directory or file that someone other than this user could have written."""


def _dir_flags() -> int:
    return os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _file_flags() -> int:
    # O_NONBLOCK: opening a FIFO planted under the name must not hang (no effect on files).
    return os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_private_dir(directory: Path) -> int:
    """A descriptor of ``directory``, once it is known to be private to this user.

    A missing directory is created with mode 0700. An existing one is used only if it is a
    real directory (not a symbolic link) owned by this user with no permission bits for
    group or others: anyone else who could write into it could replace the library.
    Raises OSError (:class:`_UnsafeError` for a refusal) with the reason.
    """
    created = False
    try:
        os.makedirs(directory, mode=0o700)
        created = True
    except FileExistsError:
        if stat.S_ISLNK(os.lstat(directory).st_mode):
            raise _UnsafeError(f"{directory} is a symbolic link") from None
    try:
        # O_NOFOLLOW also refuses a symbolic link swapped in after the lstat above.
        fd = os.open(directory, _dir_flags())
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _UnsafeError(f"{directory} is not a directory ({error.strerror})") from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise _UnsafeError(f"{directory} belongs to uid {info.st_uid}, not {os.getuid()}")
        if created:  # only a directory made just now: the umask may have cleared owner bits
            os.fchmod(fd, 0o700)
            info = os.fstat(fd)
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise _UnsafeError(
                f"{directory} has mode {stat.S_IMODE(info.st_mode):#o}: "
                "group or others have access (0700 required)"
            )
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_checked(fd: int, limit: int) -> bytes:
    """The whole content of the open file ``fd``, after checking that descriptor: a regular
    file owned by this user, not writable by group or others, of 1 to ``limit`` bytes."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _UnsafeError("not a regular file")
    if info.st_uid != os.getuid():
        raise _UnsafeError(f"owned by uid {info.st_uid}, not {os.getuid()}")
    if info.st_mode & 0o022:
        raise _UnsafeError(f"mode {stat.S_IMODE(info.st_mode):#o}: writable by group or others")
    if not 0 < info.st_size <= limit:
        raise OSError(f"{info.st_size} bytes (1 to {limit} expected)")
    chunks, left = [], info.st_size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left or os.read(fd, 1):
        raise OSError("changed size while being read")
    return b"".join(chunks)


def _open_read(dir_fd: int, name: str, limit: int) -> tuple[int, bytes]:
    """Opens ``name`` in the directory ``dir_fd`` without following a symbolic link and
    reads it with :func:`_read_checked`; returns the descriptor and the bytes."""
    try:
        fd = os.open(name, _file_flags(), dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _UnsafeError(f"{name} is a symbolic link") from None
        raise
    try:
        return fd, _read_checked(fd, limit)
    except BaseException:
        os.close(fd)
        raise


def _verified_library(dir_fd: int, stem: str) -> tuple[int, bytes]:
    """The cached library's descriptor and bytes, if they hash to the recorded checksum.

    FileNotFoundError means no library is cached; any other OSError, that it must not be
    loaded (a failed check, no or another checksum).
    """
    fd, data = _open_read(dir_fd, f"{stem}.so", _MAX_LIBRARY_BYTES)
    try:
        try:
            checksum_fd, recorded = _open_read(dir_fd, f"{stem}.sha256", _MAX_CHECKSUM_BYTES)
            os.close(checksum_fd)
        except FileNotFoundError:
            raise OSError("no checksum recorded") from None
        if hashlib.sha256(data).hexdigest() != recorded.decode("ascii", "replace").strip():
            raise OSError("its SHA-256 differs from the recorded checksum")
        return fd, data
    except BaseException:
        os.close(fd)
        raise


def _write_new(dir_fd: int, name: str, data: bytes) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _build(compiler: list[str], dir_fd: int, directory: Path, stem: str) -> tuple[int, bytes]:
    """Compiles ``_dots.c`` (with OpenMP if the compiler has it) and installs it in the
    private directory ``dir_fd`` (whose path is ``directory``) as ``<stem>.so`` next to
    ``<stem>.sha256``; returns a descriptor of the new library and its bytes."""
    scratch = f".build-{secrets.token_hex(8)}"
    os.mkdir(scratch, 0o700, dir_fd=dir_fd)
    scratch_fd = os.open(scratch, _dir_flags(), dir_fd=dir_fd)
    try:
        # The compiler only takes a path. Should the path no longer lead to the checked
        # directory, the output lands elsewhere and is not found through scratch_fd below.
        command = [*compiler, *_FLAGS, str(_SOURCE), "-o", str(directory / scratch / "dots.so")]
        built = subprocess.run([*command, _OPENMP], capture_output=True, timeout=120)
        if built.returncode != 0:  # no OpenMP support: one thread
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        fd = os.open("dots.so", _file_flags(), dir_fd=scratch_fd)
        try:
            os.fchmod(fd, 0o600)  # the compiler applied the umask, maybe group-writable
            data = _read_checked(fd, _MAX_LIBRARY_BYTES)
            _write_new(scratch_fd, "dots.sha256", f"{hashlib.sha256(data).hexdigest()}\n".encode())
            # Both files are complete under private names; two renames publish them. The
            # loader accepts a pair only if the library hashes to the checksum, so a crash
            # between the renames (or a concurrent build) can cost a rebuild, never a load of
            # unchecked bytes. The checksum goes first so that the library's name is the last
            # thing to change: a first build interrupted half-way leaves no library behind,
            # and a finished one never leaves a library without its checksum.
            os.replace("dots.sha256", f"{stem}.sha256", src_dir_fd=scratch_fd, dst_dir_fd=dir_fd)
            os.replace("dots.so", f"{stem}.so", src_dir_fd=scratch_fd, dst_dir_fd=dir_fd)
            return fd, data
        except BaseException:
            os.close(fd)
            raise
    finally:
        for name in os.listdir(scratch_fd):
            os.unlink(name, dir_fd=scratch_fd)
        os.close(scratch_fd)
        os.rmdir(scratch, dir_fd=dir_fd)


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _dlopen_verified(fd: int, data: bytes) -> tuple[ctypes.CDLL, str]:
    """Loads exactly ``data``, the verified content of the open file ``fd``.

    Preferably from an anonymous memory file holding a sealed copy of the bytes: nothing can
    change what gets mapped after the check, and truncating the cached file later cannot
    fault the process (SIGBUS). Where that fails (no ``memfd_create``, or executable memory
    files forbidden), from the verified descriptor itself, never from the path again.
    """
    if hasattr(os, "memfd_create"):
        import fcntl

        try:
            memfd = os.memfd_create("aadl_func-dots", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as error:
            _LOG.debug("aadl_func: memfd_create failed (%s)", error)
        else:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(memfd, view) :]
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
                fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)
                return ctypes.CDLL(_fd_path(memfd)), "loaded from a sealed in-memory copy"
            except OSError as error:  # e.g. vm.memfd_noexec
                _LOG.debug("aadl_func: loading from a memory file failed (%s)", error)
            finally:
                os.close(memfd)  # the mapping keeps the memory file alive
    return ctypes.CDLL(_fd_path(fd)), "loaded from the verified descriptor"


def _load_from(
    dir_fd: int, directory: Path, stem: str, compiler: list[str]
) -> tuple[ctypes.CDLL, str]:
    """Loads ``<stem>.so`` from the private directory, (re)building it first unless it
    passes every check; returns the library and how it was obtained."""
    try:
        fd, data = _verified_library(dir_fd, stem)
        how = "cached build verified"
    except FileNotFoundError:
        fd, data = _build(compiler, dir_fd, directory, stem)
        how = "built"
    except OSError as error:
        _LOG.warning(
            "aadl_func: not loading %s (%s); rebuilding it", directory / f"{stem}.so", error
        )
        fd, data = _build(compiler, dir_fd, directory, stem)
        how = f"rebuilt: {error}"
    try:
        library, loaded = _dlopen_verified(fd, data)
    finally:
        os.close(fd)
    return _bind(library), f"{how}, {loaded}"


def _build_and_load() -> tuple[ctypes.CDLL, str]:
    """The kernel and where it came from: from the first private cache directory, else
    built in a fresh private temporary directory that is deleted after loading."""
    if sys.platform == "win32":
        raise OSError("the native kernel is built on POSIX systems only")
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    stem = _library_stem(compiler)
    errors = []
    for directory in _cache_dirs():
        try:
            dir_fd = _open_private_dir(directory)
        except OSError as error:  # e.g. a read-only home directory: try the next place
            errors.append(str(error))
            if isinstance(error, _UnsafeError):
                _LOG.warning("aadl_func: not using %s as the kernel cache: %s", directory, error)
            continue
        try:
            library, how = _load_from(dir_fd, directory, stem, compiler)
            return library, f"{directory / stem}.so ({how})"
        except OSError as error:  # e.g. a full disk
            errors.append(f"{directory}: {error}")
        finally:
            os.close(dir_fd)
    # No private cache directory: mkdtemp makes a new one (0700), deleted once loaded.
    scratch = Path(tempfile.mkdtemp(prefix="aadl_func-"))
    try:
        dir_fd = _open_private_dir(scratch)
        try:
            library, how = _load_from(dir_fd, scratch, stem, compiler)
        finally:
            os.close(dir_fd)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return library, f"not cached ({how}; {'; '.join(errors)})"


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
    return library


def _plain_vectors(tensors: Sequence[Tensor], dtype: torch.dtype, n: int) -> bool:
    """Plain CPU tensors of ``dtype`` whose ``n`` elements lie contiguously in memory (a 1-d
    stride-1 vector, or any C-contiguous tensor: the kernels only see a pointer and ``n``)."""
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.dtype != dtype
            or not t.is_cpu
            or t.numel() != n
            or not t.is_contiguous()
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
    if n == 0:
        return torch.zeros(q, dtype=torch.float64)
    out = torch.empty(q, dtype=torch.float64)  # every entry written by the kernel
    num_blocks = -(-n // BLOCK)
    partial = torch.empty(num_blocks, q, dtype=torch.float64)
    threads = _threads(q, n, num_blocks)
    code = kernel(*leading, n, BLOCK, threads, partial.data_ptr(), out.data_ptr())
    if code != 0:
        raise RuntimeError(f"aadl_func native kernel failed with code {code}")
    return out


def float64_dots(rows: Sequence[Tensor], vector: Tensor) -> Tensor | None:
    r"""``out[j] = sum_i f64(rows[j][i]) * f64(vector[i])`` as a ``(len(rows),)`` float64 tensor.

    Returns None when the kernel is off or unavailable, or when ``vector`` is not a 1-d,
    stride-1 CPU tensor of length ``n`` in float32 or bfloat16 and the rows contiguous CPU
    tensors of ``n`` elements of its dtype (the caller then takes its torch path). Plain
    tensors only: under a torch.func transform the caller never gets here.
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
    """Whether :func:`append_differences` applies to one leaf: float32 CPU tensors of one
    size, each contiguous (C order, any shape), the slot overlapping neither ``newest`` nor
    ``anchor`` nor these each other, and the kernel available."""
    if not _enabled or not rows or not 0 <= slot < len(rows):
        return False
    n = newest.numel()
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
        q, n = len(rows), newest.numel()
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

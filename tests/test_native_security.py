"""Loading the native kernel gives a local attacker nothing (aadl_func/_src/native.py).

Each test sets up one attack on the kernel cache in a temporary directory -- a directory
others can write or own, a symbolic link, a library renamed over the checked one, a broken
cached file -- and loads the kernel in a fresh interpreter (the loader runs once per
process). The attacker's library writes a marker file from its constructor, so a load of it
shows, whatever happens afterwards; a real kernel must be loaded (or rebuilt) instead, and
the process must exit normally (a SIGBUS would show as a negative return code).
docs/reliability.md ("Threat model") lists these guarantees.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the loader is tested on Linux"
    ),
    pytest.mark.skipif(
        not any(shutil.which(c) for c in ("cc", "gcc", "clang")), reason="no C compiler"
    ),
]

ATTACKER_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
__attribute__((constructor)) static void run_on_load(void) {
    const char *path = getenv("AADL_TEST_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) { fputs("attacker code ran\n", f); fclose(f); }
}
/* Looks like the kernel to a loader that only checks the version. */
int64_t aadl_dots_version(void) { return 3; }
"""

# Loads the kernel, runs it on data whose float64 dot product is known exactly, and reports.
PROBE = """
    import json, torch
    from aadl_func._src import native
    ones = torch.ones(5000)
    dots = native.float64_dots([ones, 2 * ones], ones) if native.available() else None
    print(json.dumps({
        "available": native.available(),
        "status": native.status(),
        "dots": None if dots is None else dots.tolist(),
    }))
"""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_in_fresh_python(env: dict, prelude: str = "", unset=()) -> dict:
    """Runs ``prelude`` then PROBE in a new interpreter; returns the probe's report."""
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(PROBE)],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A negative code is a signal: -7 would be the SIGBUS of mapping a truncated file.
    assert result.returncode == 0, (result.returncode, result.stderr)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["stderr"] = result.stderr
    return report


def assert_real_kernel(report: dict, marker: Path) -> None:
    assert not marker.exists(), "the attacker's library was loaded"
    assert report["available"], report["status"]
    assert report["dots"] == [5000.0, 10000.0]  # sum of 1*1 and 2*1 over 5000 elements


@pytest.fixture(scope="module")
def real_build(tmp_path_factory) -> dict:
    """A real kernel built by the loader (under umask 0, into a directory it creates):
    the name it uses, its bytes, and the modes it left."""
    root = tmp_path_factory.mktemp("real")
    cache = root / "new" / "cache"
    report = load_in_fresh_python({"AADL_FUNC_CACHE_DIR": str(cache)}, "import os; os.umask(0)\n")
    assert report["available"], report["status"]
    (library,) = cache.glob("dots-*.so")
    return {
        "name": library.name,
        "stem": library.name[: -len(".so")],
        "data": library.read_bytes(),
        "checksum": (cache / f"{library.stem}.sha256").read_text(),
        "modes": {p.name: p.stat().st_mode & 0o7777 for p in [cache, *cache.iterdir()]},
        "entries": sorted(p.name for p in cache.iterdir()),
        "status": report["status"],
    }


@pytest.fixture(scope="module")
def attacker_library(tmp_path_factory) -> bytes:
    """The bytes of a shared library whose constructor writes $AADL_TEST_MARKER."""
    root = tmp_path_factory.mktemp("attacker")
    (root / "evil.c").write_text(ATTACKER_SOURCE)
    compiler = os.environ.get("CC") or next(c for c in ("cc", "gcc", "clang") if shutil.which(c))
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(root / "evil.so"), str(root / "evil.c")],
        check=True,
        capture_output=True,
    )
    return (root / "evil.so").read_bytes()


def plant(directory: Path, name: str, data: bytes, checksum: str | None) -> None:
    """Writes ``name`` and (unless None) ``<stem>.sha256`` into ``directory``."""
    (directory / name).write_bytes(data)
    if checksum is not None:
        (directory / name.replace(".so", ".sha256")).write_text(checksum)


def snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)
    return path


def test_first_build_is_private_and_checksummed(real_build):
    # Created under umask 0: the directory is still 0700, the files 0600.
    name, stem = real_build["name"], real_build["stem"]
    assert real_build["entries"] == [f"{stem}.sha256", name]  # no build leftovers
    assert real_build["modes"] == {"cache": 0o700, name: 0o600, f"{stem}.sha256": 0o600}
    assert real_build["checksum"].strip() == sha256(real_build["data"])
    assert "(built, loaded from a sealed in-memory copy)" in real_build["status"]


@pytest.mark.parametrize("mode", [0o777, 0o755], ids=["0777", "0755"])
def test_cache_dir_open_to_others_is_refused(tmp_path, real_build, attacker_library, mode):
    # An attacker's library with a valid checksum: only the directory check can stop it.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    plant(shared, real_build["name"], attacker_library, sha256(attacker_library))
    before = snapshot(shared)
    temp = private_dir(tmp_path / "tmp")
    marker = tmp_path / "marker"
    report = load_in_fresh_python(
        {"AADL_FUNC_CACHE_DIR": str(shared), "TMPDIR": str(temp), "AADL_TEST_MARKER": str(marker)}
    )
    assert_real_kernel(report, marker)
    assert f"{shared} has mode {mode:#o}" in report["status"]
    assert "not cached" in report["status"]
    assert snapshot(shared) == before  # nothing written there
    assert list(temp.iterdir()) == []  # the uncached build was deleted


def test_predictable_tmp_fallback_is_refused_when_precreated(
    tmp_path, real_build, attacker_library
):
    # No usable XDG cache (its parent is a file) and <tmp>/aadl_func-<uid> made by someone
    # else, world-writable: both refused, the kernel built in a private temp dir and deleted.
    (tmp_path / "not-a-dir").write_text("")
    temp = private_dir(tmp_path / "tmp")
    planted = temp / f"aadl_func-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    plant(planted, real_build["name"], attacker_library, sha256(attacker_library))
    before = snapshot(planted)
    marker = tmp_path / "marker"
    report = load_in_fresh_python(
        {
            "XDG_CACHE_HOME": str(tmp_path / "not-a-dir"),
            "TMPDIR": str(temp),
            "AADL_TEST_MARKER": str(marker),
        },
        unset=["AADL_FUNC_CACHE_DIR"],
    )
    assert_real_kernel(report, marker)
    assert f"{planted} has mode 0o777" in report["status"]
    assert "not using" in report["stderr"]  # the refusal is logged as a warning
    assert [p.name for p in temp.iterdir()] == [planted.name]
    assert snapshot(planted) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_cache_dir_of_another_user_is_refused(tmp_path, real_build, attacker_library):
    other = private_dir(tmp_path / "other")
    plant(other, real_build["name"], attacker_library, sha256(attacker_library))
    for path in [other, *other.iterdir()]:
        os.chown(path, 65534, 65534)  # nobody
    tmp_path.chmod(0o755)  # let nobody's directory be reached, as in a shared /tmp
    marker = tmp_path / "marker"
    report = load_in_fresh_python(
        {
            "AADL_FUNC_CACHE_DIR": str(other),
            "TMPDIR": str(tmp_path),
            "AADL_TEST_MARKER": str(marker),
        }
    )
    assert_real_kernel(report, marker)
    assert f"{other} belongs to uid 65534, not {os.getuid()}" in report["status"]


def test_symlinked_cache_dir_is_refused(tmp_path, real_build, attacker_library):
    real = private_dir(tmp_path / "real")
    plant(real, real_build["name"], attacker_library, sha256(attacker_library))
    before = snapshot(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    marker = tmp_path / "marker"
    report = load_in_fresh_python(
        {"AADL_FUNC_CACHE_DIR": str(link), "TMPDIR": str(tmp_path), "AADL_TEST_MARKER": str(marker)}
    )
    assert_real_kernel(report, marker)
    assert f"{link} is a symbolic link" in report["status"]
    assert snapshot(real) == before


def test_symlinked_library_is_replaced_not_loaded(tmp_path, real_build, attacker_library):
    # The link points to a file of the right owner with a matching checksum.
    cache = private_dir(tmp_path / "cache")
    evil = tmp_path / "evil.so"
    evil.write_bytes(attacker_library)
    evil.chmod(0o600)
    (cache / real_build["name"]).symlink_to(evil)
    (cache / f"{real_build['stem']}.sha256").write_text(sha256(attacker_library))
    marker = tmp_path / "marker"
    report = load_in_fresh_python(
        {"AADL_FUNC_CACHE_DIR": str(cache), "AADL_TEST_MARKER": str(marker)}
    )
    assert_real_kernel(report, marker)
    assert "rebuilt" in report["status"] and "symbolic link" in report["status"]
    library = cache / real_build["name"]
    assert not library.is_symlink()
    assert (cache / f"{real_build['stem']}.sha256").read_text().strip() == sha256(
        library.read_bytes()
    )
    assert evil.read_bytes() == attacker_library  # the link was replaced, not written through


# Swaps the attacker's library in under the checked name at a chosen point of the load.
RACE = """
    import os
    from aadl_func._src import native
    CACHE, NAME, EVIL, WHEN = {cache!r}, {name!r}, {evil!r}, {when!r}
    if {no_memfd}:
        del os.memfd_create
    checked_read = native._read_checked

    def racing_read(fd, limit):
        if limit == native._MAX_LIBRARY_BYTES and WHEN == "before-read":
            os.replace(EVIL, os.path.join(CACHE, NAME))  # after open, before fstat and read
        data = checked_read(fd, limit)
        if limit == native._MAX_LIBRARY_BYTES and WHEN == "after-check":
            os.replace(EVIL, os.path.join(CACHE, NAME))  # checked and read, not yet loaded
        return data

    native._read_checked = racing_read
"""


@pytest.mark.parametrize(
    "when,no_memfd",
    [("after-check", False), ("after-check", True), ("before-read", False)],
    ids=["after-check", "after-check-no-memfd", "before-read"],
)
def test_library_renamed_over_the_checked_one_is_not_loaded(
    tmp_path, real_build, attacker_library, when, no_memfd
):
    cache = private_dir(tmp_path / "cache")
    plant(cache, real_build["name"], real_build["data"], real_build["checksum"])
    (cache / real_build["name"]).chmod(0o600)
    evil = cache / "evil.so"  # same owner, same directory, a rename away
    evil.write_bytes(attacker_library)
    evil.chmod(0o600)
    marker = tmp_path / "marker"
    race = RACE.format(
        cache=str(cache), name=real_build["name"], evil=str(evil), when=when, no_memfd=no_memfd
    )
    report = load_in_fresh_python(
        {"AADL_FUNC_CACHE_DIR": str(cache), "AADL_TEST_MARKER": str(marker)}, race
    )
    assert_real_kernel(report, marker)
    assert (cache / real_build["name"]).read_bytes() == attacker_library  # the swap happened
    assert "cached build verified" in report["status"]
    how = "the verified descriptor" if no_memfd else "a sealed in-memory copy"
    assert f"loaded from {how}" in report["status"]


@pytest.mark.parametrize(
    "damage", ["truncated", "garbage", "empty", "mode-0666", "no-checksum", "other-checksum"]
)
def test_broken_cached_library_is_rebuilt_not_loaded(tmp_path, real_build, damage):
    data, checksum = real_build["data"], real_build["checksum"]
    if damage == "truncated":
        data = data[: len(data) // 2]  # mapping this would SIGBUS
    elif damage == "garbage":
        data = os.urandom(len(data))
    elif damage == "empty":
        data = b""
    elif damage == "no-checksum":
        checksum = None
    elif damage == "other-checksum":
        checksum = sha256(b"another build")
    cache = private_dir(tmp_path / "cache")
    plant(cache, real_build["name"], data, checksum)
    library = cache / real_build["name"]
    library.chmod(0o666 if damage == "mode-0666" else 0o600)
    report = load_in_fresh_python({"AADL_FUNC_CACHE_DIR": str(cache)})
    assert report["available"] and report["dots"] == [5000.0, 10000.0], report["status"]
    assert "rebuilt" in report["status"] and "rebuilding" in report["stderr"]
    repaired = library.read_bytes()
    assert (cache / f"{real_build['stem']}.sha256").read_text().strip() == sha256(repaired)
    assert library.stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in cache.iterdir()) == real_build["entries"]  # no leftovers

#!/usr/bin/env python3
"""Builds the sdist, installs it into a fresh virtual environment and runs the tests from it.

    python scripts/sdist_check.py                          # the whole suite (make sdist)
    python scripts/sdist_check.py -- tests/test_errors.py  # pytest arguments after --
    python scripts/sdist_check.py --keep /tmp/sdist        # keep the work folder

What a user who downloads the sdist gets: the archive is unpacked, installed (``pip install
--no-deps``, which compiles the optional kernel as ``pip install`` does) into a new venv, and
pytest runs on the unpacked ``tests/`` from outside the unpacked tree, so that ``import
aadl_func`` finds the installed package and not the sources beside the tests (the script checks
that it does). The dependencies (torch, optree, the test extras) are not downloaded again: the
new venv sees this interpreter's site-packages after its own (a ``.pth`` file), where the
package itself is not, or is only an editable link that a ``.pth`` line does not activate.

Exit status: pytest's (0 when every test passes); 2 when the build or the install fails.
"""

from __future__ import annotations

import argparse
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# Build outputs and local state left out of the copy the sdist is built from; above all the
# egg-info, whose SOURCES.txt setuptools would reuse as the file list (hiding a MANIFEST.in
# that misses a file).
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", ".compat", "*.egg-info", "build", "dist", "site", "runs", "bench_results",
    "__pycache__", "*.so", ".pytest_cache", ".ruff_cache", ".hypothesis",
)  # fmt: skip


def build_sdist(out: Path) -> Path:
    """The sdist of a clean copy of the checkout, built by setuptools' PEP 517 backend (no
    build isolation: nothing is downloaded)."""
    source = out / "checkout"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCES)
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    name = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    shutil.rmtree(source)
    return out / name


def make_venv(venv: Path) -> Path:
    """A new venv that sees this interpreter's packages after its own; its python."""
    # Without pip (and the old setuptools it brings): the outer ones, seen through the .pth,
    # build and install, as no build isolation needs a setuptools new enough for pyproject.toml.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(own, "_outer_site_packages.pth").write_text("\n".join(outer) + "\n")
    return python


def install(python: Path, sdist: Path) -> None:
    options = ["-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([str(python), "-m", "pip", "install", *options, str(sdist)], check=True)


def unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    return into / sdist.name.removesuffix(".tar.gz")


def installed_location(python: Path, cwd: Path) -> str:
    code = "import aadl_func; print(aadl_func.__file__)"
    return subprocess.run(
        [str(python), "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default=None, help="work folder to keep (default: a temp dir)")
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1 :] or ["tests"]
    with tempfile.TemporaryDirectory(prefix="aadl_func-sdist-") as scratch:
        work = Path(args.keep or scratch)
        work.mkdir(parents=True, exist_ok=True)
        try:
            sdist = build_sdist(work)
            python = make_venv(work / "venv")
            install(python, sdist)
            source = unpack(sdist, work / "unpacked")
            location = installed_location(python, work)
        except subprocess.CalledProcessError as error:
            print(f"sdist_check: {error}\n{error.stderr or ''}", file=sys.stderr)
            return 2
        if not location.startswith(str(work / "venv")):
            print(f"sdist_check: aadl_func imports from {location}, not the venv", file=sys.stderr)
            return 2
        print(f"sdist_check: {sdist.name} installed ({location}); pytest {' '.join(pytest_args)}")
        # Paths of the unpacked sdist (``tests/x.py::name`` too); other arguments as given.
        paths = [
            str(source / a) if (source / a.split("::")[0]).exists() else a for a in pytest_args
        ]
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
        return subprocess.run(command, cwd=work).returncode


if __name__ == "__main__":
    sys.exit(main())

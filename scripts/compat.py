#!/usr/bin/env python3
"""Runs the test suite against the oldest and the newest torch and optree this package supports.

    python scripts/compat.py                 # the declared oldest and the registry's newest
    python scripts/compat.py 2.10.0 2.12.1   # given torch releases instead
    python scripts/compat.py --optree 0.13.0 2.13.0   # a given optree with each of them
    python scripts/compat.py -- -k "not distributed" tests/test_anderson.py   # pytest args

For each release it makes a virtual environment ``<venvs>/torch-<version>`` (kept and reused
on the next run unless ``--fresh``), installs ``torch==<version>`` from the package index and
this checkout (editable) with its ``test`` and ``examples`` extras, then ``optree==<its
release>`` (by default the declared oldest optree with the oldest torch and the newest optree
with the newest torch: the two ends, each tested with the other's), checks that
``import aadl_func`` works, runs pytest there and prints one table row per release: tests
passed/failed/skipped, and separately those of ``tests/test_compile.py`` (torch.compile) and
``tests/test_distributed.py`` (torch.distributed). The table is also written to
``<venvs>/compat.md``; each release's pytest output to ``<venvs>/torch-<version>/pytest.txt``.

"Declared oldest" is the oldest release the index serves that satisfies the ``torch>=X`` (and
``optree>=X``) floor in pyproject.toml; "newest" is the newest final release the index serves.
pip runs with your pip configuration: where it constrains torch (a local cap), lift it for
this command, e.g. ``PIP_CONFIG_FILE=/dev/null``. Releases from PyPI are CUDA builds, several
GB each; they run on the CPU here like the CPU builds do.

Exit status: 0 when every release imports and passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"compile": "test_compile.py", "distributed": "test_distributed.py"}


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def declared_floor(package: str = "torch") -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{package}\s*>=\s*([0-9][0-9.]*)', text)
    if not m:
        sys.exit(f"compat: no {package}>=X requirement in pyproject.toml")
    return m.group(1)


def index_versions(python: str, package: str = "torch") -> list[str]:
    """Final releases of ``package`` the package index serves (local +cpu builds and
    pre-releases left out), oldest first."""
    out = subprocess.run(
        [python, "-m", "pip", "index", "versions", package],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = re.search(r"Available versions:\s*(.*)", out)
    if not m:
        sys.exit(f"compat: cannot read `pip index versions {package}`:\n{out}")
    found = {v.strip() for v in m.group(1).split(",")}
    return sorted((v for v in found if re.fullmatch(r"\d+(\.\d+)*", v)), key=version_key)


def default_versions(python: str, package: str = "torch") -> list[str]:
    """[oldest supported, newest] releases of ``package`` on the index (one if they agree)."""
    available = index_versions(python, package)
    floor = version_key(declared_floor(package))
    supported = [v for v in available if version_key(v)[: len(floor)] >= floor]
    if not supported:
        sys.exit(f"compat: the index serves no {package} >= {declared_floor(package)}")
    return sorted({supported[0], supported[-1]}, key=version_key)


def optree_for(versions: list[str], pinned: str | None, python: str) -> dict[str, str]:
    """The optree release each torch release is tested with: ``pinned`` for all, else the
    oldest optree with the oldest torch and the newest with every other."""
    if pinned is not None:
        return dict.fromkeys(versions, pinned)
    ends = default_versions(python, "optree")
    oldest = min(versions, key=version_key)
    return {v: ends[0] if v == oldest else ends[-1] for v in versions}


def run(cmd: list[str], log, **kwargs) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, **kwargs).returncode


def prepare(version: str, optree: str, venv: Path, fresh: bool, python: str, log) -> str | None:
    """Creates/refreshes the venv; returns an error line or None."""
    if fresh and venv.exists():
        shutil.rmtree(venv)
    py = str(venv / "bin" / "python")
    if not (venv / "bin" / "python").exists():
        if run([python, "-m", "venv", str(venv)], log):
            return "venv creation failed"
    if run([py, "-m", "pip", "install", "-q", f"torch=={version}"], log):
        return f"pip install torch=={version} failed (see {log.name})"
    if run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test,examples]"], log):
        return f"pip install of aadl_func[test,examples] failed (see {log.name})"
    if run([py, "-m", "pip", "install", "-q", f"optree=={optree}"], log):
        return f"pip install optree=={optree} failed (see {log.name})"
    return None


def counts(junit: Path) -> dict[str, list[int]]:
    """{group: [passed, failed, skipped]} for "all" and each of GROUPS."""
    table = {g: [0, 0, 0] for g in ("all", *GROUPS)}
    for case in ET.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = 1 if tags & {"failure", "error"} else 2 if "skipped" in tags else 0
        where = (case.get("file") or "") + " " + (case.get("classname") or "")
        for group, name in GROUPS.items():
            if name.removesuffix(".py") in where:
                table[group][outcome] += 1
        table["all"][outcome] += 1
    return table


def cell(c: list[int]) -> str:
    passed, failed, skipped = c
    return f"{passed}/{failed}/{skipped}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="torch releases (default: oldest, newest)")
    parser.add_argument(
        "--venvs",
        default=os.environ.get("COMPAT_DIR", str(ROOT / ".compat")),
        help="where the venvs go (default: $COMPAT_DIR or .compat)",
    )
    parser.add_argument("--fresh", action="store_true", help="recreate the venvs")
    parser.add_argument(
        "--optree", default=None, help="optree release for every row (default: the two ends)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venvs")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1 :]
    versions = args.versions or default_versions(args.python)
    optrees = optree_for(versions, args.optree, args.python)
    base = Path(args.venvs).resolve()
    base.mkdir(parents=True, exist_ok=True)
    pairs = ", ".join(f"torch {v} with optree {optrees[v]}" for v in versions)
    print(f"compat: {pairs}; venvs in {base}", flush=True)

    rows, ok = [], True
    for version in versions:
        venv = base / f"torch-{version}"
        start = time.monotonic()
        log_path = base / f"torch-{version}.install.txt"
        with open(log_path, "w") as log:
            error = prepare(version, optrees[version], venv, args.fresh, args.python, log)
        install_s = time.monotonic() - start
        py = str(venv / "bin" / "python")
        row = {"torch": version, "optree": optrees[version], "install": f"{install_s:.0f} s"}
        if error is None:
            probe = subprocess.run(
                [
                    py,
                    "-W",
                    "error",
                    "-c",
                    "import aadl_func, optree, torch; print(torch.__version__, optree.__version__)",
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            if probe.returncode:
                lines = probe.stderr.strip().splitlines() or ["?"]
                error = "import failed: " + lines[-1]
            else:
                row["build"], row["optree"] = probe.stdout.split()
        if error is not None:
            ok = False
            row.update(importable="no", notes=error)
            rows.append(row)
            print(f"compat: torch {version}: {error}", flush=True)
            continue
        junit = venv / "junit.xml"
        junit.unlink(missing_ok=True)
        print(f"compat: torch {row['build']}: running the tests", flush=True)
        start = time.monotonic()
        with open(venv / "pytest.txt", "w") as out:
            rc = run(
                [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
                + pytest_args,
                out,
                cwd=ROOT,
            )
        row["time"] = f"{time.monotonic() - start:.0f} s"
        row["importable"] = "yes"
        if junit.exists():
            row.update({g: cell(c) for g, c in counts(junit).items()})
        ok = ok and rc == 0
        row["notes"] = "pass" if rc == 0 else f"pytest exit {rc}, see {venv / 'pytest.txt'}"
        rows.append(row)

    head = ["torch", "optree", "import", "tests p/f/s", "compile p/f/s", "distributed p/f/s",
            "install", "tests time", "notes"]  # fmt: skip
    keys = [
        "build",
        "optree",
        "importable",
        "all",
        "compile",
        "distributed",
        "install",
        "time",
        "notes",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        row.setdefault("build", row["torch"])
        lines.append("| " + " | ".join(str(row.get(k, "-")) for k in keys) + " |")
    table = "\n".join(lines)
    (base / "compat.md").write_text(table + "\n")
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The sdist is complete: built from the checkout, it carries every test with its helpers, the
docs, the examples and the changelog, and its tests pass when it is installed into a fresh
virtual environment (scripts/sdist_check.py; ``make sdist`` runs the whole suite that way).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sdist_check  # noqa: E402

if not (ROOT / "pyproject.toml").exists():  # pragma: no cover - run from an installed copy
    pytest.skip("needs the source tree", allow_module_level=True)


def _checkout_files() -> set[str]:
    found = {"CHANGELOG.md", "README.md", "LICENSE", "Makefile", "mkdocs.yml", "setup.py"}
    for folder, pattern in [
        ("tests", "*.py"),
        ("docs", "*"),
        ("examples", "*"),
        ("scripts", "*"),
        ("benchmarks", "*"),
    ]:
        found |= {
            str(p.relative_to(ROOT))
            for p in (ROOT / folder).rglob(pattern)
            if p.is_file() and "__pycache__" not in p.parts
        }
    return found


def test_sdist_carries_the_tests_helpers_docs_and_examples(tmp_path):
    sdist = sdist_check.build_sdist(tmp_path)
    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz") + "/"
        carried = {name.removeprefix(top) for name in archive.getnames()}
    for helper in ["conftest.py", "gloo.py", "faults.py", "references.py", "window_invariant.py"]:
        assert f"tests/{helper}" in carried
    missing = sorted(_checkout_files() - carried)
    assert not missing, missing


def test_installed_sdist_passes_its_tests(tmp_path):
    # One quick file of the suite (it also reads docs/errors.md from the sdist); the whole
    # suite: `make sdist`.
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sdist_check.py"), "--keep", str(tmp_path)]
        + ["--", "tests/test_errors.py"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "venv/lib" in result.stdout and "passed" in result.stdout

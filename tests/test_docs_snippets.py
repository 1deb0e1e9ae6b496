"""Every Python block in README.md and docs/*.md runs as written, on its own.

Each block is run in a fresh interpreter (a user copying it into one), with warnings shown,
from a scratch working directory; a block that is not meant to run is fenced as ``text``.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# A block using a feature that needs a newer torch than the oldest supported one skips there
# (docs/compatibility.md: compile of `update` from 2.12, FSDP2 on CPU from 2.7).
NEEDS = {"torch.compile": (2, 12), "fully_shard": (2, 7)}


def _marks(code: str) -> list:
    marks = []
    for feature, version in NEEDS.items():
        if feature in code and torch.__version__ < version:
            reason = f"{feature} needs torch {'.'.join(map(str, version))}+"
            marks.append(pytest.mark.skip(reason=reason))
    return marks


def _blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text.count("\n", 0, match.start()) + 1
            code = match.group(1)
            found.append(pytest.param(code, id=f"{page.name}:{line}", marks=_marks(code)))
    return found


BLOCKS = _blocks()


def test_there_are_blocks_to_run():
    assert len(BLOCKS) >= 8


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_on_its_own(code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]

"""Every Python block in README.md and docs/*.md runs as written, on its own.

Each block is run in a fresh interpreter (a user copying it into one), with warnings shown,
from a scratch working directory; a block that is not meant to run is fenced as ``text``.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
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


# A block's expected output: the paragraph right after it starts with "Expected output" and
# ends with a ```text block, what the block prints. Checked on the torch release the pages
# were written with (other releases may differ in the last digits): words exactly, integers
# exactly, other numbers to 5% (float32 results vary in their last bits between machines), or
# to what the paragraph says ("to within 25%": a long recurrence carries the CPU's rounding).
EXPECTED = re.compile(r"\s*\nExpected output([^\n]*(?:\n[^\n]+)*?):\n\n```text\n(.*?)```", re.S)
WITHIN = re.compile(r"to within\s+(\d+)%")
WRITTEN_WITH = "2.13.0"
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _blocks() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text.count("\n", 0, match.start()) + 1
            code = match.group(1)
            expected = EXPECTED.match(text, match.end())
            output = expected.group(2) if expected else None
            within = WITHIN.search(expected.group(1)) if expected else None
            tolerance = int(within.group(1)) / 100 if within else 0.05
            found.append(
                pytest.param(code, output, tolerance, id=f"{page.name}:{line}", marks=_marks(code))
            )
    return found


def same_output(actual: str, expected: str, tolerance: float = 0.05) -> bool:
    """``actual`` prints what ``expected`` shows (see EXPECTED), non-integers to
    ``tolerance`` (relative)."""
    words = [NUMBER.sub("#", t).split() for t in (actual, expected)]
    if words[0] != words[1]:
        return False
    pairs = zip(NUMBER.findall(actual), NUMBER.findall(expected))
    for got, want in pairs:
        if re.fullmatch(r"[-+]?\d+", want):
            if got != want:
                return False
        elif abs(float(got) - float(want)) > tolerance * abs(float(want)):
            return False
    return True


def test_same_output_compares_words_integers_and_numbers():
    assert same_output("loss 1.38e-05, 70 mixed\n", "loss 1.40e-05, 70 mixed")
    assert not same_output("loss 1.38e-05, 71 mixed", "loss 1.38e-05, 70 mixed")
    assert not same_output("loss 2.00e-05, 70 mixed", "loss 1.38e-05, 70 mixed")
    assert not same_output("cost 1.38e-05, 70 mixed", "loss 1.38e-05, 70 mixed")
    assert same_output("loss 1.6e-05", "loss 1.38e-05", 0.25)
    assert not same_output("loss 1.8e-05", "loss 1.38e-05", 0.25)
    assert same_output("tensor([1.0004, 1.0004])", "tensor([1.0004, 1.0004])")


BLOCKS = _blocks()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_there_are_blocks_to_run():
    assert len(BLOCKS) >= 8


def test_most_blocks_show_their_output():
    shown = sum(1 for block in BLOCKS if block.values[1] is not None)
    assert shown == len(BLOCKS), f"{shown} of {len(BLOCKS)} blocks show their output"


@pytest.mark.parametrize("code,expected,tolerance", BLOCKS)
def test_block_runs_on_its_own(code, expected, tolerance, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        # The distributed blocks take a reader's fixed MASTER_PORT only where none is set:
        # a free one here, so that another run on the machine cannot hold it.
        env={**os.environ, "MASTER_PORT": str(_free_port())},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if expected is not None and torch.__version__.split("+")[0] == WRITTEN_WITH:
        assert same_output(result.stdout, expected, tolerance), (result.stdout, expected)

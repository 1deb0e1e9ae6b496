"""docs/distributed.md's DDP snippet runs as it would be run: under ``torchrun`` with 2 ranks
(gloo, CPU), taking its rank and world size from the environment, and the ranks end equal.

Run alone (one rank) it is also a block of tests/test_docs_snippets.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_docs_snippets import WRITTEN_WITH, same_output

PAGE = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"


def _snippet_and_expected() -> tuple[str, list[str]]:
    text = PAGE.read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "Distributed" in b)
    expected = re.search(r"```text\n(rank 0 of 2.*?)```", text, re.S).group(1).splitlines()
    return code, expected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_snippet_under_torchrun_with_two_ranks(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    code, expected = _snippet_and_expected()
    script = tmp_path / "ddp.py"
    script.write_text(code)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    launcher += ["--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    launcher += ["--master_port", str(_free_port())]
    # Each rank's stdout to its own file: on one shared pipe the two ranks' lines interleave.
    launcher += ["--log-dir", str(tmp_path / "logs"), "--redirects", "3", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    result = subprocess.run(
        launcher, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    outputs = [log.read_text() for log in sorted((tmp_path / "logs").rglob("stdout.log"))]
    assert result.returncode == 0, "\n".join(outputs)[-3000:] + result.stderr[-3000:]
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0 of 2", "rank 1 of 2"], lines
    # The ranks stay identical: the same steps and the same params, to every printed digit.
    assert lines[0].split(":")[1] == lines[1].split(":")[1], lines
    # The page shows what the ranks print, as every page's expected output is checked (words
    # and integers exactly, other numbers to 5%: the float32 sum's last digits differ between
    # CPUs, e.g. -2.174578744452 on an AMD EPYC and -2.174579043873 on an AVX-512 Xeon).
    if torch.__version__.split("+")[0] == WRITTEN_WITH:
        assert same_output("\n".join(lines), "\n".join(expected)), (lines, expected)

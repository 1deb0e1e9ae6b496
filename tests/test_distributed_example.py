"""``examples/distributed.py`` (FSDP2, the loss safeguard) gives the same run on 1 and 2 ranks.

Each rank holds half of every parameter and of the window; the run must not depend on it.
A kept mix replaces the newest window entry after its Gram rows were reduced over the ranks:
float32 windows got those rows wrong on 2+ ranks, and the runs parted 7% in the loss at the
second kept mix. The example is launched with torchrun (gloo, CPU) and its printed losses and
decisions are compared epoch by epoch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo import FSDP2_ON_CPU, TEARDOWN_ABORT

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "distributed.py"
EPOCHS = 20
TIMEOUT_S = 300

pytest.importorskip("sklearn")


def run(world: int) -> tuple[list[float], str]:
    """The per-epoch train losses and the summary line of a ``world``-rank run."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={world}", str(EXAMPLE), "--epochs", str(EPOCHS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr:
        # A rank aborted in gloo's teardown after the run, its output complete (seen twice in
        # the project's full-suite runs, never in isolation, despite the example's barrier
        # before destroy_process_group): launched once more, which must exit cleanly.
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"train loss ([0-9.]+)", done.stdout)]
    summary = re.search(r"test accuracy .*", done.stdout)
    assert len(losses) == EPOCHS and summary is not None, done.stdout[-3000:]
    return losses, summary.group(0)


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="torch's FSDP2 runs on CPU/gloo from torch 2.7")
def test_one_and_two_ranks_train_alike():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    one, summary_one = run(1)
    two, summary_two = run(2)
    # The printed losses (4 decimals) agree to their last digit or so: FSDP2 sums the
    # gradients in another order on 2 ranks, nothing else differs.
    for epoch, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) <= 3e-4 + 1e-3 * abs(a), (epoch, one, two)
    # The same mixes kept and rejected, the same accuracy; the safeguard kept several.
    assert summary_one == summary_two
    kept = int(re.search(r"mixes kept (\d+)", summary_one).group(1))
    assert kept >= 3

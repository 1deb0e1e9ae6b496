"""Multi-process tests on the CPU: launch a test file's workers over gloo, and what they share.

A distributed test file runs itself as a script in ``world`` processes (``python FILE
--worker RANK WORLD WORKDIR``); each worker calls :func:`init_worker`, runs its scenarios and
saves its results as ``WORKDIR/rank{RANK}.pt``, which :func:`launch` loads. The launch has a
hard timeout (the processes are killed) and gloo collectives time out, so a deadlock fails
the test instead of hanging it.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

# FSDP2 (``fully_shard``) runs on CPU tensors over gloo from torch 2.7: 2.6's all-gather records
# an event on a CPU stream (AttributeError: 'Stream' object has no attribute 'record_event'),
# and 2.5 has no ``torch.distributed.fsdp.fully_shard``.
FSDP2_ON_CPU = torch.__version__ >= (2, 7)


# What a rank prints when it aborts in std::terminate while the process group's threads are
# torn down, after its results were saved (not an exception of the test).
TEARDOWN_ABORT = "terminate called without an active exception"


def launch(script: str, world: int, work: Path, timeout_s: float) -> list[dict]:
    """Runs ``script``'s workers in ``world`` gloo processes; each rank's saved results.

    A launch in which a rank aborted in gloo's teardown (seen in full-suite runs under load,
    never alone; also ``tests/test_distributed_example.py``) is run once more, in a fresh
    directory, and that one must succeed."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    results = _launch_once(script, world, work, timeout_s)
    if isinstance(results, list):
        return results
    again = work / "again"
    again.mkdir()
    results = _launch_once(script, world, again, timeout_s)
    if not isinstance(results, list):
        pytest.fail(results)
    return results


def _launch_once(script: str, world: int, work: Path, timeout_s: float) -> list[dict] | str:
    """One launch: each rank's saved results, or, when a rank only aborted in the teardown,
    what it printed (a failure of any other kind fails the test here)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    # Each worker writes to a file, not a pipe: a pipe read one worker after the other can
    # fill up and block the worker not read yet, halfway through a step its peer waits on.
    logs = [open(work / f"rank{rank}.log", "wb") for rank in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--worker", str(rank), str(world), str(work)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        pytest.fail(f"the {world} distributed workers did not finish within {timeout_s} s")
    finally:
        for log in logs:
            log.close()
    outputs = [(work / f"rank{rank}.log").read_text(errors="replace") for rank in range(world)]
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        path = work / f"rank{rank}.pt"
        failure = f"worker {rank} failed (exit {proc.returncode}):\n{out[-4000:]}"
        if proc.returncode != 0 and path.exists() and out.strip().endswith(TEARDOWN_ABORT):
            return failure
        if proc.returncode != 0 or not path.exists():
            pytest.fail(failure)
        with torch.serialization.safe_globals(_numpy_globals()):
            results.append(torch.load(path, weights_only=True))
    return results


def _numpy_globals() -> list:
    """What the workers' NumPy results unpickle through: weights-only loading, with NumPy's
    array and scalar rebuilders and dtypes allowed (no arbitrary code)."""
    import numpy as np

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    dtypes = [getattr(np.dtypes, name) for name in np.dtypes.__all__]
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *dtypes]


def init_worker(rank: int, world: int, work: Path, timeout_s: float):
    """Joins the gloo process group of :func:`launch`; the 1-d CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work / 'rendezvous'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return init_device_mesh("cpu", (world,))


def run_scenarios(run, names, rank: int, world: int, work: Path, timeout_s: float) -> None:
    """A worker's body: joins the group, runs ``run(name, mesh)`` for each of ``names`` and
    saves the results (a scenario that raised: its traceback) for :func:`launch`."""
    mesh = init_worker(rank, world, work, timeout_s)
    results = {}
    for name in names:
        try:
            results[name] = run(name, mesh)
        except Exception:
            results[name] = traceback.format_exc()
    torch.save(results, work / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """Ends the worker without the interpreter's finalization, where gloo's threads can still
    abort the process after its work is done ("terminate called without an active
    exception": they hold tensors whose release needs the interpreter being torn down; a
    known torch issue). Output is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def distribute(tensor: torch.Tensor, mesh, placements):
    """``distribute_tensor`` of a tensor every rank holds in full: each rank keeps its chunk
    without communication (``src_data_rank=None``, torch 2.7+); before 2.7 rank 0's copy is
    scattered, the same values."""
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    return distribute_tensor(tensor, mesh, placements)

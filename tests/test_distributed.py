"""torch.distributed: DDP ranks stay bit-identical; sharded params match an unsharded run.

Every test reads the results of ONE launch of two gloo processes on the CPU: this file, run as a
script by the module fixture ``runs`` (``python tests/test_distributed.py --worker RANK ...``),
executes every scenario below in both ranks and saves what it measured; the tests compare.
The launch has a hard timeout (the processes are killed) and gloo collectives time out, so a
deadlock fails the tests instead of hanging them.

References are independent of the code under test: the float64 NumPy ``Recurrence``
(both modes) of ``references.py`` (written from the spec), the spec's own statement
that a sharded run equals the unsharded one, and ``CommDebugMode``, torch's counter of c10d
and functional collectives, for the communication.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo import FSDP2_ON_CPU, distribute, init_worker, launch

WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 30
# -- the launch ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Runs every scenario in two gloo processes; returns each rank's results."""
    work = tmp_path_factory.mktemp("distributed")
    return launch(__file__, WORLD_SIZE, work, LAUNCH_TIMEOUT_S)


def scenario(runs: list[dict], name: str) -> list[dict]:
    """One scenario's results on every rank, failing the test with the worker's traceback."""
    per_rank = [r[name] for r in runs]
    # Every rank's traceback: the first rank's is often only "connection closed by peer".
    errors = [f"rank {rank}:\n{r['error']}" for rank, r in enumerate(per_rank) if "error" in r]
    if errors:
        pytest.fail(f"scenario {name!r} raised on " + "\n".join(errors))
    return per_rank


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# spec.md: a sharded run equals an unsharded one to 1e-10 relative in float64, and a float64
# window agrees with a float64 reference to 1e-8.
SPEC_UNSHARDED, SPEC_REFERENCE = 1e-10, 1e-8


def assert_within_bounds(r: dict, spec: bool = True) -> None:
    """The sharded and the unsharded runs each against the NumPy reference replayed on its
    own inputs, and the sharded run against the unsharded library replayed on its inputs
    (where the windows stay comparable), call by call within the derived bound
    (``_call_bounds``: the contract's, with the reduction over ranks); and within the spec's
    figures (``spec``: float64)."""
    pairs = [("sharded", "sharded_reference", "sharded_bounds")]
    pairs.append(("unsharded", "unsharded_reference", "unsharded_bounds"))
    if r["replay_comparable"]:
        pairs.append(("sharded", "unsharded_replayed", "sharded_bounds"))
    for run, other, bounds in pairs:
        assert len(r[run]) == len(r[other]) == len(r[bounds]) > 0
        for k, (a, b, bound) in enumerate(zip(r[run], r[other], r[bounds]), start=1):
            error = relative(a, b)
            assert error <= bound, (run, other, k, error, bound)
            if spec:
                assert error <= (
                    SPEC_UNSHARDED if other == "unsharded_replayed" else SPEC_REFERENCE
                )


# -- DDP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ddp_functional", "ddp_wrapper"])
def test_ddp_ranks_stay_bit_identical(runs, name):
    ranks = scenario(runs, name)
    # Different data per rank (else the claim is vacuous) ...
    assert ranks[0]["local_losses"] != ranks[1]["local_losses"]
    # ... the acceleration was active ...
    assert ranks[0]["num_mixed"] > 0 and ranks[0]["num_mixed"] == ranks[1]["num_mixed"]
    # ... and every parameter is bitwise equal on both ranks after all steps.
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_ddp_update_communicates_nothing(runs):
    ranks = scenario(runs, "ddp_functional")
    assert all(count == 0 for r in ranks for count in r["collectives_per_update"])


# -- sharded params: equality with unsharded runs and with the float64 references ------------

SHARDED = [
    "aadl_f64",
    "aadl_f64_store2",
    "aadl_f64_loss_plain",
    "aadl_f64_loss_dtensor",
    "classic_f64",
    "classic_f64_loss_plain",
]


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_float64_matches_reference_and_unsharded(runs, name):
    for r in scenario(runs, name):
        assert len(r["sharded"]) > 0
        # Replayed on the sharded run's inputs (free-running runs part chaotically once the
        # window nears rank deficiency: each mix amplifies a rounding difference ~100x).
        assert_within_bounds(r)
        # The same steps mixed as in the reference (the decisions agree, not only the values).
        assert r["mixed_steps"] == r["reference_mixed_steps"]
        assert r["unsharded_mixed_steps"] == r["reference_mixed_steps"]
        assert len(r["mixed_steps"]) >= 3


LONG = ["aadl_f64_20", "classic_f64_20", "aadl_f64_20_loss"]


@pytest.mark.parametrize("name", LONG)
def test_sharded_float64_equals_one_process_after_20_steps(runs, name):
    """A float64 window is mixed through a QR factor (every rank's local factor stacked and
    reduced again), never through normal equations: over 20 steps each sharded call stays
    within its derived bound of the one-process call on the same inputs (normal equations
    amplified the reduction order's rounding by cond(DF)^2; the bound, from the reference's
    own sensitivity, is that of a backward-stable solve)."""
    for r in scenario(runs, name):
        assert len(r["sharded"]) == 20
        assert_within_bounds(r)
        assert r["mixed_steps"] == r["unsharded_mixed_steps"] == r["reference_mixed_steps"]
        assert len(r["mixed_steps"]) >= 5


@pytest.mark.parametrize("name", ["aadl_deferred", "classic_deferred"])
def test_sharded_deferred_safeguard_matches_unsharded_and_reference(runs, name):
    """Each rank passes its own half of the loss: the ranks decide alike (the mean), as the
    unsharded run with the whole loss and the NumPy recurrence do."""
    for r in scenario(runs, name):
        assert_within_bounds(r)
        assert r["rejected_steps"] == r["reference_rejected_steps"]
        assert len(r["rejected_steps"]) >= 2


@pytest.mark.parametrize("name", ["aadl_f64_loss_plain", "aadl_f64_loss_dtensor"])
def test_sharded_safeguard_both_accepts_and_rejects(runs, name):
    r = scenario(runs, name)[0]
    assert r["num_mixed"] > 0 and r["num_rejected"] > 0


def test_sharded_float32_matches_unsharded(runs):
    for r in scenario(runs, "aadl_f32"):
        assert_within_bounds(r, spec=False)  # float32 params: u = 2^-24 in the bound
        assert r["mixed_steps"] == r["unsharded_mixed_steps"]
        assert len(r["mixed_steps"]) >= 3


@pytest.mark.parametrize("name", SHARDED + LONG + ["aadl_f32"])
def test_sharded_one_all_reduce_per_step(runs, name):
    """Per update: one all_reduce of the Gram rows when the window grows or a mix is computed,
    none otherwise, plus one for the safeguard's pair of losses when loss_fn returns a plain
    (per-rank) tensor. Nothing else: no all_gather, no broadcast."""
    for r in scenario(runs, name):
        expected = r["expected_all_reduces"]
        assert r["all_reduces"] == expected
        assert r["other_collectives"] == [0] * len(expected)
        # Sizes as documented: 5 Q + 1 (rows appended), 3 Q + 1 (a mix only), 2 (loss pair);
        # on calls that may mix, a float64 window adds every rank's Q x Q QR factor (one
        # slot per rank), float32 windows nothing.
        q = r["num_slots"]
        factors = WORLD_SIZE * q * q if "f64" in name else 0
        allowed = {5 * q + 1 + factors, 3 * q + 1 + factors, 2}
        if factors:
            allowed |= {5 * q + 1}  # appended on a call that cannot mix
        assert r["reduced_sizes"] and set(r["reduced_sizes"]) <= allowed
        assert sum(expected) > 0
        if name.startswith("aadl"):
            assert expected[0] == 0  # the first call only stores the anchor: no reduction


def test_sharded_nonfinite_data_on_one_rank_restarts_every_rank(runs):
    """A NaN in rank 1's shard only: the summed Gram row is NaN on both ranks, so both
    discard the window together, exactly when the unsharded run does."""
    ranks = scenario(runs, "aadl_f64_nan")
    for r in ranks:
        assert r["nonfinite"] == r["unsharded_nonfinite"]
        assert r["nonfinite"][4] == 0 and r["nonfinite"][5] > 0  # the NaN enters at step 6
        assert r["mixed_steps"] == r["unsharded_mixed_steps"]
    assert ranks[0]["nonfinite"] == ranks[1]["nonfinite"]


def test_sharded_skip_nonfinite_decides_on_every_rank_together(runs):
    """skip_nonfinite with a NaN gradient in rank 1's shard only: both ranks skip that call
    (rank 0's grads are finite), and the run equals the unsharded one that skipped it."""
    ranks = scenario(runs, "aadl_f64_skip")
    for r in ranks:
        assert r["skipped"] == r["unsharded_skipped"] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
        assert_within_bounds(r)
        assert r["mixed"] > 0
    assert ranks[0]["skipped"] == ranks[1]["skipped"]


def test_sharded_state_holds_local_shards(runs):
    for r in scenario(runs, "aadl_f64"):
        assert r["state_has_dtensor"] is False
        assert r["state_local_shapes"] == r["param_local_shapes"]
        assert r["output_placements_ok"] is True
    # The shards really are partial: the 1-element leaf lives on rank 0 only.
    shapes = [r["param_local_shapes"] for r in scenario(runs, "aadl_f64")]
    assert shapes[0] != shapes[1]


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="torch's FSDP2 runs on CPU/gloo from torch 2.7")
@pytest.mark.parametrize("name", ["fsdp2_functional", "fsdp2_wrapper", "fsdp2_safeguard"])
def test_fsdp2_model_matches_unsharded(runs, name):
    for r in scenario(runs, name):
        assert r["sharded_params_are_dtensors"] is True
        for k, (s, u) in enumerate(zip(r["sharded"], r["unsharded"]), start=1):
            error = relative(np.concatenate(s), np.concatenate(u))
            assert error <= SPEC_UNSHARDED, (k, error)
        assert r["num_mixed"] == r["unsharded_num_mixed"] > 0
        assert r["num_rejected"] == r["unsharded_num_rejected"]
        if name == "fsdp2_safeguard":
            assert r["num_rejected"] > 0
        # (all_reduces, other collectives) of aadl_func per step: one all_reduce where the
        # window grows or mixes, one more for the loss pair where the safeguard ran.
        assert r["aadl_collectives"] == r["expected_collectives"]


def test_sharded_input_errors(runs):
    for r in scenario(runs, "errors"):
        assert r == {
            "mixed": "TypeError",
            "plain_grads": "TypeError",
            "replicated": "NotImplementedError",
            # update runs without grad, so it writes into leaves that require grad, in place
            # like torch.optim (README, Autograd); earlier versions refused with ValueError.
            "inplace_requires_grad": "no error",
            "average": "NotImplementedError",
        }


# -- the worker ------------------------------------------------------------------------------
# Everything below runs in the spawned processes only.


def _collectives(mode) -> tuple[int, int]:
    """(all_reduce count, count of every other collective) seen by a CommDebugMode."""
    counts = mode.get_comm_counts()
    all_reduce = sum(n for op, n in counts.items() if "allreduce" in str(op).replace("_", ""))
    return all_reduce, sum(counts.values()) - all_reduce


class _Counting:
    """Wraps a loss_fn so that the collectives it makes itself can be told apart."""

    def __init__(self, loss_fn, nested: bool = True):
        self.loss_fn, self.nested, self.active = loss_fn, nested, False
        self.calls, self.all_reduce, self.other = 0, 0, 0

    def __call__(self, params):
        from torch.distributed.tensor.debug import CommDebugMode

        self.calls += 1
        self.active = True
        try:
            if not self.nested:
                return self.loss_fn(params)
            with CommDebugMode() as inner:
                loss = self.loss_fn(params)
        finally:
            self.active = False
        a, o = _collectives(inner)
        self.all_reduce += a
        self.other += o
        return loss


def _recording(all_reduce, sizes: list[int], skip=None):
    """``all_reduce`` that also records the number of values it reduces (unless called while
    ``skip.active``, i.e. from inside a user's loss_fn)."""

    def recording(tensor, *args, **kwargs):
        if skip is None or not skip.active:
            sizes.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    return recording


def _logistic(dim: int, seed: int = 0, samples: int = 80):
    """L2-regularised logistic regression (NumPy float64): features scaled over a decade."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((samples, dim)) * np.logspace(0, -1, dim)
    labels = (rng.random(samples) < 0.5).astype(np.float64)
    l2 = 1e-3

    def loss(x, rows=slice(None)):
        z = A[rows] @ x
        return float(np.mean(np.logaddexp(0.0, z) - labels[rows] * z) + 0.5 * l2 * x @ x)

    def grad(x):
        z = A @ x
        return A.T @ (0.5 * (1.0 + np.tanh(0.5 * z)) - labels) / samples + l2 * x

    smooth = np.linalg.norm(A, 2) ** 2 / (4 * samples) + l2
    return loss, grad, smooth


# Leaves of unequal sizes: Shard(0) splits them 1/0, 3/2 and 4/3 rows over two ranks.
_SHAPES = {"b": (1,), "v": (5,), "w": (7, 3)}


def _to_tree(x: np.ndarray, dtype):
    out, start = {}, 0
    for key in sorted(_SHAPES):
        size = int(np.prod(_SHAPES[key]))
        out[key] = torch.tensor(x[start : start + size]).reshape(_SHAPES[key]).to(dtype)
        start += size
    return out


def _gather(tree, rank: int, world: int) -> np.ndarray:
    """The full vector (``_to_vector`` order) of a tree of Shard(0) DTensors: ONE all_gather
    (``full_tensor`` per leaf would take one each; these tests mostly wait on collectives)."""
    keys = sorted(tree)
    # Shard(0) splits dim 0 like torch.chunk; ranks past the last chunk hold nothing.
    counts = {}
    for k in keys:
        shape = _SHAPES[k]
        rows = [len(c) for c in torch.arange(shape[0]).chunk(world)]
        rows += [0] * (world - len(rows))
        counts[k] = [r * int(np.prod(shape[1:])) for r in rows]
    sizes = [sum(counts[k][r] for k in keys) for r in range(world)]
    local = torch.cat([tree[k].to_local().reshape(-1).to(torch.float64) for k in keys])
    padded = torch.zeros(max(sizes), dtype=torch.float64)
    padded[: local.numel()] = local
    gathered = torch.empty(world * max(sizes), dtype=torch.float64)
    # all_gather_into_tensor: every supported torch has it (all_gather_single is 2.13's name).
    torch.distributed.all_gather_into_tensor(gathered, padded)
    pieces = gathered.reshape(world, max(sizes))
    offsets = [0] * world
    out = []
    for k in keys:
        for r in range(world):
            out.append(pieces[r, offsets[r] : offsets[r] + counts[k][r]])
            offsets[r] += counts[k][r]
    return torch.cat(out).numpy()


def _to_vector(tree) -> np.ndarray:
    return np.concatenate(
        [tree[k].detach().to(torch.float64).reshape(-1).numpy() for k in sorted(tree)]
    )


def _expected_row_reductions(steps, mode, depth, store, wait, frequency) -> list[int]:
    """When the window's Gram row must be summed: a residual is appended (mode "aadl": a
    store once the window holds an entry; "classic": every store) or a mix is computed
    (the gates of spec.md, at least 3 entries / 2 pairs)."""
    out, entries = [], 0
    for k in range(1, steps + 1):
        stored = k % store == 0
        appended = stored and (entries >= 1 if mode == "aadl" else True)
        entries = min(entries + stored, depth)
        gate = k > wait and k % frequency == 0 and entries >= (3 if mode == "aadl" else 2)
        out.append(int(appended or gate))
    return out


def _sharded_scenario(
    rank,
    mesh,
    *,
    dtype=torch.float64,
    mode="aadl",
    loss="none",
    depth=5,
    relaxation=0.7,
    store=1,
    wait=1,
    frequency=2,
    steps=16,
    nan_step=None,
):
    from conftest import GradientDescent
    from references import Recurrence
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    import aadl_func as aa

    dim = sum(int(np.prod(s)) for s in _SHAPES.values())
    np_loss, np_grad, smooth = _logistic(dim)
    lr = 1.0 / smooth
    x0 = np.random.default_rng(7).standard_normal(dim)
    options = dict(history_depth=depth, relaxation=relaxation, wait_iterations=wait)
    options.update(frequency=frequency, mode=mode)
    if mode == "aadl":
        options["store_each_nth"] = store
    opt = aa.anderson(GradientDescent(lr), **options)

    def shard(tree):
        return {k: distribute(v, mesh, [Shard(0)]) for k, v in tree.items()}

    def full(tree) -> np.ndarray:
        return _gather(tree, rank, WORLD_SIZE)

    half = slice(0, 40) if rank == 0 else slice(40, 80)

    def gradient(x, k):
        g = np_grad(x)
        if k == nan_step:
            g[-1] = np.nan  # the last entry of "w": on rank 1's shard only
        return g

    def torch_loss(params, per_rank):
        x = full(params) if isinstance(params["b"], DTensor) else _to_vector(params)
        # "plain": each rank's loss on its half of the data (the mean of both is the loss).
        value = np_loss(x, half) if per_rank else np_loss(x)
        return torch.tensor(value, dtype=torch.float64)

    loss_fn = None
    if loss == "plain":
        loss_fn = _Counting(lambda p: torch_loss(p, per_rank=True))
    elif loss == "dtensor":
        loss_fn = _Counting(
            lambda p: DTensor.from_local(torch_loss(p, per_rank=False), mesh, [Replicate()])
        )

    # Sharded run.
    params = shard(_to_tree(x0, dtype))
    state = opt.init(params)
    result = {"sharded": [], "all_reduces": [], "other_collectives": [], "mixed_steps": []}
    result["nonfinite"] = []
    result["param_local_shapes"] = [tuple(v.to_local().shape) for _, v in sorted(params.items())]
    result["state_local_shapes"] = [tuple(v.shape) for _, v in sorted(state.residuals[0].items())]
    result["state_has_dtensor"] = any(
        isinstance(t, DTensor) for t in torch.utils._pytree.tree_leaves(state)
    )
    sizes, loss_pairs = [], []
    x = x0.copy()
    for k in range(1, steps + 1):
        grads = shard(_to_tree(gradient(x, k), dtype))
        calls_before = (loss_fn.all_reduce, loss_fn.other, loss_fn.calls) if loss_fn else (0,) * 3
        mixed_before = int(state.num_mixed)
        real_all_reduce = torch.distributed.all_reduce
        torch.distributed.all_reduce = _recording(real_all_reduce, sizes)
        try:
            with CommDebugMode() as comm:
                params, state = opt.update(state, params, grads, loss_fn=loss_fn)
        finally:
            torch.distributed.all_reduce = real_all_reduce
        a, o = _collectives(comm)
        if loss_fn is not None:
            a -= loss_fn.all_reduce - calls_before[0]
            o -= loss_fn.other - calls_before[1]
        result["all_reduces"].append(a)
        loss_pairs.append(int(loss_fn is not None and loss_fn.calls > calls_before[2]))
        result["other_collectives"].append(o)
        if int(state.num_mixed) > mixed_before:
            result["mixed_steps"].append(k)
        x = full(params)
        result["sharded"].append(x)
        result["nonfinite"].append(int(state.num_nonfinite))
    result["output_placements_ok"] = all(
        isinstance(v, DTensor) and tuple(v.placements) == (Shard(0),) for v in params.values()
    )
    result["reduced_sizes"] = sizes
    result["num_slots"] = len(state.residuals)
    result["num_mixed"], result["num_rejected"] = int(state.num_mixed), int(state.num_rejected)

    # Expected communication, derived from the gates alone (plus one per loss pair).
    expected = _expected_row_reductions(steps, mode, depth, store, wait, frequency)
    if loss == "plain":
        # Per-rank losses: one more all_reduce (of the pair) where the safeguard ran.
        expected = [e + c for e, c in zip(expected, loss_pairs)]
    result["expected_all_reduces"] = expected

    # Unsharded runs of the same library (plain tensors, no communication): free-running,
    # and replayed on the sharded run's inputs (call k starts from the sharded params of call
    # k - 1), so that the two differ by each call's rounding (the reduction order over
    # ranks), not by the chaotic recurrence's amplification of it from call to call.
    plain_loss = None if loss == "none" else (lambda p: torch_loss(p, per_rank=False))

    def unsharded(inputs=None) -> tuple[list, list, list]:
        state, x = opt.init(_to_tree(x0, dtype)), x0
        outputs, mixed, nonfinite = [], [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = inputs[k - 2]
            mixed_before = int(state.num_mixed)
            grads = _to_tree(gradient(x, k), dtype)
            tree, state = opt.update(state, _to_tree(x, dtype), grads, loss_fn=plain_loss)
            if int(state.num_mixed) > mixed_before:
                mixed.append(k)
            x = _to_vector(tree)
            outputs.append(x)
            nonfinite.append(int(state.num_nonfinite))
        return outputs, mixed, nonfinite

    result["unsharded"], result["unsharded_mixed_steps"], result["unsharded_nonfinite"] = (
        unsharded()
    )
    result["unsharded_replayed"] = unsharded(result["sharded"])[0]

    # Independent float64 NumPy reference, replayed on the sharded run's inputs, and each
    # call's bound (see _call_bounds).
    if nan_step is None:
        ref_loss = None if loss == "none" else np_loss
        if mode == "aadl":
            ref_options = dict(store_each_nth=store, **_ref(options))
        else:
            ref_options = dict(mode="classic", **_ref(options))
        reference = lambda: Recurrence(np_grad, lr, **ref_options)  # noqa: E731
        for run in ("sharded", "unsharded"):
            outputs = result[run]
            trajectory, kinds = reference().run(x0, steps, loss=ref_loss, inputs=outputs)
            result[f"{run}_reference"] = trajectory
            result[f"{run}_reference_kinds"] = kinds
            result[f"{run}_bounds"] = _call_bounds(reference, x0, outputs, dtype, ref_loss)
        kinds = result["sharded_reference_kinds"]
        result["reference_mixed_steps"] = [k + 1 for k, m in enumerate(kinds) if m == "mix"]
        # Mode "aadl" with loss_fn stores each kept mix in the window: the replayed unsharded
        # run stores its own, so its window parts from the sharded one's by more than a call.
        result["replay_comparable"] = not (mode == "aadl" and loss != "none")
    return result


def _call_bounds(reference, x0, outputs, dtype, loss=None) -> list[float]:
    """Each call's bound on the relative distance of a sharded call to the unsharded one and
    to the reference, both replayed on its inputs: the contract's
    (``references.rounding_bounds``), the stored differences perturbed by the float64 solve's
    backward error plus what the sum over ranks adds, ``(WORLD_SIZE - 1) u`` (each rank's
    partial Gram sums rounded once more when reduced)."""
    from references import rounding_bounds, solve_roundoff

    u_params = torch.finfo(dtype).eps / 2
    depth = reference().history_depth
    u_diff = solve_roundoff(len(x0), depth) + (WORLD_SIZE - 1) * 2.0**-53
    return list(rounding_bounds(reference, x0, outputs, u_params, u_diff, loss))


def _skip_scenario(rank, mesh, steps=12, nan_step=6):
    from conftest import GradientDescent
    from references import Recurrence
    from torch.distributed.tensor import Shard

    import aadl_func as aa

    dim = sum(int(np.prod(s)) for s in _SHAPES.values())
    _, np_grad, smooth = _logistic(dim)
    opt = aa.anderson(GradientDescent(1.0 / smooth), history_depth=4, skip_nonfinite=True)
    x0 = np.random.default_rng(3).standard_normal(dim)

    def gradient(x, k):
        g = np_grad(x)
        if k == nan_step:
            g[-1] = np.nan  # the last entry of "w": on rank 1's shard only
        return g

    def shard(tree):
        return {k: distribute(v, mesh, [Shard(0)]) for k, v in tree.items()}

    result = {"sharded": [], "skipped": [], "unsharded": [], "unsharded_skipped": []}
    params = shard(_to_tree(x0, torch.float64))
    state = opt.init(params)
    for k in range(1, steps + 1):
        x = _gather(params, rank, WORLD_SIZE)
        params, state = opt.update(state, params, shard(_to_tree(gradient(x, k), torch.float64)))
        result["sharded"].append(_gather(params, rank, WORLD_SIZE))
        result["skipped"].append(int(state.num_skipped))
    result["mixed"] = int(state.num_mixed)

    def unsharded(inputs=None) -> tuple[list, list]:
        """The unsharded run, free-running or replayed on ``inputs`` (see _sharded_scenario)."""
        state, x, outputs, skipped = opt.init(_to_tree(x0, torch.float64)), x0, [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = inputs[k - 2]
            grads = _to_tree(gradient(x, k), torch.float64)
            tree, state = opt.update(state, _to_tree(x, torch.float64), grads)
            x = _to_vector(tree)
            outputs.append(x)
            skipped.append(int(state.num_skipped))
        return outputs, skipped

    result["unsharded"], result["unsharded_skipped"] = unsharded()
    result["unsharded_replayed"] = unsharded(result["sharded"])[0]

    def reference() -> Recurrence:
        calls = iter(range(1, steps + 1))  # one gradient per call, the NaN at call nan_step
        grad = lambda x: gradient(x, next(calls))  # noqa: E731
        return Recurrence(grad, 1.0 / smooth, history_depth=4, skip_nonfinite=True)

    for run in ("sharded", "unsharded"):
        outputs = result[run]
        result[f"{run}_reference"] = reference().run(x0, steps, inputs=outputs)[0]
        result[f"{run}_bounds"] = _call_bounds(reference, x0, outputs, torch.float64)
    result["replay_comparable"] = True  # no loss_fn: the window stores no mix
    return result


def _ref(options: dict) -> dict:
    keys = ("history_depth", "relaxation", "wait_iterations", "frequency")
    return {k: options[k] for k in keys}


def _ddp_scenario(rank, *, wrapper: bool):
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.parallel import DistributedDataParallel

    import aadl_func as aa

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    X = torch.randn(64, 6, generator=gen)
    Y = torch.randn(64, 3, generator=gen)
    criterion = torch.nn.MSELoss()
    result = {"local_losses": [], "collectives_per_update": []}
    if wrapper:

        def closure():
            # With DDP the safeguard's loss must be the same on every rank: average it (a sum
            # then a division: gloo has no ReduceOp.AVG before torch 2.8).
            with torch.no_grad():
                loss = criterion(model(X), Y)
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM)
            return loss / torch.distributed.get_world_size()

        optimizer = aa.AcceleratedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
            history_depth=5,
            relaxation=0.5,
        )
        for _ in range(20):
            optimizer.zero_grad()
            loss = criterion(ddp(X), Y)
            loss.backward()
            result["local_losses"].append(loss.item())
            optimizer.step(closure)
        result["num_mixed"] = int(optimizer.anderson_states[0].num_mixed)
    else:
        opt = aa.anderson(aa.adam(1e-2), history_depth=5, relaxation=0.5)
        params = dict(model.named_parameters())
        state = opt.init({k: v.detach() for k, v in params.items()})
        for _ in range(20):
            for p in model.parameters():
                p.grad = None
            loss = criterion(ddp(X), Y)
            loss.backward()
            result["local_losses"].append(loss.item())
            with torch.no_grad(), CommDebugMode() as comm:
                grads = {k: v.grad for k, v in params.items()}
                _, state = opt.update(state, params, grads, inplace=True)
            result["collectives_per_update"].append(comm.get_total_counts())
        result["num_mixed"] = int(state.num_mixed)
    result["params"] = [p.detach().clone() for p in model.parameters()]
    return result


def _mlp(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 5)
    ).double()


def _fsdp2_scenario(rank, mesh, *, api: str):
    """A float64 MLP sharded with FSDP2, each rank on half of the batch, against the same
    model unsharded on the whole batch. ``api``: "functional" (``update(..., inplace=True)``),
    "wrapper" (``AcceleratedOptimizer`` around ``torch.optim.Adam``) or "safeguard" (the
    functional update with a ``loss_fn`` that loads candidates into the model, as in
    examples/distributed.py)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    import aadl_func as aa

    gen = torch.Generator().manual_seed(3)
    X = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    Y = torch.randn(64, 5, generator=gen, dtype=torch.float64)
    rows = slice(0, 32) if rank == 0 else slice(32, 64)
    criterion = torch.nn.MSELoss()
    steps, depth = 16, 5
    options = dict(history_depth=depth, relaxation=0.5, wait_iterations=2)

    def train(model, data, sharded, inputs=None):
        """Steps ``model``; each step's params (whole tensors) and the counters. ``inputs``:
        a replay, each step from the previous step's params of another run."""
        x, y = data
        params = dict(model.named_parameters())
        counts, loss_pairs, trajectory = [], [], []
        if api == "wrapper":
            optimizer = aa.AcceleratedOptimizer(
                torch.optim.Adam(model.parameters(), lr=0.02), **options
            )
        else:
            opt = aa.anderson(aa.adam(0.02), **options)
            state = opt.init({k: v.detach() for k, v in params.items()})

        @torch.no_grad()
        def set_params(values):
            for name, p in params.items():
                p.copy_(values[name])

        @torch.no_grad()
        def loss_at(values):
            set_params(values)
            loss = criterion(model(x), y)
            if sharded:
                model.reshard()  # FSDP2's root keeps gathered params after a forward
            return loss

        def whole() -> list[np.ndarray]:
            return [
                (p.full_tensor() if sharded else p).detach().reshape(-1).numpy().copy()
                for p in model.parameters()
            ]

        loss_fn = _Counting(loss_at, nested=False)
        for k in range(steps):
            if inputs is not None and k > 0:
                with torch.no_grad():
                    for p, value in zip(model.parameters(), inputs[k - 1]):
                        p.copy_(torch.from_numpy(value).reshape(p.shape))
            for p in model.parameters():
                p.grad = None
            criterion(model(x), y).backward()
            before = loss_fn.calls
            real_all_reduce = torch.distributed.all_reduce
            ours = []
            torch.distributed.all_reduce = _recording(real_all_reduce, ours, skip=loss_fn)
            # CommDebugMode fails around module forwards (its module tracker), which the
            # safeguard's loss_fn runs: there only the all_reduce calls outside it are counted.
            counting = CommDebugMode() if api != "safeguard" else contextlib.nullcontext()
            with counting as comm:
                if api == "wrapper":
                    optimizer.step()
                elif api == "functional":
                    with torch.no_grad():
                        grads = {k: v.grad for k, v in params.items()}
                        _, state = opt.update(state, params, grads, inplace=True)
                else:
                    grads = {k: v.grad for k, v in params.items()}
                    current = {k: v.detach() for k, v in params.items()}
                    with torch.no_grad():
                        new, state = opt.update(state, current, grads, loss_fn=loss_fn)
                    set_params(new)
            torch.distributed.all_reduce = real_all_reduce
            counts.append(_collectives(comm) if comm is not None else (len(ours), None))
            loss_pairs.append(int(loss_fn.calls > before))
            trajectory.append(whole())
        state = optimizer.anderson_states[0] if api == "wrapper" else state
        return trajectory, (int(state.num_mixed), int(state.num_rejected)), counts, loss_pairs

    model = _mlp(0)
    fully_shard(model, mesh=mesh)
    # FSDP2 averages the per-rank gradients: each rank's half batch gives the full-batch mean.
    sharded, decisions, counts, loss_pairs = train(model, (X[rows], Y[rows]), sharded=True)
    result = {"sharded": sharded, "num_mixed": decisions[0], "num_rejected": decisions[1]}
    result["aadl_collectives"] = counts
    result["sharded_params_are_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    expected = _expected_row_reductions(steps, "aadl", depth, 1, 2, 1)
    other = None if api == "safeguard" else 0
    result["expected_collectives"] = [(e + c, other) for e, c in zip(expected, loss_pairs)]
    # The unsharded model replayed on the sharded run's params: step k starts from the
    # sharded params after step k - 1, so the two differ by one step's rounding (the
    # half-batch gradients averaged over ranks, the Gram sums over ranks), not by the
    # recurrence's amplification of it from step to step.
    unsharded, decisions, _, _ = train(_mlp(0), (X, Y), sharded=False, inputs=sharded)
    result["unsharded"] = unsharded
    result["unsharded_num_mixed"], result["unsharded_num_rejected"] = decisions
    return result


def _errors_scenario(rank, mesh):
    from torch.distributed.tensor import Replicate, Shard

    import aadl_func as aa

    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    full = torch.arange(6.0)
    sharded = distribute(full, mesh, [Shard(0)])
    replicated = distribute(full, mesh, [Replicate()])
    out = {}

    def outcome(key, fn):
        try:
            fn()
            out[key] = "no error"
        except Exception as err:  # the test compares the exception types
            out[key] = type(err).__name__

    outcome("mixed", lambda: opt.init({"a": sharded, "b": full.clone()}))
    state = opt.init({"a": sharded})
    outcome("plain_grads", lambda: opt.update(state, {"a": sharded}, {"a": full.clone()}))
    outcome("replicated", lambda: opt.init({"a": replicated}))
    leaf = torch.nn.Parameter(sharded.detach().clone())
    grads = {"a": sharded.detach().clone()}
    outcome("inplace_requires_grad", lambda: opt.update(state, {"a": leaf}, grads, inplace=True))
    averaging = aa.anderson(aa.sgd(0.1), history_depth=3, average=True)
    outcome("average", lambda: averaging.init({"a": sharded}))
    return out


def _deferred_scenario(rank: int, mesh, mode: str) -> dict:
    """The deferred safeguard on sharded params: each rank passes the loss of its half of the
    data (``update`` averages them, so every rank takes the same decision), against the
    unsharded run with the whole loss and the NumPy recurrence (``deferred=True``)."""
    from conftest import GradientDescent
    from references import Recurrence
    from torch.distributed.tensor import Shard

    import aadl_func as aa

    dim = sum(int(np.prod(s)) for s in _SHAPES.values())
    np_loss, np_grad, smooth = _logistic(dim)
    lr, steps = 16.0 / smooth, 24  # a long step: some mixes raise the loss
    x0 = np.random.default_rng(7).standard_normal(dim)
    options = dict(mode=mode, history_depth=3, restart_on_reject=True)
    opt = aa.anderson(GradientDescent(lr), **options)
    half = slice(0, 40) if rank == 0 else slice(40, 80)

    params = {k: distribute(v, mesh, [Shard(0)]) for k, v in _to_tree(x0, torch.float64).items()}
    state = opt.init(params)
    sharded, rejected = [], []
    for k in range(1, steps + 1):
        x = _gather(params, rank, WORLD_SIZE)
        grads = {
            key: distribute(v, mesh, [Shard(0)])
            for key, v in _to_tree(np_grad(x), torch.float64).items()
        }
        before = int(state.num_rejected)
        loss = torch.tensor(np_loss(x, half), dtype=torch.float64)  # this rank's half
        params, state = opt.update(state, params, grads, loss=loss)
        if int(state.num_rejected) > before:
            rejected.append(k)
        sharded.append(_gather(params, rank, WORLD_SIZE))

    def unsharded(inputs=None) -> list:
        """The unsharded run, free-running or replayed on ``inputs`` (see _sharded_scenario)."""
        state, x, outputs = opt.init(_to_tree(x0, torch.float64)), x0, []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = inputs[k - 2]
            grads = _to_tree(np_grad(x), torch.float64)
            tree, state = opt.update(state, _to_tree(x, torch.float64), grads, loss=np_loss(x))
            x = _to_vector(tree)
            outputs.append(x)
        return outputs

    result = {
        "sharded": sharded,
        "unsharded": unsharded(),
        "unsharded_replayed": unsharded(sharded),
    }
    reference = lambda: Recurrence(np_grad, lr, deferred=True, **options)  # noqa: E731
    for run in ("sharded", "unsharded"):
        outputs = result[run]
        expected, kinds = reference().run(x0, steps, np_loss, inputs=outputs)
        result[f"{run}_reference"] = expected
        result[f"{run}_bounds"] = _call_bounds(reference, x0, outputs, torch.float64, np_loss)
        if run == "sharded":
            reverted = [k for k, kind in enumerate(kinds, 1) if kind == "reverted"]
    result.update(rejected_steps=rejected, reference_rejected_steps=reverted)
    result["replay_comparable"] = True  # the deferred safeguard stores no mix
    return result


def _worker(rank: int, world_size: int, work: Path) -> None:
    import torch.distributed as dist

    mesh = init_worker(rank, world_size, work, COLLECTIVE_TIMEOUT_S)
    scenarios = {
        "ddp_functional": lambda: _ddp_scenario(rank, wrapper=False),
        "ddp_wrapper": lambda: _ddp_scenario(rank, wrapper=True),
        "aadl_f64": lambda: _sharded_scenario(rank, mesh),
        "aadl_f64_store2": lambda: _sharded_scenario(rank, mesh, store=2, frequency=1, wait=3),
        "aadl_f64_loss_plain": lambda: _sharded_scenario(rank, mesh, loss="plain"),
        "aadl_f64_loss_dtensor": lambda: _sharded_scenario(rank, mesh, loss="dtensor"),
        "classic_f64": lambda: _sharded_scenario(rank, mesh, mode="classic"),
        "classic_f64_loss_plain": lambda: _sharded_scenario(
            rank, mesh, mode="classic", loss="plain"
        ),
        "aadl_f64_20": lambda: _sharded_scenario(rank, mesh, steps=20),
        "classic_f64_20": lambda: _sharded_scenario(rank, mesh, mode="classic", steps=20),
        "aadl_f64_20_loss": lambda: _sharded_scenario(rank, mesh, loss="dtensor", steps=20),
        "aadl_f32": lambda: _sharded_scenario(rank, mesh, dtype=torch.float32),
        "aadl_f64_nan": lambda: _sharded_scenario(rank, mesh, nan_step=6, frequency=1),
        "aadl_f64_skip": lambda: _skip_scenario(rank, mesh),
        "aadl_deferred": lambda: _deferred_scenario(rank, mesh, "aadl"),
        "classic_deferred": lambda: _deferred_scenario(rank, mesh, "classic"),
        "fsdp2_functional": lambda: _fsdp2_scenario(rank, mesh, api="functional"),
        "fsdp2_wrapper": lambda: _fsdp2_scenario(rank, mesh, api="wrapper"),
        "fsdp2_safeguard": lambda: _fsdp2_scenario(rank, mesh, api="safeguard"),
        "errors": lambda: _errors_scenario(rank, mesh),
    }
    if not FSDP2_ON_CPU:
        scenarios = {k: v for k, v in scenarios.items() if not k.startswith("fsdp2")}
    results = {}
    for name, run in scenarios.items():
        try:
            results[name] = run()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    torch.save(results, work / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))

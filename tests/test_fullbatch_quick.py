"""The full-batch suite's ``--quick`` mode (``benchmarks/fullbatch``): it runs end to end, and
what it reports holds up against counts and values taken outside it."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("sklearn")
sys.path.insert(0, str(ROOT))

from benchmarks.fullbatch import methods, run  # noqa: E402

PEERS = {"gd", "inner", "adam", "lbfgs", "lbfgs_inner"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("fullbatch") / "quick.json"
    return run.main(["--quick", "--out", str(out)])


def test_every_problem_has_every_row(quick):
    assert set(quick["problems"]) == set(run.SPECS)
    for key, result in quick["problems"].items():
        expected = PEERS | set(run.methods.ACCELERATED)
        if run.SPECS[key].pinn:
            expected |= {"adam_lbfgs"}
        assert set(result["methods"]) == expected, key
        for rows in result["runs"].values():
            assert [r["seed"] for r in rows] == quick["config"]["seeds"]
            assert all(set(r["targets"]) == set(result["targets"]) for r in rows)


def test_counts_agree_with_a_counter_around_the_objective(quick):
    for result in quick["problems"].values():
        for key, rows in result["runs"].items():
            for r in rows:
                assert r["gradients"] == r["counted_gradients"], key
                assert r["forwards"] == r["counted_forwards"], key
                # Forward-only evaluations: the line search's loss_fn calls only.
                assert r["forwards"] == 0 or key == "aa_line_search", key
                for hit in r["targets"].values():  # a target's cost counts the forwards too
                    assert hit is None or hit["gradients"] >= hit["forwards"], key
                assert 1 <= r["gradients"] <= result["budget"] + 25, key  # L-BFGS: one step over


def test_f_star_bounds_every_loss_reached(quick):
    """Relative suboptimality is never negative beyond rounding: f* of each seed (a long
    float64 run) lies below everything a method reached from that seed."""
    for key, result in quick["problems"].items():
        if result["kind"] != "loss":
            continue
        slack = 1e-12 if result["dtype"] == "float64" else 1e-5
        for rows in result["runs"].values():
            for r in rows:
                assert r["best_value"] >= -slack, (key, r["best_value"])


def test_target_costs_are_ordered(quick):
    for result in quick["problems"].values():
        for rows in result["runs"].values():
            for r in rows:
                hits = [r["targets"][label] for label in result["targets"]]
                reached = [h["gradients"] for h in hits if h is not None]
                assert reached == sorted(reached)
                assert all(h is not None for h in hits[: len(reached)])  # loosest first


def _counting(problem):
    calls = [0]

    def loss_and_grad(params):
        calls[0] += 1
        return problem.loss_and_grad(params)

    return dataclasses.replace(problem, loss_and_grad=loss_and_grad), calls


@pytest.mark.parametrize("row", ["lbfgs", "aa_default"])
def test_costs_to_a_target_are_every_evaluation_to_it(row):
    """On the convex softmax problem, run to 1e-2 relative suboptimality: the evaluations the
    suite reports are those of an independent counter (L-BFGS's line-search calls and AA's
    gradients at rejected mixes included), and the loss really is within the target there."""
    spec = run.SPECS["softmax"]
    f_star = run.load_f_star(run.parse_args(["--problems", "softmax"]))["softmax"]["f_star"]
    targets = run.targets_of(spec, f_star, 0)
    method = methods.aa_default() if row == "aa_default" else methods.grids(spec)["lbfgs"][4]
    problem, calls = _counting(spec.make(0, spec.dtype))
    result = run.run_once(method, problem, 1000, targets, 1e-2)
    hit = result["targets"]["rel. subopt. 1e-02"]
    assert hit is not None
    assert result["gradients"] == calls[0]
    assert hit["gradients"] <= calls[0] <= hit["gradients"] + 25
    assert result["best_value"] <= 1e-2
    loss = result["lowest_loss"]
    assert (loss - f_star["0"]) / abs(f_star["0"]) == pytest.approx(result["best_value"])
    if row == "aa_default":
        assert result["num_mixed"] + result["num_rejected"] < calls[0]
        assert 0 <= result["rejected_share"] < 1
    assert math.isfinite(loss)

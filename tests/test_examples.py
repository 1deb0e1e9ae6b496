"""The examples run end to end in tiny configurations and report sane, checkable numbers.

Each example's ``main(argv)`` is imported from ``examples/`` and run with small sizes. Beyond
"it ran", the checks compare against references that do not go through aadl_func: torch.optim
for the plain baselines, and the Walker-Ni theorem for Anderson acceleration on a linear map.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytest.importorskip("sklearn")
pytest.importorskip("scipy")


@pytest.fixture(scope="module")
def examples():
    """The example modules, imported from ``examples/`` (not a package)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield {
            name: importlib.import_module(name)
            for name in ("_common", "digits_demo", "ensemble", "fixed_point", "minibatch")
        }
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(autouse=True)
def _restore_threads():
    # The examples pin torch's thread count; give the rest of the suite its setting back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _all_finite(values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _torch_sgd_losses(model, x, y, lr, steps) -> list[float]:
    """Full-batch losses of ``torch.optim.SGD`` (the reference for the plain baselines)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    with torch.no_grad():
        losses.append(F.cross_entropy(model(x), y).item())
    return losses


def test_digits_demo(examples, tmp_path, capsys):
    demo, common = examples["digits_demo"], examples["_common"]
    steps = 30
    summary = demo.main(["--quick", "--no-progress", "--out-dir", str(tmp_path), "--run", "tiny"])
    run_dir = tmp_path / "tiny"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    png = (run_dir / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "steps<0.1" in capsys.readouterr().out  # the comparison table was printed

    for key in ("baseline", "anderson"):
        run = summary[key]
        for field in ("final_loss", "test_accuracy", "steps_to_target", "wall_seconds"):
            assert field in run
        assert len(run["loss_curve"]) == steps + 1 and _all_finite(run["loss_curve"])
        assert run["final_loss"] == run["loss_curve"][-1]
        assert 0.0 <= run["test_accuracy"] <= 1.0 and run["wall_seconds"] > 0.0
        curve = run["loss_curve"]
        target = run["steps_to_target"]
        if target is None:
            assert min(curve) >= summary["config"]["target"]
        else:
            assert curve[target] < summary["config"]["target"] <= min(curve[:target] + [math.inf])
    anderson = summary["anderson"]
    assert anderson["num_mixed"] + anderson["num_rejected"] <= steps
    assert anderson["num_nonfinite"] == 0

    # The baseline is plain full-batch GD: torch.optim.SGD from the same weights agrees.
    data = common.load_digits(seed=0)
    model = common.make_cnn(seed=0)
    reference = _torch_sgd_losses(model, data.x_train, data.y_train, lr=0.5, steps=steps)
    assert summary["baseline"]["loss_curve"] == pytest.approx(reference, rel=1e-4, abs=1e-6)
    # Both runs start from the same weights, and the first call cannot mix (one pair stored).
    assert anderson["loss_curve"][:2] == pytest.approx(reference[:2], rel=1e-4)
    # The demo's claim, on this deterministic problem: acceleration trains faster. Measured
    # at 30 steps: GD 0.37, accelerated 0.10 (the margin is wide).
    assert anderson["final_loss"] < 0.5 * summary["baseline"]["final_loss"]


def test_ensemble(examples, tmp_path, capsys):
    ensemble, common = examples["ensemble"], examples["_common"]
    members, steps = 3, 12
    summary = ensemble.main(
        ["--members", str(members), "--steps", str(steps), "--out-dir", str(tmp_path)]
    )
    assert (tmp_path / "ensemble" / "summary.json").exists()
    assert "ensemble test accuracy" in capsys.readouterr().out
    for key in ("baseline", "anderson"):
        run = summary[key]
        assert len(run["final_loss"]) == members and _all_finite(run["final_loss"])
        assert all(0.0 <= a <= 1.0 for a in run["test_accuracy"])
        assert 0.0 <= run["ensemble_test_accuracy"] <= 1.0
    assert all(0 <= m <= steps for m in summary["anderson"]["num_mixed"])

    # Each vmapped baseline member is exactly its own torch.optim.SGD run.
    data = common.load_digits(seed=0)
    for i in range(members):
        model = common.make_mlp(seed=i)
        reference = _torch_sgd_losses(model, data.x_train, data.y_train, lr=0.5, steps=steps)
        assert summary["baseline"]["final_loss"][i] == pytest.approx(reference[-1], rel=1e-4)


def test_fixed_point(examples, tmp_path, capsys):
    fixed_point = examples["fixed_point"]
    summary = fixed_point.main(
        ["--n", "30", "--kappa", "30", "--tol", "1e-6", "--max-iter", "600",
         "--logistic-tol", "1e-3", "--logistic-max-iter", "300", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert (tmp_path / "fixed_point" / "summary.json").exists()
    output = capsys.readouterr().out
    assert "GMRES" in output and "L-BFGS" in output

    quad = summary["quadratic"]
    plain = quad["plain GD"]["iterations"]
    # M = I - A / lambda_max is symmetric with spectrum in [0, 1 - 1/kappa]: plain iteration
    # contracts the residual at least that fast, so it needs at most this many steps.
    assert plain is not None and plain <= math.ceil(math.log(1e-6) / math.log(1 - 1 / 30))
    for name in ("AA classic, depth 10", "AA classic, depth 32 (full)", "GMRES (NumPy)"):
        assert quad[name]["iterations"] is not None and quad[name]["iterations"] < plain / 2
    # Walker & Ni: with full history, x_AA(k+1) = g(x_GMRES(k)), and ||M|| = 1 - 1/kappa < 1
    # here, so AA's residual reaches any level at most one step after GMRES's (checked at
    # 1e-2, well above the float64 Gram matrix's accuracy floor).
    full = quad["AA classic, depth 32 (full)"]["iterations_to"]["0.01"]
    gmres = quad["GMRES (NumPy)"]["iterations_to"]["0.01"]
    assert gmres <= full <= gmres + 1

    logistic = summary["logistic"]
    accelerated = logistic["AA classic, depth 10, safeguard"]
    assert accelerated["iterations"] is not None
    plain = logistic["plain GD"]["iterations"]
    assert plain is None or accelerated["iterations"] < plain
    # f* comes from a tight L-BFGS solve: no iterate is below it, the converged one is close.
    assert accelerated["f_minus_f_star"] > -1e-10
    assert accelerated["f_minus_f_star"] < 1e-4
    assert logistic["plain GD"]["f_minus_f_star"] > accelerated["f_minus_f_star"]


def test_minibatch(examples, tmp_path, capsys):
    minibatch = examples["minibatch"]
    epochs, seeds = 3, 2
    summary = minibatch.main(
        ["--quick", "--no-progress", "--out-dir", str(tmp_path), "--run", "tiny"]
    )
    run_dir = tmp_path / "tiny"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    png = (run_dir / "test_accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    output = capsys.readouterr().out
    assert "epochs to adam final" in output and "goal vs adam" in output

    config = summary["config"]
    assert config["epochs"] == epochs and config["seeds"] == seeds
    assert config["evaluated_on"] == "test" and set(config["variants"]) == set(minibatch.VARIANTS)
    for name in minibatch.DATASETS:
        data = summary["datasets"][name]
        assert sum(data["sizes"].values()) == {"digits": 1797, "tabular": 3000}[name]
        targets = data["targets"]
        assert set(targets) == {"adam", "sgdm"}
        for variant in minibatch.VARIANTS:
            runs = data["runs"][variant]
            assert [r["seed"] for r in runs] == list(range(seeds))
            for r in runs:
                assert len(r["accuracy"]) == len(r["train_loss"]) == epochs + 1
                assert all(0.0 <= a <= 1.0 for a in r["accuracy"])
                assert _all_finite(r["train_loss"]) and r["wall_seconds"] > 0
                elapsed = r["elapsed_seconds"]
                assert len(elapsed) == epochs + 1 and elapsed[0] == 0.0
                assert elapsed == sorted(elapsed) and elapsed[-1] == r["wall_seconds"]
                if "num_mixed" in r:
                    assert r["num_mixed"] + r["num_rejected"] <= r["steps"]
                    assert r["num_nonfinite"] == 0
            stats = data["stats"][variant]
            finals = [r["accuracy"][-1] for r in runs]
            assert stats["final_accuracy"]["mean"] == pytest.approx(sum(finals) / seeds)
            assert stats["final_accuracy"]["count"] == seeds
            for baseline, target in targets.items():
                per_seed = stats["epochs_to"][baseline]
                reached = [minibatch.epochs_to(r["accuracy"], target) for r in runs]
                assert per_seed["count"] == sum(e is not None for e in reached)
                for r, e in zip(runs, reached):
                    if e is not None:  # the first epoch at or above the target
                        assert r["accuracy"][e] >= target - 1e-12
                        assert all(a < target for a in r["accuracy"][:e])
        # The targets are the baselines' final seed-mean accuracies, which each baseline's
        # mean curve reaches by its last epoch at the latest.
        for baseline, target in targets.items():
            finals = [r["accuracy"][-1] for r in data["runs"][baseline]]
            assert target == pytest.approx(sum(finals) / seeds)
            goal = data["goal"][baseline]
            assert goal["baseline_epochs"] is not None and goal["baseline_epochs"] <= epochs
            assert all(
                minibatch.variants(minibatch.parse_args([]))[v].baseline == baseline
                for v in goal["variants"]
            )
        # No aadl_func in the plain runs: the seed-0 "adam" run is torch.optim.Adam on the
        # same minibatches from the same initial weights.
        reference = _torch_adam_losses(minibatch, name, epochs, seed=0, lr=1e-3, batch_size=256)
        actual = data["runs"]["adam"][0]["train_loss"]
        assert actual == pytest.approx(reference, rel=1e-4, abs=1e-6)


def _torch_adam_losses(minibatch, name, epochs, seed, lr, batch_size) -> list[float]:
    """Full-training-set losses after each epoch of ``torch.optim.Adam`` on the example's data,
    model and minibatch order (the generator seeded as the example documents)."""
    data = minibatch.load_dataset(name)
    x, y = data.train.x, data.train.y
    model = minibatch.make_model(x.shape[1], data.num_classes, 64, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(10_000 + seed)

    def full_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x), y).item()

    losses = [full_loss()]
    for _ in range(epochs):
        permutation = torch.randperm(len(y), generator=order)
        for start in range(0, len(y), batch_size):
            rows = permutation[start : start + batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
        losses.append(full_loss())
    return losses

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
            for name in (
                "_common", "digits_demo", "pinn", "ensemble", "fixed_point", "minibatch",
                "minibatch_averaging",
            )
        }  # fmt: skip
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


def _torch_adam_full_batch_losses(model, x, y, lr, betas, steps) -> list[float]:
    """Full-batch losses of ``torch.optim.Adam``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def _torch_lbfgs(model, x, y, budget, lr, history_size, max_iter) -> tuple[int, float]:
    """``torch.optim.LBFGS`` on the module with autograd, stepped as the demo documents (at most
    ``max_iter * 5 // 4`` closure calls per ``step``, capped by what is left of ``budget``):
    the number of closure calls and the final loss."""
    optimizer = torch.optim.LBFGS(
        model.parameters(), lr=lr, history_size=history_size, max_iter=max_iter,
        line_search_fn="strong_wolfe",
    )  # fmt: skip
    calls = [0]

    def closure():
        calls[0] += 1
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    while calls[0] < budget:
        before = calls[0]
        optimizer.param_groups[0]["max_eval"] = min(max_iter * 5 // 4, budget - calls[0])
        optimizer.step(closure)
        if calls[0] == before + 1:
            break
    with torch.no_grad():
        return calls[0], F.cross_entropy(model(x), y).item()


def _check_runs(summary, budget, forward_cost):
    """What holds for every run of a comparison: counts add up, curves are consistent, the
    budget is respected, and all rows start from the same initial loss."""
    initial = {runs[0]["curve"]["loss"][0] for runs in summary["runs"].values()}
    assert len(initial) == 1  # the same initial weights for every method
    for key, runs in summary["runs"].items():
        assert [r["seed"] for r in runs] == summary["config"]["seeds"]
        for run in runs:
            curve = run["curve"]
            n = len(curve["loss"])
            assert len(curve["equivalents"]) == len(curve["seconds"]) == n > 0
            assert curve["equivalents"] == sorted(curve["equivalents"])
            assert curve["seconds"] == sorted(curve["seconds"]) and run["seconds"] > 0
            assert run["equivalents"] == pytest.approx(
                run["grads"] + forward_cost * run["forwards"]
            )
            assert run["equivalents"] == pytest.approx(curve["equivalents"][-1])
            # A run stops once the budget is spent: at most one more step's cost beyond it.
            assert budget <= run["equivalents"] < budget + 1 + 2 * forward_cost or (
                key in ("lbfgs", "adam_lbfgs") and run["equivalents"] <= budget
            )
            if "num_mixed" in run:
                calls = run["num_mixed"] + run["num_rejected"] + run["num_nonfinite"]
                assert calls <= run["steps"] and run["num_nonfinite"] == 0
                safeguard = summary["methods"][key]["options"]["safeguard"]
                if safeguard == "none":
                    assert run["forwards"] == 0 and run["num_rejected"] == 0
                elif safeguard == "deferred":  # judged by the loss computed with the grads
                    assert run["forwards"] == 0
                else:  # the loss_fn safeguard: two forward-only losses per mixing call
                    assert run["forwards"] == 2 * calls
            else:
                assert run["forwards"] == 0
            for target, hit in ((k, v) for k, v in run.items() if k.startswith("loss<")):
                values = curve["loss"]
                bound = float(target.split("<")[1])
                reached = [i for i, v in enumerate(values) if v is not None and v < bound]
                if hit is None:
                    assert not reached
                else:  # the first iterate below the target, and its costs
                    i = reached[0]
                    assert hit["equivalents"] == pytest.approx(curve["equivalents"][i])
                    assert hit["seconds"] == curve["seconds"][i]


def test_digits_demo(examples, tmp_path, capsys):
    demo, common = examples["digits_demo"], examples["_common"]
    budget = 30
    summary = demo.main(["--quick", "--no-progress", "--out-dir", str(tmp_path), "--run", "tiny"])
    run_dir = tmp_path / "tiny"
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    png = (run_dir / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    output = capsys.readouterr().out
    assert "loss<0.01: grad-eq" in output and "best baseline" in output
    assert set(summary["runs"]) == {
        "gd", "adam", "lbfgs", "aa", "aa_deferred", "aa_wrapper", "aa_safeguard"
    }  # fmt: skip
    assert summary["config"]["seeds"] == [0] and summary["config"]["budget"] == budget
    _check_runs(summary, budget, demo.FORWARD_COST)
    runs = {key: rs[0] for key, rs in summary["runs"].items()}
    for run in runs.values():
        assert 0.0 <= run["test_accuracy"] <= 1.0 and _all_finite(run["curve"]["loss"])

    # The baselines are what they say, against torch.optim with autograd on the module.
    data = common.load_digits(seed=0)
    x, y = data.x_train, data.y_train
    reference = _torch_sgd_losses(common.make_cnn(seed=0), x, y, lr=demo.GD_LR, steps=budget)
    assert runs["gd"]["curve"]["loss"] == pytest.approx(reference[:budget], rel=1e-4, abs=1e-6)
    reference = _torch_adam_full_batch_losses(
        common.make_cnn(seed=0), x, y, demo.ADAM["lr"], demo.ADAM["betas"], budget
    )
    assert runs["adam"]["curve"]["loss"] == pytest.approx(reference, rel=1e-4, abs=1e-6)
    # L-BFGS: every closure call is counted, and the functional gradients drive
    # torch.optim.LBFGS exactly as autograd does.
    calls, final = _torch_lbfgs(common.make_cnn(seed=0), x, y, budget, max_iter=20, **demo.LBFGS)
    assert runs["lbfgs"]["closure_calls"] == runs["lbfgs"]["grads"] == calls
    assert runs["lbfgs"]["final_loss"] == pytest.approx(final, rel=1e-3)
    # The verdict is computed from the statistics it reports.
    verdict = summary["verdict"]["equivalents"]
    mean = summary["stats"]["aa"]["loss<0.01"]["equivalents"]["mean"]
    assert verdict["aa"] == mean and verdict["aa_wins"] == (mean is not None)
    # The demo's claim at this budget (measured: AA 8.0e-3 after 30 gradient evaluations, Adam
    # 5.5e-2, L-BFGS 4.9e-2, GD 0.38): accelerated Adam trains fastest in evaluations.
    others = ("gd", "adam", "lbfgs", "aa_safeguard")
    assert all(runs["aa"]["final_loss"] < 0.5 * runs[key]["final_loss"] for key in others)
    # The deferred safeguard adds no forward pass: its costs are gradients alone.
    deferred = runs["aa_deferred"]
    assert deferred["forwards"] == 0 and deferred["equivalents"] == deferred["grads"]
    assert deferred["num_mixed"] > 0
    # The wrapper row is the same algorithm through the torch.optim face: the same decisions,
    # and the loss curve within the bound the Adam row is held to against torch.optim above
    # (torch.optim.Adam's rounding against aa.adam's, float32).
    wrapper = runs["aa_wrapper"]
    for name in ("num_mixed", "num_rejected", "grads", "forwards"):
        assert wrapper[name] == deferred[name], name
    assert wrapper["curve"]["loss"] == pytest.approx(deferred["curve"]["loss"], rel=1e-4)


def test_digits_demo_tune(examples, tmp_path, capsys):
    demo = examples["digits_demo"]
    summary = demo.main(["--tune", "--quick", "--no-progress", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "digits" / "tune.json").read_text()) == summary
    assert "best first" in capsys.readouterr().out
    assert set(summary["families"]) == set(demo.tuning_grids())
    for family in summary["families"].values():
        settings = family["settings"]
        assert len(settings) == 2 and family["chosen"] == settings[0]["description"]
        keys = [[math.inf if v is None else v for v in s["score"]] for s in settings]
        assert keys == sorted(keys)
    assert all(len(grid) == 16 for grid in demo.tuning_grids().values())


def test_pinn(examples, tmp_path, capsys):
    pinn = examples["pinn"]
    summary = pinn.main(["--quick", "--no-progress", "--out-dir", str(tmp_path), "--run", "tiny"])
    assert json.loads((tmp_path / "tiny" / "summary.json").read_text()) == summary
    assert (tmp_path / "tiny" / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert "rel. L2 error" in capsys.readouterr().out
    budget = summary["config"]["budget"]
    _check_runs(summary, budget, pinn.FORWARD_COST)
    problem = pinn.make_problem(0)
    runs = {key: rs[0] for key, rs in summary["runs"].items()}
    for run in runs.values():
        errors = run["curve"]["metric"]
        assert len(errors) == len(run["curve"]["loss"]) and _all_finite(errors)
        assert run["l2_error"] >= 0.0
    # The initial error is that of the initial network against the exact solution.
    assert runs["gd"]["curve"]["metric"][0] == pytest.approx(problem.track(problem.params()))
    # The source is -u*'', and the training loss (u'' from nested torch.func.grad) is the one
    # autograd computes on the module.
    x = torch.linspace(0, 1, 11, dtype=torch.float64, requires_grad=True)
    du = torch.autograd.grad(pinn.exact(x).sum(), x, create_graph=True)[0]
    d2u = torch.autograd.grad(du.sum(), x)[0]
    assert (-d2u).tolist() == pytest.approx(pinn.source(x.detach()).tolist(), rel=1e-9, abs=1e-9)
    model = pinn.make_model(0)
    x = torch.linspace(0, 1, pinn.COLLOCATION + 2)[1:-1].reshape(-1, 1).requires_grad_(True)
    du = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
    d2u = torch.autograd.grad(du.sum(), x)[0].reshape(-1)
    f = pinn.source(x.detach().reshape(-1))
    edge = model(torch.tensor([[0.0], [1.0]]))
    reference = ((d2u + f) ** 2).mean() / (f**2).mean() + 0.5 * (edge**2).sum()
    assert problem.loss(problem.params()).item() == pytest.approx(reference.item(), rel=1e-5)
    assert runs["gd"]["curve"]["loss"][0] == pytest.approx(reference.item(), rel=1e-5)
    # Adam -> L-BFGS: the first phase is plain Adam (the same curve as the Adam row when the
    # learning rates agree), then every L-BFGS closure call is counted.
    switch = runs["adam_lbfgs"]
    first_steps = summary["methods"]["adam_lbfgs"]["options"]["first_steps"]
    if first_steps < budget:
        assert switch["grads"] == first_steps + switch["closure_calls"]
    if summary["methods"]["adam_lbfgs"]["options"]["adam_lr"] == pinn.ADAM["lr"]:
        n = min(first_steps, len(runs["adam"]["curve"]["loss"]))
        assert switch["curve"]["loss"][:n] == runs["adam"]["curve"]["loss"][:n]


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
    assert "epochs to target" in output and "goal (" in output
    tables = (run_dir / "tables.md").read_text()
    assert tables.count("| adam | lr=") == len(minibatch.DATASETS)

    config = summary["config"]
    assert config["epochs"] == epochs and config["seeds"] == seeds
    assert config["evaluated_on"] == "test" and config["targets"] == minibatch.TARGETS
    settings = minibatch.load_settings(minibatch.TUNED_FILE)
    for name in minibatch.DATASETS:
        data = summary["datasets"][name]
        assert (
            sum(data["sizes"].values()) == {"digits": 1797, "tabular": 3000, "textures": 2400}[name]
        )
        target = data["target"]
        assert target == minibatch.TARGETS[name]  # fixed in advance, not a run's own result
        assert set(data["runs"]) == set(minibatch.VARIANTS)
        for variant in minibatch.VARIANTS:
            lr, extra = settings[name][variant]
            assert (
                config["variants"][name][variant]
                == minibatch.make_variant(variant, lr, extra).label
            )
            runs = data["runs"][variant]
            assert [r["seed"] for r in runs] == list(range(seeds))
            for r in runs:
                assert len(r["accuracy"]) == len(r["train_loss"]) == epochs + 1
                assert all(0.0 <= a <= 1.0 for a in r["accuracy"])
                elapsed = r["elapsed_seconds"]
                assert len(elapsed) == epochs + 1 and elapsed[0] == 0.0
                assert elapsed == sorted(elapsed) and elapsed[-1] == r["wall_seconds"]
                if "num_rejected" in r:
                    assert r["num_mixed"] + r["num_rejected"] <= r["steps"]
                if "num_fallback" in r:  # AdaSAM: every step but the first is one or the other
                    assert r["num_mixed"] + r["num_fallback"] == r["steps"] - 1
            stats = data["stats"][variant]
            finals = [r["accuracy"][-1] for r in runs]
            assert stats["final_accuracy"]["mean"] == pytest.approx(sum(finals) / seeds)
            reached = [minibatch.epochs_to(r["accuracy"], target) for r in runs]
            assert stats["epochs_to_target"]["count"] == sum(e is not None for e in reached)
            for r, e in zip(runs, reached):
                if e is not None:  # the first epoch at or above the target
                    assert r["accuracy"][e] >= target
                    assert all(a < target for a in r["accuracy"][:e])
        goal = data["goal"]
        assert set(goal["variants"]) == set(minibatch.VARIANTS) - {
            *minibatch.BASELINES,
            *minibatch.CONTROLS,
        }
        # No aadl_func in the plain runs: the seed-0 "adam" run is torch.optim.Adam on the
        # same minibatches from the same initial weights, at the tuned learning rate.
        lr = settings[name]["adam"][0]
        reference = _torch_adam_losses(minibatch, name, epochs, seed=0, lr=lr, batch_size=256)
        actual = data["runs"]["adam"][0]["train_loss"]
        assert actual == pytest.approx(reference, rel=1e-4, abs=1e-6)


def test_minibatch_averaging_quick(examples, tmp_path):
    """The --quick report: every row, the goal, and the base rows are the plain runs (the
    averaging only watches them)."""
    averaging, minibatch = examples["minibatch_averaging"], examples["minibatch"]
    summary = averaging.main(
        ["--quick", "--no-progress", "--datasets", "digits", "--out-dir", str(tmp_path)]
    )
    assert json.loads((tmp_path / "averaging" / "summary.json").read_text()) == summary
    data = summary["datasets"]["digits"]
    expected_rows = set(averaging.ROWS) - (set() if averaging.schedulefree else {"sf-adamw"})
    assert set(data["runs"]) == expected_rows
    assert set(summary["goal"]["per_dataset"]["digits"]) >= {"rna", "swa", "ema", "spread"}
    args = averaging.parse_args(["--quick"])
    plain = minibatch.train_run(
        minibatch.load_dataset("digits"), minibatch.make_variant("adam", 0.03, None), 0, 3,
        "test", args,
    )  # fmt: skip
    assert data["runs"]["adam"][0]["accuracy"] == plain["accuracy"]
    for run in data["runs"]["rna-adam"]:
        assert len(run["lambda"]) == len(run["accuracy"]) == 4 and run["lambda"][0] is None


class _Recorder:
    """Copies of the params after every step and at every epoch end."""

    def __init__(self):
        self.steps, self.epochs = [], []

    def step(self, params, grads):
        self.steps.append({k: v.clone() for k, v in params.items()})

    def epoch(self, params):
        self.epochs.append({k: v.clone() for k, v in params.items()})


def test_minibatch_averaging_rows_against_hand_written_averages(examples):
    """SWA, EMA and RNA rows against the averages written out from recorded snapshots: the
    mean of the epoch-end params from ``start``, the EMA recursion (first step copied), and
    the NumPy RNA reference at the lambda the row chose."""
    from references import rna_extrapolate

    averaging, mb = examples["minibatch_averaging"], examples["minibatch"]
    args = averaging.parse_args(["--quick", "--epochs", "4"])
    data = mb.load_dataset("digits")
    evaluator = averaging.Evaluator(data, args.hidden, "test")
    host = mb.make_model(data, args.hidden, 0)
    swa = averaging.Averaged("swa", [2], evaluator, host)
    ema = averaging.Averaged("ema", [0.8], evaluator, host)
    rna = averaging.Extrapolated([3], evaluator)
    recorder = _Recorder()
    mb.train_run(data, mb.make_variant("adam", 0.03, None), 0, 4, "test", args,
                 observers=(recorder, swa, ema, rna))  # fmt: skip

    def mean(snaps, weights):
        return {k: sum(w * s[k].double() for w, s in zip(weights, snaps)).float() for k in snaps[0]}

    snaps = recorder.epochs[2:]
    expected = evaluator.accuracy(mean(snaps, [1 / len(snaps)] * len(snaps)))
    assert swa.curves[2][-1] == expected
    assert swa.curves[2][:2] == [evaluator.accuracy(s) for s in recorder.epochs[:2]]
    average = recorder.steps[0]
    for p in recorder.steps[1:]:
        average = {k: 0.8 * average[k] + 0.2 * p[k] for k in p}
    assert ema.curves[0.8][-1] == pytest.approx(evaluator.accuracy(average), abs=1 / 360)
    lam = rna.lambdas[3][-1]
    lam = float("inf") if lam == "inf" else lam
    names = list(recorder.epochs[0])
    flat = [torch.cat([s[k].double().reshape(-1) for k in names]) for s in recorder.epochs[-4:]]
    point = rna_extrapolate(torch.stack(flat, 1).numpy(), lam)
    sizes = [recorder.epochs[0][k].numel() for k in names]
    pieces = torch.split(torch.tensor(point, dtype=torch.float32), sizes)
    reference = {k: v.reshape(recorder.epochs[0][k].shape) for k, v in zip(names, pieces)}
    assert rna.curves[3][-1] == pytest.approx(evaluator.accuracy(reference), abs=1 / 360)


def test_minibatch_control_keeps_the_long_step_only_when_it_is_better(examples):
    """The guarded long step around SGD (lr 0.1, no momentum): y = x - 0.1 g, z = x - 0.3 g,
    z returned exactly when loss_fn(z) < loss_fn(y)."""
    minibatch = examples["minibatch"]
    import aadl_func as aa

    control = minibatch.GuardedLongStep(aa.sgd(0.1), 3.0)
    x = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    g = {"w": torch.tensor([0.5, 1.0], dtype=torch.float64)}
    y, z = x["w"] - 0.1 * g["w"], x["w"] - 0.3 * g["w"]
    state = control.init(x)
    far = lambda p: (p["w"] - z).pow(2).sum()  # noqa: E731  (z is its minimum)
    near = lambda p: (p["w"] - y).pow(2).sum()  # noqa: E731
    out, state = control.update(state, x, g, loss_fn=far)
    torch.testing.assert_close(out["w"], z, rtol=0, atol=1e-15)
    out, state = control.update(state, x, g, loss_fn=near)
    torch.testing.assert_close(out["w"], y, rtol=0, atol=1e-15)
    assert (int(state.num_mixed), int(state.num_rejected)) == (1, 1)
    out, _ = control.update(state, x, g)  # no loss_fn: the plain step
    torch.testing.assert_close(out["w"], y, rtol=0, atol=1e-15)


def test_minibatch_coordinate_search_ends_interior(examples):
    """On a separable bowl on a 12 x 9 lattice, from a corner: the search ends at the minimum,
    which beats its neighbours, evaluating each point at most once."""
    minibatch = examples["minibatch"]
    calls: dict[tuple, int] = {}

    def score(point):
        calls[point] = calls.get(point, 0) + 1
        return ((point[0] - 7) ** 2 + 0.5 * (point[1] - 2) ** 2, 0)

    cache: dict = {}

    def cached(point):
        if point not in cache:
            cache[point] = score(point)
        return cache[point]

    chosen = minibatch.coordinate_search(cached, [12, 9], (0, 8))
    assert chosen == (7, 2) and max(calls.values()) == 1
    # A noisy, non-separable score: whatever it ends at beats all four lattice neighbours.
    rng = torch.Generator().manual_seed(0)
    table = torch.rand(10, 6, generator=rng)
    chosen = minibatch.coordinate_search(lambda p: float(table[p]), [10, 6], (5, 3))
    for axis, step in ((0, -1), (0, 1), (1, -1), (1, 1)):
        other = list(chosen)
        other[axis] += step
        if 0 <= other[axis] < table.shape[axis]:
            assert table[chosen] <= table[tuple(other)]


def test_minibatch_tune(examples, tmp_path):
    """--tune: every variant's choice scores no worse than its evaluated lattice neighbours,
    on the validation split, and the Markdown lists every setting tried."""
    minibatch = examples["minibatch"]
    argv = ["--tune", "--quick", "--datasets", "digits", "--variants", "adam,control-adam"]
    tuning = minibatch.main([*argv, "--no-progress", "--out-dir", str(tmp_path), "--run", "t"])
    assert json.loads((tmp_path / "t" / "tuning.json").read_text()) == json.loads(
        json.dumps(tuning)
    )
    entry = tuning["choices"]["digits"]
    assert entry["seeds"] == [100] and entry["target"] == minibatch.TARGETS["digits"]
    for name, choice in entry["variants"].items():
        scores = {(e["lr"], e["extra"]): tuple(e["score"]) for e in choice["evaluated"]}
        best = scores[(choice["lr"], choice["extra"])]
        i = minibatch.LR_GRID.index(choice["lr"])
        for lr in minibatch.LR_GRID[max(i - 1, 0) : i + 2]:
            assert scores[(lr, choice["extra"])] >= best
        if name == "control-adam":
            grid = minibatch.EXTRA[name][1]
            j = grid.index(choice["extra"])
            for extra in grid[max(j - 1, 0) : j + 2]:
                assert scores[(choice["lr"], extra)] >= best
    markdown = (tmp_path / "t" / "tuning.md").read_text()
    tried = sum(len(v["evaluated"]) for v in entry["variants"].values())
    assert markdown.count(" -> ") == 1 + tried  # and once in the header


def test_minibatch_textures_are_balanced_and_reproducible(examples):
    minibatch = examples["minibatch"]
    images, labels = minibatch.make_textures(n=120, seed=3)
    again, labels_again = minibatch.make_textures(n=120, seed=3)
    assert images.shape == (120, 1, 16, 16) and images.dtype.name == "float32"
    assert (images == again).all() and (labels == labels_again).all()
    assert sorted(set(labels.tolist())) == list(range(len(minibatch.TEXTURES)))
    assert all((labels == k).sum() == 20 for k in range(6))


def _torch_adam_losses(minibatch, name, epochs, seed, lr, batch_size) -> list[float]:
    """Full-training-set losses after each epoch of ``torch.optim.Adam`` on the example's data,
    model and minibatch order (the generator seeded as the example documents)."""
    data = minibatch.load_dataset(name)
    x, y = data.train.x, data.train.y
    model = minibatch.make_model(data, 64, seed)
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


def test_deq(examples, tmp_path, capsys):
    """examples/deq.py --quick: both forward solvers reach the fixed point on every step, the
    implicit gradients train the same model, and Anderson needs fewer forward iterations."""
    deq = importlib.import_module("deq")  # on the path the ``examples`` fixture set
    summary = deq.main(["--quick", "--out-dir", str(tmp_path)])
    assert (tmp_path / "deq" / "summary.json").exists()
    assert "iters/step" in capsys.readouterr().out
    anderson, plain = summary["anderson"], summary["plain"]
    assert anderson["all_converged"] and plain["all_converged"]
    assert anderson["steps"] == plain["steps"] > 0
    # ||W||_2 = gamma and tanh is 1-Lipschitz: f contracts by gamma at least, so the plain
    # residual falls below rtol times the first one within log(rtol) / log(gamma) steps.
    config = summary["config"]
    assert plain["max_forward_iterations"] <= math.ceil(
        math.log(config["rtol"]) / math.log(config["gamma"])
    )
    assert anderson["mean_forward_iterations"] < 0.85 * plain["mean_forward_iterations"]
    # The two runs differ by the forward solves' tolerance only: the same training.
    assert abs(anderson["train_loss"] - plain["train_loss"]) < 1e-3
    assert abs(anderson["test_accuracy"] - plain["test_accuracy"]) <= 0.01
    assert anderson["test_accuracy"] > 0.8  # 10 classes: chance is 0.1


def test_digits_demo_tail(examples, tmp_path, capsys):
    """``--tail``: L-BFGS and each chosen AA row with a float32 and a float64 window; the
    window's dtype is the only difference, and it changes the trajectory (by rounding)."""
    demo = examples["digits_demo"]
    summary = demo.main(["--tail", "--quick", "--no-progress", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "digits" / "tail.json").read_text()) == summary
    runs = summary["runs"]
    assert sorted(runs) == sorted(
        ["lbfgs", "aa float32", "aa float64", "aa_deferred float32", "aa_deferred float64"]
    )
    assert "float64 window: final loss per seed" in capsys.readouterr().out
    for key in ("aa", "aa_deferred"):
        (low,), (high,) = runs[f"{key} float32"], runs[f"{key} float64"]
        assert low["grads"] == high["grads"] and low["curve"]["loss"] != high["curve"]["loss"]
        assert abs(low["final_loss"] - high["final_loss"]) < 1e-3 * max(low["final_loss"], 1e-3)


def test_digits_demo_short(examples, tmp_path, capsys):
    """``--short``: the short recurrence beside the chosen deferred AA row and L-BFGS."""
    demo = examples["digits_demo"]
    summary = demo.main(["--short", "--quick", "--no-progress", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "digits" / "short.json").read_text()) == summary
    assert sorted(summary["runs"]) == ["aa_deferred", "lbfgs", "st_am"]
    assert "ST-AM + deferred safeguard" in capsys.readouterr().out
    (run,) = summary["runs"]["st_am"]
    assert run["forwards"] == 0 and run["grads"] >= 30


def test_digits_demo_guard(examples, tmp_path, capsys):
    """``--guard``: each failing AA setting without and with the deferred safeguard."""
    demo = examples["digits_demo"]
    summary = demo.main(["--guard", "--quick", "--no-progress", "--out-dir", str(tmp_path)])
    assert json.loads((tmp_path / "digits" / "guard.json").read_text()) == summary
    assert len(summary["runs"]) == 6 and "rejected" in capsys.readouterr().out
    for key, (run,) in summary["runs"].items():
        assert run["forwards"] == 0  # neither row evaluates a forward-only loss
        assert (run["num_rejected"] > 0) == key.endswith("deferred")

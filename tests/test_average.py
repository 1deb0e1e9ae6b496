"""``average=True``: AADL's moving-average rule, against a float64 NumPy reference.

The reference (``references.Recurrence``) keeps the window as an explicit list and applies
the documented rule ``||std||_2 > average_tol * ||mean||_2`` (per-coordinate sample std,
Bessel's correction); it imports nothing from aadl_func. The in-place, vmap and safeguard
combinations of ``average`` are also test_contract.py's (sets "aadl-average",
"aadl-f32-average-store2").
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from references import Recurrence

import aadl_func as aa
from aadl_func import sgd


class Feed:
    """Inner optimizer whose plain step is a prescribed point: ``grads`` carries the target.

    It makes the window explicit: the plain iterates are exactly the points fed in.
    """

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return optree.tree_map(torch.sub, updates, params), state


class _Targets:
    """The reference's inner step for a feed: ``y`` is the next target (``grad`` returns it)."""

    def init(self, x):
        return None

    def step(self, x, target, state):
        return target, state


def np_run(targets, *, depth, tol, relaxation=1.0, wait=0, store=1, freq=1):
    """The steps of the ``anderson`` docstring (``references.Recurrence``) for a feed inner;
    returns (outputs, decisions)."""
    feed = iter(targets)
    reference = Recurrence(
        lambda x: next(feed),
        _Targets(),
        history_depth=depth,
        relaxation=relaxation,
        wait_iterations=wait,
        store_each_nth=store,
        frequency=freq,
        average=True,
        average_tol=tol,
    )
    return reference.run(np.zeros_like(targets[0]), len(targets))


def noisy_targets(n, steps, seed):
    """Points around a fixed centre whose scatter comes and goes (spread above and below tol)."""
    rng = np.random.default_rng(seed)
    centre = 1.0 + rng.random(n)
    scales = np.where(np.arange(steps) % 7 < 3, 0.01, 0.4)
    return [centre + s * rng.standard_normal(n) for s in scales]


@pytest.mark.parametrize(
    "config",
    [
        dict(depth=3, tol=0.1, wait=10**6),
        dict(depth=5, tol=0.1),
        dict(depth=6, tol=0.2, store=2, relaxation=0.5),
        dict(depth=4, tol=0.2, freq=3),
    ],
)
def test_average_matches_reference(config):
    n, steps = 9, 22
    targets = noisy_targets(n, steps, seed=config["depth"])
    expected, decisions = np_run(targets, **config)
    assert "average" in decisions and ("mix" in decisions or config.get("wait"))
    assert decisions.count("average") < steps - 1

    opt = aa.anderson(
        Feed(),
        history_depth=config["depth"],
        average=True,
        average_tol=config["tol"],
        relaxation=config.get("relaxation", 1.0),
        wait_iterations=config.get("wait", 0),
        store_each_nth=config.get("store", 1),
        frequency=config.get("freq", 1),
    )
    params = [torch.zeros(n, dtype=torch.float64)]
    state = opt.init(params)
    for k, target in enumerate(targets):
        params, state = opt.update(state, params, [torch.tensor(target)])
        np.testing.assert_allclose(params[0].numpy(), expected[k], rtol=1e-9, atol=1e-12)
    assert int(state.num_averaged) == decisions.count("average")
    assert int(state.num_mixed) == decisions.count("mix")


def test_average_pytree_float32_channels_last():
    """A dict of a channels_last conv weight and a bias in float32, window wrapping around."""
    rng = np.random.default_rng(1)
    shapes = {"w": (4, 3, 2, 2), "b": (4,)}
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
    n, steps, depth, tol = sum(sizes.values()), 16, 4, 0.1
    targets = [t.astype(np.float32).astype(np.float64) for t in noisy_targets(n, steps, seed=2)]
    expected, decisions = np_run(targets, depth=depth, tol=tol, wait=10**6)
    assert 0 < decisions.count("average") < steps - 1

    def split(flat):
        w = torch.tensor(flat[: sizes["w"]], dtype=torch.float32).reshape(shapes["w"])
        w = w.contiguous(memory_format=torch.channels_last)
        return {"w": w, "b": torch.tensor(flat[sizes["w"] :], dtype=torch.float32)}

    opt = aa.anderson(Feed(), history_depth=depth, average=True, wait_iterations=10**6)
    params = split(rng.standard_normal(n))
    state = opt.init(params)
    for k, target in enumerate(targets):
        params, state = opt.update(state, params, split(target))
        assert params["w"].is_contiguous(memory_format=torch.channels_last)
        assert params["w"].dtype == torch.float32
        got = np.concatenate([params["w"].numpy().reshape(-1), params["b"].numpy()])
        np.testing.assert_allclose(got, expected[k], rtol=2e-6, atol=1e-6)
    assert int(state.num_averaged) == decisions.count("average")


def test_average_vmap_matches_loop():
    """Members with little and much scatter decide differently; vmap equals the loop."""
    n, steps, members = 6, 10, 3
    rng = np.random.default_rng(4)
    centre = 1.0 + rng.random((members, 1, n))
    scale = np.array([0.01, 0.5, 0.17])[:, None, None]
    targets = torch.tensor(centre + scale * rng.standard_normal((members, steps, n)))
    opt = aa.anderson(Feed(), history_depth=4, average=True, relaxation=0.8)

    x = torch.zeros(members, n, dtype=torch.float64)
    state = torch.func.vmap(opt.init)([x])
    outs = []
    for k in range(steps):
        (xb,), state = torch.func.vmap(opt.update)(state, [x], [targets[:, k]])
        x = xb
        outs.append((x.clone(), state.num_averaged.clone()))
    counts = []
    for i in range(members):
        xi = [torch.zeros(n, dtype=torch.float64)]
        si = opt.init(xi)
        for k in range(steps):
            xi, si = opt.update(si, xi, [targets[i, k]])
            torch.testing.assert_close(outs[k][0][i], xi[0], rtol=1e-10, atol=1e-12)
            assert int(outs[k][1][i]) == int(si.num_averaged)
        counts.append(int(si.num_averaged))
    assert counts[0] == 0 and counts[1] == steps - 1 and len(set(counts)) == 3


def test_average_skips_the_mix_and_its_loss_evaluations():
    """When the rule applies the mean is returned, no loss is evaluated, the window keeps the
    plain iterate; otherwise the safeguarded mix proceeds."""
    n = 5
    targets = [torch.full((n,), 1.0), torch.full((n,), 3.0), torch.full((n,), 2.0)]
    calls = []
    loss_fn = lambda p: calls.append(1) or p[0].square().sum()
    opt = aa.anderson(Feed(), history_depth=3, average=True, average_tol=0.1)
    params = [torch.zeros(n, dtype=torch.float64)]
    state = opt.init(params)
    for t in targets:
        params, state = opt.update(state, params, [t.double()], loss_fn=loss_fn)
    # Window (1, 3, 2): mean 2, std 1, relative spread 0.5 > 0.1.
    torch.testing.assert_close(params[0], torch.full((n,), 2.0, dtype=torch.float64))
    assert calls == [] and int(state.num_averaged) == 2 and int(state.num_mixed) == 0
    torch.testing.assert_close(state.anchor[0], torch.full((n,), 2.0, dtype=torch.float64))
    # A tolerance above the spread: no averaging, the mix is evaluated by the safeguard.
    opt = aa.anderson(Feed(), history_depth=3, average=True, average_tol=0.8)
    params = [torch.zeros(n, dtype=torch.float64)]
    state = opt.init(params)
    for t in targets:
        params, state = opt.update(state, params, [t.double()], loss_fn=loss_fn)
    assert int(state.num_averaged) == 0 and len(calls) == 2


def test_average_with_gradient_descent_reference():
    """average=True with a real inner optimizer (SGD) on a noisy quadratic."""
    n, lr, steps, depth, tol = 8, 0.1, 20, 5, 0.1
    rng = np.random.default_rng(6)
    A = np.diag(np.linspace(1.0, 4.0, n))
    b = 1.0 + rng.random(n)
    noise = 0.4 * rng.standard_normal((steps, n))

    calls = iter(range(steps))  # the gradient is evaluated once per call

    def gradient(x):
        return A @ x - b + noise[next(calls)]

    reference = Recurrence(
        gradient, lr, history_depth=depth, relaxation=0.5, average=True, average_tol=tol
    )
    expected, decisions = reference.run(np.zeros(n), steps)
    assert "average" in decisions and "mix" in decisions

    At, bt, noise_t = torch.tensor(A), torch.tensor(b), torch.tensor(noise)
    opt = aa.anderson(sgd(lr), history_depth=depth, relaxation=0.5, average=True, average_tol=tol)
    xt = torch.zeros(n, dtype=torch.float64)
    state = opt.init(xt)
    for k in range(steps):
        xt, state = opt.update(state, xt, At @ xt - bt + noise_t[k])
        np.testing.assert_allclose(xt.numpy(), expected[k], rtol=1e-9, atol=1e-12)
    assert int(state.num_averaged) == decisions.count("average")


def test_classic_mode_rejects_average():
    # Rejected at construction, like every other invalid option.
    with pytest.raises(ValueError, match="`average=True` is defined for mode='aadl' only"):
        aa.anderson(sgd(0.1), mode="classic", average=True)

"""`anderson(..., line_search=True)`: the backtracking search along the mix (N-GMRES's step)
against a float64 NumPy reference of its recurrence, with SciPy's Armijo search and the
analytic gradient (not torch's forward mode) for phi'(0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize._linesearch import scalar_search_armijo

import aadl_func as aa

LR = 1e-3


def rosenbrock_np(x: np.ndarray) -> float:
    return float(np.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2))


def rosenbrock_grad_np(x: np.ndarray) -> np.ndarray:
    g = np.zeros_like(x)
    t = x[1:] - x[:-1] ** 2
    g[:-1] += -400.0 * x[:-1] * t - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * t
    return g


def rosenbrock(params: dict) -> torch.Tensor:
    x = params["x"]
    return (100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2).sum()


def reference_classic(x0: np.ndarray, steps: int, depth: int) -> tuple[list, int]:
    """Type-II AA on the gradient step g(x) = x - LR grad f(x), its mix searched from y = g(x)
    along x_mix - y by SciPy's Armijo (c1 = 1e-4, amin = 1e-2), phi'(0) = grad f(y).d; a
    direction that does not descend or a failed search keeps y and restarts the window
    from its newest pair."""
    x, pairs, iterates, rejected = x0.copy(), [], [], 0
    for _ in range(steps):
        y = x - LR * rosenbrock_grad_np(x)
        pairs = [*pairs, (x.copy(), y - x)][-depth:]
        out = y
        if len(pairs) >= 2:
            xs = np.stack([p[0] for p in pairs], 1)
            fs = np.stack([p[1] for p in pairs], 1)
            df = fs[:, 1:] - fs[:, :-1]
            gamma = np.linalg.lstsq(df, fs[:, -1], rcond=None)[0]
            alpha = np.diff(np.concatenate([[0.0], gamma, [1.0]]))
            mix = (xs + fs) @ alpha
            d = mix - y
            derphi0 = float(rosenbrock_grad_np(y) @ d)
            s = None
            if derphi0 < 0:
                s, _ = scalar_search_armijo(
                    lambda t, y=y, d=d: rosenbrock_np(y + t * d),
                    rosenbrock_np(y),
                    derphi0,
                    amin=1e-2,
                )
            if s is None:
                rejected += 1
                pairs = pairs[-1:]
            else:
                out = y + s * d
        x = out
        iterates.append(x.copy())
    return iterates, rejected


def run(mode: str, steps: int, depth: int, inplace: bool = False, **options) -> tuple:
    opt = aa.anderson(aa.sgd(LR), mode=mode, history_depth=depth, line_search=True, **options)
    params = {"x": torch.tensor([-1.2, 1.0, -0.5, 0.8], dtype=torch.float64)}
    state = opt.init(params)
    iterates = []
    for _ in range(steps):
        grads = torch.func.grad(rosenbrock)(params)
        params, state = opt.update(state, params, grads, loss_fn=rosenbrock, inplace=inplace)
        iterates.append(params["x"].clone().numpy())
    return iterates, state


@pytest.mark.parametrize("depth", [3, 5])
def test_classic_line_search_follows_the_reference(depth):
    ours, state = run("classic", 40, depth)
    ref, rejected = reference_classic(np.array([-1.2, 1.0, -0.5, 0.8]), 40, depth)
    for k, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=f"iterate {k + 1}")
    # The run exercises both outcomes: kept points and restarts.
    assert int(state.num_rejected) == rejected > 0
    assert int(state.num_mixed) > 0


def test_line_search_beats_plain_steps_and_the_binary_safeguard_here():
    """On Rosenbrock from the usual start, 40 calls: the searched mix lowers the loss more
    than plain gradient steps and than keeping or dropping the mix whole."""
    searched, _ = run("classic", 40, 5)
    opt = aa.anderson(aa.sgd(LR), mode="classic", history_depth=5)
    params = {"x": torch.tensor([-1.2, 1.0, -0.5, 0.8], dtype=torch.float64)}
    state = opt.init(params)
    plain = params["x"].numpy().copy()
    for _ in range(40):
        params, state = opt.update(
            state, params, torch.func.grad(rosenbrock)(params), loss_fn=rosenbrock
        )
        plain = plain - LR * rosenbrock_grad_np(plain)
    assert rosenbrock_np(searched[-1]) < rosenbrock({"x": params["x"]}).item()
    assert rosenbrock_np(searched[-1]) < rosenbrock_np(plain)


def test_aadl_line_search_returns_plain_steps_or_armijo_points():
    """Mode "aadl": every returned point is the plain step y or lies along a descent
    direction from y with Armijo's sufficient decrease, f(out) <= f(y) + c1 grad f(y).(out - y)."""
    opt = aa.anderson(aa.sgd(LR), history_depth=5, line_search=True)
    params = {"x": torch.tensor([-1.2, 1.0, -0.5, 0.8], dtype=torch.float64)}
    state = opt.init(params)
    searched = 0
    for _ in range(40):
        x = params["x"].numpy().copy()
        y = x - LR * rosenbrock_grad_np(x)
        grads = torch.func.grad(rosenbrock)(params)
        params, state = opt.update(state, params, grads, loss_fn=rosenbrock)
        out = params["x"].numpy()
        if np.allclose(out, y, rtol=0, atol=1e-15):
            continue
        searched += 1
        slope = float(rosenbrock_grad_np(y) @ (out - y))
        assert slope < 0
        assert rosenbrock_np(out) <= rosenbrock_np(y) + 1e-4 * slope + 1e-15
    assert searched > 0 and int(state.num_mixed) == searched


@pytest.mark.parametrize("mode", ["classic", "aadl"])
def test_in_place_gives_the_pure_bits(mode):
    pure, s1 = run(mode, 25, 4)
    inplace, s2 = run(mode, 25, 4, inplace=True)
    for a, b in zip(pure, inplace):
        assert np.array_equal(a, b)
    assert int(s1.num_rejected) == int(s2.num_rejected)


def test_float32_follows_float64_reference_loosely():
    """float32 params: the same decisions on this run (a coarse check of the dtype path)."""
    opt = aa.anderson(aa.sgd(LR), mode="classic", history_depth=3, line_search=True)
    params = {"x": torch.tensor([-1.2, 1.0, -0.5, 0.8], dtype=torch.float32)}
    state = opt.init(params)
    for _ in range(15):
        params, state = opt.update(
            state, params, torch.func.grad(rosenbrock)(params), loss_fn=rosenbrock
        )
    ref, _ = reference_classic(np.array([-1.2, 1.0, -0.5, 0.8]), 15, 3)
    assert params["x"].dtype == torch.float32
    np.testing.assert_allclose(params["x"].numpy(), ref[-1], rtol=1e-3, atol=1e-4)


def test_refusals_name_the_argument_and_change_nothing():
    opt = aa.anderson(aa.sgd(LR), mode="classic", line_search=True)
    params = {"x": torch.ones(4, dtype=torch.float64)}
    state = opt.init(params)
    grads = {"x": torch.ones(4, dtype=torch.float64)}
    with pytest.raises(ValueError, match="line_search=True` needs `loss_fn`"):
        opt.update(state, params, grads)
    with pytest.raises(ValueError, match="line_search=True` needs an eager call"):
        torch.func.vmap(lambda s, p, g: opt.update(s, p, g, loss_fn=rosenbrock))(
            torch.func.vmap(opt.init)({"x": torch.ones(2, 4, dtype=torch.float64)}),
            {"x": torch.ones(2, 4, dtype=torch.float64)},
            {"x": torch.ones(2, 4, dtype=torch.float64)},
        )
    assert int(state.count) == 0
    with pytest.raises(TypeError, match="line_search"):
        aa.anderson(aa.sgd(LR), line_search="yes")


def test_the_wrapper_refuses_it_by_name():
    """A closure writes candidates into the module's parameters, through which no forward-mode
    derivative flows: the torch.optim faces refuse the option at construction."""
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="line_search=True` is available in the functional API"):
        aa.AcceleratedOptimizer(torch.optim.SGD(params, lr=0.1), line_search=True)
    with pytest.raises(ValueError, match="line_search=True` is available in the functional API"):
        aa.accelerate(torch.optim.SGD(params, lr=0.1), line_search=True)
    assert not hasattr(torch.optim.SGD(params, lr=0.1), "anderson_states")

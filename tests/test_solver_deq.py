"""DEQ layers as users write them (issue 34): an ``nn.Module`` ``f(z, x)``, closed-over
parameters refused, forward non-convergence reported, and the phantom / Jacobian-free
gradient. References: plain autograd through unrolled iterations, central finite
differences, and the exact implicit gradient."""

from __future__ import annotations

import pytest
import torch
from test_solver import TIGHT, deq_layer, loss_of
from torch.func import grad

import aadl_func as aa

D = torch.float64


class Layer(torch.nn.Module):
    """z = tanh(W z + U x + b), ||W||_2 = 0.7: the usual DEQ cell, parameters inside."""

    def __init__(self, n=6, d=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(n, n, generator=g, dtype=D)
        self.W = torch.nn.Parameter(0.7 * W / torch.linalg.matrix_norm(W, 2))
        self.U = torch.nn.Linear(d, n, dtype=D)
        with torch.no_grad():
            self.U.weight.copy_(torch.randn(n, d, generator=g, dtype=D))
            self.U.bias.copy_(torch.randn(n, generator=g, dtype=D))

    def forward(self, z, x):
        return torch.tanh(z @ self.W.T + self.U(x))


def unrolled(layer, x, steps=150):
    z = torch.zeros(x.shape[0], 6, dtype=D)
    for _ in range(steps):
        z = layer(z, x)
    return z


def test_module_parameters_get_the_implicit_gradient():
    """The module itself as ``f``: its parameters' ``.grad`` equal autograd through 150
    plain iterations (0.7^150 ~ 1e-23) and central finite differences."""
    layer = Layer()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    z, info = aa.implicit_fixed_point(layer, torch.zeros(4, 6, dtype=D), x, **TIGHT)
    assert bool(info.converged)
    loss_of(z).backward()
    ours = {k: p.grad.clone() for k, p in layer.named_parameters()}
    layer.zero_grad()
    loss_of(unrolled(layer, x)).backward()
    for k, p in layer.named_parameters():
        torch.testing.assert_close(ours[k], p.grad, rtol=0, atol=1e-7)
    params = dict(layer.named_parameters())

    def loss_at(name, index, delta):
        with torch.no_grad():
            params[name][index] += delta
            z, _ = aa.implicit_fixed_point(layer, torch.zeros(4, 6, dtype=D), x, **TIGHT)
            params[name][index] -= delta
        return float(loss_of(z))

    eps = 1e-6
    for name, index in (("W", (1, 2)), ("U.weight", (0, 1)), ("U.bias", (3,))):
        fd = (loss_at(name, index, eps) - loss_at(name, index, -eps)) / (2 * eps)
        assert abs(fd - float(ours[name][index])) <= 1e-7


def test_closed_over_parameters_are_refused_and_calls_are_counted():
    """A lambda around the module would leave its parameters without a gradient: refused
    before any solve, naming the fix. Under no_grad nothing is recorded, so nothing is
    checked. The check's evaluation is the solve's first: calls of f == info.evaluations."""
    layer = Layer()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    z0 = torch.zeros(4, 6, dtype=D)
    with pytest.raises(
        ValueError, match="implicit_fixed_point: f\\(z, theta\\) depends on a tensor"
    ):
        aa.implicit_fixed_point(lambda z, x: layer(z, x), z0, x, **TIGHT)
    with torch.no_grad():
        aa.implicit_fixed_point(lambda z, x: layer(z, x), z0, x, **TIGHT)
    calls = []
    counted_layer = Counted(layer, calls)
    _, info = aa.implicit_fixed_point(counted_layer, z0, x, **TIGHT)
    assert int(info.evaluations) == len(calls) > 3


class Counted(torch.nn.Module):
    def __init__(self, layer, calls):
        super().__init__()
        self.layer, self.calls = layer, calls

    def forward(self, z, x):
        self.calls.append(1)
        return self.layer(z, x)


def test_forward_nonconvergence_is_reported():
    f, theta = deq_layer()
    z0 = torch.zeros(6, dtype=D)
    with pytest.warns(
        RuntimeWarning, match="forward fixed point z\\* = f\\(z\\*, theta\\) did not converge"
    ):
        _, info = aa.implicit_fixed_point(f, z0, theta, tol=0.0, max_iter=2)
    assert info.reason == "max_iter"
    with pytest.raises(RuntimeError, match="forward fixed point"):
        aa.implicit_fixed_point(f, z0, theta, tol=0.0, max_iter=2, on_nonconvergence="raise")
    _, info = aa.implicit_fixed_point(f, z0, theta, tol=0.0, max_iter=2, on_nonconvergence="ignore")
    assert not bool(info.converged)


def exact_gradient(f, theta):
    return grad(
        lambda th: loss_of(aa.implicit_fixed_point(f, torch.zeros(6, dtype=D), th, **TIGHT)[0])
    )(theta)


def test_phantom_gradient_is_unrolled_steps_from_z_star():
    """``gradient="phantom"``: the gradient of k recorded damped steps from z* (computed here
    with plain autograd from a tight solve's z*, an independent path); k = 1, tau = 1 is the
    Jacobian-free gradient J_theta^T dL/dz; its distance to the exact gradient shrinks like
    ||J_z||^k (<= 0.7^k)."""
    f, theta = deq_layer()
    exact = exact_gradient(f, theta)
    with torch.no_grad():
        z_star, _ = aa.fixed_point(lambda z: f(z, theta), torch.zeros(6, dtype=D), **TIGHT)
    gaps = []
    for k, tau in ((1, 1.0), (3, 0.5), (5, 1.0), (20, 1.0), (60, 1.0)):
        ours, reference = phantom_gradients(f, theta, z_star, k, tau)
        for key in theta:
            torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-12)
        if tau == 1.0:
            gap = max(float((ours[key] - exact[key]).abs().max()) for key in theta)
            scale = max(float(exact[key].abs().max()) for key in theta)
            assert gap <= 10 * scale * 0.7**k, (k, gap)
            gaps.append(gap)
    assert gaps[0] > 1e-3 and gaps[-1] < 1e-8  # the cheap one is not the exact one


def phantom_gradients(f, theta, z_star, k, tau):
    """The phantom gradient of the loss, and the same k damped steps from z* by hand."""

    def phantom(th):
        z, _ = aa.implicit_fixed_point(
            f, torch.zeros(6, dtype=D), th, gradient="phantom", phantom_steps=k,
            phantom_damping=tau, **TIGHT,
        )  # fmt: skip
        return loss_of(z)

    def by_hand(th):
        z = z_star
        for _ in range(k):
            z = (1 - tau) * z + tau * f(z, th)
        return loss_of(z)

    return grad(phantom)(theta), grad(by_hand)(theta)


def test_a_plain_fixed_point_result_hints_when_differentiated():
    """fixed_point/root record no iterations: when the map depends on a tensor that requires
    grad, backward through the result raises naming implicit_fixed_point (not torch's
    "element 0 of tensors does not require grad"); under no_grad, or when nothing requires
    grad, the result is a plain tensor as before. The check's evaluation is the solve's
    first (calls == info.evaluations)."""
    W = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), dtype=D)
    W.requires_grad_()
    calls = []

    def g(z):
        calls.append(1)
        return torch.tanh(0.3 * W @ z) + 1

    x, info = aa.fixed_point(g, torch.zeros(4, dtype=D))
    assert int(info.evaluations) == len(calls)
    with pytest.raises(
        RuntimeError, match="fixed_point: its result carries no gradient.*implicit_fixed_point"
    ):
        x.sum().backward()
    x, _ = aa.root(lambda z: g(z) - z, torch.zeros(4, dtype=D))
    with pytest.raises(RuntimeError, match="root: its result carries no gradient"):
        x.sum().backward()
    with torch.no_grad():
        x, _ = aa.fixed_point(g, torch.zeros(4, dtype=D))
    assert not x.requires_grad
    x, _ = aa.fixed_point(lambda z: torch.tanh(0.3 * W.detach() @ z), torch.zeros(4, dtype=D))
    assert not x.requires_grad and x.grad_fn is None

"""Shared helpers for the functional-core tests.

The NumPy float64 references live in ``references.py`` (no ``aadl_func`` import there); this
file holds the torch-side plumbing the tests share: a minimal inner optimizer independent of
``aadl_func``'s own, pytree <-> vector conversions, snapshots for purity checks and a small
NumPy test problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import optree
import pytest
import torch


class GradientDescent:
    """Plain gradient descent in the torchopt protocol: ``updates = -lr * grads``.

    A local stand-in for ``aadl_func.sgd`` so that these tests exercise the Anderson core
    alone; ``lr * g`` then ``x + (-lr g)`` rounds exactly like NumPy's ``x - lr * g``. It is
    pure whatever ``inplace`` says (in-place reuse is the caller's business, not ours).
    """

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return optree.tree_map(lambda g: -self.lr * g, updates), state


class MomentumDescent:
    """Heavy-ball descent with a tensor state, to put a non-trivial inner state under vmap."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum

    def init(self, params):
        return optree.tree_map(torch.zeros_like, params)

    def update(self, updates, state, params=None, inplace=False):
        buf = optree.tree_map(lambda b, g: self.momentum * b + g, state, updates)
        return optree.tree_map(lambda b: -self.lr * b, buf), buf


# Layout of the 60-vector test problem as a pytree: a dict holding a tuple, a matrix, a vector.
TREE_SHAPES = {"bias": (4,), "layer": ((4, 5), (2, 3, 4)), "weight": (12, 1)}


def vector_to_tree(x: np.ndarray, dtype: torch.dtype = torch.float64, shapes=TREE_SHAPES):
    """Splits a flat vector into a pytree shaped like ``shapes`` (optree leaf order)."""
    shape_leaves, spec = optree.tree_flatten(
        shapes, is_leaf=lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s)
    )
    out, start = [], 0
    for shape in shape_leaves:
        size = int(np.prod(shape))
        out.append(
            torch.tensor(x[start : start + size], dtype=torch.float64).reshape(shape).to(dtype)
        )
        start += size
    assert start == x.size, "vector size does not match the tree layout"
    return optree.tree_unflatten(spec, out)


def tree_to_vector(tree) -> np.ndarray:
    """Concatenates a pytree's leaves (optree order) into a float64 NumPy vector."""
    return np.concatenate(
        [leaf.detach().to(torch.float64).reshape(-1).numpy() for leaf in optree.tree_leaves(tree)]
    )


def snapshot(tree):
    """A deep copy of every tensor leaf (for bitwise before/after comparisons)."""
    return optree.tree_map(lambda t: t.detach().clone(), tree)


def assert_tree_equal(actual, expected) -> None:
    """Same structure and bitwise-equal leaves (dtype, shape and values)."""
    a_leaves, a_spec = optree.tree_flatten(actual)
    e_leaves, e_spec = optree.tree_flatten(expected)
    assert a_spec == e_spec
    for a, e in zip(a_leaves, e_leaves):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a, e)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@dataclass
class LogisticProblem:
    """L2-regularised logistic regression in NumPy float64 (loss and exact gradient).

    The feature columns are scaled over a decade, so gradient descent is slow enough that
    acceleration visibly changes the trajectory within a few dozen steps. With 60 unknowns and
    windows of <= 10 entries (or a Tikhonov ``reg``) the windows of the test configurations
    stay well conditioned over 30 steps, so the library and the ``lstsq`` reference agree to
    ~1e-10 per step; badly conditioned windows would measure the solvers' conditioning, not
    the semantics.
    """

    features: np.ndarray
    labels: np.ndarray
    l2: float

    @classmethod
    def make(cls, seed: int = 0, samples: int = 150, dim: int = 60, l2: float = 1e-3):
        rng = np.random.default_rng(seed)
        features = rng.standard_normal((samples, dim)) * np.logspace(0, -1, dim)
        labels = (rng.random(samples) < 0.5).astype(np.float64)
        return cls(features, labels, l2)

    @property
    def dim(self) -> int:
        return self.features.shape[1]

    @property
    def smoothness(self) -> float:
        """Lipschitz constant of the gradient, ``||A||^2 / (4 n) + l2``."""
        n = self.features.shape[0]
        return float(np.linalg.norm(self.features, 2) ** 2 / (4 * n) + self.l2)

    def loss(self, x: np.ndarray) -> float:
        z = self.features @ x
        return float(np.mean(np.logaddexp(0.0, z) - self.labels * z) + 0.5 * self.l2 * x @ x)

    def grad(self, x: np.ndarray) -> np.ndarray:
        z = self.features @ x
        sigma = 0.5 * (1.0 + np.tanh(0.5 * z))
        return self.features.T @ (sigma - self.labels) / len(z) + self.l2 * x


def run_problem(problem, opt, x0, steps, dtype=torch.float64, safeguard=False):
    """Runs ``opt`` on ``problem`` with pytree params (with the loss as ``loss_fn`` if
    ``safeguard``); returns the outputs, per-call mix and rejection flags, and the state."""
    params = vector_to_tree(x0, dtype)
    state = opt.init(params)
    loss_fn = None
    if safeguard:

        def loss_fn(tree):
            return torch.tensor(problem.loss(tree_to_vector(tree)), dtype=torch.float64)

    outputs, mixed, rejected = [], [], []
    for _ in range(steps):
        grads = vector_to_tree(problem.grad(tree_to_vector(params)), dtype)
        before = (int(state.num_mixed), int(state.num_rejected))
        params, state = opt.update(state, params, grads, loss_fn=loss_fn)
        outputs.append(tree_to_vector(params))
        mixed.append(int(state.num_mixed) > before[0])
        rejected.append(int(state.num_rejected) > before[1])
    return outputs, mixed, rejected, state


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def logistic() -> LogisticProblem:
    return LogisticProblem.make()


@pytest.fixture(params=["native", "torch"])
def gram_path(request):
    """Runs a test on the native Gram-row kernel and on the torch path it replaces."""
    import aadl_func as aa
    from aadl_func._src import native  # set_enabled: the one switch with no public face

    info = aa.kernel_info()
    if request.param == "native" and info["kernel"] != "native":
        pytest.skip(info["reason"])
    previous = native.set_enabled(request.param == "native")
    yield request.param
    native.set_enabled(previous)

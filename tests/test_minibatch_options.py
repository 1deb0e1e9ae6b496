"""The options of ``anderson`` for minibatch training: ``reg_relative`` and ``restart_on_reject``.

Each is checked against the float64 NumPy ``references.Recurrence``, written from the
docstring's mathematics (explicit windows, ``lstsq`` on the regularised problem, no
``aadl_func`` import), on a linear fixed-point map where every step is known in closed form:
gradient descent on the quadratic ``0.5 x^T A x - b^T x``, ``g(x) = x - lr (A x - b)``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import GradientDescent
from references import Recurrence

import aadl_func as aa

DIM = 12
LR = 0.1


def quadratic(seed: int = 0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``A`` symmetric positive definite (eigenvalues 0.2..3), ``b`` and ``x0`` (both scaled)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((DIM, DIM)))
    a = q @ np.diag(np.linspace(0.2, 3.0, DIM)) @ q.T
    return a, scale * rng.standard_normal(DIM), scale * rng.standard_normal(DIM)


# -- the NumPy reference ---------------------------------------------------------------------
def reference_run(mode, a, b, x0, steps, depth, relaxation, reg, reg_relative, accept=None,
                  restart=False):  # fmt: skip
    """``references.Recurrence`` with gradient descent on the quadratic. ``accept``: for each
    mixing call, whether the safeguard keeps the mix (None: no safeguard). ``restart``: a
    rejected mix leaves only the newest entry (pair). Returns the params after each call."""
    reference = Recurrence(
        lambda x: a @ x - b,
        LR,
        mode=mode,
        history_depth=depth,
        relaxation=relaxation,
        reg=reg,
        reg_relative=reg_relative,
        restart_on_reject=restart,
    )
    return reference.run(x0, steps, accept=accept)[0]


# -- the library, on the same problem ---------------------------------------------------------
def run_library(a, b, x0, steps, accept=None, **options):
    """``anderson(GradientDescent(LR), **options)`` in float64; ``accept`` as above, through a
    ``loss_fn`` that scores the mix (first call of a pair) 0 or 1 and the plain step 0.5."""
    opt = aa.anderson(GradientDescent(LR), **options)
    params = {"x": torch.tensor(x0)}
    state = opt.init(params)
    a_t, b_t = torch.tensor(a), torch.tensor(b)
    decisions = iter(accept or [])
    calls = {"n": 0}

    def loss_fn(p):
        calls["n"] += 1
        if calls["n"] % 2 == 1:  # the mix x, then the plain step y
            return torch.tensor(0.0 if next(decisions) else 1.0, dtype=torch.float64)
        return torch.tensor(0.5, dtype=torch.float64)

    out = []
    for _ in range(steps):
        grads = {"x": a_t @ params["x"] - b_t}
        params, state = opt.update(
            state, params, grads, loss_fn=loss_fn if accept is not None else None
        )
        out.append(params["x"].numpy().copy())
    return out, state


def max_relative_error(actual, expected) -> float:
    return max(float(np.linalg.norm(u - v) / np.linalg.norm(v)) for u, v in zip(actual, expected))


# -- reg_relative -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["classic", "aadl"])
@pytest.mark.parametrize("reg_relative,reg", [(0.05, 0.0), (0.3, 1e-3)])
def test_reg_relative_matches_reference(mode, reg_relative, reg):
    a, b, x0 = quadratic()
    steps, depth, relaxation = 14, 5, 0.8
    reference = functools.partial(reference_run, mode)
    expected = reference(a, b, x0, steps, depth, relaxation, reg, reg_relative)
    actual, state = run_library(
        a, b, x0, steps, mode=mode, history_depth=depth, relaxation=relaxation, reg=reg,
        reg_relative=reg_relative,
    )  # fmt: skip
    assert int(state.num_mixed) >= steps - 3
    assert max_relative_error(actual, expected) < 1e-9
    # The weight matters: the reference without it is a different trajectory.
    unregularised = reference(a, b, x0, steps, depth, relaxation, reg, 0.0)
    assert max_relative_error(actual, unregularised) > 1e-4


def test_reg_relative_is_scale_free():
    """Scaling the problem (x0, b) by s scales every iterate by s with ``reg_relative``: the
    weight follows ||DF||^2. An absolute ``reg`` of the same size does not (it is compared
    with ||DF||^2 = s^2 times smaller at s = 1e-3)."""
    a, b, x0 = quadratic()
    s = 1e-3
    options = dict(mode="classic", history_depth=5)
    base, _ = run_library(a, b, x0, 12, reg_relative=0.2, **options)
    scaled, _ = run_library(a, s * b, s * x0, 12, reg_relative=0.2, **options)
    assert max_relative_error([v / s for v in scaled], base) < 1e-9
    # Control: the absolute reg is not scale free (so the check above can fail).
    base_abs, _ = run_library(a, b, x0, 12, reg=0.05, **options)
    scaled_abs, _ = run_library(a, s * b, s * x0, 12, reg=0.05, **options)
    assert max_relative_error([v / s for v in scaled_abs], base_abs) > 1e-3


def test_reg_relative_zero_is_the_default():
    a, b, x0 = quadratic()
    options = dict(mode="classic", history_depth=4, reg=1e-3)
    default, _ = run_library(a, b, x0, 8, **options)
    zero, _ = run_library(a, b, x0, 8, reg_relative=0.0, **options)
    for u, v in zip(default, zero):
        assert np.array_equal(u, v)


# -- restart_on_reject ------------------------------------------------------------------------
ACCEPT = [True, True, False, True, True, False, False, True, True, True, True, True]


@pytest.mark.parametrize("mode", ["classic", "aadl"])
@pytest.mark.parametrize("restart", [True, False])
def test_restart_on_reject_matches_reference(mode, restart):
    a, b, x0 = quadratic(seed=1)
    steps, depth = 12, 5
    reference = functools.partial(reference_run, mode)
    # Mixing calls: classic from call 2 (2 pairs), aadl from call 3 (3 entries); a restart
    # postpones the next ones until the window has grown back.
    expected = reference(a, b, x0, steps, depth, 1.0, 1e-6, 0.0, accept=ACCEPT, restart=restart)
    actual, state = run_library(
        a, b, x0, steps, accept=ACCEPT, mode=mode, history_depth=depth, reg=1e-6,
        restart_on_reject=restart,
    )  # fmt: skip
    assert int(state.num_rejected) >= 2
    assert max_relative_error(actual, expected) < 1e-9
    # The restart changes the trajectory: the other reference is far off.
    other = reference(a, b, x0, steps, depth, 1.0, 1e-6, 0.0, accept=ACCEPT, restart=not restart)
    assert max_relative_error(actual, other) > 1e-4


def test_restart_cuts_the_window_to_one_entry():
    a, b, x0 = quadratic()
    opts = dict(mode="classic", history_depth=4, reg=1e-6)
    _, state = run_library(a, b, x0, 5, accept=[True, True, True, False], **opts)
    assert int(state.window_size) == 4  # without the option, the window stays full
    _, state = run_library(a, b, x0, 5, accept=[True, True, True, False], restart_on_reject=True,
                           **opts)  # fmt: skip
    assert int(state.window_size) == 1 and int(state.num_rejected) == 1
    # Without loss_fn nothing is rejected, so the option changes nothing.
    plain, _ = run_library(a, b, x0, 8, **opts)
    with_option, _ = run_library(a, b, x0, 8, restart_on_reject=True, **opts)
    for u, v in zip(plain, with_option):
        assert np.array_equal(u, v)


# -- argument checks --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,error,words",
    [
        (dict(reg_relative=-0.1), ValueError, "reg_relative"),
        (dict(reg_relative=float("nan")), ValueError, "reg_relative"),
        (dict(reg_relative="0.1"), TypeError, "reg_relative"),
        (dict(reg_relative=True), TypeError, "reg_relative"),
        (dict(restart_on_reject=1), TypeError, "restart_on_reject"),
        (dict(restart_on_reject=None), TypeError, "restart_on_reject"),
    ],
)
def test_bad_options_are_rejected(options, error, words):
    with pytest.raises(error, match=words):
        aa.anderson(aa.adam(), **options)


def test_wrapper_takes_the_options():
    model = torch.nn.Linear(3, 1)
    optimizer = aa.AcceleratedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), reg_relative=0.1, restart_on_reject=True
    )
    x = torch.randn(8, 3)
    for _ in range(4):

        def closure():
            optimizer.zero_grad()
            loss = (model(x) ** 2).mean()
            loss.backward()
            return loss

        optimizer.step(closure)
    assert int(optimizer.anderson_states[0].count) == 4

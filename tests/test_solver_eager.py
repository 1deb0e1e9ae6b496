"""The eager loop's own window (``aadl_func/_src/solver_eager.py``) against the core's update.

The eager solve of one problem runs the solver's own Anderson window; the core's
``aadl_func.anderson`` update (the masked loop's, and the eager loop's for options the window
does not implement) is the reference: the same recurrence, written for training steps and
checked against NumPy and SciPy on its own (test_contract.py, test_solver.py). ``test_solver.py``
also replays SciPy's steps from the eager loop's iterates. Here: float64 every iterate within
1e-12 of the core's over the options the window implements, float32 within a bound derived
from the recurrence's own sensitivity, the fallbacks (a non-finite mix, an overflowing Gram row,
fewer coordinates than pairs) and which solves take the window.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_solver import contraction
from test_solver_batched import OPTION_SETS as BATCHED_SETS
from test_solver_batched import sensitivity_bounds
from test_solver_options import recorded

import aadl_func as aa
from aadl_func._src import solver_eager, solver_options

D = torch.float64

# The batched route's option sets, less its per-sample tolerances (one problem here).
OPTION_SETS = {k: v for k, v in BATCHED_SETS.items() if k != "rtol and gtol per sample"}


def tanh_map(n=7, dtype=D):
    W, c = contraction(n=n, scale=0.9)
    W, c = W.to(dtype), c.to(dtype)
    return lambda x: torch.tanh(W @ x + c)


def through_core(monkeypatch):
    """Makes every solve take the core's update (the window is never chosen)."""
    monkeypatch.setattr(solver_eager, "supports", lambda *args: False)


def both(monkeypatch, solve, fn, x0, **options):
    """``solve`` by the window and by the core's update: ``(window, core)``, each
    ``(x, info, iterates)``."""
    window = recorded(solve, fn, x0, **options)
    with monkeypatch.context() as patch:
        through_core(patch)
        core = recorded(solve, fn, x0, **options)
    return window, core


@pytest.mark.parametrize("kind", ["fixed_point", "root"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_float64_every_iterate_equals_the_core_update(kind, name, monkeypatch):
    """Every iterate within 1e-12 (2-norm; the iterates' norms are about 2) of the core's,
    with the same iterations, evaluations and status."""
    g = tanh_map()
    if kind == "fixed_point":
        solve, fn = aa.fixed_point, g
    else:
        solve, fn = aa.root, lambda x: g(x) - x
    options = {"tol": 1e-11, "max_iter": 60, **OPTION_SETS[name]}
    (x, info, mine), (y, core_info, theirs) = both(
        monkeypatch, solve, fn, torch.zeros(7, dtype=D), **options
    )
    assert int(info.iterations) >= 6  # (reg's root does not reach 1e-11 in 60 steps)
    for field in ("iterations", "evaluations", "status", "returned_iteration"):
        assert int(getattr(info, field)) == int(getattr(core_info, field)), field
    assert mine.keys() == theirs.keys()
    worst = max(float((mine[k] - theirs[k]).norm()) for k in mine)
    assert worst <= 1e-12, worst
    torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_the_comparison_has_teeth(monkeypatch):
    """A window that drops its oldest pair from the solve is caught by the comparison."""
    slots = solver_eager.EagerWindow._slots
    monkeypatch.setattr(
        solver_eager.EagerWindow,
        "_slots",
        lambda self: slots(self)[1:] if self.size > 2 else slots(self),
    )
    with pytest.raises(AssertionError):
        test_float64_every_iterate_equals_the_core_update("fixed_point", "defaults", monkeypatch)


def test_pytree_root_with_alpha_and_fewer_coordinates_than_pairs(monkeypatch):
    """Two leaves of different shapes (one flat window over both), SciPy's alpha, and a
    3-dimensional problem with 6 pairs (the QR factor of a 3 x s matrix has fewer rows
    than columns: the window squares it with zero rows)."""
    W, c = contraction(n=7, scale=0.8)

    def F(x):
        flat = torch.cat([x["a"].reshape(-1), x["b"]])
        out = torch.tanh(W @ flat + c) - flat
        return {"a": out[:4].reshape(2, 2), "b": out[4:]}

    x0 = {"a": torch.zeros(2, 2, dtype=D), "b": torch.zeros(3, dtype=D)}
    x, info = aa.root(F, x0, alpha=0.5, tol=1e-11)
    with monkeypatch.context() as patch:
        through_core(patch)
        y, core_info = aa.root(F, x0, alpha=0.5, tol=1e-11)
    assert bool(info.converged) and int(info.iterations) == int(core_info.iterations)
    for key in x:
        torch.testing.assert_close(x[key], y[key], rtol=0, atol=1e-12)
    small = tanh_map(n=3)
    (x, info, _), (y, core_info, _) = both(
        monkeypatch, aa.fixed_point, small, torch.zeros(3, dtype=D), tol=1e-12
    )
    assert bool(info.converged) and int(info.iterations) == int(core_info.iterations)
    torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["defaults", "reg", "reg_relative", "AA(1)"])
def test_float32_within_the_sensitivity_bound(name, monkeypatch):
    """float32, 8 steps (before the residual reaches float32's rounding): every iterate
    within ``sensitivity_bounds`` of the core's, with ``delta = (2Q + 1 + n) u``,
    ``u = 2^-24``: per step the two round differently in the combination (``2Q + 1`` terms
    summed in another order) and, through the iterate, in the map (its ``n``-term
    products); the Gram rows are exact products summed in float64 in both."""
    n = 8
    g = tanh_map(n=n, dtype=torch.float32)
    options = {"tol": 0.0, "max_iter": 8, "history_depth": 6, **OPTION_SETS[name]}
    depth = options["history_depth"]
    (_, info, mine), (_, _, theirs) = both(
        monkeypatch, aa.fixed_point, g, torch.zeros(n), **options
    )
    assert int(info.iterations) == 8 and len(theirs) == 9
    with monkeypatch.context() as patch:
        through_core(patch)
        bounds = sensitivity_bounds(
            aa.fixed_point, g, theirs, (2 * depth + 1 + n) * 2.0**-24, 0, 8, **options
        )
    worst = 0.0
    for j in range(1, 9):
        error = float((mine[j] - theirs[j]).norm())
        assert error <= bounds[j], (j, error, bounds[j])
        worst = max(worst, error / bounds[j])
    assert worst > 0  # they do round differently: the bound is in use


@pytest.mark.parametrize("kernel", [True, False])
def test_gram_rows_are_exact_products_summed_in_float64(kernel, monkeypatch):
    """The float32 window's Gram matrix of its residuals against the float64 products of the
    same float32 values (exact) summed by NumPy: within ``n`` float64 roundings of
    ``|f_t| |f_u|``, by the native kernel and by its BLAS fallback."""
    if not kernel:
        monkeypatch.setattr(solver_eager.native, "float64_dots", lambda *args: None)
    n, q = 300, 4
    window = solver_eager.EagerWindow(settings(history_depth=q), [torch.zeros(n)])
    g = torch.Generator().manual_seed(3)
    for _ in range(q + 2):  # past a full ring: every slot written, one overwritten
        window.step([torch.randn(n, generator=g)], [torch.randn(n, generator=g)])
    f = window.ring[1].double().numpy()
    exact = f @ f.T
    norms = np.linalg.norm(f, axis=1)
    bound = n * 2.0**-53 * np.outer(norms, norms)
    assert (np.abs(np.array(window.gram) - exact) <= bound).all()


@pytest.mark.parametrize("q", [2, 3, 5])
def test_float64_factor_columns_are_the_residual_differences_and_the_newest(q):
    """The rows a float64 window gathers for its QR, at every call from the first mix to
    past twice around the ring: $f_{k-s+2} - f_{k-s+1}, \\ldots, f_k - f_{k-1}, f_k$ for
    its $s$ pairs, oldest first, each difference rounded once (NumPy's float64
    subtraction of the residuals as they were passed)."""
    n = 6
    window = solver_eager.EagerWindow(settings(history_depth=q), [torch.zeros(n, dtype=D)])
    g = torch.Generator().manual_seed(q)
    passed = []
    for _ in range(2 * q + 3):
        f = torch.randn(n, generator=g, dtype=D)
        passed.append(f.numpy().copy())
        window.step([torch.randn(n, generator=g, dtype=D)], [f])
        if window.size < 2:
            continue
        newest = passed[-window.size :]
        expected = np.stack([b - a for a, b in zip(newest, newest[1:])] + [newest[-1]])
        later = window._slots()[1:]
        gathered = window.factor_rows.index_select(0, window._gather(later)).numpy()
        assert np.array_equal(gathered, expected)


def settings(**options):
    """The solver's options for ``aa.fixed_point(..., **options)``."""
    keys = ("history_depth", "relaxation", "reg", "reg_relative")
    given = {"history_depth": 3, "relaxation": 1.0, "reg": 0.0, "reg_relative": 0.0, **options}
    rest = {k: v for k, v in given.items() if k not in keys}
    return solver_options.anderson_options(
        "fixed_point", *(given[k] for k in keys), "classic", rest
    )


def test_a_mix_that_is_not_finite_takes_the_plain_step():
    """A mix that overflows float32 gives the plain step ``x + f`` and the window keeps its
    pairs (the core's rule: the mix is rejected, not the window). Residuals ``e_0`` and
    ``(1 + 2^-20) e_0``: ``gamma`` is about ``2^20``, and with a step of ``3e38`` the mix
    leaves the float32 range."""
    window = solver_eager.EagerWindow(settings(), [torch.zeros(4)])
    e0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
    x1 = window.step([torch.zeros(4)], [e0])[0]
    torch.testing.assert_close(x1, e0)  # one pair: the plain step
    x, f = torch.full((4,), 3e38), e0 * (1.0 + 2.0**-20)
    x2 = window.step([x], [f])[0]
    assert torch.equal(x2, x + f) and window.size == 2  # the pairs stay


def test_a_residual_that_is_not_finite_restarts_the_window():
    """An infinite step (the root's ``alpha`` times a residual can overflow) empties the
    window and takes the plain step; the next pairs start a new window, finite."""
    window = solver_eager.EagerWindow(settings(history_depth=4), [torch.zeros(3)])
    x = window.step([torch.zeros(3)], [torch.ones(3)])
    bad = torch.tensor([math.inf, 1.0, 1.0])
    out = window.step(x, [bad])[0]
    assert window.size == 0 and torch.equal(out, x[0] + bad)
    window.step([torch.zeros(3)], [torch.ones(3)])
    assert window.size == 1 and all(math.isfinite(v) for row in window.gram for v in row)


@pytest.mark.parametrize(
    ("options", "x0", "taken"),
    [
        ({}, torch.zeros(3, dtype=D), True),
        ({}, torch.zeros(3), True),
        ({"history_depth": 2, "reg": 1e-3, "relaxation": 0.5}, torch.zeros(3), True),
        ({"mode": "aadl"}, torch.zeros(3, dtype=D), False),
        ({"history_dtype": torch.float32}, torch.zeros(3, dtype=D), False),
        ({"reg_column": 1e-2}, torch.zeros(3, dtype=D), False),
        ({"skip_nonfinite": True}, torch.zeros(3, dtype=D), False),
        ({}, torch.zeros(3, dtype=torch.complex128), False),
        ({}, torch.zeros(3, dtype=torch.bfloat16), False),
        ({}, {"a": torch.zeros(2), "b": torch.zeros(2, dtype=D)}, False),  # mixed dtypes
    ],
)
def test_which_solves_take_the_window(options, x0, taken, monkeypatch):
    """The window takes real float32/float64 CPU leaves of one dtype with the options it
    implements; everything else keeps the core's update, whose results it then gives bit for
    bit."""
    made = []
    window = solver_eager.EagerWindow
    monkeypatch.setattr(solver_eager, "EagerWindow", lambda *a: made.append(1) or window(*a))

    def g(x):
        return (
            x.__class__({k: 0.5 * v + 1 for k, v in x.items()})
            if isinstance(x, dict)
            else 0.5 * x + 1
        )

    aa.fixed_point(g, x0, tol=1e-8, **options)
    assert bool(made) == taken
    # masked loops and per-sample batches never take it
    made.clear()
    if not isinstance(x0, dict) and not x0.is_complex() and taken:
        aa.fixed_point(g, x0, tol=1e-8, masked=True, **options)
        aa.fixed_point(g, x0[None], tol=1e-8, batch_dims=1, **options)
        assert not made

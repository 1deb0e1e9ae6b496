"""The solver's batches, depth one, counts, best iterate and stopping tests (issue 34).

References are independent of the code under test: SciPy's ``scipy.optimize.anderson``
(``nonlin_solve`` with ``Anderson(M=1)``), eager solves of one problem at a time, and NumPy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_solver import PROBLEMS, assert_scipy_steps, contraction, our_iterates, scipy_solve
from torch.func import vmap
from window_invariant import dot_roundoff

import aadl_func as aa

D = torch.float64


# -- a. vmap over a start point batched outside ----------------------------------------------
def test_vmap_over_x0_batched_outside():
    """x0 comes in batched (a warm start per sample), the two ways a user writes it: as a
    vmapped argument beside the per-sample data, and as the only batched argument of a solve
    whose map is shared; also a pytree x0. Each member equals its own eager solve. (Before
    issue 34 the aliasing check read ``data_ptr()`` of the batched tensor and raised.)"""
    W, _ = contraction(n=5)
    C = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=D)
    X0 = torch.randn(4, 5, generator=torch.Generator().manual_seed(2), dtype=D)

    def solve(c, x0):
        return aa.fixed_point(lambda x: torch.tanh(W @ x) + c, x0, tol=1e-11)

    xs, infos = vmap(solve)(C, X0)
    shared = vmap(solve, in_dims=(None, 0))(C[0], X0)
    tree = vmap(
        lambda x0: aa.fixed_point(
            lambda x: {"a": torch.tanh(W @ x["a"]) + C[0]}, {"a": x0}, tol=1e-11
        )
    )(X0)
    for i in range(4):
        x, info = solve(C[i], X0[i])
        assert int(infos.iterations[i]) == int(info.iterations) and bool(infos.converged[i])
        torch.testing.assert_close(xs[i], x, rtol=0, atol=1e-12)
        x, info = solve(C[0], X0[i])
        assert int(shared[1].iterations[i]) == int(info.iterations)
        torch.testing.assert_close(shared[0][i], x, rtol=0, atol=1e-12)
        torch.testing.assert_close(tree[0]["a"][i], x, rtol=0, atol=1e-12)


# -- b. depth one: AA(1), SciPy's M = 1 -------------------------------------------------------
@pytest.mark.parametrize("name", ["F", "F2", "F3", "F6"])
def test_depth_one_is_scipys_m_one(name):
    """``history_depth=2`` (two pairs, one difference) is SciPy's ``Anderson(M=1)``: the same
    step count and each step SciPy's replayed from our iterates, to the derived bound of
    ``test_solver.assert_scipy_steps``, w0 = 0, no line search (SciPy's own solver on the
    same torch functions; 11 to 55 steps). On F5 and the
    linear system AA(1) diverges or stalls in both libraries alike."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    theirs, ok, singular = scipy_solve(
        fn, x0, nonlin.Anderson(M=1, w0=0), f_tol=1e-8, maxiter=300, line_search=None
    )
    ours, info = our_iterates(fn, x0, history_depth=2, tol=1e-8, max_iter=300)
    assert ok and not singular and bool(info.converged)
    assert len(ours) == len(theirs) == int(info.iterations) >= 2
    assert_scipy_steps(fn, x0, ours, lambda: nonlin.Anderson(M=1, w0=0), 2)


def test_depth_one_fixed_point_and_masked_loop():
    """AA(1) on a fixed point: eager and masked (vmap) loops agree, and it beats plain
    iteration's step count on a slowly contracting linear map (the secant of one difference
    is exact on the slowest mode's 1-dimensional direction)."""
    W, c = contraction(n=8, scale=0.95)
    g = lambda x: W @ x + c  # noqa: E731
    x0 = torch.zeros(8, dtype=D)
    x, info = aa.fixed_point(g, x0, tol=1e-10, history_depth=2, max_iter=500)
    xm, im = aa.fixed_point(g, x0, tol=1e-10, history_depth=2, max_iter=500, masked=True)
    assert bool(info.converged) and int(im.iterations) == int(info.iterations)
    torch.testing.assert_close(xm, x, rtol=1e-13, atol=0)  # two windows: rounding apart
    exact = torch.linalg.solve(torch.eye(8, dtype=D) - W, c)
    torch.testing.assert_close(x, exact, rtol=0, atol=1e-8)


# -- c. every call of g / F is counted --------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("alpha", [None, 0.5])
@pytest.mark.parametrize("line_search", [None, True])
def test_evaluations_count_every_call(alpha, line_search, masked):
    """``info.evaluations`` equals the calls of F, also with SciPy's alpha rule (whose F(x0)
    was not counted before issue 34: 19 calls, 18 reported) and with the line search."""
    if masked and line_search:
        return
    fn, x0 = PROBLEMS["F"]
    calls = []

    def counted(x):
        calls.append(1)
        return fn(x)

    x, info = aa.root(
        counted, torch.tensor(x0, dtype=D), alpha=alpha, tol=1e-8, line_search=line_search,
        masked=masked,
    )  # fmt: skip
    assert bool(info.converged) and int(info.evaluations) == len(calls)
    reference, _ = aa.root(fn, torch.tensor(x0, dtype=D), alpha=alpha, tol=1e-8)
    if not line_search:  # the masked loop's window rounds apart from the eager loop's
        torch.testing.assert_close(x, reference, rtol=1e-12, atol=1e-15)


# -- d. the best iterate -----------------------------------------------------------------------
def discrete_boundary_value(n):
    """MINPACK's discrete boundary-value function (Moré, Garbow, Hillstrom 1981, problem 28)
    and its standard start :math:`x_i = t_i (t_i - 1)`."""
    h = 1.0 / (n + 1)
    t = torch.arange(1, n + 1, dtype=D) * h

    def F(x):
        padded = torch.cat([x.new_zeros(1), x, x.new_zeros(1)])
        return 2 * x - padded[:-2] - padded[2:] + h**2 * (x + t + 1) ** 3 / 2

    return F, t * (t - 1)


@pytest.mark.parametrize("masked", [False, True])
def test_best_iterate_on_a_diverging_problem(masked):
    """On MINPACK's discrete boundary-value problem (n = 10) AA at the defaults diverges (||F||
    7.7e85 at the last finite iterate from 0.028): by default the lowest-residual iterate is
    returned (here the start), ``info.returned_iteration`` says which; ``return_best=False``
    returns the last one. The residuals are recomputed here from F."""
    F, x0 = discrete_boundary_value(10)
    x, info = aa.root(F, x0, masked=masked)
    last, last_info = aa.root(F, x0, masked=masked, return_best=False)
    assert info.reason == "nonfinite" and not bool(info.converged)
    assert int(info.returned_iteration) == 0 and torch.equal(x, x0)
    assert float(F(x).norm()) == pytest.approx(0.028080582281441797, rel=1e-12)
    assert int(last_info.returned_iteration) == int(last_info.iterations) > 20
    assert float(F(last).norm()) > 1e80


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize(("name", "max_iter"), [("F5", 8), ("F4_powell", 12), ("F5", 12)])
def test_best_iterate_is_the_lowest_residual(name, max_iter, masked):
    """Runs cut short by ``max_iter`` whose lowest residual is neither the first nor the last
    iterate: the returned x is the iterate (recorded by the callback) with the lowest
    recomputed ||F||, and ``residual_norms[returned_iteration]`` is its norm. (Each minimum
    stands out from its neighbours by more than 0.5%, so rounding does not move it; F2,
    which reaches its root in two steps and then wanders among 1e-15 .. 1e-77, did not.)"""
    fn, x0 = PROBLEMS[name]
    seen = [torch.tensor(x0, dtype=D)]
    x, info = aa.root(
        fn, seen[0], tol=0.0, max_iter=max_iter, history_depth=3, masked=masked,
        callback=lambda k, x, norm: seen.append(x.clone()),
    )  # fmt: skip
    norms = [float(fn(s).norm()) for s in seen]
    k = int(np.argmin(norms))
    assert 0 < k < max_iter and int(info.returned_iteration) == k
    torch.testing.assert_close(x, seen[k], rtol=0, atol=0)
    assert float(info.residual_norms[k]) == pytest.approx(norms[k], rel=1e-12)


def test_converged_solve_returns_its_last_iterate():
    W, c = contraction(n=6)
    g = lambda x: torch.tanh(W @ x + c)  # noqa: E731
    x, info = aa.fixed_point(g, torch.zeros(6, dtype=D), tol=1e-10)
    y, _ = aa.fixed_point(g, torch.zeros(6, dtype=D), tol=1e-10, return_best=False)
    assert bool(info.converged) and int(info.returned_iteration) == int(info.iterations)
    torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- e. stopping tests -------------------------------------------------------------------------
def first_met(fn, seen, test):
    """The first recorded iterate whose residual (recomputed here) passes ``test``."""
    for k, s in enumerate(seen):
        gx = fn(s)
        if test(float((gx - s).norm()), float(gx.norm())):
            return k
    return None


@pytest.mark.parametrize("masked", [False, True])
def test_stopping_tests_absolute_relative_and_relative_to_g(masked):
    """Each test alone stops at the first iterate that passes it, found by recomputing
    ||g(x_k) - x_k|| and ||g(x_k)|| in float64 from the iterates the callback saw: absolute
    ``tol``, ``rtol`` relative to ||r_0||, and ``gtol`` relative to ||g(x_k)|| (torchdeq's
    "rel"). With several the first that passes any of them stops the solve."""
    W, c = contraction(n=8, scale=0.9)
    g = lambda x: torch.tanh(W @ x + 3 * c)  # noqa: E731
    x0 = torch.zeros(8, dtype=D)
    r0 = float((g(x0) - x0).norm())
    cases = [
        (dict(tol=1e-6), lambda r, v: r <= 1e-6),
        (dict(tol=0.0, rtol=1e-4), lambda r, v: r <= 1e-4 * r0),
        (dict(tol=0.0, gtol=1e-5), lambda r, v: r <= 1e-5 * v),
        (dict(tol=1e-9, rtol=1e-7, gtol=1e-8), lambda r, v: r <= max(1e-9, 1e-7 * r0, 1e-8 * v)),
    ]
    for kwargs, test in cases:
        seen = [x0]
        _, info = aa.fixed_point(
            g,
            x0,
            masked=masked,
            callback=lambda k, x, n, seen=seen: seen.append(x.clone()),
            **kwargs,
        )
        assert bool(info.converged)
        assert int(info.iterations) == first_met(g, seen, test) > 2, kwargs


@pytest.mark.parametrize("name", ["tol", "rtol", "gtol"])
def test_tensor_tolerances_per_problem_under_vmap(name):
    """A 0-d tensor tolerance is the number; under vmap a batch of them gives each problem
    its own, and each member equals its own eager solve with that number."""
    W, _ = contraction(n=6, scale=0.8)
    C = torch.randn(3, 6, generator=torch.Generator().manual_seed(3), dtype=D)
    tols = torch.tensor([1e-3, 1e-7, 1e-11], dtype=D)
    base = dict(tol=0.0)

    def solve(c, t):
        return aa.fixed_point(lambda x: torch.tanh(W @ x) + c, torch.zeros(6, dtype=D),
                              **{**base, name: t})  # fmt: skip

    xs, infos = vmap(solve)(C, tols)
    assert len(set(infos.iterations.tolist())) == 3
    for i in range(3):
        x, info = solve(C[i], float(tols[i]))
        y, _ = solve(C[i], tols[i])
        assert int(infos.iterations[i]) == int(info.iterations) and bool(infos.converged[i])
        torch.testing.assert_close(xs[i], x, rtol=0, atol=1e-12)
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_bad_tolerances():
    g = lambda x: 0.5 * x  # noqa: E731
    x0 = torch.ones(3, dtype=D)
    with pytest.raises(
        TypeError,
        match="fixed_point: `tol` must be a real number or a real tensor of one",
    ):
        aa.fixed_point(g, x0, tol=torch.ones(2))
    with pytest.raises(TypeError, match="`gtol` must be a real number or a real tensor"):
        aa.fixed_point(g, x0, gtol=torch.tensor(1j))
    with pytest.raises(ValueError, match="root: `rtol` must be finite and >= 0.0"):
        aa.root(g, x0, rtol=torch.tensor(-1.0))
    with pytest.raises(ValueError, match="`gtol` must be finite"):
        aa.fixed_point(g, x0, gtol=math.nan)
    with pytest.raises(TypeError, match="`return_best` must be a bool"):
        aa.fixed_point(g, x0, return_best=1)


# -- g. per-sample solves of a batched problem -------------------------------------------------
def batch_problem(B=6, H=8):
    """A DEQ-like batch z = tanh(z W^T + c_i) whose samples differ in difficulty (the
    injections span 1e-2 to 1e1)."""
    W, _ = contraction(n=H, scale=0.9)
    C = torch.randn(B, H, generator=torch.Generator().manual_seed(4), dtype=D)
    C = C * torch.logspace(-2, 1, B, dtype=D)[:, None]
    return W, C


def recorded(solve, fn, x0, **kwargs):
    """``solve(fn, x0, **kwargs)`` and every iterate ``x_k`` it passed its callback, by ``k``."""
    iterates = {0: x0.clone()}

    def callback(k, x, norm):
        iterates[int(k)] = x.clone()

    x, info = solve(fn, x0, callback=callback, **kwargs)
    return x, info, iterates


@pytest.mark.parametrize("kind", ["fixed_point", "root"])
def test_batch_dims_equals_one_solve_per_sample(kind):
    """``batch_dims=1``: g is called on the whole batch, and each sample is solved as alone
    (its own window weights, stopping test with its own tolerance, freeze and best iterate):
    iterations, evaluations and decisions equal one eager solve per sample, and the iterates
    and residual norms agree within the two runs' rounding, amplified as the sample's own
    recurrence amplifies it.

    The bound: the batch (its map ``z @ W.T``, the sample's ``W @ z``; batched m x m solves)
    and the sample round each iteration differently by at most ``delta = (m + 1) u`` of the
    iterate's scale (the mix sums ``m + 1`` terms); a difference of that size made at step
    ``i`` grows to ``D_ij`` by step ``j`` (measured: the sample's own solve with its ``i``-th
    iterate so moved, ``test_solver_batched.sensitivity_bounds``), and the differences of
    every step add up. A residual norm moves by at most ``(1 + ||W||_2)`` times
    its iterate's error (``r = tanh(W z + c) - z``), plus its own rounding ``gamma_n``.
    (It was ``1e-12`` on x and ``1e-10`` on the residual norms, "measured 4e-11".)"""
    from test_solver_batched import sensitivity_bounds  # (it imports this module)

    W, C = batch_problem()
    tols = torch.tensor([1e-4, 1e-12, 1e-8, 1e-12, 1e-6, 1e-10], dtype=D)
    calls = []
    depth = 6  # the solvers' default history_depth
    delta = (depth + 1) * 2.0**-53
    lipschitz = 1.0 + float(torch.linalg.matrix_norm(W, ord=2))

    def g(z):
        calls.append(z.shape)
        return torch.tanh(z @ W.T + C)

    if kind == "fixed_point":
        solve, sample = aa.fixed_point, lambda i: lambda z: torch.tanh(W @ z + C[i])  # noqa: E731
    else:
        solve, sample = aa.root, lambda i: lambda z: torch.tanh(W @ z + C[i]) - z  # noqa: E731
    batch_fn = g if kind == "fixed_point" else (lambda z: g(z) - z)
    x, info, batch_iterates = recorded(
        solve, batch_fn, torch.zeros(6, 8, dtype=D), tol=tols, batch_dims=1, max_iter=60
    )
    assert all(shape == (6, 8) for shape in calls)  # one call of g per round, whole batch
    assert len(set(info.iterations.tolist())) > 3
    for i in range(6):
        options = dict(tol=float(tols[i]), max_iter=60)
        xi, ii, own = recorded(solve, sample(i), torch.zeros(8, dtype=D), **options)
        k = int(ii.iterations)
        assert int(info.iterations[i]) == k and bool(info.converged[i]) == bool(ii.converged)
        assert int(info.evaluations[i]) == int(ii.evaluations)
        assert int(info.returned_iteration[i]) == int(ii.returned_iteration)
        # The sample's sensitivity: its own solve with the iterate of each step moved by delta
        # of its scale (a start-only nudge was once used: where the window turns
        # ill-conditioned a few steps in, a difference made there grows ~1000x more, and
        # with MKL's AVX2 code sample 5 parted by 9.3e-11 at step 7 against 8.1e-11).
        bounds = sensitivity_bounds(solve, sample(i), own, delta, i, k, **options)
        for j in range(1, k + 1):
            error = float((batch_iterates[j][i] - own[j]).norm())
            assert error <= bounds[j], (i, j, error, bounds[j])
        returned = int(ii.returned_iteration)
        assert float((x[i] - xi).norm()) <= bounds[returned]
        norms, own_norms = info.residual_norms[i, : k + 1], ii.residual_norms
        allowed = torch.tensor([lipschitz * b for b in bounds], dtype=D)
        allowed += dot_roundoff(8) * own_norms
        assert torch.all((norms - own_norms).abs() <= allowed), (i, norms - own_norms, allowed)


def test_batch_dims_best_iterate_and_bad_shapes():
    """Per-sample best iterates on a batch of MINPACK boundary-value problems cut short, and
    the shape checks."""
    F, x0 = discrete_boundary_value(10)
    X0 = torch.stack([x0, 3 * x0, -x0])
    batch_F = torch.func.vmap(F)
    X, info = aa.root(batch_F, X0, batch_dims=1, max_iter=30, history_depth=3)
    for i in range(3):
        xi, ii = aa.root(F, X0[i], max_iter=30, history_depth=3)
        assert int(info.returned_iteration[i]) == int(ii.returned_iteration)
        torch.testing.assert_close(X[i], xi, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"`x0\['b'\]` has shape \(2, 3\).*batch shape \(3,\)"):
        aa.fixed_point(lambda x: x, {"a": torch.zeros(3, 2), "b": torch.zeros(2, 3)}, batch_dims=1)
    with pytest.raises(ValueError, match="`tol` has shape \\(2,\\).*shape \\(3,\\)"):
        aa.fixed_point(lambda x: x, torch.zeros(3, 2), tol=torch.ones(2), batch_dims=1)
    with pytest.raises(ValueError, match="fixed_point: `batch_dims` must be >= 0"):
        aa.fixed_point(lambda x: x, torch.zeros(3, 2), batch_dims=-1)
    with pytest.raises(ValueError, match="`batch_dims` must be 0 or 1"):
        aa.fixed_point(lambda x: x, torch.zeros(3, 2, 2), batch_dims=2)
    with pytest.raises(ValueError, match="`batch_dims` is not available under torch.func"):
        vmap(lambda x0: aa.fixed_point(lambda x: x, x0, batch_dims=1))(torch.zeros(2, 3, 2))


@pytest.mark.parametrize("blowup", [math.inf, math.nan])
def test_batch_dims_a_sample_whose_map_blows_up_stops_alone(blowup):
    """From its fourth evaluation on, sample 0's map returns +Inf (its residual norm is Inf,
    not NaN) or NaN: that sample stops as "nonfinite" at its last finite iterate, the others
    go on and converge as they do alone (the eager loop, float64)."""
    calls = []

    def g(z):
        calls.append(1)
        out = 0.5 * torch.tanh(z) + 0.25
        if len(calls) >= 4:
            out = torch.cat([torch.full_like(out[:1], blowup), out[1:]])
        return out

    z0 = torch.linspace(-1.0, 1.0, 12, dtype=D).reshape(3, 4)
    z, info = aa.fixed_point(g, z0, batch_dims=1, tol=1e-12, max_iter=50)
    assert info.status.tolist() == [2, 0, 0]  # SolverInfo's codes: nonfinite, converged
    assert int(info.iterations[0]) == 2 and bool(torch.isfinite(z[0]).all())
    for i in (1, 2):
        alone, alone_info = aa.fixed_point(lambda x: 0.5 * torch.tanh(x) + 0.25, z0[i], tol=1e-12)
        assert int(info.iterations[i]) == int(alone_info.iterations)
        torch.testing.assert_close(z[i], alone, rtol=0, atol=1e-12)


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="compile of update needs torch 2.12+")
def test_batch_dims_under_compile_with_a_fixed_budget():
    """torch.compile (dynamo, backend "eager", fullgraph) of a per-sample solve: the full
    budget of rounds in one graph, the same result as eagerly."""
    torch._dynamo.reset()
    W, C = batch_problem(B=3, H=4)
    g = lambda z: torch.tanh(z @ W.T + C)  # noqa: E731

    def solve(x0):
        return aa.fixed_point(g, x0, tol=1e-12, max_iter=3, batch_dims=1)

    x, info = torch.compile(solve, fullgraph=True, backend="eager")(torch.zeros(3, 4, dtype=D))
    eager_x, eager_info = solve(torch.zeros(3, 4, dtype=D))
    assert info.residual_norms.shape == (3, 4)
    assert torch.equal(info.iterations, eager_info.iterations)
    torch.testing.assert_close(x, eager_x, rtol=0, atol=1e-14)
    torch._dynamo.reset()

"""``aa.fixed_point``, ``aa.root`` and ``aa.implicit_fixed_point`` (issue 25).

The nonlinear test problems ``F``, ``F2``, ``F3``, ``F4_powell``, ``F5``, ``F6`` and the
20-dimensional linear system are those of SciPy's ``scipy/optimize/tests/test_nonlin.py``
(BSD licence; ``F5`` is ``pressure_network`` of ``test_minpack.py``), written here in torch.
SciPy (a test-only dependency) runs its own ``nonlin_solve`` with ``Anderson`` on the very same
functions through a NumPy wrapper, so the comparisons are of the two solvers only:

* SciPy's ``w0 = 0``, no line search: the recurrences are the same (``history_depth = M + 1``),
  with the same step counts, and SciPy's step replayed from each of our iterates
  (:func:`assert_scipy_steps`) lands where ours does, to a bound derived from both solvers'
  rounding, wherever SciPy's normal equations stay regular (``M <= n``: with more
  differences than unknowns SciPy's Gram matrix is singular, it warns and returns an
  arbitrary solution);
* SciPy's defaults at its test settings (``w0 = 0.01``, Armijo line search, ``f_tol = 1e-2``,
  ``maxiter = 200``): ours converges wherever SciPy does, in at most 1.2 times its steps.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from references import BOUND_FACTOR, SENSITIVITY_SAMPLES, sensitivity, solve_roundoff
from torch.func import grad, vmap

import aadl_func as aa

D = torch.float64
U64 = 2.0**-53  # float64's unit roundoff


# -- SciPy's test problems (scipy/optimize/tests/test_nonlin.py, BSD licence) ---------------
def F(x):
    d = torch.tensor([3, 2, 1.5, 1, 0.5], dtype=D)
    return -d * x - 0.01 * (x @ x) * x


def F2(x):
    return x


def F3(x):
    A = torch.tensor([[-2, 1, 0.0], [1, -2, 1], [0, 1, -2]], dtype=D)
    return A @ x - torch.tensor([1, 2, 3.0], dtype=D)


def F4_powell(x):
    A = 1e4
    return torch.stack([A * x[0] * x[1] - 1, torch.exp(-x[0]) + torch.exp(-x[1]) - (1 + 1 / A)])


def F5(x):  # pressure_network(x, 4, [.5, .5, .5, .5]) of test_minpack.py
    P = 0.5 * x**2
    return torch.cat([P[1:] - P[0], (x.sum() - 4).reshape(1)])


def F6(x):
    J0 = torch.tensor([[-4.256, 14.7], [0.8394989, 0.59964207]], dtype=D)
    v = torch.stack([(x[0] + 3) * (x[1] ** 5 - 7) + 3 * 6, torch.sin(x[1] * torch.exp(x[0]) - 1)])
    return -torch.linalg.solve(J0, v)


def linear_system():
    """TestLinear._check(N=20): A x - b with SciPy's generator and seed."""
    rng = np.random.default_rng(123)
    A = torch.from_numpy(rng.standard_normal((20, 20)))
    b = torch.from_numpy(rng.standard_normal(20))
    return lambda x: A @ x - b


PROBLEMS = {
    "F": (F, [1, 1, 1, 1, 1]),
    "F2": (F2, [1, 2, 3, 4, 5, 6]),
    "F2_lucky": (F2, [0, 0, 0, 0, 0, 0]),
    "F3": (F3, [1, 2, 3]),
    "F4_powell": (F4_powell, [-1, -2]),
    "F5": (F5, [2.0, 0, 2, 0]),
    "F6": (F6, [-0.5, 1.4]),
}


def scipy_solve(fn, x0, jacobian, **kw):
    """SciPy's ``nonlin_solve`` on ``fn`` (a torch function), with the 2-norm as the stopping
    norm (ours); returns its iterates after each step, whether it succeeded, and whether its
    Gram matrix was ever ill-conditioned (SciPy's ``LinAlgWarning``)."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    from scipy.linalg import LinAlgWarning

    iterates = []
    wrapped = lambda x: fn(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LinAlgWarning)
        try:
            _, info = nonlin.nonlin_solve(
                wrapped, np.asarray(x0, dtype=np.float64), jacobian, full_output=True,
                tol_norm=np.linalg.norm, callback=lambda x, fx: iterates.append(x.copy()), **kw,
            )  # fmt: skip
            success = bool(info["success"])
        except (ArithmeticError, ValueError, nonlin.NoConvergence):  # e.g. overflow on Powell
            success = False
    singular = any(issubclass(w.category, LinAlgWarning) for w in caught)
    return iterates, success, singular


def scipy_steps(fn, x0, ours, jacobian, line_search=None, u_point=0.0, u_diff=0.0, seed=0):
    """SciPy's ``nonlin_solve`` step replayed from each of our iterates: from ``x_k`` (and the
    pairs of ``x_0 .. x_k``), the point SciPy's ``jacobian`` (and ``line_search``) steps to,
    ``x_k + s dx``. Replayed, the two solvers' rounding is not amplified from step to step.
    ``u_point``, ``u_diff``: each ``x_k`` and ``F(x_k)`` perturbed by ``u_point`` relative, each
    stored difference by ``u_diff`` (standard normal factors, ``seed``), as
    ``references.rounding_perturbation`` does to a window."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    rng = np.random.default_rng(seed)
    jiggle = lambda v, u: v * (1.0 + u * rng.standard_normal(v.shape))  # noqa: E731
    wrapped = lambda x: fn(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()  # noqa: E731
    store = jacobian._update
    jacobian._update = lambda x, f, dx, df, *norms: store(
        x, f, jiggle(dx, u_diff), jiggle(df, u_diff), *norms
    )
    x = np.asarray(x0, dtype=np.float64)
    fx = wrapped(x)
    jacobian.setup(x.copy(), fx, wrapped)
    out = []
    for x_next in ours:
        dx = -jacobian.solve(jiggle(fx, u_point))
        start = jiggle(x, u_point)
        if line_search:
            out.append(nonlin._nonlin_line_search(wrapped, start, fx, dx, line_search)[1])
        else:
            out.append(start + dx)
        x = np.asarray(x_next, dtype=np.float64)
        fx = wrapped(x)
        jacobian.update(x.copy(), fx)
    return out


def assert_scipy_steps(fn, x0, ours, jacobian, depth, line_search=None) -> float:
    """Each of our iterates within its bound of SciPy's step replayed from the previous one
    (:func:`scipy_steps`); returns the largest error in units of the bound.

    The bound is the contract's (``references.rounding_bounds``), derived, not fitted:
    ``BOUND_FACTOR`` times the root mean square of how far SciPy's replayed step moves when
    its data is perturbed as rounding does (16 samples: the points by ``u``; the stored
    differences by the float64 solve's backward error
    ``sqrt(n (m + 1)) u``, which also covers SciPy's normal equations: their error is the
    Gram matrix's, ``cond(a) x`` its rounding, and a perturbation of the differences moves
    ``a`` by as much), plus the combination's ``(m + 2) u``; ``m`` = ``depth`` pairs. Errors
    are relative to the step's scale, the larger of its result and its start (a step can
    land on a root at 0, F2's, where its rounding is that of the start)."""
    n = len(x0)
    exact = scipy_steps(fn, x0, ours, jacobian(), line_search)
    starts = [np.asarray(x0, dtype=np.float64), *ours[:-1]]
    scales = [max(np.linalg.norm(a), np.linalg.norm(b)) for a, b in zip(exact, starts)]

    def relative(outputs) -> np.ndarray:
        return np.array([np.linalg.norm(a - b) / s for a, b, s in zip(outputs, exact, scales)])

    u_diff = solve_roundoff(n, depth)
    moves = [
        relative(scipy_steps(fn, x0, ours, jacobian(), line_search, U64, u_diff, seed))
        for seed in range(SENSITIVITY_SAMPLES)
    ]
    bounds = BOUND_FACTOR * sensitivity(np.array(moves)) + (depth + 2) * U64
    errors = relative(ours)
    worst = int(np.argmax(errors / bounds)) if len(ours) else 0
    assert np.all(errors <= bounds), (worst + 1, errors[worst], bounds[worst])
    return float(np.max(errors / bounds, initial=0.0))


def our_iterates(fn, x0, **kw):
    iterates = []
    x, info = aa.root(
        fn, torch.tensor(x0, dtype=D),
        callback=lambda k, x, norm: iterates.append(x.numpy().copy()), **kw,
    )  # fmt: skip
    return iterates, info


# -- the recurrence is SciPy's ---------------------------------------------------------------
# SciPy's M where its Gram matrix stays regular on the run (else 5).
MEMORY = {"F3": 3, "F4_powell": 2, "F5": 3, "F6": 2}


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_iterates_match_scipy_without_regularisation(name):
    """w0 = 0, no line search, SciPy's test tolerance: the same step count and each step
    SciPy's replayed (:func:`assert_scipy_steps`), with SciPy's M = 5 where its Gram matrix
    stays regular on the problem and fewer differences where it would not (M = 5 > n = 4
    differences in R^4 are dependent)."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    m = MEMORY.get(name, 5)
    theirs, ok, singular = scipy_solve(
        fn, x0, nonlin.Anderson(M=m, w0=0), f_tol=1e-2, maxiter=200, line_search=None
    )
    ours, info = our_iterates(fn, x0, history_depth=m + 1, tol=1e-2, max_iter=200)
    assert ok and not singular and bool(info.converged)
    # Badly scaled F4_powell (A = 1e4): the two free-running roundings of the same recurrence
    # drift apart (1e-9 at step 2, 1e-4 later) and take other step counts, though both
    # converge; replayed from our iterates, every step is SciPy's to its rounding.
    assert name == "F4_powell" or len(ours) == len(theirs) == int(info.iterations)
    assert_scipy_steps(fn, x0, ours, lambda: nonlin.Anderson(M=m, w0=0), m + 1)


@pytest.mark.parametrize("m", [2, 3, 4])
def test_history_depth_is_scipys_m_plus_one(m):
    """SciPy's M counts differences, history_depth pairs: on F only depth M + 1 gives SciPy's
    steps (replayed, to the derived bound); M and M + 2 differ by 0.06 or more."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS["F"]
    theirs, ok, _ = scipy_solve(
        fn, x0, nonlin.Anderson(M=m, w0=0), f_tol=1e-2, maxiter=200, line_search=None
    )
    assert ok
    for depth in (m, m + 1, m + 2):  # depth 2 (AA(1)) is the solvers' least
        ours, _ = our_iterates(fn, x0, history_depth=depth, tol=1e-2, max_iter=200)
        if depth == m + 1:  # SciPy's steps, to the derived bound (it was a gap below 1e-12)
            assert len(ours) == len(theirs)
            assert_scipy_steps(fn, x0, ours, lambda: nonlin.Anderson(M=m, w0=0), depth)
        else:
            gap = max(np.abs(a - b).max() for a, b in zip(theirs, ours))
            assert gap > 0.05, (depth, gap)


def test_linear_system_matches_scipy():
    """SciPy's TestLinear.test_anderson (M=50, alpha=1, f_tol=1e-6, 29 steps, no line search):
    with w0 = 0 the iterates match SciPy's; at SciPy's w0 = 0.01 it needs 24 steps, we 21."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn = linear_system()
    zeros = [0.0] * 20
    settings = dict(f_tol=1e-6, maxiter=29, line_search=None)
    theirs, ok, _ = scipy_solve(fn, zeros, nonlin.Anderson(M=50, alpha=1.0, w0=0), **settings)
    ours, info = our_iterates(fn, zeros, alpha=1.0, history_depth=51, tol=1e-6, max_iter=29)
    assert ok and bool(info.converged) and len(ours) == len(theirs)
    assert_scipy_steps(fn, zeros, ours, lambda: nonlin.Anderson(M=50, alpha=1.0, w0=0), 51)
    theirs, ok, _ = scipy_solve(fn, zeros, nonlin.Anderson(M=50, alpha=1.0), **settings)
    assert ok and int(info.iterations) <= len(theirs)
    residual = fn(torch.from_numpy(ours[-1]))
    assert float(residual.norm()) <= 1e-6


@pytest.mark.parametrize("name", ["F", "F2", "F5"])
def test_line_search_iterates_match_scipy(name):
    """w0 = 0 with SciPy's Armijo search (it backtracks on these runs: 1, 1 and 8 times): the
    same step counts, SciPy's search replayed from each of our iterates lands where ours does
    (step lengths included, :func:`assert_scipy_steps`), and the extra evaluations are
    counted."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    m = MEMORY.get(name, 5)
    theirs, ok, singular = scipy_solve(
        fn, x0, nonlin.Anderson(M=m, w0=0), f_tol=1e-2, maxiter=200, line_search="armijo"
    )
    ours, info = our_iterates(
        fn, x0, history_depth=m + 1, tol=1e-2, max_iter=200, line_search="armijo"
    )
    assert ok and not singular and bool(info.converged)
    assert len(ours) == len(theirs) == int(info.iterations)
    assert int(info.evaluations) > int(info.iterations) + 1  # trials beyond the full steps
    jacobian = lambda: nonlin.Anderson(M=m, w0=0)  # noqa: E731
    assert_scipy_steps(fn, x0, ours, jacobian, m + 1, line_search="armijo")


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_line_search_steps_within_scipy(name):
    """SciPy's test settings (M=5, w0=0.01, Armijo, f_tol=1e-2, maxiter=200) against ours
    with the same line search, depth M + 1 and a relative ridge of w0^2: we converge wherever
    SciPy does, in at most 1.2x its steps."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    theirs, ok, _ = scipy_solve(
        fn, x0, nonlin.Anderson(M=5), f_tol=1e-2, maxiter=200, line_search="armijo"
    )
    x, info = aa.root(
        fn, torch.tensor(x0, dtype=D), history_depth=6, line_search=True, reg_relative=1e-4,
        tol=1e-2, max_iter=200,
    )  # fmt: skip
    assert ok
    assert bool(info.converged) and info.reason == "converged"
    assert int(info.iterations) <= math.floor(1.2 * len(theirs))
    assert float(fn(x).norm()) <= 1e-2  # checked on the returned point itself
    assert int(info.evaluations) >= int(info.iterations) + 1


@pytest.mark.parametrize(
    ("a", "w", "phase"),
    [(2, 3, 1.0), (5, 11, 1.0), (2, 11, -1.5), (5, 29, -1.5), (2, 29, -0.8), (5, 11, -1.2)],
)
def test_armijo_search_is_scipys(a, w, phase):
    """The backtracking search itself against SciPy's ``scalar_search_armijo``: the same trial
    step lengths and result on bumpy functions that reject s = 1 and the quadratic step, so
    that the cubic steps run (phase 1.0: no step qualifies, the search gives up)."""
    linesearch = pytest.importorskip("scipy.optimize._linesearch")
    from aadl_func._src.core.linesearch import armijo

    trials = {"ours": [], "scipy": []}

    def phi_for(who):
        def phi(s):
            trials[who].append(s)
            return 1.0 - s + 2 * s * (1 + math.sin(w * s + phase)) ** 2 + a * s * s

        return phi

    ours = armijo(phi_for("ours"), 1.0, -1.0)
    theirs, _ = linesearch.scalar_search_armijo(phi_for("scipy"), 1.0, -1.0, amin=1e-2)
    assert len(trials["scipy"]) >= 3  # the cubic interpolation did run
    assert trials["ours"] == trials["scipy"] and ours == theirs
    assert (ours is None) == (phase == 1.0)


@pytest.mark.parametrize("name", ["F", "F3", "F5"])
def test_reg_column_is_scipy_w0(name):
    """SciPy's w0 adds w0^2 ||dF_j||^2 to column j: ``reg_column = w0**2`` gives its iterates
    (no line search, M <= n)."""
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    fn, x0 = PROBLEMS[name]
    m = min(5, len(x0) - 1)
    theirs, _, _ = scipy_solve(
        fn, x0, nonlin.Anderson(M=m, w0=0.01), f_tol=1e-2, maxiter=200, line_search=None
    )
    ours, _ = our_iterates(fn, x0, history_depth=m + 1, tol=1e-2, max_iter=200, reg_column=1e-4)
    assert len(ours) == len(theirs)
    assert_scipy_steps(fn, x0, ours, lambda: nonlin.Anderson(M=m, w0=0.01), m + 1)


def test_aadl_mode_is_not_a_root_finder():
    """Why classic is the default: on SciPy's linear system mode "aadl" does not get there in
    10x the steps classic needs."""
    fn = linear_system()
    x0 = torch.zeros(20, dtype=D)
    _, classic = aa.root(fn, x0, alpha=1.0, history_depth=51, tol=1e-6, max_iter=290)
    _, aadl = aa.root(fn, x0, alpha=1.0, history_depth=51, tol=1e-6, max_iter=290, mode="aadl")
    assert bool(classic.converged) and int(classic.iterations) <= 29
    assert not bool(aadl.converged)


# -- fixed_point: semantics, pytrees, bookkeeping ------------------------------------------
def contraction(n=6, seed=0, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g, dtype=D)
    W = scale * W / torch.linalg.matrix_norm(W, 2)
    c = torch.randn(n, generator=g, dtype=D)
    return W, c


def test_fixed_point_on_a_pytree_against_newton():
    """A dict of a matrix and a vector, x = tanh(W x + c) coupled across leaves; the answer
    is checked against Newton's method on the flat vector (torch.func.jacfwd)."""
    W, c = contraction(n=7)

    def g(x):
        flat = torch.cat([x["a"].reshape(-1), x["b"]])
        out = torch.tanh(W @ flat + c)
        return {"a": out[:4].reshape(2, 2), "b": out[4:]}

    x0 = {"a": torch.zeros(2, 2, dtype=D), "b": torch.zeros(3, dtype=D)}
    x, info = aa.fixed_point(g, x0, tol=1e-12, max_iter=50)
    assert info.reason == "converged" and bool(info.converged)
    z = torch.zeros(7, dtype=D)
    for _ in range(30):
        t = torch.tanh(W @ z + c)
        jacobian = (1 - t**2)[:, None] * W - torch.eye(7, dtype=D)
        z = z - torch.linalg.solve(jacobian, t - z)
    ours = torch.cat([x["a"].reshape(-1), x["b"]])
    torch.testing.assert_close(ours, z, rtol=0, atol=1e-11)
    # The bookkeeping: one evaluation per step plus the first; the norms are ||g(x_k) - x_k||.
    assert int(info.evaluations) == int(info.iterations) + 1
    assert info.residual_norms.shape == (int(info.iterations) + 1,)
    assert float(info.residual_norms[-1]) <= 1e-12 < float(info.residual_norms[-2])
    first = torch.cat([g(x0)["a"].reshape(-1), g(x0)["b"]]).norm()
    torch.testing.assert_close(info.residual_norms[0], first)


def test_fixed_point_is_faster_than_plain_iteration_and_relative_tolerance():
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=torch.Generator().manual_seed(2), dtype=D))
    W = (q * torch.linspace(0.0, 0.9, 30, dtype=D)) @ q.T  # symmetric, spectral radius 0.9
    c = torch.ones(30, dtype=D)
    g = lambda x: W @ x + 0.05 * torch.tanh(x) + c  # noqa: E731  (contracts by ~0.95)
    x0 = torch.zeros(30, dtype=D)
    x, info = aa.fixed_point(g, x0, tol=0.0, rtol=1e-10, max_iter=100)
    assert bool(info.converged)
    assert float(info.residual_norms[-1]) <= 1e-10 * float(info.residual_norms[0])
    plain, steps = x0, 0
    while float((g(plain) - plain).norm()) > 1e-10 * float(info.residual_norms[0]):
        plain, steps = g(plain), steps + 1
    assert int(info.iterations) < steps / 3
    # Both are within ||r|| / (1 - 0.95) of the fixed point.
    bound = 2 * 1e-10 * float(info.residual_norms[0]) / 0.05
    torch.testing.assert_close(x, plain, rtol=0, atol=bound)


def test_max_iter_callback_and_nonfinite():
    W, c = contraction()
    g = lambda x: torch.tanh(W @ x + c)  # noqa: E731
    x0 = torch.zeros(6, dtype=D)
    _, info = aa.fixed_point(g, x0, tol=0.0, max_iter=3)
    assert info.reason == "max_iter" and int(info.iterations) == 3
    assert not bool(info.converged)
    _, info = aa.fixed_point(g, x0, tol=0.0, max_iter=0)
    assert int(info.iterations) == 0 and int(info.evaluations) == 1

    seen = []
    _, info = aa.fixed_point(
        g, x0, tol=0.0, callback=lambda k, x, norm: seen.append((k, norm)) or k == 2
    )
    assert info.reason == "callback" and int(info.iterations) == 2
    assert [k for k, _ in seen] == [1, 2]
    assert seen[-1][1] == float(info.residual_norms[-1])

    # A map that blows up on its third evaluation: the solver stops on the last finite point.
    calls = []

    def blows_up(x):
        calls.append(1)
        return g(x) * (math.inf if len(calls) == 3 else 1.0)

    x, info = aa.fixed_point(blows_up, x0, tol=0.0, max_iter=10)
    assert info.reason == "nonfinite" and int(info.iterations) == 1
    assert bool(torch.isfinite(x).all())


def test_inputs_are_not_modified_and_no_graph_is_recorded():
    W, c = contraction()
    x0 = torch.zeros(6, dtype=D, requires_grad=True)
    before = x0.detach().clone()
    x, _ = aa.fixed_point(lambda x: torch.tanh(W @ x + c), x0)
    assert torch.equal(x0.detach(), before)
    assert x.grad_fn is None and not x.requires_grad


def test_float32_and_history_dtype_pass_through():
    W, c = contraction()
    g = lambda x: torch.tanh(W.float() @ x + c.float())  # noqa: E731
    x, info = aa.fixed_point(g, torch.zeros(6), tol=1e-5, history_dtype=torch.float32)
    assert x.dtype == torch.float32 and bool(info.converged)
    assert info.residual_norms.dtype == torch.float64


# -- vmap and compile ------------------------------------------------------------------------
def test_vmap_batch_stops_problem_by_problem():
    """Five problems of very different difficulty under vmap: each member's iterations, point
    and residuals are its own eager solve's (the masked loop freezes a member once done)."""
    W, _ = contraction(n=8, scale=0.6)
    C = torch.randn(5, 8, generator=torch.Generator().manual_seed(1), dtype=D)
    C = C * torch.tensor([0.01, 0.1, 1.0, 3.0, 10.0], dtype=D)[:, None]

    def solve(c):
        return aa.fixed_point(lambda x: torch.tanh(W @ x) + c, torch.zeros(8, dtype=D), tol=1e-10)

    xs, infos = vmap(solve)(C)
    assert len(set(infos.iterations.tolist())) > 2  # the members do stop at different steps
    rounds = infos.residual_norms.shape[1]
    assert rounds == int(infos.iterations.max()) + 1  # the loop ended when all had stopped
    for i in range(5):
        x, info = solve(C[i])
        k = int(info.iterations)
        assert int(infos.iterations[i]) == k and bool(infos.converged[i])
        assert int(infos.evaluations[i]) == int(info.evaluations)
        torch.testing.assert_close(xs[i], x, rtol=0, atol=1e-12)
        torch.testing.assert_close(infos.residual_norms[i, : k + 1], info.residual_norms)
        assert torch.all(infos.residual_norms[i, k:] == infos.residual_norms[i, k])  # frozen


def test_vmap_root_with_scipy_alpha_rule():
    """root under vmap: SciPy's alpha rule computed per member."""
    A = torch.tensor([[-2, 1, 0.0], [1, -2, 1], [0, 1, -2]], dtype=D)
    B = torch.tensor([[1, 2, 3.0], [0.1, 0.0, -5.0], [7.0, 7.0, 7.0]], dtype=D)

    def solve(b):
        return aa.root(lambda x: A @ x - b, torch.ones(3, dtype=D), tol=1e-10)

    xs, infos = vmap(solve)(B)
    for i in range(3):
        torch.testing.assert_close(xs[i], torch.linalg.solve(A, B[i]), rtol=0, atol=1e-9)
        assert int(infos.iterations[i]) == int(solve(B[i])[1].iterations)


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="compile of update needs torch 2.12+")
def test_compile_masked_fixed_budget():
    """torch.compile(fullgraph=True) of the solver (dynamo only, backend "eager", to keep the
    test short): the masked loop runs its full budget in one graph and a problem that meets
    the tolerance early is frozen there, as eagerly."""
    torch._dynamo.reset()
    g = lambda x: 0.5 * x.flip(0) + torch.tensor([1.0, -2.0], dtype=D)  # noqa: E731

    def solve(x0):
        return aa.fixed_point(g, x0, tol=1e-12, max_iter=4)

    compiled = torch.compile(solve, fullgraph=True, backend="eager")
    x, info = compiled(torch.zeros(2, dtype=D))
    eager_x, eager_info = solve(torch.zeros(2, dtype=D))
    assert bool(info.converged) and int(info.iterations) == int(eager_info.iterations) < 4
    assert info.residual_norms.shape == (5,)  # the full budget
    torch.testing.assert_close(x, eager_x, rtol=0, atol=1e-14)
    exact = torch.linalg.solve(torch.eye(2, dtype=D) - 0.5 * torch.eye(2, dtype=D).flip(0),
                               torch.tensor([1.0, -2.0], dtype=D))  # fmt: skip
    torch.testing.assert_close(x, exact, rtol=0, atol=1e-12)
    torch._dynamo.reset()


def test_masked_loop_equals_eager_loop():
    """The same solve in both loops, to rounding: the eager loop runs the solver's own window
    (solver_eager), the masked one the core's update; both are the same recurrence."""
    W, c = contraction()
    g = lambda x: torch.tanh(W @ x + c)  # noqa: E731
    x0 = torch.zeros(6, dtype=D)
    a, ia = aa.fixed_point(g, x0, tol=1e-9)
    b, ib = aa.fixed_point(g, x0, tol=1e-9, masked=True)
    assert int(ia.iterations) == int(ib.iterations) and ib.reason == "converged"
    torch.testing.assert_close(a, b, rtol=1e-13, atol=0)


# -- bad arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(tol=-1.0), ValueError, "`tol`"),
        (dict(rtol=math.nan), ValueError, "`rtol`"),
        (dict(max_iter=2.5), TypeError, "`max_iter`"),
        (dict(max_iter=-1), ValueError, "`max_iter`"),
        (dict(line_search="wolfe"), ValueError, "`line_search`"),
        (dict(callback=3), TypeError, "`callback`"),
        (dict(masked="yes"), TypeError, "`masked`"),
        (dict(history_depth=1), ValueError, "fixed_point: `history_depth` must be >= 2"),
        (dict(history_depth=2, mode="aadl"), ValueError, "fixed_point: `history_depth`.*>= 3"),
        (dict(reg=-1.0), ValueError, "fixed_point: `reg`"),
        (dict(history_dtype=3), TypeError, "fixed_point: `history_dtype`"),
        (dict(max_steps=3), TypeError, "fixed_point: unexpected keyword argument `max_steps`"),
        (dict(relaxation=0.0), ValueError, "`relaxation`"),
        (dict(mode="newton"), ValueError, "`mode`"),
        (dict(inner=aa.sgd(1.0)), TypeError, "`inner`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    calls = []

    def g(x):
        calls.append(1)
        return x

    with pytest.raises(error, match=match):
        aa.fixed_point(g, torch.zeros(3), **kwargs)
    assert not calls  # rejected before any evaluation


def test_bad_problems():
    with pytest.raises(TypeError, match="`g`"):
        aa.fixed_point(3, torch.zeros(3))
    with pytest.raises(TypeError, match="`F`"):
        aa.root(None, torch.zeros(3))
    # Complex x0: mode "classic" only (tests/test_complex.py solves such problems).
    with pytest.raises(TypeError, match=r"x0\['z'\].*complex.*mode='classic'"):
        aa.fixed_point(lambda x: x, {"z": torch.zeros(3, dtype=torch.complex64)}, mode="aadl")
    with pytest.raises(TypeError, match="x0.*int64"):
        aa.fixed_point(lambda x: x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="`x0` must contain"):
        aa.fixed_point(lambda x: x, {})
    with pytest.raises(ValueError, match=r"g\(x\).*shape"):
        aa.fixed_point(lambda x: x[:2], torch.zeros(3))
    with pytest.raises(ValueError, match=r"F\(x\).*structure"):
        aa.root(lambda x: (x, x), torch.zeros(3))
    # A map's values are cast to x0's dtype, but not from complex to real (that dropped the
    # imaginary parts with only torch's warning), nor moved across devices (a raw error).
    with pytest.raises(TypeError, match=r"`g\(x\)\['z'\]` is complex .* where `x0\['z'\]` is real"):
        aa.fixed_point(lambda x: {"z": x["z"].to(torch.complex64)}, {"z": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"`F\(x\)` is on device meta, expected cpu like `x0`"):
        aa.root(lambda x: x.to("meta"), torch.zeros(3))
    x, _ = aa.fixed_point(lambda x: (0.5 * x + 1).double(), torch.zeros(3))  # cast: as before
    assert x.dtype == torch.float32
    for alpha, error in ((0.0, ValueError), (math.inf, ValueError), ("1", TypeError)):
        with pytest.raises(error, match="`alpha`"):
            aa.root(lambda x: x, torch.zeros(3), alpha=alpha)
    with pytest.raises(ValueError, match="`line_search`.*vmap"):
        vmap(lambda x: aa.fixed_point(torch.sin, x, line_search=True))(torch.zeros(2, 3))
    # Differentiating through the iterations: refused, pointing to the implicit gradient.
    with pytest.raises(RuntimeError, match="implicit_fixed_point"):
        grad(lambda c: aa.fixed_point(lambda x: 0.5 * x + c, torch.zeros(3, dtype=D))[0].sum())(
            torch.ones(3, dtype=D)
        )
    with pytest.raises(TypeError, match="`adjoint_options`"):
        aa.implicit_fixed_point(lambda z, t: z, torch.zeros(2), torch.ones(2), adjoint_options=1)


@pytest.mark.parametrize(
    ("adjoint_options", "error", "match"),
    [
        ({"foo": 1}, TypeError, "unexpected keyword argument `foo`"),
        ({"tol": -1}, ValueError, "`tol` must be finite and >= 0.0, got -1.0"),
        ({"max_iter": True}, TypeError, "`max_iter` must be an int, got bool"),
        ({"history_depth": 1}, ValueError, "`history_depth` must be >= 2, got 1"),
        ({"mode": "aadl", "history_depth": 2}, ValueError, "`history_depth` must be >= 3"),
        ({"line_search": "wolfe"}, ValueError, "`line_search` must be None, False, True"),
        ({"reg": math.nan}, ValueError, "`reg` must be finite and >= 0.0"),
        ({"inner": aa.sgd(0.1)}, TypeError, "`inner` is set by the solver"),
        (
            {"on_nonconvergence": "raise"},
            TypeError,
            "unexpected keyword argument `on_nonconvergence`; pass it to implicit_fixed_point",
        ),
    ],
)
@pytest.mark.parametrize("gradient", ["implicit", "phantom"])
def test_implicit_adjoint_options_are_checked_before_the_forward_solve(
    adjoint_options, error, match, gradient
):
    """`adjoint_options` were once checked only by the backward pass's adjoint solve, after
    the forward solve, in `fixed_point`'s name: now before `f` is ever called, naming
    `implicit_fixed_point` and `adjoint_options`."""
    calls = []

    def f(z, theta):
        calls.append(1)
        return 0.5 * z + theta

    theta = torch.ones(3, dtype=D, requires_grad=True)
    prefix = r"^implicit_fixed_point: `adjoint_options`: "
    with pytest.raises(error, match=prefix + re.escape(match)):
        aa.implicit_fixed_point(
            f, torch.zeros(3, dtype=D), theta, adjoint_options=adjoint_options, gradient=gradient
        )
    assert calls == [] and theta.grad is None


def test_implicit_forward_options_are_checked_before_f_is_called():
    calls = []

    def f(z, theta):
        calls.append(1)
        return 0.5 * z + theta

    theta = torch.ones(3, dtype=D, requires_grad=True)
    with pytest.raises(ValueError, match=r"^implicit_fixed_point: `tol` must be finite"):
        aa.implicit_fixed_point(f, torch.zeros(3, dtype=D), theta, tol=-1.0)
    with pytest.raises(TypeError, match=r"^implicit_fixed_point: unexpected keyword .*`foo`"):
        aa.implicit_fixed_point(f, torch.zeros(3, dtype=D), theta, foo=1)
    assert calls == []
    # Valid options, given for both solves, still solve and differentiate.
    z, info = aa.implicit_fixed_point(
        f, torch.zeros(3, dtype=D), theta, tol=1e-12, adjoint_options={"tol": 1e-12, "rtol": 0.0}
    )
    z.sum().backward()
    assert bool(info.converged)
    torch.testing.assert_close(theta.grad, torch.full((3,), 2.0, dtype=D))


# -- implicit differentiation ----------------------------------------------------------------
def deq_layer(n=6, d=3, seed=0):
    """A small DEQ layer z = tanh(W z + U x + b) (||W||_2 = 0.7) and its parameters."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, n, generator=g, dtype=D)
    theta = {
        "W": 0.7 * W / torch.linalg.matrix_norm(W, 2),
        "U": torch.randn(n, d, generator=g, dtype=D),
        "b": torch.randn(n, generator=g, dtype=D),
    }
    x = torch.randn(d, generator=g, dtype=D)

    def f(z, th):
        return torch.tanh(th["W"] @ z + th["U"] @ x + th["b"])

    return f, theta


def loss_of(z):
    return (z**2).sum() + torch.sin(z).sum()


TIGHT = dict(tol=1e-13, max_iter=200)


def implicit_loss(f, n):
    def loss(theta):
        z, _ = aa.implicit_fixed_point(f, torch.zeros(n, dtype=D), theta, **TIGHT)
        return loss_of(z)

    return loss


def unrolled_loss(f, n, steps=150):
    """Plain iteration recorded by autograd: 0.7^150 ~ 1e-23, converged to rounding."""

    def loss(theta):
        z = torch.zeros(n, dtype=D)
        for _ in range(steps):
            z = f(z, theta)
        return loss_of(z)

    return loss


def test_implicit_gradient_against_unrolled_and_finite_differences():
    f, theta = deq_layer()
    ours = grad(implicit_loss(f, 6))(theta)
    unrolled = grad(unrolled_loss(f, 6))(theta)
    for key in theta:
        torch.testing.assert_close(ours[key], unrolled[key], rtol=0, atol=1e-7)
    # Central differences of the loss through the (tightly solved) fixed point, float64.
    loss = implicit_loss(f, 6)
    eps = 1e-6
    for key, index in (("W", (1, 2)), ("U", (0, 1)), ("b", (3,))):
        plus = {k: v.clone() for k, v in theta.items()}
        minus = {k: v.clone() for k, v in theta.items()}
        plus[key][index] += eps
        minus[key][index] -= eps
        fd = (loss(plus) - loss(minus)) / (2 * eps)
        assert abs(float(fd) - float(ours[key][index])) <= 1e-7


def test_implicit_backward_and_vmap_of_grad():
    """loss.backward() gives torch.func.grad's gradient, and vmap of grad over a batch of
    biases gives each member's unrolled gradient."""
    f, theta = deq_layer()
    reference = grad(unrolled_loss(f, 6))(theta)
    leaves = {k: v.clone().requires_grad_() for k, v in theta.items()}
    z, info = aa.implicit_fixed_point(f, torch.zeros(6, dtype=D), leaves, **TIGHT)
    assert info.reason == "converged" and z.requires_grad
    loss_of(z).backward()
    for key in theta:
        torch.testing.assert_close(leaves[key].grad, reference[key], rtol=0, atol=1e-7)

    biases = torch.randn(3, 6, generator=torch.Generator().manual_seed(5), dtype=D)

    def grad_w(b, loss):
        return grad(loss)({**theta, "b": b})["W"]

    batched = vmap(lambda b: grad_w(b, implicit_loss(f, 6)))(biases)
    for i in range(3):
        torch.testing.assert_close(
            batched[i], grad_w(biases[i], unrolled_loss(f, 6)), rtol=0, atol=1e-7
        )


def test_implicit_adjoint_that_does_not_converge_warns_or_raises():
    f, theta = deq_layer()
    outcomes = (("raise", pytest.raises(RuntimeError)), ("warn", pytest.warns(RuntimeWarning)))
    for on_failure, expect in outcomes:
        leaves = {k: v.clone().requires_grad_() for k, v in theta.items()}
        z, _ = aa.implicit_fixed_point(
            f, torch.zeros(6, dtype=D), leaves, adjoint_options=dict(tol=0.0, max_iter=2),
            on_nonconvergence=on_failure, **TIGHT,
        )  # fmt: skip
        with expect as caught:
            loss_of(z).backward()
        assert "adjoint fixed point u = J^T u + dL/dz* did not converge" in str(
            caught.value if on_failure == "raise" else caught[0].message
        )

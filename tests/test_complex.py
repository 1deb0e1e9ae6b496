"""Complex params in mode "classic" (issue 25, item 2).

Classic type-II Anderson acceleration over :math:`\\mathbb{C}^n`: the window keeps the
Hermitian Grams :math:`F^H F`, the weights minimise :math:`\\|\\sum_i \\alpha_i f_i\\|` over
complex :math:`\\alpha` with :math:`\\sum_i \\alpha_i = 1`. Every check is against an
independent NumPy complex128 computation (``references.py``: :class:`references.Recurrence`
and :func:`references.type2_anderson` with LAPACK's complex least squares,
:func:`references.minimal_residual_iterate` for GMRES, :class:`references.Sgd` and
:class:`references.Adam`), against ``np.vdot`` for the state's Grams, or against
``scipy.optimize.anderson`` (SciPy's ``scipy/optimize/tests/test_nonlin.py``, ``TestLinear``'s
complex linear system, BSD licence; SciPy is a test-only dependency).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from conftest import GradientDescent, relative_error
from references import (
    Adam,
    Recurrence,
    Sgd,
    minimal_residual_iterate,
    rounding_bounds,
    solve_roundoff,
    type2_anderson,
)
from torch.func import vmap

import aadl_func as aa

C = torch.complex128


def _hermitian_problem(n: int, seed: int, skew: float = 0.0):
    """``A x - b`` with ``A`` = Hermitian positive definite (+ ``skew`` times a skew-Hermitian
    part, which keeps the Hermitian part, hence GMRES's convergence), complex ``b`` and
    ``x0``."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))
    q = np.linalg.qr(z)[0]
    A = q @ np.diag(np.linspace(1.0, 6.0, n)) @ q.conj().T
    if skew:
        s = rng.standard_normal((n, n)) + 1j * rng.standard_normal((n, n))
        A = A + skew * (s - s.conj().T)
    b = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    x0 = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    return A, b, x0


def _run(opt, A, b, x0, steps, dtype=C, inplace=False):
    """Our iterates (complex128 NumPy arrays) for the gradient ``A x - b``."""
    x = torch.tensor(x0, dtype=dtype)
    state = opt.init(x)
    out = []
    for _ in range(steps):
        g = torch.from_numpy(A @ x.numpy().astype(np.complex128) - b).to(dtype)
        x, state = opt.update(state, x, g, inplace=inplace)
        out.append(x.numpy().astype(np.complex128))
    return out, state


def _unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a real or complex dtype (of each part)."""
    return torch.finfo(torch.empty(0, dtype=dtype).real.dtype).eps / 2


def _assert_within_rounding(ours, x0, reference, params, window=None) -> list:
    """Each call of ``ours`` against ``reference()`` replaying it, within the bound that the
    dtypes' rounding and the call's own sensitivity give (``references.rounding_bounds``: the
    points rounded to ``params``, the stored differences to ``window`` when it is coarser,
    else the float64 solve's backward error); returns the reference's kinds."""
    expected, kinds = reference().run(x0, len(ours), inputs=ours)
    u_params = _unit(params)
    u_window = _unit(window or params)
    u_solve = solve_roundoff(len(x0), reference().history_depth)
    u_diff = max(u_window if u_window > u_params else 0.0, u_solve)
    bounds = rounding_bounds(reference, x0, ours, u_params, u_diff)
    errors = [relative_error(a, e) for a, e in zip(ours, expected)]
    worst = int(np.argmax(np.divide(errors, bounds)))
    assert errors[worst] <= bounds[worst], (worst + 1, errors[worst], bounds[worst])
    return kinds


OPTIONS = {
    "plain": {},
    "reg": {"reg": 1e-3},
    "reg_relative": {"reg_relative": 0.1},
    "reg_column": {"reg_column": 1e-2},
    "relaxation_gates": {"relaxation": 0.7, "wait_iterations": 2, "frequency": 2},
}


# -- the recurrence --------------------------------------------------------------------------
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_complex128_iterates_match_numpy(name, inplace):
    """A complex128 window (the QR-factor route) gives the reference's iterates to their
    rounding (was 1e-10, fitted), with every ridge on |.|^2 (reg, reg_relative, reg_column)."""
    A, b, x0 = _hermitian_problem(8, seed=1, skew=0.3)
    lr, options = 0.1, OPTIONS[name]
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=4, **options)
    ours, state = _run(opt, A, b, x0, 20, inplace=inplace)
    kinds = _assert_within_rounding(
        ours,
        x0,
        lambda: Recurrence(lambda x: A @ x - b, lr, mode="classic", history_depth=4, **options),
        C,
    )
    assert kinds.count("mix") == int(state.num_mixed) > 5
    assert state.gram.dtype == state.dr_gram.dtype == state.dr_rhs.dtype == C
    # A real extrapolation, with complex weights: not the plain step, not a real combination.
    plain = ours[-2] - lr * (A @ ours[-2] - b)
    assert relative_error(ours[-1], plain) > 1e-6


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_complex64_window_matches_numpy(inplace):
    """complex64 params and window (the Gram route: complex128 Grams of the stored complex64
    residuals). Each call is checked on the run's own inputs, so the tolerance is one step's
    rounding: the stored residuals and the combination round at eps32 ~ 6e-8, and the
    coefficients carry that error times cond(dF) and the ratio of the iterates to the steps:
    the bound is that rounding times the call's own sensitivity (was 1e-5, fitted to one
    run's 9e-7)."""
    A, b, x0 = _hermitian_problem(8, seed=2, skew=0.3)
    lr = 0.1
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=4)
    ours, state = _run(opt, A, b, x0, 20, dtype=torch.complex64, inplace=inplace)
    assert state.residuals[0].dtype == torch.complex64 and state.gram.dtype == C
    kinds = _assert_within_rounding(
        ours,
        x0,
        lambda: Recurrence(lambda x: A @ x - b, lr, mode="classic", history_depth=4),
        torch.complex64,
    )
    assert kinds.count("mix") > 10


@pytest.mark.parametrize(
    "params_dtype, history_dtype, window",
    [
        (torch.complex128, torch.float32, torch.complex64),
        (torch.complex64, torch.float64, torch.complex128),
    ],
)
def test_history_dtype_maps_to_its_complex_dtype(params_dtype, history_dtype, window):
    """history_dtype names the precision of a complex window's parts: float32 -> complex64,
    float64 -> complex128; the iterates stay within that precision of the reference."""
    A, b, x0 = _hermitian_problem(6, seed=3)
    opt = aa.anderson(
        GradientDescent(0.1), mode="classic", history_depth=4, history_dtype=history_dtype
    )
    ours, state = _run(opt, A, b, x0, 15, dtype=params_dtype)
    assert state.residuals[0].dtype == state.iterates[0].dtype == window
    assert state.anchor.dtype == params_dtype
    _assert_within_rounding(
        ours,
        x0,
        lambda: Recurrence(lambda x: A @ x - b, 0.1, mode="classic", history_depth=4),
        params_dtype,
        window,
    )


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64], ids=str)
def test_state_grams_are_hermitian_inner_products(dtype):
    """The kept Grams are the conjugate-linear inner products of the stored window, checked
    entry by entry with np.vdot (both routes: complex128 forms d_s element by element,
    complex64 takes <f_t, f_s - f_{s-1}> from the stored, conjugated, row s - 1)."""
    A, b, x0 = _hermitian_problem(7, seed=4, skew=0.2)
    opt = aa.anderson(GradientDescent(0.1), mode="classic", history_depth=5)
    _, state = _run(opt, A, b, x0, 13, dtype=dtype)  # a full ring, wrapped around
    R = [r.numpy().astype(np.complex128) for r in state.residuals]
    q = len(R)
    D = [R[t] - R[t - 1] for t in range(q)]
    head = int(state.head)
    gram = np.array([[np.vdot(R[t], R[s]) for s in range(q)] for t in range(q)])
    dr_gram = np.array([[np.vdot(D[t], D[s]) for s in range(q)] for t in range(q)])
    dr_rhs = np.array([np.vdot(D[t], R[head]) for t in range(q)])
    scale = max(np.vdot(r, r).real for r in R)
    tol = 1e-12 if dtype == C else 1e-6  # complex64: p from the stored row, eps32-level
    keep = [t for t in range(q) if t != (head + 1) % q]  # the oldest slot's d_t is unused
    np.testing.assert_allclose(state.gram.numpy(), gram, atol=1e-12 * scale)
    assert np.allclose(state.gram.numpy(), state.gram.numpy().conj().T, atol=0)
    np.testing.assert_allclose(
        state.dr_gram.numpy()[np.ix_(keep, keep)], dr_gram[np.ix_(keep, keep)], atol=tol * scale
    )
    np.testing.assert_allclose(state.dr_rhs.numpy()[keep], dr_rhs[keep], atol=tol * scale)


# -- vmap: an ensemble of complex problems --------------------------------------------------
@pytest.mark.parametrize("passes", ["per_member", "batched"])
def test_vmap_ensemble_matches_each_member(passes, monkeypatch):
    """Three complex problems stepped together under torch.func.vmap: each member's iterates
    are the reference's for its own problem, to their rounding (was 1e-10). ``batched``: the
    passes an accelerator or a differentiated step takes (stacked chunks, batched products)
    instead of the CPU's per-member eager kernels."""
    if passes == "batched":
        from aadl_func._src import vmap_rules

        monkeypatch.setattr(vmap_rules, "per_member", lambda tensors: False)
    problems = [_hermitian_problem(6, seed=10 + m, skew=0.2) for m in range(3)]
    lr = 0.1
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=4, reg_column=1e-4)
    X = torch.tensor(np.stack([p[2] for p in problems]))
    S = vmap(opt.init)(X)
    history = []
    for _ in range(15):
        G = torch.tensor(np.stack([A @ x - b for (A, b, _), x in zip(problems, X.numpy())]))
        X, S = vmap(lambda s, p, g: opt.update(s, p, g))(S, X, G)
        history.append(X.numpy().copy())
    assert S.gram.dtype == C
    for m, (A, b, x0) in enumerate(problems):
        ours = [h[m] for h in history]
        kinds = _assert_within_rounding(
            ours,
            x0,
            lambda A=A, b=b: Recurrence(
                lambda x: A @ x - b, lr, mode="classic", history_depth=4, reg_column=1e-4
            ),
            C,
        )
        assert kinds.count("mix") >= 10


# -- GMRES ------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [3, 5])
def test_full_history_is_gmres_on_a_complex_linear_map(d):
    """Full history, relaxation 1, a non-Hermitian complex map: call k + 1 returns
    g(x_k^GMRES) (Walker & Ni, 2011), GMRES's iterate being the minimiser of ||b - A x|| over
    the complex Krylov space, computed in NumPy by its definition."""
    A, b, x0 = _hermitian_problem(d, seed=20 + d, skew=0.4)
    lr = 0.08
    g = lambda x: x - lr * (A @ x - b)  # noqa: E731
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=d + 2)
    x = torch.tensor(x0)
    state = opt.init(x)
    for k in range(d + 1):
        plain = g(x.numpy())
        x, state = opt.update(state, x, torch.from_numpy(A @ x.numpy() - b))
        gmres = minimal_residual_iterate(A, b, x0, k)
        assert relative_error(x.numpy(), g(gmres)) <= 1e-8, k
        if 0 < k < d:  # a real extrapolation, not the plain step
            assert relative_error(g(gmres), plain) > 1e-6
        # The residual of GMRES's iterate is the least over the Krylov space: no worse than
        # any other point of it (here the previous iterate).
        if k > 0:
            previous = minimal_residual_iterate(A, b, x0, k - 1)
            assert np.linalg.norm(b - A @ gmres) <= np.linalg.norm(b - A @ previous) * (1 + 1e-12)
    assert relative_error(x.numpy(), np.linalg.solve(A, b)) <= 1e-8


# -- inner optimizers -------------------------------------------------------------------------
class PairsOfReals:
    """A real reference optimizer applied to a complex vector as pairs (re, im), as
    torch.optim (and aa.adam) treat complex params."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def init(self, x):
        return self.inner.init(np.stack([x.real, x.imag]))

    def step(self, x, g, state):
        y, state = self.inner.step(np.stack([x.real, x.imag]), np.stack([g.real, g.imag]), state)
        return y[0] + 1j * y[1], state


@pytest.mark.parametrize(
    "ours, reference",
    [
        (lambda: aa.sgd(0.05), lambda: Sgd(0.05)),
        (
            lambda: aa.sgd(0.05, momentum=0.5, nesterov=True, weight_decay=1e-2),
            lambda: Sgd(0.05, momentum=0.5, nesterov=True, weight_decay=1e-2),
        ),
        (lambda: aa.adam(0.05), lambda: PairsOfReals(Adam(0.05))),
    ],
    ids=["sgd", "nesterov", "adam"],
)
def test_inner_optimizers_on_complex_params(ours, reference):
    """aa.sgd steps complex params as complex numbers and aa.adam as pairs of reals (both as
    torch.optim, tests/test_inner.py); accelerated in mode "classic", each call is the
    reference's complex type-II step on the inner optimizer's pairs, to its rounding (was
    1e-10)."""
    A, b, x0 = _hermitian_problem(6, seed=30)
    opt = aa.anderson(ours(), mode="classic", history_depth=4)
    mine, state = _run(opt, A, b, x0, 12, inplace=True)
    kinds = _assert_within_rounding(
        mine,
        x0,
        lambda: Recurrence(lambda x: A @ x - b, reference(), mode="classic", history_depth=4),
        C,
    )
    assert kinds.count("mix") == int(state.num_mixed) >= 8


def test_accelerated_torch_optimizer_on_complex_parameters():
    """AcceleratedOptimizer(mode="classic") around torch.optim.SGD on complex parameters
    minimises the real loss 0.5 x^H A x - Re(b^H x) (torch's gradient A x - b): it reaches
    the solution of A x = b, and far sooner than the plain optimizer."""
    A, b, _ = _hermitian_problem(6, seed=90)
    At, bt = torch.from_numpy(A), torch.from_numpy(b)

    def train(accelerate: bool) -> float:
        p = torch.nn.Parameter(torch.zeros(6, dtype=C))
        opt = torch.optim.SGD([p], lr=0.1)
        if accelerate:
            opt = aa.AcceleratedOptimizer(opt, mode="classic", history_depth=5)
        for _ in range(30):
            opt.zero_grad()
            loss = 0.5 * (p.conj() @ (At @ p)).real - (bt.conj() @ p).real
            loss.backward()
            opt.step()
        return relative_error(p.detach().numpy(), np.linalg.solve(A, b))

    accelerated, plain = train(True), train(False)
    assert accelerated <= 1e-9 and plain > 1e-3


# -- checkpoints ------------------------------------------------------------------------------
def test_complex_state_round_trips_through_torch_save():
    """torch.save / torch.load(weights_only=True) of a complex state: the loaded state is
    accepted and continues bit for bit like the original."""
    A, b, x0 = _hermitian_problem(5, seed=40)
    opt = aa.anderson(aa.adam(0.05), mode="classic", history_depth=4)
    ours, state = _run(opt, A, b, x0, 7, dtype=torch.complex64)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.gram.dtype == C and loaded.residuals[0].dtype == torch.complex64
    x = torch.tensor(ours[-1], dtype=torch.complex64)
    g = torch.from_numpy(A @ ours[-1] - b).to(torch.complex64)
    a, _ = opt.update(state, x, g)
    c, _ = opt.update(loaded, x.clone(), g.clone())
    assert torch.equal(a, c)


# -- the solvers ------------------------------------------------------------------------------
def _scipy_linear_system():
    """SciPy's TestLinear._check(N=20, complex=True): A x - b with its generator and seed."""
    rng = np.random.default_rng(123)
    A = rng.standard_normal((20, 20))
    A = A + 1j * rng.standard_normal((20, 20))
    b = rng.standard_normal(20)
    b = b + 1j * rng.standard_normal(20)
    return A, b


def _scipy_iterates(fn, x0, w0):
    nonlin = pytest.importorskip("scipy.optimize._nonlin")
    iterates = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, info = nonlin.nonlin_solve(
            fn, x0, nonlin.Anderson(M=50, alpha=1.0, w0=w0), maxiter=100, f_tol=1e-6,
            line_search=None, tol_norm=np.linalg.norm, full_output=True,
            callback=lambda x, fx: iterates.append(x.copy()),
        )  # fmt: skip
    assert info["success"]
    return iterates


@pytest.mark.parametrize("w0", [0.0, 0.01])
def test_complex_linear_system_matches_scipy(w0):
    """SciPy's complex TestLinear.test_anderson system (N = 20, M = 50, alpha = 1, f_tol = 1e-6,
    no line search): with w0 as reg_column = w0**2 and history_depth = M + 1 the iterates are
    scipy.optimize.anderson's to 1e-10 and the step counts equal (21 at w0 = 0, 24 at SciPy's
    w0 = 0.01). The same system split into real and imaginary parts (a real 40-dimensional
    one) takes 41 and 44 steps, by SciPy and by us: the complex window's coefficients are
    complex, which the split window cannot express."""
    A, b = _scipy_linear_system()
    theirs = _scipy_iterates(lambda x: A @ x - b, np.zeros(20, dtype=complex), w0)
    At, bt = torch.from_numpy(A), torch.from_numpy(b)
    ours = []
    _, info = aa.root(
        lambda x: At @ x - bt, torch.zeros(20, dtype=C), alpha=1.0, history_depth=51,
        tol=1e-6, max_iter=100, reg_column=w0**2,
        callback=lambda k, x, norm: ours.append(x.numpy().copy()),
    )  # fmt: skip
    assert bool(info.converged) and len(ours) == len(theirs) == int(info.iterations)
    assert len(ours) == (21 if w0 == 0 else 24)
    for a, c in zip(theirs, ours):
        np.testing.assert_allclose(c, a, rtol=1e-10, atol=1e-10)
    # The real split: [Re; Im] of A x - b with the real 2N x 2N matrix.
    Ar = np.block([[A.real, -A.imag], [A.imag, A.real]])
    br = np.concatenate([b.real, b.imag])
    split_scipy = _scipy_iterates(lambda x: Ar @ x - br, np.zeros(40), w0)
    Art, brt = torch.from_numpy(Ar), torch.from_numpy(br)
    _, split = aa.root(
        lambda x: Art @ x - brt, torch.zeros(40, dtype=torch.float64), alpha=1.0,
        history_depth=51, tol=1e-6, max_iter=100, reg_column=w0**2,
    )  # fmt: skip
    assert int(split.iterations) == len(split_scipy) >= 1.7 * len(ours)


def test_fixed_point_and_root_on_complex_pytrees():
    """fixed_point and root take a pytree of complex leaves: the stopping norm is the 2-norm
    of the moduli over all leaves, and the solution solves the problem."""
    A, b, _ = _hermitian_problem(6, seed=50)
    At, bt = torch.from_numpy(A), torch.from_numpy(b)

    def g(x):  # a contraction: x - 0.1 (A x - b) on the joined vector
        v = torch.cat([x["a"], x["b"]])
        v = v - 0.1 * (At @ v - bt)
        return {"a": v[:4], "b": v[4:]}

    x0 = {"a": torch.zeros(4, dtype=C), "b": torch.zeros(2, dtype=C)}
    x, info = aa.fixed_point(g, x0, tol=1e-10, max_iter=100)
    assert bool(info.converged) and x["a"].dtype == C
    v = torch.cat([x["a"], x["b"]]).numpy()
    np.testing.assert_allclose(v, np.linalg.solve(A, b), rtol=1e-8)
    gx = g(x)
    norm = np.sqrt(sum(np.sum(np.abs((gx[k] - x[k]).numpy()) ** 2) for k in x))
    assert float(info.residual_norms[-1]) == pytest.approx(norm, rel=1e-12)
    assert float(info.residual_norms[-1]) <= 1e-10
    # root, with SciPy's line search on ||F||^2: a complex quadratic, z^2 = c elementwise.
    c = torch.tensor([2.0 + 1.0j, -1.0 + 0.5j, 3.0 - 2.0j], dtype=C)
    z, info = aa.root(lambda z: z * z - c, torch.full((3,), 1.0 + 1.0j, dtype=C), tol=1e-10,
                      line_search="armijo", max_iter=200)  # fmt: skip
    assert bool(info.converged)
    assert float((z * z - c).abs().max()) <= 1e-9


def test_fixed_point_under_vmap_on_complex_problems():
    """A batch of complex problems, each stopping on its own mask."""
    problems = [_hermitian_problem(5, seed=60 + m) for m in range(3)]
    A = torch.tensor(np.stack([p[0] for p in problems]))
    b = torch.tensor(np.stack([p[1] for p in problems]))

    def solve(A, b):
        return aa.fixed_point(lambda x: x - 0.1 * (A @ x - b), torch.zeros(5, dtype=C),
                              tol=1e-10, max_iter=60)  # fmt: skip

    x, info = vmap(solve)(A, b)
    assert bool(info.converged.all())
    for m, (An, bn, _) in enumerate(problems):
        np.testing.assert_allclose(x[m].numpy(), np.linalg.solve(An, bn), rtol=1e-8)


# -- errors -----------------------------------------------------------------------------------
def test_complex_is_refused_outside_classic():
    z = torch.zeros(3, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"`params` is torch.complex64.*mode='classic' only"):
        aa.anderson(aa.sgd(0.1)).init(z)  # mode "aadl", the default
    state = aa.anderson(aa.sgd(0.1), mode="classic").init(z)
    with pytest.raises(TypeError, match=r"mode='classic' only"):
        aa.anderson(aa.sgd(0.1)).update(state, z, z)
    # Complex grads for real params would lose their imaginary part in the cast.
    x = torch.zeros(3)
    opt = aa.anderson(aa.sgd(0.1), mode="classic")
    with pytest.raises(TypeError, match=r"`grads` has dtype torch.complex64"):
        opt.update(opt.init(x), x, z)
    with pytest.raises(TypeError, match=r"`z0`.*complex ones are not supported"):
        aa.implicit_fixed_point(lambda z, t: z * t, z, torch.ones(()))
    with pytest.raises(TypeError, match=r"`x0\['b'\]` is complex but `x0\['a'\]` is real"):
        aa.fixed_point(lambda x: x, {"a": torch.zeros(2), "b": z})


def test_reference_is_sound():
    """The complex reference: its type-II step's weights minimise the mixed residual among
    affine weights (checked against random affine perturbations)."""
    rng = np.random.default_rng(70)
    n, k = 6, 4
    xs = rng.standard_normal((n, k)) + 1j * rng.standard_normal((n, k))
    fs = rng.standard_normal((n, k)) + 1j * rng.standard_normal((n, k))
    x_new = type2_anderson(xs, xs + fs)
    # Recover alpha from x_new = (xs + fs) alpha (a full-rank n x k system).
    alpha = np.linalg.lstsq(xs + fs, x_new, rcond=None)[0]
    assert abs(alpha.sum() - 1) <= 1e-12
    best = np.linalg.norm(fs @ alpha)
    for _ in range(20):
        delta = rng.standard_normal(k) + 1j * rng.standard_normal(k)
        delta -= delta.mean()  # keeps sum(alpha) = 1
        assert np.linalg.norm(fs @ (alpha + 1e-3 * delta)) >= best


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="compiling update needs torch 2.12+")
@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64], ids=str)
def test_compiled_step_on_complex_params(dtype):
    """torch.compile traces the complex window's passes in one graph (the ``aot_eager``
    backend, as tests/test_compile.py: graph breaks and in-place semantics are dynamo's and
    AOT autograd's; inductor has no complex code generation and falls back to eager kernels,
    so compiling is about composition, not speed): each call is the reference's, to its
    rounding (as test_complex64_window_matches_numpy; was 1e-10 / 1e-5, fitted)."""
    A, b, x0 = _hermitian_problem(5, seed=80, skew=0.2)
    lr = 0.1
    opt = aa.anderson(GradientDescent(lr), mode="classic", history_depth=3)
    torch._dynamo.reset()
    step = torch.compile(lambda s, x, g: opt.update(s, x, g), backend="aot_eager", fullgraph=True)
    x = torch.tensor(x0, dtype=dtype)
    state = opt.init(x)
    ours = []
    try:
        for _ in range(6):
            g = A @ x.numpy().astype(np.complex128) - b
            x, state = step(state, x, torch.from_numpy(g).to(dtype))
            ours.append(x.numpy().astype(np.complex128))
    finally:
        torch._dynamo.reset()
    kinds = _assert_within_rounding(
        ours,
        x0,
        lambda: Recurrence(lambda x: A @ x - b, lr, mode="classic", history_depth=3),
        dtype,
    )
    assert kinds.count("mix") == 5

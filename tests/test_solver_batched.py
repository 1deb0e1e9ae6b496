"""``batch_dims=1`` through the batched route (``aadl_func/_src/solver_batched.py``).

The contract: each sample of a batch is solved as if alone. The references are independent
of the batched code: one eager solve per sample (``batch_dims=0``: the eager loop's own window,
``solver_eager``, itself held to the core's ``update`` in test_solver_eager.py and to SciPy's
steps in test_solver.py; its own float64 small solve and stopping test), and
``core/lstsq.py``'s small solves called on one sample at a time. ``test_solver_options.py``
holds the same contract with bounds derived from each sample's sensitivity; here float64 is
held to 1e-12 at every iterate over the solver's options, and float32 to a bound derived the
same way.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_flags import _CountOps
from test_solver_options import batch_problem, recorded

import aadl_func as aa
from aadl_func._src import solver_batched
from aadl_func._src.core import lstsq

D = torch.float64
TOLS = [1e-4, 1e-12, 1e-8, 1e-12, 1e-6, 1e-10]  # per sample: they stop at different steps


def layer(W, C):
    """The batch's map and each sample's own map (the same arithmetic: one row of the batch)."""
    batch = lambda z: torch.tanh(z @ W.T + C)  # noqa: E731
    return batch, lambda i: lambda z: torch.tanh(z[None] @ W.T + C[i : i + 1])[0]


def iterate_errors(kind, options, dtype=D, B=6, H=8):
    """The batched solve against each sample's own: the same iterations, evaluations, status
    and returned iterate, and per sample the distances (2-norm) between their iterates
    ``x_0 .. x_k`` (every one, recorded by the callback), then of the returned points, and
    the largest difference of their residual norms. Returns ``(distances, norm_errors,
    batch_info, maps, own_iterates, kwargs)``."""
    W, C = batch_problem(B, H)
    g, sample = layer(W.to(dtype), C.to(dtype))
    solve_fn = aa.fixed_point if kind == "fixed_point" else aa.root
    if kind == "root":
        g0, sample0 = g, sample
        g, sample = (lambda z: g0(z) - z), (lambda i: lambda z: sample0(i)(z) - z)
    kwargs = {"max_iter": 40, "tol": torch.tensor(TOLS[:B], dtype=D), **options}
    x, info, batch = recorded(solve_fn, g, torch.zeros(B, H, dtype=dtype), batch_dims=1, **kwargs)
    distances, norm_errors, maps, owns = [], [], [], []
    for i in range(B):
        # A tolerance given per sample is the sample's own number.
        alone = {k: float(v[i]) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        xi, ii, own = recorded(solve_fn, sample(i), torch.zeros(H, dtype=dtype), **alone)
        k = int(ii.iterations)
        assert int(info.iterations[i]) == k, (i, info.iterations, k)
        assert int(info.evaluations[i]) == int(ii.evaluations)
        assert int(info.status[i]) == int(ii.status)
        assert int(info.returned_iteration[i]) == int(ii.returned_iteration)
        gaps = [float((batch[j][i] - own[j]).norm()) for j in range(k + 1)]
        distances.append([*gaps, float((x[i] - xi).norm())])
        norm_errors.append(float((info.residual_norms[i, : k + 1] - ii.residual_norms).abs().max()))
        maps.append(sample(i))
        owns.append(own)
    return distances, norm_errors, info, maps, owns, kwargs


def sensitivity_bounds(solve_fn, fn, own, delta, seed, **options):
    """``test_solver_options.test_batch_dims_equals_one_solve_per_sample``'s bound on the
    distance at step ``j`` between two runs of a sample that round differently by at most
    ``delta`` of the iterate's scale per step: a perturbation of that size at the start has
    grown to ``D_j`` by step ``j`` (measured: the sample's own solve from a start so moved,
    for the same number of steps), so ``j`` such perturbations give ``j max_{i <= j} D_i``,
    or ``j delta`` of the scale where nothing amplifies; plus ``delta`` of the scale."""
    steps = len(own) - 1
    scale = max(float(z.norm()) for z in own.values())
    nudge = torch.randn(own[0].shape, generator=torch.Generator().manual_seed(seed))
    start = own[0] + (delta * scale * nudge / nudge.norm()).to(own[0].dtype)
    options = {**options, "tol": 0.0, "rtol": 0.0, "max_iter": steps}
    options.pop("gtol", None)
    _, _, moved = recorded(solve_fn, fn, start, **options)
    spread = [float((moved[j] - own[j]).norm()) for j in range(min(len(moved), steps + 1))]
    return [
        max(j * delta * scale, j * max(spread[: j + 1])) + delta * scale for j in range(steps + 1)
    ]


OPTION_SETS = {
    "defaults": {},
    "AA(1)": {"history_depth": 2},
    "depth 3, relaxation 0.5": {"history_depth": 3, "relaxation": 0.5},
    "reg": {"reg": 1e-3},
    "reg_relative": {"reg_relative": 1e-3},
    "wait and frequency": {"wait_iterations": 3, "frequency": 2},
    "rtol and gtol per sample": {
        "tol": 0.0,
        "rtol": torch.tensor([1e-3, 1e-9, 1e-6, 1e-13, 1e-12, 1e-8], dtype=D),
        "gtol": torch.tensor([0.0, 0.0, 0.0, 1e-7, 0.0, 1e-13], dtype=D),
    },
}


@pytest.mark.parametrize("kind", ["fixed_point", "root"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_float64_every_iterate_equals_its_own_solve(kind, name, monkeypatch):
    """Every iterate of every sample within 1e-12 (2-norm; the iterates' norms are up to ~3)
    of the sample's own solve, and so its residual norms, with the same iterations,
    evaluations, status and returned iterate, the samples stopping at different steps on
    their own tolerances (a stopped sample is frozen while the others go on). The route is
    the batched one.

    ``root`` (a fixed ``alpha = 0.5``; SciPy's alpha rule is ``test_solver_options``') is held
    to ``sensitivity_bounds`` with ``delta = (2Q + 1) u`` instead: on the most saturated
    sample its window turns ill-conditioned for a few steps and amplifies rounding to ~1e-11
    before converging, as its own solve from a start moved by one rounding does."""
    options = dict(OPTION_SETS[name])
    if kind == "root":
        options = {k: v for k, v in options.items() if k != "gtol"} | {"alpha": 0.5}
    built = []
    route = solver_batched.batched_anderson
    monkeypatch.setattr(solver_batched, "batched_anderson", lambda o: built.append(o) or route(o))
    distances, norm_errors, info, maps, owns, kwargs = iterate_errors(kind, options)
    assert len(built) == 1  # the batched route, not the core's update under vmap
    assert len(set(info.iterations.tolist())) > 2  # frozen samples beside running ones
    if kind == "fixed_point":
        assert max(max(d) for d in distances) <= 1e-12, distances
        assert max(norm_errors) <= 1e-12, norm_errors
        return
    delta = (2 * options.get("history_depth", 6) + 1) * 2.0**-53
    for i, (gaps, fn, own) in enumerate(zip(distances, maps, owns)):
        alone = {k: float(v[i]) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        bounds = sensitivity_bounds(aa.root, fn, own, delta, i, **alone)
        for j, (gap, bound) in enumerate(zip(gaps, bounds)):
            assert gap <= bound, (i, j, gap, bound)


def test_the_comparison_fails_when_two_samples_swap_weights(monkeypatch):
    """The float64 comparison has teeth: the weights of samples 0 and 1 swapped (each sample
    mixed with the other's coefficients) moves the iterates by far more than 1e-12."""
    original = solver_batched.mixing_weights

    def swapped(*args):
        gamma, *rest = original(*args)
        return gamma[[1, 0, *range(2, gamma.shape[0])]], *rest

    monkeypatch.setattr(solver_batched, "mixing_weights", swapped)
    with pytest.raises(AssertionError):
        distances, *_ = iterate_errors("fixed_point", {})
        assert max(max(d) for d in distances) <= 1e-12


def test_float32_within_the_sensitivity_bound():
    """float32, a fixed budget of 12 steps: every iterate of each sample within
    ``sensitivity_bounds`` of its own solve, with ``delta = (2Q + 1 + n) u``, ``u = 2^-24``:
    per step the batch and the sample round differently in the combination (``2Q + 1``
    terms summed in another order) and in the map (its ``n``-term products)."""
    W, C = batch_problem()
    g, sample = layer(W.float(), C.float())
    depth, n = 6, 8
    delta = (2 * depth + 1 + n) * 2.0**-24
    options = dict(tol=0.0, max_iter=12, history_depth=depth)
    _, info, batch = recorded(aa.fixed_point, g, torch.zeros(6, n), batch_dims=1, **options)
    worst = 0.0
    for i in range(6):
        _, own_info, own = recorded(aa.fixed_point, sample(i), torch.zeros(n), **options)
        # tol=0 stops a solve only at a residual of exactly 0 (the small samples in float32).
        steps = min(int(own_info.iterations), int(info.iterations[i]))
        assert steps >= 3
        own = {j: own[j] for j in range(steps + 1)}
        bounds = sensitivity_bounds(aa.fixed_point, sample(i), own, delta, i, **options)
        for j in range(1, steps + 1):
            error = float((batch[j][i] - own[j]).norm())
            assert error <= bounds[j], (i, j, error, bounds[j])
            worst = max(worst, error / bounds[j])
    assert worst > 0  # the two runs do round differently: the bound is being used


# -- the small solves, batched, against core/lstsq.py's, one sample at a time -----------------
def windows(B=7, n=9, s=5, seed=0):
    """Residual windows ``(B, s, n)`` float64 of every kind the solve meets: random, columns
    decaying as in a converging iteration, rank deficient (two equal residuals), all zero,
    one with a NaN, one of huge scale, one of tiny scale."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, s, n, generator=g, dtype=D)
    f[1] *= torch.logspace(0, -8, s, dtype=D)[:, None]
    f[2, 2] = f[2, 3]
    f[3] = 0.0
    f[4, 1, 3] = math.nan
    f[5] *= 1e150
    f[6] *= 1e-150
    return f


def as_problem(f):
    """``A = [Delta F | f_last]`` of each window, ``(B, s, n)``."""
    return torch.cat([f.diff(dim=1), f[:, -1:]], dim=1)


@pytest.mark.parametrize("reg", [0.0, 1e-3, "per sample"])
def test_factor_route_equals_solve_factor_per_sample(reg):
    """``factor_coefficients`` on a batch of QR factors equals ``lstsq.solve_factor`` on each
    factor alone (every column valid): the same coefficients to 4 ulp of the largest, the
    same verdict on finiteness, including rank-deficient, zero, NaN and badly scaled
    windows."""
    a = as_problem(windows())
    factor = torch.linalg.qr(torch.nan_to_num(a, nan=0.0).mT, mode="r").R
    factor[4, 0, 0] = math.nan  # the NaN sample's factor
    weights = torch.logspace(-4, 2, factor.shape[0], dtype=D) if reg == "per sample" else reg
    gamma, ok = solver_batched.factor_coefficients(factor, weights)
    m = factor.shape[-1] - 1
    for b in range(factor.shape[0]):
        reg_b = weights[b] if isinstance(weights, torch.Tensor) else weights
        own = lstsq.solve_factor(factor[b], torch.ones(m, dtype=torch.bool), reg_b)
        assert bool(ok[b]) == bool(own.ok)
        tolerance = 4 * torch.finfo(D).eps * max(float(own.gamma.abs().max()), 1e-300)
        torch.testing.assert_close(gamma[b], own.gamma, rtol=0, atol=tolerance)
    assert not bool(ok[4]) and torch.equal(gamma[4], torch.zeros(m, dtype=D))


def conditioned_windows(B=6, n=9, s=5, seed=1):
    """Residual windows ``(B, s, n)`` float64 whose normal equations are certified but
    ill-conditioned: columns decaying as a converging iteration's, by 10^-0.5 .. 10^-1.4 a
    step, so that ``cond(H)`` runs from ~1e4 to ~1e11 (every eigenvalue kept by RTOL)."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, s, n, generator=g, dtype=D)
    decay = torch.linspace(-0.5, -1.4, B, dtype=D)  # log10 of each window's step ratio
    return f * (10.0 ** (decay[:, None] * torch.arange(s, dtype=D)))[:, :, None]


def shifted_condition(products, norms, reg):
    """``cond(H / u + reg / u I)`` of each window (float64 NumPy eigenvalues, ``u`` the
    largest squared residual norm): the system both small solves answer."""
    m = products.shape[-1] - 1
    unit = np.nan_to_num(norms.amax(-1).numpy(), nan=1.0)
    unit[unit <= 0] = 1.0  # zero and NaN windows: not compared through this
    h = np.nan_to_num(products[:, :m, :m].numpy()) / unit[:, None, None]
    eigenvalues = np.linalg.eigvalsh(h + np.eye(m) * (reg / unit)[:, None, None])
    with np.errstate(divide="ignore", invalid="ignore"):  # the zero window's is inf
        return eigenvalues[:, -1] / eigenvalues[:, 0], eigenvalues[:, 0]


@pytest.mark.parametrize("reg", [0.0, 1e-3, "per sample"])
def test_gram_route_equals_solve_differences_per_sample(reg):
    """``normal_coefficients`` on a batch equals ``lstsq.solve_differences`` on each window
    alone (the normal equations of the same products, scaled, cut off alike), including
    rank-deficient, zero, NaN and badly scaled windows. A window whose system the
    Cholesky certificate passes (no eigenvalue near the cut-off) is solved by Cholesky and
    held to the bound of two backward-stable solves of one system: with backward errors
    ``eta ||a||`` each, ``eta = m (3m + 1) u`` (Higham, Accuracy and Stability, Thm 10.4, for
    the Cholesky solve; the same allowance for the eigendecomposition's), the answers differ
    by at most ``2 eta cond(a) / (1 - eta cond(a))`` of ``||gamma||``. The others take the
    eigendecomposition, as the core, to 8 ulp of the largest coefficient."""
    f = torch.cat([windows(), conditioned_windows()])
    a = as_problem(f)
    products = a @ a.mT
    norms = (f * f).sum(-1)
    B, m = f.shape[0], products.shape[-1] - 1
    weights = torch.logspace(-4, 2, B, dtype=D) if reg == "per sample" else reg
    gamma, ok = solver_batched.normal_coefficients(products, norms, weights)
    ridge = weights.numpy() if isinstance(weights, torch.Tensor) else np.full(B, weights)
    condition, _ = shifted_condition(products, norms, ridge)
    peak = norms.amax(-1)[:, None, None]
    system = (
        products[:, :m, :m] / peak
        + torch.eye(m, dtype=D) * torch.as_tensor(ridge)[:, None, None] / peak
    )
    certified = solver_batched._certified(system)[1]
    eta = m * (3 * m + 1) * 2.0**-53
    worst = 0.0
    for b in range(B):
        reg_b = weights[b] if isinstance(weights, torch.Tensor) else weights
        own = lstsq.solve_differences(
            products[b, :m, :m], products[b, :m, m], norms[b], m + 1, reg_b
        )
        assert bool(ok[b]) == bool(own.ok)
        size = max(float(own.gamma.norm()), 1e-300)
        if bool(certified[b]) and bool(ok[b]):
            bound = 2 * eta * condition[b] / (1 - eta * condition[b]) * size
            assert float((gamma[b] - own.gamma).norm()) <= bound, (b, condition[b])
            worst = max(worst, float((gamma[b] - own.gamma).abs().max()) / size)
        else:
            tolerance = 8 * torch.finfo(D).eps * max(float(own.gamma.abs().max()), 1e-300)
            torch.testing.assert_close(gamma[b], own.gamma, rtol=0, atol=tolerance)
    assert not bool(ok[4]) and torch.equal(gamma[4], torch.zeros(m, dtype=D))
    assert not bool(certified[3]) and not bool(certified[4])  # zero and NaN: the eigen route
    assert bool(certified[7:].all())  # the ill-conditioned ones are certified ...
    assert worst > 8 * torch.finfo(D).eps  # ... and round apart by more than 8 ulp


def test_the_certificate_passes_no_eigenvalue_near_the_cut_off():
    """``_certified`` against systems of known spectrum ``Q diag(lambda) Q^T`` (Q a random
    orthogonal 5 x 5, the other eigenvalues in [0.1, 4]): a certified system has every
    eigenvalue (float64 NumPy, of the stored matrix) above RTOL, the smallest ones placed
    from 1e-15 to 1e-6 around RTOL = 1e-13; where the smallest is 1e-10 or more it is
    certified (the certificate costs nothing in the common case). A plain Cholesky
    succeeds on most of the systems below the cut-off: success alone certifies nothing."""
    g = torch.Generator().manual_seed(2)
    smallest = torch.logspace(-15, -6, 28, dtype=D).repeat_interleave(4)
    q, _ = torch.linalg.qr(torch.randn(len(smallest), 5, 5, generator=g, dtype=D))
    spectrum = torch.rand(len(smallest), 5, generator=g, dtype=D) * 3.9 + 0.1
    spectrum[:, 0] = smallest
    a = q @ (spectrum[:, :, None] * q.mT)
    a = (a + a.mT) / 2  # exactly symmetric
    _, certified = solver_batched._certified(a)
    eigenvalues = np.linalg.eigvalsh(a.numpy())
    assert (eigenvalues[certified.numpy(), 0] > lstsq.RTOL).all()
    assert bool(certified[smallest >= 1e-10].all())
    below = (eigenvalues[:, 0] <= lstsq.RTOL) & (torch.linalg.cholesky_ex(a)[1] == 0).numpy()
    assert below.sum() >= 8


def test_the_eager_and_the_traced_small_solves_agree(monkeypatch):
    """Eagerly on the CPU the samples that fail the certificate are solved on their own
    (the mask read once), and a batch that passes it whole takes no finiteness test;
    traced, both solves run on every sample and the certified ones' Cholesky answers are
    kept: the same coefficients and verdicts, bit for bit."""
    f = torch.cat([windows(), conditioned_windows()])
    a = as_problem(f)
    products, norms = a @ a.mT, (f * f).sum(-1)
    eager = solver_batched.normal_coefficients(products, norms, 1e-3)
    # A batch that is all certified (the early return) answers as in the mixed batch.
    alone = solver_batched.normal_coefficients(products[7:], norms[7:], 1e-3)
    assert bool(alone[1].all()) and torch.equal(alone[0], eager[0][7:])
    monkeypatch.setattr(solver_batched.tree, "tracing", lambda: True)
    traced = solver_batched.normal_coefficients(products, norms, 1e-3)
    assert torch.equal(eager[0], traced[0]) and torch.equal(eager[1], traced[1])


# -- non-finite samples, routing -----------------------------------------------------------------
def test_a_sample_that_blows_up_stops_alone():
    """A map that returns NaN for sample 2 from its fourth call on: that sample stops with
    status "nonfinite" at its last finite iterate (finite, as its own solve's), and every other
    sample is solved exactly as alone: nothing non-finite crosses between samples."""
    W, C = batch_problem()
    g, sample = layer(W, C)
    calls = [0]

    def batch_map(z):
        calls[0] += 1
        out = g(z)
        if calls[0] >= 4:
            out[2] = math.nan
        return out

    x, info = aa.fixed_point(batch_map, torch.zeros(6, 8, dtype=D), tol=1e-12, batch_dims=1)
    assert info.status.tolist()[2] == 2 and int(info.iterations[2]) == 2
    assert bool(torch.isfinite(x).all())
    for i in (0, 1, 3, 4, 5):
        xi, ii = aa.fixed_point(sample(i), torch.zeros(8, dtype=D), tol=1e-12)
        assert int(info.iterations[i]) == int(ii.iterations) and bool(info.converged[i])
        torch.testing.assert_close(x[i], xi, rtol=0, atol=1e-12)


def test_routes(monkeypatch):
    """The batched route takes mode "classic" with float32/float64 leaves and the solver's
    options; anything else keeps the core's update under vmap, which still solves each
    sample as alone (mode "aadl" here: the same steps as its own eager solve)."""
    from aadl_func._src.options import AndersonOptions
    from aadl_func._src.solver_options import _IDENTITY

    def settings(**options):
        return AndersonOptions.for_owner("fixed_point", 2, inner=_IDENTITY, **options)

    x = [torch.zeros(3, 4)]
    assert solver_batched.supports(settings(mode="classic", reg_relative=1e-3, frequency=2), x)
    assert solver_batched.supports(settings(mode="classic"), [torch.zeros(3, 4, dtype=D)])
    assert not solver_batched.supports(settings(mode="aadl"), x)
    assert not solver_batched.supports(settings(mode="classic", reg_column=1.0), x)
    assert not solver_batched.supports(settings(mode="classic", history_dtype=torch.bfloat16), x)
    assert not solver_batched.supports(settings(mode="classic"), [torch.zeros(3, 4).half()])
    W, C = batch_problem(B=3, H=4)
    g, sample = layer(W, C)
    built = []
    route = solver_batched.batched_anderson
    monkeypatch.setattr(solver_batched, "batched_anderson", lambda o: built.append(o) or route(o))
    X, info = aa.fixed_point(g, torch.zeros(3, 4, dtype=D), mode="aadl", batch_dims=1, tol=1e-10)
    assert not built
    for i in range(3):
        xi, ii = aa.fixed_point(sample(i), torch.zeros(4, dtype=D), mode="aadl", tol=1e-10)
        assert int(info.iterations[i]) == int(ii.iterations)
        assert bool(info.converged[i]) == bool(ii.converged)


def test_pytree_with_a_matrix_leaf():
    """x0 a dict of a ``(B, 2, 3)`` and a ``(B, 4)`` float64 leaf coupled in the map: the
    window's columns span both leaves (one QR per sample of the concatenated differences);
    every sample's iterates within 1e-12 of its own solve."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(10, 10, generator=gen, dtype=D)
    W = 0.8 * W / torch.linalg.matrix_norm(W, 2)
    C = torch.randn(3, 10, generator=gen, dtype=D) * torch.tensor([[0.1], [1.0], [3.0]], dtype=D)

    def make(c):
        def g(z):
            flat = torch.cat([z["m"].flatten(1), z["v"]], 1)
            out = torch.tanh(flat @ W.T + c)
            return {"m": out[:, :6].reshape(-1, 2, 3), "v": out[:, 6:]}

        return g

    def own(i):
        g = make(C[i : i + 1])
        return lambda z: {k: v[0] for k, v in g({k: v[None] for k, v in z.items()}).items()}

    x0 = {"m": torch.zeros(3, 2, 3, dtype=D), "v": torch.zeros(3, 4, dtype=D)}
    X, info = aa.fixed_point(make(C), x0, tol=1e-11, batch_dims=1)
    for i in range(3):
        xi, ii = aa.fixed_point(own(i), {k: v[i] for k, v in x0.items()}, tol=1e-11)
        assert int(info.iterations[i]) == int(ii.iterations) and bool(ii.converged)
        for key in ("m", "v"):
            torch.testing.assert_close(X[key][i], xi[key], rtol=0, atol=1e-12)


def test_a_mix_that_is_not_finite_falls_back_to_the_plain_step(monkeypatch):
    """Per sample, as the core's step: where the combination is not finite (here sample 0's
    coefficients made Inf, so its mix is not finite) the update returns the plain step
    ``x + f``; the other samples are mixed as before."""
    from aadl_func._src.options import AndersonOptions
    from aadl_func._src.solver_options import _IDENTITY

    options = AndersonOptions.for_owner(
        "fixed_point", 2, inner=_IDENTITY, mode="classic", history_depth=3
    )
    gen = torch.Generator().manual_seed(3)
    x, f = torch.randn(3, 4, generator=gen, dtype=D), torch.randn(3, 4, generator=gen, dtype=D)
    outputs = {}
    original = solver_batched.mixing_weights
    for huge in (False, True):
        opt = solver_batched.batched_anderson(options)
        state = opt.init(x)
        y, state = opt.update(state, x, f)  # one pair: the plain step

        def weights(*args, huge=huge):
            gamma, *rest = original(*args)
            return (gamma.index_fill(0, torch.tensor([0]), math.inf) if huge else gamma), *rest

        monkeypatch.setattr(solver_batched, "mixing_weights", weights)
        outputs[huge], _ = opt.update(state, y, 0.5 * f)
        monkeypatch.setattr(solver_batched, "mixing_weights", original)
    assert torch.equal(outputs[True][0], y[0] + 0.5 * f[0])
    assert not torch.equal(outputs[False][0], y[0] + 0.5 * f[0])
    assert torch.equal(outputs[True][1:], outputs[False][1:])


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="compile of update needs torch 2.12+")
@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_under_compile_with_options(dtype):
    """torch.compile (dynamo, backend "eager", fullgraph) of a per-sample solve through the
    batched route with AA(1), relaxation and reg_relative, on the normal equations' route
    (float32) and the QR route (float64): the same steps and result as eagerly (the same
    operations: the layouts are made in the graph instead of read from the cache)."""
    torch._dynamo.reset()
    W, C = batch_problem(B=3, H=4)
    g, _ = layer(W.to(dtype), C.to(dtype))
    options = dict(tol=1e-12, max_iter=4, history_depth=2, relaxation=0.5, reg_relative=1e-3)

    def solve(x0):
        return aa.fixed_point(g, x0, batch_dims=1, **options)

    x, info = torch.compile(solve, fullgraph=True, backend="eager")(torch.zeros(3, 4, dtype=dtype))
    eager_x, eager_info = solve(torch.zeros(3, 4, dtype=dtype))
    assert torch.equal(info.iterations, eager_info.iterations)
    torch.testing.assert_close(x, eager_x, rtol=0, atol=0)
    torch._dynamo.reset()


def test_an_evaluation_stays_within_its_operation_budget():
    """Eagerly, per evaluation of a float32 batch that neither converges nor fails (every
    round in lockstep): the torch operations the loop and the batched step dispatch, views
    included, the layer's own among them. Wall-clock time is not asserted; the count is what
    the shortcuts reduce: 67.6 before the last round of them (issue 34), 51 after, 58 with
    the masked loop's lockstep switched off. The budget leaves ~10% for small changes, not
    for losing the lockstep."""
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(16, 16, generator=gen)
    W = 0.9 * W / torch.linalg.matrix_norm(W, 2)
    c = torch.randn(8, 16, generator=gen)
    z0 = torch.zeros(8, 16)

    def solve():
        return aa.fixed_point(
            lambda z: torch.tanh(z @ W.T + c), z0, tol=0.0, max_iter=11, batch_dims=1,
            history_depth=6,
        )  # fmt: skip

    solve()  # the layouts of the window's positions are made once per process
    with _CountOps() as counter:
        _, info = solve()
    assert info.status.tolist() == [1] * 8 and info.evaluations.tolist() == [12] * 8
    assert counter.count / 12 <= 56, counter.count / 12

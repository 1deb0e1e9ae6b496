"""``batch_dims=1`` through the batched route (``aadl_func/_src/solver_batched.py``).

The contract: each sample of a batch is solved as if alone. The references are independent
of the batched code: one eager solve per sample (``batch_dims=0``: the eager loop's own window,
``solver_eager``, itself held to the core's ``update`` in test_solver_eager.py and to SciPy's
steps in test_solver.py; its own float64 small solve and stopping test), and
``core/lstsq.py``'s small solves called on one sample at a time. ``test_solver_options.py``
holds the same contract with bounds derived from each sample's sensitivity; here float64 is
held to such a bound at every iterate over the solver's options (``fixed_point`` also to
1e-12), and float32 to a bound derived the same way.

As if alone, not bit for bit: the batch and the sample take other kernels (batched QR, SVD
and ``bmm`` against one problem's; the map on a batch of rows against one row), whose
roundings differ, and differ again between CPUs (MKL picks its AVX2 or AVX-512 code by the
CPU it runs on, whatever ``ATEN_CPU_CAPABILITY`` says). So the iterates are held to a
distance derived from the rounding, and a stopping decision to the sample's own wherever
that one is not decided by the rounding (``failures``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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


def evaluation_rounding(W, c, z):
    """How far two evaluations of the residual norm ``||tanh(W z + c) - z||`` at one ``z``
    can round apart (the batch's row and the sample's own, which may take other kernels):
    each rounds ``W z + c`` by at most ``gamma_{n+1} (|W| |z| + |c|)`` per entry (Higham,
    Accuracy and Stability, (3.5)), which ``tanh`` (1-Lipschitz) passes on, ``tanh`` itself
    by at most 2 ulps (``4u |tanh|``), the difference by ``u |r|`` and the norm by
    ``(n + 1) u ||r||``; twice that, once per evaluation."""
    n, u = z.shape[-1], torch.finfo(z.dtype).eps / 2
    gamma = (n + 1) * u / (1 - (n + 1) * u)
    t = torch.tanh(W @ z + c)
    r = t - z
    entry = gamma * (W.abs() @ z.abs() + c.abs()) + 4 * u * t.abs() + u * r.abs()
    return 2 * (float(entry.norm()) + (n + 1) * u * float(r.norm()))


def without_tolerance(options):
    """A solver's options with no stopping test: only ``max_iter`` (or a residual of exactly
    0) ends the solve."""
    options = {**options, "tol": 0.0, "rtol": 0.0}
    options.pop("gtol", None)
    return options


class Sample(NamedTuple):
    """One sample of the batched solve beside its own solve (``iterate_errors``).

    Attributes:
      index: the sample's place in the batch; ``fn`` its own map; ``alone`` its own solver
        options (a tolerance given per sample is its number).
      own: the own solve's iterates ``x_0 ..`` by step; where the batch went on past the own
        solve's stop, continued to the batch's step (the same solve without a tolerance: the
        stopping test decides only where the loop ends, not the iterates before).
      gaps: the distance (2-norm) of the batch's iterate to ``own``'s at each step
        ``0 .. k``, ``k`` the batch's iterations (every iterate, recorded by the callback).
      returned: the batch's returned step and that point's distance to ``own``'s.
      norm_error: the largest difference of the two runs' residual norms over ``0 .. k``.
      margins: the own solve's residual norm minus its stopping threshold at each step
        ``0 .. k`` (positive: the solve goes on; 0 or less: it stops).
      converged: whether the batch stopped the sample on its tolerance (at step ``k``).
      lipschitz, rounding: a margin moves by at most ``lipschitz`` times its iterate's
        distance plus ``rounding[j]`` between the two runs (``failures``).
      counts, own_counts: evaluations less iterations, status, and returned step less
        iterations, of the batch's sample and of the own solve.
    """

    index: int
    fn: Any
    alone: dict
    own: dict
    gaps: list
    returned: tuple
    norm_error: float
    margins: list
    converged: bool
    lipschitz: float
    rounding: list
    counts: tuple
    own_counts: tuple


def iterate_errors(kind, options, dtype=D, B=6, H=8):
    """The batched solve against each sample's own (``batch_dims=0``): a ``Sample`` per
    sample, and the batch's info.

    The stopping margins are those of the own solve, threshold ``max(tol, rtol ||r_0||,
    gtol ||g(x_j)||)``. The two runs' margins at step ``j`` differ by at most ``(1 + gtol)
    ((1 + ||W||_2) d_j + e_j) + rtol e_0``, ``d_j`` the iterates' distance: the residual
    ``tanh(W z + c) - z`` is ``(1 + ||W||_2)``-Lipschitz and ``g`` ``||W||_2``-Lipschitz,
    and ``e_j`` is their evaluations' own rounding (``evaluation_rounding``)."""
    W, C = batch_problem(B, H)
    W, C = W.to(dtype), C.to(dtype)
    g, sample = layer(W, C)
    solve_fn = aa.fixed_point if kind == "fixed_point" else aa.root
    if kind == "root":
        g0, sample0 = g, sample
        g, sample = (lambda z: g0(z) - z), (lambda i: lambda z: sample0(i)(z) - z)
    kwargs = {"max_iter": 40, "tol": torch.tensor(TOLS[:B], dtype=D), **options}
    x, info, batch = recorded(solve_fn, g, torch.zeros(B, H, dtype=dtype), batch_dims=1, **kwargs)
    samples = []
    for i in range(B):
        # A tolerance given per sample is the sample's own number.
        alone = {k: float(v[i]) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        start = torch.zeros(H, dtype=dtype)
        _, ii, own = recorded(solve_fn, sample(i), start, **alone)
        k, norms = int(info.iterations[i]), ii.residual_norms
        if k > int(ii.iterations):  # the batch went on: so does the own solve, without a stop
            on = {**without_tolerance(alone), "max_iter": k}
            _, ii_on, own_on = recorded(solve_fn, sample(i), start, **on)
            assert all(torch.equal(own_on[j], own[j]) for j in own)  # the same steps to its stop
            own, norms = own_on, ii_on.residual_norms
        tol, rtol, gtol = (alone.get(name, 0.0) for name in ("tol", "rtol", "gtol"))
        threshold = max(tol, rtol * float(norms[0]))
        margins, rounding = [], []
        e0 = evaluation_rounding(W, C[i], own[0])
        for j in range(k + 1):
            value = float(sample(i)(own[j]).norm()) if gtol else 0.0  # ||g(x_j)||: gtol's
            margins.append(float(norms[j]) - max(threshold, gtol * value))
            rounding.append((1 + gtol) * evaluation_rounding(W, C[i], own[j]) + rtol * e0)
        back = int(info.returned_iteration[i])
        samples.append(
            Sample(
                index=i,
                fn=sample(i),
                alone=alone,
                own=own,
                gaps=[float((batch[j][i] - own[j]).norm()) for j in range(k + 1)],
                returned=(back, float((x[i] - own[back]).norm())),
                norm_error=float((info.residual_norms[i, : k + 1] - norms[: k + 1]).abs().max()),
                margins=margins,
                converged=bool(info.converged[i]),
                lipschitz=(1 + gtol) * (1 + float(torch.linalg.matrix_norm(W, 2))),
                rounding=rounding,
                counts=(int(info.evaluations[i]) - k, int(info.status[i]), back - k),
                own_counts=(
                    int(ii.evaluations - ii.iterations),
                    int(ii.status),
                    int(ii.returned_iteration - ii.iterations),
                ),
            )
        )
    return samples, info


def failures(sample, bounds):
    """What of ``sample`` is not held to ``bounds`` (the distance allowed at each step
    ``0 .. k``): ``(step, what, value, limit)`` for an iterate or the returned point farther
    from the own solve's than its step's bound, and for a stopping decision of the batch
    that is not the own solve's where that one's margin is farther than ``band_j =
    lipschitz bound_j + rounding_j`` from 0 (there the two runs' margins have one sign; a
    margin within the band may take either, and so stop one run and not the other: which,
    a last-bit difference decides)."""
    found = [(j, "iterate", gap, bounds[j]) for j, gap in enumerate(sample.gaps) if gap > bounds[j]]
    back, distance = sample.returned
    if distance > bounds[back]:
        found.append((back, "returned", distance, bounds[back]))
    k = len(sample.gaps) - 1
    for j, margin in enumerate(sample.margins):
        band = sample.lipschitz * bounds[j] + sample.rounding[j]
        if j == k and sample.converged:  # the batch stopped: the own solve's margin <= band
            if margin > band:
                found.append((j, "stopped", margin, band))
        elif margin <= -band:  # the batch went on: the own solve's margin > -band
            found.append((j, "went on", margin, -band))
    return sorted(found)


def unamplified(own, delta, steps):
    """``sensitivity_bounds``' least value at steps ``0 .. steps``, where nothing amplifies:
    ``(j + 1) delta`` of the scale at step ``j``."""
    scale = max(float(z.norm()) for z in own.values())
    return [(j + 1) * delta * scale for j in range(steps + 1)]


def sensitivity_bounds(solve_fn, fn, own, delta, seed, steps, **options):
    """The bound on the distance at steps ``0 .. steps`` between two runs of a sample that
    round differently by at most ``delta`` of the iterate's scale per step (the scale: the
    largest norm of ``own``'s iterates): a difference made at step ``i`` has grown to
    ``D_ij`` by step ``j`` (measured: the sample's own solve with its iterate ``x_i`` moved
    by that much, in a random direction), so the differences made at steps ``0 .. j - 1``
    give ``sum_i max(D_ij, delta scale)`` at step ``j``, plus ``delta`` of the scale (step
    ``j``'s own); ``(j + 1) delta`` of the scale where nothing amplifies (``unamplified``).

    Each step's difference is measured where it is made (it was once a difference at the
    start only): one made at the start has been damped by the contraction when the window
    turns ill-conditioned, and one made there grows by far more (``root``'s most saturated
    sample with ``wait_iterations=3, frequency=2``: one made at step 7 is ~1000 times the
    start's by step 8, where that bound was under half the batch's distance). ``x_0`` is
    moved as the start, a later iterate in place as the map receives it: the iterate the
    solve goes on from (checked: the solve's recorded ``x_i`` is the moved one)."""
    unit = unamplified(own, delta, 0)[0]
    options = {**without_tolerance(options), "max_iter": steps}
    generator = torch.Generator().manual_seed(seed)
    grown = []
    for i in range(steps):
        nudge = torch.randn(own[0].shape, generator=generator)
        move = (unit * nudge / nudge.norm()).to(own[0].dtype)
        calls = [0]

        def moved_map(z, i=i, move=move, calls=calls):
            if calls[0] == i and i > 0:
                z.add_(move)  # x_i, before its evaluation
            calls[0] += 1
            return fn(z)

        start = own[0] + move if i == 0 else own[0].clone()
        _, _, moved = recorded(solve_fn, moved_map, start, **options)
        assert float((moved[i] - own[i]).norm()) >= unit / 2  # the move was made
        # A run stopped on a residual of exactly 0 (float32's small samples) stays there.
        moved = [moved[min(j, len(moved) - 1)] for j in range(steps + 1)]
        grown.append([float((moved[j] - own[j]).norm()) for j in range(steps + 1)])
    return [sum(max(grown[i][j], unit) for i in range(j)) + unit for j in range(steps + 1)]


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


def held_bounds(solve_fn, sample, delta):
    """``sensitivity_bounds`` of ``sample`` at steps ``0 .. k`` (the batch's iterations):
    measured up to the last step whose check its least value (``unamplified``) does not
    settle (``failures``), that least value after it (where it settles every check, so
    would the bound)."""
    bounds = unamplified(sample.own, delta, len(sample.gaps) - 1)
    unsettled = failures(sample, bounds)
    if not unsettled:
        return bounds
    last = max(step for step, *_ in unsettled)
    fn, own, seed = sample.fn, sample.own, sample.index
    return (
        sensitivity_bounds(solve_fn, fn, own, delta, seed, last, **sample.alone)
        + bounds[last + 1 :]
    )


@pytest.mark.parametrize("kind", ["fixed_point", "root"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_float64_every_iterate_equals_its_own_solve(kind, name, monkeypatch):
    """Every iterate of every sample within ``sensitivity_bounds`` (``delta = (2Q + 1) u``)
    of the sample's own solve, the samples stopping at different steps on their own
    tolerances (a stopped sample is frozen while the others go on), with the same
    evaluations per iteration, status and returned iterate. ``fixed_point``'s also within
    1e-12 (2-norm; the iterates' norms are up to ~3), and so its residual norms. The route
    is the batched one.

    Every stopping decision is the sample's own solve's wherever the rounding cannot decide
    it (``failures``): where the own solve's residual norm lies within the two runs'
    rounding of its threshold, one run may stop and the other go on (the batch is then
    held to the own solve's iterates continued past its stop). Elsewhere, the same steps.

    ``root`` has a fixed ``alpha = 0.5`` (SciPy's alpha rule is ``test_solver_options``'):
    on the most saturated sample its window turns ill-conditioned (``cond`` 1e10 to 1e14)
    for a few steps and amplifies the rounding of those steps to ~1e-10 before converging,
    as its own solve with an iterate moved by one rounding there does. Its tolerance 1e-10
    lies within that of its residual norm at step 8 (measured from 0.8e-10 to 2.3e-10
    with MKL's AVX-512, AVX2 and SSE4.2 code on one CPU): the own solve stops there with
    AVX-512 MKL and goes on with AVX2."""
    options = dict(OPTION_SETS[name])
    solve_fn = aa.fixed_point
    if kind == "root":
        options = {k: v for k, v in options.items() if k != "gtol"} | {"alpha": 0.5}
        solve_fn = aa.root
    built = []
    route = solver_batched.batched_anderson
    monkeypatch.setattr(solver_batched, "batched_anderson", lambda o: built.append(o) or route(o))
    samples, info = iterate_errors(kind, options)
    assert len(built) == 1  # the batched route, not the core's update under vmap
    assert len(set(info.iterations.tolist())) > 2  # frozen samples beside running ones
    delta = (2 * options.get("history_depth", 6) + 1) * 2.0**-53
    for s in samples:
        assert s.counts == s.own_counts, (s.index, s.counts, s.own_counts)
        bounds = held_bounds(solve_fn, s, delta)
        assert not failures(s, bounds), (s.index, failures(s, bounds))
    if kind == "fixed_point":
        assert max(max(s.gaps) for s in samples) <= 1e-12, [s.gaps for s in samples]
        assert max(s.norm_error for s in samples) <= 1e-12, [s.norm_error for s in samples]


def test_the_comparison_fails_when_two_samples_swap_weights(monkeypatch):
    """The float64 comparison has teeth: the weights of samples 0 and 1 swapped (each sample
    mixed with the other's coefficients) moves the iterates by far more than 1e-12."""
    original = solver_batched.mixing_weights

    def swapped(*args):
        gamma, *rest = original(*args)
        return gamma[[1, 0, *range(2, gamma.shape[0])]], *rest

    monkeypatch.setattr(solver_batched, "mixing_weights", swapped)
    samples, _ = iterate_errors("fixed_point", {})
    assert min(max(s.gaps) for s in samples[:2]) > 1e-6
    assert all(failures(s, [1e-12] * len(s.gaps)) for s in samples[:2])
    assert not any(failures(s, [1e-12] * len(s.gaps)) for s in samples[2:])


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
        bounds = sensitivity_bounds(aa.fixed_point, sample(i), own, delta, i, steps, **options)
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

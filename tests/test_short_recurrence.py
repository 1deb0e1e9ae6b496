"""Tests of `aa.short_recurrence` (ST-AM): conjugate gradients on a quadratic (float64 NumPy
CG), a float64 NumPy reference of the recurrence with its safeguards on a nonconvex problem,
float32, vmap, in place, saving, and bad input."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch.func import vmap
from untouched import assert_untouched, snapshot

import aadl_func as aa


def spd_problem(n, condition, seed):
    """A, b, x0 of f(x) = x.A.x / 2 - b.x, A symmetric positive definite with eigenvalues
    spread geometrically over [1, condition]."""
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = basis @ np.diag(np.geomspace(1.0, condition, n)) @ basis.T
    return a, rng.standard_normal(n), rng.standard_normal(n)


def conjugate_gradients(a, b, x0, steps):
    """The textbook CG iterates c_0 = x0, ..., c_steps on a x = b (Hestenes-Stiefel)."""
    x, r = x0.copy(), b - a @ x0
    p, iterates = r.copy(), [x0.copy()]
    for _ in range(steps):
        ap = a @ p
        alpha = (r @ r) / (p @ ap)
        x, r_new = x + alpha * p, r - alpha * ap
        p, r = r_new + (r_new @ r_new) / (r @ r) * p, r_new
        iterates.append(x.copy())
    return iterates


def run_quadratic(opt, a, b, x0, calls, dtype=torch.float64):
    """The params after each call of `opt` on the quadratic's gradients (float64 NumPy)."""
    at, bt = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
    x = torch.tensor(x0, dtype=dtype)
    state, out = opt.init(x), []
    for _ in range(calls):
        x, state = opt.update(state, x, at @ x - bt)
        out.append(x.double().numpy())
    return out, state


@pytest.mark.parametrize("relaxation", [1.0, 0.5])
def test_gradient_descent_on_a_quadratic_follows_conjugate_gradients(relaxation):
    """x_{k+1} = c_k + beta r(c_k), r = -lr (A x - b): the mix before relaxation is CG's
    iterate (type-I Anderson mixing with a full window is CG on an SPD problem; two
    conjugate pairs do the same). Plain gradient descent is far from it, so the test has
    teeth."""
    a, b, x0 = spd_problem(30, 100.0, seed=0)
    lr, calls = 1e-2, 10
    outs, state = run_quadratic(
        aa.short_recurrence(aa.sgd(lr), relaxation=relaxation), a, b, x0, calls
    )
    cg = conjugate_gradients(a, b, x0, calls)
    for k in range(calls):
        expected = cg[k] - relaxation * lr * (a @ cg[k] - b)
        np.testing.assert_allclose(outs[k], expected, rtol=0, atol=1e-8 * np.abs(expected).max())
    assert int(state.num_restarts) == 1  # the first call only
    descent = x0.copy()
    for _ in range(calls):
        descent = descent - lr * (a @ descent - b)
    assert np.linalg.norm(outs[-1] - descent) > 1e4 * 1e-8 * np.abs(descent).max()


def preconditioned_cg(a, b, x0, d, steps):
    """The textbook preconditioned CG iterates c_0 = x0, ..., c_steps on a x = b with the
    preconditioner M^-1 = diag(d)."""
    x, r = x0.copy(), b - a @ x0
    z = d * r
    p, iterates = z.copy(), [x0.copy()]
    for _ in range(steps):
        ap = a @ p
        alpha = (r @ z) / (p @ ap)
        x, r_new = x + alpha * p, r - alpha * ap
        z_new = d * r_new
        p, r, z = z_new + (r_new @ z_new) / (r @ z) * p, r_new, z_new
        iterates.append(x.copy())
    return iterates


def test_a_fixed_diagonal_preconditioner_gives_preconditioned_cg():
    """An inner step u = -D g with D a fixed positive diagonal (what Adam's step is when its
    second moment settles): the mix before relaxation is PCG's iterate with M^-1 = D, because
    the Galerkin condition is on the gradient (the published ST-AM's, on the residual u,
    is not PCG for D != c I). The problem is badly scaled, so that D matters."""
    a, b, x0 = spd_problem(30, 10.0, seed=2)
    scales = np.geomspace(1.0, 30.0, 30)
    a = scales[:, None] * a * scales[None, :]  # condition ~1e4; D = 1/scales^2 undoes it
    d = 0.5 / (scales**2 * 10.0)
    dt = torch.tensor(d)

    def inner_update(updates, state, params=None, inplace=False):
        return -dt * updates, state

    inner = aa.InnerOptimizer(init=lambda params: (), update=inner_update)
    outs, state = run_quadratic(aa.short_recurrence(inner), a, b, x0, 10)
    pcg = preconditioned_cg(a, b, x0, d, 10)
    for k in range(10):
        expected = pcg[k] - d * (a @ pcg[k] - b)
        np.testing.assert_allclose(outs[k], expected, rtol=0, atol=1e-8 * np.abs(expected).max())
    assert int(state.num_restarts) == 1
    unpreconditioned = conjugate_gradients(a, b, x0, 10)[9]
    assert np.abs(unpreconditioned - pcg[9]).max() > 1e-3 * np.abs(pcg[9]).max()


def test_float32_gets_far_closer_than_a_long_window():
    """float32, n = 200, condition 1e3: in 300 calls two conjugate pairs reach a residual
    below 1e-7 of the first (2e-8 here), and classic AA with 20 pairs stays 5x above that
    (5e-7 here: its window is not a Krylov basis)."""
    a, b, x0 = spd_problem(200, 1e3, seed=1)
    r0 = np.linalg.norm(a @ x0 - b)
    short, _ = run_quadratic(aa.short_recurrence(aa.sgd(1e-3)), a, b, x0, 300, torch.float32)
    window = aa.anderson(aa.sgd(1e-3), mode="classic", history_depth=20)
    long, _ = run_quadratic(window, a, b, x0, 300, torch.float32)
    residual = [np.linalg.norm(a @ x - b) / r0 for x in (short[-1], long[-1])]
    assert residual[0] < 1e-7 and residual[1] > 5 * residual[0], residual


# --------------------------------------------------------------------------------------------
# The reference: the recurrence written plainly, with a full 2 x 2 solve, in float64 NumPy.
# --------------------------------------------------------------------------------------------


class NumpyShortRecurrence:
    """ST-AM around gradient descent (step `lr`) as the module docstring states it: triples
    as a list (oldest first, at most two), Gram-Schmidt against them, the drift estimate, the
    curvature test, `np.linalg.solve` of P^T Y Gamma = P^T g, and the deferred safeguard
    with its wait: after a rejection the next 1, 2, 4, ... (at most `max_wait`) calls take
    the plain step, the run of rejections ending at a kept mix."""

    def __init__(self, lr, relaxation=1.0, eps=1e-10, drift_tol=1e-3, max_wait=0):
        self.lr, self.beta, self.eps, self.tol = lr, relaxation, eps, drift_tol
        self.pairs, self.prev, self.pending = [], None, np.inf
        self.max_wait, self.wait, self.next_wait = max_wait, 0, min(1, max_wait)
        self.counts = {"restarts": 0, "rejected": 0, "drift": 0, "mixes": 0, "waits": 0}

    def step(self, x, grad, loss):
        r = -self.lr * grad
        if loss is not None and np.isfinite(self.pending):
            if not loss < self.pending:
                self.counts["rejected"] += 1
                self.counts["restarts"] += 1
                self.pairs, self.pending = [], np.inf
                self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, self.max_wait)
                x_prev, r_prev, _ = self.prev
                return x_prev + self.beta * r_prev
            self.next_wait = min(1, self.max_wait)  # a kept mix
        waiting, self.wait = self.wait > 0, max(self.wait - 1, 0)
        triple = None
        if self.prev is not None:
            raw = (x - self.prev[0], r - self.prev[1], grad - self.prev[2])
            (p, q, y), error = raw, 0.0
            for p_i, q_i, y_i, e_i in self.pairs:
                zeta = (p_i @ y) / (p_i @ y_i)
                p, q, y = p - zeta * p_i, q - zeta * q_i, y - zeta * y_i
                error += abs(zeta) * e_i
            error = (np.finfo(np.float64).eps * np.linalg.norm(raw[0]) + error) / np.linalg.norm(p)
            if not error <= self.tol:
                self.counts["drift"] += 1
                (p, q, y), error, self.pairs = raw, np.finfo(np.float64).eps, []
            norm = np.linalg.norm(p)
            if p @ y > self.eps * norm * np.linalg.norm(y):
                triple = (p / norm, q / norm, y / norm, error)
        self.prev = (x.copy(), r.copy(), grad.copy())
        if triple is None:
            self.counts["restarts"] += 1
            self.pairs, self.pending = [], np.inf
            return x + self.beta * r
        self.pairs = [*self.pairs, triple][-2:]
        if waiting:
            self.counts["waits"] += 1
            self.pending = np.inf
            return x + self.beta * r
        p_mat, q_mat, y_mat = (np.stack([t[i] for t in self.pairs], axis=1) for i in range(3))
        gamma = np.linalg.solve(p_mat.T @ y_mat, p_mat.T @ grad)
        self.counts["mixes"] += 1
        self.pending = np.inf if loss is None or not np.isfinite(loss) else loss
        return x + self.beta * r - (p_mat + self.beta * q_mat) @ gamma


def rosenbrock(x):
    """The extended Rosenbrock function and its gradient, float64 NumPy."""
    a, b = x[0::2], x[1::2]
    f = np.sum(100.0 * (b - a**2) ** 2 + (1.0 - a) ** 2)
    g = np.empty_like(x)
    g[0::2] = -400.0 * a * (b - a**2) - 2.0 * (1.0 - a)
    g[1::2] = 200.0 * (b - a**2)
    return f, g


@pytest.mark.parametrize("max_wait", [16, 0])
def test_matches_the_numpy_recurrence_on_rosenbrock_with_the_deferred_safeguard(max_wait):
    """60 calls on extended Rosenbrock (nonconvex: curvature restarts, rejected mixes and,
    with `max_wait`, waits after them happen, which the reference counts), float64, to
    rounding."""
    x0 = np.tile([-1.2, 1.0], 5) + 0.1 * np.random.default_rng(3).standard_normal(10)
    reference = NumpyShortRecurrence(2e-3, max_wait=max_wait)
    opt = aa.short_recurrence(aa.sgd(2e-3), max_wait=max_wait)
    x_ref, x = x0.copy(), torch.tensor(x0)
    state = opt.init(x)
    for call in range(60):
        f, g = rosenbrock(x_ref)
        x_ref = reference.step(x_ref, g, f)
        f_t, g_t = rosenbrock(x.numpy())
        x, state = opt.update(state, x, torch.tensor(g_t), loss=torch.tensor(f_t))
        np.testing.assert_allclose(x.numpy(), x_ref, rtol=1e-9, atol=1e-11, err_msg=f"call {call}")
    counts = reference.counts
    assert counts["rejected"] >= 5 and counts["restarts"] >= 10 and counts["mixes"] >= 30, counts
    assert (counts["waits"] >= 5) == (max_wait > 0), counts
    assert int(state.num_rejected) == counts["rejected"]
    assert int(state.num_restarts) == counts["restarts"]


@pytest.mark.parametrize("max_wait, gaps", [(4, [3, 4, 6, 6, 6]), (0, [2, 2, 2, 2, 2])])
def test_after_a_rejection_the_mixes_wait_twice_as_long_up_to_max_wait(max_wait, gaps):
    """A loss that grows every call rejects every mix. Call 1 mixes (one pair), call 2
    rejects it (the plain step it replaced) and waits 1 call, call 4 mixes again, call 5
    rejects it and waits 2, then 4, then `max_wait` = 4 each time: the calls between
    mixes are 3, 4, 6, 6, ... Without waits (`max_wait=0`) every other call mixes."""
    a, b, x0 = spd_problem(10, 10.0, seed=1)
    at, bt = torch.tensor(a), torch.tensor(b)
    opt = aa.short_recurrence(aa.sgd(1e-2), max_wait=max_wait)
    x = torch.tensor(x0)
    state, mixes = opt.init(x), []
    for call in range(40):
        x, state = opt.update(state, x, at @ x - bt, loss=float(call))
        if torch.isfinite(state.pending_loss):  # a mix was returned, its loss pending
            mixes.append(call)
    assert mixes[0] == 1 and int(state.num_rejected) == len(mixes) - (mixes[-1] == 39)
    assert np.diff(mixes)[: len(gaps)].tolist() == gaps


def test_drift_estimates_and_resets_match_the_reference():
    """At relaxation 0.5 on a quadratic the conjugate pairs' errors grow about tenfold per
    call: both implementations estimate the same errors and reset at the same calls. (The
    two trajectories differ by about the estimate, so they are compared by their decisions.)"""
    a, b, x0 = spd_problem(30, 100.0, seed=0)
    reference = NumpyShortRecurrence(1e-2, 0.5)
    opt = aa.short_recurrence(aa.sgd(1e-2), relaxation=0.5)
    x_ref, x = x0.copy(), torch.tensor(x0)
    state, resets, eps = opt.init(x), [], np.finfo(np.float64).eps
    for call in range(30):
        x_ref = reference.step(x_ref, a @ x_ref - b, None)
        x, state = opt.update(state, x, torch.tensor(a) @ x - torch.tensor(b))
        expected = reference.pairs[-1][3] if reference.pairs else 0.0
        estimate = float(state.pair_errors[1])
        assert (expected == eps) == (estimate == eps), call
        resets += [call] if expected == eps and call > 1 else []
        assert estimate == pytest.approx(expected, rel=0.5), call
    assert resets == [14, 28]


def drift_run(opt, a, b, x0, calls):
    """`calls` updates of `opt` on the quadratic with minimizer x* = A^-1 b, the gradient taken
    as A (x - x*); the residuals after each call and the largest relative error
    |y - A p| / |A p| of a pair in the window at any call (every pair is a combination of
    secants, for which y = A p holds to rounding: the error is the drift). The residuals are
    torch's, which a diverging run overflows to Inf without a warning."""
    x_star = np.linalg.solve(a, b)
    at, x_st = torch.tensor(a), torch.tensor(x_star)
    x = torch.tensor(x0)
    state, residuals, drift = opt.init(x), [], 0.0
    for _ in range(calls):
        x, state = opt.update(state, x, at @ (x - x_st))
        residuals.append(float(torch.linalg.vector_norm(at @ (x - x_st))))
        rows = slice(2 - int(state.num_pairs), 2)  # row 1 is the newest pair
        p, y = state.directions[rows].numpy(), state.grad_changes[rows].numpy()
        ap = p @ a  # A is symmetric
        errors = np.linalg.norm(y - ap, axis=1) / np.linalg.norm(ap, axis=1)
        drift = np.max([drift, *errors])  # NaN, were there one, would stay
    return residuals, drift


def test_drift_control_keeps_the_run_stable():
    """At relaxation 0.5 the conjugate pairs' errors grow about tenfold per call. With no
    drift control (an infinite tolerance) nothing stops them: within 100 calls a pair in the
    window no longer satisfies the secant relation y = A p at all (relative error 1.6 and
    above in 400 runs whose start or A differ by a unit in the last place, with AVX2 and
    with AVX512 kernels), after which the run stalls or diverges (above its first residual
    within 150 calls in 80-90% of them; when is up to the last bits, so that is not
    asserted). The default tolerance restarts the window first: its pairs stay within 2e-2
    of the relation in those runs (0.2 asserted, a tenth of the free runs' least), and the
    run converges below 1e-8 of its first residual in 100 calls (8e-11 at worst) and never
    rises above it.

    The gradient is A (x - x*): its rounding is relative to its own size, so the secants
    carry relative errors near the unit roundoff all the way down and the window's error is
    the recurrence's own, which `drift_tol` estimates. A x - b leaves an absolute error of
    about u |A| |x| that the secants carry relative to their shrinking size; near convergence
    that seeds errors the estimate does not see, and without a loss a type-I run can leave
    convergence there whatever the tolerance (test_with_the_loss_..., module docstring)."""
    a, b, x0 = spd_problem(30, 100.0, seed=0)
    r0 = np.linalg.norm(a @ x0 - b)
    opt = aa.short_recurrence(aa.sgd(1e-2), relaxation=0.5)
    residuals, drift = drift_run(opt, a, b, x0, 100)
    assert np.min(residuals) < 1e-8 * r0 and np.max(residuals) <= r0, np.min(residuals) / r0
    assert drift < 0.2, drift
    free = aa.short_recurrence(aa.sgd(1e-2), relaxation=0.5, drift_tol=1e300)
    _, drift = drift_run(free, a, b, x0, 100)
    assert drift > 0.2, drift


def rounding_variants(x0, count, seed=0):
    """`x0` and `count - 1` copies of it moved by one unit in the last place in every entry,
    up or down at random (seeded): differences of the size by which two machines' roundings
    part (AVX2 or AVX512 reductions, FMA or not), after which a run at the rounding floor
    takes a course of its own."""
    rng = np.random.default_rng(seed)
    directions = [np.where(rng.random(x0.shape) < 0.5, -np.inf, np.inf) for _ in range(count - 1)]
    return [x0, *(np.nextafter(x0, d) for d in directions)]


def kept_point_bound(a, b):
    """The largest gradient norm of a point the loss safeguard can keep at the rounding floor
    of f(x) = x.A.x / 2 - b.x. Near x* the loss's rounding is at most
    delta = (2n + 1) u (|x*|.|A|.|x*| / 2 + |b|.|x*|) (x.A.x is two n-term sums deep, b.x
    one; worst case, first order), so a mix made from a point at the floor is kept only if
    f - f(x*) < 2 delta, where |A (x - x*)|^2 <= 2 lambda_max (f - f(x*)) < 4 lambda_max
    delta. For the tests' quadratic: 1.1e-7 of the first residual."""
    x_star, u = np.linalg.solve(a, b), np.finfo(np.float64).eps / 2
    delta = (2 * len(a) + 1) * u * (np.abs(x_star) @ np.abs(a) @ np.abs(x_star) / 2)
    delta += (2 * len(a) + 1) * u * (np.abs(b) @ np.abs(x_star))
    return math.sqrt(4 * np.linalg.eigvalsh(a)[-1] * delta)


@pytest.mark.parametrize("max_wait", [0, 16])
@pytest.mark.parametrize("relaxation", [1.0, 0.5])
def test_with_the_loss_a_run_stays_at_the_rounding_floor(relaxation, max_wait):
    """Without a loss these runs can leave the rounding floor (the next test); with `loss=`
    the rejected mixes restart the window there, and in 300 calls no point the run keeps
    after call 200 rises above what the loss can tell from the floor (`kept_point_bound`;
    7e-10 of the first residual at most in 160 runs whose start or A differ by a unit in the
    last place, with AVX2 and with AVX512 kernels). A rejected point, evaluated and dropped,
    is not bounded (up to 1e-2 of the first residual in those runs, with waits): it is a
    type-I mix of secants that are mostly the gradients' rounding, which the safeguard
    judges but does not shape. From x0 and two rounding variants of it: which mixes go
    astray depends on the last bits of the rounding, that the safeguard catches them does
    not."""
    a, b, x0 = spd_problem(30, 100.0, seed=0)
    at, bt = torch.tensor(a), torch.tensor(b)
    bound = kept_point_bound(a, b)
    opt = aa.short_recurrence(aa.sgd(1e-2), relaxation=relaxation, max_wait=max_wait)
    for start in rounding_variants(x0, 3):
        x = torch.tensor(start)
        state, residuals, kept = opt.init(x), [], []
        for _ in range(300):
            g = at @ x - bt
            residuals.append(float(g.norm()))
            rejected = int(state.num_rejected)
            x, state = opt.update(state, x, g, loss=0.5 * x @ at @ x - bt @ x)
            kept.append(int(state.num_rejected) == rejected)  # this call kept the point it was at
        r0 = residuals[0]
        assert max(residuals[1:]) < r0 and min(residuals) < 1e-10 * r0
        floor = [r for r, k in zip(residuals[200:], kept[200:]) if k]
        assert len(floor) > 50 and max(floor) < bound, max(floor) / r0
        assert int(state.num_rejected) > 0


@pytest.mark.parametrize("relaxation", [1.0, 0.5])
def test_without_the_loss_a_run_leaves_the_rounding_floor(relaxation):
    """The contrast for the test above: without a loss the same run (every point kept) rises
    above `kept_point_bound` after call 200 in 56-67% of runs at relaxation 1 and 97% at 0.5
    (starts or A a unit in the last place apart, with AVX2 and with AVX512 kernels): whether
    and when is up to the last bits. So this asks it of one run among x0 and 15 rounding
    variants of it; that none does has a chance near 0.45^16 = 3e-6."""
    a, b, x0 = spd_problem(30, 100.0, seed=0)
    bound = kept_point_bound(a, b)
    free = aa.short_recurrence(aa.sgd(1e-2), relaxation=relaxation)

    def leaves(start):
        outs, _ = run_quadratic(free, a, b, start, 299)  # outs[k] is the point of call k + 1
        with np.errstate(over="ignore", invalid="ignore"):  # a diverged run overflows (NaN: left)
            return not all(np.linalg.norm(a @ x - b) <= bound for x in outs[199:])

    assert any(leaves(start) for start in rounding_variants(x0, 16))


# --------------------------------------------------------------------------------------------
# Execution: vmap, in place, pytrees, saving; bad input; non-finite values.
# --------------------------------------------------------------------------------------------


def tree_problem(seed, dtype=torch.float32):
    """A two-leaf pytree of params and a smooth convex loss with its gradient."""
    g = torch.Generator().manual_seed(seed)
    target = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    target = {k: v.to(dtype) for k, v in target.items()}

    def loss_and_grad(params):
        diff = {k: params[k] - target[k] for k in params}
        loss = sum((d**2).sum() + 0.1 * (d**4).sum() for d in diff.values())
        grads = {k: 2 * d + 0.4 * d**3 for k, d in diff.items()}
        return loss, grads

    return {"w": torch.zeros(3, 4, dtype=dtype), "b": torch.zeros(4, dtype=dtype)}, loss_and_grad


def train(opt, state, params, loss_and_grad, calls):
    """`calls` updates of `opt` on `loss_and_grad`'s gradients, judged by its loss."""
    for _ in range(calls):
        loss, grads = loss_and_grad(params)
        params, state = opt.update(state, params, grads, loss=loss)
    return params, state


def test_vmap_ensemble_equals_member_by_member():
    """Adam inside, a two-leaf tree, float64 (in float32 a decision near its threshold can
    go the other way under vmap's other summation order, and the runs part)."""
    opt = aa.short_recurrence(aa.adam(0.05, betas=(0.0, 0.999)))
    members = [tree_problem(seed, torch.float64) for seed in range(3)]
    loops = []
    for params, loss_and_grad in members:
        state = opt.init(params)
        params, state = train(opt, state, params, loss_and_grad, 15)
        loops.append(params)
    stacked = {k: torch.stack([m[0][k] for m in members]) for k in ("w", "b")}
    state = vmap(opt.init)(stacked)

    params = stacked
    for _ in range(15):
        losses, grads = zip(*[members[i][1]({k: params[k][i] for k in params}) for i in range(3)])
        grads = {k: torch.stack([g[k] for g in grads]) for k in params}
        params, state = vmap(lambda s, p, g, value: opt.update(s, p, g, loss=value))(
            state, params, grads, torch.stack(list(losses))
        )
    for i, loop in enumerate(loops):
        for k in loop:
            torch.testing.assert_close(params[k][i], loop[k], rtol=1e-9, atol=1e-12)


def test_vmap_takes_the_masked_path_with_the_same_decisions_as_eager():
    """Under vmap every choice is a mask (eagerly they are Python branches): three
    Rosenbrock members whose runs restart and reject mixes at different calls give the
    eager runs' iterates to rounding (float64)."""
    rng = np.random.default_rng(5)
    starts = [np.tile([-1.2, 1.0], 5) + 0.1 * rng.standard_normal(10) for _ in range(3)]
    opt = aa.short_recurrence(aa.sgd(2e-3))
    eager, rejected = [], []
    for x0 in starts:
        x = torch.tensor(x0)
        state = opt.init(x)
        for _ in range(40):
            f, g = rosenbrock(x.numpy())
            x, state = opt.update(state, x, torch.tensor(g), loss=torch.tensor(f))
        eager.append(x)
        rejected.append(int(state.num_rejected))
    assert len(set(rejected)) > 1 and min(rejected) > 0, rejected

    def batched_rosenbrock(x):
        f, g = zip(*[rosenbrock(row) for row in x.numpy()])
        return torch.tensor(np.array(f)), torch.tensor(np.array(g))

    x = torch.tensor(np.array(starts))
    state = vmap(opt.init)(x)
    step = vmap(lambda s, p, g, f: opt.update(s, p, g, loss=f))
    for _ in range(40):
        f, g = batched_rosenbrock(x)
        x, state = step(state, x, g, f)
    torch.testing.assert_close(x, torch.stack(eager), rtol=1e-9, atol=1e-12)
    assert state.num_rejected.tolist() == rejected


@pytest.mark.skipif(torch.__version__ < (2, 12), reason="torch.compile of update needs 2.12+")
def test_compiled_update_is_one_graph_and_takes_the_eager_decisions():
    """`torch.compile(update, fullgraph=True)` traces the masked route in one graph; from the
    same state and params each call equals the eager one (float64, Rosenbrock: restarts and
    rejected mixes included) and threads the same counters."""
    torch._dynamo.reset()
    opt = aa.short_recurrence(aa.sgd(2e-3))

    def step(state, params, grads, loss):
        return opt.update(state, params, grads, loss=loss)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    x0 = np.tile([-1.2, 1.0], 5) + 0.1 * np.random.default_rng(3).standard_normal(10)
    x = torch.tensor(x0)
    state = opt.init(x)
    for call in range(40):
        f, g = (torch.tensor(v) for v in rosenbrock(x.numpy()))
        out, compiled_state = compiled(state, x.clone(), g, f)
        x, state = step(state, x, g, f)
        torch.testing.assert_close(out, x, rtol=1e-12, atol=1e-14, msg=f"call {call}")
        for name in ("count", "num_pairs", "num_restarts", "num_rejected"):
            assert int(getattr(compiled_state, name)) == int(getattr(state, name)), (call, name)
    assert int(state.num_rejected) >= 3 and int(state.num_restarts) >= 5
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_train(dtype):
    """bf16 and fp16 params (the vectors and their dots in that dtype): 60 calls around Adam
    end below 1e-2 on the two-leaf problem (5e-4 and 5e-5 here), where Adam alone is still
    near 0.3; the window never holds a non-finite number."""
    params, loss_and_grad = tree_problem(0)
    params = {k: v.to(dtype) for k, v in params.items()}
    opt = aa.short_recurrence(aa.adam(0.05, betas=(0.0, 0.999)))
    state = opt.init(params)
    for _ in range(60):
        loss, grads = loss_and_grad({k: v.float() for k, v in params.items()})
        params, state = opt.update(
            state, params, {k: g.to(dtype) for k, g in grads.items()}, loss=loss
        )
    assert all(v.dtype == dtype for v in params.values())
    assert float(loss_and_grad({k: v.float() for k, v in params.items()})[0]) < 1e-2
    assert torch.isfinite(state.directions).all() and torch.isfinite(state.grad_changes).all()


def test_in_place_writes_the_same_values_into_the_params():
    opt = aa.short_recurrence(aa.sgd(0.1))
    params, loss_and_grad = tree_problem(0)
    copy = {k: v.clone() for k, v in params.items()}
    s1, s2 = opt.init(params), opt.init(copy)
    for _ in range(8):
        loss, grads = loss_and_grad(params)
        out, s1 = opt.update(s1, params, grads, loss=loss, inplace=True)
        assert all(out[k].data_ptr() == params[k].data_ptr() for k in params)
        loss, grads = loss_and_grad(copy)
        copy, s2 = opt.update(s2, copy, grads, loss=loss)
        assert all(torch.equal(params[k], copy[k]) for k in params)


def test_state_saves_and_resumes_bit_for_bit():
    opt = aa.short_recurrence(aa.adam(0.05))
    params, loss_and_grad = tree_problem(1)
    state = opt.init(params)
    params, state = train(opt, state, params, loss_and_grad, 5)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert isinstance(loaded, aa.ShortRecurrenceState)
    a, b = params, {k: v.clone() for k, v in params.items()}
    for _ in range(5):
        loss, grads = loss_and_grad(a)
        a, state = opt.update(state, a, grads, loss=loss)
        loss, grads = loss_and_grad(b)
        b, loaded = opt.update(loaded, b, grads, loss=loss)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_non_finite_gradient_never_enters_the_window():
    """NaN gradients without a loss give the plain step (NaN, as the inner optimizer alone
    would) and leave the window finite; from finite params again the run goes on and
    converges. With the loss (NaN too) the pending mix is rejected instead, and the call
    returns the finite plain step that mix replaced."""
    opt = aa.short_recurrence(aa.sgd(0.1))
    params, loss_and_grad = tree_problem(2)
    state = opt.init(params)
    params, state = train(opt, state, params, loss_and_grad, 4)
    assert int(state.num_pairs) > 0 and torch.isfinite(state.pending_loss)
    bad = {k: torch.full_like(v, float("nan")) for k, v in params.items()}
    out, judged = opt.update(state, params, bad, loss=torch.tensor(float("nan")))
    back = {k: state.params[i] + state.residual[i] for k, i in (("b", slice(0, 4)),)}
    torch.testing.assert_close(out["b"], back["b"], rtol=0, atol=0)
    assert int(judged.num_rejected) == int(state.num_rejected) + 1
    out, state = opt.update(state, params, bad)
    assert all(torch.isnan(v).all() for v in out.values())
    for field in ("directions", "residual_changes", "params", "residual", "pair_errors"):
        assert torch.isfinite(getattr(state, field)).all(), field
    params, state = train(opt, state, params, loss_and_grad, 40)
    assert float(loss_and_grad(params)[0]) < 1e-8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"relaxation": 0.0}, ValueError, "`relaxation` must be finite and > 0"),
        ({"relaxation": float("nan")}, ValueError, "`relaxation`"),
        ({"curvature_eps": -1.0}, ValueError, "`curvature_eps` must be finite and >= 0"),
        ({"drift_tol": 0.0}, ValueError, "`drift_tol` must be finite and > 0"),
        ({"relaxation": "1"}, TypeError, "`relaxation` must be a real number"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        aa.short_recurrence(aa.sgd(0.1), **kwargs)


def test_bad_inner_is_refused():
    with pytest.raises(TypeError, match="`inner` must be an inner optimizer"):
        aa.short_recurrence(torch.optim.SGD)


def test_bad_calls_are_refused_before_anything_is_written():
    opt = aa.short_recurrence(aa.sgd(0.1))
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    state = opt.init(params)
    grads = {"w": torch.ones(3), "b": torch.ones(2)}
    with pytest.raises(ValueError, match="`loss` must be one real value"):
        opt.update(state, params, grads, loss=torch.ones(2), inplace=True)
    with pytest.raises(ValueError, match="different pytree structure"):
        opt.update(state, params, {"w": torch.ones(3)}, inplace=True)
    with pytest.raises(ValueError, match=r"`state.directions` is .*was it made for other params"):
        opt.update(opt.init({"w": torch.ones(4), "b": torch.ones(2)}), params, grads, inplace=True)
    with pytest.raises(TypeError, match="must be an ShortRecurrenceState"):
        opt.update(aa.sgd(0.1).init(params), params, grads, inplace=True)
    assert all(torch.equal(v, torch.ones_like(v)) for v in params.values())
    assert int(state.count) == 0


@pytest.mark.parametrize("num", [1.0, -1.0, 0.0])
def test_a_zero_curvature_divides_alike_eagerly_and_in_masks(num):
    """On a diverging run a kept pair's curvature can underflow to 0 once its step is
    scaled to unit length: the eager route divides as IEEE does (Inf or NaN, which the
    finiteness test then turns into the plain step), like the masked one, and raises
    nothing."""
    from aadl_func._src.short_recurrence import _Arith

    eager = _Arith(True).ratio(num, 0.0, True)
    masked = _Arith(False).ratio(torch.tensor(num, dtype=torch.float64), torch.tensor(0.0,
                                 dtype=torch.float64), torch.tensor(True))  # fmt: skip
    assert torch.equal(torch.tensor(eager, dtype=torch.float64), masked) or (
        math.isnan(eager) and torch.isnan(masked)
    )
    assert _Arith(True).ratio(num, 0.0, False) == 0.0


def test_an_eager_call_stays_within_its_operation_budget():
    """Eagerly the scalar work is Python arithmetic: a call with a full window dispatches 125
    torch operations (the inner Adam's and the flattening included); the all-mask route that
    vmap takes, run eagerly, dispatches 271. Wall-clock time is not asserted; the budget,
    135, fails if the eager route is lost, which changes no result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountOps.count += 1
            return func(*args, **(kwargs or {}))

    opt = aa.short_recurrence(aa.adam(1e-3))
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    state = opt.init(x)
    for k in range(5):  # a falling loss: every mix is kept
        x, state = opt.update(state, x, 0.01 * x + 0.001, loss=torch.tensor(10.0 - k))
    assert int(state.num_pairs) == 2 and int(state.num_rejected) == 0
    grads, loss = 0.01 * x + 0.001, torch.tensor(1.0)
    with CountOps():
        opt.update(state, x, grads, loss=loss)
    assert CountOps.count <= 135, CountOps.count


def _filled_state(opt, params):
    """A state after three updates from a copy of `params` (its window holds pairs)."""
    x = {k: v.clone() for k, v in params.items()}
    state = opt.init(x)
    for k in range(3):
        x, state = opt.update(state, x, {n: (k + 1) * v + 0.5 for n, v in x.items()})
    return state


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    ("grad", "error", "match"),
    [
        # once broadcast against the (5,) params
        (torch.ones(1), ValueError, r"`grads\['w'\]` has shape \(1,\), expected \(5,\)"),
        (torch.tensor(1.0), ValueError, r"`grads\['w'\]` has shape \(\), expected \(5,\)"),
        (torch.ones(5, 1), ValueError, r"`grads\['w'\]` has shape \(5, 1\), expected \(5,\)"),
        # once cast (the complex one losing its imaginary part)
        (torch.ones(5, dtype=torch.int64), TypeError, r"`grads\['w'\]` has dtype torch.int64"),
        (torch.ones(5, dtype=torch.complex64), TypeError, r"`grads\['w'\]` has dtype torch.comp"),
        (torch.ones(5, dtype=torch.float64), TypeError, r"`grads\['w'\]` has dtype torch.float64"),
        (1.0, TypeError, r"`grads` must be a pytree of tensors; `grads\['w'\]` is float"),
    ],
    ids=["shape-1", "shape-0d", "shape-5x1", "int64", "complex64", "float64", "float"],
)
def test_grads_must_have_the_params_shapes_and_dtypes(grad, error, match, inplace):
    opt = aa.short_recurrence(aa.sgd(0.1))
    params = {"a": torch.linspace(-1.0, 1.0, 3), "w": torch.linspace(0.0, 1.0, 5)}
    state = _filled_state(opt, params)
    grads = {"a": torch.ones(3), "w": grad}
    taken = snapshot(state, params, grads)
    with pytest.raises(error, match=r"^short_recurrence.update: " + match):
        opt.update(state, params, grads, inplace=inplace)
    assert_untouched(taken)


@pytest.mark.parametrize("inplace", ["no", 1, None, torch.tensor(True)])
def test_inplace_must_be_a_bool(inplace):
    opt = aa.short_recurrence(aa.sgd(0.1))
    params = {"w": torch.linspace(0.0, 1.0, 5)}
    state, grads = _filled_state(opt, params), {"w": torch.ones(5)}
    taken = snapshot(state, params, grads)
    with pytest.raises(TypeError, match=r"^short_recurrence.update: `inplace` must be a bool"):
        opt.update(state, params, grads, inplace=inplace)
    assert_untouched(taken)


def test_in_place_refuses_an_expanded_params_leaf_before_writing_any():
    """An expanded leaf (stride 0) cannot be written once per element: refused up front,
    not after the leaves before it were written (torch's raw RuntimeError). Out of place it
    is an ordinary input."""
    opt = aa.short_recurrence(aa.sgd(0.1))
    params = {"a": torch.linspace(-1.0, 1.0, 3), "w": torch.zeros(1).expand(5)}
    grads = {"a": torch.ones(3), "w": torch.ones(5)}
    state = _filled_state(opt, {k: v.contiguous() for k, v in params.items()})
    taken = snapshot(state, params, grads)
    with pytest.raises(ValueError, match=r"`params\['w'\]` has elements that share memory"):
        opt.update(state, params, grads, inplace=True)
    assert_untouched(taken)
    out, _ = opt.update(state, params, grads)
    dense, _ = opt.update(state, {k: v.contiguous() for k, v in params.items()}, grads)
    assert all(torch.equal(out[k], dense[k]) for k in out)

"""Low-precision windows on every execution path: the state's Gram is the window's own.

The invariant (``window_invariant.py``): after every call, the float64 Gram matrices in the
state are those of the values the ring *stores*, rounded to ``history_dtype``. It is checked
here for both modes, every window dtype, the safeguard keeping and rejecting, ``average``,
``store_each_nth`` and ``frequency``, on the eager pure and in-place paths, under ``vmap`` and
compiled (sharded runs: ``test_sharded_precision.py``). The reference recomputes the Gram
matrices from the stored ring with NumPy, independently of the code under test.

Two more checks that a float64-only suite would miss:

* a compiled step equals the eager one with bf16/fp16 windows to the tolerance of float32
  windows (inductor computes bf16 intermediates in float32 inside a fused kernel, so a traced
  step could read a slot it has just written without the rounding that was stored);
* both modes keep the params' precision with a low-precision window: each mix is compared
  with the float64 NumPy mix of the exact pairs, in units of the mix's own move.
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from references import (
    GradientDescent,
    Recurrence,
    aadl_extrapolate,
    rounding_bounds,
    solve_roundoff,
    type2_anderson,
)
from torch.func import vmap
from window_invariant import WINDOWS, state_gram_errors

import aadl_func as aa

N, STEPS, DEPTH = 96, 16, 5
OPTIONS = {
    # Over-relaxed, so that the safeguard both keeps and rejects mixes in both modes.
    "safeguard": dict(safeguard=True, relaxation=4.0),
    "store2-freq2": dict(store_each_nth=2, frequency=2, wait_iterations=3),
    "average": dict(average=True, average_tol=0.2),  # mode "aadl" only: mixes and averages
}
# Every entry of the state's Gram matrices within this of the stored ring's, relative to the
# entry's scale: float64 summation rounding, far below any low-precision rounding (~1e-3).
GRAM_TOL = 1e-10


def problem(dtype: torch.dtype, members: int = 0):
    """A quadratic ``0.5 sum h (w - t)^2 + 0.5 |B w|^2 / N`` (coupled coordinates, so that
    mixing helps and the safeguard both keeps and rejects); ``members`` > 0 stacks that many
    different problems for an ensemble."""
    gen = torch.Generator().manual_seed(3)
    shape = (members, N) if members else (N,)
    h = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 + 0.2).to(dtype)
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    b = (torch.randn(N, N, generator=gen, dtype=torch.float64) / N).to(dtype)
    x0 = (3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)

    def grad(w, hh=h, tt=t):
        return hh * (w - tt) + (w @ b.T) @ b / N

    def loss(w, hh=h, tt=t):
        return 0.5 * (hh * (w - tt) ** 2).sum() + 0.5 * ((w @ b.T) ** 2).sum() / N

    return grad, loss, x0, (h, t)


def make(mode: str, window: str, option: str):
    options = dict(OPTIONS[option])
    safeguard = options.pop("safeguard", False)
    dtype, history_dtype = WINDOWS[window]
    opt = aa.anderson(
        aa.sgd(0.4), history_depth=DEPTH, mode=mode, history_dtype=history_dtype, **options
    )
    return opt, safeguard, dtype


CASES = [
    (mode, window, option)
    for mode in ("aadl", "classic")
    for window in WINDOWS
    for option in OPTIONS
    if not (option == "average" and mode == "classic")
]


def case_id(case) -> str:
    return "-".join(case)


def assert_window_invariant(state, mode: str, where: str) -> None:
    errors = state_gram_errors(state, mode)
    assert max(errors.values()) <= GRAM_TOL, f"{where}: {errors}"


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_eager_gram_is_the_stored_windows(case, inplace):
    mode, window, option = case
    opt, safeguard, dtype = make(*case)
    grad, loss, x0, _ = problem(dtype)
    params = {"w": x0.clone()}
    state = opt.init(params)
    loss_fn = (lambda p: loss(p["w"])) if safeguard else None
    for k in range(STEPS):
        grads = {"w": grad(params["w"])}
        params, state = opt.update(state, params, grads, inplace=inplace, loss_fn=loss_fn)
        assert_window_invariant(state, mode, f"call {k + 1}")
    assert int(state.num_mixed) > 0
    if safeguard:  # the safeguard both kept and rejected mixes (and replaced entries)
        assert int(state.num_rejected) > 0
    if option == "average":
        assert int(state.num_averaged) > 0


MEMBERS = 3


@pytest.mark.parametrize("init", ["stacked", "vmapped"])
@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c[1] in ("bfloat16", "float16") and c[2] != "store2-freq2"],
    ids=case_id,
)
def test_vmapped_gram_is_each_members_stored_window(case, init):
    """An ensemble under ``vmap``: from ``vmap(init)`` (shared counters) and from stacked
    member states (batched counters, every decision blended)."""
    mode, window, option = case
    opt, safeguard, dtype = make(*case)
    grad, loss, x0, (h, t) = problem(dtype, members=MEMBERS)

    def step(state, params, hh, tt):
        loss_fn = (lambda p: loss(p["w"], hh, tt)) if safeguard else None
        grads = {"w": grad(params["w"], hh, tt)}
        return opt.update(state, params, grads, loss_fn=loss_fn)

    params = {"w": x0.clone()}
    if init == "vmapped":
        state = vmap(opt.init)(params)
    else:
        states = [opt.init({"w": x0[i]}) for i in range(MEMBERS)]
        state = optree.tree_map(lambda *xs: torch.stack(xs), *states)
    for k in range(STEPS):
        params, state = vmap(step)(state, params, h, t)
        for i in range(MEMBERS):
            member = optree.tree_map(lambda x, i=i: x[i] if x.dim() else x, state)
            assert_window_invariant(member, mode, f"member {i}, call {k + 1}")
    assert int(state.num_mixed.min()) > 0


COMPILED = [
    ("aadl", "bfloat16", "safeguard", True),
    ("aadl", "float16", "average", False),
    ("classic", "bfloat16", "safeguard", False),
]
# A compiled call against the eager call from the same state and params: float32 arithmetic
# fused in another order (~1e-7). A bf16 slot read unrounded by the compiled Gram pass missed
# by up to ~1e-4 within a few calls. (Whole trajectories are not compared: one float32
# rounding that differs flips a bf16/fp16 rounding of the next stored step, ~1e-3 of that
# entry, which ill-conditioned mixes amplify; a float32 window has no such step.)
COMPILED_TOL = 1e-5


# torch's own code warns while inductor loads and lowers (whatever the category: it changed
# in 2.15).
@pytest.mark.skipif(torch.__version__ < (2, 12), reason="torch.compile of update needs torch 2.12+")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
@pytest.mark.filterwarnings("ignore:`torch._prims_common.check` is deprecated")
@pytest.mark.parametrize(
    "mode,window,option,inplace",
    COMPILED,
    ids=[f"{m}-{w}-{o}-{'inplace' if i else 'pure'}" for m, w, o, i in COMPILED],
)
def test_compiled_gram_is_the_stored_windows_and_equals_eager(mode, window, option, inplace):
    """Inductor, not a test backend: the bug lived in its fused kernels."""
    opt, safeguard, dtype = make(mode, window, option)
    grad, loss, x0, _ = problem(dtype)
    loss_fn = (lambda p: loss(p["w"])) if safeguard else None

    def step(state, params, grads):
        return opt.update(state, params, grads, inplace=inplace, loss_fn=loss_fn)

    def clone(tree):
        return optree.tree_map(torch.clone, tree)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    params = {"w": x0.clone()}
    state = opt.init(params)
    worst = 0.0
    for k in range(STEPS):
        grads = {"w": grad(params["w"])}
        # Clones: an in-place step may also reuse the grads' buffers for the inner update.
        compiled_params, compiled_state = compiled(clone(state), clone(params), clone(grads))
        params, state = step(state, params, grads)
        assert_window_invariant(compiled_state, mode, f"compiled call {k + 1}")
        e, c = params["w"].double(), compiled_params["w"].double()
        worst = max(worst, float((c - e).norm() / e.norm()))
        for name in ("window_size", "num_mixed", "num_rejected", "num_averaged"):
            assert int(getattr(compiled_state, name)) == int(getattr(state, name)), name
    assert worst <= COMPILED_TOL, f"compiled differs from eager by {worst:.1e}"
    assert int(state.num_mixed) > 0


# -- the params' precision: each mix against the float64 NumPy mix of the stored window --------
# A low-precision window stores its differences rounded (bf16: 2^-8 relative), and the mix of
# a rounded window is not the mix of the exact one: near convergence the window's conditioning
# amplifies that rounding (on the quadratic below, against the exact pairs, aadl's bf16 mix
# misses by a 90th percentile of 0.6 of its own move and up to 10 moves; classic's by 0.04
# and 0.45; fp16: 0.03 / 0.47 and 0.01 / 0.06). That is the window's rounding, which the
# option chooses. What the library must not add is rounding of its own: the mix it returns
# is the float64 mix of the window it stores (reconstructed from the state: the anchor and
# the stored differences, exactly), up to the rounding of the result to the params' float32,
# ``u ||x||`` (u = 2^-24; bf16/fp16 windows are combined in float64 and rounded once), plus,
# for a float32 window combined in float32, Higham's ``gamma_{m+1}`` for the ``m + 1`` terms
# of the combination: ``(m + 1) u ||x||`` (the terms beside the anchor are far smaller).
# Measured on this problem: at most 0.72 u ||x|| (aadl, float32 window), 0.40 u ||x|| else.
UNIT_ROUNDOFF_32 = 2.0**-24


def far_quadratic(n: int = 256):
    """A float32 quadratic whose minimum is far from 0 (||x|| ~ 100 sqrt(n)), cond 100."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    a = (q * torch.logspace(0, -2, n, dtype=torch.float64)) @ q.T
    x_star = 100.0 + torch.randn(n, generator=gen, dtype=torch.float64)
    x0 = x_star + torch.randn(n, generator=gen, dtype=torch.float64)
    return a.float(), (a @ x_star).float(), x0.float()


def stored_window_mix(state, mode: str) -> np.ndarray:
    """The float64 mix of the window ``state`` stores, newest entry first in its ring: mode
    "aadl", the iterates ``y`` (anchor minus the stored differences); mode "classic", the
    pairs ``(x_i, x_i + f_i)`` (anchor minus the stored steps, plus the stored residuals)."""
    q, head, size = len(state.residuals), int(state.head), int(state.window_size)
    slots = [(head - j) % q for j in range(size)]
    newest = state.anchor.double().numpy()
    if mode == "aadl":
        ys = [newest]
        for slot in slots[: size - 1]:
            ys.append(ys[-1] - state.residuals[slot].double().numpy())
        return aadl_extrapolate(np.stack(ys[::-1], axis=1))
    xs, gs = [newest], []
    for slot in slots:
        gs.append(xs[-1] + state.residuals[slot].double().numpy())
        xs.append(xs[-1] - state.iterates[slot].double().numpy())
    return type2_anderson(np.stack(xs[:size][::-1], axis=1), np.stack(gs[::-1], axis=1))


@pytest.mark.parametrize("window", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_low_precision_window_mixes_what_it_stores(mode, window):
    a, b, x = far_quadratic()
    lr, steps = 0.5, 24
    opt = aa.anderson(aa.sgd(lr), history_depth=DEPTH, mode=mode, history_dtype=WINDOWS[window][1])
    state = opt.init(x)
    ratios, moves = [], []
    terms = 1 if window != "float32" else DEPTH + 1
    for _ in range(steps):
        mixed = int(state.num_mixed)
        out, state = opt.update(state, x, a @ x - b)
        if int(state.num_mixed) > mixed:
            expected = stored_window_mix(state, mode)
            got = out.double().numpy()
            bound = terms * UNIT_ROUNDOFF_32 * np.linalg.norm(got)
            ratios.append(np.linalg.norm(got - expected) / bound)
            moves.append(np.linalg.norm(expected - x.double().numpy()) / np.linalg.norm(got))
        x = out
    assert len(ratios) >= steps // 2
    assert max(moves) < 1e-2  # the regime under test: moves far below ||x||
    assert max(ratios) <= 1.0, ratios


# -- what a user can expect: each mix against the float64 window's, to the window's rounding ----
# A low-precision window rounds each stored difference (steps, residuals) once, to ``u_w``
# relative (float32 2^-24, fp16 2^-11, bf16 2^-8). Fed the same points, a float64
# window differs from it by that rounding alone, so each mix can miss the float64 window's by
# what ``u_w`` moves it: ``S``, measured by the float64 reference replaying the calls with its
# stored differences perturbed by ``u_w`` (``references.rounding_bounds``, points unperturbed:
# both runs see the same rounded points), times ``8 sqrt(2)`` (see there), plus the float32
# combination's ``(m + 2) u`` of the params. One bound for both modes and every window dtype,
# from the window's own conditioning: on this problem the median bound is 1.5-3e-3 (float32),
# 5e-2-0.12 (fp16) and 0.5-1.8 (bf16, by the CPU's kernels) of the mix's move, and up to
# 1,300 moves (aadl/bf16) where the window nears rank deficiency. So the test's teeth are not
# that the bound is below the move (bf16's is about the move) but that not mixing fails it.
# Measured: at most 0.14 of the bound. Judged by float32's ``u_w``, the fp16 windows fail in
# both modes (32 / 99 times the bound); judged by fp16's (8x finer) the bf16 ones still pass
# (0.88 / 0.66: the bound sits within 8x of bf16's own effect, not within 6x; under the former
# 8-times-two-samples bound they failed at 1.4 / 1.0).


@pytest.mark.parametrize("window", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_low_precision_window_misses_the_exact_mix_by_its_rounding(mode, window):
    a, b, x0 = far_quadratic()
    lr, steps = 0.5, 24
    exact, low = (
        aa.anderson(aa.sgd(lr), history_depth=DEPTH, mode=mode, history_dtype=dtype)
        for dtype in (torch.float64, WINDOWS[window][1])
    )
    exact_state, low_state, x = exact.init(x0), low.init(x0), x0
    outputs, lows, mixed = [], [], []
    for _ in range(steps):
        grad, before = a @ x - b, int(exact_state.num_mixed)
        x_exact, exact_state = exact.update(exact_state, x, grad)
        x_low, low_state = low.update(low_state, x, grad)
        outputs.append(x_exact.double().numpy())
        lows.append(x_low.double().numpy())
        mixed.append(int(exact_state.num_mixed) > before)
        x = x_exact  # both windows see the same points

    def gradient(z: np.ndarray) -> np.ndarray:  # the float32 gradient the library was given
        return (a @ torch.from_numpy(z).float() - b).double().numpy()

    def reference() -> Recurrence:
        return Recurrence(gradient, GradientDescent(lr), mode=mode, history_depth=DEPTH)

    u_window = torch.finfo(WINDOWS[window][1]).eps / 2
    u_diff = max(u_window, solve_roundoff(len(x0), DEPTH))
    start = x0.double().numpy()
    bounds = rounding_bounds(reference, start, outputs, UNIT_ROUNDOFF_32, u_diff, u_point=0.0)
    starts = [start, *outputs[:-1]]
    ratios, unmixed = [], []
    for k in np.flatnonzero(mixed):
        size = np.linalg.norm(outputs[k])
        ratios.append(np.linalg.norm(lows[k] - outputs[k]) / size / bounds[k])
        # The plain step the call would have returned without its mix (float32, as given).
        plain = (starts[k] - lr * gradient(starts[k])).astype(np.float32)
        unmixed.append(np.linalg.norm(plain - outputs[k]) / size / bounds[k])
    assert len(ratios) >= steps // 2
    assert max(ratios) <= 1.0, (max(ratios), int(np.argmax(ratios)))
    # Teeth: a window that did not mix would fail the bound (its plain step misses the float64
    # window's mix by more than twice the bound at some call; measured 13-29x for bf16 and
    # 88x to 8,900x for the others, alike on AVX2 and AVX-512 kernels).
    assert max(unmixed) > 2.0, max(unmixed)

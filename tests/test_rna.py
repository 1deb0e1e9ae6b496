"""Extrapolated averaging (``aadl_func.rna``, ``RNAAverager``, ``recompute_bn``).

The weights and the extrapolation are checked against ``references.rna_weights`` /
``rna_extrapolate`` (float64 NumPy, the KKT system of the constrained problem: another route
than the library's eigen-decomposition), on snapshots of a noisy linear iteration; the
uniform limit against ``torch.optim.swa_utils.AveragedModel``; BatchNorm against
``swa_utils.update_bn`` on a separately loaded copy.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from references import rna_extrapolate, rna_weights
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

import aadl_func as aa

LAMBDAS = (1e-4, 1e-2, 1.0, math.inf)


def trajectory(steps: int, dtype=torch.float64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Snapshots of ``x <- A x + b + noise`` (a contraction, spectral radius 0.9) on two
    leaves, float64 arithmetic, cast to ``dtype``."""
    rng = np.random.default_rng(seed)
    n = 14
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    a = q @ np.diag(np.linspace(0.1, 0.9, n)) @ q.T
    b, x = rng.standard_normal(n), rng.standard_normal(n)
    out = []
    for _ in range(steps):
        x = a @ x + b + 0.01 * rng.standard_normal(n)
        t = torch.tensor(x, dtype=dtype)
        out.append({"w": t[:10].reshape(2, 5).clone(), "b": t[10:].clone()})
    return out


def flat(params: dict[str, torch.Tensor]) -> np.ndarray:
    return np.concatenate([params["w"].double().reshape(-1).numpy(), params["b"].double().numpy()])


def run(opt: aa.RNA, snapshots, inplace: bool = False) -> aa.RNAState:
    state = opt.init(snapshots[0])
    for x in snapshots:
        state = opt.snapshot(state, x, inplace=inplace)
    return state


@pytest.mark.parametrize("lam", LAMBDAS)
def test_float64_matches_the_reference(lam):
    snaps = trajectory(9)  # 9 snapshots, window 5: the ring wraps, the last 6 take part
    opt = aa.rna(5)
    state = run(opt, snaps)
    X = np.stack([flat(s) for s in snaps[-6:]], axis=1)
    expected_c = rna_weights(np.diff(X, axis=1), lam)
    np.testing.assert_allclose(opt.weights(state, lam).numpy(), expected_c, rtol=1e-10, atol=1e-12)
    got = flat(opt.extrapolate(state, lam))
    np.testing.assert_allclose(got, rna_extrapolate(X, lam), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lam", (1e-2, 1.0, math.inf))
def test_float32_params_match_the_reference(lam):
    snaps = trajectory(7, dtype=torch.float32)
    opt = aa.rna(10)  # not full: 6 pairs
    state = run(opt, snaps)
    X = np.stack([flat(s) for s in snaps], axis=1)  # the float32 snapshots, exactly
    out = opt.extrapolate(state, lam)
    assert out["w"].dtype == torch.float32
    np.testing.assert_allclose(
        opt.weights(state, lam).numpy(), rna_weights(np.diff(X, axis=1), lam), rtol=1e-5
    )
    np.testing.assert_allclose(flat(out), rna_extrapolate(X, lam), rtol=1e-5, atol=1e-5)


def test_float64_window_of_float32_params():
    snaps = trajectory(7, dtype=torch.float32)
    opt = aa.rna(10, dtype=torch.float64)
    state = run(opt, snaps)
    assert state.points["w"].dtype == torch.float64
    X = np.stack([flat(s) for s in snaps], axis=1)
    np.testing.assert_allclose(flat(opt.extrapolate(state, 1e-3)), rna_extrapolate(X, 1e-3),
                               rtol=1e-10, atol=1e-10)  # fmt: skip


def test_lambda_zero_matches_the_reference_on_a_full_rank_window():
    """lam = 0 takes the unregularised route (solve_weights' alpha); on a full-rank window
    it is the reference's KKT answer at lam = 0."""
    snaps = trajectory(6)
    opt = aa.rna(5)
    state = run(opt, snaps)
    R = np.diff(np.stack([flat(s) for s in snaps], axis=1), axis=1)
    np.testing.assert_allclose(opt.weights(state, 0.0).numpy(), rna_weights(R, 0.0), rtol=1e-7)


def test_infinite_lambda_is_swa_over_the_window():
    """lam = inf: the uniform average of the snapshots that have a residual, which is what
    torch.optim.swa_utils.AveragedModel computes from the same snapshots."""
    snaps = trajectory(8)
    opt = aa.rna(4)
    state = run(opt, snaps)
    module = nn.Module()
    module.w = nn.Parameter(snaps[0]["w"].clone())
    module.b = nn.Parameter(snaps[0]["b"].clone())
    swa = AveragedModel(module)
    swa.n_averaged.zero_()
    for s in snaps[-5:-1]:
        module.w.data.copy_(s["w"])
        module.b.data.copy_(s["b"])
        swa.update_parameters(module)
    out = opt.extrapolate(state, math.inf)
    torch.testing.assert_close(out["w"], swa.module.w.detach(), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(out["b"], swa.module.b.detach(), rtol=1e-14, atol=1e-14)


def test_exact_on_a_linear_iteration():
    """Without noise, x_{k+1} = A x_k + b with n + 1 snapshot pairs: RNA at lambda = 0
    recovers the fixed point (1 - A)^{-1} b (the minimal polynomial argument: R has a null
    vector, so the Gram is singular and the lambda = 0 route must not drop it)."""
    rng = np.random.default_rng(3)
    n = 4
    a = np.diag([0.2, 0.5, 0.7, 0.9])
    b, x = rng.standard_normal(n), rng.standard_normal(n)
    opt = aa.rna(n + 1)
    state = opt.init({"x": torch.tensor(x)})
    for _ in range(n + 2):
        state = opt.snapshot(state, {"x": torch.tensor(x)})
        x = a @ x + b
    fixed = np.linalg.solve(np.eye(n) - a, b)
    np.testing.assert_allclose(opt.extrapolate(state, 0.0)["x"].numpy(), fixed, atol=1e-9)


def test_every_k_steps_equals_explicit_snapshots_and_inplace_equals_pure():
    snaps = trajectory(12)
    explicit = run(aa.rna(4), snaps[2::3])
    for inplace in (False, True):
        opt = aa.rna(4, every=3)
        state = opt.init(snaps[0])
        for s in snaps:
            state = opt.update(state, s, inplace=inplace)
        assert int(state.count) == 12 and int(state.num_snapshots) == 4
        for a, b in zip(
            torch.utils._pytree.tree_leaves(state[1:]),
            torch.utils._pytree.tree_leaves(explicit[1:]),
        ):  # noqa: E501
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradient_residuals_match_the_reference():
    """residual='gradient': r_i is the mean of the gradients between snapshots i and i+1."""
    snaps = trajectory(7)
    grads = trajectory(12, seed=1)
    opt = aa.rna(10, residual="gradient")
    state = opt.init(snaps[0])
    means = []
    for k, s in enumerate(snaps):
        if k:  # two gradients between consecutive snapshots
            pair = grads[2 * k - 2 : 2 * k]
            for g in pair:
                state = opt.update(state, s, g)
            means.append((flat(pair[0]) + flat(pair[1])) / 2)
        state = opt.snapshot(state, s)
    X = np.stack([flat(s) for s in snaps[:-1]], axis=1)
    R = np.stack(means, axis=1)
    for lam in (1e-3, 1.0):
        np.testing.assert_allclose(
            flat(opt.extrapolate(state, lam)), rna_extrapolate(X, lam, R), rtol=1e-10, atol=1e-10
        )


def test_select_picks_the_lowest_held_out_loss():
    snaps = trajectory(9)
    opt = aa.rna(6)
    state = run(opt, snaps)
    target = torch.tensor(flat(snaps[-1])) + 0.3

    def loss(p):
        return float(np.sum((flat(p) - target.numpy()) ** 2))

    grid = (1e-6, 1e-3, 1.0, math.inf)
    params, choice = opt.select(state, loss, grid)
    values = {lam: loss(opt.extrapolate(state, lam)) for lam in grid}
    assert choice.lam == min(values, key=values.get)
    assert choice.losses == pytest.approx(values)
    np.testing.assert_array_equal(flat(params), flat(opt.extrapolate(state, choice.lam)))


def test_select_skips_non_finite_losses_and_raises_when_none_is_finite():
    opt = aa.rna(4)
    state = run(opt, trajectory(6))
    calls = iter([math.nan, 2.0, math.inf, 1.0])
    _, choice = opt.select(state, lambda p: next(calls), (1e-6, 1e-3, 1.0, math.inf))
    assert choice.lam == math.inf and math.isnan(choice.losses[1e-6])
    with pytest.raises(FloatingPointError, match="loss_fn"):
        opt.select(state, lambda p: math.nan)


def test_online_restart_measures_the_next_residual_from_the_new_point():
    snaps = trajectory(5)
    opt = aa.rna(4)
    state = run(opt, snaps)
    y = opt.extrapolate(state, 1e-3)
    state = opt.restart_at(state, y)
    nxt = {k: v + 1.0 for k, v in y.items()}
    state = opt.snapshot(state, nxt)
    slot = (int(state.num_snapshots) - 2) % 4
    torch.testing.assert_close(state.points["w"][slot], y["w"])
    torch.testing.assert_close(state.residuals["w"][slot], torch.ones(2, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"history_depth": 1}, ValueError, "history_depth"),
        ({"history_depth": 2.0}, TypeError, "history_depth"),
        ({"every": 0}, ValueError, "every"),
        ({"residual": "grad"}, ValueError, "residual"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
        ({"device": 3.5}, TypeError, "device"),
    ],
)
def test_bad_options_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        aa.rna(**kwargs)


def test_bad_calls_are_named_and_leave_the_state_unchanged():
    snaps = trajectory(4)
    opt = aa.rna(3)
    state = run(opt, snaps, inplace=True)
    before = copy.deepcopy(state)
    with pytest.raises(ValueError, match="params"):
        opt.snapshot(state, {"w": torch.zeros(3)}, inplace=True)
    with pytest.raises(ValueError, match="grads"):
        aa.rna(3, residual="gradient").update(
            aa.rna(3, residual="gradient").init(snaps[0]), snaps[0]
        )
    with pytest.raises(ValueError, match="residual"):
        aa.rna(3, residual="gradient").snapshot(state, snaps[0])
    with pytest.raises(ValueError, match="history_depth"):
        aa.rna(4).snapshot(state, snaps[0])
    with pytest.raises(TypeError, match="RNAState"):
        opt.snapshot((1, 2), snaps[0])
    with pytest.raises(ValueError, match="lam"):
        opt.weights(state, -1.0)
    with pytest.raises(ValueError, match="lambdas"):
        opt.select(state, lambda p: 0.0, ())
    with pytest.raises(ValueError, match="no snapshot pair"):
        opt.extrapolate(opt.snapshot(opt.init(snaps[0]), snaps[0]), 1.0)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(before)
    ):  # noqa: E501
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- the torch.optim face and BatchNorm --------------------------------------------------------
def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def train_with_averager(rna: aa.RNAAverager, net: nn.Module, epochs: int, data):
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = data
    for _ in range(epochs):
        for i in range(0, len(x), 16):
            opt.zero_grad()
            nn.functional.mse_loss(net(x[i : i + 16]), y[i : i + 16]).backward()
            opt.step()
            rna.step()
        rna.snapshot()


def test_averager_matches_the_functional_and_recomputes_batchnorm():
    torch.manual_seed(1)
    data = (torch.randn(64, 4), torch.randn(64, 2))
    loader = [data[0][i : i + 16] for i in range(0, 64, 16)]
    net = bn_net()
    averager = aa.RNAAverager(net, history_depth=4)
    train_with_averager(averager, net, 6, data)
    trained = copy.deepcopy(net.state_dict())

    def held_out():
        with torch.no_grad():
            return nn.functional.mse_loss(net(data[0]), data[1])

    # load=False: parameters and buffers come back as they were.
    choice = averager.extrapolate(held_out, load=False, bn_loader=loader)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0)
    # load=True: the chosen extrapolation (the functional's), BatchNorm recomputed for it.
    names = [k for k, _ in net.named_parameters()]
    expected = averager.rna.extrapolate(averager.state, choice.lam)
    averager.extrapolate(held_out, lambdas=(choice.lam,), bn_loader=loader)
    for name, value in zip(names, expected):
        torch.testing.assert_close(dict(net.named_parameters())[name].detach(), value)
    reference = bn_net()
    reference.load_state_dict(trained)
    with torch.no_grad():
        for p, v in zip(reference.parameters(), expected):
            p.copy_(v)
    update_bn(loader, reference)
    torch.testing.assert_close(net[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(net[1].running_var, reference[1].running_var)


def test_recompute_bn_for_functional_call_users():
    torch.manual_seed(2)
    loader = [torch.randn(16, 4) for _ in range(3)]
    net = bn_net()
    params = {k: v.detach() + 0.1 for k, v in net.named_parameters()}
    buffers = aa.recompute_bn(loader, net, params)
    reference = bn_net()
    with torch.no_grad():
        for k, p in reference.named_parameters():
            p.copy_(params[k])
    update_bn(loader, reference)
    torch.testing.assert_close(buffers["1.running_mean"], reference[1].running_mean)
    with pytest.raises(ValueError, match="names the module lacks"):
        aa.recompute_bn(loader, net, {"nope": torch.zeros(1)})


def test_averager_online_continues_from_the_extrapolation():
    torch.manual_seed(3)
    data = (torch.randn(64, 4), torch.randn(64, 2))
    net = nn.Linear(4, 2)
    averager = aa.RNAAverager(net.parameters(), history_depth=3, residual="gradient", every=4)
    train_with_averager(averager, net, 5, data)
    averager.extrapolate(lambdas=(1e-2,), online=True)
    last = torch.utils._pytree.tree_leaves(averager.state.last)
    for p, v in zip(net.parameters(), last):
        torch.testing.assert_close(p.detach(), v, rtol=0, atol=0)
    assert int(averager.state.grad_count) == 0
    with pytest.raises(ValueError, match="online"):
        averager.extrapolate(load=False, online=True)
    with pytest.raises(ValueError, match="bn_loader"):
        averager.extrapolate(bn_loader=[data[0]])


# -- arguments unlike the window, refused before anything is written --------------------------
def _versions(tree):
    return [(t, t.clone(), t._version) for t in torch.utils._pytree.tree_leaves(tree)]


def _assert_unchanged(saved):
    for t, value, version in saved:
        assert t._version == version and torch.equal(t, value)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("call", ["update", "snapshot", "restart_at"])
@pytest.mark.parametrize(
    "params, error, match",
    [
        ([torch.zeros(2, 5), torch.zeros(4)], ValueError, r"`params` is a list of 2 where"),
        ({"w": torch.zeros(2, 5), "c": torch.zeros(4)}, ValueError, r"keys \['c', 'w'\]"),
        (
            {"w": torch.zeros(2, 5, dtype=torch.float64), "b": torch.zeros(4)},
            TypeError,
            r"`params\['w'\]` has dtype torch.float64, expected torch.float32",
        ),
        (
            {"w": torch.zeros(2, 5), "b": torch.zeros(4, device="meta")},
            ValueError,
            r"`params\['b'\]` is on device meta, expected cpu",
        ),
    ],
    ids=["list", "other-keys", "float64", "device"],
)
def test_params_unlike_the_window_are_refused_before_anything_is_written(
    params, error, match, call, inplace
):
    """The structure, dtypes and devices of the params given to `init` (the window keeps
    each leaf's own): a list for a dict, other keys, float64 leaves (which `last` would take
    while the rings stay float32) or another device are named, and the state keeps every
    value and version."""
    opt = aa.rna(3, every=2, residual="gradient")
    snaps = trajectory(4, dtype=torch.float32)
    state = opt.init(snaps[0])
    for x in snaps:
        state = opt.update(state, x, x, inplace=True)
    saved = _versions(state)
    kwargs = {} if call == "restart_at" else {"inplace": inplace}
    args = (snaps[0],) if call == "update" else ()
    with pytest.raises(error, match=f"rna: .*{match}"):
        getattr(opt, call)(state, params, *args, **kwargs)
    if call == "update":  # the same leaves as grads, after valid params
        with pytest.raises(error, match=f"rna: .*{match.replace('params', 'grads')}"):
            opt.update(state, snaps[0], params, inplace=inplace)
    _assert_unchanged(saved)


def test_a_window_dtype_or_device_of_its_own_takes_params_of_any():
    """With `dtype` (`device`) given, every leaf is cast (moved) into the window: float64
    params in a float32 window are the float32 ones rounded, as before."""
    snaps = trajectory(5)
    opt = aa.rna(3, dtype=torch.float32, device="cpu")
    state = run(opt, snaps)
    reference = run(opt, [{k: v.float() for k, v in s.items()} for s in snaps])
    for a, b in zip(
        torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(reference)
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "params, error, match",
    [
        ({"0.weight": torch.full((1,), 7.0)}, ValueError, r"has shape \(1,\), expected \(8, 4\)"),
        ({"0.weight": torch.ones(4)}, ValueError, r"has shape \(4,\), expected \(8, 4\)"),
        (
            {"0.bias": torch.zeros(8), "0.weight": torch.ones(5, 5)},
            ValueError,
            r"`params\['0.weight'\]` has shape \(5, 5\)",
        ),
        (
            {"0.bias": torch.zeros(8), "3.bias": torch.ones(2, dtype=torch.int64)},
            TypeError,
            r"`params\['3.bias'\]` must be a floating-point tensor.*torch.int64",
        ),
        ({"0.bias": torch.zeros(8, device="meta")}, TypeError, r"got torch.float32 on meta"),
        ({"0.bias": [0.0] * 8}, TypeError, r"floating-point tensor with values, got <class"),
        ([torch.zeros(8)], TypeError, r"`params` must be a dict, got list"),
        ({"0.bias": torch.zeros(8), "nope": torch.zeros(1)}, ValueError, r"lacks: \['nope'\]"),
    ],
    ids=["one-element", "row", "half-way", "integer", "meta", "list-value", "list", "name"],
)
def test_recompute_bn_refuses_bad_params_before_the_first_copy(params, error, match):
    """Values are never broadcast (a (1,) tensor filled the weight, a row every row), a bad
    entry after a good one no longer leaves the good one written, and integers are refused:
    the module keeps every parameter and buffer, values and versions."""
    net = bn_net()
    saved = _versions(dict(net.named_parameters())) + _versions(dict(net.named_buffers()))
    with pytest.raises(error, match=f"recompute_bn: .*{match}"):
        aa.recompute_bn([torch.randn(16, 4)], net, params)
    _assert_unchanged(saved)


def test_recompute_bn_casts_values_to_the_modules_dtype():
    """As `load_state_dict`: a float64 extrapolation loads into a float32 module, rounded."""
    torch.manual_seed(4)
    loader = [torch.randn(16, 4) for _ in range(2)]
    params = {k: v.detach().double() + 0.1 for k, v in bn_net().named_parameters()}
    buffers = aa.recompute_bn(loader, bn_net(), params)
    reference = aa.recompute_bn(loader, bn_net(), {k: v.float() for k, v in params.items()})
    for name, value in buffers.items():
        assert value.dtype == reference[name].dtype and torch.equal(value, reference[name])

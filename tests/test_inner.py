"""Tests of the functional inner optimizers against their torch.optim twins."""

from __future__ import annotations

import functools
import io
import itertools

import optree
import pytest
import torch
from torch.func import grad, vmap

from aadl_func import AdamState, InnerOptimizer, SgdState, adam, adamw, sgd
from aadl_func._src.transforms import adam_leaves

STEPS = 50

# --------------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------------


def make_params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "conv": randn(4, 3, 3, 3),
        "linear": (randn(5, 7), randn(5)),
        "scale": randn(()),
    }


def loss_fn(params):
    """A fixed smooth, nonlinear, coupled and convex objective."""
    total = 0.0
    for i, leaf in enumerate(optree.tree_leaves(params)):
        total = total + 0.5 * (1.0 + 0.25 * i) * (leaf**2).sum()
        total = total + 0.3 * torch.nn.functional.softplus(2 * leaf - 1).sum()
    w, b = params["linear"]
    return total + 0.1 * torch.nn.functional.softplus(b @ w).sum()


grad_fn = grad(loss_fn)


def noise_sequence(params, steps, seed=1):
    """A seeded, deterministic sequence of gradient perturbations shaped like ``params``."""
    gen = torch.Generator().manual_seed(seed)
    leaves, spec = optree.tree_flatten(params)
    seq = []
    for _ in range(steps):
        noise = [
            0.5 * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
            for x in leaves
        ]
        seq.append(optree.tree_unflatten(spec, noise))
    return seq


def gradients(params, noise):
    return optree.tree_map(torch.add, grad_fn(params), noise)


def apply_updates(params, updates):
    return optree.tree_map(torch.add, params, updates)


def clone_tree(tree):
    return optree.tree_map(torch.clone, tree)


def assert_tree_equal(a, b):
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def tols(dtype):
    # Parameters are O(1); ``params + updates`` rounds once more than torch.optim's fused
    # in-place update, so tiny absolute differences accumulate over the steps.
    if dtype in (torch.float64, torch.complex128):
        return {"rtol": 1e-12, "atol": 1e-12}
    return {"rtol": 1e-5, "atol": 1e-5}


def run_against_torch(
    opt,
    torch_opt_cls,
    torch_kwargs,
    dtype,
    inplace,
    state_names,
    steps=STEPS,
    scheduler=None,
    before_step=None,
):
    """Runs ``opt`` and the torch.optim twin side by side, comparing params and state.

    ``scheduler(torch_opt)`` makes an LR scheduler stepped after every ``torch_opt.step()``;
    ``before_step(torch_opt, t)`` may change the twin's param groups before step ``t``.
    """
    params = make_params(dtype)
    leaves, spec = optree.tree_flatten(params)
    twins = [x.clone() for x in leaves]
    torch_opt = torch_opt_cls(twins, **torch_kwargs)
    lr_scheduler = None if scheduler is None else scheduler(torch_opt)
    noises = noise_sequence(params, steps)
    state = opt.init(params)
    for t in range(steps):
        # Both optimizers see the same gradients (computed at our parameters), so differences
        # are the optimizers' own and do not get amplified by the objective's dynamics.
        grads = gradients(params, noises[t])
        for p, g in zip(twins, optree.tree_leaves(grads), strict=True):
            p.grad = g.clone()
        if before_step is not None:
            before_step(torch_opt, t)
        torch_opt.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        updates, state = opt.update(grads, state, params, inplace=inplace)
        params = apply_updates(params, updates)

        kw = tols(dtype)
        for ours, twin in zip(optree.tree_leaves(params), twins, strict=True):
            assert ours.dtype == dtype
            torch.testing.assert_close(ours, twin, **kw, msg=lambda m, t=t: f"step {t}: {m}")
        assert int(state.count) == t + 1
        for ours_name, torch_name in state_names:
            ours_leaves = optree.tree_leaves(getattr(state, ours_name))
            for ours, twin in zip(ours_leaves, twins, strict=True):
                ref = torch_opt.state[twin][torch_name]
                assert ours.dtype == ref.dtype
                torch.testing.assert_close(ours, ref, **kw, msg=lambda m, t=t: f"step {t}: {m}")


# --------------------------------------------------------------------------------------------
# Step-for-step agreement with torch.optim.
# --------------------------------------------------------------------------------------------

SGD_CONFIGS = [
    {"momentum": m, "dampening": d, "nesterov": n, "weight_decay": wd}
    for m, d, n, wd in itertools.product((0.0, 0.9), (0.0, 0.1), (False, True), (0.0, 1e-2))
    if not (n and (m <= 0 or d != 0))
]
ADAM_CONFIGS = [
    {"betas": b, "eps": e, "weight_decay": wd}
    for b, e, wd in itertools.product(
        ((0.9, 0.999), (0.5, 0.9), (0.0, 0.99)), (1e-8, 1e-3), (0.0, 0.1)
    )
]
ADAMW_CONFIGS = [
    {"betas": b, "eps": e, "weight_decay": wd}
    for b, e, wd in itertools.product(
        ((0.9, 0.999), (0.5, 0.9), (0.0, 0.99)), (1e-8, 1e-3), (0.0, 1e-2, 0.5)
    )
]
DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch(config, dtype, inplace):
    names = [("momentum_buffer", "momentum_buffer")] if config["momentum"] else []
    run_against_torch(
        sgd(0.05, **config), torch.optim.SGD, {"lr": 0.05, **config}, dtype, inplace, names
    )


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ADAM_CONFIGS, ids=str)
def test_adam_matches_torch(config, dtype, inplace):
    names = [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")]
    run_against_torch(
        adam(0.02, **config), torch.optim.Adam, {"lr": 0.02, **config}, dtype, inplace, names
    )


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ADAMW_CONFIGS, ids=str)
def test_adamw_matches_torch(config, dtype, inplace):
    names = [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")]
    run_against_torch(
        adamw(0.02, **config), torch.optim.AdamW, {"lr": 0.02, **config}, dtype, inplace, names
    )


def test_defaults_match_torch():
    run_against_torch(adam(), torch.optim.Adam, {}, torch.float64, True, [], steps=10)
    run_against_torch(adamw(), torch.optim.AdamW, {}, torch.float64, True, [], steps=10)
    run_against_torch(sgd(1e-3), torch.optim.SGD, {"lr": 1e-3}, torch.float64, True, [], 10)


def _twin(name):
    return {
        "sgd": (sgd(0.05, momentum=0.9, weight_decay=1e-2), torch.optim.SGD,
                {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}),
        "nesterov": (sgd(0.05, momentum=0.9, nesterov=True), torch.optim.SGD,
                     {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        # eps=1e-8 underflows to 0 in float16, making Adam divide by zero (in torch.optim too)
        "adam": (adam(0.02, eps=1e-4, weight_decay=0.1), torch.optim.Adam,
                 {"lr": 0.02, "eps": 1e-4, "weight_decay": 0.1}),
        "adamw": (adamw(0.02, eps=1e-4), torch.optim.AdamW, {"lr": 0.02, "eps": 1e-4}),
    }[name]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
def test_low_precision_dtypes(name, dtype):
    opt, cls, kwargs = _twin(name)
    params = make_params(dtype)
    leaves, spec = optree.tree_flatten(params)
    twins = [x.clone() for x in leaves]
    torch_opt = cls(twins, **kwargs)
    noises = noise_sequence(params, 10)
    state = opt.init(params)
    for leaf, p in zip(optree.tree_leaves(state[1:]), itertools.cycle(leaves), strict=False):
        assert leaf.dtype == dtype and leaf.shape == p.shape
    for t in range(10):
        g = noises[t]  # parameter-independent gradients: only rounding differs
        updates, state = opt.update(clone_tree(g), state, params)
        for u, p in zip(optree.tree_leaves(updates), leaves, strict=True):
            assert u.dtype == dtype and u.shape == p.shape
        params = apply_updates(params, updates)
        for p, gl in zip(twins, optree.tree_leaves(g), strict=True):
            p.grad = gl.clone()
        torch_opt.step()
    for ours, twin in zip(optree.tree_leaves(params), twins, strict=True):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, twin, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64], ids=str)
@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
def test_complex_params(name, dtype):
    opt, cls, kwargs = _twin(name)
    gen = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn(4, 3, generator=gen, dtype=dtype),
        "b": torch.randn(2, generator=gen, dtype=dtype),
    }
    leaves, spec = optree.tree_flatten(params)
    twins = [x.clone() for x in leaves]
    torch_opt = cls(twins, **kwargs)
    state = opt.init(params)
    for t in range(20):
        g = {k: torch.randn(v.shape, generator=gen, dtype=dtype) for k, v in params.items()}
        updates, state = opt.update(clone_tree(g), state, params, inplace=bool(t % 2))
        params = apply_updates(params, updates)
        for p, gl in zip(twins, optree.tree_leaves(g), strict=True):
            p.grad = gl.clone()
        torch_opt.step()
        for ours, twin in zip(optree.tree_leaves(params), twins, strict=True):
            torch.testing.assert_close(ours, twin, **tols(dtype))


# --------------------------------------------------------------------------------------------
# Functional properties.
# --------------------------------------------------------------------------------------------

ALL_OPTIMIZERS = {
    "sgd": lambda: sgd(0.1),
    "sgd_momentum_wd": lambda: sgd(0.1, momentum=0.9, dampening=0.2, weight_decay=1e-2),
    "sgd_nesterov_wd": lambda: sgd(0.1, momentum=0.8, nesterov=True, weight_decay=1e-2),
    "adam": lambda: adam(0.01),
    "adam_wd": lambda: adam(0.01, betas=(0.8, 0.99), weight_decay=0.1),
    "adamw": lambda: adamw(0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_vmap_ensemble_equals_separate_members(name, inplace):
    opt = ALL_OPTIMIZERS[name]()
    members = [make_params(seed=s) for s in range(3)]
    batched = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    noises = [noise_sequence(m, 5, seed=10 + i) for i, m in enumerate(members)]

    batched_state = vmap(opt.init)(batched)
    assert batched_state.count.shape == (3,)
    states = [opt.init(m) for m in members]
    assert_tree_equal(batched_state, optree.tree_map(lambda *xs: torch.stack(xs), *states))

    vupdate = vmap(functools.partial(opt.update, inplace=inplace))
    for t in range(5):
        grads = [gradients(m, n[t]) for m, n in zip(members, noises, strict=True)]
        batched_grads = optree.tree_map(lambda *xs: torch.stack(xs), *grads)
        batched_updates, batched_state = vupdate(batched_grads, batched_state, batched)
        batched = apply_updates(batched, batched_updates)
        for i in range(3):
            updates, states[i] = opt.update(grads[i], states[i], members[i], inplace=inplace)
            members[i] = apply_updates(members[i], updates)
        stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members)
        stacked_state = optree.tree_map(lambda *xs: torch.stack(xs), *states)
        for a, b in zip(optree.tree_leaves(batched), optree.tree_leaves(stacked), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
        for a, b in zip(
            optree.tree_leaves(batched_state), optree.tree_leaves(stacked_state), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert batched_state.count.tolist() == [5, 5, 5]


def _storages(tree):
    return {x.untyped_storage().data_ptr() for x in optree.tree_leaves(tree) if x.numel()}


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_pure_update_leaves_inputs_untouched(name):
    opt = ALL_OPTIMIZERS[name]()
    params = make_params()
    state = opt.init(params)
    noises = noise_sequence(params, 4)
    for t in range(4):
        grads = gradients(params, noises[t])
        before = clone_tree((grads, state, params))
        updates, new_state = opt.update(grads, state, params, inplace=False)
        assert_tree_equal((grads, state, params), before)
        inputs = _storages((grads, state, params))
        assert not _storages(updates) & inputs
        assert not _storages(new_state) & inputs
        params, state = apply_updates(params, updates), new_state


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_inplace_matches_pure_bitwise(name):
    opt = ALL_OPTIMIZERS[name]()
    params_a = params_b = make_params()
    state_a, state_b = opt.init(params_a), opt.init(params_b)
    noises = noise_sequence(params_a, 6)
    for t in range(6):
        grads = gradients(params_a, noises[t])
        updates_a, state_a = opt.update(clone_tree(grads), state_a, params_a, inplace=False)
        grads_b = clone_tree(grads)
        updates_b, state_b = opt.update(grads_b, state_b, params_b, inplace=True)
        # torchopt semantics: the gradient buffers are reused for the returned updates
        for u, g in zip(optree.tree_leaves(updates_b), optree.tree_leaves(grads_b), strict=True):
            assert u.data_ptr() == g.data_ptr()
        assert_tree_equal(updates_a, updates_b)
        assert_tree_equal(state_a, state_b)
        params_a = apply_updates(params_a, updates_a)
        params_b = apply_updates(params_b, updates_b)


EXECUTION_OPTIMIZERS = {
    **ALL_OPTIMIZERS,
    "sgd_tensor_hyperparameters": lambda: sgd(
        torch.tensor(0.1, dtype=torch.float64),
        momentum=0.9,
        weight_decay=torch.tensor(1e-2, dtype=torch.float64),
    ),
    "adamw_scheduled": lambda: adamw(
        lambda count: 0.01 / (1.0 + count), weight_decay=lambda count: 0.1 / (1.0 + count)
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(EXECUTION_OPTIMIZERS))
def test_in_place_pure_and_vmapped_updates_agree(name, dtype):
    """One result whatever the execution: in place and pure updates are bitwise equal, and a
    vmapped ensemble equals its members, also with channels_last params and contiguous grads
    (a stage that wrote into a buffer of the other layout would run other kernels and round
    otherwise) and with float64 tensor hyperparameters on low-precision params (an
    out-of-place ``addcmul`` by a float64 0-d tensor promotes the result under vmap)."""
    opt = EXECUTION_OPTIMIZERS[name]()
    gen = torch.Generator().manual_seed(11)

    def member():
        weight = torch.randn(8, 3, 5, 5, generator=gen, dtype=torch.float64).to(dtype)
        bias = torch.randn(8, generator=gen, dtype=torch.float64).to(dtype)
        return {"weight": weight.to(memory_format=torch.channels_last), "bias": bias}

    members = [member() for _ in range(3)]
    batched = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    pure_params, inplace_params = members[0], clone_tree(members[0])
    pure_state, inplace_state = opt.init(pure_params), opt.init(inplace_params)
    states, batched_state = [opt.init(m) for m in members], vmap(opt.init)(batched)
    vupdate = vmap(functools.partial(opt.update, inplace=False))
    for _ in range(6):
        grads = [
            optree.tree_map(lambda p: torch.randn(p.shape, generator=gen).to(dtype), m)
            for m in members
        ]
        pure_updates, pure_state = opt.update(grads[0], pure_state, pure_params, inplace=False)
        inplace_updates, inplace_state = opt.update(
            clone_tree(grads[0]), inplace_state, inplace_params, inplace=True
        )
        assert_tree_equal(inplace_updates, pure_updates)
        assert_tree_equal(inplace_state, pure_state)
        pure_params = apply_updates(pure_params, pure_updates)
        inplace_params = apply_updates(inplace_params, inplace_updates)

        stacked = optree.tree_map(lambda *xs: torch.stack(xs), *grads)
        batched_updates, batched_state = vupdate(stacked, batched_state, batched)
        batched = apply_updates(batched, batched_updates)
        for i in range(3):
            updates, states[i] = opt.update(grads[i], states[i], members[i], inplace=False)
            members[i] = apply_updates(members[i], updates)
    for i in range(3):
        ours = optree.tree_map(lambda x, i=i: x[i], (batched, batched_state))
        theirs = (members[i], states[i])
        for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(theirs), strict=True):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("contiguous_grads", [False, True], ids=["cl_grads", "contig_grads"])
@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_channels_last_is_preserved(name, inplace, contiguous_grads):
    opt = ALL_OPTIMIZERS[name]()
    cl = torch.channels_last
    weight = torch.randn(8, 3, 5, 5, dtype=torch.float64).to(memory_format=cl)
    params = {"weight": weight, "bias": torch.randn(8, dtype=torch.float64)}
    assert not weight.is_contiguous()
    state = opt.init(params)
    bufs = state[1:] if isinstance(state, AdamState) else [state.momentum_buffer]
    for buf in bufs:
        if buf:
            assert buf["weight"].is_contiguous(memory_format=cl)
    for _ in range(3):
        g = torch.randn_like(params["weight"])
        if contiguous_grads:
            g = g.contiguous()
        grads = {"weight": g, "bias": torch.randn(8, dtype=torch.float64)}
        updates, state = opt.update(grads, state, params, inplace=inplace)
        assert updates["weight"].shape == weight.shape
        assert updates["weight"].dtype == weight.dtype
        if not contiguous_grads:
            assert updates["weight"].is_contiguous(memory_format=cl)
        params = apply_updates(params, updates)
        assert params["weight"].is_contiguous(memory_format=cl)
        assert not params["weight"].is_contiguous()
    bufs = state[1:] if isinstance(state, AdamState) else [state.momentum_buffer]
    for buf in bufs:
        if buf:
            assert buf["weight"].is_contiguous(memory_format=cl)


def test_states_hold_only_tensors():
    params = make_params()
    no_momentum = sgd(0.1).init(params)
    assert isinstance(no_momentum, SgdState)
    assert no_momentum.momentum_buffer == ()
    assert no_momentum.count.dtype == torch.int64 and no_momentum.count.shape == ()
    for opt in (sgd(0.1, momentum=0.5), adam(), adamw()):
        state = opt.init(params)
        assert isinstance(state, (SgdState, AdamState))
        assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state))
        assert state.count.dtype == torch.int64 and int(state.count) == 0
        for buf in state[1:]:
            assert optree.tree_structure(buf) == optree.tree_structure(params)
    assert isinstance(sgd(0.1), InnerOptimizer)


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_state_save_load_round_trip(name):
    opt = ALL_OPTIMIZERS[name]()
    params = make_params()
    state = opt.init(params)
    for noise in noise_sequence(params, 3):
        updates, state = opt.update(gradients(params, noise), state, params)
        params = apply_updates(params, updates)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is type(state)
    assert_tree_equal(loaded, state)
    # both continue identically
    grads = gradients(params, noise_sequence(params, 1, seed=7)[0])
    u1, s1 = opt.update(clone_tree(grads), state, params)
    u2, s2 = opt.update(clone_tree(grads), loaded, params)
    assert_tree_equal(u1, u2)
    assert_tree_equal(s1, s2)


def test_pure_update_is_differentiable():
    """With ``inplace=False`` the update is an ordinary differentiable function."""
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 4, generator=gen, dtype=torch.float64)

    def one_step(opt, p):
        state = opt.init(p)
        state = opt.update(g.clone(), state, p, inplace=False)[1]  # warm up the moments
        updates, _ = opt.update(g * torch.tanh(p), state, p, inplace=False)
        return p + updates

    for opt in (sgd(0.1, momentum=0.9, weight_decay=0.1), adam(0.1, weight_decay=0.1), adamw()):
        p = p0.clone().requires_grad_()
        assert torch.autograd.gradcheck(functools.partial(one_step, opt), (p,))
        jac = torch.func.jacrev(functools.partial(one_step, opt))(p0)
        assert torch.isfinite(jac).all()


def test_sgd_weight_decay_gradient():
    p = torch.randn(5, dtype=torch.float64)
    opt = sgd(0.1, weight_decay=0.5)
    state = opt.init(p)
    jac = torch.func.jacrev(lambda q: q + opt.update(torch.ones_like(q), state, q, False)[0])(p)
    torch.testing.assert_close(jac, torch.eye(5, dtype=torch.float64) * (1 - 0.1 * 0.5))


def test_pytree_containers_and_empty_tree():
    opt = adam(0.1)
    params = {"a": [torch.ones(2), (torch.zeros(3), None)], "b": torch.ones(())}
    state = opt.init(params)
    grads = {"a": [torch.ones(2), (torch.ones(3), None)], "b": torch.ones(())}
    updates, state = opt.update(grads, state)
    assert optree.tree_structure(updates) == optree.tree_structure(params)
    empty_state = sgd(0.1, momentum=0.9).init({})
    updates, empty_state = sgd(0.1, momentum=0.9).update({}, empty_state)
    assert updates == {} and int(empty_state.count) == 1


# --------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------

INVALID = [
    (sgd, {"lr": -1.0}, ValueError, "lr"),
    (sgd, {"lr": float("nan")}, ValueError, "lr"),
    (sgd, {"lr": float("inf")}, ValueError, "lr"),
    (sgd, {"lr": "0.1"}, TypeError, "lr"),
    (sgd, {"lr": True}, TypeError, "lr"),
    (sgd, {"lr": torch.tensor([0.1])}, TypeError, "lr"),
    (sgd, {"lr": torch.tensor(True)}, TypeError, "lr"),
    (sgd, {"lr": torch.tensor(-0.1, dtype=torch.float64)}, ValueError, "lr"),
    (sgd, {"lr": torch.tensor(float("nan"))}, ValueError, "lr"),
    (sgd, {"lr": 0.1, "weight_decay": "0"}, TypeError, "weight_decay"),
    (sgd, {"lr": 0.1, "momentum": lambda count: 0.9}, TypeError, "momentum"),
    (adam, {"lr": torch.tensor(1e-3 + 0j)}, TypeError, "lr"),
    (adam, {"lr": None}, TypeError, "lr"),
    (adamw, {"weight_decay": torch.ones(2)}, TypeError, "weight_decay"),
    (sgd, {"lr": 0.1, "momentum": -0.5}, ValueError, "momentum"),
    (sgd, {"lr": 0.1, "momentum": None}, TypeError, "momentum"),
    (sgd, {"lr": 0.1, "dampening": -0.1}, ValueError, "dampening"),
    (sgd, {"lr": 0.1, "weight_decay": -1e-4}, ValueError, "weight_decay"),
    (sgd, {"lr": 0.1, "nesterov": True}, ValueError, "nesterov"),
    (sgd, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, ValueError,
     "nesterov"),
    (sgd, {"lr": 0.1, "momentum": 0.9, "nesterov": 1}, TypeError, "nesterov"),
    (adam, {"lr": -1e-3}, ValueError, "lr"),
    (adam, {"betas": (1.0, 0.999)}, ValueError, "betas[0]"),
    (adam, {"betas": (0.9, -0.1)}, ValueError, "betas[1]"),
    (adam, {"betas": (0.9, float("nan"))}, ValueError, "betas[1]"),
    (adam, {"betas": 0.9}, TypeError, "betas"),
    (adam, {"betas": (0.9, 0.99, 0.9)}, TypeError, "betas"),
    (adam, {"betas": (0.9, "x")}, TypeError, "betas[1]"),
    (adam, {"eps": -1e-8}, ValueError, "eps"),
    (adam, {"weight_decay": -0.1}, ValueError, "weight_decay"),
    (adamw, {"lr": -0.1}, ValueError, "lr"),
    (adamw, {"betas": (0.9, 1.0)}, ValueError, "betas[1]"),
    (adamw, {"eps": "1e-8"}, TypeError, "eps"),
    (adamw, {"weight_decay": -1e-2}, ValueError, "weight_decay"),
]  # fmt: skip


@pytest.mark.parametrize(("factory", "kwargs", "exc", "arg"), INVALID)
def test_invalid_hyperparameters(factory, kwargs, exc, arg):
    with pytest.raises(exc, match=f"{factory.__name__}: `{arg}`".replace("[", r"\[")):
        factory(**kwargs)


EDGE_HYPERPARAMETERS = [
    # (ours, torch.optim's twin with the same hyperparameters)
    (
        lambda: sgd(0, momentum=0, dampening=0, weight_decay=0),
        (torch.optim.SGD, dict(lr=0.0, momentum=0, dampening=0, weight_decay=0)),
    ),
    (
        lambda: sgd(torch.tensor(0), weight_decay=torch.tensor(0.0, dtype=torch.float64)),
        (torch.optim.SGD, dict(lr=0.0)),
    ),
    (
        lambda: adamw(lambda count: 1e-3, weight_decay=lambda count: 0.0),
        (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.0)),
    ),
    (  # torch.optim accepts these too
        lambda: sgd(1, momentum=1.5, dampening=2.0),
        (torch.optim.SGD, dict(lr=1.0, momentum=1.5, dampening=2.0)),
    ),
    (
        lambda: adam(0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0),
        (torch.optim.Adam, dict(lr=0.0, betas=(0.0, 0.0), eps=0.0, weight_decay=0)),
    ),
    (lambda: adamw(1, betas=[0.5, 0.5]), (torch.optim.AdamW, dict(lr=1.0, betas=(0.5, 0.5)))),
]


@pytest.mark.parametrize("case", range(len(EDGE_HYPERPARAMETERS)))
def test_valid_edge_hyperparameters(case):
    """Edge values that torch.optim accepts are accepted and mean what they mean there: a few
    steps equal torch.optim's with the same hyperparameters."""
    make, (torch_cls, torch_kwargs) = EDGE_HYPERPARAMETERS[case]
    run_against_torch(make(), torch_cls, torch_kwargs, torch.float64, False, (), steps=5)


def test_message_format():
    with pytest.raises(ValueError, match=r"^sgd: `lr` must be a non-negative float, got -1.0$"):
        sgd(-1.0)


def test_update_argument_errors():
    params = make_params()
    for opt in (sgd(0.1, weight_decay=0.1), adam(weight_decay=0.1), adamw()):
        state = opt.init(params)
        with pytest.raises(ValueError, match="`params`"):
            opt.update(clone_tree(params), state)
    opt = adam()
    state = opt.init(params)
    with pytest.raises(ValueError, match="structure"):
        opt.update({"conv": params["conv"]}, state)
    with pytest.raises(TypeError, match="pytree of tensors"):
        opt.init({"a": 1.0})


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize(
    "name, factory",
    [
        ("sgd", lambda: sgd(0.1, momentum=0.9)),
        ("adam", lambda: adam(1e-2)),
        ("adamw", lambda: adamw(1e-2, weight_decay=0.1)),
    ],
)
def test_standalone_update_refuses_updates_of_another_shape(name, factory, inplace):
    """Called alone (not under `anderson`, which checks the grads first), an update whose
    shapes differ from the state's buffers or the params is refused before anything is
    written. Here the grads (5,) broadcast against buffers of shape (2, 5): without the check
    the in-place update wrote the moments and then raised from torch, and the pure one
    returned updates of the buffers' shape (2, 5)."""
    opt = factory()
    params = torch.zeros(2, 5)
    state = opt.init(params)
    grads = torch.ones(5)
    watched = [x for x in optree.tree_leaves((state, params, grads)) if isinstance(x, torch.Tensor)]
    before = [(x.clone(), x._version) for x in watched]
    with pytest.raises(ValueError, match=r"`updates` has shape \(5,\), expected \(2, 5\) like"):
        opt.update(grads, state, params=params, inplace=inplace)
    for (copy, version), x in zip(before, watched, strict=True):
        assert x._version == version and torch.equal(x, copy)
    # Params of another shape than the updates (the decay reads them): refused as well.
    if name == "adamw":
        with pytest.raises(ValueError, match=r"expected \(1,\) like `params`"):
            opt.update(torch.ones(5), opt.init(torch.zeros(5)), params=torch.zeros(1))


@pytest.mark.parametrize("factory", [lambda: sgd(0.1), adam, adamw])
def test_init_refuses_integer_params(factory):
    """An integer or bool leaf would get integer buffers, which round every update."""
    refused = r"`params\['n'\]` must be a floating-point or complex tensor, got torch.int64"
    with pytest.raises(TypeError, match=refused):
        factory().init({"w": torch.zeros(2), "n": torch.arange(3)})
    with pytest.raises(TypeError, match="floating-point or complex tensor, got torch.bool"):
        factory().init(torch.zeros(2, dtype=torch.bool))
    factory().init(torch.zeros(2, dtype=torch.complex64))  # complex: as torch.optim


def _watch(*trees):
    """Every tensor of `trees` with a copy of its values and its version counter."""
    tensors = [x for x in optree.tree_leaves(trees) if isinstance(x, torch.Tensor)]
    return [(x, x.clone(), x._version) for x in tensors]


def _unchanged(watched):
    return all(x._version == version and torch.equal(x, copy) for x, copy, version in watched)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_standalone_update_refuses_integer_grads(name, inplace):
    """Called alone (not under `anderson`, which checks the grads first), an integer update is
    refused, naming it, before anything is written. Without the check sgd with momentum
    wrote its buffer and then raised from torch in place (its integer grads truncated the
    step), Adam raised torch's error, and the pure plain sgd returned an update."""
    opt = ALL_OPTIMIZERS[name]()
    params = {"w": torch.zeros(3)}
    state = opt.init(params)
    _, state = opt.update({"w": torch.ones(3)}, state, params=params, inplace=False)
    grads = {"w": torch.tensor([3, 5, 9])}
    watched = _watch(state, params, grads)
    refused = r"`updates\['w'\]` must be a floating-point or complex tensor"
    with pytest.raises(TypeError, match=refused):
        opt.update(grads, state, params=params, inplace=inplace)
    assert _unchanged(watched)


@pytest.mark.parametrize("inplace", ["no", 1, None])
@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_update_refuses_a_non_bool_inplace(name, inplace):
    """`inplace="no"` is truthy: without the check it ran in place, writing the grads and the
    buffers. Refused before anything is written."""
    opt = ALL_OPTIMIZERS[name]()
    params = {"w": torch.zeros(3)}
    state = opt.init(params)
    grads = {"w": torch.ones(3)}
    watched = _watch(state, params, grads)
    fn = name.split("_")[0]
    with pytest.raises(TypeError, match=rf"^{fn}: `inplace` must be a bool, got"):
        opt.update(grads, state, params=params, inplace=inplace)
    assert _unchanged(watched)


def _expanded_grads():
    """Grads that share memory, as `torch.func.grad` returns them for a sum or a mean (an
    `expand`-ed tensor), with unequal values along the undivided dimension."""
    row = torch.tensor([[0.5, -1.5, 2.0, 0.25]], dtype=torch.float64)
    return {
        "w": row.expand(3, 4),
        "b": grad(lambda b: b.sum())(torch.zeros(4, dtype=torch.float64)),
    }


@pytest.mark.parametrize("name", list(ALL_OPTIMIZERS))
def test_in_place_update_of_expanded_grads(name):
    """Expanded grads cannot hold the update: in place the update is returned in a new tensor
    (as the protocol's "may" allows), the caller's grads keep their values and versions, and
    updates and state equal, bit for bit, those of the same grads made contiguous. Without
    this the final write into the grads raised from torch after the state was written."""
    opt = ALL_OPTIMIZERS[name]()
    params = {"w": torch.full((3, 4), 0.5, dtype=torch.float64), "b": torch.ones(4).double()}
    state, twin = opt.init(params), opt.init(params)
    for _ in range(3):  # the first update, then the momentum's other branch
        grads = _expanded_grads()
        assert grads["b"].stride() == (0,)
        watched = _watch(grads, params)
        updates, state = opt.update(grads, state, params=params, inplace=True)
        assert _unchanged(watched)
        dense = optree.tree_map(torch.clone, grads)
        expected, twin = opt.update(dense, twin, params=params, inplace=True)
        assert_tree_equal(updates, expected)
        assert_tree_equal(state, twin)
        params = apply_updates(params, updates)


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adam"])
def test_in_place_update_of_expanded_grads_under_vmap(name):
    """Grads from `torch.func.grad` of a sum inside `vmap` are expanded per member: the
    vmapped in-place update equals the one of contiguous grads."""
    opt = ALL_OPTIMIZERS[name]()
    params = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def step(p, state, expand):
        g = grad(lambda q: q.sum() * 3.0)(p)
        return opt.update(g if expand else g.contiguous(), state, params=p, inplace=True)

    for expand in (True, False):
        state = vmap(opt.init)(params)
        for _ in range(2):
            updates, state = vmap(functools.partial(step, expand=expand))(params, state)
        if expand:
            got = (updates, state)
    assert_tree_equal(got, (updates, state))


# --------------------------------------------------------------------------------------------
# Schedules and tensor hyperparameters.
# --------------------------------------------------------------------------------------------


def _warmup_decay(epoch):
    """A LambdaLR factor: linear warm-up over 5 updates, then geometric decay. Plain
    arithmetic, so the same function serves torch.optim (a Python int) and us (a float64
    tensor)."""
    return min(1.0, (epoch + 1) / 5) * 0.9**epoch


SCHEDULED = {
    "sgd": (lambda lr: sgd(lr, momentum=0.9, weight_decay=1e-2), torch.optim.SGD,
            {"momentum": 0.9, "weight_decay": 1e-2}, 0.05),
    "nesterov": (lambda lr: sgd(lr, momentum=0.9, nesterov=True), torch.optim.SGD,
                 {"momentum": 0.9, "nesterov": True}, 0.05),
    "adam": (lambda lr: adam(lr, weight_decay=0.1), torch.optim.Adam, {"weight_decay": 0.1}, 0.02),
    "adamw": (lambda lr: adamw(lr, weight_decay=0.1), torch.optim.AdamW, {"weight_decay": 0.1},
              0.02),
}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SCHEDULED))
def test_lambda_lr_schedule_matches_torch(name, dtype):
    make, cls, kwargs, base = SCHEDULED[name]
    run_against_torch(
        make(lambda count: base * _warmup_decay(count)),
        cls,
        {"lr": base, **kwargs},
        dtype,
        True,
        [],
        steps=20,
        scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _warmup_decay),
    )


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("name", list(SCHEDULED))
def test_step_lr_schedule_matches_torch(name, inplace):
    """StepLR(step_size=4, gamma=0.5) as a tensor expression of the count (vmap-able)."""
    make, cls, kwargs, base = SCHEDULED[name]
    run_against_torch(
        make(lambda count: base * 0.5 ** torch.div(count, 4, rounding_mode="floor")),
        cls,
        {"lr": base, **kwargs},
        torch.float64,
        inplace,
        [],
        steps=20,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
    )


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_weight_decay_schedule_matches_torch(name):
    """A scheduled weight decay against torch.optim with its param group changed by hand."""
    factory, cls = {"sgd": (sgd, torch.optim.SGD), "adam": (adam, torch.optim.Adam),
                    "adamw": (adamw, torch.optim.AdamW)}[name]  # fmt: skip
    decay = lambda count: 0.1 / (1.0 + count)  # noqa: E731

    def set_decay(torch_opt, t):
        torch_opt.param_groups[0]["weight_decay"] = 0.1 / (1.0 + t)

    run_against_torch(
        factory(0.02, weight_decay=decay),
        cls,
        {"lr": 0.02},
        torch.float64,
        True,
        [],
        steps=15,
        before_step=set_decay,
    )


def test_schedule_sees_the_state_count():
    seen = []

    def schedule(count):
        seen.append(count.clone())
        return 0.1

    opt = sgd(schedule)
    params = make_params()
    state = opt.init(params)
    for _ in range(3):
        _, state = opt.update(clone_tree(params), state, params)
    assert [c.dtype for c in seen] == [torch.float64] * 3
    assert [float(c) for c in seen] == [0.0, 1.0, 2.0]
    assert all(c.shape == () for c in seen)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_tensor_and_constant_schedule_equal_a_number(name):
    """lr = 0.05, lr = tensor(0.05) and lr = (count -> 0.05 or tensor(0.05)) give the same bits."""
    factory = {"sgd": sgd, "adam": adam, "adamw": adamw}[name]
    runs = []
    for lr in (
        0.05,
        torch.tensor(0.05, dtype=torch.float64),
        lambda count: 0.05,
        lambda count: torch.full_like(count, 0.05),
    ):
        opt = factory(lr)
        params = make_params()
        state = opt.init(params)
        for noise in noise_sequence(params, 4):
            updates, state = opt.update(gradients(params, noise), state, params)
            params = apply_updates(params, updates)
        runs.append(params)
    for other in runs[1:]:
        assert_tree_equal(other, runs[0])


def test_tensor_lr_is_read_at_every_update():
    """An in-place change of a tensor lr takes effect, like a changed torch.optim param group."""
    lr = torch.tensor(0.05, dtype=torch.float64)

    def halve_at_10(torch_opt, t):
        if t == 10:
            torch_opt.param_groups[0]["lr"] = 0.025
            lr.fill_(0.025)

    # before_step runs before both optimizers' step t, so both see the new value there.
    run_against_torch(
        sgd(lr, momentum=0.9), torch.optim.SGD, {"lr": 0.05, "momentum": 0.9},
        torch.float64, True, [], steps=20, before_step=halve_at_10,
    )  # fmt: skip


def test_batched_tensor_lr_under_vmap():
    """A batched 0-d lr gives each ensemble member its own learning rate."""
    lrs = torch.tensor([0.1, 0.05, 0.2], dtype=torch.float64)
    members = [make_params(seed=s) for s in range(3)]
    batched = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    state = vmap(adam().init)(batched)

    def step(lr, grads, state, params):
        return adam(lr, weight_decay=0.01).update(grads, state, params, inplace=False)

    states = [adam().init(m) for m in members]
    for t in range(4):
        grads = [gradients(m, noise_sequence(m, 1, seed=20 + t)[0]) for m in members]
        stacked_grads = optree.tree_map(lambda *xs: torch.stack(xs), *grads)
        updates, state = vmap(step)(lrs, stacked_grads, state, batched)
        batched = apply_updates(batched, updates)
        for i, lr in enumerate((0.1, 0.05, 0.2)):
            u, states[i] = adam(lr, weight_decay=0.01).update(grads[i], states[i], members[i])
            members[i] = apply_updates(members[i], u)
    for i, member in enumerate(members):
        ours = optree.tree_map(lambda x, i=i: x[i], batched)
        for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(member), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_schedule_under_vmap_matches_separate_members():
    schedule = lambda count: 0.1 * 0.5 ** torch.div(count, 2, rounding_mode="floor")  # noqa: E731
    opt = sgd(schedule, momentum=0.9)
    members = [make_params(seed=s) for s in range(2)]
    batched = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    state = vmap(opt.init)(batched)
    states = [opt.init(m) for m in members]
    for t in range(5):
        grads = [gradients(m, noise_sequence(m, 1, seed=30 + t)[0]) for m in members]
        stacked = optree.tree_map(lambda *xs: torch.stack(xs), *grads)
        updates, state = vmap(functools.partial(opt.update, inplace=False))(stacked, state, batched)
        batched = apply_updates(batched, updates)
        for i in range(2):
            u, states[i] = opt.update(grads[i], states[i], members[i])
            members[i] = apply_updates(members[i], u)
    for i, member in enumerate(members):
        ours = optree.tree_map(lambda x, i=i: x[i], batched)
        for a, b in zip(optree.tree_leaves(ours), optree.tree_leaves(member), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_scheduled_anderson_run_resumes_bit_identically(mode):
    """A scheduled run saved mid-way and resumed with a freshly built optimizer (nothing kept
    in Python) continues bit for bit: the schedule reads the count from the state."""
    import aadl_func as aa

    def build():
        return aa.anderson(
            adam(lambda count: 0.05 * 0.5 ** torch.div(count, 4, rounding_mode="floor")),
            history_depth=4,
            mode=mode,
        )

    def grads_at(params, t):
        return gradients(params, noise_sequence(params, 1, seed=40 + t)[0])

    opt = build()
    params = make_params()
    state = opt.init(params)
    for t in range(12):
        if t == 5:
            buffer = io.BytesIO()
            torch.save((params, state), buffer)
        params, state = opt.update(state, params, grads_at(params, t), inplace=True)
    assert int(state.num_mixed) > 0

    buffer.seek(0)
    resumed_params, resumed_state = torch.load(buffer, weights_only=True)
    resumed = build()
    for t in range(5, 12):
        resumed_params, resumed_state = resumed.update(
            resumed_state, resumed_params, grads_at(resumed_params, t), inplace=True
        )
    assert_tree_equal(resumed_params, params)
    assert_tree_equal(resumed_state, state)


def test_failing_schedule_changes_nothing():
    """A schedule that fails (here: a bad value at the third update) raises before the inner
    optimizer or the window writes anything, also in place."""
    import aadl_func as aa

    def schedule(count):
        return 0.1 if float(count) < 2 else "0.1"

    opt = aa.anderson(sgd(schedule, momentum=0.9), history_depth=4)
    params = make_params()
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.update(state, params, gradients(params, noise_sequence(params, 1)[0]))
    grads = gradients(params, noise_sequence(params, 1, seed=3)[0])
    watched = [x for x in optree.tree_leaves((state, params, grads)) if isinstance(x, torch.Tensor)]
    before = [(x.clone(), x._version) for x in watched]
    with pytest.raises(TypeError, match="the `lr` schedule must return a real number"):
        opt.update(state, params, grads, inplace=True)
    for (copy, version), x in zip(before, watched, strict=True):
        assert x._version == version and torch.equal(x, copy)


def test_standalone_update_rejects_another_state():
    params = make_params()
    with pytest.raises(TypeError, match="`state` must be an SgdState"):
        sgd(0.1).update(clone_tree(params), adam().init(params))
    with pytest.raises(TypeError, match="`state` must be an AdamState"):
        adamw().update(clone_tree(params), sgd(0.1).init(params), params)
    with pytest.raises(TypeError, match="`updates` is None"):
        sgd(0.1).update(None, sgd(0.1).init(params))


LEAF_UPDATE_CASES = {
    "sgd-momentum-nesterov": lambda: sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: adam(1e-2),
    "adam-schedule": lambda: adam(lambda t: 1e-2 / (1.0 + t), betas=(0.5, 0.99)),
    "adamw": lambda: adamw(1e-2, weight_decay=0.1),
    "adamw-no-decay": lambda: adamw(1e-2, betas=(0.0, 0.999), weight_decay=0.0),
}
# Adam with a number lr and no decay takes its known rule (`transforms.adam_leaves`) for
# float32 and float64 leaves, and the stages for bfloat16 ones: each dtype against `update`.
LEAF_UPDATE_DTYPES = [(name, torch.float32) for name in LEAF_UPDATE_CASES] + [
    (name, dtype)
    for name in ("adam", "adamw-no-decay")
    for dtype in (torch.float64, torch.bfloat16)
]


@pytest.mark.parametrize(("name", "dtype"), LEAF_UPDATE_DTYPES)
def test_update_leaves_is_the_pure_update(name, dtype):
    """`update.update_leaves` (anderson's steady call, on leaves it checked) gives the bytes
    of `update(..., inplace=False)` over several steps, leaves its inputs alone, and declines
    (None) a state whose buffers no longer fit the grads, where `update` raises."""
    opt = LEAF_UPDATE_CASES[name]()
    params = make_params(dtype)
    leaves, spec = optree.tree_flatten(params)
    state = opt.init(params)
    for noise in noise_sequence(params, 5):
        grads = gradients(params, noise)
        g_leaves = optree.tree_leaves(grads)
        before = clone_tree((state, grads, params))
        updates, expected = opt.update(grads, state, params=params, inplace=False)
        got_updates, got = opt.update.update_leaves(g_leaves, state, leaves, spec)
        assert_tree_equal(optree.tree_unflatten(spec, got_updates), updates)
        assert_tree_equal(got, expected)
        assert type(got) is type(expected)
        assert_tree_equal((state, grads, params), before)
        state = expected
    cut = optree.tree_map(lambda t: t.reshape(-1)[:1], state[1])  # another shape
    replaced = state._replace(**{state._fields[1]: cut})
    assert opt.update.update_leaves(g_leaves, replaced, leaves, spec) is None
    with pytest.raises(ValueError, match="has shape"):
        opt.update(grads, replaced, params=params, inplace=False)


def test_adam_known_rule_on_a_tree_of_mixed_leaves_is_the_pure_update():
    """On several CPU leaves `transforms.adam_leaves` runs torch's foreach ops: each leaf's
    bytes are still those of `update(..., inplace=False)` (the stages, leaf by leaf), with
    float32 and float64 leaves in one tree, a 0-d leaf and a channels_last one."""
    gen = torch.Generator().manual_seed(3)
    params = {
        "conv": torch.randn(4, 3, 5, 5, generator=gen).contiguous(
            memory_format=torch.channels_last
        ),
        "bias": torch.randn(4, generator=gen, dtype=torch.float64),
        "scale": torch.randn((), generator=gen),
    }
    opt = adam(3e-2, betas=(0.8, 0.99), eps=1e-6)
    leaves, spec = optree.tree_flatten(params)
    state = opt.init(params)
    for scale in (1.0, 0.1, 1e-2, 1e-3):
        grads = optree.tree_map(lambda p, s=scale: torch.randn(p.shape, generator=gen).to(p) * s,
                                params)  # fmt: skip
        updates, expected = opt.update(grads, state, params=params, inplace=False)
        got_updates, got = opt.update.update_leaves(optree.tree_leaves(grads), state, leaves, spec)
        assert_tree_equal(optree.tree_unflatten(spec, got_updates), updates)
        assert_tree_equal(got, expected)
        state = expected
    # No leaves: nothing to compute (torch's foreach ops would refuse the empty lists).
    assert adam_leaves([], [], [], 0, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8) == ([], [], [])


def test_adam_known_rule_declines_other_leaves():
    """`transforms.adam_leaves` computes nothing for a leaf it does not take (complex, half
    precision), so that `update_leaves` runs the stages, which handle them."""
    for dtype in (torch.complex64, torch.bfloat16, torch.float16):
        g = torch.ones(3, dtype=dtype)
        m, v = torch.zeros_like(g), torch.zeros_like(g)
        assert adam_leaves([torch.ones(3), g], [torch.zeros(3), m], [torch.zeros(3), v], 0,
                           lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8) is None  # fmt: skip

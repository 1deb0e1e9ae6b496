"""``update`` and autograd: inputs that require grad, differentiating through, mixed dtypes.

The policy (``aadl_func._src.checks.autograd_policy``, README *Autograd*):

* eager autograd: ``init``/``update`` run without grad, whatever the inputs carry; no graph is
  recorded through the window, and the returned params keep the given ``requires_grad``
  flags (leaves stay leaves), in both modes, in place or not;
* under torch.func's differentiating transforms (``grad``, ``vjp``, ``jvp``, ...) grad stays
  on: a pure ``update`` is an ordinary differentiable function of its inputs (checked here
  against finite differences), and ``inplace=True`` is refused up front (docs/errors.md);
* grads of another floating dtype are cast to the params' dtype, as ``torch.optim`` promotes
  them (checked here against ``torch.optim``).
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, stack_module_state, vjp, vmap

import aadl_func as aa

MODES = ("aadl", "classic")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(24, 6, generator=gen), torch.randint(0, 3, (24,), generator=gen)


def _state_tensors(state: aa.AndersonState) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)]


def _train(params: dict, model: torch.nn.Module, mode: str, inplace: bool, steps: int = 6):
    x, y = _data()

    def loss(p):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    opt = aa.anderson(aa.sgd(0.5), history_depth=4, mode=mode)
    state = opt.init(params)
    history = []
    for _ in range(steps):
        grads = grad(loss)(params)
        given = params
        params, state = opt.update(state, params, grads, inplace=inplace, loss_fn=loss)
        # Values as of this step (an in-place run keeps writing into the same tensors).
        values = {k: v.detach().clone() for k, v in params.items()}
        history.append((given, params, values, state))
    return history


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_named_parameters_without_detach(mode, inplace):
    """``dict(model.named_parameters())`` as torchopt users pass it: same values as detached
    params, no graph anywhere, params still leaves that require grad."""
    model = _model()
    params = dict(model.named_parameters())
    assert all(p.requires_grad and p.is_leaf for p in params.values())
    detached = {k: v.detach().clone() for k, v in _model().named_parameters()}
    history = _train(params, model, mode, inplace)
    reference = _train(detached, _model(), mode, inplace)
    assert int(history[-1][3].num_mixed) > 0  # the window and the mix did run
    for (given, out, values, state), (_, _, ref_values, _) in zip(history, reference, strict=True):
        for name, p in out.items():
            assert p.requires_grad and p.is_leaf and p.grad_fn is None, name
            assert torch.equal(values[name], ref_values[name]), name
            if inplace:  # written into the caller's nn.Parameters
                assert p is given[name]
        for t in _state_tensors(state):
            assert not t.requires_grad and t.grad_fn is None
    # The returned leaves train on: backward reaches them.
    x, y = _data()
    out = history[-1][1]
    F.cross_entropy(functional_call(model, out, (x,)), y).backward()
    assert all(p.grad is not None for p in out.values())


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_inputs_with_history(mode, inplace):
    """Grads made with ``create_graph=True``, params that are outputs of a graph (not leaves)
    and a ``loss_fn`` that returns a loss with history: nothing is recorded; the returned
    params are leaves flagged like the inputs."""
    model = _model()
    x, y = _data()
    weights = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}

    def loss(p):
        with torch.enable_grad():  # a loss with history even inside update's no_grad
            value = F.cross_entropy(functional_call(model, p, (x,)), y)
        assert value.requires_grad == any(t.requires_grad for t in p.values())
        return value

    opt = aa.anderson(aa.adam(0.05), history_depth=4, mode=mode)
    params = {k: 1.0 * v for k, v in weights.items()}  # non-leaves with a grad_fn
    state = opt.init(params)
    for step in range(5):
        value = F.cross_entropy(functional_call(model, params, (x,)), y)
        grads = dict(
            zip(params, torch.autograd.grad(value, list(params.values()), create_graph=True))
        )
        assert all(g.grad_fn is not None for g in grads.values())
        params, state = opt.update(state, params, grads, inplace=inplace and step > 0, loss_fn=loss)
        for p in params.values():
            assert p.requires_grad and p.grad_fn is None and p.is_leaf
        assert not any(t.requires_grad for t in _state_tensors(state))
    assert int(state.num_mixed) + int(state.num_rejected) > 0


def test_flags_follow_the_inputs_leaf_by_leaf():
    frozen = {"a": torch.ones(3), "b": torch.ones(2, requires_grad=True)}
    opt = aa.anderson(aa.sgd(0.1))
    out, _ = opt.update(opt.init(frozen), frozen, {"a": torch.ones(3), "b": torch.ones(2)})
    assert not out["a"].requires_grad and out["b"].requires_grad and out["b"].is_leaf


# torch.func.jvp's first call loads decompositions that torch itself scripts with torch.jit,
# which warns (a DeprecationWarning in 2.13, a FutureWarning in 2.15): any category.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("mode", MODES)
def test_differentiating_through_a_pure_update(mode):
    """Under torch.func.grad/jvp a pure update (window, mix, safeguard) is differentiable:
    the derivative of a loss after one mixing step matches central finite differences."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    hessian = a @ a.T / 6 + torch.eye(6, dtype=torch.float64)

    def loss(p):
        return (
            0.5 * p["x"] @ hessian @ p["x"] + F.softplus(p["y"]).sum() + 0.1 * (p["y"] ** 2).sum()
        )

    opt = aa.anderson(aa.sgd(0.2), history_depth=4, mode=mode)
    params = {
        "x": torch.randn(6, generator=gen, dtype=torch.float64),
        "y": torch.randn(2, 2, generator=gen, dtype=torch.float64),
    }
    state = opt.init(params)
    for _ in range(4):  # the 5th update's mix is kept in both modes
        params, state = opt.update(state, params, grad(loss)(params), loss_fn=loss)
    mixed_before = int(state.num_mixed)

    def after_one_update(p):
        out, new_state = opt.update(state, p, grad(loss)(p), loss_fn=loss)
        return loss(out), new_state.num_mixed

    value, num_mixed = after_one_update(params)
    assert int(num_mixed) == mixed_before + 1  # the differentiated update is a mixing one
    direction = {
        k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()
    }
    eps = 1e-6
    plus = after_one_update({k: params[k] + eps * direction[k] for k in params})[0]
    minus = after_one_update({k: params[k] - eps * direction[k] for k in params})[0]
    finite_difference = (plus - minus) / (2 * eps)

    gradient = grad(lambda p: after_one_update(p)[0])(params)
    directional = sum((gradient[k] * direction[k]).sum() for k in params)
    torch.testing.assert_close(directional, finite_difference, rtol=1e-6, atol=1e-9)
    _, tangent = jvp(lambda p: after_one_update(p)[0], (params,), (direction,))
    torch.testing.assert_close(tangent, finite_difference, rtol=1e-6, atol=1e-9)
    _, pullback = vjp(lambda p: after_one_update(p)[0], params)
    (cotangent,) = pullback(torch.ones((), dtype=torch.float64))
    for k in params:
        torch.testing.assert_close(cotangent[k], gradient[k], rtol=1e-12, atol=1e-14)


def test_vmap_over_stacked_module_state_records_no_graph():
    """``stack_module_state`` params require grad; the vmapped update records no graph (inside
    vmap a batched tensor reports requires_grad=False, so the flags cannot be carried over)."""
    models = [_model(seed) for seed in range(3)]
    params, _ = stack_module_state(models)
    assert all(p.requires_grad for p in params.values())
    skeleton = _model().to("meta")
    x, y = _data()

    def member_loss(p):
        return F.cross_entropy(functional_call(skeleton, p, (x,)), y)

    opt = aa.anderson(aa.sgd(0.5), history_depth=4, mode="classic")
    state = vmap(opt.init)(params)
    step = vmap(lambda s, p, g: opt.update(s, p, g, loss_fn=member_loss))
    for _ in range(5):
        params, state = step(state, params, vmap(grad(member_loss))(params))
    assert all(p.grad_fn is None for p in params.values())
    assert not any(t.requires_grad for t in _state_tensors(state))
    assert int(state.num_mixed.sum()) > 0


def test_mix_passes_gradcheck():
    """The pure solver is differentiable in float64 (outside update, nothing disables grad)."""
    gen = torch.Generator().manual_seed(4)
    history = torch.cumsum(torch.randn(5, 4, generator=gen, dtype=torch.float64), 0)
    history.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: aa.mix(h, relaxation=0.7, reg=1e-3), (history,))


# -- grads of another dtype --------------------------------------------------------------------
def _quadratic_grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """float32 gradients of a fixed quadratic plus seeded noise, at float64 params."""
    gen = torch.Generator().manual_seed(100 + step)
    return [
        (p + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64)).float() for p in params
    ]


@pytest.mark.parametrize(
    "inner, torch_optimizer",
    [
        (lambda: aa.sgd(0.1, momentum=0.9, weight_decay=0.01),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)),
        # torch.optim.Adam accepts float32 grads for float64 params only with weight decay,
        # which promotes the gradient before the moments see it.
        (lambda: aa.adam(0.05, weight_decay=0.01),
         lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.01, foreach=False)),
    ],
)  # fmt: skip
@pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"),
    reason="the reference needs Tensor.grad_dtype (torch 2.10+) to give torch.optim's float64 "
    "params float32 grads",
)
def test_float32_grads_for_float64_params_match_torch_optim(inner, torch_optimizer):
    """Plain steps (mixing gated off) of float64 params fed float32 grads follow torch.optim,
    which promotes such grads in its arithmetic."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(4, 3, generator=gen, dtype=torch.float64),
        torch.randn(3, generator=gen, dtype=torch.float64),
    ]
    twins = [p.clone() for p in params]
    for t in twins:
        t.grad_dtype = None  # let torch.optim's params hold float32 grads
    reference = torch_optimizer(twins)
    opt = aa.anderson(inner(), history_depth=3, wait_iterations=10**6)
    state = opt.init(params)
    for step in range(20):
        grads = _quadratic_grads(params, step)
        for t, g in zip(twins, _quadratic_grads(twins, step)):
            t.grad = g
        reference.step()
        params, state = opt.update(state, params, grads)
        for p, t in zip(params, twins):
            assert p.dtype == torch.float64
            torch.testing.assert_close(p, t, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inplace", [False, True])
def test_mixed_dtype_grads_equal_cast_grads(mode, inplace):
    """Accelerated steps with float32 grads are bit-identical to the same run with the grads
    cast to float64 by the caller (the cast happens before anything reads them)."""

    def run(cast: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(1)
        params = [
            torch.randn(5, generator=gen, dtype=torch.float64),
            torch.randn(2, 2, generator=gen, dtype=torch.float64),
        ]
        opt = aa.anderson(aa.adam(0.1), history_depth=4, mode=mode)
        state = opt.init(params)
        for step in range(8):
            grads = _quadratic_grads(params, step)
            if cast:
                grads = [g.double() for g in grads]
            params, state = opt.update(state, params, grads, inplace=inplace)
        assert int(state.num_mixed) > 0
        return params

    for ours, cast in zip(run(False), run(True)):
        assert torch.equal(ours, cast)

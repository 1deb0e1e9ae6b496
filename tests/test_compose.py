"""``aa.chain``, ``aa.clip_by_global_norm`` and ``aa.add_decayed_weights`` against torch.optim
and ``torch.nn.utils.clip_grad_norm_``, alone and as the inner map of ``anderson``."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import aadl_func as aa


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(20, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (20,), generator=g
    )


def _is_weight(params):
    return {k: v.ndim > 1 for k, v in params.items()}


@pytest.mark.parametrize("inplace", [False, True])
def test_clip_decay_sgd_equals_torch_optim(inplace):
    """clip_grad_norm_ then SGD whose weight decay is on the weight matrices only."""
    x, y = _data()
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    weights = [p for n, p in model.named_parameters() if p.ndim > 1]
    others = [p for n, p in model.named_parameters() if p.ndim <= 1]
    torch_opt = torch.optim.SGD(
        [{"params": weights, "weight_decay": 0.05}, {"params": others, "weight_decay": 0.0}],
        lr=0.3,
        momentum=0.9,
    )
    inner = aa.chain(
        aa.clip_by_global_norm(0.1),
        aa.add_decayed_weights(0.05, mask=_is_weight),
        aa.sgd(0.3, momentum=0.9),
    )
    state = inner.init(params)

    def loss(p):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    clipped = 0
    for _ in range(15):
        torch_opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        clipped += int(norm > 0.1)
        torch_opt.step()
        grads = grad(loss)(params)
        updates, state = inner.update(grads, state, params=params, inplace=inplace)
        params = {k: params[k] + updates[k] for k in params}
    assert clipped >= 5  # the clip was active
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-12, atol=1e-14)


def test_decay_mask_as_a_pytree_and_inputs_untouched_out_of_place():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    t = aa.add_decayed_weights(0.1, mask={"w": True, "b": False})
    out, _ = t.update(grads, t.init(params), params=params, inplace=False)
    assert torch.equal(out["w"], torch.full((2, 2), 0.1)) and torch.equal(out["b"], torch.zeros(2))
    assert torch.equal(grads["w"], torch.zeros(2, 2))  # not written


def test_anderson_around_a_chain_pure_inplace_vmap_and_weights_only_checkpoint():
    x, y = _data()
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss(p):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    def make():
        inner = aa.chain(aa.clip_by_global_norm(1.0), aa.add_decayed_weights(1e-3, _is_weight),
                         aa.adam(0.05, betas=(0.0, 0.999)))  # fmt: skip
        return aa.anderson(inner, history_depth=5, mode="classic")

    opt = make()
    pure, inplace = dict(params), {k: v.clone() for k, v in params.items()}
    s_pure, s_in = opt.init(pure), opt.init(inplace)
    for _ in range(12):
        pure, s_pure = opt.update(s_pure, pure, grad(loss)(pure))
        inplace, s_in = opt.update(s_in, inplace, grad(loss)(inplace), inplace=True)
    assert int(s_pure.num_mixed) > 5
    for k in params:
        assert torch.equal(pure[k], inplace[k])
    assert float(loss(pure)) < float(loss(params))

    buffer = io.BytesIO()
    torch.save(s_pure, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    a, _ = opt.update(s_pure, pure, grad(loss)(pure))
    b, _ = opt.update(loaded, pure, grad(loss)(pure))
    for k in params:
        assert torch.equal(a[k], b[k])

    stacked = {k: torch.stack([v, 1.1 * v]) for k, v in params.items()}
    states = vmap(opt.init)(stacked)
    members = [{k: v[i] for k, v in stacked.items()} for i in range(2)]
    singles = [opt.init(m) for m in members]
    for _ in range(6):
        stacked, states = vmap(lambda s, p: opt.update(s, p, grad(loss)(p)))(states, stacked)
        for i in range(2):
            members[i], singles[i] = opt.update(singles[i], members[i], grad(loss)(members[i]))
    for i in range(2):
        for k in params:
            torch.testing.assert_close(stacked[k][i], members[i][k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("make", "error", "text"),
    [
        (lambda: aa.chain(), ValueError, "at least one"),
        (lambda: aa.chain(aa.sgd(0.1), object()), TypeError, "transformation 1 must have"),
        (lambda: aa.clip_by_global_norm(0.0), ValueError, "`max_norm` must be finite and > 0"),
        (
            lambda: aa.add_decayed_weights(-1.0),
            ValueError,
            "`weight_decay` must be finite and >= 0",
        ),
    ],
)
def test_bad_arguments_are_named(make, error, text):
    with pytest.raises(error, match=text):
        make()


def test_a_bad_mask_is_named():
    t = aa.add_decayed_weights(0.1, mask={"w": 1})
    with pytest.raises(TypeError, match="`mask` must be"):
        t.update({"w": torch.zeros(2)}, t.init(None), params={"w": torch.ones(2)})

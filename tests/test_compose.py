"""``aa.chain``, ``aa.clip_by_global_norm`` and ``aa.add_decayed_weights`` against torch.optim
and ``torch.nn.utils.clip_grad_norm_``, alone and as the inner map of ``anderson``."""

from __future__ import annotations

import io
import re

import optree
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


def test_params_unlike_the_updates_are_named_against_the_updates():
    t = aa.add_decayed_weights(0.1)
    updates = {"w": torch.zeros(2), "b": torch.zeros(1)}
    with pytest.raises(
        ValueError, match="`params` has a different pytree structure from `updates`"
    ):
        t.update(updates, t.init(None), params={"w": torch.ones(2)})
    shape = "`params['w']` has shape (3,), expected (2,) like `updates['w']`"
    with pytest.raises(ValueError, match=re.escape(shape)):
        t.update(updates, t.init(None), params={"w": torch.ones(3), "b": torch.ones(1)})


# -- anderson inside someone else's chain ---------------------------------------------------
RULE = (
    "anderson must be the outermost transformation: call update(state, params, grads); to "
    "clip or decay, put aa.chain(...) as anderson's inner optimizer"
)


def _torchopt_style_chain(*transforms):
    """torchopt's ``chain``, as torchopt 0.7 writes it: ``update(updates, state, *,
    params=None, inplace=True)`` calls each ``fn(updates, s, params=params, inplace=...)``."""

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, *, params=None, inplace=True):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params=params, inplace=inplace)
            new_state.append(s)
        return updates, tuple(new_state)

    return init, update


def _optax_style_chain(*transforms):
    """optax's ``chain``: ``fn(updates, state, params)``, all three by position."""

    def update(updates, state, params=None):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return lambda params: tuple(t.init(params) for t in transforms), update


def _problem():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3).double()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    return params, grads


def _snapshot(tree):
    return [t.clone() for t in torch.utils._pytree.tree_leaves(tree)]


def _unchanged(tree, snapshot):
    return all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(tree), snapshot))


@pytest.mark.parametrize("style", ["torchopt_written_here", "optax", "torchopt"])
def test_anderson_inside_a_chain_names_the_rule_and_changes_nothing(style):
    params, grads = _problem()
    accelerated = aa.anderson(aa.sgd(0.1), history_depth=3)
    if style == "torchopt":
        torchopt = pytest.importorskip("torchopt")
        chained = torchopt.chain(torchopt.clip_grad_norm(1.0), accelerated)
        init, update = chained.init, chained.update
    elif style == "optax":
        init, update = _optax_style_chain(aa.clip_by_global_norm(1.0), accelerated)
    else:
        init, update = _torchopt_style_chain(aa.clip_by_global_norm(1.0), accelerated)
    state = init(params)
    # The clip before anderson may scale the grads in place (inplace=True): that is the
    # chain's doing; anderson leaves the params and every state as they were.
    before = _snapshot((params, state))
    with pytest.raises(TypeError) as raised:
        if style == "optax":
            update(grads, state, params)
        else:
            update(grads, state, params=params, inplace=True)
    assert RULE in str(raised.value)
    assert str(raised.value).startswith("anderson.update: ")
    assert _unchanged((params, state), before)


def test_gradient_transformation_order_without_params_names_the_rule():
    """``update(grads, state)``: a gradient transformation's call, by position."""
    params, grads = _problem()
    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    state = opt.init(params)
    with pytest.raises(TypeError, match="outermost transformation"):
        opt.update(grads, state)


def test_grads_by_keyword_still_works_and_other_calls_are_named():
    params, grads = _problem()
    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    by_position, _ = opt.update(opt.init(params), params, grads)
    by_keyword, _ = opt.update(opt.init(params), params, grads=grads)
    assert all(torch.equal(by_position[k], by_keyword[k]) for k in params)
    # Plain SGD from params: p - 0.1 g, a reference independent of the window (first call).
    assert all(torch.allclose(by_keyword[k], params[k] - 0.1 * grads[k]) for k in params)
    state = opt.init(params)
    with pytest.raises(TypeError, match="`grads` is missing"):
        opt.update(state, params)
    with pytest.raises(TypeError, match="unexpected keyword argument `lr`"):
        opt.update(state, params, grads, lr=0.1)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    "make", [lambda **kw: aa.adam(0.01, **kw), lambda **kw: aa.sgd(0.1, momentum=0.9, **kw)]
)
def test_chained_decay_is_the_optimizers_weight_decay_bit_for_bit(make, inplace):
    """One decay rule: `add_decayed_weights` chained in front of an optimizer gives the bits of
    that optimizer's own `weight_decay` (float32, where the order of the operations shows)."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(5, generator=g)}
    chained = aa.chain(aa.add_decayed_weights(0.03), make())
    own = make(weight_decay=0.03)
    s_chained, s_own = chained.init(params), own.init(params)
    for _ in range(6):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        copy = {k: v.clone() for k, v in grads.items()}
        u_chained, s_chained = chained.update(grads, s_chained, params=params, inplace=inplace)
        u_own, s_own = own.update(copy, s_own, params=params, inplace=inplace)
        for k in params:
            assert torch.equal(u_chained[k], u_own[k]), k
        params = {k: params[k] + u_own[k] for k in params}


def test_a_zero_decay_leaves_the_updates_bit_for_bit():
    """`weight_decay=0` is no operation: -0.0 stays -0.0 and an infinite param adds no NaN."""
    params = {"w": torch.tensor([1.0, float("inf")])}
    updates = {"w": torch.tensor([-0.0, 2.0])}
    t = aa.add_decayed_weights(0.0)
    out, _ = t.update(updates, t.init(params), params=params, inplace=False)
    assert torch.equal(out["w"], updates["w"]) and torch.signbit(out["w"][0])


def test_chain_hands_params_and_inplace_to_each_transformation_by_keyword():
    """torchopt's `update` takes `params` and `inplace` as keyword-only arguments."""
    seen = []

    class KeywordOnly:
        def init(self, params):
            return ()

        def update(self, updates, state, *, params=None, inplace=True):
            seen.append((params, inplace))
            return {k: v * 2 for k, v in updates.items()}, state

    params = {"w": torch.ones(2)}
    inner = aa.chain(KeywordOnly(), KeywordOnly())
    out, state = inner.update(
        {"w": torch.ones(2)}, inner.init(params), params=params, inplace=False
    )
    assert torch.equal(out["w"], torch.full((2,), 4.0))
    assert seen == [(params, False), (params, False)] and state == aa.ChainState(((), ()))


# -- an in-place chain that fails changes nothing; bad masks and updates are named -----------
class _FailsSecond:
    """A user's torchopt-style transformation that fails on its second call."""

    def init(self, params):
        return ()

    def update(self, updates, state, *, params=None, inplace=True):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 1:
            raise RuntimeError("user transform failed")
        return updates, state


def _holdings(*trees):
    """`(tensor, its values, its version)` for every tensor the caller holds."""
    return [(t, t.clone(), t._version) for t in optree.tree_leaves(trees)]


def _kept(holdings):
    return all(torch.equal(t, value) and t._version == v for t, value, v in holdings)


@pytest.mark.parametrize(
    ("stages", "with_params", "error", "text"),
    [
        (  # the decay needs params, which the failing call does not pass
            lambda: [aa.sgd(0.1, momentum=0.9), aa.add_decayed_weights(1e-4)],
            False,
            ValueError,
            "add_decayed_weights: `params` is required",
        ),
        (  # a schedule that returns a bad value, in the last stage
            lambda: [
                aa.clip_by_global_norm(0.5),
                aa.adam(0.1),
                aa.sgd(lambda count: 0.1 if count < 1 else "fast"),
            ],
            True,
            TypeError,
            "the `lr` schedule must return a real number",
        ),
        (
            lambda: [aa.clip_by_global_norm(0.5), aa.sgd(0.1, momentum=0.9), _FailsSecond()],
            True,
            RuntimeError,
            "user transform failed",
        ),
    ],
)
def test_a_failing_chain_in_place_changes_nothing_the_caller_holds(
    stages, with_params, error, text
):
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    chained = aa.chain(*stages())
    state = chained.init(params)
    # A valid step first, so that the buffers hold values that a write would change.
    first = {k: torch.ones_like(v) for k, v in params.items()}
    _, state = chained.update(first, state, params=params, inplace=True)
    grads = {"w": torch.full((3,), 10.0), "b": torch.full((2,), -4.0)}
    held = _holdings(state, params, grads)
    with pytest.raises(error, match=re.escape(text)):
        chained.update(grads, state, params=params if with_params else None, inplace=True)
    assert _kept(held)


def test_an_in_place_chain_writes_the_pure_results_into_the_callers_buffers():
    """Bit for bit the pure call's results; the grads hold the updates (torchopt's
    semantics, also after a stage that returns new tensors), the state's buffers are the
    caller's, written; the counters are new, as the stages make them."""

    class Fresh:  # returns new tensors even in place
        def init(self, params):
            return ()

        def update(self, updates, state, *, params=None, inplace=True):
            return {k: 0.5 * v for k, v in updates.items()}, state

    g = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    chained = aa.chain(
        aa.clip_by_global_norm(0.5),
        aa.add_decayed_weights(0.01, mask=_is_weight),
        aa.sgd(0.1, momentum=0.9),
        Fresh(),
    )
    pure_state, state = chained.init(params), chained.init(params)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        copy = {k: v.clone() for k, v in grads.items()}
        expected, pure_state = chained.update(copy, pure_state, params=params, inplace=False)
        buffers, count = state.states[2].momentum_buffer, state.states[2].count
        updates, new_state = chained.update(grads, state, params=params, inplace=True)
        for k in params:
            assert torch.equal(updates[k], expected[k]) and updates[k] is grads[k]
            assert new_state.states[2].momentum_buffer[k] is buffers[k]
            assert torch.equal(buffers[k], pure_state.states[2].momentum_buffer[k])
        assert new_state.states[2].count is not count and int(new_state.states[2].count) == (
            int(count) + 1
        )
        state = new_state


def test_an_in_place_chain_commits_a_state_that_keeps_the_grads():
    """A stage whose new state is the grads it was given (out of place): the state gets
    their values before the grads are overwritten with the updates."""

    class KeepsGrads:
        def init(self, params):
            return {k: torch.zeros_like(v) for k, v in params.items()}

        def update(self, updates, state, *, params=None, inplace=True):
            if inplace:
                return updates, {k: state[k].copy_(u) for k, u in updates.items()}
            return updates, dict(updates)

    params = {"w": torch.ones(3)}
    chained = aa.chain(KeepsGrads(), aa.sgd(0.1, momentum=0.9))
    state = chained.init(params)
    grads = {"w": torch.tensor([1.0, 2.0, 3.0])}
    updates, state = chained.update(grads, state, params=params, inplace=True)
    assert torch.equal(state.states[0]["w"], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(grads["w"], updates["w"]) and torch.equal(
        updates["w"], -0.1 * state.states[0]["w"]
    )


def test_an_in_place_chain_leaves_an_expanded_gradient_alone():
    """`torch.func.grad` of a mean returns an `expand`-ed tensor, which torch cannot write:
    its update comes back as a new tensor."""
    params = {"w": torch.ones(3, 2)}
    chained = aa.chain(aa.clip_by_global_norm(0.1), aa.sgd(0.1, momentum=0.9))
    grads = {"w": torch.tensor(2.0).expand(3, 2)}
    updates, _ = chained.update(grads, chained.init(params), params=params, inplace=True)
    expected, _ = chained.update(
        {"w": torch.full((3, 2), 2.0)}, chained.init(params), params=params, inplace=False
    )
    assert torch.equal(updates["w"], expected["w"]) and torch.equal(
        grads["w"], torch.full((3, 2), 2.0)
    )


def test_an_in_place_chain_under_vmap_keeps_a_broadcast_counter():
    """A counter that `vmap(init)` returns broadcast (stride 0, as torchopt's) is not
    written into: the in-place chain returns a new one, as before."""

    class Counted:
        def init(self, params):
            return (torch.zeros((), dtype=torch.int64),)

        def update(self, updates, state, *, params=None, inplace=True):
            return updates, (state[0] + 1,)

    chained = aa.chain(aa.sgd(0.1, momentum=0.9), Counted())
    params = {"w": torch.ones(2, 3)}
    state = vmap(chained.init)(params)
    assert state.states[1][0].stride() == (0,)
    for _ in range(2):
        grads = {"w": torch.ones(2, 3)}
        _, state = vmap(lambda g, s: chained.update(g, s, inplace=True))(grads, state)
    assert state.states[1][0].tolist() == [2, 2]


@pytest.mark.parametrize(
    ("mask", "error", "text"),
    [
        (  # by position, [True, False] would decay `b` (optree sorts a dict's keys)
            [True, False],
            ValueError,
            "`mask` is a list of 2 where `params` is a dict with keys ['b', 'w']",
        ),
        (
            {"a": True, "z": False},
            ValueError,
            "`mask` is a dict with keys ['a', 'z'] where `params` is a dict with keys ['b', 'w']",
        ),
        (
            lambda p: [True, False],
            ValueError,
            "`mask(params)` is a list of 2 where `params` is a dict",
        ),
        ({"w": True, "b": {"x": False}}, ValueError, "`mask['b']` is a dict with keys ['x']"),
        ({"w": True}, ValueError, "`mask` is a dict with keys ['w'] where"),
        ({"w": True, "b": 1}, TypeError, "pytree of bools like `params`; `mask['b']` is int"),
    ],
)
def test_a_mask_unlike_the_params_is_refused_before_any_write(mask, error, text):
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    t = aa.add_decayed_weights(0.1, mask=mask)
    held = _holdings(params, grads)
    with pytest.raises(error, match=re.escape(text)) as raised:
        t.update(grads, t.init(params), params=params, inplace=True)
    assert str(raised.value).startswith("add_decayed_weights: `mask` must be")
    assert _kept(held)


def test_a_mask_is_matched_by_key():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    for mask in (
        {"w": True, "b": False},
        {"b": False, "w": True},
        lambda p: {"w": True, "b": False},
    ):
        t = aa.add_decayed_weights(0.5, mask=mask)
        out, _ = t.update({k: torch.zeros(2) for k in params}, (), params=params, inplace=False)
        assert torch.equal(out["w"], torch.full((2,), 0.5)) and torch.equal(
            out["b"], torch.zeros(2)
        )


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_clip_by_global_norm_names_updates_that_are_not_floating_point(dtype):
    t = aa.clip_by_global_norm(1.0)
    grads = {"w": torch.full((3,), 5.0), "n": torch.ones(3, dtype=dtype)}
    held = _holdings(grads)
    text = (
        "clip_by_global_norm: `updates['n']` must be a floating-point or complex tensor, "
        f"got {dtype}"
    )
    with pytest.raises(TypeError, match=re.escape(text)):
        t.update(grads, t.init(None), inplace=True)
    assert _kept(held)

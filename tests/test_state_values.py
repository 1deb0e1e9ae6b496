"""A state from outside (``torch.load``, a state built by hand, the wrapper's
``load_state_dict``) has its values checked once, before anything is written.

The per-case errors are rows of docs/errors.md (``tests/test_errors.py``); here: the checks
accept every state ``update`` itself makes (a round trip through ``torch.save`` before every
call, in both modes and with the options that move the counters), the checks run again on
a state rebuilt with ``_replace`` and not on the states ``update`` returns, and the wrapper's
``load_state_dict`` refuses tampered windows without changing anything.
"""

from __future__ import annotations

import io

import optree
import pytest
import torch

import aadl_func as aa
from aadl_func import AcceleratedOptimizer
from aadl_func._src import checks


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _problem():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    a = a @ a.T / 12 + 0.1 * torch.eye(12, dtype=torch.float64)
    params = {"w": torch.randn(3, 4, generator=gen, dtype=torch.float64), "b": torch.zeros(2)}

    def loss(p):
        w = p["w"].reshape(-1)
        return 0.5 * w @ (a @ w) + (p["b"].double() ** 2).sum()

    return params, loss


@pytest.mark.parametrize(
    "options",
    [
        dict(mode="aadl", inner=aa.adam(0.05)),
        dict(mode="aadl", average=True, average_tol=0.05, restart_on_reject=True),
        dict(mode="classic", inner=aa.sgd(0.1, momentum=0.5), skip_nonfinite=True),
        dict(mode="aadl", store_each_nth=2, frequency=2, history_dtype=torch.bfloat16),
    ],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_states_of_a_run_pass_the_value_checks_after_a_round_trip(options, inplace):
    """Every state of a 14-step run (safeguard on, one NaN gradient for skip_nonfinite),
    saved and loaded before each call, passes the checks and continues bit for bit."""
    options = dict(options)
    inner = options.pop("inner", aa.sgd(0.1))
    opt = aa.anderson(inner, history_depth=4, **options)
    params, loss = _problem()
    state = opt.init(params)
    ref_params, ref_state = _roundtrip((params, state))
    for k in range(14):
        grads = torch.func.grad(loss)(params)
        if k == 5:
            grads["w"] = grads["w"] * float("nan") if options.get("skip_nonfinite") else grads["w"]
        params, state = _roundtrip((params, state))
        assert not checks.verified(state)
        params, state = opt.update(
            state, params, optree.tree_map(torch.clone, grads), inplace=inplace, loss_fn=loss
        )
        assert checks.verified(state)
        ref_params, ref_state = opt.update(
            ref_state, ref_params, grads, inplace=inplace, loss_fn=loss
        )
    for a, b in zip(
        optree.tree_leaves((params, state)), optree.tree_leaves((ref_params, ref_state))
    ):
        assert torch.equal(a, b)
    assert int(state.num_mixed) + int(state.num_averaged) > 0


def test_a_rebuilt_state_is_checked_again():
    opt = aa.anderson(aa.sgd(0.1), history_depth=4)
    params, loss = _problem()
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update(state, params, torch.func.grad(loss)(params))
    assert checks.verified(state)
    bad = state._replace(window_size=torch.tensor(9))
    assert not checks.verified(bad)
    with pytest.raises(ValueError, match="`state.window_size` is 9"):
        opt.update(bad, params, torch.func.grad(loss)(params))


def _wrapper(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = AcceleratedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), history_depth=4)
    return model, opt


def _train(model, opt, steps):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(20, 4, generator=gen), torch.randn(20, 2, generator=gen)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    "tamper, match",
    [
        (lambda w: w._replace(head=torch.tensor(99)), "`state.head` is 99"),
        (lambda w: w._replace(count=torch.tensor(-1)), "`state.count` is -1"),
        (lambda w: w._replace(window_size=torch.tensor(-5)), "`state.window_size` is -5"),
        (lambda w: w._replace(num_rejected=torch.tensor(2**40)), "`state.num_rejected`"),
    ],
)
def test_wrapper_load_state_dict_checks_the_values(tamper, match):
    model, opt = _wrapper()
    _train(model, opt, 5)
    saved = _roundtrip(opt.state_dict())
    saved["anderson"]["windows"] = [tamper(w) for w in saved["anderson"]["windows"]]
    fresh_model, fresh = _wrapper(seed=3)
    before = [p.detach().clone() for p in fresh_model.parameters()]
    with pytest.raises(ValueError, match=match) as info:
        fresh.load_state_dict(saved)
    assert str(info.value).startswith("AcceleratedOptimizer.load_state_dict:")
    assert fresh.anderson_states == (None,)
    assert len(fresh.state) == 0
    assert all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), before))


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_wrapper_load_state_dict_refuses_windows_without_dense_values(kind):
    model, opt = _wrapper()
    _train(model, opt, 5)
    saved = opt.state_dict()
    window = saved["anderson"]["windows"][0]
    gram = window.gram.to("meta") if kind == "meta" else window.gram.to_sparse()
    saved["anderson"]["windows"] = [window._replace(gram=gram)]
    fresh_model, fresh = _wrapper(seed=3)
    before = [p.detach().clone() for p in fresh_model.parameters()]
    with pytest.raises(ValueError, match="AcceleratedOptimizer.load_state_dict: the window"):
        fresh.load_state_dict(saved)
    assert fresh.anderson_states == (None,)
    assert all(torch.equal(p, q) for p, q in zip(fresh_model.parameters(), before))


# -- aliased params and grads in place -----------------------------------------------------


def _aliasing_cases():
    w = torch.arange(1.0, 7.0)
    return {
        "same tensor twice": ({"a": w, "b": w}, None),
        "overlapping views": ({"a": w[:4], "b": w[2:]}, None),
        "grads are the params": ({"a": w[:3], "b": w[3:]}, "params"),
        "grads view the params": ({"a": w[:3], "b": w[3:]}, "view"),
    }


@pytest.mark.parametrize("case", list(_aliasing_cases()))
def test_aliased_params_or_grads_are_refused_in_place_before_any_write(case):
    params, grads_kind = _aliasing_cases()[case]
    if grads_kind == "params":
        grads = params
    elif grads_kind == "view":
        grads = {"a": params["b"], "b": torch.ones(3)}
    else:
        grads = {k: torch.ones_like(v) for k, v in params.items()}
    opt = aa.anderson(aa.sgd(0.1, momentum=0.9), history_depth=4)
    state = opt.init(params)
    watched = [t for t in optree.tree_leaves((state, params, grads))]
    before = [(t.clone(), t._version) for t in watched]
    with pytest.raises(ValueError, match="shares memory with `params"):
        opt.update(state, params, grads, inplace=True)
    for (copy, version), t in zip(before, watched):
        assert t._version == version and torch.equal(t, copy)


def test_aliased_params_are_stepped_once_each_out_of_place():
    """Out of place nothing is written: the same tensor twice gives two leaves, each the
    plain step of that tensor (x - lr * g), as for two separate copies."""
    w = torch.arange(1.0, 7.0)
    opt = aa.anderson(aa.sgd(0.1), history_depth=4)
    params = {"a": w, "b": w}
    out, _ = opt.update(opt.init(params), params, {"a": torch.ones(6), "b": torch.ones(6)})
    for key in ("a", "b"):
        assert torch.equal(out[key], torch.arange(1.0, 7.0) - 0.1)
    assert torch.equal(w, torch.arange(1.0, 7.0))


def test_views_that_share_no_element_are_accepted_in_place():
    """Interleaved views (``w[0::2]``, ``w[1::2]``) overlap in extent only: each element is
    stepped once, as torch.optim would."""
    w = torch.arange(1.0, 7.0)
    params = {"a": w[0::2], "b": w[1::2]}
    opt = aa.anderson(aa.sgd(0.1), history_depth=4)
    opt.update(opt.init(params), params, {"a": torch.ones(3), "b": torch.ones(3)}, inplace=True)
    assert torch.equal(w, torch.arange(1.0, 7.0) - 0.1)


def test_the_verified_list_keeps_the_newest_and_forgets_freed_states():
    """The list of verified states (`verified_states._Verified`): beyond `keep` entries
    (counters kept alive after their states) the oldest leaves; an entry leaves when its
    state's `count` is freed; a state with the same `count` and new fields (an in-place call)
    takes its entry over."""
    from aadl_func._src.verified_states import _Verified

    opt = aa.anderson(aa.sgd(0.1), history_depth=3)
    a, b, c = (opt.init({"w": torch.zeros(2)}) for _ in range(3))
    listed = _Verified(keep=2)
    listed.record(a, None, new_layout=False)
    listed.record(b, None, new_layout=False)
    assert len(listed) == 2 and listed.find(a) is not None and listed.find(b) is not None
    listed.record(c, None, new_layout=False)
    assert len(listed) == 2 and listed.find(a) is None  # the oldest left
    assert listed.find(b) is not None and listed.find(c) is not None
    del c  # its count freed: the weak reference's callback drops the entry
    assert len(listed) == 1 and listed.find(b) is not None
    moved = b._replace(anchor={"w": torch.ones(2)})
    listed.record(moved, ("layout",), new_layout=True)
    assert len(listed) == 1 and listed.find(b) is None
    assert listed.find(moved).layout == ("layout",)
    again = moved._replace(anchor={"w": torch.zeros(2)})
    listed.record(again, None, new_layout=False)  # a checked state: the layout stays
    assert len(listed) == 1 and listed.find(again).layout == ("layout",)

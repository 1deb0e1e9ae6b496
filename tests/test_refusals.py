"""Inputs the step cannot take are refused by name before anything is written (issue 38).

* leaves that cannot be written in place (expanded or self-overlapping memory, inference
  tensors), as params with ``inplace=True`` or anywhere in a state;
* layouts other than dense (sparse params, grads or state tensors; meta or sparse windows in
  the wrapper's ``load_state_dict``);
* state fields that contradict one another (a finite ``pending_loss`` in a state that never
  mixed; more mixes and means than calls);
* a state rebuilt around a freed field is never taken for the verified state it copies.

Each refusal leaves every tensor the caller holds as it was: same bytes, same version counter.
Out of place, leaves that only cannot be written are stepped like their contiguous copies.
"""

from __future__ import annotations

import gc
import io
import itertools
import weakref

import numpy as np
import optree
import pytest
import torch

import aadl_func as aa
from aadl_func._src import checks

MODES = ["aadl", "classic"]


def _opt(mode, **options):
    return aa.anderson(aa.sgd(0.1, momentum=0.5), history_depth=4, mode=mode, **options)


def _bytes(t):
    return t.detach().reshape(-1).clone().view(torch.uint8)


def _snapshot(*trees):
    """Every tensor of ``trees`` with a copy of its bytes and its version counter."""
    out = []
    for t in optree.tree_leaves(trees):
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta:
            version = None if t.is_inference() else t._version
            out.append((t, _bytes(t), version))
    return out


def _unchanged(snapshot):
    for t, before, version in snapshot:
        assert torch.equal(_bytes(t), before)
        if version is not None:
            assert t._version == version


def _grads(params):
    return {k: torch.full(v.shape, 2.0, dtype=v.dtype) for k, v in params.items()}


def _stepped(opt, params, steps=3, inplace=False):
    state = opt.init(params)
    for _ in range(steps):
        params, state = opt.update(state, params, _grads(params), inplace=inplace)
    return params, state


# -- params that cannot be written in place ----------------------------------------------------


def _unwritable_params():
    return {
        "expanded": torch.zeros(1).expand(4),
        "overlapping as_strided": torch.arange(6.0).as_strided((2, 3), (1, 1)),
        "zero-stride row": torch.arange(3.0).as_strided((4, 3), (0, 1)),
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(_unwritable_params()))
def test_self_overlapping_params_are_refused_in_place_before_any_write(mode, case):
    """The issue's case: ``a`` was stepped, then torch refused ``b``; or an overlapping
    ``as_strided`` leaf was accepted and its shared elements stepped twice."""
    params = {"a": torch.zeros(3), "b": _unwritable_params()[case]}
    opt = _opt(mode)
    state = opt.init(params)
    grads = _grads(params)
    snapshot = _snapshot(params, state, grads)
    with pytest.raises(ValueError, match=r"`params\['b'\]` has elements that share memory"):
        opt.update(state, params, grads, inplace=True)
    _unchanged(snapshot)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(_unwritable_params()))
def test_self_overlapping_params_work_out_of_place(mode, case):
    """Out of place nothing is written: the leaf steps as its contiguous copy does."""
    leaf = _unwritable_params()[case]
    opt = _opt(mode)
    out, state = _stepped(opt, {"a": torch.zeros(3), "b": leaf})
    ref, ref_state = _stepped(opt, {"a": torch.zeros(3), "b": leaf.contiguous()})
    for x, y in zip(optree.tree_leaves((out, state)), optree.tree_leaves((ref, ref_state))):
        assert torch.equal(x, y)


def test_views_without_shared_elements_are_written_in_place():
    """Strided but not overlapping (a transposed, a sliced leaf): accepted and equal to pure."""
    base = torch.arange(24.0).reshape(4, 6)
    params = {"t": base.clone().T, "s": base.clone()[:, ::2]}
    opt = _opt("aadl")
    pure, _ = _stepped(opt, {k: v.clone() for k, v in params.items()}, steps=5)
    out, _ = _stepped(opt, params, steps=5, inplace=True)
    for key in params:
        assert out[key] is params[key]
        assert torch.equal(out[key], pure[key])


@pytest.mark.parametrize("mode", MODES)
def test_inference_tensor_params_are_refused_in_place(mode):
    """torch writes an inference tensor outside inference mode only to raise after; the
    recovery then stepped it a second time (-0.2)."""
    with torch.inference_mode():
        frozen = torch.zeros(4)
    params = {"a": torch.zeros(3), "b": frozen}
    opt = _opt(mode)
    state = opt.init(params)
    grads = _grads(params)
    snapshot = _snapshot(params, state, grads)
    with pytest.raises(ValueError, match=r"`params\['b'\]` is an inference tensor"):
        opt.update(state, params, grads, inplace=True)
    _unchanged(snapshot)
    out, _ = opt.update(state, params, grads)  # out of place: it is only read
    assert torch.equal(out["b"], torch.full((4,), -0.2))


def test_inference_tensors_are_written_in_place_in_inference_mode():
    opt = _opt("aadl")
    with torch.inference_mode():
        params = {"w": torch.zeros(4)}
        out, state = _stepped(opt, params, steps=4, inplace=True)
        ref, _ = _stepped(opt, {"w": torch.zeros(4)}, steps=4)
    assert out["w"] is params["w"]
    assert torch.equal(out["w"], ref["w"])


def test_a_state_made_in_inference_mode_is_checked_outside_it():
    """Its tensors are inference tensors: verified there, refused by name out of it."""
    opt = _opt("aadl")
    params = {"w": torch.zeros(4)}
    with torch.inference_mode():
        _, state = _stepped(opt, {"w": torch.zeros(4)}, steps=2)
        assert checks.verified(state)
    assert not checks.verified(state)
    snapshot = _snapshot(params, state)
    with pytest.raises(ValueError, match=r"`state\.count` is an inference tensor"):
        opt.update(state, params, _grads(params), inplace=True)
    _unchanged(snapshot)


def test_self_overlapping_matches_a_count_of_element_addresses():
    """Against an independent reference: the addresses of all elements enumerated in NumPy."""
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(0, 4, size=ndim))
        strides = tuple(int(s) for s in rng.integers(0, 7, size=ndim))
        extent = sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
        t = torch.zeros(extent + 1).as_strided(shape, strides)
        addresses = [
            sum(i * s for i, s in zip(index, strides))
            for index in itertools.product(*(range(n) for n in shape))
        ]
        expected = len(set(addresses)) < len(addresses)
        assert checks.self_overlapping(t) == expected, (shape, strides)
        seen[expected] += 1
    assert min(seen.values()) > 50  # both outcomes are exercised


# -- states whose tensors cannot be written -----------------------------------------------------


def _roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _expanded(t):
    return t.reshape(-1)[:1].expand(t.shape) if t.dim() else t


_STATE_TAMPERS = {
    "residuals[1]": (
        lambda s: s._replace(
            residuals=(s.residuals[0], {"w": _expanded(s.residuals[1]["w"])}, *s.residuals[2:])
        ),
        r"`state\.residuals\[1\]\['w'\]` has elements that share memory",
    ),
    "gram": (
        lambda s: s._replace(gram=s.gram[:1].expand_as(s.gram)),
        r"`state\.gram` has elements that share memory",
    ),
    "anchor": (
        lambda s: s._replace(anchor={"w": _expanded(s.anchor["w"])}),
        r"`state\.anchor\['w'\]` has elements that share memory",
    ),
    "sparse dr_rhs": (
        lambda s: s._replace(dr_rhs=s.dr_rhs.to_sparse()),
        r"`state\.dr_rhs` has layout torch\.sparse_coo",
    ),
    "sparse count": (
        lambda s: s._replace(count=s.count.to_sparse()),
        r"`state\.count` has layout torch\.sparse_coo",
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", list(_STATE_TAMPERS))
def test_a_loaded_state_that_cannot_be_written_is_refused_before_any_write(mode, inplace, case):
    """The issue's checkpoint: an expanded ring slot loads with weights_only=True, and the
    next in-place update moved the params before raising on the slot. Refused the same way
    out of place, since a state checked once is trusted by every later call."""
    tamper, match = _STATE_TAMPERS[case]
    opt = _opt(mode)
    params, state = _stepped(opt, {"w": torch.linspace(-1.0, 1.0, 5)}, steps=3)
    params, state = _roundtrip((params, tamper(state)))
    grads = _grads(params)
    snapshot = _snapshot(params, state, grads)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.update(state, params, grads, inplace=inplace)
    _unchanged(snapshot)


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
def test_sparse_grads_are_refused_by_name(inplace):
    params = {"a": torch.zeros(3), "b": torch.zeros(4)}
    opt = _opt("aadl")
    state = opt.init(params)
    grads = {"a": torch.ones(3), "b": torch.ones(4).to_sparse()}
    snapshot = _snapshot(params, state, grads)
    with pytest.raises(TypeError, match=r"`grads\['b'\]` has layout torch\.sparse_coo"):
        opt.update(state, params, grads, inplace=inplace)
    _unchanged(snapshot)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_params_are_refused_by_name_at_init_and_update(layout):
    sparse = getattr(torch.eye(3), f"to_{layout}")()
    opt = _opt("aadl")
    with pytest.raises(TypeError, match=r"anderson\.init: `params\['s'\]` has layout"):
        opt.init({"w": torch.zeros(2), "s": sparse})
    state = opt.init({"w": torch.zeros(2), "s": torch.zeros(3, 3)})
    params = {"w": torch.zeros(2), "s": sparse}
    snapshot = _snapshot(state)
    with pytest.raises(TypeError, match=r"anderson\.update: `params\['s'\]` has layout"):
        opt.update(state, params, {"w": torch.ones(2), "s": torch.ones(3, 3)})
    _unchanged(snapshot)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("anchor", 3e38, r"`state\.anchor\['w'\]` holds 3e\+38"),
        ("residuals", float("nan"), r"`state\.residuals\[2\]\['w'\]` holds a non-finite"),
        ("gram", float("inf"), r"`state\.gram` holds a non-finite value"),
    ],
)
def test_window_values_that_would_overflow_the_step_are_refused(mode, inplace, field, value, match):
    """The issue: 3e38 in a float32 anchor gave non-finite params after 3 calls; the
    finiteness fallback covers the mix, not the plain step, so the state is refused."""
    opt = _opt(mode)
    params, state = _stepped(opt, {"w": torch.linspace(-1.0, 1.0, 5)}, steps=3)
    if field == "anchor":
        state = state._replace(anchor={"w": torch.full((5,), value)})
    elif field == "residuals":
        ring = list(state.residuals)
        ring[2] = {"w": torch.full((5,), value)}
        state = state._replace(residuals=tuple(ring))
    else:
        state = state._replace(gram=state.gram.clone().fill_(value))
    grads = _grads(params)
    snapshot = _snapshot(params, state, grads)
    with pytest.raises(ValueError, match=match):
        opt.update(state, params, grads, inplace=inplace)
    _unchanged(snapshot)


# -- fields checked against one another ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inplace", [False, True])
def test_a_fresh_state_with_a_finite_pending_loss_is_refused(mode, inplace):
    """The issue: the deferred safeguard rejected a mix that never happened (3.0 went to 0.0
    with count 0 and num_rejected 1)."""
    opt = _opt(mode)
    params = {"w": torch.full((3,), 3.0)}
    state = opt.init(params)._replace(pending_loss=torch.tensor(0.5, dtype=torch.float64))
    grads = _grads(params)
    snapshot = _snapshot(params, state, grads)
    with pytest.raises(ValueError, match=r"`state\.pending_loss` is 0\.5, a mix waiting"):
        opt.update(state, params, grads, inplace=inplace, loss=1.0)
    _unchanged(snapshot)


def test_a_pending_loss_needs_a_window_that_mixed():
    opt = _opt("aadl")
    params, state = _stepped(opt, {"w": torch.linspace(-1.0, 1.0, 5)}, steps=6)
    assert int(state.num_mixed) > 0
    bad = state._replace(
        pending_loss=torch.tensor(0.5, dtype=torch.float64), window_size=torch.tensor(1)
    )
    with pytest.raises(ValueError, match=r"but `state\.window_size` is 1"):
        opt.update(bad, params, _grads(params), loss=1.0)


def test_more_mixes_and_means_than_calls_are_refused():
    opt = _opt("aadl")
    params, state = _stepped(opt, {"w": torch.linspace(-1.0, 1.0, 5)}, steps=6)
    count = int(state.count)
    bad = state._replace(
        num_mixed=torch.tensor(count - 1), num_averaged=torch.tensor(2, dtype=torch.int64)
    )
    with pytest.raises(ValueError, match=r"`state\.num_mixed` \+ `state\.num_averaged` is"):
        opt.update(bad, params, _grads(params))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("restart", [False, True])
def test_every_state_of_a_deferred_run_passes_the_cross_checks(mode, restart):
    """A run with the deferred safeguard (kept and rejected mixes, pending losses), each state
    saved and loaded before its call: none is refused, and the run equals the unsaved one."""
    opt = aa.anderson(aa.sgd(0.3), history_depth=4, mode=mode, restart_on_reject=restart)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    a = a @ a.T + 0.05 * torch.eye(6, dtype=torch.float64)

    def loss(w):
        return 0.5 * w @ (a @ w) + 0.3 * torch.sin(3 * w).sum()

    params = torch.randn(6, generator=gen, dtype=torch.float64)
    state = opt.init(params)
    ref_params, ref_state = params.clone(), opt.init(params)
    pending = 0
    for _ in range(25):
        value, grad = loss(params), torch.func.grad(loss)(params)
        params, state = _roundtrip((params, state))
        params, state = opt.update(state, params, grad, loss=value)
        ref_params, ref_state = opt.update(ref_state, ref_params, grad, loss=value)
        pending += bool(torch.isfinite(state.pending_loss))
    assert pending > 0 and int(state.num_rejected) > 0
    assert torch.equal(params, ref_params)


# -- verification cannot be fooled by a reused id --------------------------------------------------


def test_a_state_rebuilt_around_a_freed_field_is_checked_again():
    """The issue's experiment: a verified state rebuilt with ``window_size=-5`` after the old
    tensor was dropped (so that the new one may take its id) passed as verified in 45 of 200
    tries. Each try here must be refused."""
    opt = _opt("aadl")
    params, state = _stepped(opt, {"w": torch.linspace(-1.0, 1.0, 5)}, steps=3)
    for _ in range(200):
        params, state = opt.update(state, params, _grads(params))
        assert checks.verified(state)
        fields = state._asdict()
        size = int(fields.pop("window_size"))
        state = None  # the old window_size is freed here
        rebuilt = aa.AndersonState(**fields, window_size=torch.tensor(-5))
        assert not checks.verified(rebuilt)
        with pytest.raises(ValueError, match=r"`state\.window_size` is -5"):
            opt.update(rebuilt, params, _grads(params))
        state = rebuilt._replace(window_size=torch.tensor(size))


def test_the_verified_list_keeps_no_dropped_state_alive():
    """The list holds a verified state's fields only while its ``count`` lives: a pure run's
    dropped states are freed (every tensor of theirs not shared with the newer state)."""
    opt = _opt("aadl")
    params, state = _stepped(opt, {"w": torch.zeros(1000)}, steps=2)
    old = state
    params, state = opt.update(state, params, _grads(params))
    assert checks.verified(old) and checks.verified(state)
    kept = {id(t) for t in optree.tree_leaves(state)}
    watched = [weakref.ref(t) for t in optree.tree_leaves(old) if id(t) not in kept]
    assert watched
    del old
    gc.collect()
    assert all(ref() is None for ref in watched)

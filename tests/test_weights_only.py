"""Every public record a user may save loads with ``torch.load(weights_only=True)``.

The package allow-lists its NamedTuples at import (``state.allow_weights_only``), so that a
checkpoint never needs the unsafe loader (weights_only off), which unpickles arbitrary code.
One test per record: each is made by the public function that returns it, saved, loaded
weights-only and compared field by field with the original.
"""

from __future__ import annotations

import io
import pathlib

import optree
import torch

import aadl_func as aa


def _weights_only_round_trip(record):
    buffer = io.BytesIO()
    torch.save(record, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is type(record)
    leaves, spec = optree.tree_flatten(record, none_is_leaf=True)
    loaded_leaves, loaded_spec = optree.tree_flatten(loaded, none_is_leaf=True)
    assert loaded_spec == spec
    for a, b in zip(leaves, loaded_leaves):
        assert (a is None and b is None) or torch.equal(a, b)
    return loaded


def _quadratic_grads(params):
    return {k: 2.0 * v for k, v in params.items()}


def _anderson_state(inner):
    opt = aa.anderson(inner, history_depth=3)
    params = {"w": torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(4):
        params, state = opt.update(state, params, _quadratic_grads(params))
    return state


def test_anderson_state_with_sgd_state():
    loaded = _weights_only_round_trip(_anderson_state(aa.sgd(0.1, momentum=0.5)))
    assert isinstance(loaded.inner_state, aa.SgdState)


def test_anderson_state_with_adam_state():
    loaded = _weights_only_round_trip(_anderson_state(aa.adam(0.05)))
    assert isinstance(loaded.inner_state, aa.AdamState)


def test_anderson_state_with_chain_state():
    inner = aa.chain(aa.clip_by_global_norm(1.0), aa.sgd(0.1))
    loaded = _weights_only_round_trip(_anderson_state(inner))
    assert isinstance(loaded.inner_state, aa.ChainState)


def test_adasam_state():
    opt = aa.adasam(0.1, history_depth=3)
    params = {"w": torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(4):
        params, state = opt.update(state, params, _quadratic_grads(params))
    _weights_only_round_trip(state)


def test_mixing_weights():
    history = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = aa.mixing_weights(history)
    assert isinstance(weights, aa.MixingWeights)
    _weights_only_round_trip(weights)


def test_rna_state():
    opt = aa.rna(history_depth=3)
    params = {"w": torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(5):
        params = {"w": params["w"] - 0.1 * _quadratic_grads(params)["w"]}
        state = opt.snapshot(state, params)
    assert int(state.num_snapshots) == 5
    _weights_only_round_trip(state)


def test_solver_info():
    x, info = aa.fixed_point(lambda x: 0.5 * x + 1.0, torch.zeros(3, dtype=torch.float64))
    assert isinstance(info, aa.SolverInfo)
    assert _weights_only_round_trip(info).reason == info.reason


def test_no_test_loads_with_weights_only_false():
    """The suite itself never asks for the unsafe loader (it would hide a missing entry)."""
    unsafe = "weights_only" + "=False"
    offenders = [
        path.name
        for path in pathlib.Path(__file__).parent.glob("*.py")
        if unsafe in path.read_text(encoding="utf-8")
    ]
    assert offenders == []

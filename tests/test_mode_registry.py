"""Modes as records (`aadl_func._src.modes.MODES`): a mode registered by one line runs the one
`update` sequence with its own functions on every call unless its record names a
straight-line sequence of the fast paths (`eager_steps`); the fast paths never run a mode as
another one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import aadl_func as aa
from aadl_func._src import aadl_step, classic_step
from aadl_func._src.modes import MODES


@pytest.mark.parametrize("base", ["aadl", "classic"])
@pytest.mark.parametrize("inplace", [True, False])
def test_a_mode_without_eager_steps_takes_its_own_step(monkeypatch, base, inplace):
    calls = [0]
    own = {"aadl": aadl_step.store_and_step, "classic": classic_step.store_and_step}[base]

    def counted(call):
        calls[0] += 1
        return own(call)

    record = dataclasses.replace(
        MODES[base], name="counted", store_and_step=counted, eager_steps=None
    )
    monkeypatch.setitem(MODES, "counted", record)
    new = aa.anderson(aa.adam(1e-2), history_depth=4, mode="counted")
    old = aa.anderson(aa.adam(1e-2), history_depth=4, mode=base)
    # float32 on init's layout, in place: the steady call's case when the mode has a sequence.
    start = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x, y = start.clone(), start.clone()
    s_new, s_old = new.init(x), old.init(y)
    for k in range(20):
        g = torch.sin(3.0 * x) + 0.1 * x  # the same gradient map for both
        x2, s_new = new.update(s_new, x, g, inplace=inplace)
        y2, s_old = old.update(s_old, y, torch.sin(3.0 * y) + 0.1 * y, inplace=inplace)
        x, y = x2, y2
        # The general path and the fast paths run the same operations: the same bits.
        assert torch.equal(x, y), k
    assert calls[0] == 20
    assert int(s_new.num_mixed) == int(s_old.num_mixed) > 0

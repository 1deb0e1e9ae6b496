"""Leaves people pass by mistake get an error that says what to pass instead."""

from __future__ import annotations

import pytest
import torch

import aadl_func as aa


@pytest.mark.parametrize(
    ("make", "hint"),
    [
        (lambda m: m.parameters(), r"is generator; pass dict\(model.named_parameters\(\)\)"),
        (lambda m: m, r"is Linear; pass its parameters as a dict"),
        (lambda m: {"w": m.weight, "layer": m}, r"params\['layer'\]` is Linear; pass"),
    ],
    ids=["generator", "module", "module-leaf"],
)
def test_init_says_what_to_pass(make, hint):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(
        TypeError, match=r"anderson.init: `params` must be a pytree of tensors; .*" + hint
    ):
        aa.anderson(aa.sgd(0.1)).init(make(model))


def test_a_list_of_parameters_is_fine():
    model = torch.nn.Linear(3, 2)
    state = aa.anderson(aa.sgd(0.1)).init([p.detach() for p in model.parameters()])
    assert int(state.count) == 0

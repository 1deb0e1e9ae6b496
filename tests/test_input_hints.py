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


def test_update_names_itself_whatever_torch_has_loaded():
    """The sharded-params detection flattens first once torch.distributed's DTensor is
    loaded (which torch 2.5 does at import): its errors name ``anderson.update`` too."""
    import torch.distributed.tensor  # noqa: F401  (loads DTensor, as some torch releases do)

    opt = aa.anderson(aa.sgd(0.1))
    params = {"w": torch.zeros(2)}
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"^anderson.update: `grads` must be a pytree of tensors"):
        opt.update(state, params, {"w": 1.0})
    with pytest.raises(TypeError, match=r"^anderson.init: `params` must be a pytree of tensors"):
        opt.init(torch.nn.Linear(2, 2))

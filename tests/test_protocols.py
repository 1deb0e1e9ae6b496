"""The typed faces of ``anderson``: ``aa.AndersonInit`` and ``aa.AndersonUpdate`` (issue 24).

No type checker is installed here (neither mypy nor pyright), so what a checker would read is
held by ``inspect``: the protocols' signatures against the functions ``anderson`` returns.
"""

from __future__ import annotations

import inspect
import typing

import torch

import aadl_func as aa


def _parameters(function) -> tuple[list[str], dict]:
    """Positional parameter names, and keyword-only ``name -> default``."""
    parameters = inspect.signature(function).parameters.values()
    positional = [p.name for p in parameters if p.kind == inspect.Parameter.POSITIONAL_ONLY]
    keywords = {p.name: p.default for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY}
    return positional, keywords


def test_anderson_fields_are_typed_by_the_protocols():
    hints = typing.get_type_hints(aa.Anderson)
    assert hints == {"init": aa.AndersonInit, "update": aa.AndersonUpdate}
    assert aa.AndersonInit.__module__ == aa.AndersonUpdate.__module__ == "aadl_func._src.protocols"


def test_update_and_init_take_what_the_protocols_describe():
    opt = aa.anderson(aa.sgd(0.1))
    positional, keywords = _parameters(opt.update)
    expected_positional, expected_keywords = _parameters(aa.AndersonUpdate.__call__)
    assert positional == expected_positional[1:] == ["state", "params", "grads"]
    # The same keywords with the same defaults (``loss``: the deferred safeguard's).
    assert keywords == expected_keywords and "loss" in keywords
    assert _parameters(opt.init)[0] == [] and list(inspect.signature(opt.init).parameters) == [
        "params"
    ]
    assert _parameters(aa.AndersonInit.__call__)[0] == ["self", "params"]


def test_update_returns_params_of_the_type_passed_in():
    """What the protocol's type variable says: dict in, dict out; list in, list out."""
    opt = aa.anderson(aa.sgd(0.1))
    for params in ({"w": torch.ones(3)}, [torch.ones(3)]):
        grads = type(params)(params) if isinstance(params, dict) else list(params)
        out, state = opt.update(opt.init(params), params, grads)
        assert type(out) is type(params)
        assert isinstance(state, aa.AndersonState)

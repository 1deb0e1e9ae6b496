"""The options of ``anderson`` are one list: its signature, ``AndersonOptions``, docs/options.md."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import aadl_func as aa
from aadl_func._src.options import AndersonOptions

OPTIONS_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "options.md"


def _signature_defaults() -> dict:
    parameters = inspect.signature(aa.anderson).parameters
    return {name: p.default for name, p in parameters.items() if name != "inner"}


def test_signature_and_options_record_agree_in_order_and_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(AndersonOptions) if f.name != "inner"}
    assert list(_signature_defaults()) == list(fields)
    assert _signature_defaults() == fields


def test_readme_signature_and_table_list_every_option_with_its_default():
    text = OPTIONS_PAGE.read_text()
    block = re.search(r"`aa\.anderson\(inner, \*, (.*?)\)`", text, re.S)
    assert block is not None, "docs/options.md: no `aa.anderson(inner, *, ...)` signature"
    written = dict(
        item.strip().split("=", 1) for item in block.group(1).replace("\n", " ").split(",")
    )
    expected = {name: repr(value) for name, value in _signature_defaults().items()}
    expected = {k: v.replace("'", '"') for k, v in expected.items()}
    assert written == expected
    for name, value in expected.items():
        row = re.search(rf"^\| `{name}` \| `?([^`|]*)`? \|", text, re.M)
        assert row is not None, f"docs/options.md: no table row for `{name}`"
        assert row.group(1) == value.strip('"') or row.group(1) == value, (name, row.group(1))


def test_the_wrapper_takes_the_same_options():
    parameters = inspect.signature(AndersonOptions).parameters
    assert list(parameters)[1:] == list(_signature_defaults())


def _option_fields() -> dict:
    """``AndersonOptions``' fields after ``inner``: ``name -> (default, annotation)``."""
    return {
        f.name: (f.default, f.type)
        for f in dataclasses.fields(AndersonOptions)
        if f.name != "inner"
    }


def _keywords(function) -> dict:
    """The keyword-only parameters of ``function``: ``name -> (default, annotation)``, but
    the wrapper's own ``safeguard`` (last, checked here), which is not an ``anderson`` option."""
    parameters = inspect.signature(function).parameters
    keywords = {
        name: (p.default, p.annotation)
        for name, p in parameters.items()
        if p.kind == inspect.Parameter.KEYWORD_ONLY
    }
    if function in (aa.AcceleratedOptimizer, aa.accelerate):
        assert list(keywords)[-1] == "safeguard"
        assert keywords.pop("safeguard") == ("loss_fn", "str")
    return keywords


def test_the_wrapper_types_every_option_as_anderson_does():
    """``AcceleratedOptimizer(optimizer, *, ...)`` lists the options with the same order,
    defaults and annotations (what a type checker reads: ``history_depth="5"`` is an error)."""
    parameters = list(inspect.signature(aa.AcceleratedOptimizer).parameters)
    assert parameters[0] == "optimizer"
    assert _keywords(aa.AcceleratedOptimizer) == _option_fields()
    assert list(_keywords(aa.AcceleratedOptimizer)) == list(_option_fields())
    anderson = inspect.signature(aa.anderson).parameters
    assert {n: (p.default, p.annotation) for n, p in anderson.items() if n != "inner"} == (
        _option_fields()
    )


def test_accelerate_types_every_option_under_aadl_names_or_its_own():
    """``accelerate`` keeps AADL's positional parameters (``reg_acc`` is ``reg``; AADL's own
    defaults) and takes every other option by keyword, typed as ``anderson`` types it."""
    parameters = inspect.signature(aa.accelerate).parameters
    aadl = [n for n, p in parameters.items() if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert aadl[:2] == ["optimizer", "acceleration_type"]
    fields = _option_fields()
    named = {"reg" if n == "reg_acc" else n for n in aadl[2:]}
    assert named <= set(fields)
    for name in aadl[2:]:
        assert parameters[name].annotation == fields["reg" if name == "reg_acc" else name][1]
    keywords = _keywords(aa.accelerate)
    assert set(keywords) == set(fields) - named
    assert keywords == {name: fields[name] for name in keywords}
    assert list(keywords) == [name for name in fields if name in keywords]  # the same order
    assert not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())

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

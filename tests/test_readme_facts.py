"""The numbers the README and the demo's docs state about the main job (``make demo``) are the
ones ``examples/digits_demo.py`` computes and writes into its ``summary.json`` ``config``.

Computed as the demo computes them, without running it: the model built and its parameters
counted (``num_params``), the digits split (``data``), the seeds, the budget and the size of
the tuning grids, read from the script's constants and functions.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/demo.md", "docs/benchmarks.md")

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def demo():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import _common
        import digits_demo

        yield digits_demo, _common
    finally:
        sys.path.remove(str(ROOT / "examples"))


def _paragraphs_on_the_demo():
    """(page, paragraph) for every paragraph that describes the digits CNN."""
    for page in PAGES:
        for paragraph in (ROOT / page).read_text().split("\n\n"):
            if "CNN" in paragraph and "digits" in paragraph:
                yield page, " ".join(paragraph.split())


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_stated_parameter_count_is_the_demos(demo):
    digits_demo, common = demo
    data = common.load_digits(dtype=torch.float32, seed=0)
    problem = digits_demo.make_problem(digits_demo.SEEDS[0], data, torch.float32)
    num_params = sum(p.numel() for p in problem.initial.values())  # summary["config"]
    stated = [
        (page, _number(count))
        for page, paragraph in _paragraphs_on_the_demo()
        for count in re.findall(r"([\d,]+) parameters", paragraph)
    ]
    assert {page for page, _ in stated} == set(PAGES), stated
    assert all(count == num_params for _, count in stated), (num_params, stated)
    # The docstring of the model's builder says the same.
    assert f"{num_params:,}" in common.make_cnn.__doc__.replace("\n   ", "")


def test_the_stated_data_seeds_budget_and_grids_are_the_demos(demo):
    digits_demo, common = demo
    data = common.load_digits(dtype=torch.float32, seed=0)
    train, test = len(data.y_train), len(data.y_test)
    texts = [paragraph for _, paragraph in _paragraphs_on_the_demo()]
    for count in (n for t in texts for n in re.findall(r"([\d,]+) train", t)):
        assert _number(count) == train
    for count in (n for t in texts for n in re.findall(r"([\d,]+) test images", t)):
        assert _number(count) == test
    budgets = [n for t in texts for n in re.findall(r"(?:spent|gets|budget) ([\d,]+)", t)]
    assert budgets and all(_number(budget) == digits_demo.BUDGET for budget in budgets), budgets
    seeds = list(digits_demo.SEEDS)
    assert seeds == [0, 1, 2]  # as the pages spell them: "seeds 0-2", "seeds 0, 1 and 2"
    assert any("seeds 0-2" in t or "seeds 0, 1" in t for t in texts)
    sizes = {len(grid) for grid in digits_demo.tuning_grids().values()}
    for count in (n for t in texts for n in re.findall(r"(\d+) settings", t)):
        assert sizes == {int(count)}, sizes

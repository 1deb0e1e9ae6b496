"""What a failing call must leave as it was: every tensor the caller holds, by value and by
version counter (an in-place write moves the counter even when it writes the same values)."""

from __future__ import annotations

import optree
import torch


def snapshot(*trees) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Every tensor leaf of `trees` with a copy of its values and its version counter."""
    leaves = optree.tree_leaves(trees, none_is_leaf=True)
    return [(t, t.clone(), t._version) for t in leaves if isinstance(t, torch.Tensor)]


def assert_untouched(taken: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Each tensor of a `snapshot()` keeps its version counter, dtype and values."""
    for t, copy, version in taken:
        assert t._version == version, "a tensor was written by a failing update"
        assert t.dtype == copy.dtype and torch.equal(t, copy)

r"""Gradient transformations to chain in front of an inner optimizer (optax/torchopt style).

[`chain()`][aadl_func.chain] composes `InnerOptimizer` s (or any torchopt-style
`init`/`update` pair): each one's output updates are the next one's input, so

```python
inner = aa.chain(
    aa.clip_by_global_norm(1.0),
    aa.add_decayed_weights(5e-4, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
    aa.sgd(0.1, momentum=0.9),
)
opt = aa.anderson(inner, history_depth=5)
```

clips the gradients, adds an L2 term to the weight matrices only and takes SGD's step, which
Anderson acceleration then treats as its map $g$. [`aadl_func.anderson()`][aadl_func.anderson] is
always the outermost layer (it needs the params and returns them; it is not a gradient
transformation), so the other transformations go *inside* it, as its `inner`.

Every transformation here is pure, holds tensors only in its state (`torch.save` with
`weights_only=True` loads it), has no data-dependent Python control flow (`vmap`,
`torch.compile`), and with `inplace=True` may overwrite the updates it receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from aadl_func._src import tree
from aadl_func._src.inner import InnerOptimizer
from aadl_func._src.state import allow_weights_only
from aadl_func._src.transforms import EmptyState, Transform, decay_leaf
from aadl_func._src.transforms import chain as chain_stages
from aadl_func._src.validation import check_float

__all__ = ["ChainState", "add_decayed_weights", "chain", "clip_by_global_norm"]

PyTree = Any


class ChainState(NamedTuple):
    """The states of a [`chain()`][aadl_func.chain]'s transformations, in order."""

    states: tuple


def chain(*transforms: Any) -> InnerOptimizer:
    """Composes transformations: `update` runs each in turn on the previous one's output.

    Args:
      *transforms: `init`/`update` pairs in the torchopt protocol (`update(updates,
        state, params=None, inplace=...) -> (updates, state)`), e.g.
        [`clip_by_global_norm()`][aadl_func.clip_by_global_norm],
        [`add_decayed_weights()`][aadl_func.add_decayed_weights],
        [`aadl_func.sgd()`][aadl_func.sgd], or torchopt's.

    Returns:
      An `InnerOptimizer` whose state is a `ChainState`.
    """
    if not transforms:
        raise ValueError("chain: pass at least one transformation")
    for i, t in enumerate(transforms):
        if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
            raise TypeError(
                f"chain: transformation {i} must have callable `init` and `update`, got "
                f"{type(t).__name__}"
            )

    composed = chain_stages(*(_as_stage(t) for t in transforms))

    def init(params: PyTree) -> ChainState:
        return ChainState(composed.init(params))

    def update(
        updates: PyTree, state: ChainState, params: PyTree = None, inplace: bool = True
    ) -> tuple[PyTree, ChainState]:
        if not isinstance(state, ChainState) or len(state.states) != len(transforms):
            raise TypeError(
                f"chain.update: `state` must be the ChainState of {len(transforms)} "
                f"transformations this chain's init made, got {type(state).__name__}"
            )
        updates, states = composed.update(updates, state.states, (params, inplace))
        return updates, ChainState(states)

    return InnerOptimizer(init, update)


def _as_stage(transform: Any) -> Transform:
    """A torchopt-style transformation as a stage of the package's one composition
    (`transforms.chain`), which hands every stage the same `(params, inplace)` pair."""

    def update(updates: PyTree, state: Any, call: tuple[PyTree, bool]) -> tuple[PyTree, Any]:
        params, inplace = call
        return transform.update(updates, state, params=params, inplace=inplace)

    return Transform(transform.init, update)


def clip_by_global_norm(max_norm: float) -> InnerOptimizer:
    r"""Scales the updates so that their global 2-norm is at most `max_norm`.

    As `torch.nn.utils.clip_grad_norm_()`: with $\nu$ the 2-norm of the leaves'
    2-norms, every leaf is multiplied by $\min(1, \mathrm{max\_norm} / (\nu +
    10^{-6}))$. Under `vmap` each member is clipped by its own norm.
    """
    max_norm = check_float("clip_by_global_norm", "max_norm", max_norm, minimum=0.0, strict=True)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(
        updates: PyTree, state: EmptyState, params: PyTree = None, inplace: bool = True
    ) -> tuple[PyTree, EmptyState]:
        leaves, spec = tree.flatten(updates, "updates", owner="clip_by_global_norm")
        if not leaves:
            return updates, state
        norms = torch.stack([torch.linalg.vector_norm(u) for u in leaves])
        total = torch.linalg.vector_norm(norms)
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if inplace:
            scaled = [u.mul_(factor.to(u.device, u.dtype)) for u in leaves]
        else:
            scaled = [u * factor.to(u.device, u.dtype) for u in leaves]
        return tree.unflatten(spec, scaled), state

    return InnerOptimizer(init, update)


def add_decayed_weights(
    weight_decay: float, mask: PyTree | Callable[[PyTree], PyTree] | None = None
) -> InnerOptimizer:
    r"""Adds `weight_decay * params` to the updates, on the leaves `mask` selects.

    In front of an optimizer, where the updates are gradients, this is L2 regularisation as
    `torch.optim`'s (coupled) `weight_decay` applies it, restricted to some leaves: the
    usual "no decay on biases and norm layers".

    Args:
      weight_decay: `>= 0`.
      mask: None (every leaf), a pytree of bools like `params`, or a function
        `params -> pytree of bools` (called at every update, on the params).
    """
    weight_decay = check_float("add_decayed_weights", "weight_decay", weight_decay, minimum=0.0)

    def init(params: PyTree) -> EmptyState:
        return EmptyState()

    def update(
        updates: PyTree, state: EmptyState, params: PyTree = None, inplace: bool = True
    ) -> tuple[PyTree, EmptyState]:
        owner = "add_decayed_weights"
        if params is None:
            raise ValueError(f"{owner}: `params` is required (the decay is proportional to them)")
        u_leaves, spec = tree.flatten(updates, "updates", owner=owner)
        p_leaves, p_spec = tree.flatten(params, "params", owner=owner)
        tree.check_like("params", p_leaves, p_spec, u_leaves, spec, "updates", owner=owner)
        selected = mask(params) if callable(mask) else mask
        if selected is None:
            chosen = [True] * len(u_leaves)
        else:
            chosen = optree.tree_flatten(selected, none_is_leaf=False)[0]
            if len(chosen) != len(u_leaves) or not all(isinstance(c, bool) for c in chosen):
                raise TypeError(
                    f"{owner}: `mask` must be (or return) a pytree of bools like `params`"
                )
        out = []
        for u, p, use in zip(u_leaves, p_leaves, chosen):
            # A decay of 0 is a no-op: adding 0 * params would make -0.0 into 0.0, inf into NaN.
            if not use or weight_decay == 0.0:
                out.append(u)
            else:
                out.append(decay_leaf(u, p, weight_decay, inplace))
        return tree.unflatten(spec, out), state

    return InnerOptimizer(init, update)


allow_weights_only(ChainState, EmptyState)

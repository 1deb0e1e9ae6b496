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
from aadl_func._src.inner import InnerOptimizer, holds_updates
from aadl_func._src.state import allow_weights_only
from aadl_func._src.transforms import EmptyState, Transform, decay_leaf
from aadl_func._src.transforms import chain as chain_stages
from aadl_func._src.validation import check_float, check_floating_leaves

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

    With `inplace=True` nothing the caller holds is written before every transformation
    succeeded: they run out of place, then the returned updates are written into the
    gradient buffers and the new states into the old states' buffers (counters, 0-d, are
    returned new, as the transformations make them). A transformation that raises (no
    `params` for a decay, a failing schedule, a user's) thus leaves the params, the grads
    and the state as they were.
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
        # Out of place either way: an in-place call writes the results into the caller's
        # tensors only once every stage succeeded (`_commit`).
        new_updates, states = composed.update(updates, state.states, (params, False))
        if not inplace:
            return new_updates, ChainState(states)
        return _commit(updates, state.states, new_updates, states)

    return InnerOptimizer(init, update)


def _commit(
    grads: PyTree, old_states: tuple, updates: PyTree, new_states: tuple
) -> tuple[PyTree, ChainState]:
    """An in-place chain's results, written into the caller's tensors once every stage
    succeeded: the updates into the gradient buffers (torchopt's semantics: they hold the
    returned updates), the new states into the old states' buffers.

    A new leaf is written into the old one where both are tensors of one shape, dtype and
    device and the old one can be written (not an `expand`-ed gradient); otherwise the
    new leaf is returned as it is (so are a stage's non-tensor leaves, e.g. numbers). A
    state's 0-d tensors, its counters, are returned new, as the stages make them in place
    too (`count + 1`): the caller's counter keeps its value, and one that `vmap` broadcast
    (stride 0, torchopt's) is never written into.
    """
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    states = tuple(
        new if new is old else _written(old, new, writes, scalars=False)
        for old, new in zip(old_states, new_states)
    )
    out = _written(grads, updates, writes, scalars=True)
    # All at once: a source that is also a target (a stage that returned a buffer it was
    # given, e.g. a gradient kept in its state) is read before anything is written.
    targets = {id(dst) for dst, _ in writes}
    if any(id(src) in targets for _, src in writes):
        writes = [(dst, src.clone() if id(src) in targets else src) for dst, src in writes]
    for dst, src in writes:
        dst.copy_(src)
    return out, ChainState(states)


def _written(old: PyTree, new: PyTree, writes: list, *, scalars: bool) -> PyTree:
    """`new`, with each tensor leaf that `old` has a tensor of the same layout for (and,
    unless `scalars`, at least one dimension) replaced by that tensor, the copy recorded in
    `writes`; `new` itself if the structures differ."""
    old_leaves, old_spec = optree.tree_flatten(old, none_is_leaf=True)
    new_leaves, new_spec = optree.tree_flatten(new, none_is_leaf=True)
    if not tree.same_structure(old_spec, new_spec):
        return new
    leaves = []
    for dst, src in zip(old_leaves, new_leaves):
        if (
            isinstance(dst, torch.Tensor)
            and isinstance(src, torch.Tensor)
            and dst is not src
            and (scalars or dst.ndim > 0)
            and dst.shape == src.shape
            and dst.dtype == src.dtype
            and dst.device == src.device
            and holds_updates(dst)
        ):
            writes.append((dst, src))
            leaves.append(dst)
        else:
            leaves.append(src)
    return optree.tree_unflatten(new_spec, leaves)


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
    10^{-6}))$. Under `vmap` each member is clipped by its own norm. The updates must be
    floating-point (or complex) tensors (`TypeError` otherwise, before anything is written).
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
        check_floating_leaves("clip_by_global_norm", "updates", leaves, spec)
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
        `params -> pytree of bools` (called at every update, on the params). The mask has
        the pytree structure of `params` (its leaves are matched by key, e.g. by a dict's
        keys, not by position); another structure raises `ValueError`, a leaf that is
        not a `bool` `TypeError`.
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
        chosen = _mask_leaves(mask, params, p_spec)
        out = []
        for u, p, use in zip(u_leaves, p_leaves, chosen):
            # A decay of 0 is a no-op: adding 0 * params would make -0.0 into 0.0, inf into NaN.
            if not use or weight_decay == 0.0:
                out.append(u)
            else:
                out.append(decay_leaf(u, p, weight_decay, inplace))
        return tree.unflatten(spec, out), state

    return InnerOptimizer(init, update)


def _mask_leaves(mask: Any, params: PyTree, spec: Any) -> list[bool]:
    """`add_decayed_weights`'s mask (or what it returns for `params`) as one bool per leaf of
    `params` (structure `spec`), matched by key: a mask of another structure is refused
    rather than applied by leaf position."""
    owner = "add_decayed_weights"
    if mask is None:
        return [True] * spec.num_leaves
    name = "mask(params)" if callable(mask) else "mask"
    selected = mask(params) if callable(mask) else mask
    chosen, m_spec = optree.tree_flatten(selected, none_is_leaf=False)
    if not tree.same_structure(m_spec, spec):
        raise ValueError(
            f"{owner}: `mask` must be (or return) a pytree of bools with the structure of "
            "`params`: "
            # (the walk calls any leaf "a tensor"; a mask's leaves are bools)
            + tree.structure_difference(m_spec, spec, name, "params").replace(
                "` is a tensor where", "` is a leaf where", 1
            )
        )
    for i, c in enumerate(chosen):
        if not isinstance(c, bool):
            raise TypeError(
                f"{owner}: `mask` must be (or return) a pytree of bools like `params`; "
                f"`{tree.leaf_path(m_spec, i, name)}` is {type(c).__name__}"
            )
    return chosen


allow_weights_only(ChainState, EmptyState)

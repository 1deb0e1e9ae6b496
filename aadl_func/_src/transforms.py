r"""The stages the inner optimizers are chained from (optax's and torchopt's transformations).

A stage is a `Transform`: `init(leaves) -> state` and
`update(updates, state, step) -> (updates, state)`, over the flat lists of leaves of one
pytree (the alias flattens once per call, like torchopt's `chain.flat`). A stage's state is
a NamedTuple of such lists, one per parameter-shaped buffer, named like the field of the
public state (`SgdState`, `AdamState`) that stores it.
What the stages of one update share, the update count, the params and the hyperparameters'
values, comes in a `StepInputs` that the alias resolves before any stage runs, so that a
failing schedule raises before a buffer is written.

`inplace` is the torchopt protocol's: with `True` a stage may overwrite the updates it
received and its state's buffers, and the alias copies the chain's result into the caller's
gradient buffers where it is not there already; with `False` a stage writes nothing it was
given and may return an update that is also one of its new state's tensors (the momentum
buffer), so that the stages after it must not write into it either. The one exception is
the decoupled weight decay, which adds into the new tensors that `scale_by_adam()`
returns, in both modes (see [`add_decayed_weights()`][aadl_func.add_decayed_weights]).

Every stage does exactly the operations of the `torch.optim` single-tensor kernels, in
their order, so that the chains equal `torch.optim` step for step. That is why the learning
rate is part of `scale_by_adam()`'s step size instead of a stage of its own there:
`torch.optim` multiplies the first moment by $-\gamma / (1 - \beta_1^t)$ before the
division, and scaling the quotient afterwards would round differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import tree

__all__ = [
    "EmptyState",
    "ScaleByAdamState",
    "StepInputs",
    "TraceState",
    "Transform",
    "adam_leaves",
    "add_decayed_weights",
    "chain",
    "decay_leaf",
    "scale_by_adam",
    "scale_by_learning_rate",
    "trace",
]

_REDUCED_FLOAT_DTYPES = (torch.float16, torch.bfloat16)
# The real dtypes whose Adam step is computed in their own precision (`adam_leaves()`).
_KNOWN_DTYPES = (torch.float32, torch.float64)


class StepInputs(NamedTuple):
    """What every stage of one update reads besides its own state.

    Attributes:
        count: 0-d `int64` tensor, the number of updates done before this one.
        params: the parameters' leaves, or `None` when no stage of the chain reads them.
        lr: the learning rate for this update, a Python float or a float64 0-d tensor.
        weight_decay: the weight decay for this update, likewise.
        inplace: whether the stages may write into the updates and their state buffers.
    """

    count: Tensor
    params: list[Tensor] | None
    lr: float | Tensor
    weight_decay: float | Tensor
    inplace: bool


class Transform(NamedTuple):
    """One stage: `init(leaves) -> state` and `update(updates, state, step) -> (updates,
    state)`, both over flat lists of leaves (see the module docstring)."""

    init: Callable[[list[Tensor]], tuple]
    update: Callable[[list[Tensor], Any, StepInputs], tuple[list[Tensor], Any]]


class EmptyState(NamedTuple):
    """The state of a stage that keeps none."""


def chain(*stages: Transform) -> Transform:
    """The stages applied one after the other; the state is the tuple of theirs.

    The package's one composition: the inner optimizers chain their stages with it, and the
    public [`chain()`][aadl_func.chain] chains torchopt-style transformations with it (each as
    a stage that reads `params` and `inplace` from its third argument). `step` reaches every
    stage as it came; each stage's output updates are the next one's input.
    """

    def init(leaves: list[Tensor]) -> tuple:
        return tuple(stage.init(leaves) for stage in stages)

    def update(updates: list[Tensor], state: tuple, step: StepInputs) -> tuple[list[Tensor], tuple]:
        new_state = []
        for stage, stage_state in zip(stages, state):
            updates, stage_state = stage.update(updates, stage_state, step)
            new_state.append(stage_state)
        return updates, tuple(new_state)

    return Transform(init, update)


def _no_state(leaves: list[Tensor]) -> EmptyState:
    return EmptyState()


# --------------------------------------------------------------------------------------------
# Weight decay and the learning rate.
# --------------------------------------------------------------------------------------------


def add_decayed_weights(*, decoupled: bool = False) -> Transform:
    r"""Weight decay $\lambda$ = `step.weight_decay` with the params $\theta$.

    Coupled (an L2 penalty, SGD's and Adam's `weight_decay`, before the scaling):
    $u \leftarrow u + \lambda\theta$. Decoupled (AdamW's, after `scale_by_adam()`):
    $u \leftarrow u - \gamma\lambda\theta$ with the learning rate $\gamma$ =
    `step.lr`, added into the updates in place whatever `inplace`: they are the new
    tensors of `scale_by_adam()`, and writing into them keeps their dtype and layout (an
    out-of-place `addcmul` with a float64 0-d scale promotes under vmap) and is
    `torch.optim`'s operation.
    """

    def update(
        updates: list[Tensor], state: EmptyState, step: StepInputs
    ) -> tuple[list[Tensor], EmptyState]:
        decay = step.weight_decay
        if decoupled:
            scale, into_updates = -(step.lr * decay), True
        else:
            scale, into_updates = decay, step.inplace
        return [decay_leaf(u, p, scale, into_updates) for u, p in zip(updates, step.params)], state

    return Transform(_no_state, update)


def decay_leaf(update: Tensor, param: Tensor, scale: float | Tensor, inplace: bool) -> Tensor:
    r"""The package's one decay rule, $u \leftarrow u + s\,\theta$ for one leaf.

    `add_decayed_weights()` passes $s = \lambda$ (coupled) or $-\gamma\lambda$
    (decoupled), the public [`add_decayed_weights()`][aadl_func.add_decayed_weights] its
    `weight_decay` on the leaves its mask selects. A number $s$ is the `alpha=` of one
    `add`, `torch.optim`'s operation; a 0-d tensor goes into one fused `addcmul`. With
    `inplace` the update is written into.
    """
    if isinstance(scale, float):
        return update.add_(param, alpha=scale) if inplace else update.add(param, alpha=scale)
    # addcmul_ has no vmap batching rule: out of place, then written back.
    out = torch.addcmul(update, param, scale)
    return update.copy_(out) if inplace else out


def scale_by_learning_rate() -> Transform:
    r"""$u \leftarrow -\gamma u$, the learning rate $\gamma$ = `step.lr`."""

    def update(
        updates: list[Tensor], state: EmptyState, step: StepInputs
    ) -> tuple[list[Tensor], EmptyState]:
        neg_lr = -step.lr
        if step.inplace:
            return [u.mul_(neg_lr) for u in updates], state
        return [u.mul(neg_lr) for u in updates], state

    return Transform(_no_state, update)


# --------------------------------------------------------------------------------------------
# Momentum.
# --------------------------------------------------------------------------------------------


class TraceState(NamedTuple):
    """The state of `trace()`: the momentum buffers $b$, one per leaf."""

    momentum_buffer: list[Tensor]


def trace(momentum: float, dampening: float, nesterov: bool) -> Transform:
    r"""Heavy-ball momentum as `torch.optim.SGD` keeps it.

    $$
    b_t = u_t \text{ if } t = 1 \text{ else } \mu b_{t-1} + (1 - \tau) u_t, \qquad
    u_t \leftarrow u_t + \mu b_t \text{ (nesterov) or } b_t
    $$

    The first update is known from the count: eagerly (a concrete CPU counter) only its branch
    is computed; under a transform both are blended with `torch.where`. Each buffer keeps
    its own memory format (`blended` first in `where`, or a copy into a buffer laid out
    like it).
    """

    def init(leaves: list[Tensor]) -> TraceState:
        return TraceState(
            [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        )

    def update(
        updates: list[Tensor], state: TraceState, step: StepInputs
    ) -> tuple[list[Tensor], TraceState]:
        count = tree.static_value(step.count)
        first = None if count is None else count == 0
        not_first = step.count != 0 if first is None else None
        inplace = step.inplace
        new_updates, new_bufs = [], []
        for d_p, buf in zip(updates, state.momentum_buffer, strict=True):
            if first:
                new_buf = buf.copy_(d_p) if inplace else torch.empty_like(buf).copy_(d_p)
            elif first is not None:
                if inplace:
                    new_buf = buf.mul_(momentum).add_(d_p, alpha=1.0 - dampening)
                else:
                    new_buf = torch.add(buf.mul(momentum), d_p, alpha=1.0 - dampening)
            elif inplace:
                blended = buf.mul_(momentum).add_(d_p, alpha=1.0 - dampening)
                new_buf = buf.copy_(torch.where(not_first, blended, d_p))
            else:
                blended = torch.add(buf.mul(momentum), d_p, alpha=1.0 - dampening)
                new_buf = torch.where(not_first, blended, d_p)
            new_bufs.append(new_buf)
            if nesterov:
                d_p = (
                    d_p.add_(new_buf, alpha=momentum)
                    if inplace
                    else d_p.add(new_buf, alpha=momentum)
                )
            elif inplace:
                d_p = d_p.copy_(new_buf)  # never scale the momentum buffer itself
            else:
                d_p = new_buf
            new_updates.append(d_p)
        return new_updates, TraceState(new_bufs)

    return Transform(init, update)


# --------------------------------------------------------------------------------------------
# Adam.
# --------------------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """The state of `scale_by_adam()`: the moment estimates $m$ and $v$."""

    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]


def scale_by_adam(beta1: float, beta2: float, eps: float) -> Transform:
    r"""Adam's scaling, with the learning rate $\gamma$ = `step.lr` in its step size.

    $$
    m_t &= m_{t-1} + (1 - \beta_1)(u_t - m_{t-1}) \\
    v_t &= \beta_2 v_{t-1} + (1 - \beta_2) u_t^2 \\
    u_t &\leftarrow -\frac{\gamma}{1 - \beta_1^t} \, m_t \Big/
        \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)
    $$

    for update $t$ = `count + 1` (see the module docstring for why $\gamma$ is
    here). Its updates are new tensors in both modes. Complex leaves are handled as pairs of
    reals, like `torch.optim`.
    """

    def init(leaves: list[Tensor]) -> ScaleByAdamState:
        exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        return ScaleByAdamState(exp_avg, exp_avg_sq)

    def update(
        updates: list[Tensor], state: ScaleByAdamState, step: StepInputs
    ) -> tuple[list[Tensor], ScaleByAdamState]:
        neg_step_size, bias_correction2_sqrt = _bias_corrections(step.count, beta1, beta2, step.lr)
        new_updates, new_ms, new_vs = [], [], []
        for g, m, v in zip(updates, state.exp_avg, state.exp_avg_sq, strict=True):
            u, m, v = _adam_leaf(
                g, m, v, neg_step_size, bias_correction2_sqrt, beta1, beta2, eps, step.inplace
            )
            new_updates.append(u)
            new_ms.append(m)
            new_vs.append(v)
        return new_updates, ScaleByAdamState(new_ms, new_vs)

    return Transform(init, update)


def _adam_leaf(
    g: Tensor,
    m: Tensor,
    v: Tensor,
    neg_step_size: float | Tensor,
    bias_correction2_sqrt: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    inplace: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    is_complex = torch.is_complex(g)
    if is_complex:  # like torch.optim: complex numbers are treated as pairs of reals
        g, m, v = torch.view_as_real(g), torch.view_as_real(m), torch.view_as_real(v)

    if inplace and not tree.is_transformed(m):
        m = m.lerp_(g, 1.0 - beta1)
        v = v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    elif inplace:
        # lerp_ / addcmul_ have no vmap batching rules (slow fallback + warning): compute out
        # of place with the same kernels and write back into the state buffers.
        m = m.copy_(torch.lerp(m, g, 1.0 - beta1))
        v = v.copy_(torch.addcmul(v.mul_(beta2), g, g, value=1.0 - beta2))
    else:
        m, v = _moments(g, m, v, beta1, beta2)

    # Half precision computes the scalings in float32, like torch.optim's kernels; the
    # corrections are cast to the compute dtype. (sqrt is out of place: its backward needs
    # its output when the update is differentiated.)
    dtype = v.dtype
    opmath = torch.float32 if dtype in _REDUCED_FLOAT_DTYPES else dtype
    if not isinstance(bias_correction2_sqrt, float):
        bias_correction2_sqrt = bias_correction2_sqrt.to(opmath)
    if not isinstance(neg_step_size, float):
        neg_step_size = neg_step_size.to(opmath)
    if opmath == dtype:
        step = _direction(m, v, neg_step_size, bias_correction2_sqrt, eps)
    else:
        denom = torch.div(v.sqrt().to(opmath), bias_correction2_sqrt).to(dtype).add_(eps)
        step = torch.mul(m.to(opmath), neg_step_size).div_(denom.to(opmath)).to(dtype)

    if is_complex:
        m, v, step = torch.view_as_complex(m), torch.view_as_complex(v), torch.view_as_complex(step)
    return step, m, v


def adam_leaves(
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    done: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]] | None:
    """`scale_by_adam()`'s out-of-place update, `(updates, exp_avg, exp_avg_sq)`, for a
    caller that knows the update count `done` (a Python int), a number `lr` and plain
    real float32/float64 leaves outside any transform (anderson's steady call, through
    `update_leaves`): the same operations as `_adam_leaf()`'s, without its per-leaf
    questions. None, having computed nothing, for another kind of leaf."""
    if any(g.dtype not in _KNOWN_DTYPES for g in grads):
        return None  # complex, half precision: `_adam_leaf()` answers
    if not len(grads) == len(exp_avg) == len(exp_avg_sq):
        raise ValueError("internal: adam_leaves needs one buffer of each kind per leaf")
    neg_step_size, bias_correction2_sqrt = _known_bias_corrections(done, beta1, beta2, lr)
    if len(grads) <= 1 or not all(g.is_cpu for g in grads):
        # One leaf: the plain ops cost less than their foreach forms (and none: the foreach
        # ops refuse an empty list). Off the CPU torch's foreach kernels are fused ones of
        # their own, not the per-tensor ops.
        updates, ms, vs = [], [], []
        for g, m, v in zip(grads, exp_avg, exp_avg_sq):
            m, v = _moments(g, m, v, beta1, beta2)
            updates.append(_direction(m, v, neg_step_size, bias_correction2_sqrt, eps))
            ms.append(m)
            vs.append(v)
        return updates, ms, vs
    # The same operations over every leaf at once, as torch.optim's foreach Adam runs them:
    # on the CPU each `_foreach_*` op applies its per-tensor kernel leaf by leaf, so every
    # value is the per-leaf op's, with one Python call per operation instead of per leaf.
    ms = torch._foreach_lerp(exp_avg, grads, 1.0 - beta1)
    vs = torch._foreach_addcmul(
        torch._foreach_mul(exp_avg_sq, beta2), grads, grads, value=1.0 - beta2
    )
    denoms = torch._foreach_div(torch._foreach_sqrt(vs), bias_correction2_sqrt)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_mul(ms, neg_step_size)
    torch._foreach_div_(updates, denoms)
    return updates, ms, vs


def _moments(g: Tensor, m: Tensor, v: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    r"""$m + (1 - \beta_1)(g - m)$ and $\beta_2 v + (1 - \beta_2) g^2$, as new tensors."""
    return torch.lerp(m, g, 1.0 - beta1), torch.addcmul(v.mul(beta2), g, g, value=1.0 - beta2)


def _direction(
    m: Tensor, v: Tensor, neg_step_size: float | Tensor, bias_correction2_sqrt: float | Tensor,
    eps: float,
) -> Tensor:  # fmt: skip
    r"""Adam's step $-s\, m / (\sqrt{v} / b_2 + \epsilon)$ in the moments' dtype."""
    denom = torch.div(v.sqrt(), bias_correction2_sqrt).add_(eps)
    return torch.mul(m, neg_step_size).div_(denom)


def _known_bias_corrections(
    done: int, beta1: float, beta2: float, lr: float
) -> tuple[float, float]:
    """`_bias_corrections()` for a known count and a number `lr`: Python floats, with
    torch.optim's arithmetic."""
    bias_correction1 = 1.0 - beta1 ** (done + 1)
    bias_correction2 = 1.0 - beta2 ** (done + 1)
    return -(lr / bias_correction1), bias_correction2**0.5


def _bias_corrections(
    count: Tensor, beta1: float, beta2: float, lr: float | Tensor
) -> tuple[float | Tensor, float | Tensor]:
    r"""`(-lr / (1 - beta1^t), sqrt(1 - beta2^t))` for update $t$ = `count + 1`.

    In float64, like the Python floats of torch.optim: as Python floats themselves when the
    counter is a concrete CPU tensor and `lr` a number (the eager case; the same arithmetic
    as torch.optim, and no tensor ops), else with tensor ops from the counter (vmap, counters
    on an accelerator, tensor or scheduled-tensor `lr`). Each leaf casts them to its own
    compute dtype.
    """
    done = tree.static_value(count)
    if done is not None and isinstance(lr, float):
        return _known_bias_corrections(done, beta1, beta2, lr)
    t = (count + 1).to(torch.float64)
    bias_correction1 = 1.0 - torch.pow(beta1, t)
    bias_correction2 = 1.0 - torch.pow(beta2, t)
    if isinstance(lr, float):
        neg_step_size = -(torch.full_like(bias_correction1, lr) / bias_correction1)
    else:
        neg_step_size = -(lr.to(bias_correction1.device) / bias_correction1)
    return neg_step_size, bias_correction2.sqrt()

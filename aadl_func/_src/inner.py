"""Functional inner optimizers in the torchopt protocol.

Every optimizer here is a pair of pure functions bundled in an `InnerOptimizer`:

* `init(params) -> state`
* `update(updates, state, params=None, inplace=True) -> (updates, new_state)`

`params` and `updates` (the gradients on input) are arbitrary pytrees of tensors (dicts,
tuples, lists, nested; traversed with `optree`, `None` is *not* a leaf). The returned
`updates` are the deltas to **add** to the parameters, `new_params = params + updates`,
exactly like `torchopt.apply_updates`.

The optimizers reproduce `torch.optim.SGD`, `torch.optim.Adam` and
`torch.optim.AdamW` (default single-tensor implementation: not fused, not capturable,
`maximize=False`, `amsgrad=False`) operation for operation, so that after
`params + updates` the results agree with `torch.optim` up to the final rounding of that
addition (`torch.optim` fuses it into the parameter update).

Each optimizer is a chain of small stages (`aadl_func._src.transforms`), as in optax and
torchopt: `sgd = chain(add_decayed_weights, trace, scale_by_learning_rate)`,
`adam = chain(add_decayed_weights, scale_by_adam)` and
`adamw = chain(scale_by_adam, add_decayed_weights(decoupled=True))`, each stage present only
when its option asks for it. The public state holds the update count, shared by the stages,
then the stages' buffers, each in the field named like it.

All states are `typing.NamedTuple` s that hold only tensors (the step counter is a 0-d
`int64` tensor on the parameters' device), and no hyperparameter logic branches on tensor
values, so `init` and `update` compose with `torch.func.vmap()` (ensembles of models),
and with `inplace=False` with `torch.func.grad()` / `torch.func.jvp()` as well.

Schedules. `lr` and `weight_decay` take, besides a number, a 0-d tensor (read at every
update: in-place changes take effect, and under `vmap` a batched one gives every member its
own value) or a schedule `count -> value` (optax's and torchopt's `ScalarOrSchedule`). A
schedule is called at every update with `count`, the number of updates done so far (0 on the
first), read from the state: a scheduled run is a pure function of its state, so it saves and
resumes bit-identically. `count` is a 0-d float64 tensor on the parameters' device, so that
schedule arithmetic such as `0.5 ** (count // 30)` or `(count + 1) / 100` runs in float64
like `torch.optim`'s Python floats (an int64 tensor would compute in float32). The value may
be a Python number or a 0-d tensor. The other hyperparameters (`momentum`, `dampening`,
`nesterov`, `betas`, `eps`) are numbers only, as in optax and torchopt: they decide the
state's layout and are validated once, at construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import inner_bound, tree
from aadl_func._src.inner_bound import BoundRule
from aadl_func._src.leaf_memory import self_overlapping
from aadl_func._src.state import allow_weights_only
from aadl_func._src.transforms import (
    StepInputs,
    Transform,
    adam_leaves,
    add_decayed_weights,
    chain,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)
from aadl_func._src.validation import (
    check_betas,
    check_bool,
    check_buffers,
    check_floating_leaves,
    check_hyperparameter,
    check_nesterov,
    check_non_negative,
    check_schedule_value,
    check_state_type,
    flatten_like,
)

__all__ = [
    "AdamState",
    "InnerOptimizer",
    "SgdState",
    "adam",
    "adamw",
    "check_update_shapes",
    "holds_updates",
    "sgd",
]

PyTree = Any
#: A hyperparameter: a number, a 0-d tensor, or a schedule `count -> number or 0-d tensor`.
ScalarOrSchedule = float | Tensor | Callable[[Tensor], float | Tensor]


class InnerOptimizer(NamedTuple):
    """A functional optimizer: a pair of pure functions (torchopt's `GradientTransformation`).

    Attributes:
        init: `init(params) -> state`. Builds the optimizer state for a pytree of parameter
            tensors.
        update: `update(updates, state, params=None, inplace=True) -> (updates, new_state)`.
            Maps gradients `updates` (same pytree structure as `params`) to the parameter
            deltas, so that `new_params = params + updates` leaf by leaf. With
            `inplace=True` the gradient and state buffers may be overwritten and reused
            (a gradient that cannot be written, such as the `expand`-ed tensors
            `torch.func.grad` returns for a sum, is left alone and its update returned in
            a new tensor); with `inplace=False` no input is mutated. `inplace` must be a
            bool, and the gradients floating point.
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]

    def check_state(
        self, state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str
    ) -> None:
        """Validates `state` for params `(leaves, spec)` from metadata only.

        Used by [`aadl_func.anderson()`][aadl_func.anderson] before any buffer is written. The
        built-in optimizers check the state's type and every field (counter, buffers' structure,
        shapes, dtypes and devices); an `InnerOptimizer` built from other functions checks nothing.

        Raises:
            TypeError: `state` is another optimizer's state, or a field has the wrong type
                or dtype.
            ValueError: a field's structure, shape or device does not fit the params, or the
                state was made with other options (e.g. without momentum).
        """
        check = getattr(self.update, "check_state", None)
        if check is not None:
            check(state, leaves, spec, name=name, owner=owner)

    def check_values(self, state: Any, *, count: int | None, name: str, owner: str) -> None:
        """Validates the values of a `state` that passed `check_state()` and comes from
        outside (a checkpoint): `0 <= count <= 2**53` and, when the state is kept by
        [`aadl_func.anderson()`][aadl_func.anderson], equal to its `count` (both advance together);
        [`adam()`][aadl_func.adam] / [`adamw()`][aadl_func.adamw]: `exp_avg_sq >= 0` (NaN passes: it
        is a possible result of a run, a negative value is not). Reads values (one pass over the
        second moments), so [`aadl_func.anderson()`][aadl_func.anderson] calls it once per state
        from outside, never on its own states. An `InnerOptimizer` built from other functions checks
        nothing."""
        check = getattr(self.update, "check_values", None)
        if check is not None:
            check(state, count=count, name=name, owner=owner)


class SgdState(NamedTuple):
    """State of [`sgd()`][aadl_func.sgd].

    Attributes:
        count: 0-d `int64` tensor, the number of updates done so far.
        momentum_buffer: pytree shaped like the parameters holding the momentum buffers
            $b$ (same dtype, device and memory format as the parameters; the
            `trace()` stage's), or `()` when
            `momentum == 0` (no parameter-sized memory is kept then).
    """

    count: Tensor
    momentum_buffer: PyTree = ()


class AdamState(NamedTuple):
    """State of [`adam()`][aadl_func.adam] and [`adamw()`][aadl_func.adamw].

    Attributes:
        count: 0-d `int64` tensor, the number of updates done so far ($t - 1$ during
            update $t$).
        exp_avg: pytree shaped like the parameters, first moment estimates $m$.
        exp_avg_sq: pytree shaped like the parameters, second moment estimates $v$
            (both the `scale_by_adam()` stage's).
    """

    count: Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree


allow_weights_only(SgdState, AdamState)


# --------------------------------------------------------------------------------------------
# An optimizer from a chain of stages.
# --------------------------------------------------------------------------------------------


def _value_at(fn: str, name: str, hyper: ScalarOrSchedule, count: Tensor) -> float | Tensor:
    """The hyperparameter's value for the update after `count` updates: numbers and tensors
    as they are, a schedule called with `count` as a float64 0-d tensor (and its value
    checked)."""
    if isinstance(hyper, (float, Tensor)):
        return hyper
    return check_schedule_value(fn, name, hyper(count.to(torch.float64)), count)


def _is_zero(hyper: ScalarOrSchedule) -> bool:
    """Statically zero: a number 0 (a tensor or schedule may change, so it is never zero)."""
    return isinstance(hyper, float) and hyper == 0.0


def _zero_count(leaves: list[Tensor]) -> Tensor:
    # `new_zeros` of a (possibly vmapped) parameter gives a counter batched like it, so that
    # `vmap(init)` returns one independent, writable counter per ensemble member.
    if leaves:
        return leaves[0].new_zeros((), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)


def _optimizer(
    fn: str,
    state_type: type,
    stages: list[Transform],
    lr: ScalarOrSchedule,
    weight_decay: ScalarOrSchedule,
    check_state: Callable[..., None],
    known_rule: Callable[..., tuple | None] | None = None,
) -> InnerOptimizer:
    """The torchopt protocol around `chain(*stages)`, over the leaves of the pytrees
    (`known_rule`: see `_Stages`).

    The state is a `state_type`: the update count, shared by the stages, then the stages'
    buffers as pytrees, field after field in chain order (fields no stage has keep their
    defaults). `update` evaluates `lr` and `weight_decay` before any stage runs, and
    asks for params when `weight_decay` is not the number 0.
    """
    transform = chain(*stages)
    # The stages' state types, read from an init on no leaves (which allocates nothing), and
    # the run of the public state's fields each one takes.
    layout, names = [], []
    for stage_state in transform.init([]):
        fields = type(stage_state)._fields
        layout.append((type(stage_state)._make, len(names), len(names) + len(fields)))
        names.extend(fields)
    if tuple(names) != state_type._fields[1 : 1 + len(names)]:
        raise AssertionError(f"{fn}: the stages' fields {names} do not fit {state_type}")
    paths = [f"state.{name}" for name in names]
    needs_params = not _is_zero(weight_decay)
    stages = _Stages(
        fn, state_type, transform, layout, lr, weight_decay if needs_params else None, known_rule
    )

    def init(params: PyTree) -> Any:
        leaves, spec = tree.flatten(params, "params", owner=fn)
        check_floating_leaves(fn, "params", leaves, spec)
        return _pack(state_type, spec, _zero_count(leaves), transform.init(leaves))

    def update(
        updates: PyTree, state: Any, params: PyTree | None = None, inplace: bool = True
    ) -> tuple[PyTree, Any]:
        if not isinstance(state, state_type):
            check_state_type(fn, state, state_type, "state", fn)
        check_bool(fn, "inplace", inplace)
        grads, spec = tree.flatten(updates, "updates", owner=fn)
        # Hyperparameters first: a schedule that fails must fail before a buffer is written.
        count = state.count
        step_lr, decay = stages.hyperparameters(count)
        param_leaves = None
        if needs_params:
            if params is None:
                raise ValueError(f"{fn}: `params` are required when `weight_decay` != 0")
            param_leaves = flatten_like(fn, "params", params, spec)
            check_update_shapes(fn, grads, spec, ["params"], [param_leaves])
        buffers = [flatten_like(fn, path, b, spec) for path, b in zip(paths, state[1:])]
        check_update_shapes(fn, grads, spec, paths, buffers)
        grads = _grads_to_write(fn, grads, spec, inplace)
        step = StepInputs(count, param_leaves, step_lr, decay, inplace)
        new_updates, new_state = stages.run(grads, buffers, spec, step)
        if inplace:  # torchopt's semantics: the gradient buffers hold the returned updates
            new_updates = [u if u is g else g.copy_(u) for g, u in zip(grads, new_updates)]
        return optree.tree_unflatten(spec, new_updates), new_state

    def check_values(state: Any, *, count: int | None, name: str, owner: str) -> None:
        _check_values(paths, state, count, name, owner)

    update.check_state = check_state  # type: ignore[attr-defined]
    update.check_values = check_values  # type: ignore[attr-defined]
    update.update_leaves = stages.update_leaves  # type: ignore[attr-defined]
    update.bind_leaves = stages.bind_leaves  # type: ignore[attr-defined]
    # Whether an in-place update writes state buffers (momentum, moments), not only the
    # gradient buffers: anderson's in-place step then asks for it out of place (atomic.py).
    update.writes_state = bool(names)  # type: ignore[attr-defined]
    return InnerOptimizer(init=init, update=update)


class _Stages(NamedTuple):
    """What an optimizer's update runs once its inputs are checked, shared by `update` and
    `update_leaves`: the chain of stages, the public state's type and the run of its fields
    each stage takes (`layout`), and the hyperparameters (`weight_decay` None when no stage
    reads the params). `known_rule`: the whole chain's out-of-place update for a known
    count, `known_rule(grads, *buffers, done) -> (updates, *buffers)` or None (a leaf it
    does not take), which `update_leaves` runs instead of the stages (Adam's,
    `transforms.adam_leaves()`: the same operations without the chain's protocol, which an
    optimizer step of a small model notices)."""

    fn: str
    state_type: type
    transform: Transform
    layout: list
    lr: ScalarOrSchedule
    weight_decay: ScalarOrSchedule | None
    known_rule: Callable[..., tuple | None] | None = None

    def hyperparameters(self, count: Tensor) -> tuple[float | Tensor, float | Tensor]:
        """`(lr, weight_decay)` for the update after `count` updates (schedules called)."""
        step_lr = _value_at(self.fn, "lr", self.lr, count)
        if self.weight_decay is None:
            return step_lr, 0.0
        return step_lr, _value_at(self.fn, "weight_decay", self.weight_decay, count)

    def run(
        self, grads: list[Tensor], buffers: list[list[Tensor]], spec: Any, step: StepInputs
    ) -> tuple[list[Tensor], Any]:
        """The stages on the leaves (`buffers`: the state's fields' leaves, in order): the
        update leaves and the new public state."""
        stage_states = tuple([make(buffers[start:end]) for make, start, end in self.layout])
        new_updates, stage_states = self.transform.update(grads, stage_states, step)
        return new_updates, _pack(self.state_type, spec, step.count + 1, stage_states)

    def update_leaves(
        self, grads: list[Tensor], state: Any, params: list[Tensor], spec: Any
    ) -> tuple[list[Tensor], Any] | None:
        """`update(..., inplace=False)` on the leaves of params and grads a caller checked
        already (anderson's steady call: same shapes, float, no shared memory): the update
        leaves and the new state, by the same operations. The state's buffers are still
        matched to the grads (a buffer replaced since would broadcast), else None."""
        buffers = [optree.tree_leaves(b, none_is_leaf=False) for b in state[1:]]
        shapes = [g.shape for g in grads]
        if any([b.shape for b in leaves] != shapes for leaves in buffers):
            return None
        count = state.count
        if self.known_rule is not None:
            done = tree.static_value(count)
            out = None if done is None else self.known_rule(grads, *buffers, done)
            if out is not None:
                fields = [optree.tree_unflatten(spec, leaves) for leaves in out[1:]]
                return out[0], self.state_type(count + 1, *fields)
        step_lr, decay = self.hyperparameters(count)
        reads_params = self.weight_decay is not None
        step = StepInputs(count, params if reads_params else None, step_lr, decay, False)
        return self.run(grads, buffers, spec, step)

    def bind_leaves(self, state: Any, params: list[Tensor], spec: Any) -> BoundRule | None:
        """The known rule bound to `state`'s buffers (`inner_bound.bind()`), for a caller
        that tracks them between calls (anderson's steady plan); None without a rule or
        for a state it does not fit."""
        if self.known_rule is None:
            return None
        return inner_bound.bind(self.known_rule, self.state_type, state, params, spec)


def check_update_shapes(
    fn: str, grads: list[Tensor], spec: Any, names: list[str], trees: list[list[Any]]
) -> None:
    """Each tensor of the `trees` (leaves of the state buffers, or of `params`, named by
    `names`) has its update's shape, checked before any buffer is written: an update of
    another shape would broadcast into the buffers, or fail after some of them were
    written."""
    shapes = [g.shape for g in grads]
    for name, leaves in zip(names, trees):
        found = [getattr(leaf, "shape", shape) for leaf, shape in zip(leaves, shapes)]
        if found == shapes:
            continue
        i = next(i for i, (got, shape) in enumerate(zip(found, shapes)) if got != shape)
        hint = "" if name == "params" else "; was the state made for other params?"
        raise ValueError(
            f"{fn}: `{tree.leaf_path(spec, i, 'updates')}` has shape {tuple(shapes[i])}, "
            f"expected {tuple(found[i])} like `{tree.leaf_path(spec, i, name)}`{hint}"
        )


def _grads_to_write(fn: str, grads: list[Tensor], spec: Any, inplace: bool) -> list[Tensor]:
    """The gradient leaves the stages start from, checked before any buffer is written: each
    is floating-point or complex (an integer one would be truncated by the in-place stages,
    or fail halfway, after the state was written). In place, a leaf that cannot hold its
    update (`holds_updates()`) is replaced by a copy, which the update is written into and
    returned: the caller's tensor is left as it was, and the state is written as usual."""
    check_floating_leaves(fn, "updates", grads, spec)
    if not inplace:
        return grads
    return [
        g if holds_updates(g) else g.clone(memory_format=torch.contiguous_format) for g in grads
    ]


def holds_updates(t: Tensor) -> bool:
    """Whether the gradient leaf `t` can be written in place with its update (torchopt's
    `inplace=True`): not when two of its elements share memory, as in an `expand`-ed
    tensor (`torch.func.grad` returns one for a sum or a mean), which torch refuses to write
    (a zero stride), or an overlapping `as_strided` view, where the update would be written
    once per alias. From the shape and strides only (no tensor op for a dense or sliced
    layout), so it also runs under `torch.func.vmap` and `torch.compile`."""
    if t.is_contiguous():
        return True
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        return False
    return not self_overlapping(t)


def _check_values(paths: list[str], state: Any, count: int | None, name: str, owner: str) -> None:
    """The values of an inner state from outside (`paths`: its buffers' names): its `count`
    in `[0, 2**53]` and equal to `count` (the Anderson state's, if given), and Adam's second
    moments `>= 0`. Nothing is read on an accelerator or under a transform."""
    done = tree.static_value(state.count)
    if done is None:
        return  # on an accelerator or transformed: nothing read
    if not 0 <= done <= 2**53 or (count is not None and done != count):
        expected = f"equal to `state.count` ({count})" if count is not None else "in [0, 2**53]"
        raise ValueError(
            f"{owner}: `{name}.count` is {done}, expected {expected}; was the state saved "
            "by this optimizer and loaded unchanged?"
        )
    for path, buffers in zip(paths, state[1:]):
        if path.endswith("exp_avg_sq"):
            leaves, b_spec = tree.flatten(buffers, path)
            for i, v in enumerate(leaves):
                real = torch.view_as_real(v) if v.is_complex() else v
                if v.numel() and bool((real < 0).any()):
                    where = tree.leaf_path(b_spec, i, f"{name}.exp_avg_sq")
                    raise ValueError(
                        f"{owner}: `{where}` has negative entries; Adam's second moment "
                        "is >= 0 (was the state saved by this optimizer and loaded "
                        "unchanged?)"
                    )


def _pack(state_type: type, spec: Any, count: Tensor, stage_states: tuple) -> Any:
    """The public state: `count`, then the stages' buffers as pytrees, in order."""
    fields = [optree.tree_unflatten(spec, leaves) for s in stage_states for leaves in s]
    return state_type(count, *fields)


# --------------------------------------------------------------------------------------------
# The aliases.
# --------------------------------------------------------------------------------------------


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: ScalarOrSchedule = 0.0,
) -> InnerOptimizer:
    r"""Stochastic gradient descent, step for step equal to `torch.optim.SGD`.

    With gradient $g_t$, parameters $\theta_{t-1}$, learning rate $\gamma_t$,
    weight decay $\lambda_t$, momentum $\mu$ and dampening $\tau$, update
    $t = 1, 2, \dots$ computes

    $$
    d_t &= g_t + \lambda_t \theta_{t-1} \\
    b_t &= d_t \text{ if } t = 1 \text{ else } \mu b_{t-1} + (1 - \tau) d_t \\
    d_t &\leftarrow d_t + \mu b_t \text{ (nesterov) or } b_t \text{ (otherwise; only if }
        \mu \neq 0) \\
    \Delta_t &= -\gamma_t d_t
    $$

    and returns $\Delta_t$ (`theta_t = theta_{t-1} + Delta_t`). The first-step case
    is selected with `torch.where` on `state.count` (no Python branching on tensors), so
    the update works under `torch.func.vmap()`. With a schedule,
    $\gamma_t = \mathrm{lr}(t - 1)$, the value `torch.optim.lr_scheduler.LambdaLR`
    gives update $t$ with `lr_lambda = lambda epoch: lr(epoch) / base_lr`.

    Args:
        lr: learning rate $\gamma \ge 0$: a number, a 0-d tensor or a schedule
            `count -> value` (see the module docstring).
        momentum: momentum factor $\mu \ge 0$. With `0` no momentum buffer is stored.
        dampening: dampening $\tau \ge 0$ of the momentum.
        nesterov: use Nesterov momentum; requires `momentum > 0` and `dampening == 0`.
        weight_decay: L2 penalty $\lambda \ge 0$ (added to the gradient): a number, a
            0-d tensor or a schedule.

    Returns:
        An `InnerOptimizer` whose state is an `SgdState`. `update` needs
        `params` only when `weight_decay` is not the number 0.

    Raises:
        TypeError: a hyperparameter is not a real number (`lr`, `weight_decay`: nor a 0-d
            real tensor or a callable; `nesterov`: not a bool).
        ValueError: a hyperparameter is negative or not finite, or `nesterov` is set with
            `momentum <= 0` or `dampening != 0`.
    """
    fn = "sgd"
    lr = check_hyperparameter(fn, "lr", lr)
    momentum = check_non_negative(fn, "momentum", momentum)
    dampening = check_non_negative(fn, "dampening", dampening)
    weight_decay = check_hyperparameter(fn, "weight_decay", weight_decay)
    nesterov = check_nesterov(fn, nesterov, momentum, dampening)
    use_momentum = momentum != 0.0

    def check_state(state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str) -> None:
        check_state_type(fn, state, SgdState, name, owner)
        buffers = state.momentum_buffer
        empty = isinstance(buffers, tuple) and len(buffers) == 0
        if not use_momentum and not empty:
            raise ValueError(
                f"{owner}: `{name}.momentum_buffer` holds buffers but this sgd has momentum=0; "
                "was it made by another configuration?"
            )
        if use_momentum and leaves:
            if empty:
                raise ValueError(
                    f"{owner}: `{name}.momentum_buffer` is empty but this sgd has "
                    f"momentum={momentum}; was it made by another configuration?"
                )
            check_buffers(buffers, f"{name}.momentum_buffer", leaves, spec, owner)

    stages = []
    if not _is_zero(weight_decay):
        stages.append(add_decayed_weights())
    if use_momentum:
        stages.append(trace(momentum, dampening, nesterov))
    stages.append(scale_by_learning_rate())
    optimizer = _optimizer(fn, SgdState, stages, lr, weight_decay, check_state)
    if not use_momentum and _is_zero(weight_decay):  # the update: the grads times a number
        scale = functools.partial(_gradient_scale, fn, lr)
        optimizer.update.gradient_scale = scale  # type: ignore[attr-defined]
    return optimizer


def _gradient_scale(fn: str, lr: ScalarOrSchedule, state: Any) -> tuple[float, SgdState] | None:
    r"""Plain SGD's next update as one number, for a caller that forms it itself where it
    reads the grads anyway (anderson's steady call, in its append's pass): `(-lr, new_state)`,
    the update being `grads.mul_(-lr)` (`scale_by_learning_rate()`) and `new_state` the state
    after it, where `lr` at `state`'s count is a Python number; else None (a tensor
    learning rate, or a state of another type: `update` says what is wrong)."""
    if type(state) is not SgdState or not isinstance(state.count, Tensor):
        return None
    step_lr = _value_at(fn, "lr", lr, state.count)
    if type(step_lr) is not float:
        return None
    return -step_lr, SgdState(state.count + 1)


def _adam(
    fn: str,
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: ScalarOrSchedule,
    decoupled: bool,
) -> InnerOptimizer:
    lr = check_hyperparameter(fn, "lr", lr)
    beta1, beta2 = check_betas(fn, betas)
    eps = check_non_negative(fn, "eps", eps)
    weight_decay = check_hyperparameter(fn, "weight_decay", weight_decay)

    def check_state(state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str) -> None:
        check_state_type(fn, state, AdamState, name, owner)
        check_buffers(state.exp_avg, f"{name}.exp_avg", leaves, spec, owner)
        check_buffers(state.exp_avg_sq, f"{name}.exp_avg_sq", leaves, spec, owner)

    decay = [] if _is_zero(weight_decay) else [add_decayed_weights(decoupled=decoupled)]
    if decoupled:  # AdamW: the decay after the scaling, by the learning rate
        stages = [scale_by_adam(beta1, beta2, eps), *decay]
    else:  # Adam: an L2 penalty added to the gradient
        stages = [*decay, scale_by_adam(beta1, beta2, eps)]
    known_rule = None
    if stages == [stages[-1]] and isinstance(lr, float):  # the scaling alone, a fixed lr
        known_rule = functools.partial(adam_leaves, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    return _optimizer(fn, AdamState, stages, lr, weight_decay, check_state, known_rule)


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
) -> InnerOptimizer:
    r"""Adam, step for step equal to `torch.optim.Adam` (`amsgrad=False`).

    With gradient $g_t$, parameters $\theta_{t-1}$, learning rate $\gamma$,
    betas $(\beta_1, \beta_2)$ and weight decay $\lambda$ (an L2 penalty added to
    the gradient), update $t = 1, 2, \dots$ computes

    $$
    g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
    m_t &= m_{t-1} + (1 - \beta_1)(g_t - m_{t-1}) \\
    v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
    \Delta_t &= -\frac{\gamma}{1 - \beta_1^t} \, m_t \Big/
        \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)
    $$

    and returns $\Delta_t$ (`theta_t = theta_{t-1} + Delta_t`). The bias corrections
    are computed from `state.count` with float64 tensor operations (no `.item()`), so the
    update works under `torch.func.vmap()`. Complex parameters are handled as pairs of
    reals, like `torch.optim`.

    Args:
        lr: learning rate $\gamma \ge 0$: a number, a 0-d tensor or a schedule
            `count -> value` (see the module docstring).
        betas: $(\beta_1, \beta_2)$, each in $[0, 1)$.
        eps: $\epsilon \ge 0$ added to the denominator.
        weight_decay: L2 penalty $\lambda \ge 0$: a number, a 0-d tensor or a schedule.

    Returns:
        An `InnerOptimizer` whose state is an `AdamState`. `update` needs
        `params` only when `weight_decay` is not the number 0.

    Raises:
        TypeError: a hyperparameter is not a real number (`lr`, `weight_decay`: nor a 0-d
            real tensor or a callable), or `betas` is not a pair.
        ValueError: a hyperparameter is out of range (negative, not finite, beta not in
            $[0, 1)$).
    """
    return _adam("adam", lr, betas, eps, weight_decay, decoupled=False)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-2,
) -> InnerOptimizer:
    r"""AdamW, step for step equal to `torch.optim.AdamW` (`amsgrad=False`).

    Adam with decoupled weight decay: the parameters are shrunk by $1 - \gamma\lambda$
    before the Adam step, and the decay never enters the moments:

    $$
    m_t &= m_{t-1} + (1 - \beta_1)(g_t - m_{t-1}) \\
    v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
    \Delta_t &= -\gamma\lambda\,\theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \, m_t \Big/
        \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)
    $$

    so that `theta_t = theta_{t-1} + Delta_t = (1 - lr * wd) * theta_{t-1} + adam_step`.

    Args:
        lr: learning rate $\gamma \ge 0$: a number, a 0-d tensor or a schedule
            `count -> value` (see the module docstring); the decay uses the same
            $\gamma_t$, as `torch.optim.AdamW` under an LR scheduler does.
        betas: $(\beta_1, \beta_2)$, each in $[0, 1)$.
        eps: $\epsilon \ge 0$ added to the denominator.
        weight_decay: decoupled weight decay $\lambda \ge 0$: a number, a 0-d tensor
            or a schedule.

    Returns:
        An `InnerOptimizer` whose state is an `AdamState`. `update` needs
        `params` whenever `weight_decay` is not the number 0 (the default is 1e-2).

    Raises:
        TypeError: a hyperparameter is not a real number (`lr`, `weight_decay`: nor a 0-d
            real tensor or a callable), or `betas` is not a pair.
        ValueError: a hyperparameter is out of range (negative, not finite, beta not in
            $[0, 1)$).
    """
    return _adam("adamw", lr, betas, eps, weight_decay, decoupled=True)

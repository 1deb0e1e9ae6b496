"""Functional inner optimizers in the torchopt protocol.

Every optimizer here is a pair of pure functions bundled in an :class:`InnerOptimizer`:

* ``init(params) -> state``
* ``update(updates, state, params=None, inplace=True) -> (updates, new_state)``

``params`` and ``updates`` (the gradients on input) are arbitrary pytrees of tensors (dicts,
tuples, lists, nested; traversed with :mod:`optree`, ``None`` is *not* a leaf). The returned
``updates`` are the deltas to **add** to the parameters, ``new_params = params + updates``,
exactly like ``torchopt.apply_updates``.

The optimizers reproduce :class:`torch.optim.SGD`, :class:`torch.optim.Adam` and
:class:`torch.optim.AdamW` (default single-tensor implementation: not fused, not capturable,
``maximize=False``, ``amsgrad=False``) operation for operation, so that after
``params + updates`` the results agree with ``torch.optim`` up to the final rounding of that
addition (``torch.optim`` fuses it into the parameter update).

All states are :class:`typing.NamedTuple` s that hold only tensors (the step counter is a 0-d
``int64`` tensor on the parameters' device), and no hyperparameter logic branches on tensor
values, so ``init`` and ``update`` compose with :func:`torch.func.vmap` (ensembles of models),
and with ``inplace=False`` with :func:`torch.func.grad` / :func:`torch.func.jvp` as well.

Schedules. ``lr`` and ``weight_decay`` take, besides a number, a 0-d tensor (read at every
update: in-place changes take effect, and under ``vmap`` a batched one gives every member its
own value) or a schedule ``count -> value`` (optax's and torchopt's ``ScalarOrSchedule``). A
schedule is called at every update with ``count``, the number of updates done so far (0 on the
first), read from the state: a scheduled run is a pure function of its state, so it saves and
resumes bit-identically. ``count`` is a 0-d float64 tensor on the parameters' device, so that
schedule arithmetic such as ``0.5 ** (count // 30)`` or ``(count + 1) / 100`` runs in float64
like ``torch.optim``'s Python floats (an int64 tensor would compute in float32). The value may
be a Python number or a 0-d tensor. The other hyperparameters (``momentum``, ``dampening``,
``nesterov``, ``betas``, ``eps``) are numbers only, as in optax and torchopt: they decide the
state's layout and are validated once, at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.validation import (
    check_betas,
    check_buffers,
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
    "sgd",
]

PyTree = Any
#: A hyperparameter: a number, a 0-d tensor, or a schedule ``count -> number or 0-d tensor``.
ScalarOrSchedule = float | Tensor | Callable[[Tensor], float | Tensor]

_REDUCED_FLOAT_DTYPES = (torch.float16, torch.bfloat16)


class InnerOptimizer(NamedTuple):
    """A functional optimizer: a pair of pure functions (torchopt's ``GradientTransformation``).

    Attributes:
        init: ``init(params) -> state``. Builds the optimizer state for a pytree of parameter
            tensors.
        update: ``update(updates, state, params=None, inplace=True) -> (updates, new_state)``.
            Maps gradients ``updates`` (same pytree structure as ``params``) to the parameter
            deltas, so that ``new_params = params + updates`` leaf by leaf. With
            ``inplace=True`` the gradient and state buffers may be overwritten and reused;
            with ``inplace=False`` no input is mutated.
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]

    def check_state(
        self, state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str
    ) -> None:
        """Validates ``state`` for params ``(leaves, spec)`` from metadata only.

        Used by :func:`aadl_func.anderson` before any buffer is written. The built-in optimizers
        check the state's type and every field (counter, buffers' structure, shapes, dtypes and
        devices); an :class:`InnerOptimizer` built from other functions checks nothing.

        Raises:
            TypeError: ``state`` is another optimizer's state, or a field has the wrong type
                or dtype.
            ValueError: a field's structure, shape or device does not fit the params, or the
                state was made with other options (e.g. without momentum).
        """
        check = getattr(self.update, "check_state", None)
        if check is not None:
            check(state, leaves, spec, name=name, owner=owner)


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: 0-d ``int64`` tensor, the number of updates done so far.
        momentum_buffer: pytree shaped like the parameters holding the momentum buffers
            :math:`b` (same dtype, device and memory format as the parameters), or ``()``
            when ``momentum == 0`` (no parameter-sized memory is kept then).
    """

    count: Tensor
    momentum_buffer: PyTree


class AdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`.

    Attributes:
        count: 0-d ``int64`` tensor, the number of updates done so far (:math:`t - 1` during
            update :math:`t`).
        exp_avg: pytree shaped like the parameters, first moment estimates :math:`m`.
        exp_avg_sq: pytree shaped like the parameters, second moment estimates :math:`v`.
    """

    count: Tensor
    exp_avg: PyTree
    exp_avg_sq: PyTree


# Let users ``torch.load(..., weights_only=True)`` saved states without registering anything.
if hasattr(torch.serialization, "add_safe_globals"):  # torch >= 2.4
    torch.serialization.add_safe_globals([SgdState, AdamState])


# --------------------------------------------------------------------------------------------
# Hyperparameters.
# --------------------------------------------------------------------------------------------


def _value_at(fn: str, name: str, hyper: ScalarOrSchedule, count: Tensor) -> float | Tensor:
    """The hyperparameter's value for the update after ``count`` updates: numbers and tensors
    as they are, a schedule called with ``count`` as a float64 0-d tensor (and its value
    checked)."""
    if isinstance(hyper, (float, Tensor)):
        return hyper
    return check_schedule_value(fn, name, hyper(count.to(torch.float64)), count)


def _is_zero(hyper: ScalarOrSchedule) -> bool:
    """Statically zero: a number 0 (a tensor or schedule may change, so it is never zero)."""
    return isinstance(hyper, float) and hyper == 0.0


def _add_scaled(x: Tensor, y: Tensor, scale: float | Tensor, inplace: bool) -> Tensor:
    """``x + scale * y``; with a tensor ``scale`` in one fused kernel, like ``alpha=``."""
    if isinstance(scale, float):
        return x.add_(y, alpha=scale) if inplace else x.add(y, alpha=scale)
    # addcmul_ has no vmap batching rule: out of place, then written back.
    out = torch.addcmul(x, y, scale)
    return x.copy_(out) if inplace else out


# --------------------------------------------------------------------------------------------
# Pytree helpers.
# --------------------------------------------------------------------------------------------


def _flatten_params(fn: str, params: PyTree) -> tuple[list[Tensor], Any]:
    return tree.flatten(params, "params", owner=fn)


def _zero_count(leaves: list[Tensor]) -> Tensor:
    # ``new_zeros`` of a (possibly vmapped) parameter gives a counter batched like it, so that
    # ``vmap(init)`` returns one independent, writable counter per ensemble member.
    if leaves:
        return leaves[0].new_zeros((), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    # torch.optim's kernels do the arithmetic of half / bfloat16 tensors with python scalars in
    # float32; float32 and float64 are computed in their own precision.
    return torch.float32 if dtype in _REDUCED_FLOAT_DTYPES else dtype


# --------------------------------------------------------------------------------------------
# SGD.
# --------------------------------------------------------------------------------------------


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: ScalarOrSchedule = 0.0,
) -> InnerOptimizer:
    r"""Stochastic gradient descent, step for step equal to :class:`torch.optim.SGD`.

    With gradient :math:`g_t`, parameters :math:`\theta_{t-1}`, learning rate :math:`\gamma_t`,
    weight decay :math:`\lambda_t`, momentum :math:`\mu` and dampening :math:`\tau`, update
    :math:`t = 1, 2, \dots` computes

    .. math::

        d_t &= g_t + \lambda_t \theta_{t-1} \\
        b_t &= d_t \text{ if } t = 1 \text{ else } \mu b_{t-1} + (1 - \tau) d_t \\
        d_t &\leftarrow d_t + \mu b_t \text{ (nesterov) or } b_t \text{ (otherwise; only if }
            \mu \neq 0) \\
        \Delta_t &= -\gamma_t d_t

    and returns :math:`\Delta_t` (``theta_t = theta_{t-1} + Delta_t``). The first-step case
    is selected with ``torch.where`` on ``state.count`` (no Python branching on tensors), so
    the update works under :func:`torch.func.vmap`. With a schedule,
    :math:`\gamma_t = \mathrm{lr}(t - 1)`, the value ``torch.optim.lr_scheduler.LambdaLR``
    gives update :math:`t` with ``lr_lambda = lambda epoch: lr(epoch) / base_lr``.

    Args:
        lr: learning rate :math:`\gamma \ge 0`: a number, a 0-d tensor or a schedule
            ``count -> value`` (see the module docstring).
        momentum: momentum factor :math:`\mu \ge 0`. With ``0`` no momentum buffer is stored.
        dampening: dampening :math:`\tau \ge 0` of the momentum.
        nesterov: use Nesterov momentum; requires ``momentum > 0`` and ``dampening == 0``.
        weight_decay: L2 penalty :math:`\lambda \ge 0` (added to the gradient): a number, a
            0-d tensor or a schedule.

    Returns:
        An :class:`InnerOptimizer` whose state is an :class:`SgdState`. ``update`` needs
        ``params`` only when ``weight_decay`` is not the number 0.

    Raises:
        TypeError: a hyperparameter is not a real number (``lr``, ``weight_decay``: nor a 0-d
            real tensor or a callable; ``nesterov``: not a bool).
        ValueError: a hyperparameter is negative or not finite, or ``nesterov`` is set with
            ``momentum <= 0`` or ``dampening != 0``.
    """
    fn = "sgd"
    lr = check_hyperparameter(fn, "lr", lr)
    momentum = check_non_negative(fn, "momentum", momentum)
    dampening = check_non_negative(fn, "dampening", dampening)
    weight_decay = check_hyperparameter(fn, "weight_decay", weight_decay)
    nesterov = check_nesterov(fn, nesterov, momentum, dampening)
    use_momentum = momentum != 0.0
    use_weight_decay = not _is_zero(weight_decay)

    def init(params: PyTree) -> SgdState:
        leaves, spec = _flatten_params(fn, params)
        if use_momentum:
            bufs = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
            momentum_buffer = optree.tree_unflatten(spec, bufs)
        else:
            momentum_buffer = ()
        return SgdState(count=_zero_count(leaves), momentum_buffer=momentum_buffer)

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

    def update(
        updates: PyTree,
        state: SgdState,
        params: PyTree | None = None,
        inplace: bool = True,
    ) -> tuple[PyTree, SgdState]:
        if not isinstance(state, SgdState):
            check_state_type(fn, state, SgdState, "state", fn)
        grads, spec = tree.flatten(updates, "updates", owner=fn)
        # Hyperparameters first: a schedule that fails must fail before a buffer is written.
        step_lr = _value_at(fn, "lr", lr, state.count)
        decay = _value_at(fn, "weight_decay", weight_decay, state.count)
        if use_weight_decay:
            if params is None:
                raise ValueError(f"{fn}: `params` are required when `weight_decay` != 0")
            param_leaves = flatten_like(fn, "params", params, spec)
        else:
            param_leaves = [None] * len(grads)
        if use_momentum:
            bufs = flatten_like(fn, "state.momentum_buffer", state.momentum_buffer, spec)
            # Eagerly (a concrete CPU counter) the first-step case is known and only its branch
            # is computed; under a transform both are blended with torch.where.
            count = tree.static_value(state.count)
            first = None if count is None else count == 0
            not_first = state.count != 0 if first is None else None
        else:
            bufs = [None] * len(grads)
            first = not_first = None

        new_updates, new_bufs = [], []
        for g, p, buf in zip(grads, param_leaves, bufs, strict=True):
            out = g
            # d_p = g + wd * p
            d_p = _add_scaled(g, p, decay, inplace) if use_weight_decay else g
            if use_momentum:
                # buf = d_p on the first step, else momentum * buf + (1 - dampening) * d_p
                # (the buffer keeps its own memory format: ``blended`` first in ``where``, or a
                # copy into a buffer laid out like it)
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
                    if inplace:
                        d_p = d_p.add_(new_buf, alpha=momentum)
                    else:
                        d_p = d_p.add(new_buf, alpha=momentum)
                elif inplace:
                    d_p = out.copy_(new_buf)  # never scale the momentum buffer itself
                else:
                    d_p = new_buf
            # Delta = -lr * d_p
            if inplace:
                if d_p is not out:
                    d_p = out.copy_(d_p)
                new_updates.append(d_p.mul_(-step_lr))
            else:
                new_updates.append(d_p.mul(-step_lr))

        new_state = SgdState(
            count=state.count + 1,
            momentum_buffer=optree.tree_unflatten(spec, new_bufs) if use_momentum else (),
        )
        return optree.tree_unflatten(spec, new_updates), new_state

    update.check_state = check_state  # type: ignore[attr-defined]
    return InnerOptimizer(init=init, update=update)


# --------------------------------------------------------------------------------------------
# Adam / AdamW.
# --------------------------------------------------------------------------------------------


def _adam_leaf(
    g: Tensor,
    p: Tensor | None,
    m: Tensor,
    v: Tensor,
    neg_step_size: float | Tensor,
    bias_correction2_sqrt: float | Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float | Tensor | None,
    decoupled_decay: float | Tensor | None,
    inplace: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    out = g
    if weight_decay is not None:  # L2 penalty (Adam): g = g + wd * p
        g = _add_scaled(g, p, weight_decay, inplace)

    is_complex = torch.is_complex(g)
    if is_complex:  # like torch.optim: complex numbers are treated as pairs of reals
        g, m, v = torch.view_as_real(g), torch.view_as_real(m), torch.view_as_real(v)

    # m = m + (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
    if inplace and not tree.is_transformed(m):
        m = m.lerp_(g, 1.0 - beta1)
        v = v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    elif inplace:
        # lerp_ / addcmul_ have no vmap batching rules (slow fallback + warning): compute out
        # of place with the same kernels and write back into the state buffers.
        m = m.copy_(torch.lerp(m, g, 1.0 - beta1))
        v = v.copy_(torch.addcmul(v.mul_(beta2), g, g, value=1.0 - beta2))
    else:
        m = torch.lerp(m, g, 1.0 - beta1)
        v = torch.addcmul(v.mul(beta2), g, g, value=1.0 - beta2)

    dtype = v.dtype
    opmath = _opmath(dtype)
    reduced = opmath != dtype  # half precision computes the scalings in float32

    def widened(t: Tensor) -> Tensor:
        return t.to(opmath) if reduced else t

    def scalar(x: float | Tensor) -> float | Tensor:
        return x if isinstance(x, float) else x.to(opmath)

    # denom = sqrt(v) / sqrt(1 - beta2^t) + eps
    # (out of place: sqrt's backward needs its output when the update is differentiated)
    denom = torch.div(widened(v.sqrt()), scalar(bias_correction2_sqrt))
    denom = (denom.to(dtype) if reduced else denom).add_(eps)
    # Delta = (-lr / (1 - beta1^t) * m) / denom
    step = torch.mul(widened(m), scalar(neg_step_size)).div_(widened(denom))
    step = step.to(dtype) if reduced else step

    if is_complex:
        m, v, step = torch.view_as_complex(m), torch.view_as_complex(v), torch.view_as_complex(step)
    if decoupled_decay is not None:  # AdamW: Delta = Delta - lr * wd * p
        step = _add_scaled(step, p, -decoupled_decay, inplace=True)
    if inplace:
        step = out.copy_(step)
    return step, m, v


def _bias_corrections(
    count: Tensor, beta1: float, beta2: float, lr: float | Tensor
) -> tuple[float | Tensor, float | Tensor]:
    r"""``(-lr / (1 - beta1^t), sqrt(1 - beta2^t))`` for update :math:`t` = ``count + 1``.

    In float64, like the Python floats of torch.optim: as Python floats themselves when the
    counter is a concrete CPU tensor and ``lr`` a number (the eager case; the same arithmetic
    as torch.optim, and no tensor ops), else with tensor ops from the counter (vmap, counters
    on an accelerator, tensor or scheduled-tensor ``lr``). Each leaf casts them to its own
    compute dtype.
    """
    done = tree.static_value(count)
    if done is not None and isinstance(lr, float):
        bias_correction1 = 1.0 - beta1 ** (done + 1)
        bias_correction2 = 1.0 - beta2 ** (done + 1)
        return -(lr / bias_correction1), bias_correction2**0.5
    t = (count + 1).to(torch.float64)
    bias_correction1 = 1.0 - torch.pow(beta1, t)
    bias_correction2 = 1.0 - torch.pow(beta2, t)
    if isinstance(lr, float):
        neg_step_size = -(torch.full_like(bias_correction1, lr) / bias_correction1)
    else:
        neg_step_size = -(lr.to(bias_correction1.device) / bias_correction1)
    return neg_step_size, bias_correction2.sqrt()


def _make_adam(
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
    needs_params = not _is_zero(weight_decay)

    def init(params: PyTree) -> AdamState:
        leaves, spec = _flatten_params(fn, params)
        exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        return AdamState(
            count=_zero_count(leaves),
            exp_avg=optree.tree_unflatten(spec, exp_avg),
            exp_avg_sq=optree.tree_unflatten(spec, exp_avg_sq),
        )

    def check_state(state: Any, leaves: list[Tensor], spec: Any, *, name: str, owner: str) -> None:
        check_state_type(fn, state, AdamState, name, owner)
        check_buffers(state.exp_avg, f"{name}.exp_avg", leaves, spec, owner)
        check_buffers(state.exp_avg_sq, f"{name}.exp_avg_sq", leaves, spec, owner)

    def update(
        updates: PyTree,
        state: AdamState,
        params: PyTree | None = None,
        inplace: bool = True,
    ) -> tuple[PyTree, AdamState]:
        if not isinstance(state, AdamState):
            check_state_type(fn, state, AdamState, "state", fn)
        grads, spec = tree.flatten(updates, "updates", owner=fn)
        # Hyperparameters first: a schedule that fails must fail before a buffer is written.
        step_lr = _value_at(fn, "lr", lr, state.count)
        decay = _value_at(fn, "weight_decay", weight_decay, state.count)
        if needs_params:
            if params is None:
                raise ValueError(f"{fn}: `params` are required when `weight_decay` != 0")
            param_leaves = flatten_like(fn, "params", params, spec)
        else:
            param_leaves = [None] * len(grads)
        ms = flatten_like(fn, "state.exp_avg", state.exp_avg, spec)
        vs = flatten_like(fn, "state.exp_avg_sq", state.exp_avg_sq, spec)

        count = state.count + 1
        neg_step_size, bias_correction2_sqrt = _bias_corrections(state.count, beta1, beta2, step_lr)
        if not needs_params:
            coupled_wd = decoupled_decay = None
        elif decoupled:
            coupled_wd, decoupled_decay = None, step_lr * decay
        else:
            coupled_wd, decoupled_decay = decay, None

        new_updates, new_ms, new_vs = [], [], []
        for g, p, m, v in zip(grads, param_leaves, ms, vs, strict=True):
            step, m, v = _adam_leaf(
                g,
                p,
                m,
                v,
                neg_step_size,
                bias_correction2_sqrt,
                beta1=beta1,
                beta2=beta2,
                eps=eps,
                weight_decay=coupled_wd,
                decoupled_decay=decoupled_decay,
                inplace=inplace,
            )
            new_updates.append(step)
            new_ms.append(m)
            new_vs.append(v)

        new_state = AdamState(
            count=count,
            exp_avg=optree.tree_unflatten(spec, new_ms),
            exp_avg_sq=optree.tree_unflatten(spec, new_vs),
        )
        return optree.tree_unflatten(spec, new_updates), new_state

    update.check_state = check_state  # type: ignore[attr-defined]
    return InnerOptimizer(init=init, update=update)


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
) -> InnerOptimizer:
    r"""Adam, step for step equal to :class:`torch.optim.Adam` (``amsgrad=False``).

    With gradient :math:`g_t`, parameters :math:`\theta_{t-1}`, learning rate :math:`\gamma`,
    betas :math:`(\beta_1, \beta_2)` and weight decay :math:`\lambda` (an L2 penalty added to
    the gradient), update :math:`t = 1, 2, \dots` computes

    .. math::

        g_t &\leftarrow g_t + \lambda \theta_{t-1} \\
        m_t &= m_{t-1} + (1 - \beta_1)(g_t - m_{t-1}) \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \Delta_t &= -\frac{\gamma}{1 - \beta_1^t} \, m_t \Big/
            \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)

    and returns :math:`\Delta_t` (``theta_t = theta_{t-1} + Delta_t``). The bias corrections
    are computed from ``state.count`` with float64 tensor operations (no ``.item()``), so the
    update works under :func:`torch.func.vmap`. Complex parameters are handled as pairs of
    reals, like ``torch.optim``.

    Args:
        lr: learning rate :math:`\gamma \ge 0`: a number, a 0-d tensor or a schedule
            ``count -> value`` (see the module docstring).
        betas: :math:`(\beta_1, \beta_2)`, each in :math:`[0, 1)`.
        eps: :math:`\epsilon \ge 0` added to the denominator.
        weight_decay: L2 penalty :math:`\lambda \ge 0`: a number, a 0-d tensor or a schedule.

    Returns:
        An :class:`InnerOptimizer` whose state is an :class:`AdamState`. ``update`` needs
        ``params`` only when ``weight_decay`` is not the number 0.

    Raises:
        TypeError: a hyperparameter is not a real number (``lr``, ``weight_decay``: nor a 0-d
            real tensor or a callable), or ``betas`` is not a pair.
        ValueError: a hyperparameter is out of range (negative, not finite, beta not in
            :math:`[0, 1)`).
    """
    return _make_adam("adam", lr, betas, eps, weight_decay, decoupled=False)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 1e-2,
) -> InnerOptimizer:
    r"""AdamW, step for step equal to :class:`torch.optim.AdamW` (``amsgrad=False``).

    Adam with decoupled weight decay: the parameters are shrunk by :math:`1 - \gamma\lambda`
    before the Adam step, and the decay never enters the moments:

    .. math::

        m_t &= m_{t-1} + (1 - \beta_1)(g_t - m_{t-1}) \\
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        \Delta_t &= -\gamma\lambda\,\theta_{t-1} - \frac{\gamma}{1 - \beta_1^t} \, m_t \Big/
            \Big(\frac{\sqrt{v_t}}{\sqrt{1 - \beta_2^t}} + \epsilon\Big)

    so that ``theta_t = theta_{t-1} + Delta_t = (1 - lr * wd) * theta_{t-1} + adam_step``.

    Args:
        lr: learning rate :math:`\gamma \ge 0`: a number, a 0-d tensor or a schedule
            ``count -> value`` (see the module docstring); the decay uses the same
            :math:`\gamma_t`, as ``torch.optim.AdamW`` under an LR scheduler does.
        betas: :math:`(\beta_1, \beta_2)`, each in :math:`[0, 1)`.
        eps: :math:`\epsilon \ge 0` added to the denominator.
        weight_decay: decoupled weight decay :math:`\lambda \ge 0`: a number, a 0-d tensor
            or a schedule.

    Returns:
        An :class:`InnerOptimizer` whose state is an :class:`AdamState`. ``update`` needs
        ``params`` whenever ``weight_decay`` is not the number 0 (the default is 1e-2).

    Raises:
        TypeError: a hyperparameter is not a real number (``lr``, ``weight_decay``: nor a 0-d
            real tensor or a callable), or ``betas`` is not a pair.
        ValueError: a hyperparameter is out of range (negative, not finite, beta not in
            :math:`[0, 1)`).
    """
    return _make_adam("adamw", lr, betas, eps, weight_decay, decoupled=True)

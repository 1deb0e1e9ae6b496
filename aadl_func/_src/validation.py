"""Argument checks: each names the argument it rejects.

The first part serves [`aadl_func.anderson()`][aadl_func.anderson] and
[`aadl_func.mix()`][aadl_func.mix]; the second the inner
optimizers (`aadl_func._src.inner`): their hyperparameters, which may be schedules, and
their states. The two families word their messages differently (`docs/errors.md` fixes both).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import optree
import torch
from torch import Tensor

from aadl_func._src import tree

__all__ = [
    "check_int",
    "check_float",
    "check_device",
    "check_dtype",
    "check_choice",
    "check_bool",
    "check_callable",
    "same_device",
    "check_leaf_dtypes",
    "check_leaf_devices",
    "check_devices_like",
    "check_floating_leaves",
    "check_counter",
    "check_non_negative",
    "check_hyperparameter",
    "check_schedule_value",
    "check_betas",
    "check_nesterov",
    "check_state_type",
    "check_buffers",
    "flatten_like",
]


def check_int(owner: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{owner}: `{name}` must be >= {minimum}, got {value}")
    return int(value)


def check_float(
    owner: str, name: str, value: object, *, minimum: float, strict: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: `{name}` must be a real number, got {type(value).__name__}")
    value = float(value)
    bad = not math.isfinite(value) or (value <= minimum if strict else value < minimum)
    if bad:
        relation = ">" if strict else ">="
        raise ValueError(f"{owner}: `{name}` must be finite and {relation} {minimum}, got {value}")
    return value


def check_device(owner: str, name: str, value: object) -> torch.device | None:
    if value is None:
        return None
    try:
        return torch.device(value)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as err:
        raise TypeError(f"{owner}: `{name}` must be None or a torch.device, got {value!r}") from err


def check_dtype(owner: str, name: str, value: object) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{owner}: `{name}` must be None or a floating torch.dtype, got {value!r}")
    return value


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{owner}: `{name}` must be one of {choices}, got {value!r}")
    return value  # type: ignore[return-value]


def check_bool(owner: str, name: str, value: object) -> bool:
    # `inplace=1` or `inplace="yes"` would silently pick a code path; demand a real bool.
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be a bool, got {type(value).__name__}")
    return value


def check_callable(owner: str, name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"{owner}: `{name}` must be callable, got {type(value).__name__}")


def scalar_loss(owner: str, value: object) -> Tensor:
    """`value`, what `loss_fn` returned, if it is a tensor of one element; else a TypeError."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise TypeError(f"{owner}: `loss_fn` must return a scalar tensor")
    return value


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices agree; an index-less device (`"cuda"`) matches any index."""
    if a == b:  # the common case, and a cheap one: this runs per leaf on every step
        return True
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _leaf_name(name: str, index: int, spec: Any) -> str:
    # Key paths are built only here, on the error path (see tree.leaf_path).
    return spec.accessors()[index].codify(name)


def check_leaf_dtypes(
    owner: str,
    name: str,
    leaves: list,
    dtypes: list[torch.dtype],
    expected: str,
    spec: Any,
) -> None:
    """Raises `TypeError` naming the first leaf whose dtype is not expected, by its key path
    in `spec` (the tree spec of `leaves`, with `name` as the root)."""
    for i, (leaf, dtype) in enumerate(zip(leaves, dtypes)):
        if leaf.dtype != dtype:
            raise TypeError(
                f"{owner}: `{_leaf_name(name, i, spec)}` has dtype {leaf.dtype}, expected "
                f"{dtype} ({expected})"
            )


def check_leaf_devices(
    owner: str,
    name: str,
    leaves: list,
    devices: list[torch.device],
    expected: str,
    spec: Any,
) -> None:
    """Raises `ValueError` naming the first leaf on an unexpected device, by its key path."""
    for i, (leaf, device) in enumerate(zip(leaves, devices)):
        if not same_device(leaf.device, device):
            raise ValueError(
                f"{owner}: `{_leaf_name(name, i, spec)}` is on device {leaf.device}, expected "
                f"{device} ({expected})"
            )


def check_floating_leaves(owner: str, name: str, leaves: list, spec: Any) -> None:
    """Raises `TypeError` naming the first leaf (by its key path in `spec`) that is not a
    floating-point or complex tensor: torch.optim's arithmetic, which an integer or bool
    buffer or update would round or truncate."""
    for i, leaf in enumerate(leaves):
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{owner}: `{tree.leaf_path(spec, i, name)}` must be a floating-point or "
                f"complex tensor, got {leaf.dtype}"
            )


def check_devices_like(
    owner: str, name: str, leaves: list, spec: Any, ref_leaves: list, ref_name: str = "params"
) -> None:
    """Raises `ValueError` naming the first leaf of `leaves` (pytree `spec`, shared with
    `ref_leaves`) on another device than its reference leaf, both by their key paths."""
    for i, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
        if not same_device(leaf.device, ref.device):
            raise ValueError(
                f"{owner}: `{tree.leaf_path(spec, i, name)}` is on device {leaf.device}, "
                f"expected {ref.device} like `{tree.leaf_path(spec, i, ref_name)}`"
            )


# --------------------------------------------------------------------------------------------
# The inner optimizers: hyperparameters (numbers, 0-d tensors or schedules) and states.
# --------------------------------------------------------------------------------------------


def _real(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: `{name}` must be a real number (int or float), "
            f"got {type(value).__name__}: {value!r}"
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}: `{name}` must be a finite non-negative float, got {value}")
    return value


def check_non_negative(owner: str, name: str, value: Any) -> float:
    """A finite real number `>= 0`, returned as a float."""
    value = _real(owner, name, value)
    if value < 0.0:
        raise ValueError(f"{owner}: `{name}` must be a non-negative float, got {value}")
    return value


def check_hyperparameter(owner: str, name: str, value: Any) -> Any:
    """A number (returned as a float), a 0-d real tensor or a schedule (returned as is).

    A concrete tensor's value is range-checked once, here; a schedule's values are checked as
    they come, by `check_schedule_value()`.
    """
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"{owner}: `{name}` must be a 0-d real tensor, got a {value.dtype} tensor of "
                f"shape {tuple(value.shape)}"
            )
        if not tree.is_transformed(value) and value.device.type != "meta":
            check_non_negative(owner, name, value.item())  # once, at construction
        return value
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: `{name}` must be a non-negative real number, a 0-d tensor or a schedule "
            f"(a callable count -> value), got {type(value).__name__}: {value!r}"
        )
    return check_non_negative(owner, name, value)


def check_schedule_value(owner: str, name: str, value: Any, count: Tensor) -> float | Tensor:
    """What the `name` schedule returned at `count`, as a float or a float64 0-d tensor.

    Checked by type, and a Python number also by range: reading a tensor's value would
    synchronise an accelerator, and is impossible under vmap.
    """
    if isinstance(value, Tensor):
        if value.dim() != 0 or not (value.is_floating_point() or _is_integer(value)):
            raise TypeError(
                f"{owner}: the `{name}` schedule must return a real number or a 0-d real tensor, "
                f"got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        if value.device.type != "cpu" and value.device != count.device:
            raise ValueError(
                f"{owner}: the `{name}` schedule returned a tensor on {value.device}; return it "
                f"on the CPU or on the params' device ({count.device})"
            )
        return value.to(torch.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{owner}: the `{name}` schedule must return a real number or a 0-d real tensor, got "
            f"{type(value).__name__}: {value!r}"
        )
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{owner}: the `{name}` schedule must return finite non-negative values, got {value} "
            f"at count {_count_text(count)}"
        )
    return value


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _count_text(count: Tensor) -> str:
    return str(int(count)) if not tree.is_transformed(count) else "(under a transform)"


def check_betas(owner: str, betas: Any) -> tuple[float, float]:
    """A pair `(beta1, beta2)` of floats in `[0, 1)`."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{owner}: `betas` must be a pair (beta1, beta2) of floats, got {betas!r}")
    out = []
    for i, beta in enumerate(betas):
        name = f"betas[{i}]"
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
            raise TypeError(
                f"{owner}: `{name}` must be a real number in [0, 1), "
                f"got {type(beta).__name__}: {beta!r}"
            )
        beta = float(beta)
        if not 0.0 <= beta < 1.0:  # also rejects nan
            raise ValueError(f"{owner}: `{name}` must be in [0, 1), got {beta}")
        out.append(beta)
    return out[0], out[1]


def check_nesterov(owner: str, nesterov: Any, momentum: float, dampening: float) -> bool:
    """Nesterov momentum, as torch.optim.SGD allows it: a bool, with momentum and no dampening."""
    if not isinstance(nesterov, bool):
        raise TypeError(
            f"{owner}: `nesterov` must be a bool, got {type(nesterov).__name__}: {nesterov!r}"
        )
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(
            f"{owner}: `nesterov` momentum requires `momentum` > 0 and `dampening` == 0, "
            f"got momentum={momentum}, dampening={dampening}"
        )
    return nesterov


def check_state_type(fn: str, state: Any, cls: type, name: str, owner: str) -> None:
    """`state` is a `cls` (the state of `fn`) with a 0-d int64 `count`."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{owner}: `{name}` must be an {cls.__name__} (the state of {fn}), got "
            f"{type(state).__name__}; was it made by another configuration?"
        )
    check_counter(owner, f"{name}.count", state.count)


def check_counter(owner: str, name: str, value: Any) -> None:
    """`value` (a state's counter) is a 0-d int64 tensor."""
    if not (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.int64):
        got = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, Tensor)
            else type(value).__name__
        )
        raise TypeError(f"{owner}: `{name}` must be a 0-d int64 tensor, got {got}")


def check_buffers(buffers: Any, name: str, leaves: list[Tensor], spec: Any, owner: str) -> None:
    """Parameter-shaped state buffers: same structure, shapes, dtypes and devices as params."""
    hint = "was it made by another configuration or for other params?"
    b_leaves, b_spec = tree.flatten(buffers, name, owner=owner)
    if not tree.same_structure(b_spec, spec):
        raise ValueError(
            f"{owner}: `{name}` has a different pytree structure from `params`: "
            f"{tree.structure_difference(b_spec, spec, name, 'params')}; {hint}"
        )
    for i, (b, p) in enumerate(zip(b_leaves, leaves)):
        if b.shape != p.shape or b.dtype != p.dtype or b.device != p.device:
            got = f"{b.dtype} tensor of shape {tuple(b.shape)} on {b.device}"
            expected = f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}"
            kind = ValueError if b.shape != p.shape or b.device != p.device else TypeError
            raise kind(
                f"{owner}: `{tree.leaf_path(b_spec, i, name)}` is a {got}, expected a {expected} "
                f"like `{tree.leaf_path(spec, i, 'params')}`; {hint}"
            )


def check_field_shapes(
    owner: str, state: Any, name: str, expected: dict[str, tuple], dtype: torch.dtype, hint: str
) -> None:
    """Each field of `state` named in `expected` is a `dtype` tensor of that shape; else a
    `ValueError` naming the field, what it is and what was expected, then `hint`."""
    for field, shape in expected.items():
        t = getattr(state, field)
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{owner}: `{name}.{field}` is {got}, expected a {dtype} tensor of shape "
                f"{shape}; {hint}"
            )


def flatten_like(owner: str, what: str, value: Any, spec: Any) -> list[Any]:
    """The leaves of `value`, a pytree that must have the structure `spec` of `updates`."""
    if value is None:
        raise TypeError(f"{owner}: `{what}` is None; a pytree like `updates` is required")
    leaves, value_spec = optree.tree_flatten(value, none_is_leaf=False)
    if not tree.same_structure(value_spec, spec):
        raise ValueError(
            f"{owner}: `{what}` has a different pytree structure from `updates`: "
            + tree.structure_difference(value_spec, spec, what, "updates")
        )
    return leaves


def float_leaves(owner: str, name: str, value: Any) -> tuple[list[Tensor], Any]:
    """The leaves and tree spec of `value`, a non-empty pytree of floating-point tensors."""
    leaves, spec = optree.tree_flatten(value)
    if not leaves:
        raise ValueError(f"{owner}: `{name}` has no tensor leaves")
    for leaf in leaves:
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            raise TypeError(f"{owner}: `{name}` must be a pytree of floating-point tensors")
    return leaves, spec

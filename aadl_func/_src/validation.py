"""Argument checks shared by the public constructors: each names the argument it rejects."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

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
    # ``inplace=1`` or ``inplace="yes"`` would silently pick a code path; demand a real bool.
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be a bool, got {type(value).__name__}")
    return value


def check_callable(owner: str, name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"{owner}: `{name}` must be callable, got {type(value).__name__}")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices agree; an index-less device (``"cuda"``) matches any index."""
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
    """Raises ``TypeError`` naming the first leaf whose dtype is not expected, by its key path
    in ``spec`` (the tree spec of ``leaves``, with ``name`` as the root)."""
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
    """Raises ``ValueError`` naming the first leaf on an unexpected device, by its key path."""
    for i, (leaf, device) in enumerate(zip(leaves, devices)):
        if not same_device(leaf.device, device):
            raise ValueError(
                f"{owner}: `{_leaf_name(name, i, spec)}` is on device {leaf.device}, expected "
                f"{device} ({expected})"
            )

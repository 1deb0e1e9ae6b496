"""Argument checks shared by the public constructors: each names the argument it rejects."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_int", "check_float", "check_device", "check_dtype", "check_choice"]


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

"""Helpers shared by the examples: the digits data, the small CNN and curve bookkeeping.

Everything here is plain PyTorch/scikit-learn; the examples themselves show the aadl_func API.
The data is scikit-learn's bundled copy of the UCI 8x8 handwritten digits (1,797 images), so
nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn


class PlainOptimizer:
    """A baseline: the inner optimizer applied alone, ``params <- params + updates``, behind the
    same ``init`` / ``update(state, params, grads, ...)`` calls as :func:`aadl_func.anderson`
    (``loss_fn`` is accepted and ignored)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def init(self, params: Any) -> Any:
        return self.inner.init(params)

    def update(self, state: Any, params: Any, grads: Any, *, inplace: bool = False, **_: Any):
        updates, state = self.inner.update(grads, state, params=params, inplace=inplace)
        return optree.tree_map(torch.add, params, updates), state


@dataclass(frozen=True)
class Digits:
    """Train/test split of the digits, images scaled to [0, 1], shape ``(N, 1, 8, 8)``."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def load_digits(dtype: torch.dtype = torch.float32, seed: int = 0, test_size: float = 0.25):
    """The bundled digits, split (stratified) by ``seed``: 1,347 train and 450 test images."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    data = sklearn_digits()
    images = torch.tensor(data.data / 16.0, dtype=dtype).reshape(-1, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.int64)
    train, test = train_test_split(
        list(range(len(labels))), test_size=test_size, random_state=seed, stratify=data.target
    )
    return Digits(images[train], labels[train], images[test], labels[test])


def make_cnn(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """conv 1->8 3x3, tanh, conv 8->16 3x3, tanh, 2x2 average pool, linear 256->10 (3,818
    parameters). tanh keeps the training map smooth, which is what extrapolation relies on."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.Tanh(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )
    return model.to(dtype)


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 32) -> nn.Module:
    """flatten, linear 64->hidden, tanh, linear hidden->10: cheap enough to train an ensemble of
    them at once on two CPU cores."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    return model.to(dtype)


def detached_params(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters as a plain dict of tensors (no autograd history), the pytree the
    functional API works on."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def steps_to(curve: Sequence[float], threshold: float) -> int | None:
    """First ``k`` with ``curve[k] < threshold`` (``curve[k]``: loss after ``k`` updates), or
    None if the curve never gets there."""
    return next((k for k, value in enumerate(curve) if value < threshold), None)


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN/Inf: non-finite numbers are written as null."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, allow_nan=False)
        f.write("\n")


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width text table (floats with 4 significant digits, None as '-')."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)

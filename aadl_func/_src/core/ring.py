"""Which ring slot holds which window entry.

The window is a ring of `Q` slots; `head` is the slot of the newest entry, and the slots
after it (modulo `Q`) hold the older ones, oldest first. These functions turn that into
chronological orders and validity masks, as tensors (any execution) or, for a known
`newest` slot, as cached index tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "chronological",
    "chronological_slots",
    "difference_valid",
    "slot_valid",
    "to_ring_order",
]


def slot_valid(q: int, head: Tensor, num_residuals: Tensor) -> Tensor:
    """Ring-order mask of slots holding one of the newest `num_residuals` residuals."""
    age = (head - torch.arange(q, device=head.device)) % q
    return age < num_residuals


def chronological(q: int, head: Tensor) -> Tensor:
    """Ring slots from oldest to newest (the newest is `head`)."""
    return (head + 1 + torch.arange(q, device=head.device)) % q


def difference_valid(q: int, num_residuals: Tensor) -> Tensor:
    """Chronological mask of the differences `f_{j+1} - f_j` between valid residuals."""
    return torch.arange(q - 1) >= q - num_residuals


def to_ring_order(chrono_values: Tensor, order: Tensor | int) -> Tensor:
    """Values by chronological position (oldest first) moved to their ring slots;
    `order` from `solve()`."""
    if isinstance(order, int):  # the newest slot: position j is slot (order + 1 + j) % Q
        return chrono_values.roll(order + 1)
    return torch.zeros_like(chrono_values).index_copy(0, order, chrono_values)


_SLOT_ORDERS: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}


def chronological_slots(q: int, newest: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The ring slots oldest first when `newest` is the newest one, and those after the
    oldest (the slots of the differences' newer ends), cached: a handful of tiny index
    tensors per device, shared read-only by every step."""
    key = (q, newest, device)
    if key not in _SLOT_ORDERS:
        slots = torch.tensor([(newest + 1 + j) % q for j in range(q)], device=device)
        _SLOT_ORDERS[key] = (slots, slots[1:])
    return _SLOT_ORDERS[key]

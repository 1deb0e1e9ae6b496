"""`AndersonOptions`: the options of [`aadl_func.anderson()`][aadl_func.anderson], defined and
validated once.

[`aadl_func.anderson()`][aadl_func.anderson],
[`aadl_func.AcceleratedOptimizer`][aadl_func.AcceleratedOptimizer] and
[`aadl_func.accelerate()`][aadl_func.accelerate] all build one of these; its fields, in order and
with their defaults, are [`aadl_func.anderson()`][aadl_func.anderson]'s keyword arguments (a test
holds the signature, this class and the README's signature block to the same list). Construction
validates every field and raises an error that names the argument; the instance is immutable and
hashable.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import Tensor

from aadl_func._src import acceptance
from aadl_func._src.acceptance import Acceptance
from aadl_func._src.core.scalars import COMPLEX_HISTORY
from aadl_func._src.modes import MODES, Mode
from aadl_func._src.validation import (
    check_bool,
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_int,
)

__all__ = ["AndersonOptions"]

OWNER = "anderson"


@dataclasses.dataclass(frozen=True)
class AndersonOptions:
    """The validated options of [`aadl_func.anderson()`][aadl_func.anderson] (see its docstring for
    each).

    Besides the fields: `rules`, the mode's `Mode` record
    (slot layout, window minimum, its part of the step, bounds), `acceptance`, the acceptance rule's
    record (`aadl_func._src.acceptance`), and `num_slots`, the ring's slots for
    `history_depth` in that mode.
    """

    rules: ClassVar[Mode]
    acceptance: ClassVar[Acceptance]
    num_slots: ClassVar[int]

    inner: Any
    history_depth: int = 10
    relaxation: float = 1.0
    reg: float = 0.0
    wait_iterations: int = 0
    store_each_nth: int = 1
    frequency: int = 1
    mode: str = "aadl"
    average: bool = False
    average_tol: float = 0.1
    history_device: torch.device | str | None = None
    compute_device: torch.device | str | None = None
    history_dtype: torch.dtype | None = None
    skip_nonfinite: bool = False
    max_consecutive_skips: int | None = None
    reg_relative: float = 0.0
    restart_on_reject: bool = False
    reg_column: float = 0.0
    line_search: bool = False
    sufficient_decrease: float = 0.0

    def __post_init__(self) -> None:
        self._validate(OWNER, 3)

    @classmethod
    def for_owner(cls, owner: str, min_history_depth: int, /, **options: Any) -> AndersonOptions:
        """The options validated in `owner`'s name with `history_depth >=
        min_history_depth`: the solvers (`fixed_point`, `root`) name themselves in their
        errors and take mode classic's 2 pairs, AA(1), which `anderson` itself does not
        (the contract's `history_depth >= 3`). Missing options take their defaults."""
        self = cls.__new__(cls)
        for name, default in _DEFAULTS.items():
            object.__setattr__(self, name, options.get(name, default))
        self._validate(owner, min_history_depth)
        return self

    def _validate(self, owner: str, min_history_depth: int) -> None:
        inner = self.inner
        if not (
            callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))
        ):
            raise TypeError(
                f"{owner}: `inner` must have callable `init` and `update` (e.g. "
                f"aadl_func.adam(...)), got {type(inner).__name__}"
            )
        mode = check_choice(owner, "mode", self.mode, tuple(MODES))
        if not isinstance(self.average, bool):
            raise TypeError(f"{owner}: `average` must be a bool, got {type(self.average).__name__}")
        if self.average and not MODES[mode].averages:
            raise ValueError(f"{owner}: `average=True` is defined for mode='aadl' only")
        skips = self.max_consecutive_skips
        checked = dict(
            history_depth=check_int(owner, "history_depth", self.history_depth, min_history_depth),
            relaxation=check_float(owner, "relaxation", self.relaxation, minimum=0.0, strict=True),
            reg=check_float(owner, "reg", self.reg, minimum=0.0),
            wait_iterations=check_int(owner, "wait_iterations", self.wait_iterations, 0),
            store_each_nth=check_int(owner, "store_each_nth", self.store_each_nth, 1),
            frequency=check_int(owner, "frequency", self.frequency, 1),
            mode=mode,
            average_tol=check_float(
                owner, "average_tol", self.average_tol, minimum=0.0, strict=True
            ),
            history_device=check_device(owner, "history_device", self.history_device),
            compute_device=check_device(owner, "compute_device", self.compute_device),
            history_dtype=check_dtype(owner, "history_dtype", self.history_dtype),
            skip_nonfinite=check_bool(owner, "skip_nonfinite", self.skip_nonfinite),
            max_consecutive_skips=(
                None if skips is None else check_int(owner, "max_consecutive_skips", skips, 0)
            ),
            reg_relative=check_float(owner, "reg_relative", self.reg_relative, minimum=0.0),
            restart_on_reject=check_bool(owner, "restart_on_reject", self.restart_on_reject),
            reg_column=check_float(owner, "reg_column", self.reg_column, minimum=0.0),
            line_search=check_bool(owner, "line_search", self.line_search),
            sufficient_decrease=check_float(
                owner, "sufficient_decrease", self.sufficient_decrease, minimum=0.0
            ),
        )
        if checked["sufficient_decrease"] >= 1.0:
            raise ValueError(
                f"{owner}: `sufficient_decrease` must be in [0, 1), got "
                f"{checked['sufficient_decrease']!r}"
            )
        if checked["max_consecutive_skips"] is not None and not checked["skip_nonfinite"]:
            raise ValueError(f"{owner}: `max_consecutive_skips` needs `skip_nonfinite=True`")
        for name, value in checked.items():  # the normalised values (ints, floats, devices)
            object.__setattr__(self, name, value)
        # Derived once: every step reads them (not fields: they follow from `mode`).
        object.__setattr__(self, "rules", MODES[mode])
        object.__setattr__(self, "acceptance", acceptance.chosen(owner, checked))
        object.__setattr__(self, "num_slots", MODES[mode].num_slots(checked["history_depth"]))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names after `inner`, in [`aadl_func.anderson()`][aadl_func.anderson]'s
        order."""
        return tuple(field.name for field in dataclasses.fields(cls))[1:]

    def values(self) -> dict[str, Any]:
        """The options after `inner` by name (what a checkpoint records)."""
        return {name: getattr(self, name) for name in self.names()}

    def history_device_of(self, p: Tensor) -> torch.device:
        return self.history_device if self.history_device is not None else p.device

    def history_dtype_of(self, p: Tensor) -> torch.dtype:
        """The window's dtype for leaf `p`: `history_dtype` (default `p`'s dtype); for a
        complex leaf, the complex dtype whose parts are `history_dtype` (float32:
        complex64, float64: complex128; `COMPLEX_HISTORY`)."""
        if self.history_dtype is None:
            return p.dtype
        if p.is_complex():
            # check_floating refused the history dtypes without a complex counterpart.
            return COMPLEX_HISTORY.get(self.history_dtype, self.history_dtype)
        return self.history_dtype

    def compute_device_of(self, leaves: list[Tensor]) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return self.history_device_of(leaves[0])


# The fields and their defaults, read once (torch.compile does not trace dataclasses.fields).
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(AndersonOptions)}

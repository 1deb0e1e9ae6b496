r"""The window's scalar field: real (float64 Grams) or complex (complex128 Grams).

Mode "classic" accepts complex params. Everything the window computes is then an inner
product $\langle a, b \rangle = a^H b = \sum_i \overline{a_i}\, b_i$ (conjugate-linear
in the first argument), its Gram matrices are Hermitian, $G = F^H F$, and its least
squares problem is solved over complex coefficients. The passes write that as
`torch.mv(block.conj(), v)`; for a real tensor `conj()` returns the tensor itself, so the
real window's arithmetic is unchanged, bit for bit. The few decisions that do depend on the
field are here (besides the argument checks, which refuse what complex data cannot do):

* `wide()` -- the dtype inner products and the state's Grams are kept in (float64, or
  complex128 for complex data: params are all real or all complex, so one leaf decides);
* `real_view()` -- a complex tensor as its real and imaginary parts (finiteness, bounds);
* `abs2()` -- $|z|^2$, real.
"""

from __future__ import annotations

import array

import torch
from torch import Tensor

__all__ = [
    "COMPLEX_HISTORY",
    "EXACT",
    "abs2",
    "float32_tensor",
    "float64_tensor",
    "real_view",
    "wide",
]

#: Window dtypes solved by the accurate route (a QR factor of the differences, formed element
#: by element): float64 and, for complex windows, complex128.
EXACT = (torch.float64, torch.complex128)

#: The window dtype of a complex leaf for each `history_dtype`: the complex dtype of that
#: precision. float16/bfloat16 have none that torch computes with on every device.
COMPLEX_HISTORY = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype inner products of `dtype` data accumulate in: complex128 for complex data
    (its parts float64), float64 otherwise."""
    return torch.complex128 if dtype.is_complex else torch.float64


def real_view(t: Tensor) -> Tensor:
    """`t`'s numbers as reals: a complex tensor viewed as `(..., 2)` (real, imaginary)
    pairs, no copy (an Inf/NaN or a too large value is one of the parts); others as they
    are."""
    return torch.view_as_real(t) if t.is_complex() else t


def abs2(t: Tensor) -> Tensor:
    """$|t|^2$ elementwise, real: `t * t` for real `t` (the same operation as
    before complex support), `re^2 + im^2` for complex `t`."""
    if t.is_complex():
        return t.real * t.real + t.imag * t.imag
    return t * t


def float64_tensor(values: list[float], rows: int | None = None) -> Tensor:
    """A new float64 CPU tensor holding `values` (Python floats) exactly; with `rows`, as a
    `(rows, len(values) // rows)` matrix. Built through a standard-library buffer, which
    costs about half of `torch.tensor(values)` (the eager step makes several per call)."""
    if not values:
        return torch.zeros(0 if rows is None else (rows, 0), dtype=torch.float64)
    flat = torch.frombuffer(array.array("d", values), dtype=torch.float64)
    return flat if rows is None else flat.view(rows, -1)


def float32_tensor(values: list[float]) -> Tensor:
    """A new float32 CPU vector of `values` (Python floats), each rounded once to the
    nearest float32 as `float64_tensor(values).to(torch.float32)` rounds it (a C cast:
    round to nearest even, out-of-range values to infinity), without the float64 tensor
    and the conversion."""
    if not values:
        return torch.zeros(0, dtype=torch.float32)
    return torch.frombuffer(array.array("f", values), dtype=torch.float32)

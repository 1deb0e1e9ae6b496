r"""The window's inner products, the only view of the window the small solve needs.

For the ring of residuals $f_t$ (slot order) and their consecutive differences
$d_t = f_t - f_{t-1}$:

* `gram[t, s]` $= \langle f_t, f_s \rangle$ (`(Q, Q)` float64; complex windows: complex128,
  Hermitian, $\langle u, v \rangle = u^H v$);
* `dr_gram[t, s]` $= \langle d_t, d_s \rangle$, kept from differences formed element by
  element, so it does not cancel when consecutive residuals nearly agree (as $D^T G D$ would);
* `dr_rhs[t]` $= \langle d_t, f_{\mathrm{head}} \rangle$.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["Grams"]


class Grams(NamedTuple):
    """The three inner-product tables of a window, in ring (slot) order."""

    gram: Tensor
    dr_gram: Tensor
    dr_rhs: Tensor

    @classmethod
    def of(cls, state: Any) -> Grams:
        """The Grams an `AndersonState` (or any record with these three fields) holds."""
        return cls(state.gram, state.dr_gram, state.dr_rhs)

"""Independent float64 NumPy references for the functional core.

Nothing here imports ``aadl_func``: every function is written from the mathematics in
``docs/background.md`` / ``docs/spec.md`` (or a textbook), with dense matrices and
``numpy.linalg.lstsq`` (an SVD solver applied to the whole matrix, a different algorithm
from the library's QR factor or float64 Gram matrix), so agreement is evidence, not
tautology.

Conventions: a window is an ``(n, k)`` array whose columns are the iterates, oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "AadlReference",
    "ClassicReference",
    "aadl_extrapolate",
    "aadl_gamma",
    "gmres_iterate",
    "type2_anderson",
]


def aadl_gamma(X: np.ndarray, reg: float = 0.0) -> np.ndarray:
    r"""AADL's least-squares coefficients, ``argmin ||DX[:, -1] - DR g||^2 + reg ||g||^2``.

    For ``reg > 0`` the Tikhonov problem is solved as the augmented least-squares problem

    .. math::

        \min_\gamma \left\| \begin{bmatrix} \Delta R \\ \sqrt{\mathrm{reg}}\, I \end{bmatrix}
        \gamma - \begin{bmatrix} \Delta X_{:, -1} \\ 0 \end{bmatrix} \right\|,

    and for ``reg == 0`` ``lstsq`` returns the minimum-norm solution (SVD with the default
    cut-off), the one well-defined answer for a rank-deficient window.
    """
    X = np.asarray(X, dtype=np.float64)
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    rhs = DX[:, -1]
    if reg > 0:
        m = DR.shape[1]
        DR = np.vstack([DR, np.sqrt(reg) * np.eye(m)])
        rhs = np.concatenate([rhs, np.zeros(m)])
    return np.linalg.lstsq(DR, rhs, rcond=None)[0]


def aadl_alpha(gamma: np.ndarray) -> np.ndarray:
    """``alpha = (gamma_0, gamma_1 - gamma_0, ..., 1 - gamma_last)``."""
    return np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])


def aadl_extrapolate(X: np.ndarray, relaxation: float = 1.0, reg: float = 0.0) -> np.ndarray:
    r"""The AADL extrapolation exactly as background.md writes it.

    .. math::

        \mathrm{extr} &= X_{:, -2} + \Delta X_{:, -1} - (\Delta X_{:, :-1} + \Delta R)\gamma \\
        \mathrm{relaxed} &= \beta\, \mathrm{extr} + (1 - \beta)\, X_{:, :-1}\,\alpha
    """
    X = np.asarray(X, dtype=np.float64)
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    gamma = aadl_gamma(X, reg)
    extr = X[:, -2] + DX[:, -1] - (DX[:, :-1] + DR) @ gamma
    return relaxation * extr + (1.0 - relaxation) * X[:, :-1] @ aadl_alpha(gamma)


def type2_anderson(xs: np.ndarray, gs: np.ndarray, relaxation: float = 1.0) -> np.ndarray:
    r"""Textbook type-II Anderson acceleration from pairs ``(x_i, g(x_i))`` (columns).

    .. math::

        x_{+} = \sum_i \alpha_i\big((1-\beta) x_i + \beta g(x_i)\big), \quad
        \alpha = \arg\min_{\sum_i \alpha_i = 1} \Big\|\sum_i \alpha_i f_i\Big\|,
        \quad f_i = g(x_i) - x_i.

    The constraint is eliminated through the *newest* pair, ``alpha_last = 1 - sum_{i<last}
    alpha_i``, i.e. ``min ||f_last + sum_i a_i (f_i - f_last)||`` (a different parametrisation
    from the library's consecutive differences).
    """
    xs = np.asarray(xs, dtype=np.float64)
    gs = np.asarray(gs, dtype=np.float64)
    F = gs - xs
    if F.shape[1] == 1:
        alpha = np.ones(1)
    else:
        A = F[:, :-1] - F[:, -1:]
        a = np.linalg.lstsq(A, -F[:, -1], rcond=None)[0]
        alpha = np.concatenate([a, [1.0 - a.sum()]])
    return ((1.0 - relaxation) * xs + relaxation * gs) @ alpha


def gmres_iterate(A: np.ndarray, b: np.ndarray, x0: np.ndarray, k: int) -> np.ndarray:
    r"""``argmin ||b - A x||`` over ``x0 + K_k(A, r0)``, ``r0 = b - A x0`` (``x0`` for k = 0).

    An orthonormal basis of the Krylov space is built by Arnoldi with modified Gram-Schmidt
    (and a second orthogonalisation pass), then the small problem is solved by ``lstsq``.
    """
    x0 = np.asarray(x0, dtype=np.float64)
    if k == 0:
        return x0.copy()
    r0 = b - A @ x0
    V = np.zeros((len(b), k))
    v = r0 / np.linalg.norm(r0)
    for j in range(k):
        V[:, j] = v
        w = A @ v
        for _ in range(2):
            for i in range(j + 1):
                w = w - (V[:, i] @ w) * V[:, i]
        v = w / np.linalg.norm(w)
    y = np.linalg.lstsq(A @ V, r0, rcond=None)[0]
    return x0 + V @ y


def _finite(x: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(x)))


@dataclass
class AadlReference:
    """The numbered semantics of ``update`` in mode "aadl" (spec.md), with an explicit window.

    The inner optimizer is plain gradient descent, ``y = x - lr * grad(x)``; the window is a
    ``deque`` of the appended ``y`` (or of the accepted mix, which replaces the newest entry).
    """

    grad: Callable[[np.ndarray], np.ndarray]
    lr: float
    history_depth: int = 10
    relaxation: float = 1.0
    reg: float = 0.0
    wait_iterations: int = 0
    store_each_nth: int = 1
    frequency: int = 1

    def run(
        self,
        x0: np.ndarray,
        steps: int,
        loss: Callable[[np.ndarray], float] | None = None,
        inputs: list[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], list[bool]]:
        """Returned params after each of ``steps`` calls and whether each came from the mix.

        With ``inputs``, call ``k`` (1-based) receives ``inputs[k - 2]`` as its params instead
        of the reference's own previous output (``x0`` for call 1): the reference then checks
        every step of another trajectory on that trajectory's own inputs (and, with ``loss``,
        with that trajectory's accepted mixes in the window), so rounding is not amplified by
        the (chaotic) dynamics of Anderson acceleration.
        """
        window: deque[np.ndarray] = deque(maxlen=self.history_depth)
        x = np.asarray(x0, dtype=np.float64).copy()
        trajectory, mixed = [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = np.asarray(inputs[k - 2], dtype=np.float64).copy()
            y = x - self.lr * self.grad(x)
            if k % self.store_each_nth == 0:
                window.append(y.copy())
            use = False
            if k > self.wait_iterations and k % self.frequency == 0 and len(window) >= 3:
                xm = aadl_extrapolate(np.stack(window, axis=1), self.relaxation, self.reg)
                use = _finite(xm)
                if use and loss is not None:
                    lx = loss(xm)
                    use = bool(np.isfinite(lx) and lx < loss(y))
                    if use:
                        # Forced: the window holds the other trajectory's accepted mix, as
                        # that trajectory's own window does (checked equal to ``xm`` by the
                        # caller), so window perturbations are not compounded either.
                        forced = inputs is not None and k - 1 < len(inputs)
                        window[-1] = np.asarray(inputs[k - 1] if forced else xm, np.float64)
            x = xm if use else y
            trajectory.append(x.copy())
            mixed.append(use)
        return trajectory, mixed


@dataclass
class ClassicReference:
    """Mode "classic": type-II AA on the pairs of the last ``history_depth`` calls."""

    grad: Callable[[np.ndarray], np.ndarray]
    lr: float
    history_depth: int = 10
    relaxation: float = 1.0
    wait_iterations: int = 0
    frequency: int = 1

    def run(
        self,
        x0: np.ndarray,
        steps: int,
        loss: Callable[[np.ndarray], float] | None = None,
        inputs: list[np.ndarray] | None = None,
    ) -> tuple[list[np.ndarray], list[bool]]:
        """As :meth:`AadlReference.run`."""
        pairs: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.history_depth)
        x = np.asarray(x0, dtype=np.float64).copy()
        trajectory, mixed = [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = np.asarray(inputs[k - 2], dtype=np.float64).copy()
            y = x - self.lr * self.grad(x)
            pairs.append((x.copy(), y.copy()))
            use = False
            if k > self.wait_iterations and k % self.frequency == 0 and len(pairs) >= 2:
                xs = np.stack([p[0] for p in pairs], axis=1)
                gs = np.stack([p[1] for p in pairs], axis=1)
                xm = type2_anderson(xs, gs, self.relaxation)
                use = _finite(xm)
                if use and loss is not None:
                    lx = loss(xm)
                    use = bool(np.isfinite(lx) and lx < loss(y))
            x = xm if use else y
            trajectory.append(x.copy())
            mixed.append(use)
        return trajectory, mixed

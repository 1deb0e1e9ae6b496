"""Textbook float64 references for the accuracy tests (``test_accuracy.py``, ``accuracy.py``).

Nothing here imports ``aadl_func``. The least-squares problems are solved by a Householder QR
written out below (Golub & Van Loan, Algorithm 5.2.1, and back substitution), not by LAPACK,
and GMRES is Saad's (Arnoldi with modified Gram-Schmidt, Givens rotations on the Hessenberg
matrix), so agreement with the library is evidence, not the same code run twice.

Conventions: a window is an ``(n, k)`` array whose columns are the iterates, oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "householder_lstsq",
    "aadl_gamma_qr",
    "aadl_point",
    "gmres",
    "AadlRecurrence",
    "ClassicRecurrence",
]


def householder_lstsq(A: np.ndarray, b: np.ndarray, reg: float = 0.0) -> np.ndarray:
    r"""``argmin ||A x - b||^2 + reg ||x||^2`` by Householder QR of ``[A; sqrt(reg) I]``.

    ``A`` must have full column rank (after the ridge): the tests use this reference on
    well-defined problems only, where it is accurate to ``eps * cond(A)`` (normwise) and to
    near ``eps`` when the ill-conditioning comes from the columns' scales.
    """
    A = np.array(A, dtype=np.float64)
    b = np.array(b, dtype=np.float64)
    n, m = A.shape
    if reg > 0:
        A = np.vstack([A, np.sqrt(reg) * np.eye(m)])
        b = np.concatenate([b, np.zeros(m)])
    for j in range(m):
        x = A[j:, j]
        norm = np.linalg.norm(x)
        if norm == 0.0:
            continue
        v = x.copy()
        v[0] += np.copysign(norm, x[0])  # no cancellation in v[0]
        v /= np.linalg.norm(v)
        A[j:, j:] -= 2.0 * np.outer(v, v @ A[j:, j:])
        b[j:] -= 2.0 * v * (v @ b[j:])
    x = np.zeros(m)
    for i in range(m - 1, -1, -1):  # back substitution with R = A[:m, :m]
        x[i] = (b[i] - A[i, i + 1 : m] @ x[i + 1 :]) / A[i, i]
    return x


def aadl_gamma_qr(X: np.ndarray, reg: float = 0.0) -> np.ndarray:
    """AADL's coefficients ``argmin ||DX[:, -1] - DR g||^2 + reg ||g||^2`` (background.md)."""
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    return householder_lstsq(DR, DX[:, -1], reg)


def aadl_point(X: np.ndarray, gamma: np.ndarray, relaxation: float = 1.0) -> np.ndarray:
    """AADL's relaxed extrapolation of window ``X`` for coefficients ``gamma``."""
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    extr = X[:, -2] + DX[:, -1] - (DX[:, :-1] + DR) @ gamma
    alpha = np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])
    return relaxation * extr + (1.0 - relaxation) * X[:, :-1] @ alpha


def gmres(A: np.ndarray, b: np.ndarray, x0: np.ndarray, steps: int) -> list:
    r"""GMRES (Saad & Schultz 1986): for ``k = 0 .. steps``, ``(x_k, ||b - A x_k|| / ||r0||)``
    with ``x_k`` the minimiser of ``||b - A x||`` over ``x0 + K_k(A, r0)``.

    Arnoldi with modified Gram-Schmidt (run twice: reorthogonalised); the Hessenberg least
    squares problem is solved by Givens rotations as they are generated, and ``x_k`` by back
    substitution on its leading ``k x k`` triangle. Stops early at an exact solution.
    """
    r0 = b - A @ x0
    beta = np.linalg.norm(r0)
    out = [(x0.copy(), 1.0)]
    if beta == 0.0:
        return out
    n = len(b)
    V = np.zeros((n, steps + 1))
    H = np.zeros((steps + 1, steps))
    cs, sn = np.zeros(steps), np.zeros(steps)
    g = np.zeros(steps + 1)
    g[0] = beta
    V[:, 0] = r0 / beta
    for j in range(steps):
        w = A @ V[:, j]
        for _ in range(2):
            for i in range(j + 1):
                h = V[:, i] @ w
                H[i, j] += h
                w = w - h * V[:, i]
        H[j + 1, j] = np.linalg.norm(w)
        for i in range(j):  # earlier rotations on the new column
            top = cs[i] * H[i, j] + sn[i] * H[i + 1, j]
            H[i + 1, j] = -sn[i] * H[i, j] + cs[i] * H[i + 1, j]
            H[i, j] = top
        radius = np.hypot(H[j, j], H[j + 1, j])
        cs[j], sn[j] = H[j, j] / radius, H[j + 1, j] / radius
        H[j, j] = radius
        g[j + 1] = -sn[j] * g[j]
        g[j] = cs[j] * g[j]
        k = j + 1
        y = np.zeros(k)
        for i in range(k - 1, -1, -1):
            y[i] = (g[i] - H[i, i + 1 : k] @ y[i + 1 :]) / H[i, i]
        x = x0 + V[:, :k] @ y
        out.append((x, float(np.linalg.norm(b - A @ x) / beta)))
        if H[j + 1, j] == 0.0:
            break
        V[:, j + 1] = w / H[j + 1, j]
    return out


def _finite(x: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(x)))


@dataclass
class AadlRecurrence:
    """``update`` in mode "aadl" (spec.md, steps 1-5) with a deque window and Householder QR.

    The inner step is ``y = x - lr * grad(x)``. By default it runs free: each call gets the
    previous output, so the library and this reference follow the same recurrence from
    ``x0``. With ``inputs`` (another run's outputs) call ``k`` gets ``inputs[k - 2]`` instead
    and an accepted mix puts ``inputs[k - 1]`` in the window: every call is then checked on
    that run's own data, without the recurrence amplifying earlier differences.
    """

    grad: Callable[[np.ndarray], np.ndarray]
    lr: float
    history_depth: int = 10
    relaxation: float = 1.0
    reg: float = 0.0
    wait_iterations: int = 0
    store_each_nth: int = 1
    frequency: int = 1
    average: bool = False
    average_tol: float = 0.1

    def run(self, x0, steps, loss=None, inputs=None):
        """Outputs of ``steps`` calls and, per call, "mix" / "average" / "plain"."""
        window: deque[np.ndarray] = deque(maxlen=self.history_depth)
        x = np.array(x0, dtype=np.float64)
        outputs, kinds = [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = np.array(inputs[k - 2], dtype=np.float64)
            y = x - self.lr * self.grad(x)
            if k % self.store_each_nth == 0:
                window.append(y.copy())
            kind, x = "plain", y
            if self.average and len(window) >= 2:
                W = np.stack(window, axis=1)
                mean = W.mean(axis=1)
                spread = np.sum((W - mean[:, None]) ** 2) / (W.shape[1] - 1)
                if spread > self.average_tol**2 * (mean @ mean):
                    kind, x = "average", mean
            gate = k > self.wait_iterations and k % self.frequency == 0 and len(window) >= 3
            if kind == "plain" and gate:
                W = np.stack(window, axis=1)
                xm = aadl_point(W, aadl_gamma_qr(W, self.reg), self.relaxation)
                use = _finite(xm)
                if use and loss is not None:
                    use = bool(loss(xm) < loss(y))
                if use:
                    kind, x = "mix", xm
                    if loss is not None:
                        window[-1] = xm.copy() if inputs is None else inputs[k - 1].copy()
            outputs.append(x.copy())
            kinds.append(kind)
        return outputs, kinds


@dataclass
class ClassicRecurrence:
    """``update`` in mode "classic": type-II AA on the stored pairs ``(x_i, g(x_i))``, the
    constraint eliminated with consecutive differences as the library does (so that ``reg``
    means the same), solved by Householder QR."""

    grad: Callable[[np.ndarray], np.ndarray]
    lr: float
    history_depth: int = 10
    relaxation: float = 1.0
    reg: float = 0.0
    wait_iterations: int = 0
    store_each_nth: int = 1
    frequency: int = 1

    def run(self, x0, steps, loss=None, inputs=None):
        """As :meth:`AadlRecurrence.run`."""
        pairs: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.history_depth)
        x = np.array(x0, dtype=np.float64)
        outputs, kinds = [], []
        for k in range(1, steps + 1):
            if inputs is not None and k > 1:
                x = np.array(inputs[k - 2], dtype=np.float64)
            y = x - self.lr * self.grad(x)
            if k % self.store_each_nth == 0:
                pairs.append((x.copy(), y.copy()))
            kind, out = "plain", y
            if k > self.wait_iterations and k % self.frequency == 0 and len(pairs) >= 2:
                xs = np.stack([p[0] for p in pairs], axis=1)
                gs = np.stack([p[1] for p in pairs], axis=1)
                F = gs - xs
                gamma = householder_lstsq(np.diff(F, axis=1), F[:, -1], self.reg)
                alpha = np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])
                xm = ((1.0 - self.relaxation) * xs + self.relaxation * gs) @ alpha
                use = _finite(xm) and (loss is None or bool(loss(xm) < loss(y)))
                if use:
                    kind, out = "mix", xm
            x = out
            outputs.append(x.copy())
            kinds.append(kind)
        return outputs, kinds

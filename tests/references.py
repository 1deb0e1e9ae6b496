"""The independent float64 NumPy references of the test suite, in one place.

Nothing here imports ``aadl_func``: everything is written from the mathematics of the
``aadl_func.anderson`` docstring, the README and docs/background.md, and from textbooks, with
dense matrices, so that agreement with the library is evidence, not the same code run twice.

* Least squares: :func:`householder_lstsq` (Golub & Van Loan, Algorithm 5.2.1, written out:
  no LAPACK) and :func:`svd_lstsq` (LAPACK's SVD solver on the whole matrix, the
  minimum-norm answer for a rank-deficient problem). The library uses neither (a streamed QR
  factor or a float64 Gram matrix).
* One AADL extrapolation (:func:`aadl_gamma`, :func:`aadl_point`, :func:`aadl_extrapolate`)
  and one textbook type-II Anderson step (:func:`type2_anderson`), which on a linear map with
  full history equals GMRES (:func:`gmres`, Saad's, with Givens rotations; Walker & Ni 2011).
* The inner optimizers of torch.optim (:class:`Sgd`, :class:`Adam`), float64.
* Regularized nonlinear acceleration (:func:`rna_weights`, :func:`rna_extrapolate`; Scieur,
  d'Aspremont & Bach 2016), as a constrained quadratic program solved through its KKT system.
* :class:`Recurrence`: the numbered semantics of ``update`` in both modes, with every option,
  on an explicit window.

Conventions: a window is an ``(n, k)`` array whose columns are the iterates, oldest first.
Complex data (mode "classic"): :func:`type2_anderson`, :class:`Recurrence` and
:func:`svd_lstsq` compute in complex128 (LAPACK's complex least squares, norms of
:math:`|z|^2`), :func:`minimal_residual_iterate` is GMRES over real or complex numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Adam",
    "GradientDescent",
    "Recurrence",
    "Sgd",
    "aadl_alpha",
    "aadl_extrapolate",
    "aadl_gamma",
    "aadl_point",
    "gmres",
    "gmres_iterate",
    "householder_lstsq",
    "mix_bound",
    "minimal_residual_iterate",
    "rna_extrapolate",
    "rna_weights",
    "svd_lstsq",
    "type2_anderson",
]


# -- least squares ----------------------------------------------------------------------------


def _augment(A: np.ndarray, b: np.ndarray, reg) -> tuple[np.ndarray, np.ndarray]:
    r"""``[A; diag(sqrt(reg))]`` and ``[b; 0]``: Tikhonov as an ordinary least-squares
    problem, :math:`\|Ax - b\|^2 + \sum_j \mathrm{reg}_j x_j^2 = \|[A;
    \mathrm{diag}(\sqrt{\mathrm{reg}})] x - [b; 0]\|^2`; ``reg`` one number for every
    column or one per column (``reg_column``)."""
    dtype = np.result_type(A, b, np.float64)  # complex128 for complex data
    A = np.array(A, dtype=dtype)
    b = np.array(b, dtype=dtype)
    m = A.shape[1]
    weights = np.broadcast_to(np.asarray(reg, dtype=np.float64), (m,))
    if np.any(weights > 0):
        A = np.vstack([A, np.diag(np.sqrt(weights))])
        b = np.concatenate([b, np.zeros(m, dtype=dtype)])
    return A, b


def svd_lstsq(A: np.ndarray, b: np.ndarray, reg: float | np.ndarray = 0.0) -> np.ndarray:
    """``argmin ||A x - b||^2 + reg ||x||^2`` by LAPACK's SVD solver (``numpy.linalg.lstsq``),
    ``reg`` a number or one weight per column;
    for a rank-deficient ``A`` (``reg = 0``) the minimum-norm solution, the one well-defined
    answer."""
    A, b = _augment(A, b, reg)
    return np.linalg.lstsq(A, b, rcond=None)[0]


def householder_lstsq(A: np.ndarray, b: np.ndarray, reg: float = 0.0) -> np.ndarray:
    r"""``argmin ||A x - b||^2 + reg ||x||^2`` by Householder QR of ``[A; sqrt(reg) I]``
    and back substitution, written out (no LAPACK).

    ``A`` must have full column rank (after the ridge): it is accurate to ``eps * cond(A)``
    (normwise) and to near ``eps`` when the ill-conditioning comes from the columns' scales.
    """
    A, b = _augment(A, b, reg)
    m = A.shape[1]
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


Solver = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


# -- one AADL extrapolation, one type-II Anderson step ----------------------------------------


def aadl_gamma(
    X: np.ndarray, reg: float = 0.0, reg_relative: float = 0.0, solve: Solver = svd_lstsq
) -> np.ndarray:
    r"""AADL's coefficients: with :math:`\Delta X` the consecutive differences of the window
    and :math:`\Delta R` theirs,

    .. math::

        \gamma = \arg\min_\gamma \|\Delta X_{:,-1} - \Delta R\,\gamma\|^2
            + \lambda\|\gamma\|^2, \quad
        \lambda = \mathrm{reg} + \mathrm{reg\_relative}\,\|\Delta R\|_F^2 / m .
    """
    X = np.asarray(X, dtype=np.float64)
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    lam = reg + reg_relative * float(np.sum(DR * DR)) / DR.shape[1]
    return solve(DR, DX[:, -1], lam)


def aadl_alpha(gamma: np.ndarray) -> np.ndarray:
    """The affine weights of the entries, ``(gamma_0, gamma_1 - gamma_0, ..., 1 - gamma_last)``
    (they sum to 1)."""
    return np.concatenate([gamma[:1], np.diff(gamma), 1.0 - gamma[-1:]])


def aadl_point(X: np.ndarray, gamma: np.ndarray, relaxation: float = 1.0) -> np.ndarray:
    r"""AADL's relaxed extrapolation of window ``X`` for the coefficients ``gamma``:

    .. math::

        \mathrm{extr} &= X_{:, -2} + \Delta X_{:, -1} - (\Delta X_{:, :-1} + \Delta R)\gamma \\
        x &= \beta\, \mathrm{extr} + (1 - \beta)\, X_{:, :-1}\,\alpha(\gamma)
    """
    X = np.asarray(X, dtype=np.float64)
    DX = np.diff(X, axis=1)
    DR = np.diff(DX, axis=1)
    extr = X[:, -2] + DX[:, -1] - (DX[:, :-1] + DR) @ gamma
    return relaxation * extr + (1.0 - relaxation) * X[:, :-1] @ aadl_alpha(gamma)


def aadl_extrapolate(
    X: np.ndarray,
    relaxation: float = 1.0,
    reg: float = 0.0,
    reg_relative: float = 0.0,
    solve: Solver = svd_lstsq,
) -> np.ndarray:
    """``aadl_point(X, aadl_gamma(X, ...))``: the mix of one window."""
    return aadl_point(X, aadl_gamma(X, reg, reg_relative, solve), relaxation)


def rna_weights(R: np.ndarray, lam: float) -> np.ndarray:
    r"""RNA's weights for the residual columns ``R`` (``(n, p)``, oldest first):

    .. math::

        c = \arg\min_{\mathbf{1}^\top c = 1} c^\top H c, \qquad
        H = \frac{R^\top R}{\|R^\top R\|_2} + \lambda I,

    from the KKT system :math:`\begin{bmatrix} 2H & \mathbf{1} \\ \mathbf{1}^\top & 0
    \end{bmatrix} \begin{bmatrix} c \\ \nu \end{bmatrix} = \begin{bmatrix} 0 \\ 1
    \end{bmatrix}` (the same :math:`c` as :math:`H^{-1}\mathbf{1}` normalised, reached
    another way); ``lam = inf``: the uniform :math:`\mathbf{1}/p`."""
    R = np.asarray(R, dtype=np.float64)
    p = R.shape[1]
    if np.isinf(lam):
        return np.full(p, 1.0 / p)
    G = R.T @ R
    H = G / np.linalg.norm(G, 2) + lam * np.eye(p)
    kkt = np.zeros((p + 1, p + 1))
    kkt[:p, :p] = 2.0 * H
    kkt[:p, p] = kkt[p, :p] = 1.0
    rhs = np.zeros(p + 1)
    rhs[p] = 1.0
    return np.linalg.solve(kkt, rhs)[:p]


def rna_extrapolate(X: np.ndarray, lam: float, R: np.ndarray | None = None) -> np.ndarray:
    r"""RNA's extrapolation :math:`\sum_i c_i x_i` of the snapshots ``X`` (``(n, k)``, oldest
    first). Residuals: ``R`` if given (one column per column of ``X``, e.g. mean gradients),
    else the differences :math:`x_{i+1} - x_i`, which combine the first ``k - 1`` columns."""
    X = np.asarray(X, dtype=np.float64)
    if R is None:
        R, X = np.diff(X, axis=1), X[:, :-1]
    return X @ rna_weights(R, lam)


def type2_anderson(
    xs: np.ndarray,
    gs: np.ndarray,
    relaxation: float = 1.0,
    reg: float = 0.0,
    reg_relative: float = 0.0,
    solve: Solver = svd_lstsq,
    reg_column: float = 0.0,
) -> np.ndarray:
    r"""Textbook type-II Anderson acceleration from the pairs ``(x_i, g(x_i))`` (columns):

    .. math::

        x_{+} = \sum_i \alpha_i\big((1-\beta) x_i + \beta g(x_i)\big), \quad
        \alpha = \arg\min_{\sum_i \alpha_i = 1} \Big\|\sum_i \alpha_i f_i\Big\|,
        \quad f_i = g(x_i) - x_i.

    The constraint is eliminated with consecutive differences :math:`\Delta F`, so that a
    Tikhonov weight means what it means in ``anderson``: :math:`\gamma = \arg\min \|f_{last}
    - \Delta F \gamma\|^2 + \lambda \|\gamma\|^2`, :math:`\alpha = \alpha(\gamma)` as in AADL
    (:math:`\sum_i \alpha_i f_i = f_{last} - \Delta F \gamma`). ``reg_column`` adds
    :math:`\mathrm{reg\_column}\,\|\Delta f_j\|^2` to column ``j``'s weight (SciPy's
    :math:`w_0^2`).

    Complex pairs give the complex problem: the norms are those of :math:`\mathbb{C}^n`
    (:math:`|z|^2`), :math:`\gamma` and :math:`\alpha` are complex (``solve`` must then be
    :func:`svd_lstsq`, LAPACK's complex solver).
    """
    dtype = np.result_type(xs, gs, np.float64)
    xs = np.asarray(xs, dtype=dtype)
    gs = np.asarray(gs, dtype=dtype)
    F = gs - xs
    if F.shape[1] == 1:
        alpha = np.ones(1)
    else:
        DF = np.diff(F, axis=1)
        lam = reg + reg_relative * float(np.sum(np.abs(DF) ** 2)) / DF.shape[1]
        if reg_column:
            lam = lam + reg_column * np.sum(np.abs(DF) ** 2, axis=0)
        alpha = aadl_alpha(solve(DF, F[:, -1], lam))
    return ((1.0 - relaxation) * xs + relaxation * gs) @ alpha


def gmres(A: np.ndarray, b: np.ndarray, x0: np.ndarray, steps: int) -> list:
    r"""GMRES (Saad & Schultz 1986): for ``k = 0 .. steps``, ``(x_k, ||b - A x_k|| / ||r0||)``
    with ``x_k`` the minimiser of ``||b - A x||`` over ``x0 + K_k(A, r0)``.

    Arnoldi with modified Gram-Schmidt (run twice: reorthogonalised); the Hessenberg least
    squares problem is solved by Givens rotations as they are generated, and ``x_k`` by back
    substitution on its leading ``k x k`` triangle. Stops early at an exact solution.
    """
    x0 = np.asarray(x0, dtype=np.float64)
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


def minimal_residual_iterate(A: np.ndarray, b: np.ndarray, x0: np.ndarray, k: int) -> np.ndarray:
    r"""GMRES's ``x_k`` over real or complex numbers, by its definition: the minimiser of
    :math:`\|b - A x\|_2` over :math:`x_0 + \mathcal{K}_k(A, r_0)`, from an orthonormal basis
    of the Krylov space (Arnoldi, modified Gram-Schmidt run twice, with the Hermitian inner
    product ``np.vdot``) and LAPACK's least-squares solver on the small problem
    :math:`\min_y \|r_0 - A V_k y\|`. (:func:`gmres` is the real Givens-rotation form.)"""
    dtype = np.result_type(A, b, x0, np.float64)
    x0 = np.asarray(x0, dtype=dtype)
    r0 = b - A @ x0
    if k == 0 or np.linalg.norm(r0) == 0.0:
        return x0.copy()
    V = [r0 / np.linalg.norm(r0)]
    for _ in range(1, k):
        w = A @ V[-1]
        for _ in range(2):
            for v in V:
                w = w - np.vdot(v, w) * v
        norm = np.linalg.norm(w)
        if norm <= 1e-14 * np.linalg.norm(r0):  # the space is invariant: x* is in it
            break
        V.append(w / norm)
    basis = np.stack(V, axis=1)
    y = np.linalg.lstsq(A @ basis, r0, rcond=None)[0]
    return x0 + basis @ y


def gmres_iterate(A: np.ndarray, b: np.ndarray, x0: np.ndarray, k: int) -> np.ndarray:
    """GMRES's ``x_k`` (the exact solution from an early stop on)."""
    iterates = gmres(A, b, x0, k)
    return iterates[min(k, len(iterates) - 1)][0]


# -- torch.optim's inner steps in float64 -----------------------------------------------------


class GradientDescent:
    """``y = x - lr * grad``, stateless."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def init(self, x: np.ndarray):
        return None

    def step(self, x: np.ndarray, g: np.ndarray, state):
        return x - self.lr * g, state


@dataclass
class Sgd:
    """``torch.optim.SGD``: ``g += wd x``; ``b = g`` on the first step, then ``b = mu b + (1 -
    dampening) g``; ``g = g + mu b`` (Nesterov) or ``b``; ``y = x - lr g``."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def init(self, x: np.ndarray):
        return None  # no momentum buffer before the first step

    def step(self, x: np.ndarray, g: np.ndarray, buf):
        g = g + self.weight_decay * x
        if self.momentum:
            buf = g.copy() if buf is None else self.momentum * buf + (1 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        return x - self.lr * g, buf


@dataclass
class Adam:
    """``torch.optim.Adam`` (``decoupled=False``: ``g += wd x``) or ``AdamW`` (``x *= 1 - lr
    wd`` first): ``m, v`` the moving averages of ``g`` and ``g^2``, ``y = x - lr/(1 - b1^t) m /
    (sqrt(v) / sqrt(1 - b2^t) + eps)``."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def init(self, x: np.ndarray):
        return (0, np.zeros_like(x), np.zeros_like(x))

    def step(self, x: np.ndarray, g: np.ndarray, state):
        t, m, v = state
        b1, b2 = self.betas
        if self.decoupled:
            x = x * (1 - self.lr * self.weight_decay)
        else:
            g = g + self.weight_decay * x
        t, m, v = t + 1, b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + self.eps
        return x - self.lr / (1 - b1**t) * m / denom, (t, m, v)


# -- a window's rounding, as a perturbation ----------------------------------------------------


def rounding_perturbation(u_point: float, u_diff: float, seed: int) -> Callable:
    r"""A ``Recurrence.perturb`` that moves a window's data as rounding does, with random
    (standard normal) factors: every point (mode "aadl": the iterates; mode "classic": ``x_i``
    and ``g(x_i)``) by ``u_point`` relative in each coordinate, then every consecutive
    difference (and mode "classic"'s residuals ``f_i = g(x_i) - x_i``) by ``u_diff`` relative,
    the window rebuilt from its newest point:

    .. math::

        x_i' = x_i (1 + u_p s_i), \quad
        \Delta x_i'' = \Delta x_i' (1 + u_d t_i), \quad s, t \sim N(0, I).

    How far the mix moves under it samples the mix's sensitivity to rounding of that size
    (the probabilistic model of rounding: independent errors of at most ``u`` relative each,
    Higham & Mary, SIAM J. Sci. Comput. 41, 2019; a unit normal factor has at least their
    variance)."""
    rng = np.random.default_rng(seed)

    def signs(shape) -> np.ndarray:
        return rng.standard_normal(shape)

    def columns(X: np.ndarray) -> np.ndarray:
        X = X * (1.0 + u_point * signs(X.shape))
        D = np.diff(X, axis=1) * (1.0 + u_diff * signs((X.shape[0], X.shape[1] - 1)))
        out = X.copy()
        for j in range(X.shape[1] - 2, -1, -1):
            out[:, j] = out[:, j + 1] - D[:, j]
        return out

    def perturb(*window: np.ndarray):
        if len(window) == 1:
            return columns(window[0])
        xs, gs = window
        residuals = (gs - xs) * (1.0 + u_diff * signs(xs.shape))
        xs = columns(xs)
        return xs, (xs + residuals) * (1.0 + u_point * signs(xs.shape))

    return perturb


# -- the recurrence of ``update`` -------------------------------------------------------------


def _finite(x) -> bool:
    return bool(np.all(np.isfinite(x)))


@dataclass
class Recurrence:
    """``update``'s numbered semantics (the ``anderson`` docstring) in mode ``"aadl"`` or
    ``"classic"``, with an explicit window, for the inner step ``inner`` (a learning rate:
    gradient descent). Call ``k`` (1-based, skipped calls not counted):

    0. ``skip_nonfinite``: non-finite grads or inner step: nothing changes, not even ``k``;
    1. ``y = inner(x)``;
    2. mode "aadl": ``y`` joins the window if ``k % store_each_nth == 0``; mode "classic":
       the pair ``(x, y)`` does;
    3. ``average`` (mode "aadl"): if the window's spread exceeds ``average_tol`` times its
       mean's norm, the result is the mean and no mix is formed;
    4. if ``k > wait_iterations``, ``k % frequency == 0`` and the window holds >= 3 entries
       (classic: >= 2 pairs), the mix is formed (:func:`aadl_extrapolate`,
       :func:`type2_anderson`); a non-finite mix is dropped;
    5. safeguard (``loss``, or the scripted decisions ``accept``): the mix is kept only if
       ``loss(mix) < loss(y)``; a kept mix replaces the newest entry (mode "aadl"), a
       rejected one restarts the window from its newest entry with ``restart_on_reject``.
    6. ``deferred`` (``update(..., loss=loss(x))``, judged before step 1): if the previous
       call returned a mix made from a point of loss ``l`` (finite) and ``loss(x) < l``
       fails, the call returns the previous call's plain step ``y`` and is not counted
       (``k`` stays, as for a skipped call), with nothing else changed (no inner step;
       ``restart_on_reject`` cuts the window to its newest entry). A mix returned by a call
       records that call's ``loss(x)``, or with ``sufficient_decrease`` ``c`` the bar
       ``loss(x) + c grad(x).(y - x)`` where that slope is negative (Armijo's condition
       with the plain step as the yardstick).

    After :meth:`run`, ``window`` holds the final window (mode "classic": the pairs).
    """

    grad: Callable[[np.ndarray], np.ndarray]
    inner: object
    mode: str = "aadl"
    history_depth: int = 10
    relaxation: float = 1.0
    reg: float = 0.0
    reg_relative: float = 0.0
    wait_iterations: int = 0
    store_each_nth: int = 1
    frequency: int = 1
    average: bool = False
    average_tol: float = 0.1
    restart_on_reject: bool = False
    skip_nonfinite: bool = False
    deferred: bool = False
    sufficient_decrease: float = 0.0
    solve: Solver = svd_lstsq
    reg_column: float = 0.0  # mode "classic" (type2_anderson's)
    # Applied to the window's columns (oldest first) before each mix: mode "aadl" ``perturb(X)``,
    # mode "classic" ``perturb(xs, gs)``; to measure how far a mix moves when its data is
    # rounded (the test's own rounding model), None for the exact mix.
    perturb: Callable | None = None
    window: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.inner, (int, float)):
            self.inner = GradientDescent(float(self.inner))

    def _mix(self) -> np.ndarray:
        options = dict(reg=self.reg, reg_relative=self.reg_relative, solve=self.solve)
        if self.mode == "aadl":
            X = np.stack(self.window, axis=1)
            if self.perturb is not None:
                X = self.perturb(X)
            return aadl_extrapolate(X, self.relaxation, **options)
        xs = np.stack([p[0] for p in self.window], axis=1)
        gs = np.stack([p[1] for p in self.window], axis=1)
        if self.perturb is not None:
            xs, gs = self.perturb(xs, gs)
        return type2_anderson(xs, gs, self.relaxation, reg_column=self.reg_column, **options)

    def _averaged(self) -> np.ndarray | None:
        """The window mean if AADL's moving-average rule applies (spread > tol |mean|)."""
        if not self.average or len(self.window) < 2:
            return None
        W = np.stack(self.window, axis=1)
        mean = W.mean(axis=1)
        spread = np.sum((W - mean[:, None]) ** 2) / (W.shape[1] - 1)
        return mean if spread > self.average_tol**2 * (mean @ mean) else None

    def run(
        self,
        x0: np.ndarray,
        steps: int,
        loss: Callable[[np.ndarray], float] | None = None,
        inputs: list[np.ndarray] | None = None,
        accept: Iterable[bool] | None = None,
    ) -> tuple[list[np.ndarray], list[str]]:
        """The params after each of ``steps`` calls and, per call, what it returned: "plain",
        "mix", "rejected" (the plain step after the safeguard refused a finite mix),
        "reverted" (``deferred``: the previous plain step after ``loss`` refused the previous
        call's mix), "average" or "skipped".

        With ``inputs`` (another run's outputs), call ``j`` (0-based) receives ``inputs[j -
        1]`` as its params instead of the reference's own previous output, and a kept mix puts
        ``inputs[j]`` in the window: each call is then checked on that run's own data, so the
        (chaotic) recurrence does not amplify earlier rounding differences.
        """
        decisions = iter(accept) if accept is not None else None
        depth = self.history_depth
        self.window = []
        dtype = np.result_type(x0, np.float64)  # complex128 for a complex run (mode "classic")
        x = np.array(x0, dtype=dtype)
        inner_state = self.inner.init(x)
        outputs, kinds, k = [], [], 0
        pending, y = None, None  # deferred: the pending mix's reference loss, the last y
        for j in range(steps):
            if inputs is not None and j > 0:
                x = np.array(inputs[j - 1], dtype=dtype)
            if self.deferred:
                value = loss(x)
                if pending is not None and not value < pending:
                    pending, x = None, y.copy()
                    if self.restart_on_reject:
                        self.window = self.window[-1:]
                    outputs.append(x.copy())
                    kinds.append("reverted")
                    continue
            g = self.grad(x)
            y, new_inner = self.inner.step(x, g, inner_state)
            if self.skip_nonfinite and not (_finite(g) and _finite(y)):
                outputs.append(x.copy())
                kinds.append("skipped")
                continue
            k, inner_state = k + 1, new_inner
            if k % self.store_each_nth == 0:
                entry = y.copy() if self.mode == "aadl" else (x.copy(), y.copy())
                self.window = (self.window + [entry])[-depth:]
            kind, out = "plain", y
            mean = self._averaged() if self.mode == "aadl" else None
            needed = 3 if self.mode == "aadl" else 2
            gate = k > self.wait_iterations and k % self.frequency == 0
            if mean is not None:
                kind, out = "average", mean
            elif gate and len(self.window) >= needed:
                xm = self._mix()
                if _finite(xm):
                    judge = None if self.deferred else loss
                    kind, out = self._safeguard(xm, y, judge, decisions)
                    if kind == "mix" and (judge is not None or decisions is not None):
                        if self.mode == "aadl":
                            forced = inputs is not None and j < len(inputs)
                            self.window[-1] = np.array(inputs[j] if forced else xm)
                    if kind == "rejected" and self.restart_on_reject:
                        self.window = self.window[-1:]
            if self.deferred:
                slope = float(np.real(np.vdot(g, y - x)))
                bar = value
                if self.sufficient_decrease and np.isfinite(slope) and slope < 0:
                    bar = value + self.sufficient_decrease * slope
                pending = bar if kind == "mix" and np.isfinite(value) else None
            x = out
            outputs.append(x.copy())
            kinds.append(kind)
        return outputs, kinds

    @staticmethod
    def _safeguard(xm, y, loss, decisions) -> tuple[str, np.ndarray]:
        if decisions is not None:
            keep = next(decisions)
        elif loss is not None:
            lx = loss(xm)
            keep = bool(np.isfinite(lx) and lx < loss(y))
        else:
            keep = True
        return ("mix", xm) if keep else ("rejected", y)


# -- bounds on a run's rounding ----------------------------------------------------------------


# Each call's rounding is a perturbation of its window's data, of a size the dtypes fix (``u``
# the unit roundoff): every point by ``u_params`` relative (the inner step's subtraction, the
# grads rounded to the params' dtype), and every stored difference by ``u_window`` when the
# window is stored in a lower precision than the params (one rounding per stored entry), else
# by the backward error of the float64 solve, ``sqrt(n (m + 1)) u_64`` (QR or Gram sums over
# ``n`` coordinates and ``m + 1`` columns, probabilistically: Higham & Mary 2019).
#
# To first order a call's mix moves by ``J e`` for rounding errors ``e`` of those sizes, ``J``
# the mix's sensitivity to its data. The reference measures it: ``SENSITIVITY_SAMPLES`` random
# perturbations of those sizes (:func:`rounding_perturbation`), and their root mean square
# ``S`` estimates ``||J D||_F``, the spread of the mix under independent errors. The library
# and the reference each round once, independently: their difference spreads as ``sqrt(2)``
# of one. Divided by ``S``, one rounding's move is at most a Student t with
# ``SENSITIVITY_SAMPLES`` degrees of freedom (equality when ``J`` is rank one, where the
# estimate is least sure; a larger rank concentrates both), and ``P(|t_16| > 8) = 6e-7``.
# So the bound is ``BOUND_FACTOR = 8 sqrt(2)`` times ``S``, plus the combination's own
# rounding, ``(m + 2) u_params`` (``m + 1`` terms and the result's rounding). No constant is
# fitted per test: a window near rank deficiency gets a larger bound from its own larger
# sensitivity, a well-conditioned one a bound near the dtypes' rounding.
#
# It was 8 times the larger of two random-sign samples: for a nearly rank-one ``J`` that
# misses two roundings' difference in about 2 calls of 100 (the same model, simulated), and
# two calls of tests/test_sharded_precision.py missed it (docs/numerics.md).
SENSITIVITY_SAMPLES = 16
BOUND_FACTOR = 8.0 * float(np.sqrt(2.0))


def sensitivity(moves: np.ndarray) -> np.ndarray:
    """``S``, the root mean square over the samples (axis 0) of how far a perturbed mix
    moved: the estimate of ``||J D||_F`` the bounds scale (see above)."""
    return np.sqrt(np.mean(np.square(moves), axis=0))


def solve_roundoff(n: int, history_depth: int) -> float:
    """The float64 solve's backward error over ``n`` coordinates and ``history_depth + 1``
    columns, ``sqrt(n (m + 1)) u_64`` (probabilistic)."""
    return float(np.sqrt(n * (history_depth + 1))) * 2.0**-53


def rounding_bounds(
    reference: Callable[[], Recurrence],
    x0: np.ndarray,
    outputs: list,
    u_params: float,
    u_diff: float,
    loss: Callable | None = None,
    samples: int = SENSITIVITY_SAMPLES,
    u_point: float | None = None,
) -> np.ndarray:
    """Each call's bound on the relative error of a run's ``outputs`` against ``reference()``
    replaying them (see above): ``reference`` makes a fresh :class:`Recurrence`. ``u_point``:
    the points' perturbation when it is not ``u_params`` (0 to compare two runs fed the same
    rounded points, which differ only by their windows)."""
    steps = len(outputs)
    exact = reference().run(x0, steps, loss, inputs=outputs)[0]
    u_point = u_params if u_point is None else u_point
    moves = []
    for sample in range(samples):
        perturbed = reference()
        perturbed.perturb = rounding_perturbation(u_point, u_diff, seed=sample)
        out = perturbed.run(x0, steps, loss, inputs=outputs)[0]
        moves.append([_relative(a, b) for a, b in zip(out, exact)])
    return BOUND_FACTOR * sensitivity(np.array(moves)) + (perturbed.history_depth + 2) * u_params


def mix_bound(
    mix: Callable[[np.ndarray], np.ndarray],
    window: np.ndarray,
    u_params: float,
    u_diff: float,
    u_point: float | None = None,
    samples: int = SENSITIVITY_SAMPLES,
) -> float:
    """:func:`rounding_bounds` for one mix of a given window: the bound on the relative error
    of a library's mix of ``window`` (``(n, k)``, oldest first) against ``mix(window)``,
    ``BOUND_FACTOR`` times how far ``mix`` moves when the window is perturbed as rounding does
    (:func:`rounding_perturbation`), plus the combination's ``(k + 1) u_params``."""
    exact = mix(window)
    u_point = u_params if u_point is None else u_point
    moves = [
        _relative(mix(rounding_perturbation(u_point, u_diff, seed=sample)(window)), exact)
        for sample in range(samples)
    ]
    return float(BOUND_FACTOR * sensitivity(np.array(moves))) + (window.shape[1] + 1) * u_params


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

"""The rows of the suite and their tuning.

Peers: plain gradient descent, the inner optimizer of the recommended AA configuration alone
(Adam without momentum), Adam, ``torch.optim.LBFGS`` with the strong Wolfe line search and, on
the PINNs, Adam then L-BFGS. AA: the configuration ``docs/guide.md`` recommends for full-batch
training, unchanged on every problem (``AA default``), and the same configuration with its
learning rate tuned (``AA tuned``). AA around the L-BFGS inner transformation (``aa.lbfgs``,
no line search): one configuration on every problem (``AA-L-BFGS default``) and its learning
rate tuned (``AA-L-BFGS tuned``); that transformation alone, its learning rate tuned, is a
peer (``L-BFGS inner alone``). Every tuned family has a grid of 6 settings; the setting
kept is the one that reaches the tuning target on the most tuning seeds, then in the fewest
gradient evaluations, then with the lowest final loss (``_compare.tuning_score``). The tuning
seeds are not the reported ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import digits_demo
import pinn
import torch
from _common import PlainOptimizer
from _compare import ST_AM_LR, Method, adam_method, lbfgs_method, st_am_method

import aadl_func as aa

from .problem import Spec

LRS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3)  # Adam's, the inner optimizer's and AA's grid
# docs/guide.md's full-batch line: aa.anderson(aa.adam(0.05, betas=(0.0, 0.999)),
# mode="classic", history_depth=20, reg_relative=1e-4), update(..., loss=value).
DEFAULT_AA = {"lr": 0.05, "history_depth": 20, "reg_relative": 1e-4}
# AA around the L-BFGS inner transformation (aa.lbfgs, no line search), one configuration on
# every problem; its tuned row takes the same lr grid as its inner alone.
# Mixing every 5th call: mixing every call wasted about half the gradients at rejected mixes
# and lost to the inner alone (seed 100: softmax 92 against 50 evaluations, Rosenbrock not
# reaching 1e-4 in 300 against 66).
DEFAULT_AA_LBFGS = {
    "lr": 1.0, "memory_size": 10, "mode": "classic", "history_depth": 3, "frequency": 5,
    "reg_relative": 1e-4,
}  # fmt: skip
LBFGS_LRS = (0.03, 0.1, 0.2, 0.3, 0.5, 1.0)
PEERS = ("gd", "inner", "adam", "lbfgs", "adam_lbfgs", "lbfgs_inner")
# AA default judged by a sufficient decrease (`sufficient_decrease`, Armijo's condition with the
# plain step as the yardstick): c = 0.5, chosen on the Poisson PINN's seed 0 against c = 0.1
# (issue 36: there AA default's accepted mixes stall at a loss near 1 while Adam goes on).
SUFFICIENT_DECREASE = 0.5
# Short-term recurrence Anderson mixing (aa.short_recurrence, two conjugate pairs, the
# deferred safeguard): around Adam (beta1 0) at one lr on every problem, chosen on the tuning
# seeds (100, 101) against 0.003, 0.01, 0.05 and 0.1 on the softmax, Rosenbrock and Poisson
# problems, and tuned on the AA grid; around gradient descent (a fixed metric, where its
# iterates are CG's on a quadratic) tuned on a grid of its own, as GD's lr has no default.
DEFAULT_ST_AM = {"lr": ST_AM_LR}
# The same with the waits after rejected mixes (`max_wait`, issue 36's "fewer wasted
# gradients"): the longest wait 16, against 4 on the tuning seed 100 (the same runs there).
ST_AM_MAX_WAIT = 16
ST_AM_GD_LRS = (1e-3, 4e-3, 0.016, 0.063, 0.25, 1.0)
ACCELERATED = (
    "aa_default", "aa_tuned", "aa_sufficient", "aa_line_search", "aa_float64_window",
    "aa_restart", "aa_lbfgs_default",
    "aa_lbfgs_tuned",
    "st_am_default", "st_am_waits", "st_am_tuned", "st_am_gd_tuned",
)  # fmt: skip
TUNED_ROWS = ("aa_tuned", "aa_lbfgs_tuned", "st_am_tuned", "st_am_gd_tuned")


def inner_method(lr: float) -> Method:
    """The inner optimizer of the AA rows, alone."""
    method = adam_method(lr, (0.0, 0.999))
    return dataclasses.replace(method, label="inner alone (Adam, beta1 0)")


def aa_method(lr: float, label: str) -> Method:
    """The recommended configuration with the learning rate ``lr``, judged by the deferred
    safeguard: ``update(..., loss=value)`` with the loss computed with the gradient."""
    options = {**DEFAULT_AA, "lr": lr}
    return dataclasses.replace(digits_demo.aa_method(**options, safeguard="deferred"), label=label)


def aa_default() -> Method:
    return aa_method(DEFAULT_AA["lr"], "AA default")


def _default_with(**extra) -> Callable[[], aa.Anderson]:
    """AA default's optimizer with the options ``extra`` added."""
    o = DEFAULT_AA
    return lambda: aa.anderson(
        aa.adam(o["lr"], betas=(0.0, 0.999)),
        mode="classic",
        history_depth=o["history_depth"],
        reg_relative=o["reg_relative"],
        **extra,
    )


def _with_option(label: str, name: str, value: Any) -> Method:
    """AA default with the option ``name=value`` added (its label, make, options and
    description alike)."""
    base = aa_default()
    text = f"{value:g}" if isinstance(value, float) else repr(value)
    return dataclasses.replace(
        base,
        label=label,
        make=_default_with(**{name: value}),
        options={**base.options, name: value},
        description=base.description.replace(
            "reg_relative=0.0001)", f"reg_relative=0.0001, {name}={text})"
        ),
    )


def aa_sufficient() -> Method:
    """AA default with ``sufficient_decrease=SUFFICIENT_DECREASE``: a mix is kept only if its
    loss is below the bar ``loss(x_k) + c grads.u_k`` (one more O(n) dot per call)."""
    return _with_option(
        "AA default, sufficient decrease", "sufficient_decrease", SUFFICIENT_DECREASE
    )


def aa_line_search() -> Method:
    """AA default with N-GMRES's step (issue 36's first candidate) in place of the deferred
    safeguard: ``line_search=True``, the loss searched along the mix from the plain step
    (SciPy's Armijo search, phi'(0) by one forward-mode derivative; a direction that does not
    descend restarts the window), ``update(..., loss_fn=train_loss)``. Every ``loss_fn`` call
    counts one gradient-equivalent, the one inside the forward-mode derivative included."""
    base = aa_default()
    return dataclasses.replace(
        base,
        label="AA default, line search",
        make=_default_with(line_search=True),
        safeguard=True,
        deferred=False,
        options={**base.options, "safeguard": "loss_fn", "line_search": True},
        description=base.description.replace(
            "reg_relative=0.0001), update(..., loss=train_loss)",
            "reg_relative=0.0001, line_search=True), update(..., loss_fn=train_loss)",
        ),
    )


def aa_float64_window() -> Method:
    """AA default with a float64 window (``history_dtype=torch.float64``; issue 36's "float64
    windows for the tail"): the residuals and iterates stored, and the Gram rows formed, in
    float64 while the params and the inner step stay in the problem's dtype."""
    base = aa_default()
    return dataclasses.replace(
        base,
        label="AA default, float64 window",
        make=_default_with(history_dtype=torch.float64),
        options={**base.options, "history_dtype": "float64"},
        description=base.description.replace(
            "reg_relative=0.0001)", "reg_relative=0.0001, history_dtype=torch.float64)"
        ),
    )


def aa_restart() -> Method:
    """AA default with ``restart_on_reject=True``: when the deferred safeguard rejects a mix,
    the window restarts from its newest pair (issue 36's "restart when the rejection rate is
    high", at every rejection; no cost of its own)."""
    return _with_option("AA default, restart on reject", "restart_on_reject", True)


def lbfgs_inner_method(lr: float) -> Method:
    """The L-BFGS inner transformation alone: its direction with the fixed step ``lr``."""
    memory = DEFAULT_AA_LBFGS["memory_size"]
    return Method(
        "L-BFGS inner alone (no line search)",
        "functional",
        make=lambda: PlainOptimizer(aa.lbfgs(lr, memory_size=memory)),
        options={"lr": lr, "memory_size": memory},
        description=f"aa.lbfgs({lr:g}, memory_size={memory})",
    )


def aa_lbfgs_method(lr: float, label: str) -> Method:
    """AA around ``aa.lbfgs(lr)`` with the other options of ``DEFAULT_AA_LBFGS``, judged by the
    deferred safeguard (``update(..., loss=value)``)."""
    o = {**DEFAULT_AA_LBFGS, "lr": lr}
    memory = o.pop("memory_size")
    inner = f"aa.lbfgs({lr:g}, memory_size={memory})"
    anderson = {k: v for k, v in o.items() if k != "lr"}
    return Method(
        label,
        "functional",
        make=lambda: aa.anderson(aa.lbfgs(lr, memory_size=memory), **anderson),
        deferred=True,
        options={"inner": inner, **anderson, "safeguard": "deferred"},
        description=(
            f"aa.anderson({inner}, "
            + ", ".join(f"{k}={v!r}" for k, v in anderson.items())
            + "), update(..., loss=train_loss)"
        ),
    )


def aa_lbfgs_default() -> Method:
    return aa_lbfgs_method(DEFAULT_AA_LBFGS["lr"], "AA-L-BFGS default")


def st_am_default() -> Method:
    return st_am_method(DEFAULT_ST_AM["lr"], "ST-AM default")


def st_am_waits() -> Method:
    return st_am_method(DEFAULT_ST_AM["lr"], "ST-AM default, waits", max_wait=ST_AM_MAX_WAIT)


def grids(spec: Spec) -> dict[str, list[Method]]:
    """6 settings per tuned family."""
    families = {
        "gd": [pinn.gd_method(lr) for lr in spec.gd_lrs],
        "inner": [inner_method(lr) for lr in LRS],
        "adam": [adam_method(lr, (0.9, 0.999)) for lr in LRS],
        "lbfgs": [lbfgs_method(lr, h) for lr in (0.3, 1.0) for h in (5, 20, 100)],
        "aa_tuned": [aa_method(lr, "AA tuned") for lr in LRS],
        "lbfgs_inner": [lbfgs_inner_method(lr) for lr in LBFGS_LRS],
        "aa_lbfgs_tuned": [aa_lbfgs_method(lr, "AA-L-BFGS tuned") for lr in LBFGS_LRS],
        "st_am_tuned": [st_am_method(lr, "ST-AM tuned") for lr in LRS],
        "st_am_gd_tuned": [st_am_method(lr, "ST-AM-GD tuned", "sgd") for lr in ST_AM_GD_LRS],
    }
    if spec.pinn:
        families["adam_lbfgs"] = [
            pinn.adam_lbfgs_method(lr, steps) for lr in (3e-3, 0.01, 0.03) for steps in (100, 300)
        ]
    assert all(len(grid) == 6 for grid in families.values())
    return families

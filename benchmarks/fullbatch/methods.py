"""The rows of the suite and their tuning.

Peers: plain gradient descent, the inner optimizer of the recommended AA configuration alone
(Adam without momentum), Adam, ``torch.optim.LBFGS`` with the strong Wolfe line search and, on
the PINNs, Adam then L-BFGS. AA: the configuration ``docs/guide.md`` recommends for full-batch
training, unchanged on every problem (``AA default``), and the same configuration with its
learning rate tuned (``AA tuned``). Every tuned family has a grid of 6 settings; the setting
kept is the one that reaches the tuning target on the most tuning seeds, then in the fewest
gradient evaluations, then with the lowest final loss (``_compare.tuning_score``). The tuning
seeds are not the reported ones.
"""

from __future__ import annotations

import dataclasses

import digits_demo
import pinn
from _compare import Method, adam_method, lbfgs_method

from .problem import Spec

LRS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3)  # Adam's, the inner optimizer's and AA's grid
# docs/guide.md's full-batch line: aa.anderson(aa.adam(0.05, betas=(0.0, 0.999)),
# mode="classic", history_depth=20, reg_relative=1e-4), update(..., loss=value).
DEFAULT_AA = {"lr": 0.05, "history_depth": 20, "reg_relative": 1e-4}
PEERS = ("gd", "inner", "adam", "lbfgs", "adam_lbfgs")
ACCELERATED = ("aa_default", "aa_tuned")


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


def grids(spec: Spec) -> dict[str, list[Method]]:
    """6 settings per tuned family."""
    families = {
        "gd": [pinn.gd_method(lr) for lr in spec.gd_lrs],
        "inner": [inner_method(lr) for lr in LRS],
        "adam": [adam_method(lr, (0.9, 0.999)) for lr in LRS],
        "lbfgs": [lbfgs_method(lr, h) for lr in (0.3, 1.0) for h in (5, 20, 100)],
        "aa_tuned": [aa_method(lr, "AA tuned") for lr in LRS],
    }
    if spec.pinn:
        families["adam_lbfgs"] = [
            pinn.adam_lbfgs_method(lr, steps) for lr in (3e-3, 0.01, 0.03) for steps in (100, 300)
        ]
    assert all(len(grid) == 6 for grid in families.values())
    return families

r"""An MLP regression on scikit-learn's bundled diabetes data (442 patients, 10 standardised
features, the standardised disease progression as the target): ``10 -> 16 -> 16 -> 1``, tanh
(465 parameters), mean squared error plus $\tfrac{\lambda}{2} \lVert \theta \rVert^2$,
$\lambda = 10^{-2}$ (enough to make the long float64 runs from different starts agree
on $f^*$). Non-convex; the seed draws the initial weights."""

from __future__ import annotations

import torch
from _common import detached_params
from torch import nn
from torch.func import functional_call

from .problem import Spec, full_batch, half_square_norm

WEIGHT_DECAY = 1e-2
WIDTH = 16


def make(seed: int, dtype: torch.dtype):
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float64)
    y = torch.tensor(data.target, dtype=torch.float64)
    x = ((x - x.mean(0)) / x.std(0)).to(dtype)
    y = ((y - y.mean()) / y.std()).to(dtype)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(10, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    ).to(dtype)

    def train_loss(params):
        prediction = functional_call(model, params, (x,)).reshape(-1)
        return ((prediction - y) ** 2).mean() + WEIGHT_DECAY * half_square_norm(params)

    return full_batch(detached_params(model), train_loss)


SPEC = Spec(
    key="mlp_regression",
    title="MLP regression, diabetes (465 parameters, 442 samples, L2 1e-2)",
    make=make,
    gd_lrs=(0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
)

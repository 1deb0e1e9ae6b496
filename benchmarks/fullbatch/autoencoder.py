r"""An autoencoder of scikit-learn's bundled digits (1,797 images of 64 pixels scaled to
$[0, 1]$): ``64 -> 32 -> 8 -> 32 -> 64``, tanh, a linear output (4,680 parameters); the mean
squared reconstruction error plus $\tfrac{\lambda}{2} \lVert \theta \rVert^2$,
$\lambda = 10^{-4}$. Non-convex, with the symmetries of the code layer; the seed draws the
initial weights."""

from __future__ import annotations

import torch
from _common import detached_params
from torch import nn
from torch.func import functional_call

from .problem import Spec, full_batch, half_square_norm

WEIGHT_DECAY = 1e-4


def make(seed: int, dtype: torch.dtype):
    from sklearn.datasets import load_digits

    x = torch.tensor(load_digits().data / 16.0, dtype=dtype)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(),
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 64),
    ).to(dtype)  # fmt: skip

    def train_loss(params):
        reconstruction = functional_call(model, params, (x,))
        return ((reconstruction - x) ** 2).mean() + WEIGHT_DECAY * half_square_norm(params)

    return full_batch(detached_params(model), train_loss)


SPEC = Spec(
    key="autoencoder",
    title="autoencoder, digits (64-32-8-32-64, 4,680 parameters, 1,797 images, L2 1e-4)",
    make=make,
    gd_lrs=(0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
)

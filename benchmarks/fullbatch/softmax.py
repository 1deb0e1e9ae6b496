r"""L2-regularised softmax regression on scikit-learn's bundled digits (1,797 images of 64
pixels scaled to $[0, 1]$, 10 classes; 650 parameters): mean cross-entropy plus
$\tfrac{\lambda}{2} \lVert \theta \rVert^2$, $\lambda = 10^{-3}$. Convex with a unique
minimiser; the seed draws the initial weights (``nn.Linear``'s initialisation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import detached_params
from torch import nn
from torch.func import functional_call

from .problem import Spec, full_batch, half_square_norm

WEIGHT_DECAY = 1e-3


def make(seed: int, dtype: torch.dtype):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=dtype)
    y = torch.tensor(data.target, dtype=torch.int64)
    torch.manual_seed(seed)
    model = nn.Linear(64, 10).to(dtype)

    def train_loss(params):
        logits = functional_call(model, params, (x,))
        return F.cross_entropy(logits, y) + WEIGHT_DECAY * half_square_norm(params)

    return full_batch(detached_params(model), train_loss)


SPEC = Spec(
    key="softmax",
    title="softmax regression, digits (650 parameters, 1,797 images, L2 1e-3)",
    make=make,
    gd_lrs=(0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
)

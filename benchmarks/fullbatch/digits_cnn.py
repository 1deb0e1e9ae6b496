r"""The digits CNN of ``examples/digits_demo.py`` (the same data, split and model, 3,818
parameters) with an L2 term: mean cross-entropy over the 1,347 training images plus
$\tfrac{\lambda}{2} \lVert \theta \rVert^2$, $\lambda = 10^{-3}$. Without it the cross-entropy of
a network that separates the training set has no minimum (its infimum is 0), so there would be
no $f^*$ to measure suboptimality against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import detached_params, load_digits, make_cnn
from torch.func import functional_call

from .problem import Spec, full_batch, half_square_norm

WEIGHT_DECAY = 1e-3


def make(seed: int, dtype: torch.dtype):
    data = load_digits(dtype=dtype, seed=0)
    model = make_cnn(seed=seed, dtype=dtype)

    def train_loss(params):
        logits = functional_call(model, params, (data.x_train,))
        return F.cross_entropy(logits, data.y_train) + WEIGHT_DECAY * half_square_norm(params)

    return full_batch(detached_params(model), train_loss)


SPEC = Spec(
    key="digits_cnn",
    title="digits CNN (the demo's; 3,818 parameters, 1,347 images, L2 1e-3)",
    make=make,
    gd_lrs=(0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
)

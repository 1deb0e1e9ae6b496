r"""A harder PINN: the steady viscous Burgers equation on $(-1, 1)$ with a sharp interior layer,

$$ u u' = \nu u'', \qquad u(\pm 1) = \mp \tanh\!\big(\tfrac{1}{2\nu}\big), \qquad
   u^*(x) = -\tanh\!\big(\tfrac{x}{2\nu}\big), \quad \nu = 0.05 $$

($u^{*\prime} = -\tfrac{1}{2\nu}\operatorname{sech}^2$ and
$\nu u^{*\prime\prime} = \tfrac{1}{2\nu} \operatorname{sech}^2 \tanh = u^* u^{*\prime}$: the
exact solution; the layer is about $4\nu = 0.2$ wide). An MLP ``1 -> 20 -> 20 -> 1``, tanh
(481 parameters), on the loss

$$ L = \operatorname{mean}_i \big(u u' - \nu u''\big)^2(x_i)
     + \tfrac12 \big((u(-1) - u^*(-1))^2 + (u(1) - u^*(1))^2\big) $$

over 128 equispaced interior collocation points; judged by the relative $L^2$ error of $u$
against $u^*$ on 1,001 points. The nonlinear residual and the layer make it harder than the
Poisson problem: the network first settles near a smooth wrong profile."""

from __future__ import annotations

import torch
from pinn import derivatives, make_model, pointwise
from torch import Tensor

from .problem import Spec, full_batch

NU = 0.05
COLLOCATION = 128


def exact(x: Tensor) -> Tensor:
    return -torch.tanh(x / (2 * NU))


def make(seed: int, dtype: torch.dtype):
    model = make_model(seed, dtype)
    x = torch.linspace(-1, 1, COLLOCATION + 2, dtype=dtype)[1:-1]
    boundary = torch.tensor([-1.0, 1.0], dtype=dtype)
    u_boundary = exact(boundary)
    x_test = torch.linspace(-1, 1, 1001, dtype=dtype)
    u_test = exact(x_test)

    u = pointwise(model)

    def train_loss(params: dict[str, Tensor]) -> Tensor:
        du, d2u = derivatives(u, params, x)
        residual = u(params, x) * du(x) - NU * d2u
        edge = u(params, boundary) - u_boundary
        return (residual**2).mean() + 0.5 * (edge**2).sum()

    def l2_error(params: dict[str, Tensor]) -> float:
        with torch.no_grad():
            return ((u(params, x_test) - u_test).norm() / u_test.norm()).item()

    initial = {n: p.detach() for n, p in model.named_parameters()}
    return full_batch(initial, train_loss, track=l2_error)


SPEC = Spec(
    key="burgers_pinn",
    title=f"PINN, steady 1-D Burgers, nu = {NU:g} (481 parameters, {COLLOCATION} points)",
    make=make,
    gd_lrs=(1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3),
    pinn=True,
)

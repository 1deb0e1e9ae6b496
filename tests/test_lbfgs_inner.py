"""Tests of `aa.lbfgs`, the L-BFGS inner transformation, against a float64 NumPy reference of
the two-loop recursion, the BFGS theory on quadratics, vmap and `aa.anderson`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import grad, vmap

import aadl_func as aa
from aadl_func._src.lbfgs import two_loop

# --------------------------------------------------------------------------------------------
# The reference: L-BFGS's direction from Nocedal & Wright, Algorithm 7.4, on a list of pairs.
# --------------------------------------------------------------------------------------------


class NumpyLbfgs:
    """The pairs as a Python list (oldest first), the two-loop recursion as written in the
    textbook, and the curvature test `s.y > eps * y.y` that drops a pair."""

    def __init__(self, lr, memory_size, scale=True, eps=1e-10):
        self.lr, self.m, self.scale, self.eps = lr, memory_size, scale, eps
        self.pairs, self.gamma, self.prev = [], 1.0, None

    def step(self, x, g):
        if self.prev is not None:
            s, y = x - self.prev[0], g - self.prev[1]
            if s @ y > self.eps * (y @ y):
                self.pairs = [*self.pairs, (s, y)][-self.m :]
                if self.scale:
                    self.gamma = (s @ y) / (y @ y)
        self.prev = (x.copy(), g.copy())
        q, alphas = g.copy(), []
        for s, y in reversed(self.pairs):  # newest first
            alpha = (s @ q) / (s @ y)
            q = q - alpha * y
            alphas.append(alpha)
        r = self.gamma * q
        for (s, y), alpha in zip(self.pairs, reversed(alphas)):  # oldest first
            beta = (y @ r) / (s @ y)
            r = r + (alpha - beta) * s
        return -self.lr * r


def _split(v):
    return {"a": torch.tensor(v[:3]), "b": torch.tensor(v[3:]).reshape(2, 2)}


def _join(tree):
    return np.concatenate([tree["a"].numpy().ravel(), tree["b"].numpy().ravel()])


def _sequence(n_steps, skip_at, seed=0):
    """Params and gradients (7 entries); at call `skip_at` the gradient change is `-s`,
    whose curvature `s.y < 0` must drop the pair."""
    rng = np.random.default_rng(seed)
    hess = rng.standard_normal((7, 7))
    hess = hess @ hess.T + np.eye(7)
    xs = [rng.standard_normal(7)]
    gs = [hess @ xs[0] + 0.1 * np.sin(xs[0])]
    for k in range(1, n_steps):
        xs.append(xs[-1] + rng.standard_normal(7))
        if k == skip_at:
            gs.append(gs[-1] - (xs[-1] - xs[-2]))
        else:
            gs.append(hess @ xs[-1] + 0.1 * np.sin(xs[-1]))
    return xs, gs


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("inplace", [True, False])
def test_matches_numpy_two_loop_with_a_skipped_pair(scale, inplace):
    xs, gs = _sequence(9, skip_at=4)
    ref = NumpyLbfgs(lr=0.7, memory_size=3, scale=scale)
    opt = aa.lbfgs(lr=0.7, memory_size=3, scale_init_precond=scale)
    state = opt.init(_split(xs[0]))
    for k, (x, g) in enumerate(zip(xs, gs)):
        params = _split(x)
        updates, state = opt.update(_split(g), state, params=params, inplace=inplace)
        np.testing.assert_allclose(_join(updates), ref.step(x, g), rtol=1e-11, atol=1e-12)
        assert int(state.num_pairs) == k - (k >= 4)  # stored so far: the 4th is dropped
    assert int(state.count) == 9
    assert int(state.num_pairs) == 7  # 8 pairs made, the one at call 4 dropped
    assert torch.equal(params["a"], torch.tensor(xs[-1][:3]))  # params are never written


def test_first_call_is_a_gradient_step():
    params = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(3.0)}
    grads = {"w": torch.tensor([0.5, 4.0]), "b": torch.tensor(-1.0)}
    opt = aa.lbfgs(lr=0.25)
    updates, _ = opt.update(dict(grads), opt.init(params), params=params, inplace=False)
    for key in grads:
        torch.testing.assert_close(updates[key], -0.25 * grads[key], rtol=0, atol=0)


def _conjugate_steps(hess, rng):
    """Columns that are `hess`-conjugate (Gram-Schmidt in the `hess` inner product)."""
    steps = []
    for v in rng.standard_normal((hess.shape[0], hess.shape[0])):
        for s in steps:
            v = v - (s @ hess @ v) / (s @ hess @ s) * s
        steps.append(v)
    return steps


def test_conjugate_pairs_on_a_quadratic_give_newton():
    """BFGS's hereditary property: with pairs `y = A s` along `A`-conjugate steps, every
    update keeps `H y_i = s_i` for the earlier pairs, so after d pairs `H = A^{-1}`, whatever
    `H^0 = gamma I` is, and the returned step is Newton's, to the minimiser."""
    d = 7
    rng = np.random.default_rng(3)
    hess = rng.standard_normal((d, d))
    hess = hess @ hess.T + 0.5 * np.eye(d)
    b = rng.standard_normal(d)
    x = rng.standard_normal(d)
    opt = aa.lbfgs(lr=1.0, memory_size=d)
    state = opt.init(_split(x))
    for s in [*_conjugate_steps(hess, rng), None]:
        updates, state = opt.update(_split(hess @ x - b), state, params=_split(x), inplace=False)
        x = x + s if s is not None else x
    assert int(state.num_pairs) == d
    np.testing.assert_allclose(x + _join(updates), np.linalg.solve(hess, b), rtol=1e-9)
    # And H y_i = s_i for every stored pair, by the recursion on y_i as the gradient.
    order = torch.arange(d)
    for i in range(d):
        hy = two_loop(
            state.y_memory[i], state.s_memory, state.y_memory, state.rho, state.gamma, order
        )
        torch.testing.assert_close(hy, state.s_memory[i], rtol=1e-9, atol=1e-10)


def test_unit_steps_on_a_quadratic_satisfy_the_secant_equation_and_converge():
    """Its own unit steps on a strictly convex quadratic: the newest pair is exact and the
    method (BFGS with memory >= the steps taken) reaches the minimiser in float64."""
    d = 6
    rng = np.random.default_rng(5)
    hess = rng.standard_normal((d, d))
    hess = hess @ hess.T + np.eye(d)
    b = rng.standard_normal(d + 1)[:d]
    hess_t, b_t = torch.tensor(hess), torch.tensor(b)
    opt = aa.lbfgs(lr=1.0, memory_size=30)
    params = {"x": torch.zeros(d, dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(25):
        grads = {"x": hess_t @ params["x"] - b_t}
        updates, state = opt.update(grads, state, params=params, inplace=False)
        params = {"x": params["x"] + updates["x"]}
        newest = (int(state.num_pairs) - 1) % 30
        s, y = state.s_memory[newest], state.y_memory[newest]
        torch.testing.assert_close(y, hess_t @ s, rtol=1e-10, atol=1e-12)
        order = (state.num_pairs - 1 - torch.arange(30)) % 30
        hy = two_loop(y, state.s_memory, state.y_memory, state.rho, state.gamma, order)
        torch.testing.assert_close(hy, s, rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(params["x"].numpy(), np.linalg.solve(hess, b), atol=1e-10)


def _loss(params):
    a, b = params["a"], params["b"]
    return (a**2).sum() + 0.5 * ((b - 1.0) ** 4).sum() + (a.sum() * b.sum()) ** 2 / 8


@pytest.mark.parametrize("inplace", [False, True])
def test_vmap_equals_the_loop(inplace):
    opt = aa.lbfgs(lr=0.5, memory_size=3)
    members = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(flat):
        params = {"a": flat[:3], "b": flat[3:].reshape(2, 2)}
        state = opt.init(params)
        for _ in range(6):
            updates, state = opt.update(grad(_loss)(params), state, params=params, inplace=inplace)
            params = {k: params[k] + updates[k] for k in params}
        return params["a"], params["b"], state.num_pairs

    batched = vmap(run)(members)
    for i, flat in enumerate(members):
        for got, expected in zip(batched, run(flat)):
            torch.testing.assert_close(got[i], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["aadl", "classic"])
def test_inside_anderson(mode):
    """AA around L-BFGS's step reaches the minimiser of a smooth convex problem, in place and
    pure alike, with the deferred safeguard."""
    opt = aa.anderson(aa.lbfgs(lr=0.5, memory_size=5), history_depth=3, mode=mode)
    results = []
    for inplace in (True, False):
        params = {"a": torch.ones(3, dtype=torch.float64), "b": torch.zeros(2, 2).double()}
        state = opt.init(params)
        for _ in range(60):
            grads, value = torch.func.grad_and_value(_loss)(params)
            params, state = opt.update(state, params, grads, inplace=inplace, loss=value)
        assert isinstance(state.inner_state, aa.LbfgsState)
        assert int(state.num_mixed) > 0
        results.append(params)
    expected = {"a": torch.zeros(3, dtype=torch.float64), "b": torch.ones(2, 2).double()}
    for params in results:
        for k in expected:  # b - 1 converges slowly (quartic), a fast (quadratic)
            torch.testing.assert_close(params[k], expected[k], rtol=0, atol=2e-3)
    for k in expected:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"memory_size": 0}, "memory_size"),
        ({"curvature_eps": -1e-3}, "curvature_eps"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        aa.lbfgs(**kwargs)


def test_update_requires_params_and_leaves_the_state_alone():
    opt = aa.lbfgs()
    params = {"w": torch.ones(3)}
    state = opt.init(params)
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match="`params`"):
        opt.update({"w": torch.ones(3)}, state)
    for t, b in zip(state, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize(
    ("made", "field"),
    [(dict(memory_size=4), "s_memory"), (dict(params={"w": torch.ones(2)}), "s_memory")],
)
def test_direct_update_refuses_a_state_for_another_memory_or_params(made, field):
    """Called directly (not through anderson, which checks the inner state itself), a state
    made for another memory size or for other params is refused, naming the field, before
    anything is written: the state and the gradient buffers are as they were."""
    opt = aa.lbfgs(memory_size=3)
    params = {"w": torch.ones(3)}
    state = aa.lbfgs(memory_size=made.get("memory_size", 3)).init(made.get("params", params))
    grads = {"w": torch.full((3,), 0.5)}
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match=rf"lbfgs: `state\.{field}`"):
        opt.update(grads, state, params=params, inplace=True)
    assert all(torch.equal(t, b) for t, b in zip(state, before))
    assert torch.equal(grads["w"], torch.full((3,), 0.5))


def test_anderson_refuses_a_state_for_other_params():
    opt = aa.anderson(aa.lbfgs(), history_depth=3)
    state = opt.init({"w": torch.ones(3)})
    small = aa.lbfgs().init({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="s_memory"):
        opt.update(state._replace(inner_state=small), {"w": torch.ones(3)}, {"w": torch.ones(3)})


def test_state_saves_and_loads_with_weights_only(tmp_path):
    """The state is a NamedTuple of tensors: `torch.load(weights_only=True)` rebuilds it, and
    the run resumes with the same updates."""
    opt = aa.lbfgs(lr=0.5, memory_size=2)
    params = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.ones(2, 2)}
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update(grad(_loss)(params), state, params=params, inplace=False)
        params = {k: params[k] + updates[k] for k in params}
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert isinstance(loaded, aa.LbfgsState)
    g = grad(_loss)(params)
    expected, _ = opt.update(g, state, params=params, inplace=False)
    got, _ = opt.update(g, loaded, params=params, inplace=False)
    for k in expected:
        assert torch.equal(got[k], expected[k])


def _watch(*trees):
    """Every tensor of `trees` with a copy of its values and its version counter."""
    tensors = [x for t in trees for x in (t.values() if isinstance(t, dict) else t)]
    return [(x, x.clone(), x._version) for x in tensors if isinstance(x, torch.Tensor)]


def _unchanged(watched):
    """Same versions, and same values where there are any (a meta tensor has none)."""
    return all(
        x._version == version and (x.is_meta or torch.equal(x, copy))
        for x, copy, version in watched
    )


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize(
    ("grads", "params", "error", "message"),
    [
        (torch.ones(1), None, ValueError, r"`updates\['w'\]` has shape \(1,\), expected \(5,\)"),
        (torch.ones(2, 5), None, ValueError, r"has shape \(2, 5\), expected \(5,\) like `params"),
        (
            torch.ones(4),
            None,
            ValueError,
            r"has shape \(4,\), expected \(5,\) like `params\['w'\]`",
        ),
        (torch.ones(5, 1), None, ValueError, r"has shape \(5, 1\), expected \(5,\)"),
        (
            torch.tensor([3, 5, 9, 1, 1]),
            None,
            TypeError,
            r"`updates\['w'\]` must be real floating-point like `params\['w'\]`, got torch.int64",
        ),
        (torch.ones(5, dtype=torch.complex64), None, TypeError, "got torch.complex64"),
        (
            torch.ones(5, device="meta"),
            None,
            ValueError,
            r"`updates\['w'\]` is on device meta, expected",
        ),
        (torch.ones(5), 1.0, TypeError, r"`params` must be a pytree of tensors; `params\['w'\]`"),
    ],
    ids=["one", "matrix", "shorter", "column", "int", "complex", "device", "params-float"],
)
def test_direct_update_refuses_grads_that_do_not_fit_the_params(
    grads, params, error, message, inplace
):
    """Called alone (not under `anderson`, which checks the grads first), grads of another
    shape, dtype or device than the params are refused, naming the leaf, before anything is
    written. Without the check the in-place update wrote the state's params and grads and
    then raised torch's error, a (5, 1) update came back as (5, 1), an integer one was
    truncated (updates 0) and a complex one lost its imaginary part."""
    opt = aa.lbfgs(0.1, memory_size=3)
    p = {"w": torch.zeros(5)}
    state = opt.init(p)
    _, state = opt.update({"w": torch.ones(5)}, state, params=p, inplace=False)
    params = {"w": torch.ones(5) if params is None else params}
    grads = {"w": grads}
    watched = _watch(state, params, grads)
    with pytest.raises(error, match=rf"^lbfgs: .*{message}"):
        opt.update(grads, state, params=params, inplace=inplace)
    assert _unchanged(watched)


@pytest.mark.parametrize("inplace", ["no", 1, None])
def test_update_refuses_a_non_bool_inplace(inplace):
    """`inplace="no"` is truthy: without the check it ran in place. Refused before anything
    is written."""
    opt = aa.lbfgs(0.1, memory_size=3)
    params = {"w": torch.zeros(5)}
    state = opt.init(params)
    grads = {"w": torch.ones(5)}
    watched = _watch(state, params, grads)
    with pytest.raises(TypeError, match=r"^lbfgs: `inplace` must be a bool, got"):
        opt.update(grads, state, params=params, inplace=inplace)
    assert _unchanged(watched)


def test_in_place_update_of_expanded_grads():
    """Expanded grads (`torch.func.grad` of a sum returns them) cannot hold the update: in
    place it is returned in a new tensor, the caller's grads keep their values and versions,
    and updates and state equal, bit for bit, those of the same grads made contiguous.
    Without this the final write into the grads raised after the state was written."""
    opt = aa.lbfgs(0.5, memory_size=3)
    params = {"a": torch.tensor([1.0, -2.0, 0.5]), "b": torch.ones(2, 2)}
    state, twin = opt.init(params), opt.init(params)
    for _ in range(4):
        # The gradients of 0.5 (sum a)^2 and of 0.5 |column sums of b|^2, both expanded.
        grads = {
            "a": grad(lambda a: 0.5 * a.sum() ** 2)(params["a"]),
            "b": params["b"].sum(0, keepdim=True).expand(2, 2),
        }
        assert grads["a"].stride() == (0,) and grads["b"].stride() == (0, 1)
        watched = _watch(grads, params)
        updates, state = opt.update(grads, state, params=params, inplace=True)
        assert _unchanged(watched)
        dense = {key: g.clone() for key, g in grads.items()}
        expected, twin = opt.update(dense, twin, params=params, inplace=True)
        for key in expected:
            assert torch.equal(updates[key], expected[key])
            assert updates[key].shape == params[key].shape
        assert all(torch.equal(t, u) for t, u in zip(state, twin))
        params = {key: params[key] + updates[key] for key in params}
    assert int(state.num_pairs) > 0

"""Acceptance rules as records (`aadl_func._src.acceptance`): a rule defined in one place and
registered by one line is what every execution path runs at step 4, checks calls by its own
`check_call`, restarts by its own flag and is refused by the torch.optim faces by its own
words. The rule here, defined in this file only, returns the midpoint of the plain step and
the mix; its iterates are held to a float64 NumPy transcription of type-II Anderson with that
rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aadl_func as aa
from aadl_func._src import acceptance, flags
from aadl_func._src.acceptance import Acceptance

LR = 0.05
DEPTH = 4
# Registered under an existing boolean option in these tests (a rule's own option would be a
# new field of the options); `restart_on_reject` only acts on a rejected mix, which this
# rule never makes.
SWITCH = "restart_on_reject"


calls = [0]


def _midpoint(call, mixable, x, x_hist, y):
    """Step 4 of the test rule: `y + (x - y) / 2` wherever a mix is usable."""
    calls[0] += 1
    if flags.value(mixable):
        x = [yi + 0.5 * (xi - yi) for xi, yi in zip(x, y)]
    return mixable, x, x_hist


def _serves_all(loss_fn, shards, transformed):
    pass


MIDPOINT = Acceptance(choose=_midpoint, check_call=_serves_all)


@pytest.fixture
def midpoint(monkeypatch):
    monkeypatch.setitem(acceptance.ACCEPTANCES, SWITCH, MIDPOINT)
    return MIDPOINT


def _problem(n: int = 24):
    """A diagonal quadratic 1/2 x^T A x - b^T x: its gradient, and a start."""
    rng = np.random.default_rng(0)
    a = np.linspace(1.0, 8.0, n)
    b = rng.standard_normal(n)
    return (lambda x: a * x - b), rng.standard_normal(n)


def _reference(grad, x0: np.ndarray, steps: int) -> list[np.ndarray]:
    """Type-II AA (the pairs (x_k, g(x_k) - x_k) of the returned points, depth `DEPTH`,
    relaxation 1) around g(x) = x - LR grad(x), returning y + (mix - y) / 2 once a mix is
    defined (two pairs or more)."""
    x, pairs, out = x0.copy(), [], []
    for _ in range(steps):
        y = x - LR * grad(x)
        pairs = [*pairs, (x.copy(), y - x)][-DEPTH:]
        if len(pairs) >= 2:
            xs = np.stack([p[0] for p in pairs], 1)
            fs = np.stack([p[1] for p in pairs], 1)
            gamma = np.linalg.lstsq(fs[:, 1:] - fs[:, :-1], fs[:, -1], rcond=None)[0]
            alpha = np.diff(np.concatenate([[0.0], gamma, [1.0]]))
            y = y + 0.5 * ((xs + fs) @ alpha - y)
        x = y
        out.append(x.copy())
    return out


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_registered_rule_chooses_every_call(midpoint, inplace, dtype):
    # float32 in place on init's layout is the steady call's case: it must leave the rule's
    # calls to the path that runs it.
    grad, x0 = _problem()
    calls[0] = 0
    opt = aa.anderson(aa.sgd(LR), history_depth=DEPTH, mode="classic", **{SWITCH: True})
    x = torch.tensor(x0, dtype=dtype)
    state = opt.init(x)
    expected = _reference(grad, x0, 25)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for k in range(25):
        g = torch.tensor(grad(x.double().numpy()), dtype=dtype)
        out, state = opt.update(state, x, g, inplace=inplace)
        if inplace:
            assert out is x
        x = out
        scale = np.abs(expected[k]).max()
        assert np.abs(x.double().numpy() - expected[k]).max() <= tol * scale, k
    assert int(state.num_mixed) == 24
    assert calls[0] >= 24  # the rule itself chose (not a path that left it out)


def test_without_the_rule_the_mix_is_returned_whole():
    # The teeth of the test above: the default rule returns the mix, not the midpoint.
    grad, x0 = _problem()
    opt = aa.anderson(aa.sgd(LR), history_depth=DEPTH, mode="classic")
    x = torch.tensor(x0)
    state = opt.init(x)
    expected = _reference(grad, x0, 5)
    for _ in range(5):
        x, state = opt.update(state, x, torch.tensor(grad(x.numpy())))
    assert np.abs(x.numpy() - expected[-1]).max() > 1e-6


def test_the_rules_check_call_runs_before_anything_is_written(monkeypatch):
    def refuse(loss_fn, shards, transformed):
        if loss_fn is None:
            raise ValueError("anderson.update: the test rule needs `loss_fn`")

    rule = Acceptance(choose=_midpoint, check_call=refuse)
    monkeypatch.setitem(acceptance.ACCEPTANCES, SWITCH, rule)
    opt = aa.anderson(aa.adam(1e-2), history_depth=DEPTH, **{SWITCH: True})
    x = torch.randn(8)
    state = opt.init(x)
    before = (x.clone(), [t.clone() for t in torch.utils._pytree.tree_leaves(state)])
    with pytest.raises(ValueError, match="the test rule needs `loss_fn`"):
        opt.update(state, x, torch.ones(8), inplace=True)
    assert torch.equal(x, before[0])
    for a, b in zip(torch.utils._pytree.tree_leaves(state), before[1]):
        assert torch.equal(a, b)


def test_a_rule_that_restarts_cuts_the_window_on_a_rejection(monkeypatch):
    def reject(call, mixable, x, x_hist, y):
        return flags.FALSE, x, x_hist

    for restarts, size in ((True, 1), (False, DEPTH)):
        rule = Acceptance(choose=reject, check_call=_serves_all, restarts=restarts)
        monkeypatch.setitem(acceptance.ACCEPTANCES, "skip_nonfinite", rule)
        opt = aa.anderson(aa.sgd(LR), history_depth=DEPTH, mode="classic", skip_nonfinite=True)
        x, state = torch.randn(8, dtype=torch.float64), None
        state = opt.init(x)
        for _ in range(DEPTH + 2):
            x, state = opt.update(state, x, x.clone())
        assert int(state.window_size) == size
        assert int(state.num_mixed) == 0


def test_two_rules_at_once_is_an_error_naming_both(midpoint):
    with pytest.raises(ValueError, match="`line_search=True` and `restart_on_reject=True`"):
        aa.anderson(aa.sgd(LR), restart_on_reject=True, line_search=True)


def test_the_torch_optim_faces_refuse_a_rule_by_its_record(monkeypatch):
    rule = Acceptance(
        choose=_midpoint,
        check_call=_serves_all,
        torch_optim_refusal="(the test rule's reason)",
    )
    monkeypatch.setitem(acceptance.ACCEPTANCES, SWITCH, rule)
    model = torch.nn.Linear(3, 1)
    message = (
        "AcceleratedOptimizer: `restart_on_reject=True` is available in the functional API "
        "only (the test rule's reason)"
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **{SWITCH: True})
    # The same option without a refusing rule is served.
    monkeypatch.setitem(acceptance.ACCEPTANCES, SWITCH, MIDPOINT)
    aa.AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **{SWITCH: True})

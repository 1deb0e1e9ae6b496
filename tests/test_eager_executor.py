"""The eager in-place executor (`aadl_func._src.exec.eager`) against the general path.

The executor runs an eager in-place call as straight-line code with its decisions as Python
values; the general path (`stages` and the mode's step function) runs every call, with its
decisions as tensors. Both must give the same bits: params and every byte of the state, call
by call, over the options the executor takes, the ones it hands back (a deferred rejection,
a poisoned append) and the window dtypes users train with.
"""

from __future__ import annotations

import optree
import pytest
import torch

import aadl_func as aa
from aadl_func._src import anderson as anderson_module
from aadl_func._src.options import AndersonOptions


def _problem(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    params = {
        "w": 0.5 * torch.randn(6, 4, generator=g, dtype=dtype),
        "b": 0.5 * torch.randn(4, generator=g, dtype=dtype),
    }

    def loss(p):
        x = torch.cat([p["w"].reshape(-1), p["b"]])
        return (100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2).sum() / 50

    return params, loss


def _bytes(tree) -> list[bytes]:
    out = []
    for leaf in optree.tree_leaves(tree, none_is_leaf=True):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().contiguous()
            out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return out


def _run(
    options: dict,
    inner,
    dtype,
    *,
    deferred: bool,
    poison_at: int | None,
    inplace: bool = True,
    steps: int = 40,
):
    """Every call's params and state bytes, and how many calls the executor took."""
    opt = aa.anderson(inner, **options)
    params, loss = _problem(dtype)
    state = opt.init(params)
    grad_and_value = torch.func.grad_and_value(loss)
    history = []
    for k in range(steps):
        grads, value = grad_and_value(params)
        if k == poison_at:  # an Inf gradient: a poisoned append, the window restarts
            grads = {**grads, "b": torch.full_like(grads["b"], float("inf"))}
        kwargs = {"loss": value} if deferred else {}
        params, state = opt.update(state, params, grads, inplace=inplace, **kwargs)
        history.append(_bytes((params, state)))
    return history


def _general_only(monkeypatch) -> None:
    """Every call the general way: neither the executor nor the steady call
    (`aadl_func._src.exec.steady`, which runs the executor's operations on a kept plan)."""
    monkeypatch.setattr(anderson_module.eager, "applies", lambda *a, **k: False)
    monkeypatch.setattr(anderson_module.steady, "run", lambda *a, **k: None)


CASES = [
    ("classic", {}),
    ("aadl", {}),
    ("classic", {"relaxation": 0.5, "reg_relative": 1e-4}),
    ("aadl", {"relaxation": 0.7, "reg": 1e-6, "reg_column": 1e-3}),
    ("classic", {"wait_iterations": 3, "store_each_nth": 2, "frequency": 3}),
    ("aadl", {"wait_iterations": 3, "store_each_nth": 2, "frequency": 3}),
    ("classic", {"history_depth": 3}),
    ("aadl", {"history_depth": 3}),
    ("classic", {"history_dtype": torch.bfloat16}),
    ("aadl", {"history_dtype": torch.bfloat16}),
    ("classic", {"history_dtype": torch.float64}),
    ("aadl", {"history_dtype": torch.float64}),
    ("classic", {"restart_on_reject": True}),
]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("deferred", [False, True], ids=["plain", "deferred"])
@pytest.mark.parametrize("inner_name", ["adam", "sgd-momentum"])
@pytest.mark.parametrize(("mode", "options"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_executor_matches_the_general_path(
    monkeypatch, mode, options, inner_name, deferred, inplace
):
    dtype = torch.float32
    make_inner = {"adam": lambda: aa.adam(0.01), "sgd-momentum": lambda: aa.sgd(2e-3, 0.5)}
    if deferred and options.get("store_each_nth", 1) != 1:
        pytest.skip("the deferred safeguard needs store_each_nth=1")
    options = {"mode": mode, **options}
    runs = []
    taken = [0]

    def counting(original):
        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            taken[0] += result is not None
            return result

        return counted

    # The executor's calls, and the steady calls (the same operations on a kept plan).
    monkeypatch.setattr(anderson_module.eager, "run", counting(anderson_module.eager.run))
    monkeypatch.setattr(anderson_module.steady, "run", counting(anderson_module.steady.run))
    kwargs = {"deferred": deferred, "poison_at": 17, "inplace": inplace}
    runs.append(_run(options, make_inner[inner_name](), dtype, **kwargs))
    executor_calls = taken[0]
    _general_only(monkeypatch)
    runs.append(_run(options, make_inner[inner_name](), dtype, **kwargs))
    # The executor ran on most calls (a deferred rejection goes the general way).
    assert executor_calls >= 20
    assert taken[0] == executor_calls  # and the second run never reached it
    for k, (fast, general) in enumerate(zip(*runs)):
        assert fast == general, f"call {k + 1} differs"


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
def test_executor_takes_float64_params_and_sgd_without_buffers(monkeypatch, inplace):
    """An inner optimizer without buffers (updated in place into the grads) and float64
    params: the same bits on both paths."""
    runs = []
    for general in (False, True):
        if general:
            _general_only(monkeypatch)
        runs.append(
            _run(
                {"mode": "classic"},
                aa.sgd(2e-3),
                torch.float64,
                deferred=False,
                poison_at=None,
                inplace=inplace,
            )
        )
    assert runs[0] == runs[1]


def test_calls_the_executor_does_not_take_go_the_general_way():
    """`loss_fn`, the moving average and skip_nonfinite are the general path's."""
    params, loss = _problem(torch.float32)
    grads = torch.func.grad(loss)(params)
    take = anderson_module.eager.applies
    leaves = optree.tree_leaves(params)
    for options, kwargs in [
        ({}, {"inplace": False, "loss_fn": loss}),
        ({}, {"inplace": True, "loss_fn": loss}),
        ({"average": True}, {"inplace": True, "loss_fn": None}),
        ({"skip_nonfinite": True}, {"inplace": True, "loss_fn": None}),
    ]:
        opt = aa.anderson(aa.sgd(1e-3), **options)
        state = opt.init(params)
        options_record = AndersonOptions(aa.sgd(1e-3), **options)
        assert not take(
            options_record, state, leaves, mix=True, shards=None, transformed=False, **kwargs
        )
        opt.update(state, params, grads, **kwargs)  # and the call itself runs


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("history_dtype", [None, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["classic", "aadl"])
def test_executor_matches_on_strided_leaves(monkeypatch, mode, history_dtype, inplace):
    """channels_last and transposed leaves (windows laid out like them, not C-contiguous)."""
    g = torch.Generator().manual_seed(1)
    start = {
        "conv": torch.randn(3, 4, 5, 5, generator=g).to(memory_format=torch.channels_last),
        "t": torch.randn(7, 3, generator=g).t(),
        "b": torch.randn(5, generator=g),
    }

    def loss(p):
        return sum(((v - 0.3) ** 2 * (1 + v.abs())).sum() for v in p.values())

    def run() -> list:
        opt = aa.anderson(aa.adam(0.05), mode=mode, history_depth=4, history_dtype=history_dtype)
        params = {k: v.clone(memory_format=torch.preserve_format) for k, v in start.items()}
        state = opt.init(params)
        out = []
        for _ in range(15):
            grads = torch.func.grad(loss)(params)
            params, state = opt.update(state, params, grads, inplace=inplace)
            out.append(_bytes((params, state)))
        return out

    fast = run()
    _general_only(monkeypatch)
    assert fast == run()


def test_inside_vmap_the_general_path_runs_even_for_unbatched_params(monkeypatch):
    """Params made inside the vmapped function are plain tensors while the grads (and then the
    state) are batched: the executor must not take such a call."""
    taken = []
    original = anderson_module.eager.run
    monkeypatch.setattr(
        anderson_module.eager, "run", lambda *a, **k: taken.append(1) or original(*a, **k)
    )
    opt = aa.anderson(aa.sgd(0.1), mode="classic", history_depth=3)

    def solve(c):
        x = torch.zeros(4, dtype=torch.float64)
        state = opt.init(x)
        for _ in range(6):
            x, state = opt.update(state, x, x - c)
        return x

    c = torch.arange(8, dtype=torch.float64).reshape(2, 4)
    xs = torch.func.vmap(solve)(c)
    assert taken == []
    for i in range(2):
        torch.testing.assert_close(xs[i], solve(c[i]), rtol=0, atol=1e-12)
    assert taken  # and the eager solves did run through it


@pytest.mark.parametrize(
    "leaf",
    [torch.zeros(3), torch.nn.Parameter(torch.ones(2, 2)), torch.zeros((), dtype=torch.int64)],
)
def test_a_bare_tensor_flattens_as_optree_flattens_it(leaf):
    # tree.flatten answers a bare tensor (one-leaf params, their window slots) without optree:
    # the same leaves and a spec equal to optree's, which unflattens and compares as it does.
    from aadl_func._src import tree

    leaves, spec = tree.flatten(leaf)
    expected_leaves, expected_spec = optree.tree_flatten(leaf, none_is_leaf=False)
    assert leaves == expected_leaves and leaves[0] is leaf
    assert spec == expected_spec and hash(spec) == hash(expected_spec)
    assert spec.num_leaves == 1 and spec.is_leaf()
    assert tree.unflatten(spec, [leaf]) is leaf
    assert spec != optree.tree_flatten([leaf])[1] != optree.tree_flatten({"w": leaf})[1]

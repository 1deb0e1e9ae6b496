"""A fuzzer of ``update``'s inputs (hypothesis): odd leaves, and tampered states.

Property of every call: it either works, with the result of a reference, or raises a clear
error (``TypeError``, ``ValueError`` or ``FloatingPointError`` whose message starts with
``anderson.init:``/``anderson.update:`` and names an argument in backticks) and leaves every
tensor the caller passed as it was (same bytes, same version counter).

* Leaves: params and grads of every dtype (float16/bfloat16/float32/float64, complex, int,
  bool), layout (contiguous, 0-d, transposed, sliced, expanded, overlapping ``as_strided``,
  inference, sparse) and special value (0, nan, +-inf, 3e38, subnormal). The reference is the
  pure call on dense, contiguous copies; in place or out of place, a call that works returns
  the same bits (NaN for NaN), or, with params laid out otherwise (transposed, sliced,
  expanded), values equal to the dtype's precision.
* Tampered states: a state of a short run with one leaf of one field (counters, Grams,
  anchor, ring slots, inner state, pending loss) changed in value (nan, inf, -1, 2**60, 3e38,
  a small integer), dtype, shape, memory (expanded, sparse, inference) or replaced by a
  non-tensor. A call that works in place equals the pure call on a copy of the state; a pure
  call writes nothing; params stay finite when the params and grads are (unless the tampered
  leaf is the inner optimizer's, whose values enter its step as in torch.optim).

``make test`` runs a sample (``AADL_FUZZ_EXAMPLES``, default 40 per test, derandomized);
``make fuzz`` runs the long campaign (docs/reliability.md gives its counts).
"""

from __future__ import annotations

import collections
import os
import re
import warnings

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aadl_func as aa

EXAMPLES = int(os.environ.get("AADL_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,  # the sample in `make test` is the same every run
    suppress_health_check=list(HealthCheck),
    database=None,
)
#: Outcomes seen, printed by ``make fuzz`` (``-s``): the counts of docs/reliability.md.
OUTCOMES: collections.Counter = collections.Counter()

ERRORS = (TypeError, ValueError, FloatingPointError)
NAMED = re.compile(r"^anderson\.(init|update): .*`(params|grads|state|inplace|loss)[^`]*`", re.S)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "complex64": torch.complex64,
    "int64": torch.int64,
    "bool": torch.bool,
}
LAYOUTS = (
    "contiguous",
    "scalar",
    "transposed",
    "sliced",
    "expanded",
    "overlapping",
    "inference",
    "sparse",
)
SPECIALS = {
    "normal": None,
    "zero": 0.0,
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "huge": 3e38,
    "subnormal": 1e-40,
}


# -- bytes, snapshots, comparison -----------------------------------------------------------------


def _dense(t):
    return isinstance(t, torch.Tensor) and t.layout is torch.strided and not t.is_meta


def _bytes(t):
    return t.detach().reshape(-1).clone().view(torch.uint8)


def _snapshot(*trees):
    out = []
    for t in optree.tree_leaves(trees, none_is_leaf=False):
        if _dense(t):
            out.append((t, _bytes(t), None if t.is_inference() else t._version))
    return out


def _assert_unchanged(snapshot):
    for t, before, version in snapshot:
        assert torch.equal(_bytes(t), before), "a refused call changed a tensor"
        if version is not None:
            assert t._version == version, "a refused call wrote a tensor"


def _same(a, b):
    """The same bits, NaN for NaN (any NaN payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        a, b = (
            torch.view_as_real(a) if a.is_complex() else a,
            (torch.view_as_real(b) if b.is_complex() else b),
        )
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _assert_same_trees(got, expected, what, exact=True):
    """The same bits; with ``exact=False`` (params laid out otherwise than the reference's:
    the window's reductions may then add in another order) close to the dtype's precision."""
    got_leaves, got_spec = optree.tree_flatten(got, none_is_leaf=True)
    ref_leaves, ref_spec = optree.tree_flatten(expected, none_is_leaf=True)
    assert got_spec == ref_spec, what
    for i, (a, b) in enumerate(zip(got_leaves, ref_leaves)):
        if not isinstance(a, torch.Tensor):
            continue
        if exact or not (a.is_floating_point() or a.is_complex()):
            assert _same(a.detach(), b.detach()), f"{what}: leaf {i} differs from the reference"
        else:
            torch.testing.assert_close(a, b, equal_nan=True, msg=f"{what}: leaf {i}")


def _dense_copy(tree):
    """Plain dense contiguous copies (the reference's inputs), made outside inference mode."""

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.layout is not torch.strided:
            t = t.to_dense()
        return t.detach().clone(memory_format=torch.contiguous_format)

    return optree.tree_map(copy, tree, none_is_leaf=True)


def _outcome(fn):
    """``("ok", result)`` or ``("refused", error)`` for a clear error; anything else fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sparse-CSR beta, non-writable numpy, ...
            return "ok", fn()
    except ERRORS as error:
        assert NAMED.match(str(error)), f"unclear refusal: {type(error).__name__}: {error}"
        return "refused", error


# -- odd leaves ---------------------------------------------------------------------------------


def _leaf(dtype, layout, special, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    if special is not None:
        base.view(-1)[seed % 24] = special
    base = base.to(dtype) if dtype is not torch.bool else base > 0
    if layout == "scalar":
        return base[0, 0].clone()
    if layout == "transposed":
        return base.T
    if layout == "sliced":
        return base[:, ::2]
    if layout == "expanded":
        return base[:1].expand(4, 6)
    if layout == "overlapping":
        return base.reshape(-1).as_strided((3, 4), (2, 1))
    if layout == "inference":
        with torch.inference_mode():
            return base.clone()
    if layout == "sparse":
        return base.to_sparse()
    return base


# Weighted towards what init accepts (real floating, dense), so that most examples step.
leaf_specs = st.tuples(
    st.one_of(st.sampled_from(["float32", "float64"]), st.sampled_from(list(DTYPES))),
    st.one_of(st.sampled_from(LAYOUTS[:4]), st.sampled_from(LAYOUTS)),
    st.one_of(st.just("normal"), st.sampled_from(list(SPECIALS))),
)


def _grad_like(param, spec, seed):
    """A gradient of ``param``'s shape with the dtype, memory layout and value of ``spec``."""
    dtype, layout, special = spec
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(param.shape, generator=gen, dtype=torch.float64)
    if SPECIALS[special] is not None and g.numel():
        g.view(-1)[seed % g.numel()] = SPECIALS[special]
    g = g.to(DTYPES[dtype]) if DTYPES[dtype] is not torch.bool else g > 0
    if layout == "transposed" and g.dim() == 2:
        return g.T.contiguous().T
    if layout == "sliced" and g.dim() >= 1:
        wide = torch.zeros(*g.shape[:-1], 2 * g.shape[-1], dtype=g.dtype)
        return wide[..., ::2].copy_(g)
    if layout in ("expanded", "overlapping") and g.numel() > 1:
        return g.reshape(-1)[:1].expand(g.shape)
    if layout == "inference":
        with torch.inference_mode():
            return g.clone()
    if layout == "sparse":
        return g.to_sparse()
    return g


@SETTINGS
@given(
    mode=st.sampled_from(["aadl", "classic"]),
    inner=st.sampled_from(["sgd", "adam"]),
    inplace=st.booleans(),
    specs=st.lists(st.tuples(leaf_specs, leaf_specs), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_odd_leaves(mode, inner, inplace, specs, seed):
    """Every dtype, layout and special value of params and grads, in both modes."""
    opt = aa.anderson(
        aa.sgd(0.1, momentum=0.5) if inner == "sgd" else aa.adam(0.05),
        history_depth=3,
        mode=mode,
    )
    params, grads = {}, {}
    for k, (p_spec, g_spec) in enumerate(specs):
        p_dtype, p_layout, p_special = p_spec
        params[f"p{k}"] = _leaf(DTYPES[p_dtype], p_layout, SPECIALS[p_special], seed + k)
        grads[f"p{k}"] = _grad_like(params[f"p{k}"], g_spec, seed + 7 * k)
    snapshot = _snapshot(params, grads)
    kind, state = _outcome(lambda: opt.init(params))
    if kind == "refused":
        OUTCOMES["leaves: init refused"] += 1
        _assert_unchanged(snapshot)
        return
    ref_params, ref_state = _dense_copy(params), _dense_copy(state)
    for _ in range(3):
        ref_kind, ref = _outcome(
            lambda: opt.update(ref_state, ref_params, _dense_copy(grads))  # noqa: B023
        )
        snapshot = _snapshot(params, grads, state)
        kind, out = _outcome(
            lambda: opt.update(state, params, grads, inplace=inplace)  # noqa: B023
        )
        OUTCOMES[f"leaves: update {kind}"] += 1
        if kind == "refused":
            _assert_unchanged(snapshot)
            return
        assert ref_kind == "ok", f"works on odd leaves but not on dense copies: {ref}"
        dense = all(spec[0][1] in ("contiguous", "scalar", "inference") for spec in specs)
        _assert_same_trees(out, ref, "params and state", exact=dense)
        if not inplace:
            _assert_unchanged(snapshot)  # a pure call writes none of its inputs
        params, state = out
        ref_params, ref_state = ref


# -- tampered states ------------------------------------------------------------------------------


def _run_state(mode):
    opt = aa.anderson(aa.adam(0.05), history_depth=3, mode=mode)
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(2, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    state = opt.init(params)
    for _ in range(4):
        grads = {k: 0.5 * v + 0.1 for k, v in params.items()}
        params, state = opt.update(
            state, params, grads, loss=float(sum(v.sum() for v in params.values()))
        )
    return opt, params, state


TAMPERS = (
    "nan",
    "inf",
    "minus one",
    "2**60",
    "3e38",
    "small integer",
    "dtype",
    "shape",
    "expanded",
    "sparse",
    "inference",
    "python number",
    "none",
)


def _tampered(t, how, seed):
    if how == "python number":
        return 1
    if how == "none":
        return None
    if how == "dtype":
        return t.to(torch.int32 if t.is_floating_point() else torch.float32)
    if how == "shape":
        return t.unsqueeze(0).clone()
    if how == "expanded":
        return t.reshape(-1)[:1].expand(t.shape) if t.numel() > 1 else t.expand(2, *t.shape)
    if how == "sparse":
        return t.to_sparse()
    if how == "inference":
        with torch.inference_mode():
            return t.clone()
    values = {
        "nan": float("nan"),
        "inf": float("inf"),
        "minus one": -1,
        "2**60": 2**60,
        "3e38": 3e38,
        "small integer": seed % 7,
    }
    out = t.clone()
    if out.is_floating_point() or out.is_complex():
        out.view(-1)[seed % max(out.numel(), 1)] = values[how]
    elif how not in ("nan", "inf", "3e38"):
        out.fill_(values[how])
    return out


@SETTINGS
@given(
    mode=st.sampled_from(["aadl", "classic"]),
    inplace=st.booleans(),
    leaf=st.integers(0, 10**6),
    how=st.sampled_from(TAMPERS),
    seed=st.integers(0, 2**16),
    with_loss=st.booleans(),
)
def test_tampered_states(mode, inplace, leaf, how, seed, with_loss):
    """One leaf of one field of a state changed; the state is used as a checkpoint would be."""
    opt, params, state = _run_state(mode)
    leaves, spec = optree.tree_flatten(state, none_is_leaf=False)
    index = leaf % len(leaves)
    leaves[index] = _tampered(leaves[index], how, seed)
    # The inner state's values feed the inner step as torch.optim's would (a NaN momentum
    # gives NaN params there too, and a run can produce one): not held to finiteness.
    inner = spec.accessors()[index].codify("state").startswith("state.inner_state")
    state = optree.tree_unflatten(spec, leaves)
    grads = {k: torch.full_like(v, 0.3) for k, v in params.items()}
    loss = 1.0 if with_loss else None
    snapshot = _snapshot(params, grads, state)
    copies = _dense_copy((params, state))
    kind, out = _outcome(lambda: opt.update(state, params, grads, inplace=inplace, loss=loss))
    OUTCOMES[f"state: update {kind}"] += 1
    if kind == "refused":
        _assert_unchanged(snapshot)
        return
    new_params, _ = out
    if not inner:
        assert all(bool(v.isfinite().all()) for v in new_params.values()), "non-finite params"
    if inplace:
        ref_kind, ref = _outcome(lambda: opt.update(copies[1], copies[0], grads, loss=loss))
        assert ref_kind == "ok"
        _assert_same_trees(out, ref, "in place against pure")
    else:
        _assert_unchanged(snapshot)


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes():
    yield
    if os.environ.get("AADL_FUZZ_EXAMPLES"):
        print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))

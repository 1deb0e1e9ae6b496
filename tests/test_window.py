"""The incremental window (ring of differences + float64 Gram) against float64 references.

``anderson`` never re-forms the window: each step writes one difference into a ring slot,
adds one float64 Gram row and combines the slots in one pass. These tests replay long runs
(the ring wraps around several times) and check, step by step,

* the state's Gram matrix against a NumPy float64 Gram of the slots it actually stores;
* the returned params against ``references.aadl_extrapolate`` (NumPy, dense, lstsq) applied
  to the window of plain iterates that those slots represent (for a bf16 history: the
  window rebuilt from the bf16-rounded differences);

for several params/history dtypes, ``channels_last`` leaves, odd sizes, chunks much smaller
than the params (many chunk boundaries) and both the in-place and the pure path. The pass
functions of ``window.py`` are also checked directly against NumPy on every slot layout they
distinguish (rows of one buffer, separate tensors, a mixture, vmap-batched).
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from references import aadl_extrapolate
from torch.func import vmap

import aadl_func as aa
from aadl_func._src import kernels, tree, window
from aadl_func._src.blend import Blend

CPU = torch.device("cpu")


class AddGrads:
    """Inner optimizer whose update is the gradient itself: ``y = x + g``, one rounding.

    NumPy reproduces ``y`` bit for bit, so the reference window holds exactly the iterates
    the code under test stores (before the history dtype rounds their differences).
    """

    def init(self, params):
        return ()

    def update(self, updates, state, params=None, inplace=False):
        return optree.tree_map(lambda g: g.clone(), updates), state


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few dozen elements: small params then cross many chunk boundaries."""
    monkeypatch.setattr(kernels, "_CHUNK_ELEMENTS", 256)
    monkeypatch.setattr(kernels, "_MIN_CHUNK", 16)


def make_params(dtype: torch.dtype, generator: torch.Generator) -> dict:
    conv = torch.randn(2, 3, 5, 7, generator=generator, dtype=torch.float64)
    return {
        "conv": conv.to(dtype).contiguous(memory_format=torch.channels_last),
        "odd": torch.randn(1031, generator=generator, dtype=torch.float64).to(dtype),
        "column": torch.randn(3, 1, generator=generator, dtype=torch.float64).to(dtype),
    }


def as_vector(tree) -> np.ndarray:
    """Leaves in optree order, each in logical (row-major) order, as one float64 vector."""
    return np.concatenate(
        [t.detach().to(torch.float64).reshape(-1).numpy() for t in optree.tree_leaves(tree)]
    )


def stored_gram(state: aa.AndersonState) -> np.ndarray:
    """Float64 Gram of the slots the state holds, in ring order (NumPy, from the data)."""
    slots = np.stack([as_vector(slot) for slot in state.residuals])
    return slots @ slots.T


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float64)


CASES = [
    # (params dtype, history dtype, relative tolerance on the extrapolation's correction)
    (torch.float64, None, 1e-9),
    (torch.float32, None, 1e-4),
    (torch.float32, torch.bfloat16, 1e-4),
    (torch.float32, torch.float16, 1e-4),
    (torch.float32, torch.float64, 1e-4),
]


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
@pytest.mark.parametrize("dtype,history_dtype,rtol", CASES, ids=lambda c: str(c))
def test_incremental_window_matches_reference_over_many_steps(
    small_chunks, gram_path, dtype, history_dtype, rtol, inplace
):
    history_depth, relaxation, steps = 5, 0.7, 23
    generator = torch.Generator().manual_seed(7)
    opt = aa.anderson(
        AddGrads(), history_depth=history_depth, relaxation=relaxation, history_dtype=history_dtype
    )
    params = make_params(dtype, generator)
    state = opt.init(params)
    hdt = dtype if history_dtype is None else history_dtype
    iterates: list[torch.Tensor] = []  # plain iterates y as float64 vectors (exact copies)
    differences: list[torch.Tensor] = []  # their differences as the window stores them
    for _ in range(steps):
        grads = optree.tree_map(
            lambda p: (0.1 * torch.randn(p.shape, generator=generator, dtype=torch.float64)).to(
                p.dtype
            ),
            params,
        )
        # y = x + g rounded once to the params dtype (the float64 sum of two float32
        # numbers of similar size is exact), in logical order.
        y = torch.from_numpy(as_vector(params) + as_vector(grads)).to(dtype).to(torch.float64)
        if iterates:
            # The difference in the params dtype, then rounded to the history dtype.
            differences.append(rounded((y - iterates[-1]).to(dtype), hdt))
        iterates.append(y)
        iterates, differences = iterates[-history_depth:], differences[-(history_depth - 1) :]

        params, state = opt.update(state, params, grads, inplace=inplace)

        expected_gram = stored_gram(state)
        np.testing.assert_allclose(
            state.gram.numpy(), expected_gram, rtol=1e-12, atol=1e-13 * np.abs(expected_gram).max()
        )
        got = torch.from_numpy(as_vector(params))
        if len(iterates) < 3:
            assert torch.equal(got, y)
            continue
        # The window the slots represent: the newest entry and the stored differences.
        window_entries = [iterates[-1]]
        for d in reversed(differences):
            window_entries.insert(0, window_entries[0] - d)
        expected = aadl_extrapolate(torch.stack(window_entries, 1).numpy(), relaxation)
        correction = np.linalg.norm(expected - iterates[-1].numpy())
        error = np.linalg.norm(got.numpy() - expected)
        assert error <= rtol * correction, (error, correction)
    assert int(state.num_mixed) == steps - 2


def test_window_wider_than_the_default_chunk(gram_path):
    """Default chunk sizes, an odd-sized float32 leaf spanning several chunks."""
    history_depth = 5
    n = 3 * kernels.chunk_size(history_depth - 1) + 5
    generator = torch.Generator().manual_seed(3)
    opt = aa.anderson(AddGrads(), history_depth=history_depth, relaxation=0.5)
    x = torch.randn(n, generator=generator)
    state = opt.init(x)
    entries = []
    for _ in range(8):
        g = 0.1 * torch.randn(n, generator=generator)
        entries.append((x + g).double())
        entries = entries[-history_depth:]
        x, state = opt.update(state, x, g, inplace=True)
        np.testing.assert_allclose(state.gram.numpy(), stored_gram(state), rtol=1e-12)
    stored = [entries[-1]]
    for a, b in reversed(list(zip(entries[:-1], entries[1:]))):
        stored.insert(0, stored[0] - (b.float() - a.float()).double())
    expected = aadl_extrapolate(torch.stack(stored, 1).numpy(), 0.5)
    correction = np.linalg.norm(expected - entries[-1].numpy())
    assert np.linalg.norm(x.double().numpy() - expected) <= 1e-4 * correction


# -- the pass functions on every slot layout ---------------------------------------------


def layouts(like: torch.Tensor, q: int, dtype: torch.dtype, generator: torch.Generator):
    """The same slot values in the layouts the passes distinguish."""
    values = [
        torch.randn(like.shape, generator=generator, dtype=torch.float64).to(dtype)
        for _ in range(q)
    ]
    block = window.new_ring(like, q, dtype=dtype, device=CPU)
    for slot, v in zip(block, values):
        slot.copy_(v)
    separate = [torch.empty_like(like, dtype=dtype).copy_(v) for v in values]
    mixed = list(block)
    mixed[1] = separate[1]  # a pure step replaced one slot
    return values, {"block": block, "separate": separate, "mixed": mixed}


@pytest.mark.parametrize("chunks", ["small", "default"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str
)
@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (1237,)], ids=["channels_last", "odd"])
def test_gram_row_and_combine_on_every_layout(request, gram_path, chunks, dtype, shape):
    if chunks == "small":
        request.getfixturevalue("small_chunks")
    generator = torch.Generator().manual_seed(11)
    like = torch.empty(shape)
    if len(shape) == 4:
        like = like.contiguous(memory_format=torch.channels_last)
    q = 5
    values, cases = layouts(like, q, dtype, generator)
    dense = np.stack([v.to(torch.float64).reshape(-1).numpy() for v in values])
    layout = torch.channels_last if len(shape) == 4 else torch.contiguous_format
    base = torch.randn(shape, generator=generator).contiguous(memory_format=layout)
    weights = torch.randn(q, generator=generator, dtype=torch.float64)
    cdt = torch.promote_types(dtype, torch.float32)
    for name, slots in cases.items():
        ring = [[s] for s in slots]
        if name == "block":
            assert len(kernels.slot_runs([tree.flat_view(s) for s in slots])) == 1
        # The vector is a slot (the residual just written) or a tensor of its own.
        for vector, v_dense in ((ring[2], dense[2]), ([base.to(dtype)], None)):
            if v_dense is None:
                v_dense = base.to(dtype).to(torch.float64).reshape(-1).numpy()
            row = window.gram_row(ring, vector, CPU)
            assert row.dtype == torch.float64
            np.testing.assert_allclose(row.numpy(), dense @ v_dense, rtol=1e-13, err_msg=name)
        mixed = window.combine([base], [ring], weights, [cdt], [base])[0]
        assert mixed.dtype == cdt and mixed.stride() == base.to(cdt).stride(), name
        expected = base.double().reshape(-1).numpy() + weights.numpy() @ dense
        scale = np.abs(base.double().reshape(-1).numpy()) + np.abs(weights.numpy()) @ np.abs(dense)
        tolerance = 8 * torch.finfo(cdt).eps * scale
        assert np.all(np.abs(mixed.double().reshape(-1).numpy() - expected) <= tolerance), name
        no_base = window.combine(None, [ring], weights, [cdt], [base])[0]
        assert np.all(
            np.abs(no_base.double().reshape(-1).numpy() - weights.numpy() @ dense) <= tolerance
        )


def test_combine_over_two_rings_matches_numpy():
    """Mode "classic" combines the iterates ring and the residual ring in one call."""
    generator = torch.Generator().manual_seed(5)
    like = torch.empty(777)
    first = layouts(like, 3, torch.float32, generator)[1]["block"]
    second = layouts(like, 3, torch.float32, generator)[1]["mixed"]
    weights = torch.randn(6, generator=generator, dtype=torch.float64)
    rings = [[[s] for s in first], [[s] for s in second]]
    out = window.combine(None, rings, weights, [torch.float32], [like])[0]
    dense = np.stack([s.double().numpy() for s in first + second])
    np.testing.assert_allclose(out.double().numpy(), weights.numpy() @ dense, rtol=1e-5, atol=1e-5)


def test_passes_under_vmap_match_the_unbatched_passes():
    generator = torch.Generator().manual_seed(9)
    batch, q, n = 3, 4, 301
    slots = torch.randn(batch, q, n, generator=generator)
    vector = torch.randn(batch, n, generator=generator)
    weights = torch.randn(batch, q, generator=generator, dtype=torch.float64)

    def passes(s, v, w):
        ring = [[s[i]] for i in range(q)]
        row = window.gram_row(ring, [v], CPU)
        mixed = window.combine([v], [ring], w, [torch.float32], [v])[0]
        return row, mixed

    rows, mixed = vmap(passes)(slots, vector, weights)
    for b in range(batch):
        dense = slots[b].double().numpy()
        np.testing.assert_allclose(rows[b].numpy(), dense @ vector[b].double().numpy(), rtol=1e-13)
        expected = vector[b].double().numpy() + weights[b].numpy() @ dense
        np.testing.assert_allclose(mixed[b].double().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_new_ring_slots_are_rows_of_one_buffer_laid_out_like_the_param():
    like = torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    slots = window.new_ring(like, 4, dtype=torch.bfloat16, device=CPU)
    reference = torch.zeros_like(like, dtype=torch.bfloat16)
    storages = {s.untyped_storage().data_ptr() for s in slots}
    assert len(storages) == 1
    assert slots[0].untyped_storage().nbytes() == 4 * like.numel() * 2
    for s in slots:
        assert s.stride() == reference.stride() and s.dtype == torch.bfloat16
        assert torch.equal(s, reference)
    slots[1].fill_(1.0)  # rows do not overlap
    assert all(float(s.abs().sum()) == 0 for i, s in enumerate(slots) if i != 1)


def test_state_window_is_one_buffer_per_leaf_and_survives_inplace_steps():
    opt = aa.anderson(AddGrads(), history_depth=4)
    params = {"a": torch.zeros(10), "b": torch.zeros(3, 3)}
    state = opt.init(params)
    for _ in range(6):
        grads = optree.tree_map(torch.randn_like, params)
        params, state = opt.update(state, params, grads, inplace=True)
    for key in params:
        storages = {slot[key].untyped_storage().data_ptr() for slot in state.residuals}
        assert len(storages) == 1


def test_select_calls_a_callable_fallback_only_when_needed():
    calls = []

    def fallback():
        calls.append(1)
        return torch.zeros(3)

    assert torch.equal(
        Blend().select(torch.tensor(True), lambda: torch.ones(3), fallback), torch.ones(3)
    )
    assert not calls
    assert torch.equal(
        Blend().select(torch.tensor(False), lambda: torch.ones(3), fallback), torch.zeros(3)
    )
    assert calls == [1]
    gates = torch.tensor([True, False])
    out = vmap(lambda g: Blend().select(g, lambda: torch.ones(3), fallback))(gates)
    assert torch.equal(out, torch.tensor([[1.0] * 3, [0.0] * 3]))


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "pure"])
def test_an_overflowing_mix_is_rejected_and_the_plain_step_returned(inplace):
    """In place the mix is written straight into the params' buffers; when it overflows the
    plain step must come back. Steps of 1e37 and (1 + 1e-4) 1e37, then (1 + 2e-4) 1e37: the
    extrapolation of such a nearly linear float32 sequence lies near -1e41, beyond float32."""
    opt = aa.anderson(AddGrads(), history_depth=3, relaxation=1.0)
    x = torch.zeros(4)
    state = opt.init(x)
    expected = x.clone()
    for step in (1e37, 1.0001e37, 1.0002e37):
        g = torch.full((4,), step)
        expected = expected + g
        buffer = x
        x, state = opt.update(state, x, g, inplace=inplace)
        assert (x is buffer) == inplace
    assert torch.isfinite(expected).all()
    assert torch.equal(x, expected)
    assert torch.equal(state.anchor, expected)
    assert int(state.num_nonfinite) == 1 and int(state.num_mixed) == 0

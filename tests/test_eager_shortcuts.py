"""The eager step's shortcuts change no bit.

Eagerly, ``update`` reads its decisions (counters, gates, finiteness) as Python values and
skips work: masks that would be all True, blends with a known side, the reordering of the
small problem by index arithmetic, counters that do not change, and the per-slot flat views
of contiguous windows. Under ``vmap`` none of these values is known, so the same step runs
the masked, blended code path. A vmapped ensemble and each member run on its own must
therefore agree bit for bit, step after step, through partial windows, safeguard rejections,
restarts and members that decide differently. The vmapped state is stacked from the members'
own states, so that its counters are batched tensors and no decision is known (a state from
``vmap(init)`` shares its counters across members, which lets the ensemble take some eager
shortcuts itself).

Bit for bit holds on this quadratic for float32 and bf16 windows. Float64 windows agree to
rounding only: the QR route of mode "aadl" streams its factor in other chunks under vmap, and
mode "classic" sums its combination in other groupings when the members' slots are separate
tensors (stacked states) than when they are rows of one ring buffer. In general, a stacked
state whose members are out of step (a batched ring slot) also takes the chunked Gram route,
whose float64 sums differ from a member's own by 1e-16..1e-15, which a later ill-conditioned
mix can amplify: the exact promise is for ensembles from ``vmap(opt.init)`` (second test).
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.func import vmap

import aadl_func as aa

MEMBERS, N, STEPS = 3, 300, 14

CASES = {
    "aadl": dict(mode="aadl"),
    "aadl-safeguard": dict(mode="aadl", safeguard=True),
    "aadl-restart-regrel": dict(
        mode="aadl", safeguard=True, restart_on_reject=True, reg_relative=1e-3
    ),
    "aadl-bf16": dict(mode="aadl", safeguard=True, history_dtype=torch.bfloat16),
    "aadl-float64": dict(mode="aadl", safeguard=True, dtype=torch.float64),
    "aadl-average-store2": dict(mode="aadl", average=True, store_each_nth=2, frequency=2),
    "classic": dict(mode="classic"),
    "classic-safeguard-restart": dict(mode="classic", safeguard=True, restart_on_reject=True),
    "classic-float64": dict(mode="classic", safeguard=True, dtype=torch.float64),
}


def ensemble(case: str, seed: int):
    """The case's optimizer, a member's step ``step(state, params, h, target, inplace)`` on
    the quadratic ``0.5 sum h (w - target)^2``, the members' data and their own states."""
    options = dict(CASES[case])
    safeguard = options.pop("safeguard", False)
    dtype = options.pop("dtype", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    h = torch.rand(MEMBERS, N, generator=gen, dtype=dtype) + 0.2
    target = torch.randn(MEMBERS, N, generator=gen, dtype=dtype)
    start = torch.randn(MEMBERS, N, generator=gen, dtype=dtype)
    opt = aa.anderson(aa.adam(0.05), history_depth=4, **options)

    def step(state, params, hh, tt, inplace=False):
        loss = (lambda q: 0.5 * (hh * (q["w"] - tt) ** 2).sum()) if safeguard else None
        grads = {"w": hh * (params["w"] - tt)}
        return opt.update(state, params, grads, loss_fn=loss, inplace=inplace)

    members = [{"w": start[i].clone()} for i in range(MEMBERS)]
    return opt, step, (h, target, start), [(p, opt.init(p)) for p in members]


def assert_members_equal(case: str, k: int, params, state, members) -> None:
    """Each member's own run against its row of the vmapped one: bit for bit (float64
    windows: to rounding), with the same decisions."""
    for i, (p, s) in enumerate(members):
        if case.endswith("float64"):
            torch.testing.assert_close(params["w"][i], p["w"], rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(params["w"][i], p["w"]), f"member {i} differs at step {k}"
        assert int(state.num_mixed[i]) == int(s.num_mixed)
        assert int(state.num_rejected[i]) == int(s.num_rejected)
        assert int(state.window_size[i]) == int(s.window_size)


@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
@pytest.mark.parametrize("case", list(CASES))
def test_vmapped_ensemble_equals_each_member_bit_for_bit(case, inplace):
    opt, step, (h, target, start), members = ensemble(case, seed=7)
    params = {"w": start.clone()}
    state = optree.tree_map(lambda *xs: torch.stack(xs), *[s for _, s in members])
    assert state.count.stride() != (0,)  # batched counters: nothing known under vmap
    for k in range(STEPS):
        params, state = vmap(step)(state, params, h, target)
        members = [step(s, p, h[i], target[i], inplace) for i, (p, s) in enumerate(members)]
        assert_members_equal(case, k, params, state, members)
    assert int(state.num_mixed.min()) > 0
    if CASES[case].get("safeguard"):
        assert int(state.num_rejected.max()) > 0


@pytest.mark.parametrize("case", list(CASES))
def test_vmapped_inplace_ensemble_from_vmapped_init_equals_each_member(case):
    """The other ensemble: ``vmap(opt.init)`` shares the counters (the members step together,
    so the ring slot and the store gate are known) and the vmapped step writes in place. It
    takes the eager shortcuts that need only those values, and none that need a tensor's
    raw buffer or a per-member verdict: every member still equals its own in-place run."""
    opt, step, (h, target, start), members = ensemble(case, seed=11)
    params = {"w": start.clone()}
    state = vmap(opt.init)(params)

    def inplace_step(state, params, hh, tt):
        return step(state, params, hh, tt, inplace=True)

    for k in range(STEPS):
        params, state = vmap(inplace_step)(state, params, h, target)
        members = [inplace_step(s, p, h[i], target[i]) for i, (p, s) in enumerate(members)]
        assert_members_equal(case, k, params, state, members)
    assert int(state.num_mixed.min()) > 0

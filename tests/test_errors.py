"""Every invalid input of the functional core raises a clear error, before any state changes.

The table in ``docs/errors.md`` is the specification: each row names an id, the function, the
argument, the condition, the exception type and an excerpt of the message. This file holds
one triggering call per id and is parametrized from the parsed table, so the two cannot drift:
a row without a case, or a case without a row, fails ``test_every_row_has_a_case``.

For ``update`` the call is made with ``inplace=False`` and ``inplace=True`` on a state whose
window already holds entries, and we check that nothing was computed or written: the inner
optimizer was never called, and every tensor reachable from the state, the params and the
grads is bitwise equal to a copy taken before the call and has the same version counter
(``Tensor._version`` counts in-place writes, so even a write of identical values shows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

import aadl_func as aa
from aadl_func import adam, sgd

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
EXCEPTIONS = {"TypeError": TypeError, "ValueError": ValueError}


# -- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    function: str
    argument: str
    condition: str
    exception: str
    excerpt: str


def _unquote(cell: str) -> str:
    cell = cell.strip()
    for fence in ("`` ", "``", "`"):
        if cell.startswith(fence) and cell.endswith(fence[::-1]) and len(cell) > 2 * len(fence):
            return cell[len(fence) : len(cell) - len(fence)]
    return cell


def _doc_rows() -> list[Row]:
    rows = []
    for line in DOC.read_text().splitlines():
        # Data rows start with the id as a code span; the header and the rule do not.
        if not line.startswith("| `"):
            continue
        cells = [_unquote(c) for c in line.strip().strip("|").split("|")]
        assert len(cells) == 6, f"malformed row in errors.md: {line}"
        rows.append(Row(*cells))
    return rows


ROWS = _doc_rows()


# -- the cases ------------------------------------------------------------------------------


class Spy:
    """An inner optimizer (by default aadl_func.sgd with momentum) that counts its ``update``
    calls and passes its state checks through."""

    def __init__(self, inner: aa.InnerOptimizer | None = None) -> None:
        self.inner = sgd(0.1, momentum=0.9) if inner is None else inner
        self.calls = 0

    def init(self, params):
        return self.inner.init(params)

    def update(self, updates, state, params=None, inplace=False):
        self.calls += 1
        return self.inner.update(updates, state, params=params, inplace=inplace)

    def check_state(self, state, leaves, spec, *, name, owner):
        self.inner.check_state(state, leaves, spec, name=name, owner=owner)

    def check_values(self, state, *, count, name, owner):
        self.inner.check_values(state, count=count, name=name, owner=owner)


class Differentiated:
    """``opt`` whose ``update`` is differentiated through with ``torch.func.grad``."""

    def __init__(self, opt: aa.Anderson) -> None:
        self.opt = opt

    def update(self, state, params, grads, **kwargs):
        def total(p):
            out, _ = self.opt.update(state, p, grads, **kwargs)
            return sum(leaf.sum() for leaf in optree.tree_leaves(out))

        return torch.func.grad(total)(params)


def _params(dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "b": torch.randn(2, generator=gen, dtype=torch.float64).to(dtype),
        "w": torch.randn(3, 2, generator=gen, dtype=torch.float64).to(dtype),
    }


def _grads_of(params: dict) -> dict:
    return {k: 0.5 * v for k, v in params.items()}


def _short_recurrence_update(grads: dict | None = None, params: dict | None = None, **kwargs):
    """`short_recurrence(sgd(0.1)).update` on a fresh state for `_params()`, with some of
    the grads' or params' leaves replaced."""
    sr = aa.short_recurrence(sgd(0.1))
    good = _params()
    return sr.update(
        sr.init(good), {**good, **(params or {})}, {**_grads_of(good), **(grads or {})}, **kwargs
    )


def _warm(opt: aa.Anderson, params: dict, steps: int = 4):
    """A state whose window holds entries (so an in-place step would overwrite buffers)."""
    state = opt.init(params)
    for _ in range(steps):
        params, state = opt.update(state, params, _grads_of(params))
    return state, params


@dataclass
class Update:
    """A failing ``update`` call: ``build()`` returns (opt, spy, state, params, grads, kwargs)."""

    build: Callable[[], tuple]


def _update_case(
    *,
    made_with: dict | None = None,
    called_with: dict | None = None,
    params: Callable[[dict], Any] = lambda p: p,
    grads: Callable[[dict], Any] = _grads_of,
    state: Callable[[aa.AndersonState], Any] = lambda s: s,
    inner_made: Callable[[], aa.InnerOptimizer] | None = None,
    inner_called: Callable[[], aa.InnerOptimizer] | None = None,
    differentiate: bool = False,
    params_from_state: bool = False,
    **kwargs: Any,
) -> Update:
    """``update`` of an optimizer built with ``called_with`` (and inner ``inner_called``) on a
    state warmed up by one built with ``made_with`` (and ``inner_made``), the params/grads/state
    transformed by the given functions; with ``differentiate`` inside ``torch.func.grad``;
    with ``params_from_state`` the params are the state's own anchor tensors."""

    def build() -> tuple:
        made = {"history_depth": 4, **(made_with or {})}
        called = made if called_with is None else {"history_depth": 4, **called_with}
        default = lambda: sgd(0.1, momentum=0.9)  # noqa: E731
        warm_opt = aa.anderson(Spy((inner_made or default)()), **made)
        warm_state, warm_params = _warm(warm_opt, _params())
        spy = Spy((inner_called or default)())
        opt = aa.anderson(spy, **called)
        st = state(warm_state)
        p = st.anchor if params_from_state else params(warm_params)
        caller = Differentiated(opt) if differentiate else opt
        return caller, spy, st, p, grads(p), kwargs

    return Update(build)


def _anderson_and_state(call: Callable[[Any, aa.AndersonState, dict], Any]) -> Any:
    """``call(opt, state, params)`` on a fresh optimizer and state, for the rows about the
    call itself (its arguments in the wrong places)."""
    opt = aa.anderson(sgd(0.1), history_depth=4)
    params = _params()
    return call(opt, opt.init(params), params)


def _rebuild(leaf_fn: Callable[[torch.Tensor], torch.Tensor], field: str):
    """Replaces every tensor of one state field, e.g. to corrupt a loaded checkpoint."""
    return lambda s: s._replace(**{field: optree.tree_map(leaf_fn, getattr(s, field))})


def _slot(ring: tuple, s: int, key: str, leaf_fn: Callable[[torch.Tensor], torch.Tensor]):
    """``ring`` with leaf ``key`` of slot ``s`` replaced by ``leaf_fn`` of it."""
    return tuple({**r, key: leaf_fn(r[key])} if i == s else r for i, r in enumerate(ring))


def _update_in_place(params_of: Callable, grads: Callable = _grads_of) -> Any:
    """An in-place ``update`` on params made by ``params_of`` from one 6-element tensor."""
    opt = aa.anderson(sgd(0.1), history_depth=4)
    params = params_of(torch.arange(6.0))
    return opt.update(opt.init(params), params, grads(params), inplace=True)


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _requires_grad(p: dict) -> dict:
    return {k: v.clone().requires_grad_(True) for k, v in p.items()}


def _inner_field(field: str, leaf_fn: Callable[[torch.Tensor], torch.Tensor]):
    """Replaces every tensor of one field of the inner optimizer's state."""

    def corrupt(s: aa.AndersonState) -> aa.AndersonState:
        inner = s.inner_state
        value = optree.tree_map(leaf_fn, getattr(inner, field))
        return s._replace(inner_state=inner._replace(**{field: value}))

    return corrupt


def _scheduled_update(schedule: Callable) -> Callable[[], Any]:
    """One standalone ``sgd(schedule).update`` call (schedules are evaluated there)."""

    def call() -> Any:
        opt = sgd(schedule)
        params = _params()
        return opt.update(_grads_of(params), opt.init(params), params)

    return call


def _anderson(**options: Any) -> Callable[[], Any]:
    return lambda: aa.anderson(sgd(0.1), **options)


def _init(params: Any) -> Callable[[], Any]:
    return lambda: aa.anderson(sgd(0.1)).init(params)


WINDOW = torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

CASES: dict[str, Callable[[], Any] | Update] = {
    # construction
    "anderson-inner": lambda: aa.anderson(object()),
    "anderson-history_depth-type": _anderson(history_depth=5.0),
    "anderson-history_depth-bool": _anderson(history_depth=True),
    "anderson-history_depth-range": _anderson(history_depth=2),
    "anderson-relaxation-type": _anderson(relaxation="0.5"),
    "anderson-relaxation-range": _anderson(relaxation=0.0),
    "anderson-relaxation-nan": _anderson(relaxation=math.nan),
    "anderson-reg-type": _anderson(reg=None),
    "anderson-reg-range": _anderson(reg=-1e-8),
    "anderson-reg-inf": _anderson(reg=math.inf),
    "anderson-wait_iterations-type": _anderson(wait_iterations=1.5),
    "anderson-wait_iterations-range": _anderson(wait_iterations=-1),
    "anderson-store_each_nth-type": _anderson(store_each_nth="10"),
    "anderson-store_each_nth-range": _anderson(store_each_nth=0),
    "anderson-frequency-type": _anderson(frequency=2.0),
    "anderson-frequency-range": _anderson(frequency=0),
    "anderson-sufficient_decrease-type": _anderson(sufficient_decrease="0.5"),
    "anderson-sufficient_decrease-range": _anderson(sufficient_decrease=-0.1),
    "anderson-sufficient_decrease-one": _anderson(sufficient_decrease=1.0),
    "anderson-mode": _anderson(mode="type1"),
    "anderson-average": _anderson(average=1),
    "anderson-average-classic": _anderson(average=True, mode="classic"),
    "anderson-average_tol-type": _anderson(average_tol="0.1"),
    "anderson-average_tol-range": _anderson(average_tol=0.0),
    "anderson-skip_nonfinite": _anderson(skip_nonfinite=1),
    "anderson-max_consecutive_skips-type": _anderson(
        skip_nonfinite=True, max_consecutive_skips=2.0
    ),
    "anderson-max_consecutive_skips-range": _anderson(
        skip_nonfinite=True, max_consecutive_skips=-1
    ),
    "anderson-max_consecutive_skips-alone": _anderson(max_consecutive_skips=3),
    "anderson-history_device": _anderson(history_device="gpu0"),
    "anderson-compute_device": _anderson(compute_device=3.5),
    "anderson-history_dtype-int": _anderson(history_dtype=torch.int8),
    "anderson-history_dtype-str": _anderson(history_dtype="float16"),
    # init
    "init-params-none": _init(None),
    "init-params-leaf": _init({"w": torch.zeros(2), "b": 1.0}),
    "init-params-empty": _init({}),
    "init-params-int": _init({"w": torch.arange(3)}),
    "init-params-complex": _init(torch.zeros(3, dtype=torch.complex64)),
    "init-params-complex-mixed": lambda: aa.anderson(sgd(0.1), mode="classic").init(
        {"a": torch.zeros(3, dtype=torch.complex64), "b": torch.zeros(2)}
    ),
    "init-params-complex-history_dtype": lambda: aa.anderson(
        sgd(0.1), mode="classic", history_dtype=torch.bfloat16
    ).init(torch.zeros(3, dtype=torch.complex64)),
    # update: the call itself
    "update-state-type": _update_case(state=lambda s: tuple(s)),
    # update called as a gradient transformation (anderson inside a chain; tests/test_compose.py)
    "update-state-second": lambda: _anderson_and_state(
        lambda opt, state, p: opt.update(_grads_of(p), state, p)
    ),
    "update-params-keyword": lambda: _anderson_and_state(
        lambda opt, state, p: opt.update(_grads_of(p), state, params=p, inplace=True)
    ),
    "update-grads-absent": lambda: _anderson_and_state(lambda opt, state, p: opt.update(state, p)),
    "update-keyword-unknown": lambda: _anderson_and_state(
        lambda opt, state, p: opt.update(state, p, _grads_of(p), lr=0.1)
    ),
    "update-inplace-type": _update_case(inplace=1),
    "update-loss_fn-type": _update_case(loss_fn="mse"),
    "update-loss-type": _update_case(loss=torch.tensor([1.0, 2.0])),
    "update-loss-and-loss_fn": _update_case(loss=torch.tensor(1.0), loss_fn=lambda p: p["b"].sum()),
    "update-loss-store_each_nth": _update_case(
        made_with={"store_each_nth": 2}, loss=torch.tensor(1.0)
    ),
    "update-params-leaf": _update_case(params=lambda p: {**p, "b": 1.0}, grads=lambda p: p),
    "update-params-int": _update_case(params=lambda p: {k: v.long() for k, v in p.items()}),
    "update-params-none": _update_case(params=lambda p: None, grads=lambda p: _grads_of(_params())),
    "update-inplace-differentiated": _update_case(differentiate=True, inplace=True),
    "update-grads-leaf": _update_case(grads=lambda p: {**p, "b": 0.5}),
    "update-grads-structure": _update_case(grads=lambda p: (p["b"], p["w"])),
    "update-grads-none": _update_case(grads=lambda p: None),
    "update-grads-missing": _update_case(grads=lambda p: {"b": None, "w": p["w"]}),
    "update-grads-shape": _update_case(grads=lambda p: {**p, "w": p["w"].T.contiguous()}),
    "update-grads-dtype": _update_case(grads=lambda p: {k: v.long() for k, v in p.items()}),
    "update-grads-device": _update_case(grads=lambda p: {k: v.to("meta") for k, v in p.items()}),
    # update: params that do not match the state
    "update-params-structure": _update_case(params=lambda p: {"w": p["w"]}),
    "update-params-shape": _update_case(params=lambda p: {**p, "b": torch.zeros(3)}),
    "update-params-dtype": _update_case(params=lambda p: {k: v.double() for k, v in p.items()}),
    "update-params-dtype-classic": _update_case(
        made_with={"mode": "classic"}, params=lambda p: {k: v.double() for k, v in p.items()}
    ),
    "update-params-device": _update_case(
        params=lambda p: {k: v.to("meta") for k, v in p.items()},
        # A factory, not arithmetic: the first meta-tensor op loads torch's meta kernels (~3 s).
        grads=lambda p: {k: torch.empty(v.shape, device="meta") for k, v in p.items()},
    ),
    # update: states made by other options (e.g. a checkpoint) or corrupted
    "update-state-history_depth": _update_case(called_with={"history_depth": 6}),
    "update-state-history_dtype": _update_case(
        made_with={"history_dtype": torch.bfloat16}, called_with={}
    ),
    "update-state-mode-aadl": _update_case(
        made_with={"mode": "classic", "history_depth": 3}, called_with={"history_depth": 4}
    ),
    "update-state-mode-classic": _update_case(
        made_with={"history_depth": 4}, called_with={"mode": "classic", "history_depth": 3}
    ),
    "update-state-gram-device": _update_case(state=_rebuild(lambda t: t.to("meta"), "gram")),
    "update-state-gram-shape": _update_case(state=lambda s: s._replace(gram=s.gram[:2, :2])),
    "update-state-gram-dtype": _update_case(state=_rebuild(lambda t: t.float(), "gram")),
    "update-state-counter": _update_case(state=lambda s: s._replace(count=3)),
    "update-state-counter-dtype": _update_case(state=_rebuild(lambda t: t.float(), "head")),
    "update-state-anchor-device": _update_case(state=_rebuild(lambda t: t.to("meta"), "anchor")),
    "update-state-iterates-dtype": _update_case(
        made_with={"mode": "classic"}, state=_rebuild(lambda t: t.double(), "iterates")
    ),
    # update in place: params stepped once each, grads read before the params are written
    "update-params-aliased": lambda: _update_in_place(lambda w: {"a": w, "b": w}),
    "update-params-overlap": lambda: _update_in_place(lambda w: {"a": w[:4], "b": w[2:]}),
    "update-grads-aliased": lambda: _update_in_place(
        lambda w: {"a": w[:3], "b": w[3:]}, grads=lambda p: p
    ),
    "update-params-expanded": lambda: _update_in_place(lambda w: {"a": w, "b": w[:1].expand(3)}),
    "update-params-inference": lambda: _update_in_place(lambda w: {"a": w, "b": _inference(w)}),
    "update-params-sparse": _update_case(params=lambda p: {**p, "b": p["b"].to_sparse()}),
    "update-grads-sparse": _update_case(
        grads=lambda p: {**_grads_of(p), "b": _grads_of(p)["b"].to_sparse()}
    ),
    # update: the state's other slots and its values (a tampered or mismatched checkpoint)
    "update-state-residuals-slot-shape": _update_case(
        state=lambda s: s._replace(
            residuals=_slot(s.residuals, 1, "w", lambda t: t.reshape(2, 3).clone())
        )
    ),
    "update-state-residuals-slot-dtype": _update_case(
        state=lambda s: s._replace(residuals=_slot(s.residuals, 2, "b", lambda t: t.double()))
    ),
    "update-state-iterates-slot-shape": _update_case(
        made_with={"mode": "classic"},
        state=lambda s: s._replace(
            iterates=_slot(s.iterates, 2, "w", lambda t: t.reshape(2, 3).clone())
        ),
    ),
    "update-state-head-range": _update_case(state=lambda s: s._replace(head=torch.tensor(99))),
    "update-state-window_size-range": _update_case(
        state=lambda s: s._replace(window_size=torch.tensor(-5))
    ),
    "update-state-count-range": _update_case(state=lambda s: s._replace(count=torch.tensor(-1))),
    "update-state-pending_loss-value": _update_case(
        state=lambda s: s._replace(pending_loss=torch.tensor(-math.inf, dtype=torch.float64))
    ),
    "update-state-pending_loss-type": _update_case(
        state=lambda s: s._replace(pending_loss=torch.tensor(1.0))
    ),
    "update-state-outcome-range": _update_case(
        state=lambda s: s._replace(num_mixed=torch.tensor(7))
    ),
    "update-state-skip_streak-range": _update_case(
        state=lambda s: s._replace(skip_streak=torch.tensor(2))
    ),
    "update-state-aliased-slots": _update_case(
        state=lambda s: s._replace(residuals=(s.residuals[0], *s.residuals[:-1]))
    ),
    "update-state-aliased-params": _update_case(
        state=lambda s: s._replace(num_mixed=s.num_mixed.clone()), params_from_state=True
    ),
    "update-state-expanded": _update_case(
        state=lambda s: s._replace(gram=s.gram[:1].expand_as(s.gram))
    ),
    "update-state-inference": _update_case(state=lambda s: s._replace(gram=_inference(s.gram))),
    "update-state-pending_loss-unmixed": _update_case(
        state=lambda s: s._replace(
            pending_loss=torch.tensor(0.5, dtype=torch.float64), num_mixed=torch.tensor(0)
        )
    ),
    "update-state-mixed-averaged-range": _update_case(
        state=lambda s: s._replace(num_mixed=s.count.clone(), num_averaged=torch.tensor(1))
    ),
    "update-state-window-overflow": _update_case(
        state=lambda s: s._replace(
            anchor=optree.tree_map(lambda t: torch.full_like(t, torch.finfo(t.dtype).max), s.anchor)
        )
    ),
    "update-inner_state-count-value": _update_case(
        state=lambda s: s._replace(inner_state=s.inner_state._replace(count=torch.tensor(0)))
    ),
    "update-inner_state-exp_avg_sq-negative": _update_case(
        inner_made=lambda: adam(0.1),
        inner_called=lambda: adam(0.1),
        state=_inner_field("exp_avg_sq", lambda t: t - 1.0),
    ),
    # update: the inner optimizer's state (checked by the built-in inner optimizers)
    "update-inner_state-type": _update_case(inner_made=lambda: adam(0.1)),
    "update-inner_state-momentum": _update_case(inner_made=lambda: sgd(0.1)),
    "update-inner_state-no-momentum": _update_case(inner_called=lambda: sgd(0.1)),
    "update-inner_state-count": _update_case(
        state=lambda s: s._replace(inner_state=s.inner_state._replace(count=0))
    ),
    "update-inner_state-buffer-dtype": _update_case(
        state=_inner_field("momentum_buffer", lambda t: t.double())
    ),
    "update-inner_state-buffer-shape": _update_case(
        inner_made=lambda: adam(0.1),
        inner_called=lambda: adam(0.1),
        state=_inner_field("exp_avg_sq", lambda t: t[:1]),
    ),
    "update-inner_state-buffer-structure": _update_case(
        state=lambda s: s._replace(
            inner_state=s.inner_state._replace(
                momentum_buffer={"w": s.inner_state.momentum_buffer["w"]}
            )
        )
    ),
    # the inner optimizers' hyperparameters: numbers, 0-d tensors or schedules
    "sgd-lr-type": lambda: sgd("0.1"),
    "sgd-lr-tensor-shape": lambda: sgd(torch.tensor([0.1])),
    "sgd-lr-tensor-range": lambda: sgd(torch.tensor(-0.1)),
    "adam-weight_decay-type": lambda: adam(weight_decay=[0.1]),
    "sgd-schedule-type": _scheduled_update(lambda count: "fast"),
    "sgd-schedule-shape": _scheduled_update(lambda count: torch.full((2,), 0.1)),
    "sgd-schedule-range": _scheduled_update(lambda count: -0.1),
    "sgd-schedule-device": _scheduled_update(lambda count: torch.tensor(0.1, device="meta")),
    "sgd-update-state-type": lambda: sgd(0.1).update(
        _grads_of(_params()), adam(0.1).init(_params())
    ),
    "sgd-init-params-dtype": lambda: sgd(0.1).init(
        {"a": torch.zeros(2), "n": torch.ones(2, dtype=torch.int64)}
    ),
    "adam-update-updates-shape": lambda: adam(0.1).update(
        {"b": torch.ones(2), "w": torch.ones(2, 3)}, adam(0.1).init(_params())
    ),
    "adam-update-params-shape": lambda: aa.adamw(0.1).update(
        _grads_of(_params()),
        aa.adamw(0.1).init(_params()),
        params={"b": torch.zeros(2), "w": torch.zeros(2, 3)},
    ),
    "sgd-update-inplace-type": lambda: sgd(0.1, momentum=0.9).update(
        _grads_of(_params()), sgd(0.1, momentum=0.9).init(_params()), inplace="no"
    ),
    "sgd-update-updates-dtype": lambda: sgd(0.1, momentum=0.9).update(
        {"b": torch.ones(2), "w": torch.ones(3, 2, dtype=torch.int64)},
        sgd(0.1, momentum=0.9).init(_params()),
    ),
    # lbfgs: its arguments, then its init and update called alone
    "lbfgs-lr-type": lambda: aa.lbfgs(lr="1"),
    "lbfgs-lr-range": lambda: aa.lbfgs(lr=0.0),
    "lbfgs-memory_size-type": lambda: aa.lbfgs(memory_size=5.0),
    "lbfgs-memory_size-range": lambda: aa.lbfgs(memory_size=0),
    "lbfgs-scale_init_precond-type": lambda: aa.lbfgs(scale_init_precond=1),
    "lbfgs-curvature_eps-type": lambda: aa.lbfgs(curvature_eps=None),
    "lbfgs-curvature_eps-range": lambda: aa.lbfgs(curvature_eps=-1e-10),
    "lbfgs-init-params-dtype": lambda: aa.lbfgs().init(
        {"a": torch.zeros(2), "n": torch.ones(2, dtype=torch.int64)}
    ),
    "lbfgs-init-params-device": lambda: aa.lbfgs().init(
        {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")}
    ),
    "lbfgs-update-state-type": lambda: aa.lbfgs().update(
        _grads_of(_params()), sgd(0.1).init(_params()), params=_params()
    ),
    "lbfgs-update-state-count": lambda: aa.lbfgs().update(
        _grads_of(_params()), aa.lbfgs().init(_params())._replace(count=0), params=_params()
    ),
    "lbfgs-update-params-none": lambda: aa.lbfgs().update(
        _grads_of(_params()), aa.lbfgs().init(_params())
    ),
    "lbfgs-update-params-structure": lambda: aa.lbfgs().update(
        _grads_of(_params()), aa.lbfgs().init(_params()), params={"w": _params()["w"]}
    ),
    "lbfgs-update-state-shape": lambda: aa.lbfgs(memory_size=3).update(
        _grads_of(_params()), aa.lbfgs(memory_size=5).init(_params()), params=_params()
    ),
    "lbfgs-update-inplace-type": lambda: aa.lbfgs().update(
        _grads_of(_params()), aa.lbfgs().init(_params()), params=_params(), inplace="no"
    ),
    "lbfgs-update-updates-shape": lambda: aa.lbfgs().update(
        {"b": torch.ones(2), "w": torch.ones(2, 3)}, aa.lbfgs().init(_params()), params=_params()
    ),
    "lbfgs-update-updates-dtype": lambda: aa.lbfgs().update(
        {"b": torch.ones(2), "w": torch.ones(3, 2, dtype=torch.int64)},
        aa.lbfgs().init(_params()),
        params=_params(),
    ),
    "lbfgs-update-updates-device": lambda: aa.lbfgs().update(
        {"b": torch.ones(2, device="meta"), "w": torch.ones(3, 2)},
        aa.lbfgs().init(_params()),
        params=_params(),
    ),
    "lbfgs-update-params-leaf": lambda: aa.lbfgs().update(
        _grads_of(_params()), aa.lbfgs().init(_params()), params={"b": 0.5, "w": torch.zeros(3, 2)}
    ),
    "update-inner_state-lbfgs-shape": _update_case(
        inner_made=lambda: aa.lbfgs(memory_size=5), inner_called=lambda: aa.lbfgs(memory_size=3)
    ),
    # short_recurrence: its arguments, then update called with bad input
    "short_recurrence-inner": lambda: aa.short_recurrence(torch.optim.SGD),
    "short_recurrence-relaxation-type": lambda: aa.short_recurrence(sgd(0.1), relaxation="1"),
    "short_recurrence-relaxation-range": lambda: aa.short_recurrence(sgd(0.1), relaxation=0.0),
    "short_recurrence-curvature_eps-range": lambda: aa.short_recurrence(
        sgd(0.1), curvature_eps=math.nan
    ),
    "short_recurrence-drift_tol-range": lambda: aa.short_recurrence(sgd(0.1), drift_tol=0.0),
    "short_recurrence-max_wait-type": lambda: aa.short_recurrence(sgd(0.1), max_wait=1.5),
    "short_recurrence-max_wait-range": lambda: aa.short_recurrence(sgd(0.1), max_wait=-1),
    "short_recurrence-update-state-type": lambda: aa.short_recurrence(sgd(0.1)).update(
        sgd(0.1).init(_params()), _params(), _grads_of(_params())
    ),
    "short_recurrence-update-grads-structure": lambda: aa.short_recurrence(sgd(0.1)).update(
        aa.short_recurrence(sgd(0.1)).init(_params()), _params(), {"w": _params()["w"]}
    ),
    "short_recurrence-update-state-shape": lambda: aa.short_recurrence(sgd(0.1)).update(
        aa.short_recurrence(sgd(0.1)).init({**_params(), "c": torch.zeros(1)}),
        _params(),
        _grads_of(_params()),
    ),
    "short_recurrence-update-loss-shape": lambda: aa.short_recurrence(sgd(0.1)).update(
        aa.short_recurrence(sgd(0.1)).init(_params()),
        _params(),
        _grads_of(_params()),
        loss=torch.ones(2),
    ),
    "short_recurrence-update-grads-leaf": lambda: _short_recurrence_update(grads={"w": 1.0}),
    "short_recurrence-update-grads-shape": lambda: _short_recurrence_update(
        grads={"w": torch.ones(1)}
    ),
    "short_recurrence-update-grads-dtype": lambda: _short_recurrence_update(
        grads={"w": torch.ones(3, 2, dtype=torch.int64)}
    ),
    "short_recurrence-update-grads-device": lambda: _short_recurrence_update(
        grads={"w": torch.ones(3, 2, device="meta")}
    ),
    "short_recurrence-update-inplace-type": lambda: _short_recurrence_update(inplace="no"),
    "short_recurrence-update-params-expanded": lambda: _short_recurrence_update(
        params={"w": torch.zeros(1, 1).expand(3, 2)}, inplace=True
    ),
    # mix and mixing_weights
    "mix-history-none": lambda: aa.mix(None),
    "mix-history-leaf": lambda: aa.mix([1.0, 2.0, 3.0]),
    "mix-history-vector": lambda: aa.mix(torch.linspace(0.0, 1.0, 40)),
    "mix-history-empty": lambda: aa.mix({}),
    "mix-history-scalar": lambda: aa.mix(torch.tensor(1.0)),
    "mix-history-window": lambda: aa.mix({"a": WINDOW, "b": WINDOW[:4]}),
    "mix-history-short": lambda: aa.mix(WINDOW[:2]),
    "mix-history-int": lambda: aa.mix(torch.zeros(4, 3, dtype=torch.int64)),
    "mix-relaxation-type": lambda: aa.mix(WINDOW, relaxation=None),
    "mix-relaxation-range": lambda: aa.mix(WINDOW, relaxation=-0.5),
    "mix-reg-range": lambda: aa.mix(WINDOW, reg=-1.0),
    "mixing_weights-reg-range": lambda: aa.mixing_weights(WINDOW, reg=math.nan),
}


# -- the tests ------------------------------------------------------------------------------


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(tree, none_is_leaf=True)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "meta" or t.layout != torch.strided else t.detach().clone()


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference tensors keep no counter


def _assert_untouched(before: list[tuple], after: list[torch.Tensor]) -> None:
    assert len(before) == len(after)
    for (copy, version), t in zip(before, after):
        assert _version(t) == version, "a tensor was written in place by a failing update"
        assert t.dtype == copy.dtype and t.shape == copy.shape
        if t.device.type != "meta" and t.layout == torch.strided:  # values to compare
            assert torch.equal(t, copy)


def test_every_row_has_a_case():
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), "duplicate ids in errors.md"
    assert set(ids) == set(CASES), (
        f"errors.md rows without a case: {sorted(set(ids) - set(CASES))}; "
        f"cases without a row: {sorted(set(CASES) - set(ids))}"
    )


def test_rows_are_well_formed():
    assert len(ROWS) >= 40
    for row in ROWS:
        assert row.exception in EXCEPTIONS, row
        assert row.function in {
            "anderson",
            "init",
            "update",
            "mix",
            "mixing_weights",
            "sgd",
            "adam",
            "lbfgs",
            "short_recurrence",
        }, row
        # The message names the argument it rejects: the excerpt shows where.
        assert f"`{row.argument}" in row.excerpt, row


def _update_params(row: Row) -> list:
    if not isinstance(CASES.get(row.id), Update):
        return [pytest.param(row, None, id=row.id)]
    return [pytest.param(row, inplace, id=f"{row.id}-inplace={inplace}") for inplace in (0, 1)]


@pytest.mark.parametrize("row, inplace", [p for row in ROWS for p in _update_params(row)])
def test_error_row(row: Row, inplace: int | None):
    case = CASES[row.id]
    expected = EXCEPTIONS[row.exception]
    if not isinstance(case, Update):
        with pytest.raises(expected, match=re.escape(row.excerpt)):
            case()
        return
    opt, spy, state, params, grads, kwargs = case.build()
    kwargs = {"inplace": bool(inplace), **kwargs}
    watched = _tensors((state, params, grads))
    before = [(_copy(t), _version(t)) for t in watched]
    with pytest.raises(expected, match=re.escape(row.excerpt)) as info:
        opt.update(state, params, grads, **kwargs)
    assert spy.calls == 0, "the inner optimizer ran before the error"
    _assert_untouched(before, _tensors((state, params, grads)))
    assert f"`{row.argument}" in str(info.value)


def test_valid_calls_pass_the_checks():
    """The checks reject nothing valid: every option at its boundary, both modes, in place,
    index-less devices ("cpu" vs cpu:0 is not a mismatch), a low-precision window."""
    params = _params()
    for options in (
        {"history_depth": 3, "relaxation": 1e-12, "reg": 0.0, "wait_iterations": 0},
        {"mode": "classic", "history_depth": 3, "store_each_nth": 1, "frequency": 1},
        {"history_device": "cpu", "compute_device": torch.device("cpu")},
        {"history_dtype": torch.bfloat16, "average_tol": 1e-9},
    ):
        opt = aa.anderson(sgd(0.1), **options)
        state = opt.init(params)
        p = params
        for inplace in (False, True, False, True):
            p, state = opt.update(
                state, p, _grads_of(p), inplace=inplace, loss_fn=lambda q: q["w"].sum()
            )
        assert all(torch.isfinite(t).all() for t in p.values())
    with torch.no_grad():  # in place on leaves requiring grad is fine without autograd
        p = _requires_grad(params)
        opt = aa.anderson(sgd(0.1))
        opt.update(opt.init(p), p, _grads_of(params), inplace=True)

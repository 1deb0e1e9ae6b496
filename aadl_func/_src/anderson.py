"""``anderson``: Anderson acceleration as a functional (init, update) transformation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from aadl_func._src import tree
from aadl_func._src.mix import aadl_coefficients
from aadl_func._src.solve import solve_weights
from aadl_func._src.state import AndersonState
from aadl_func._src.validation import (
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_int,
)
from aadl_func._src.window import combine, gram_row, select, set_gram_row, write_slot

__all__ = ["Anderson", "anderson"]

Params = Any
LossFn = Callable[[Params], Tensor]


class Anderson(NamedTuple):
    """A functional optimizer: ``state = init(params)``;
    ``params, state = update(state, params, grads, *, inplace=False, loss_fn=None)``."""

    init: Callable[[Params], AndersonState]
    update: Callable[..., tuple[Params, AndersonState]]


@dataclasses.dataclass(frozen=True)
class _Config:
    inner: Any
    history_depth: int
    relaxation: float
    reg: float
    wait_iterations: int
    store_each_nth: int
    frequency: int
    mode: str
    average: bool
    average_tol: float
    history_device: torch.device | None
    compute_device: torch.device | None
    history_dtype: torch.dtype | None

    @property
    def num_slots(self) -> int:
        # aadl stores differences of consecutive entries; classic stores one residual per pair.
        return self.history_depth - 1 if self.mode == "aadl" else self.history_depth

    def history_device_of(self, p: Tensor) -> torch.device:
        return self.history_device if self.history_device is not None else p.device

    def history_dtype_of(self, p: Tensor) -> torch.dtype:
        return self.history_dtype if self.history_dtype is not None else p.dtype

    def compute_device_of(self, leaves: list[Tensor]) -> torch.device:
        if self.compute_device is not None:
            return self.compute_device
        return self.history_device_of(leaves[0])


def anderson(
    inner: Any,
    *,
    history_depth: int = 10,
    relaxation: float = 1.0,
    reg: float = 0.0,
    wait_iterations: int = 0,
    store_each_nth: int = 1,
    frequency: int = 1,
    mode: str = "aadl",
    average: bool = False,
    average_tol: float = 0.1,
    history_device: torch.device | str | None = None,
    compute_device: torch.device | str | None = None,
    history_dtype: torch.dtype | None = None,
) -> Anderson:
    r"""Anderson-accelerates an inner optimizer, treating its step as a fixed-point map ``g``.

    Mode ``"aadl"`` (default, AADL's semantics). Call number :math:`k` (1-based):

    1. :math:`y = g(x)`, the inner optimizer's step from ``params`` with ``grads``;
    2. if :math:`k \bmod` ``store_each_nth`` :math:`= 0`, :math:`y` joins the window (at most
       ``history_depth`` entries, oldest dropped);
    3. if :math:`k >` ``wait_iterations``, :math:`k \bmod` ``frequency`` :math:`= 0` and the
       window holds at least 3 entries, the params become :math:`x` = :func:`aadl_func.mix`
       (window, ``relaxation``, ``reg``), else :math:`y`;
    4. with ``loss_fn``, :math:`x` is kept only if ``loss_fn(x) < loss_fn(y)``, and then also
       replaces the newest window entry; a non-finite :math:`x` is never returned.

    Mode ``"classic"``: textbook type-II Anderson acceleration on the pairs
    :math:`(x_i, g(x_i))` of the last ``history_depth`` calls,

    .. math::

        x_{k+1} = \sum_i \alpha_i \big((1 - \beta) x_i + \beta g(x_i)\big), \quad
        \alpha = \arg\min_{\sum \alpha = 1} \Big\|\sum_i \alpha_i (g(x_i) - x_i)\Big\|,

    gated by ``wait_iterations`` and ``frequency`` (and at least 2 pairs); on a linear map with
    full history and :math:`\beta = 1` it is equivalent to GMRES (Walker & Ni, 2011).

    The window is a ring of differences with an incrementally updated float64 Gram matrix: a
    step costs two passes over the window (:math:`O(m n)`), solves an :math:`m \times m`
    problem in float64 (:func:`aadl_func.solve_weights`) and stores, in mode "aadl", the newest
    entry plus ``history_depth - 1`` differences.

    Args:
      inner: the inner optimizer, e.g. :func:`aadl_func.adam`, or any object with torchopt-style
        ``init(params)`` and ``update(updates, state, params=None, inplace=...)`` returning
        ``(updates, state)`` (updates are added to the params).
      history_depth: window entries, ``>= 3``.
      relaxation: :math:`\beta > 0`; 1 is undamped, above 1 over-relaxes.
      reg: absolute Tikhonov weight of the least-squares problem, ``>= 0``.
      wait_iterations: calls before the first mixing, ``>= 0``.
      store_each_nth: store every n-th inner step in the window, ``>= 1``.
      frequency: mix every ``frequency`` calls, ``>= 1``.
      mode: ``"aadl"`` or ``"classic"``.
      average: AADL's moving-average rule on the window (see the README).
      average_tol: relative spread of the window above which ``average`` applies, ``> 0``.
      history_device: where the window lives (default: each parameter's device).
      compute_device: where the small least-squares problem is solved (default: the history
        device of the first parameter). Passes over the window always run where it lives.
      history_dtype: dtype of the stored differences (default: each parameter's dtype).

    Returns:
      :class:`Anderson` ``(init, update)``.
    """
    owner = "anderson"
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"{owner}: `inner` must have callable `init` and `update` (e.g. aadl_func.adam(...)),"
            f" got {type(inner).__name__}"
        )
    if not isinstance(average, bool):
        raise TypeError(f"{owner}: `average` must be a bool, got {type(average).__name__}")
    config = _Config(
        inner=inner,
        history_depth=check_int(owner, "history_depth", history_depth, 3),
        relaxation=check_float(owner, "relaxation", relaxation, minimum=0.0, strict=True),
        reg=check_float(owner, "reg", reg, minimum=0.0),
        wait_iterations=check_int(owner, "wait_iterations", wait_iterations, 0),
        store_each_nth=check_int(owner, "store_each_nth", store_each_nth, 1),
        frequency=check_int(owner, "frequency", frequency, 1),
        mode=check_choice(owner, "mode", mode, ("aadl", "classic")),
        average=average,
        average_tol=check_float(owner, "average_tol", average_tol, minimum=0.0, strict=True),
        history_device=check_device(owner, "history_device", history_device),
        compute_device=check_device(owner, "compute_device", compute_device),
        history_dtype=check_dtype(owner, "history_dtype", history_dtype),
    )

    def init(params: Params) -> AndersonState:
        return _init(config, params)

    def update(
        state: AndersonState,
        params: Params,
        grads: Params,
        *,
        inplace: bool = False,
        loss_fn: LossFn | None = None,
    ) -> tuple[Params, AndersonState]:
        return _update(config, state, params, grads, inplace=inplace, loss_fn=loss_fn)

    return Anderson(init, update)


def _counter() -> Tensor:
    # Counters live on the CPU: reading them never synchronises an accelerator.
    return torch.zeros((), dtype=torch.int64)


def _window_buffer(config: _Config, p: Tensor) -> Tensor:
    return torch.zeros_like(
        p,
        dtype=config.history_dtype_of(p),
        device=config.history_device_of(p),
        memory_format=torch.preserve_format,
    )


def _init(config: _Config, params: Params) -> AndersonState:
    leaves, spec = tree.flatten(params, "params")
    if not leaves:
        raise ValueError("anderson.init: `params` must contain at least one tensor")
    for i, p in enumerate(leaves):
        if not p.is_floating_point():
            raise TypeError(f"anderson.init: `params` leaf {i} must be floating, got {p.dtype}")
    q = config.num_slots

    def ring() -> tuple:
        return tuple(
            tree.unflatten(spec, [_window_buffer(config, p) for p in leaves]) for _ in range(q)
        )

    if config.mode == "aadl":
        anchor = tree.unflatten(
            spec,
            [
                torch.zeros_like(
                    p, device=config.history_device_of(p), memory_format=torch.preserve_format
                )
                for p in leaves
            ],
        )
        iterates: tuple = ()
    else:
        anchor = ()
        iterates = ring()
    device = config.compute_device_of(leaves)
    return AndersonState(
        count=_counter(),
        inner_state=config.inner.init(params),
        anchor=anchor,
        residuals=ring(),
        iterates=iterates,
        gram=torch.zeros(q, q, dtype=torch.float64, device=device),
        head=torch.full((), q - 1, dtype=torch.int64),
        window_size=_counter(),
        num_mixed=_counter(),
        num_rejected=_counter(),
        num_nonfinite=_counter(),
        num_averaged=_counter(),
    )


def _check_inputs(
    config: _Config, state: AndersonState, params: Params, grads: Params, loss_fn: Any
) -> tuple[list[Tensor], Any, list[Tensor]]:
    if not isinstance(state, AndersonState):
        raise TypeError(
            f"anderson.update: `state` must be an AndersonState, got {type(state).__name__}"
        )
    p_leaves, spec = tree.flatten(params, "params")
    g_leaves, g_spec = tree.flatten(grads, "grads")
    tree.check_like("grads", g_leaves, g_spec, p_leaves, spec, check_dtype=True)
    if len(state.residuals) != config.num_slots:
        raise ValueError(
            f"anderson.update: `state` holds {len(state.residuals)} window slots, this optimizer "
            f"expects {config.num_slots} (history_depth={config.history_depth}, mode="
            f"{config.mode!r}); was it made by another configuration?"
        )
    s_leaves, s_spec = tree.flatten(state.residuals[0], "state.residuals")
    tree.check_like("params", p_leaves, spec, s_leaves, s_spec, ref_name="the state's window")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"anderson.update: `loss_fn` must be callable, got {type(loss_fn).__name__}"
        )
    return p_leaves, spec, g_leaves


def _update(
    config: _Config,
    state: AndersonState,
    params: Params,
    grads: Params,
    *,
    inplace: bool,
    loss_fn: LossFn | None,
) -> tuple[Params, AndersonState]:
    p_leaves, spec, _ = _check_inputs(config, state, params, grads, loss_fn)
    updates, inner_state = config.inner.update(
        grads, state.inner_state, params=params, inplace=inplace
    )
    u_leaves, u_spec = tree.flatten(updates, "inner updates")
    tree.check_like("inner updates", u_leaves, u_spec, p_leaves, spec)
    step = _AadlStep if config.mode == "aadl" else _ClassicStep
    return step(config, state, p_leaves, spec, u_leaves, inner_state, inplace, loss_fn).run()


class _Step:
    """One call of ``update``: the parts both modes share (gates, ring append, safeguard)."""

    def __init__(
        self,
        config: _Config,
        state: AndersonState,
        p_leaves: list[Tensor],
        spec: Any,
        u_leaves: list[Tensor],
        inner_state: Any,
        inplace: bool,
        loss_fn: LossFn | None,
    ) -> None:
        self.config = config
        self.state = state
        self.params = p_leaves
        self.spec = spec
        self.updates = u_leaves
        self.inner_state = inner_state
        self.inplace = inplace
        self.loss_fn = loss_fn
        self.count = state.count + 1
        self.q = config.num_slots
        self.ring = tuple(tree.flatten(r, "state.residuals")[0] for r in state.residuals)
        self.compute_device = state.gram.device
        self.compute_dtypes = [
            torch.promote_types(
                torch.promote_types(p.dtype, config.history_dtype_of(p)), torch.float32
            )
            for p in p_leaves
        ]

    # -- helpers ---------------------------------------------------------------------------
    def inner_step(self) -> list[Tensor]:
        """``y = x + u``: the plain step, written into the params' buffers if ``inplace``."""
        if self.inplace:
            return [p.add_(u) for p, u in zip(self.params, self.updates)]
        return [p + u for p, u in zip(self.params, self.updates)]

    def to_history(self, leaves: list[Tensor], like: list[Tensor]) -> list[Tensor]:
        """Leaves moved to the window's device/dtype/layout (O(n) per leaf, no-op if there)."""
        return [
            tree.as_layout(v.to(device=w.device, dtype=w.dtype, non_blocking=True), w)
            for v, w in zip(leaves, like)
        ]

    def slot_valid(self, head: Tensor, num_residuals: Tensor) -> Tensor:
        """Ring-order mask of slots holding one of the newest ``num_residuals`` residuals."""
        slots = torch.arange(self.q)
        age = (head - slots) % self.q
        return age < num_residuals

    def chronological(self, head: Tensor) -> Tensor:
        """Ring slots from oldest to newest (the newest is ``head``)."""
        return (head + 1 + torch.arange(self.q)) % self.q

    def append(
        self, ring: tuple, gram: Tensor, head: Tensor, num_residuals: Tensor, residual: list[Tensor]
    ) -> tuple[tuple, Tensor, Tensor, Tensor, Tensor]:
        """Writes ``residual`` into the next slot and its Gram row.

        A residual whose Gram row is not finite (an Inf/NaN iterate) is zeroed and the window
        restarts from the newest entry, so poisoned data never reaches a later mix.

        Returns ``(ring, gram, head, num_residuals, poisoned)``.
        """
        slot = (head + 1) % self.q
        ring = write_slot(ring, slot, residual, self.inplace)
        row = gram_row(ring, residual, self.compute_device)
        grown = torch.clamp(num_residuals + 1, max=self.q)
        valid = self.slot_valid(slot, grown).to(row.device)
        poisoned = ~torch.isfinite(torch.where(valid, row, 0.0)).all().cpu()

        def restart() -> tuple:
            zeros = [torch.zeros_like(r) for r in residual]
            return write_slot(ring, slot, zeros, self.inplace), torch.zeros_like(gram)

        ring, new_gram = select(poisoned, restart, (ring, set_gram_row(gram, slot, row)))
        num_residuals = torch.where(poisoned, torch.zeros_like(grown), grown)
        return ring, new_gram, slot, num_residuals, poisoned

    def solve(self, gram: Tensor, head: Tensor, num_residuals: Tensor):
        order = self.chronological(head)
        order_c = order.to(self.compute_device)
        chrono = gram[order_c][:, order_c]
        weights = solve_weights(chrono, num_residuals.to(self.compute_device), self.config.reg)
        return weights, order_c

    def to_ring_order(self, chrono_values: Tensor, order: Tensor) -> Tensor:
        return torch.zeros_like(chrono_values).index_copy(0, order, chrono_values)

    def finite(self, leaves: list[Tensor]) -> Tensor:
        flag = torch.ones((), dtype=torch.bool)
        for t in leaves:
            flag = flag & torch.isfinite(t).all().cpu()
        return flag

    def to_params(self, leaves: list[Tensor]) -> list[Tensor]:
        return [
            v.to(device=p.device, dtype=p.dtype, non_blocking=True)
            for v, p in zip(leaves, self.params)
        ]

    def safeguard(self, gate: Tensor, x: list[Tensor], y: list[Tensor]) -> Tensor:
        """``gate`` and ``loss_fn(x) < loss_fn(y)`` (both finite); True without ``loss_fn``."""
        if self.loss_fn is None:
            return gate

        def decide() -> Tensor:
            loss_x = self.loss_fn(tree.unflatten(self.spec, x))
            loss_y = self.loss_fn(tree.unflatten(self.spec, y))
            for name, loss in (("loss_fn(params)", loss_x),):
                if not isinstance(loss, Tensor) or loss.numel() != 1:
                    raise TypeError(f"anderson.update: {name} must return a scalar tensor")
            better = torch.isfinite(loss_x) & (loss_x < loss_y)
            return gate & better.reshape(()).cpu()

        return select(gate, decide, torch.zeros((), dtype=torch.bool))

    def output(self, use_mix: Tensor, x: list[Tensor], y: list[Tensor]) -> list[Tensor]:
        """The returned params: ``x`` where ``use_mix`` else ``y``, in the params' buffers if
        ``inplace`` (``y`` already lives there)."""
        chosen = select(use_mix, lambda: x, y)
        if self.inplace:
            for p, v in zip(self.params, chosen):
                if v is not p:
                    p.copy_(v)
            return self.params
        return list(chosen)

    def new_state(self, **fields: Any) -> AndersonState:
        return self.state._replace(count=self.count, inner_state=self.inner_state, **fields)


class _AadlStep(_Step):
    def run(self) -> tuple[Params, AndersonState]:
        config, state = self.config, self.state
        anchor = tree.flatten(state.anchor, "state.anchor")[0]
        y = self.inner_step()
        y_hist = self.to_history(y, anchor)

        store = self.count % config.store_each_nth == 0
        empty = state.window_size == 0
        num_residuals = torch.clamp(state.window_size - 1, min=0)

        def append_residual() -> tuple:
            residual = [(yh - a).to(config.history_dtype_of(a)) for yh, a in zip(y_hist, anchor)]
            residual = self.to_history(residual, self.ring[0])
            return self.append(self.ring, state.gram, state.head, num_residuals, residual)

        no_append = (
            self.ring,
            state.gram,
            state.head,
            num_residuals,
            torch.zeros((), dtype=torch.bool),
        )
        ring, gram, head, num_residuals, poisoned = select(
            store & ~empty, append_residual, no_append
        )

        def store_anchor() -> list[Tensor]:
            if self.inplace:
                for a, v in zip(anchor, y_hist):
                    a.copy_(v)
                return anchor
            # The window owns its buffers: never share storage with the returned params.
            return [v.clone() if v is yv else v for v, yv in zip(y_hist, y)]

        anchor = select(store, store_anchor, anchor)
        window_size = torch.where(
            store,
            torch.where(empty, torch.ones_like(num_residuals), num_residuals + 1),
            state.window_size,
        )

        gate = (
            (self.count > config.wait_iterations)
            & (self.count % config.frequency == 0)
            & (window_size >= 3)
        )

        def extrapolate() -> tuple[list[Tensor], Tensor]:
            weights, order = self.solve(gram, head, num_residuals)
            coefficients = aadl_coefficients(weights.alpha, config.relaxation)
            x_hist = combine(
                anchor,
                [ring],
                -self.to_ring_order(coefficients, order),
                self.compute_dtypes,
                anchor,
            )
            ok = weights.ok.cpu() & self.finite(x_hist)
            return x_hist, ok

        zero_like_anchor = [
            torch.zeros_like(a, dtype=c) for a, c in zip(anchor, self.compute_dtypes)
        ]
        x_hist, ok = select(
            gate, extrapolate, (zero_like_anchor, torch.zeros((), dtype=torch.bool))
        )
        mixable = gate & ok
        x = select(mixable, lambda: self.to_params(x_hist), y)
        use_mix = self.safeguard(mixable, x, y)

        if self.loss_fn is not None:

            def replace_newest() -> tuple:
                newest = _read_slot(ring, head)
                x_anchor = [v.to(a.dtype) for v, a in zip(x_hist, anchor)]
                residual = [
                    (r.to(c) + (xa - a).to(c)).to(r.dtype)
                    for r, xa, a, c in zip(newest, x_anchor, anchor, self.compute_dtypes)
                ]
                new_ring = write_slot(ring, head, residual, self.inplace)
                row = gram_row(new_ring, residual, self.compute_device)
                if self.inplace:
                    for a, xa in zip(anchor, x_anchor):
                        a.copy_(xa)
                    x_anchor = anchor
                return new_ring, set_gram_row(gram, head, row), x_anchor

            ring, gram, anchor = select(use_mix, replace_newest, (ring, gram, anchor))

        out = self.output(use_mix, x, y)
        new_state = self.new_state(
            anchor=tree.unflatten(self.spec, list(anchor)),
            residuals=tuple(tree.unflatten(self.spec, list(r)) for r in ring),
            gram=gram,
            head=head,
            window_size=window_size,
            num_mixed=state.num_mixed + use_mix.long(),
            num_rejected=state.num_rejected + (mixable & ~use_mix).long(),
            num_nonfinite=state.num_nonfinite + (poisoned | (gate & ~ok)).long(),
        )
        return tree.unflatten(self.spec, out), new_state


class _ClassicStep(_Step):
    def run(self) -> tuple[Params, AndersonState]:
        config, state = self.config, self.state
        iterates = tuple(tree.flatten(r, "state.iterates")[0] for r in state.iterates)
        store = self.count % config.store_each_nth == 0

        def append_pair() -> tuple:
            slot = (state.head + 1) % self.q
            # x_k is copied into the window before an in-place step overwrites params.
            new_iterates = write_slot(
                iterates, slot, self.to_history(self.params, iterates[0]), self.inplace
            )
            residual = self.to_history(self.updates, self.ring[0])
            ring, gram, head, size, poisoned = self.append(
                self.ring, state.gram, state.head, state.window_size, residual
            )
            return new_iterates, ring, gram, head, size, poisoned

        unchanged = (
            iterates,
            self.ring,
            state.gram,
            state.head,
            state.window_size,
            torch.zeros((), dtype=torch.bool),
        )
        iterates, ring, gram, head, window_size, poisoned = select(store, append_pair, unchanged)

        y = self.inner_step()

        gate = (
            (self.count > config.wait_iterations)
            & (self.count % config.frequency == 0)
            & (window_size >= 2)
        )

        def extrapolate() -> tuple[list[Tensor], Tensor]:
            weights, order = self.solve(gram, head, window_size)
            alpha = self.to_ring_order(weights.alpha, order)
            x_hist = combine(
                None,
                [iterates, ring],
                torch.cat([alpha, config.relaxation * alpha]),
                self.compute_dtypes,
                ring[0],
            )
            return x_hist, weights.ok.cpu() & self.finite(x_hist)

        zero_like = [torch.zeros_like(r, dtype=c) for r, c in zip(ring[0], self.compute_dtypes)]
        x_hist, ok = select(gate, extrapolate, (zero_like, torch.zeros((), dtype=torch.bool)))
        mixable = gate & ok
        x = select(mixable, lambda: self.to_params(x_hist), y)
        use_mix = self.safeguard(mixable, x, y)
        out = self.output(use_mix, x, y)
        new_state = self.new_state(
            residuals=tuple(tree.unflatten(self.spec, list(r)) for r in ring),
            iterates=tuple(tree.unflatten(self.spec, list(r)) for r in iterates),
            gram=gram,
            head=head,
            window_size=window_size,
            num_mixed=state.num_mixed + use_mix.long(),
            num_rejected=state.num_rejected + (mixable & ~use_mix).long(),
            num_nonfinite=state.num_nonfinite + (poisoned | (gate & ~ok)).long(),
        )
        return tree.unflatten(self.spec, out), new_state


def _read_slot(ring: tuple, slot: Tensor) -> list[Tensor]:
    index = tree.static_value(slot)
    if index is not None:
        return list(ring[index])
    return [torch.stack([entries[i] for entries in ring])[slot] for i in range(len(ring[0]))]

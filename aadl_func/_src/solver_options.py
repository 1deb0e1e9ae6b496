"""The solvers' arguments, checked before the map is ever called, each error naming the
solver (`owner`) and the argument.

`options()` checks the loop's options (tolerances, budget, line search, callback, loop
choice); `anderson_options()` those of the [`aadl_func.anderson()`][aadl_func.anderson]
update that runs around the identity inner optimizer (`_IDENTITY`); `check_x0()` the
starting point's leaves and, with `batch_dims`, `check_batch()` their batch shape and the
tolerances given per problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._C import _functorch

from aadl_func._src import tree
from aadl_func._src.inner import InnerOptimizer
from aadl_func._src.options import AndersonOptions
from aadl_func._src.validation import check_bool, check_callable, check_float, check_int

__all__ = ["Options", "anderson_options", "check_batch", "check_x0", "options"]

PyTree = Any


# -- the identity inner optimizer ------------------------------------------------------------
def _identity_init(params: PyTree) -> tuple:
    return ()


def _identity_update(
    updates: PyTree, state: tuple, params: PyTree = None, inplace: bool = False
) -> tuple[PyTree, tuple]:
    return updates, state


# The inner "optimizer" whose step from x with grads r is x + r: Anderson then accelerates
# x -> x + r(x), the map the solver was given.
_IDENTITY = InnerOptimizer(_identity_init, _identity_update)


# -- the options -----------------------------------------------------------------------------
# The options of aadl_func.anderson that the solvers pass through (read once: torch.compile
# does not trace dataclasses.fields of a class).
_ANDERSON_OPTIONS = frozenset(AndersonOptions.names())


@dataclasses.dataclass(frozen=True)
class Options:
    """The loop's options, checked (`options()`)."""

    tol: float | Tensor
    rtol: float | Tensor
    gtol: float | Tensor
    max_iter: int
    line_search: bool
    callback: Callable | None
    masked: bool | None
    return_best: bool

    def tensors(self) -> list[Tensor]:
        """The tolerances given as tensors (a batched one makes the loop masked)."""
        return [t for t in (self.tol, self.rtol, self.gtol) if isinstance(t, Tensor)]


def options(
    owner: str,
    tol: object,
    rtol: object,
    max_iter: object,
    line_search: object,
    callback: object,
    masked: object,
    return_best: object,
    gtol: object = 0.0,
    batch_dims: int = 0,
) -> Options:
    """`fixed_point`'s and `root`'s options for the loop, checked in the name of `owner`
    (`line_search`: True or "armijo" for SciPy's search, None or False for none)."""
    if line_search not in (None, False, True, "armijo"):
        raise ValueError(
            f"{owner}: `line_search` must be None, False, True or 'armijo', got {line_search!r}"
        )
    if callback is not None:
        check_callable(owner, "callback", callback)
    return Options(
        tol=_tolerance(owner, "tol", tol, batch_dims),
        rtol=_tolerance(owner, "rtol", rtol, batch_dims),
        gtol=_tolerance(owner, "gtol", gtol, batch_dims),
        max_iter=check_int(owner, "max_iter", max_iter, 0),
        line_search=line_search not in (None, False),
        callback=callback,  # type: ignore[arg-type]
        masked=None if masked is None else check_bool(owner, "masked", masked),
        return_best=check_bool(owner, "return_best", return_best),
    )


def _tolerance(owner: str, name: str, value: object, batch_dims: int) -> float | Tensor:
    """A tolerance: a real number `>= 0`, or a real tensor of them (a float64 copy): 0-d,
    the per-problem value under `vmap` (a batched 0-d tensor), or with `batch_dims` one
    per problem of the batch (its shape checked against `x0` later). Its values are checked
    where they can be read (not under a transform or while compiling)."""
    if not isinstance(value, Tensor):
        return check_float(owner, name, value, minimum=0.0)
    if value.is_complex() or value.dtype == torch.bool or value.dim() > batch_dims:
        raise TypeError(
            f"{owner}: `{name}` must be a real number or a real tensor of one per problem "
            f"(0-d, or the batch shape with batch_dims), got a {value.dtype} tensor of shape "
            f"{tuple(value.shape)}"
        )
    value = value.detach().to(torch.float64)
    if not tree.is_transformed(value) and not bool(((value >= 0) & value.isfinite()).all()):
        raise ValueError(f"{owner}: `{name}` must be finite and >= 0.0, got {value.tolist()}")
    return value


def anderson_options(
    owner: str,
    history_depth: int,
    relaxation: float,
    reg: float,
    reg_relative: float,
    mode: str,
    anderson_options: dict[str, Any],
) -> AndersonOptions:
    """The options of the [`aadl_func.anderson()`][aadl_func.anderson] update around the
    identity map, validated in the solver's name. Mode "classic" takes `history_depth=2` here
    (AA(1), SciPy's `M=1`: one difference), which `anderson` itself does not."""
    if "inner" in anderson_options:
        raise TypeError(f"{owner}: `inner` is set by the solver (the identity map), not by you")
    unknown = sorted(set(anderson_options) - _ANDERSON_OPTIONS)
    if unknown:
        raise TypeError(
            f"{owner}: unexpected keyword argument `{unknown[0]}` (neither a solver option nor "
            "one of aadl_func.anderson's)"
        )
    return AndersonOptions.for_owner(
        owner,
        2 if mode == "classic" else 3,
        inner=_IDENTITY,
        history_depth=history_depth,
        relaxation=relaxation,
        reg=reg,
        reg_relative=reg_relative,
        mode=mode,
        **anderson_options,
    )


# -- the starting point and the batch --------------------------------------------------------
def check_x0(
    owner: str, x0: PyTree, mode: str | None = None, name: str = "x0"
) -> tuple[list[Tensor], Any]:
    """`x0`'s leaves: real floating, or (`mode="classic"`) all complex; `mode` None
    ([`implicit_fixed_point()`][aadl_func.implicit_fixed_point], whose `name` is `z0`) takes real
    ones only."""
    leaves, spec = tree.flatten(x0, name, owner=owner)
    if not leaves:
        raise ValueError(f"{owner}: `{name}` must contain at least one tensor")
    kinds = [leaf.is_complex() for leaf in leaves]
    for i, leaf in enumerate(leaves):
        if leaf.is_floating_point():
            continue
        path = tree.leaf_path(spec, i, name)
        if not leaf.is_complex():
            raise TypeError(
                f"{owner}: `{path}` has dtype {leaf.dtype}; {owner} takes floating tensors "
                "(real, or complex in mode='classic')"
            )
        if mode is None:
            raise TypeError(
                f"{owner}: `{path}` has dtype {leaf.dtype}; {owner} takes real floating "
                "tensors (complex ones are not supported: the adjoint solve is written for "
                "real vjps)"
            )
        if mode != "classic":
            raise TypeError(
                f"{owner}: `{path}` is complex ({leaf.dtype}); complex problems are solved in "
                f"mode='classic' only (the default), not mode={mode!r}"
            )
        if not all(kinds):
            real = tree.leaf_path(spec, kinds.index(False), name)
            raise TypeError(
                f"{owner}: `{path}` is complex but `{real}` is real; `{name}` must be all real or "
                "all complex (make the real leaves complex)"
            )
    return leaves, spec


def check_batch(
    owner: str, leaves: list[Tensor], spec: Any, options: Options, batch_dims: int
) -> None:
    """With `batch_dims` (1, not under a transform): every leaf of `x0` starts with the
    same batch shape, and each tolerance is one number or one per problem (the batch
    shape)."""
    if batch_dims > 1:
        raise ValueError(
            f"{owner}: `batch_dims` must be 0 or 1, got {batch_dims} (the core's update does "
            "not nest vmaps: fold the batch dimensions into one)"
        )
    if _functorch.maybe_current_level() is not None:
        raise ValueError(
            f"{owner}: `batch_dims` is not available under torch.func transforms (the core's "
            "update does not nest vmaps): fold the vmapped dimension into the batch, or vmap "
            "the solve without batch_dims"
        )
    shape = leaves[0].shape[:batch_dims]
    for i, leaf in enumerate(leaves):
        if leaf.dim() < batch_dims or leaf.shape[:batch_dims] != shape:
            raise ValueError(
                f"{owner}: `{tree.leaf_path(spec, i, 'x0')}` has shape {tuple(leaf.shape)}; "
                f"with batch_dims={batch_dims} every leaf of `x0` starts with the batch shape "
                f"{tuple(shape)}"
            )
    for name in ("tol", "rtol", "gtol"):
        value = getattr(options, name)
        if isinstance(value, Tensor) and value.dim() and value.shape != shape:
            raise ValueError(
                f"{owner}: `{name}` has shape {tuple(value.shape)}; with batch_dims="
                f"{batch_dims} a tolerance is one number or one per problem, shape {tuple(shape)}"
            )

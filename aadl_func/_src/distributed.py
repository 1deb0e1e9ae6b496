r"""Sharded parameters (FSDP2 `fully_shard` / DTensor): local windows, one all_reduce a step.

Data parallel training (DDP) needs nothing from this module: every rank holds the same params
and the same averaged grads, and `update` is deterministic, so the ranks stay bit-identical
without any communication of ours.

With sharded params each rank holds a shard $x^{(r)}$ of every parameter, and every
quantity of Anderson acceleration splits into per-rank pieces:

* the window, the anchor, the inner optimizer's state and the combination
  $x = a - \sum_s c_s r_s$ act coordinate by coordinate, so each rank applies them to its
  own shards (the [`aadl_func.AndersonState`][aadl_func.AndersonState] holds local tensors only);
* the inner products of the Gram matrix are sums over coordinates,
  $\langle r_s, r_t \rangle = \sum_r \langle r_s^{(r)}, r_t^{(r)} \rangle$, so each rank
  computes its partial sums and one `all_reduce` adds them up.

After that reduction every rank holds the same float64 Gram matrix, solves the same small
problem and takes the same decisions (mix or not, restart on non-finite data), which is what
keeps the shards of one logical parameter vector consistent.

One all_reduce a step. The safeguard may replace the newest residual *after* the reduction
(once `loss_fn` has accepted the mix). Instead of a second reduction for the new Gram row,
the state keeps the row of the newest residual as this rank's partial sums and the next step
adds them up together with its own new rows: a step that appends reduces `[rows of the
previous newest residual in gram and dr_gram (2 Q), the new residual's rows g, h and its
dr_rhs c (3 Q), base bound (1)]`, i.e. `5 Q + 1` float64 values (`3 Q + 1` for a mix
without an append: the two head rows and `dr_rhs`). So in a sharded state `gram[head]` and
`dr_gram[head]` (rows and columns) and `dr_rhs` hold this rank's partial sums and every
other entry the global inner products.

Finiteness without a second reduction. Whether the mixed point $x$ is finite is decided
from reduced quantities, identically on every rank: with $|r_{s,i}| \le \|r_s\|_2 =
\sqrt{G_{ss}}$ and $|a_i| \le A$,

$$
    |x_i| \le A + \sum_s |c_s| \sqrt{G_{ss}} =: B,
$$

and the mix is used only if $B$ is at most half the largest finite value of the
parameter and compute dtypes (the combination and its rounding then cannot overflow). `A` is
the sum over ranks of each rank's largest magnitude of the combination's base (an upper bound
of the global maximum), reduced in the same all_reduce. The unsharded path checks the
entries themselves; the certificate can differ from it only for a finite mix with $B$
above half the largest value (about 1.7e38 for float32 and bfloat16 params, 32752 for float16;
`A` overestimates the largest entry by at most the number of ranks).

The loss of the safeguard. `loss_fn` receives DTensors. A DTensor loss is read through
`full_tensor()` (free for a replicated one); a plain tensor is taken as this rank's loss and
the pair `(loss_fn(x), loss_fn(y))` is averaged over the group with one all_reduce of two
float64 values, so every rank takes the same decision.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from aadl_func._src import tree

__all__ = ["ShardedCall", "sharded_call", "is_dtensor", "max_abs"]


def _dtensor_class() -> type | None:
    # A DTensor can only exist once torch.distributed.tensor has been imported: looking the
    # class up in sys.modules keeps plain (undistributed) use free of that import.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def max_abs(leaves: list[Tensor], device: torch.device) -> Tensor:
    """`max_i |t_i|` over all leaves, a float64 0-d tensor on `device` (0 if there are no
    entries; NaN propagates). Stays on the accelerator when `device` is one: no sync."""
    out = torch.zeros((), dtype=torch.float64, device=device)
    for t in leaves:
        if t.numel() > 0:
            # vector_norm(inf) reduces |t| without materialising it.
            m = torch.linalg.vector_norm(t, float("inf")).to(torch.float64)
            out = torch.maximum(out, m.to(device, non_blocking=True))
    return out


class ShardedCall:
    """One `init`/`update` call on DTensor params: local shards in, DTensors out.

    Holds the params' device mesh, placements and global shapes, the local views of the
    params (`p.detach().to_local()` shares the shard's storage, so in-place writes reach the
    DTensor), and the reduction primitives of `aadl_func._src.anderson`'s sharded step.
    """

    def __init__(self, leaves: list[Tensor], owner: str, *, average: bool = False) -> None:
        dtensor = _dtensor_class()
        if average:
            # The rule's relative spread needs ||mean||, a second reduction after the mean is
            # formed; not wired into the one-all_reduce step yet.
            raise NotImplementedError(
                f"{owner}: `average=True` is not supported with sharded (DTensor) params"
            )
        if any(p.is_complex() for p in leaves):
            # The step's one all_reduce packs float64 rows and a real finiteness bound.
            raise NotImplementedError(
                f"{owner}: complex sharded (DTensor) params are not supported; complex params "
                "work unsharded (mode='classic')"
            )
        if not all(isinstance(p, dtensor) for p in leaves):
            kinds = sorted({"DTensor" if isinstance(p, dtensor) else "Tensor" for p in leaves})
            raise TypeError(
                f"{owner}: `params` mixes DTensor and plain tensor leaves ({', '.join(kinds)}); "
                "shard every parameter (e.g. fully_shard the whole model) or none"
            )
        mesh = leaves[0].device_mesh
        for i, p in enumerate(leaves):
            if p.device_mesh != mesh:
                raise ValueError(
                    f"{owner}: `params` leaf {i} lives on another device mesh than leaf 0; "
                    "all DTensor params must share one mesh"
                )
        if mesh.ndim != 1:
            raise NotImplementedError(
                f"{owner}: DTensor params on a {mesh.ndim}-d device mesh are not supported; "
                "use a 1-d mesh (FSDP2's default; HSDP and tensor parallelism are not handled)"
            )
        for i, p in enumerate(leaves):
            if not all(placement.is_shard() for placement in p.placements):
                raise NotImplementedError(
                    f"{owner}: `params` leaf {i} has placements {tuple(p.placements)}; only "
                    "sharded (Shard) DTensor params are supported: a replicated leaf would be "
                    "counted once per rank in the Gram matrix"
                )
        self.owner = owner
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.originals = list(leaves)
        self.locals = [p.detach().to_local() for p in leaves]
        # gloo reduces CPU tensors, NCCL CUDA tensors: the buffer goes where the mesh lives.
        self.reduce_device = torch.device(mesh.device_type)
        if mesh.device_type != "cpu":
            module = torch.get_device_module(mesh.device_type)
            self.reduce_device = torch.device(mesh.device_type, module.current_device())
        self.losses_are_global = True

    # -- DTensor <-> local -----------------------------------------------------------------
    def localize(self, leaves: list[Tensor], name: str) -> list[Tensor]:
        """Local shards of `leaves` (grads), which must be sharded exactly like the params."""
        out = []
        for i, (t, p) in enumerate(zip(leaves, self.originals)):
            if not is_dtensor(t):
                raise TypeError(
                    f"{self.owner}: `{name}` leaf {i} must be a DTensor like `params`, got "
                    f"{type(t).__name__}"
                )
            if t.device_mesh != self.mesh or tuple(t.placements) != tuple(p.placements):
                raise ValueError(
                    f"{self.owner}: `{name}` leaf {i} has placements {tuple(t.placements)}, "
                    f"expected {tuple(p.placements)} like `params` on the same mesh; "
                    "redistribute it first"
                )
            if t.shape != p.shape:
                raise ValueError(
                    f"{self.owner}: `{name}` leaf {i} has shape {tuple(t.shape)}, expected "
                    f"{tuple(p.shape)} like `params`"
                )
            out.append(t.detach().to_local())
        return out

    def globalize(self, local_leaves: list[Tensor]) -> list[Tensor]:
        """DTensors with the params' mesh, placements and global shapes around local shards.

        A local tensor that is the very view of a param (an in-place update) gives back that
        param itself, so `nn.Parameter` objects survive `inplace=True`.
        """
        out = []
        for t, p, view in zip(local_leaves, self.originals, self.locals):
            if t is view:
                out.append(p)
                continue
            out.append(
                _dtensor_class().from_local(
                    t, self.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            )
        return out

    def local_loss_fn(self, loss_fn: Callable[[Any], Any], spec: Any) -> Callable[[Any], Any]:
        """`loss_fn` seen from local shards: called on DTensors, returning a plain tensor."""

        def local_loss(local_params: Any) -> Any:
            leaves = tree.flatten(local_params, "params")[0]
            loss = loss_fn(tree.unflatten(spec, self.globalize(leaves)))
            if is_dtensor(loss):
                return loss.full_tensor()
            self.losses_are_global = False
            return loss

        return local_loss

    # -- reductions ------------------------------------------------------------------------
    def all_sum(self, values: Tensor) -> Tensor:
        """Sums a float64 vector over the group: one all_reduce, wherever `values` lives."""
        buffer = values.to(device=self.reduce_device, dtype=torch.float64)
        if buffer is values:
            buffer = buffer.clone()
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        return buffer.to(values.device)

    def mean_loss(self, loss: Tensor) -> Tensor:
        """A loss passed to `update` (the deferred safeguard), identical on every rank: a
        DTensor's global value, else this rank's loss averaged over the group (one
        all_reduce of one float64 value)."""
        if is_dtensor(loss):
            return loss.full_tensor()
        return self.all_sum(loss.detach().reshape(1).to(torch.float64))[0] / self.world_size

    def mean_losses(self, loss_x: Tensor, loss_y: Tensor) -> tuple[Tensor, Tensor]:
        """The safeguard's losses, identical on every rank.

        DTensor losses were already global; plain ones are this rank's losses and are averaged
        over the group (one all_reduce of two float64 values).
        """
        if self.losses_are_global:
            return loss_x, loss_y
        pair = torch.stack([loss_x.detach().reshape(()), loss_y.detach().reshape(())])
        mean = self.all_sum(pair.to(torch.float64)) / self.world_size
        return mean[0], mean[1]


def sharded_call(
    params: Any, grads: Any, loss_fn: Any, *, inplace: bool, average: bool, owner: str
) -> tuple[ShardedCall | None, Any, Any, Any]:
    """Detects DTensor params and swaps every input for its local counterpart.

    Returns `(call, params, grads, loss_fn)`: `call` is None (inputs unchanged) unless some
    params leaf is a DTensor; then params and grads are pytrees of local shards and
    `loss_fn` takes local shards.
    """
    if _dtensor_class() is None:
        return None, params, grads, loss_fn
    leaves, spec = tree.flatten(params, "params", owner=owner)
    if not any(is_dtensor(p) for p in leaves):
        return None, params, grads, loss_fn
    call = ShardedCall(leaves, owner, average=average)
    if inplace and torch.is_grad_enabled():
        for i, p in enumerate(leaves):
            # The local views are detached; refuse like the plain path would for leaves that
            # require grad rather than write behind autograd's back.
            if p.requires_grad and p.is_leaf:
                raise ValueError(
                    f"{owner}: `inplace=True` cannot write into `params` leaf {i}, a leaf that "
                    "requires grad; call update under torch.no_grad() or pass detached params"
                )
    local_params = tree.unflatten(spec, call.locals)
    local_grads = grads
    if grads is not None:
        g_leaves, g_spec = tree.flatten(grads, "grads", owner=owner)
        if g_spec == spec:
            local_grads = tree.unflatten(g_spec, call.localize(g_leaves, "grads"))
    local_loss = None if loss_fn is None or not callable(loss_fn) else loss_fn
    if local_loss is not None:
        local_loss = call.local_loss_fn(loss_fn, spec)
    elif loss_fn is not None:
        local_loss = loss_fn  # not callable: the usual validation reports it
    return call, local_params, local_grads, local_loss


def local_params(params: Any, owner: str, *, average: bool = False) -> Any:
    """`params` with DTensor leaves replaced by their local shards (for `init`)."""
    if _dtensor_class() is None:
        return params
    leaves, spec = tree.flatten(params, "params", owner=owner)
    if not any(is_dtensor(p) for p in leaves):
        return params
    return tree.unflatten(spec, ShardedCall(leaves, owner, average=average).locals)

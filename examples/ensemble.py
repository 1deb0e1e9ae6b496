r"""An ensemble of small networks trained at once: ``torch.func.vmap`` over the whole optimizer.

Every member is an MLP (64 -> 32 -> 10, tanh) on the 8x8 digits with its own initial weights.
The members' parameters are stacked along a leading dimension with
:func:`torch.func.stack_module_state`, and one call does the step for all of them::

    opt = aa.anderson(aa.sgd(lr), history_depth=5, mode="classic")
    state = torch.func.vmap(opt.init)(params)                 # one window per member
    grads = torch.func.vmap(torch.func.grad(train_loss))(params)
    params, state = torch.func.vmap(
        lambda s, p, g: opt.update(s, p, g, loss_fn=train_loss)
    )(state, params, grads)

Nothing in ``update`` branches on tensor values, so the decisions (mix or not, the safeguard)
are taken per member: ``state.num_mixed`` has one count per member. Under ``vmap`` the update
is pure (``inplace=False``) and both sides of every decision are computed and blended, so a
vmapped step costs more than a single member's; the point is one program for all members.

The same members are also trained with plain gradient descent (vmapped ``aa.sgd``) from the
same weights, and the ensemble's prediction (mean of the members' probabilities) is scored.

Usage::

    python examples/ensemble.py                   # 5 members, 150 full-batch steps (seconds)
    python examples/ensemble.py --members 3 --steps 20 --out-dir /tmp/runs
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

import aadl_func as aa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finite_or_none, format_table, load_digits, make_mlp, write_json  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--history-depth", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="member i uses seed + i")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--run", default="ensemble")
    args = parser.parse_args(argv)
    if args.members < 1 or args.steps < 1:
        parser.error("--members and --steps must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_digits(seed=args.seed)
    models = [make_mlp(seed=args.seed + i) for i in range(args.members)]
    stacked, _ = stack_module_state(models)  # {name: (members, *shape)}
    initial = {k: v.detach().clone() for k, v in stacked.items()}
    # functional_call needs one module of the right structure; its own weights are unused.
    skeleton = copy.deepcopy(models[0]).to("meta")

    def train_loss(params: dict[str, Tensor]) -> Tensor:
        logits = functional_call(skeleton, params, (data.x_train,))
        return F.cross_entropy(logits, data.y_train)

    batched_loss_and_grad = vmap(grad_and_value(train_loss))

    def test_probabilities(params: dict[str, Tensor]) -> Tensor:
        with torch.no_grad():
            logits = vmap(lambda p: functional_call(skeleton, p, (data.x_test,)))(params)
        return logits.softmax(dim=-1)  # (members, test images, classes)

    inner = aa.sgd(args.lr)
    accelerated = aa.anderson(inner, history_depth=args.history_depth, mode="classic")

    def plain_step(state: Any, params: Any, grads: Any) -> tuple[Any, Any]:
        updates, state = inner.update(grads, state, params=params, inplace=False)
        return optree.tree_map(torch.add, params, updates), state

    def accelerated_step(state: Any, params: Any, grads: Any) -> tuple[Any, Any]:
        return accelerated.update(state, params, grads, loss_fn=train_loss)

    results = {}
    for key, init, step in (
        ("baseline", inner.init, plain_step),
        ("anderson", accelerated.init, accelerated_step),
    ):
        params = {k: v.clone() for k, v in initial.items()}
        state = vmap(init)(params)
        batched_step = vmap(step)
        start = time.perf_counter()
        for _ in range(args.steps):
            grads, _losses = batched_loss_and_grad(params)
            params, state = batched_step(state, params, grads)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            final_losses = vmap(train_loss)(params)
        probabilities = test_probabilities(params)
        member_accuracy = (probabilities.argmax(-1) == data.y_test).double().mean(-1)
        ensemble_accuracy = (probabilities.mean(0).argmax(-1) == data.y_test).double().mean()
        result: dict[str, Any] = {
            "final_loss": [finite_or_none(v) for v in final_losses.tolist()],
            "test_accuracy": member_accuracy.tolist(),
            "ensemble_test_accuracy": ensemble_accuracy.item(),
            "wall_seconds": seconds,
        }
        if isinstance(state, aa.AndersonState):
            result["num_mixed"] = state.num_mixed.tolist()
            result["num_rejected"] = state.num_rejected.tolist()
        results[key] = result

    base, acc = results["baseline"], results["anderson"]
    rows = [
        [i, args.seed + i, base["final_loss"][i], 100 * base["test_accuracy"][i],
         acc["final_loss"][i], 100 * acc["test_accuracy"][i], acc["num_mixed"][i],
         acc["num_rejected"][i]]
        for i in range(args.members)
    ]  # fmt: skip
    header = ["member", "seed", "GD loss", "GD test %", "AA loss", "AA test %", "mixed", "rejected"]
    print(f"{args.members} members x {args.steps} full-batch steps, lr {args.lr:g}, AA classic "
          f"depth {args.history_depth} with the loss safeguard, all under one vmap")  # fmt: skip
    print(format_table(header, rows))
    print(
        f"ensemble test accuracy: GD {100 * base['ensemble_test_accuracy']:.2f}%, "
        f"AA {100 * acc['ensemble_test_accuracy']:.2f}%; wall time GD "
        f"{base['wall_seconds']:.1f} s, AA {acc['wall_seconds']:.1f} s"
    )
    summary = {"config": vars(args), **results}
    write_json(os.path.join(args.out_dir, args.run, "summary.json"), summary)
    return summary


if __name__ == "__main__":
    main()

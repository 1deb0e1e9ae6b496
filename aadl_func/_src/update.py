r"""One `update` call on the general path, in every mode: the numbered steps of
[`aadl_func.anderson()`][aadl_func.anderson]'s docstring.

$$
y = g(x) \;(1), \qquad \text{the window takes its entry} \;(2), \qquad
x^+ = \text{mix}(\text{window}) \;(3), \qquad
\text{returned: } x^+ \text{ if the acceptance rule keeps it, else } y \;(4),
$$

and (5) AADL's moving average where it applies. What differs between the modes (the order
of the plain step and the store, the mix, what a kept mix changes in the window, the mode's
own state fields) is the mode's record (`aadl_func._src.modes.Mode`); which point is
returned is the acceptance rule's (`aadl_func._src.acceptance`). The stages are
`aadl_func._src.stages`'; how each runs (in place, blended under vmap and compile, sharded)
is the `Call`'s business, not this sequence's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aadl_func._src import flags, tree
from aadl_func._src.average import window_average
from aadl_func._src.core.grams import Grams
from aadl_func._src.exec.inplace import begin_writes, commit
from aadl_func._src.stages import commit_plain, count_outcome, gate, output, to_params
from aadl_func._src.state import AndersonState
from aadl_func._src.update_call import Call

__all__ = ["moving_average", "update"]


def update(call: Call) -> tuple[Any, AndersonState]:
    """One call: the params it returns and the new state."""
    options, mode = call.options, call.options.rules
    begin_writes(call)
    window, y = mode.store_and_step(call)  # steps 1 and 2, in the mode's order
    # Commit point (atomic.py): from here on the caller holds a finished plain step.
    plain = commit_plain(
        call,
        window.ring,
        window.grams,
        window.head,
        window.window_size,
        window.poisoned,
        **mode.state_fields(call, window, final=False),
    )
    # The committed Grams (the caller's, in place), so that the final state shares them
    # unless a kept mix moves the newest entry.
    window = window._replace(grams=Grams.of(plain))
    mean, averaged = moving_average(call, window)  # step 5, decided before any mix
    mixes = flags.both(gate(call, window.window_size), flags.negate(averaged))
    # x is only used where mixable = mixes & ok holds (the acceptance rule, the output): a
    # gate without a value (vmap, compile) computes it unblended.
    x_hist, ok = call.blend.select(  # step 3
        mixes, lambda: mode.extrapolate(call, window), lambda: mode.no_mix(call), blend=False
    )
    mixable = flags.both(mixes, ok)
    x = call.blend.select(mixable, lambda: to_params(call, x_hist), y, blend=False)
    use_mix, x, x_hist = options.acceptance.choose(call, mixable, x, x_hist, y)  # step 4
    if call.loss_fn is not None and mode.keep_mix is not None:
        window = call.blend.select(use_mix, lambda: mode.keep_mix(call, window, x_hist, x), window)
    if options.average:
        x = call.blend.select(averaged, lambda: to_params(call, mean), x)
    final = count_outcome(
        call,
        plain,
        gate=mixes,
        ok=ok,
        use_mix=use_mix,
        poisoned=window.poisoned,
        num_averaged=flags.add_if(plain.num_averaged, averaged),
        **mode.state_fields(call, window, final=True),
    )
    out = output(call, flags.either(use_mix, averaged), x, y, final)
    return tree.unflatten(call.spec, out), commit(call, final)


def moving_average(call: Call, window: Any) -> tuple[list[Tensor] | None, Tensor]:
    """Step 5, AADL's moving average (`aadl_func._src.average`, modes whose window holds
    plain iterates), decided on the window before any mix: `(the window mean, whether it
    replaces the params)`. When it applies, the window is too noisy to extrapolate from, so
    the call does not mix (nor evaluate the safeguard's losses)."""
    if not call.options.average or call.plain:
        return None, flags.FALSE

    def average() -> tuple[list[Tensor], Tensor]:
        return window_average(
            window.anchor,
            window.ring,
            window.grams.gram,
            window.head,
            window.window_size,
            tol=call.options.average_tol,
            compute_dtypes=call.compute_dtypes,
        )

    no_mean = [torch.zeros_like(a, dtype=c) for a, c in zip(window.anchor, call.compute_dtypes)]
    return call.blend.select(window.window_size >= 2, average, (no_mean, flags.FALSE))

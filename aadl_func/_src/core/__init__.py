"""The mathematics of Anderson acceleration, apart from how it runs.

What lives here is written over explicit tensors and numbers, so that it can be read, tested
and changed alone:

* `ops`: the small interface through which the math asks its data-dependent questions
  (is this known, is this finite, which of two results), which the execution layer answers;
* `grams`: the window's inner products as a named record;
* `ring`: which ring slot holds which window entry (chronological orders, validity masks);
* `weights`: a window's small problem gathered oldest first, its ridge, and its weights;
* `lstsq`: the small least-squares problem, solved once, in float64;
* `variants`: each mode's coefficient map and the bound of its mix;
* `accept`: the rules that keep or drop a mix (the `loss_fn` and deferred safeguards, the
  range of the params' dtype, finiteness);
* `linesearch`: the backtracking (Armijo) search along a direction.

The rule, held by `tests/test_core_rules.py` (which lists the names it refuses): no module
here imports a package module outside `core/`, and none asks how it is being run. What the
answer to a data-dependent question depends on is the execution layer's business
(`aadl_func._src.exec` and the stages that use it); the math reaches it through `ops`.
"""

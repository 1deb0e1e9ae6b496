"""How a step runs: executors that carry the math of `aadl_func._src` out in one setting.

`eager` runs an eager in-place call whose decisions are Python values; the general path
(`aadl_func._src.update.update()`, with the stages) serves every other call. Both write
in place by `inplace`'s protocol (commits and recovery) and ask `ops` their questions;
`sharded` is the general path's one reduction a step over sharded params.
"""

"""Each mode's math over explicit tensors: the map from the affine weights to the
coefficients of the combination, the bounds of the combination's base and of every entry of
the mix (the sharded step's finiteness certificate), and the previous call's plain step read
from the window (where a rejected mix goes back to). The execution of a mode
(`aadl_func._src.update`, with `aadl_func._src.aadl_step` or `aadl_func._src.classic_step`,
and `aadl_func._src.exec.eager`) calls these."""

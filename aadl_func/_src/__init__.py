"""Private implementation modules of aadl_func; import from `aadl_func` instead."""

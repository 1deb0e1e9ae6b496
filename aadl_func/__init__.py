"""aadl_func: functional Anderson acceleration for deep learning on torch.func."""

from aadl_func._src.adasam import AdaSAM, AdaSAMState, adasam
from aadl_func._src.anderson import Anderson, anderson
from aadl_func._src.compose import ChainState, add_decayed_weights, chain, clip_by_global_norm
from aadl_func._src.core.lstsq import MixingWeights, solve_weights
from aadl_func._src.inner import AdamState, InnerOptimizer, SgdState, adam, adamw, sgd
from aadl_func._src.lbfgs import LbfgsState, lbfgs
from aadl_func._src.mix import mix, mixing_weights
from aadl_func._src.native import kernel_info
from aadl_func._src.protocols import AndersonInit, AndersonUpdate
from aadl_func._src.rna import RNA, RNAAverager, RNAChoice, RNAState, recompute_bn, rna
from aadl_func._src.short_recurrence import ShortRecurrence, ShortRecurrenceState, short_recurrence
from aadl_func._src.solver import SolverInfo, fixed_point, root
from aadl_func._src.solver_implicit import implicit_fixed_point
from aadl_func._src.state import AndersonState
from aadl_func._src.wrapper import AcceleratedOptimizer, accelerate

__version__ = "0.1.0"

__all__ = [
    "AcceleratedOptimizer",
    "AdaSAM",
    "AdaSAMState",
    "AdamState",
    "Anderson",
    "AndersonInit",
    "AndersonState",
    "AndersonUpdate",
    "ChainState",
    "InnerOptimizer",
    "LbfgsState",
    "MixingWeights",
    "RNA",
    "RNAAverager",
    "RNAChoice",
    "RNAState",
    "SgdState",
    "ShortRecurrence",
    "ShortRecurrenceState",
    "SolverInfo",
    "accelerate",
    "add_decayed_weights",
    "adasam",
    "adam",
    "adamw",
    "anderson",
    "chain",
    "clip_by_global_norm",
    "fixed_point",
    "implicit_fixed_point",
    "kernel_info",
    "lbfgs",
    "mix",
    "mixing_weights",
    "recompute_bn",
    "rna",
    "root",
    "sgd",
    "short_recurrence",
    "solve_weights",
]

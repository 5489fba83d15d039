"""Distributed training: the data-parallel world and DDP communication hooks.

Statistics under DDP need no hook (they are taken from autograd gradient
hooks before DDP reduces, and shared in one scalar all-reduce per step).
The hooks are in torch's ``(state, hook)`` form:
:func:`two_group_cosine_hook` with a :class:`TwoGroupCosine` state measures
SimiGrad's exact two-group cosine for comparison; :func:`compression_hook`
with a :class:`CompressionState` compresses gradient traffic with error
control (EF, EF21, EControl).
"""

from .compression import COMPRESSORS, METHODS, CompressionState, compression_hook
from .ddp import accumulating, register, unwrap
from .hooks import CommHook, TwoGroupCosine, is_lossless, two_group_cosine_hook
from .world import World, init_from_env

__all__ = [
    "COMPRESSORS",
    "METHODS",
    "CommHook",
    "CompressionState",
    "TwoGroupCosine",
    "World",
    "accumulating",
    "compression_hook",
    "init_from_env",
    "is_lossless",
    "register",
    "two_group_cosine_hook",
    "unwrap",
]

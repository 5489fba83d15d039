"""Distributed training: the data-parallel world and DDP communication hooks.

Statistics under DDP need no hook (they are taken from autograd gradient
hooks before DDP reduces, and shared in one scalar all-reduce per step);
:class:`TwoGroupCosine` measures SimiGrad's exact two-group cosine for
comparison; :class:`CompressionHook` compresses gradient traffic with error
feedback (EF, EF21, EControl).
"""

from .compression import COMPRESSORS, METHODS, CompressionHook
from .hooks import TwoGroupCosine
from .world import World, init_from_env

__all__ = ["COMPRESSORS", "METHODS", "CompressionHook", "TwoGroupCosine", "World", "init_from_env"]

"""Distributed training: the data-parallel world and DDP communication hooks
(:func:`two_group_cosine_hook`, :func:`compression_hook`)."""

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

"""Learning-rate schedules as functions of samples seen, ``f(samples) -> multiplier``."""

from .batch.lr import constant, warmup_cosine, warmup_linear, warmup_poly, warmup_stable_decay

__all__ = [
    "constant",
    "warmup_cosine",
    "warmup_linear",
    "warmup_poly",
    "warmup_stable_decay",
]

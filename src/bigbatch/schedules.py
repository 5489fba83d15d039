"""Learning-rate schedules as functions of samples seen (the batch size varies).

Each returns ``f(samples) -> multiplier`` for ``AdaptiveBatch(schedule=...)``;
any callable of that shape is a schedule too.
"""

from .batch.lr import constant, warmup_cosine, warmup_linear, warmup_poly, warmup_stable_decay

__all__ = [
    "constant",
    "warmup_cosine",
    "warmup_linear",
    "warmup_poly",
    "warmup_stable_decay",
]

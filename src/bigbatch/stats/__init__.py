"""Sub-batch gradient statistics: similarity, noise scale, GSNR (REFERENCE.md §1)."""

from .collector import GradientStats, MicroBatchStatistics
from .estimators import (
    equilibrium_batch,
    expected_similarity,
    half_split_cosine,
    inverse_size,
    noise_components,
    noise_from_mean,
    scalar_similarity,
)

__all__ = [
    "GradientStats",
    "MicroBatchStatistics",
    "equilibrium_batch",
    "expected_similarity",
    "half_split_cosine",
    "inverse_size",
    "noise_components",
    "noise_from_mean",
    "scalar_similarity",
]

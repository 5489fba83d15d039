"""Sub-batch gradient statistics: similarity, noise scale, GSNR (docs/algorithms.md)."""

from .collector import SIMILARITY_MODES, MicroBatchStatistics
from .estimators import (
    equilibrium_batch,
    expected_similarity,
    half_split_cosine,
    inverse_size,
    noise_components,
    noise_from_mean,
    scalar_similarity,
)
from .result import GradientStats

__all__ = [
    "SIMILARITY_MODES",
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

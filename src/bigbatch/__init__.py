"""bigbatch: make very large batches train as well as small ones in PyTorch."""

from . import batch, dist, optim, schedules, stats
from .engine import StepEngine, StepResult
from .loop import AdaptiveBatch, NonFiniteError, Step

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBatch",
    "NonFiniteError",
    "Step",
    "StepEngine",
    "StepResult",
    "__version__",
    "batch",
    "dist",
    "optim",
    "schedules",
    "stats",
]

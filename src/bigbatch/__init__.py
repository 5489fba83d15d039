"""bigbatch: make very large batches train as well as small ones in PyTorch."""

from . import batch, optim, parallel, schedules, stats
from .engine import StepEngine, StepResult
from .loop import AdaptiveBatch, NonFiniteError, Step
from .options import StepOptions

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBatch",
    "NonFiniteError",
    "Step",
    "StepEngine",
    "StepOptions",
    "StepResult",
    "__version__",
    "batch",
    "optim",
    "parallel",
    "schedules",
    "stats",
]

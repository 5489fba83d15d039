"""A run's summary: the numbers ``summary.json`` holds, from the metrics on disk, and how
the run ended.

Every way a run ends writes one (:data:`ENDS`); only a run whose end is a result
(:data:`FINISHED`) is reused by ``compare`` and ``tune`` or read into a report.
A run stopped by a signal or an error is not: ``--resume`` continues it and its
summary is written again at the end.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from ..loop import AdaptiveBatch
from ..parallel.compression import CompressionState
from .rundir import read_json
from .tasks import Task

#: ``summary.json``'s ``ended``: how a run ended
ENDS = {
    "budget": "the sample budget is spent",
    "target": "the task's target was reached (stop_at_target)",
    "skip_limit": "too many optimizer steps were skipped as non-finite (skip_limit)",
    "signal": "a signal stopped it after a checkpoint; --resume continues it",
    "error": "an error stopped it; --resume continues it from its last checkpoint",
}
#: the ends that are a result of the config (a diverged rate is one: it ranks last)
FINISHED = frozenset({"budget", "target", "skip_limit"})


def finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` if it ended with a result, else None."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    summary = read_json(path)
    return summary if summary.get("ended") in FINISHED else None


def batch_path_ratio(batches: list[int]) -> float | None:
    """``Σ |Δ log B| / |log(B_last / B_first)|``: 1.0 for a monotone path (or a constant
    batch), large for a sawtooth; None when the batch moved but ended where it began."""
    travelled = sum(abs(math.log(b / a)) for a, b in itertools.pairwise(batches))
    if travelled == 0:
        return 1.0
    net = abs(math.log(batches[-1] / batches[0]))
    return travelled / net if net > 0 else None


def target_summary(task: Task, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """When the task's target was first reached, and the same in words either way."""
    reached = next((r for r in evals if task.reached(r)), None)
    values = [r[task.target_metric] for r in evals if task.target_metric in r]
    best = (min if task.lower_is_better else max)(values, default=math.nan)
    name = task.target_metric.removeprefix("eval_")
    if reached is not None:
        note = (
            f"target {name} {task.target:g} reached at step {reached['step']} "
            f"({reached['samples']:,} samples)"
        )
    else:
        note = f"target {name} {task.target:g} not reached; best {best:.4g}"
    return {
        "target_metric": task.target_metric,
        "target": task.target,
        "target_reached": reached is not None,
        "steps_to_target": reached["step"] if reached else None,
        "samples_to_target": reached["samples"] if reached else None,
        "target_note": note,
    }


def traffic_per_step(loop: AdaptiveBatch) -> dict[str, float]:
    """Bytes each rank put into all-reduces per step: gradients, and what statistics added."""
    if not loop.world.distributed:
        return {}
    params = [p for p in loop.model.parameters() if p.requires_grad]
    out = {"gradient_bytes_per_step": float(sum(p.numel() * p.element_size() for p in params))}
    hook_state = loop.comm_hook[0] if loop.comm_hook is not None else None
    if isinstance(hook_state, CompressionState):
        out.update(hook_state.traffic())
    if loop.collector is not None:
        out["statistics_bytes_per_step"] = loop.collector.traffic() / max(1, loop.steps_taken)
    return out

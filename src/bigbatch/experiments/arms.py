"""The arms of a comparison and how their runs rank: plain data, shared by the sweep that
trains them and the report that draws them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["RANKS", "Arm", "ArmResult", "metric"]


@dataclass(frozen=True)
class Arm:
    """One cell of a comparison: its label, config overrides and run-directory stem."""

    name: str
    overrides: dict[str, Any]
    stem: str


@dataclass
class ArmResult:
    """What an arm's sweep found: its rate grid, the chosen rate and the seeds' summaries."""

    name: str
    overrides: dict[str, Any]
    lrs: list[float]
    chosen: int
    #: the summaries at the chosen rate, one per seed (the first is the grid's run)
    runs: list[dict[str, Any]]
    #: the run directories of ``runs``, relative to the sweep's root
    dirs: list[str] = field(default_factory=list)
    #: for a rate chosen by a study instead of the grid: its trials and cost (a fraction
    #: of the grid's samples)
    tuned: dict[str, Any] | None = None
    #: the rate ceiling the chosen point trained under (``lr_max``; 0: none), which a run
    #: at the chosen rate needs as well (a task's ceiling scales with the grid's rate)
    lr_max: float = 0.0
    #: the run directory of each rate of ``lrs`` (first seed), relative to the sweep's root
    grid_dirs: list[str] = field(default_factory=list)
    #: the index in ``lrs`` of the arm's own rate (x1 of the grid: the rate a user gets
    #: with these settings); None where the grid has no x1 point
    own: int | None = None

    @property
    def lr(self) -> float:
        return self.lrs[self.chosen]

    @property
    def at_edge(self) -> bool:
        """Whether the chosen rate is an end of the grid (its optimum may lie beyond; a
        study's rate is never reported so)."""
        return self.chosen in (0, len(self.lrs) - 1) and len(self.lrs) > 1

    def values(self, key: str) -> list[Any]:
        """``key`` of each seed's summary (None where a summary lacks it)."""
        return [s.get(key) for s in self.runs]

    def to_dict(self) -> dict[str, Any]:
        """Every field but the summaries, which the run directories hold (``compare.json``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "runs"}


def metric(summary: dict[str, Any], which: str = "best") -> float:
    """A run's ``best`` or ``final`` score on its task's target metric (accuracy or eval loss)."""
    loss = summary.get("target_metric", "eval_accuracy").endswith("loss")
    value = summary[f"{which}_eval_loss" if loss else f"{which}_accuracy"]
    return value if value is not None else math.nan


def _score(summary: dict[str, Any], which: str) -> float:
    """Lower is better; a non-finite score ranks last."""
    value = metric(summary, which)
    if not math.isfinite(value):
        return math.inf
    return value if summary.get("target_metric", "").endswith("loss") else -value


def _by_steps(summary: dict[str, Any]) -> tuple:
    steps = summary.get("steps_to_target")
    return (steps is None, steps or 0, _score(summary, "best"))


#: how a grid's runs are ranked: ``steps`` (fewest optimizer steps to the task's target,
#: then the best score), ``best`` (best score over the run), ``final`` (score at the end)
RANKS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "steps": _by_steps,
    "best": lambda s: _score(s, "best"),
    "final": lambda s: _score(s, "final"),
}

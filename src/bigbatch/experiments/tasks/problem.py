"""What a task is: a built :class:`Problem` (data, model, scores) and its :class:`Task` record."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.data import Dataset


@dataclass
class Problem:
    """What a run trains: data, model, and how to score it."""

    train: Dataset
    test: tuple[Tensor, Tensor]
    model: nn.Module
    loss: Callable[[nn.Module, Any], Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    #: facts about the data a run's summary records (numbers, or a corpus hash)
    info: dict[str, Any] = field(default_factory=dict)
    #: the same scores on the training set (for the generalization gap), if meaningful
    evaluate_train: Callable[[nn.Module], dict[str, float]] | None = None


@dataclass(frozen=True)
class Task:
    """A built-in task: how to build it, its defaults, and the target runs are timed to.

    ``target`` is a value of ``target_metric`` (an evaluation key: higher is
    better for an accuracy, lower for a loss) that the task's default run and
    its static batches at the default rate reach within the default budget;
    ``steps_to_target`` in a summary is the first evaluation that reaches it.
    """

    name: str
    summary: str
    size: str
    expected: str
    target: float
    #: measured learning rates: ``lrs[family]`` at ``base_batch`` under the family's
    #: batch rule (``bigbatch.batch.lr.FAMILY_RULES``), ``lrs[family + "/held"]`` for
    #: controllers that hold the rate while the batch follows the noise. The adam rates
    #: come from the evidence grids, the sgd and lars ones from benchmarks/family_lrs.py
    #: (docs/results.md, "Learning rate per optimizer family")
    lrs: Mapping[str, float]
    max_samples: int
    width: int
    depth: int
    build: Callable[[dict[str, Any]], Problem]
    target_metric: str = "eval_accuracy"

    #: the small batch the scaled rates are tuned at (``batch.base``)
    base_batch: int = 64
    #: the sequence length of a sequence task (``model.context``); 0: the task has none
    context: int = 0

    def lr(self, family: str, held: bool) -> float:
        """The task's rate for an optimizer family, under a held or a scaled LR rule."""
        key = f"{family}/held" if held else family
        if key not in self.lrs:  # not measured for this family: the Adam-type rate
            key = "adam/held" if held else "adam"
        return self.lrs[key]

    def reached(self, evaluation: dict[str, float]) -> bool:
        """Whether an evaluation row meets the target."""
        value = evaluation.get(self.target_metric)
        if value is None:
            return False
        return value <= self.target if self.lower_is_better else value >= self.target

    @property
    def lower_is_better(self) -> bool:
        return self.target_metric.endswith("loss")

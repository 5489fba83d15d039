"""What a task is: a built :class:`Problem` (data, model, scores) and its :class:`Task` record."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.data import Dataset

from ...optim import get_optimizer_info

#: the rules a task may record as measured: fixed powers of the batch (the AdaScale rules
#: follow the run's own statistics, so there is nothing about them to measure per task)
MEASURABLE_RULES = ("none", "sqrt", "linear")


def _own_then_family(optimizer: str, suffix: str = "") -> list[str]:
    """The keys a task's tables are searched by: the optimizer's name, then its family's."""
    return [name + suffix for name in (optimizer, get_optimizer_info(optimizer).family)]


def _measured(table: Mapping[str, Any], optimizer: str) -> Any:
    """``table``'s entry for ``optimizer`` (its own, else its family's), None if neither."""
    return next((table[k] for k in _own_then_family(optimizer) if k in table), None)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TaskArgs:
    """What a task's build reads of a planned run (``RunPlan.task_args``): the model's
    size, the seed of its initialisation, how many training samples to keep (0: all) and
    the task's own keys (an instance of :attr:`Task.options`, else None)."""

    width: int
    depth: int
    context: int = 0
    seed: int = 0
    train_samples: int = 0
    options: Any = None


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
    #: measured learning rates at ``base_batch``, keyed by optimizer name (``"lars"``,
    #: ``"vr-sgd"``) or, for the optimizers not measured by name, by family (``"adam"``,
    #: ``"sgd"``, ``"lars"``): the scaled rate (``key``) is carried to other batches by the
    #: task's rule for the optimizer where that rule scales (``lr_rules``), else by the
    #: family's (``bigbatch.batch.lr.FAMILY_RULES``); the held rate (``key + "/held"``) is
    #: the one at every batch, for controllers that hold the rate while the batch follows
    #: the noise and wherever the task's rule is ``none``. Measured by the evidence grids and
    #: benchmarks/studies/recipes.toml (docs/results.md, "Recipes")
    lrs: Mapping[str, float]
    max_samples: int
    width: int
    depth: int
    build: Callable[[TaskArgs], Problem]
    target_metric: str = "eval_accuracy"

    #: the small batch the scaled rates are tuned at (``batch.base``)
    base_batch: int = 64
    #: the sequence length of a sequence task (``model.context``); 0: the task has none
    context: int = 0
    #: batch rules measured on this task where they differ from the family's
    #: (``FAMILY_RULES``), keyed like ``lrs`` (optimizer name, else family): the rule
    #: that joins an optimizer's best rate at a small and at a large batch. On ``text``
    #: momentum SGD's best rate rises 4x from batch 16 to 256 (sqrt), LARS's not at all
    lr_rules: Mapping[str, str] = field(default_factory=dict)
    #: scaled rates measured at other batches than ``base_batch``: ``{batch: {key: rate}}``,
    #: keyed like ``lrs`` (an entry counts for an optimizer by its own name, or by the key
    #: its ``base_batch`` rate was found under). Between two measured batches a run starts
    #: at the rate interpolated as a power of the batch; beyond them the rule carries the
    #: nearest (:meth:`measured_rates`)
    lrs_at: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    #: the task's own config keys: a frozen class whose fields are
    #: :func:`~bigbatch.knobs.setting` s naming keys ``<task>.<name>`` (``text.corpus``);
    #: its build reads them, a run of another task refuses them set
    options: type | None = None
    #: the largest rate a step may take, measured where an optimizer's best rate stops
    #: rising with the batch (its rule would carry it past the largest stable rate),
    #: keyed like ``lrs``; it applies to the task's own rates (``lr = 0``)
    lr_max: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for batch, table in self.lrs_at.items():
            bad = [r for r in table.values() if not (_is_number(r) and 0 < r < math.inf)]
            if type(batch) is not int or batch < 1 or batch == self.base_batch or bad:
                raise ValueError(
                    f"task {self.name!r}: lrs_at[{batch!r}] = {dict(table)!r}; a measured "
                    f"rate is a positive number at a batch other than base_batch"
                )
        for key, ceiling in self.lr_max.items():
            if not (_is_number(ceiling) and 0 < ceiling < math.inf):
                raise ValueError(
                    f"task {self.name!r}: lr_max[{key!r}] = {ceiling!r}; a ceiling is a "
                    "positive rate"
                )
        for key, rule in self.lr_rules.items():
            if rule not in MEASURABLE_RULES:
                raise ValueError(
                    f"task {self.name!r}: lr_rules[{key!r}] = {rule!r}; a measured rule is "
                    f"one of {', '.join(MEASURABLE_RULES)}"
                )

    def lr(self, optimizer: str, held: bool) -> float:
        """The task's rate for ``optimizer`` under a held or a scaled LR rule: its own
        measured rate, else its family's (``bigbatch.optim.FAMILIES``). Never another family's:
        on ``text`` the Adam-type rate is 60 times below LARS's best (issue 40)."""
        keys = _own_then_family(optimizer, "/held" if held else "")
        for key in keys:
            if key in self.lrs:
                return self.lrs[key]
        wanted = " or ".join(map(repr, keys))
        raise KeyError(
            f"the {self.name} task has no measured rate for optimizer {optimizer!r} "
            f"(no {wanted} in its rates); give one with --set lr=..."
        )

    def measured_rates(self, optimizer: str) -> dict[int, float]:
        """The scaled rates measured for ``optimizer``, by batch: ``base_batch``'s (its own,
        else its family's) and those of :attr:`lrs_at` under its name or that key."""
        keys = [k for k in _own_then_family(optimizer) if k in self.lrs]
        if not keys:
            self.lr(optimizer, held=False)  # the KeyError that names what is missing
        rates = {self.base_batch: self.lrs[keys[0]]}
        for batch, table in self.lrs_at.items():
            key = next((k for k in (optimizer, keys[0]) if k in table), None)
            if key is not None:
                rates[batch] = table[key]
        return dict(sorted(rates.items()))

    def lr_rule(self, optimizer: str) -> str | None:
        """The batch rule measured for ``optimizer`` on this task (its own, else its
        family's), or None where the family's general rule holds here."""
        return _measured(self.lr_rules, optimizer)

    def lr_ceiling(self, optimizer: str) -> float | None:
        """The rate ceiling measured for ``optimizer`` on this task (its own, else its
        family's), or None where none was measured."""
        return _measured(self.lr_max, optimizer)

    def reached(self, evaluation: dict[str, float]) -> bool:
        """Whether an evaluation row meets the target."""
        value = evaluation.get(self.target_metric)
        if value is None:
            return False
        return value <= self.target if self.lower_is_better else value >= self.target

    @property
    def lower_is_better(self) -> bool:
        return self.target_metric.endswith("loss")

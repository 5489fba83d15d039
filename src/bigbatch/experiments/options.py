"""The commands' options beyond a run's config keys, one settings class per command.

``bigbatch compare``'s :class:`Protocol`, ``bigbatch tune``'s :class:`TuneSettings`,
``bigbatch critical-batch``'s :class:`CriticalSettings` and ``bigbatch federated``'s
:class:`FederatedSettings`. Each option is one :func:`~bigbatch.knobs.setting` (its
default, bounds and help); the flags, the ``--config`` file's tables (``[compare]``,
``[tune]``, ``[critical]``, ``[federated]``) and docs/cli.md's options tables are made
from these fields (:mod:`bigbatch.experiments.flags`). This module imports nothing
heavy, so the command line is built without the extras the commands need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..batch.sampler import MAX_SEED
from ..knobs import setting
from .config import ConfigError
from .flags import checked
from .tasks import TASKS

__all__ = ["SECTIONS", "CriticalSettings", "FederatedSettings", "Protocol", "TuneSettings"]

#: how a grid's runs are ranked (``bigbatch.experiments.arms.RANKS`` holds the rules)
RANK_NAMES = ("steps", "best", "final")


@dataclass(frozen=True)
class Protocol:
    """How ``bigbatch compare`` tunes each arm: the rate grid, its widening, the ranking,
    the seeds at the chosen rate, the runs at a time; or a ``bigbatch tune`` study."""

    lr_grid: tuple[float, ...] = setting(
        (1.0,),
        "train each arm at its rate times each multiplier, increasing (first seed), and keep "
        "the best",
        low=0,
        low_open=True,
    )
    widen: int = setting(
        0,
        "grid points to add, one at a time, at an end where an arm's best rate lies, up to "
        "this many on each side",
        low=0,
    )
    rank: str = setting(
        "best",
        "which grid run gives the arm's rate: fewest steps to the task's target (then the "
        "best score), the best score over the run, or the final score",
        choices=RANK_NAMES,
    )
    seeds: int = setting(
        1, "seeds at each arm's chosen rate (the first is the config's seed)", low=1
    )
    jobs: int = setting(1, "runs at a time, each in its own process", low=1)
    tune: bool = setting(
        False,
        "search each arm's rate over the grid's range with a bigbatch tune study instead of "
        "training every point (needs the tune extra)",
    )
    prefixes: tuple[float, ...] = setting(
        (),
        "also judge each arm's rate grid at these fractions of the run (the rate a tuner that "
        "stops runs early would choose) in the report",
        low=0,
        low_open=True,
        high=1,
        high_open=True,
    )

    def __post_init__(self) -> None:
        checked(self)
        if not self.lr_grid:
            raise ConfigError("lr_grid takes one multiplier or more, got none")
        if list(self.lr_grid) != sorted(set(self.lr_grid)):  # its ends are the rates' ends
            raise ConfigError(f"lr_grid needs increasing multipliers, got {list(self.lr_grid)}")
        if self.widen and len(self.lr_grid) < 2:  # it widens by the grid's own step
            raise ConfigError("widen needs an lr_grid of two multipliers or more to step by")
        if self.tune and len(set(self.lr_grid)) < 2:
            raise ConfigError("a tuned sweep searches the grid's range: give two multipliers")
        if self.tune and (self.widen or self.prefixes):  # (they went unused, unsaid)
            flag = "--widen" if self.widen else "--prefixes"
            raise ConfigError(f"{flag} judges a grid of trained rates, which --tune has not")


@dataclass(frozen=True)
class TuneSettings:
    """How a ``bigbatch tune`` study searches: its brackets, fidelities, budget,
    processes and seed (the space is ``--search``)."""

    trials: int = setting(9, "trials each bracket starts at the lowest fidelity", low=1)
    brackets: int = setting(
        1, "brackets, one after the other, the later ones proposed by TPE", low=1
    )
    reduction: int = setting(3, "keep 1 in this many of a bracket's trials at each fidelity", low=2)
    min_fidelity: float = setting(
        1 / 27,
        "the first pause, as a fraction of max_samples",
        low=0,
        low_open=True,
        high=1,
    )
    #: inside the warm-up every rate is still below its peak, and the largest look best
    #: (measured: docs/tuning.md)
    after_warmup: float = setting(
        2.0, "no pause before this many warm-ups: after a 5% warm-up, the first is at 1/9", low=0
    )
    budget: float | None = setting(
        None,
        "run no bracket past this fraction of the samples of a x2 grid over the same range "
        "(none: only brackets limits the study)",
        low=0,
        low_open=True,
    )
    jobs: int = setting(1, "trials at a time, in N processes the study starts once", low=1)
    seed: int = setting(0, "seeds the proposals", low=0, high=MAX_SEED, flag="--search-seed")

    def __post_init__(self) -> None:
        checked(self)

    def rungs(self, warmup: float = 0.0) -> list[float]:
        """The fidelities a bracket pauses at, lowest first: the run's samples divided by
        powers of ``reduction``, none below ``min_fidelity`` nor ``after_warmup`` times the
        ``warmup`` fraction, ending at the whole run."""
        lowest = max(self.min_fidelity, self.after_warmup * warmup)
        rungs = [1.0]
        while rungs[0] / self.reduction >= lowest - 1e-9:
            rungs.insert(0, rungs[0] / self.reduction)
        return rungs

    def survivors(self, warmup: float = 0.0) -> list[int]:
        """How many of a bracket's trials train up to each rung: ``1/reduction`` of the rung
        before, but two (where a bracket has two) up to the last pause, so that the winner
        is chosen between runs judged on the longest prefix, not on an earlier one."""
        paused = len(self.rungs(warmup)) - 1
        if not paused:  # no pause fits after the warm-up: each trains to the end (a grid)
            return [self.trials]
        least = min(2, self.trials)
        return [max(least, self.trials // self.reduction**j) for j in range(paused)] + [1]

    def bracket_runs(self, warmup: float = 0.0) -> float:
        """What one bracket trains, in whole runs (each survivor trains on from its pause)."""
        rungs = self.rungs(warmup)
        return sum(
            keep * (f - before)
            for keep, f, before in zip(self.survivors(warmup), rungs, [0.0, *rungs[:-1]])
        )


@dataclass(frozen=True)
class CriticalSettings:
    """What ``bigbatch critical-batch`` measures: the branches' batches, where they
    start, how long they train, the loss they may lose and how their rate follows."""

    batches: tuple[int, ...] = setting(
        (),
        "branch batch sizes; the smallest is the base run's and the reference (none: "
        "batch.initial and its doublings up to 32 times it)",
        low=1,
    )
    points: tuple[float, ...] = setting(
        (0.1, 0.25, 0.5, 0.75),
        "where branches start, as fractions of max_samples",
        low=0,
        low_open=True,
        high=1,
        high_open=True,
    )
    branch_samples: int = setting(
        0,
        "samples each branch trains (0: 5% of max_samples, in whole steps of every batch)",
        low=0,
    )
    tolerance: float = setting(
        0.01,
        "how much higher than the reference a branch's eval loss may end and still count "
        "(absolute, in the task's eval-loss units, e.g. nats)",
        low=0,
    )
    lr_rule: str = setting(
        "auto",
        "a branch's rate against the base batch's (auto: the rule the task measured for "
        "the optimizer, else the family's: sqrt for Adam-type, linear for SGD- and LARS-type)",
        choices=("auto", "none", "sqrt", "linear"),
    )

    def __post_init__(self) -> None:
        checked(self)
        if self.batches and (len(self.batches) < 2 or len(set(self.batches)) < len(self.batches)):
            raise ConfigError(f"batches needs two or more distinct sizes, got {list(self.batches)}")
        if not self.points:
            raise ConfigError("points takes one fraction of the budget or more, got none")
        if len(set(self.points)) < len(self.points):  # each would train its branches twice
            raise ConfigError(f"points needs distinct fractions, got {list(self.points)}")


@dataclass(frozen=True)
class FederatedSettings:
    """One ``bigbatch federated`` simulation: the federation, its data, its rounds and
    the scheme that picks the local batch. The defaults are the setting measured in
    docs/results.md ("Federated"), where the adaptive arm from local batch 4 at rate
    0.025 was the one to save steps."""

    task: str = setting(
        "mnist1d",
        "the task: one that classifies (its clients' data is split by label)",
        choices=tuple(name for name, task in TASKS.items() if not task.lower_is_better),
    )
    clients: int = setting(4, "clients, all trained each round", low=1)
    split: str = setting("iid", "how the training set is shared", choices=("iid", "dirichlet"))
    alpha: float = setting(0.5, "the Dirichlet split's concentration", low=0, low_open=True)
    rounds: int = setting(20, "rounds", low=1)
    local_samples: int = setting(1024, "samples per client per round", low=1)
    scheme: str = setting(
        "adaptive",
        "fixed (local_batch), switch (large, then local_batch) or adaptive (bigbatch's "
        "controller on the clients' pooled noise statistics, from local_batch)",
        choices=("fixed", "switch", "adaptive"),
    )
    local_batch: int = setting(4, "the base local batch (the statistics need 2)", low=2)
    large: int = setting(128, "switch: the first phase's local batch", low=1)
    switch: float = setting(0.5, "switch: the fraction of the samples at large", low=0, high=1)
    lr: float = setting(
        0.025, "the rate at local_batch (linear in the local batch)", low=0, low_open=True
    )
    warmup: float = setting(0.05, "the warm-up, a fraction of the samples", low=0, high=1)
    min_sub_batches: int = setting(
        2, "micro-batches per local step, across which the statistics are measured", low=2
    )
    seed: int = setting(0, "the seed", low=0, high=MAX_SEED)
    #: the accuracies the report gives each scheme's rounds and samples to
    targets: tuple[float, ...] = field(default=(0.85, 0.9, 0.93, 0.95))

    def __post_init__(self) -> None:
        checked(self)
        if self.scheme == "switch" and not self.local_batch <= self.large <= self.local_samples:
            raise ConfigError(
                f"large ({self.large}) must lie between local_batch ({self.local_batch}) "
                f"and local_samples ({self.local_samples})"
            )
        if self.local_batch > self.local_samples:
            raise ConfigError(
                f"local_batch ({self.local_batch}) exceeds local_samples "
                f"({self.local_samples}): a round would be less than one step"
            )
        if self.min_sub_batches > self.local_batch:  # (it was capped at the batch, unsaid)
            raise ConfigError(
                f"min_sub_batches ({self.min_sub_batches}) exceeds local_batch "
                f"({self.local_batch}): every micro-batch needs a sample"
            )

    @property
    def total_samples(self) -> int:
        return self.rounds * self.clients * self.local_samples


#: each command's settings and its table in a ``--config`` file
SECTIONS = {
    "compare": Protocol,
    "tune": TuneSettings,
    "critical": CriticalSettings,
    "federated": FederatedSettings,
}

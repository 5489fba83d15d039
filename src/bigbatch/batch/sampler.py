"""A resumable sampler that hands out batches of any size, every sample once per epoch."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._checks import check_flag, check_number, positive_int, rank_in_world
from .._warn import warn_at_caller
from .plan import StepPlan, plan_step

#: the largest seed: a permutation's seed is ``seed * 1,000,003 + epoch``, a 64-bit integer
MAX_SEED = 2**32 - 1


class VariableBatchSampler:
    """Draws batches of changing size from a map-style dataset of ``dataset_size`` samples.

    Each epoch is one seeded permutation and batches are consecutive runs of it (crossing
    into the next epoch), so every sample is used once per epoch whatever the sizes. The
    state is (seed, epoch, position): a resumed run draws the same batches; take a batch
    only when it is about to train. With ``weight_fn`` a batch of size ``B`` holds samples
    until their weight reaches ``B``.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        weight_fn: Callable[[int], int] | None = None,
    ) -> None:
        positive_int("dataset_size (samples in the dataset)", dataset_size)
        if weight_fn is not None and not callable(weight_fn):
            raise TypeError(f"weight_fn must be a function of a sample's index, got {weight_fn!r}")
        self.dataset_size = dataset_size
        self.shuffle = check_flag("shuffle", shuffle)
        self.seed = check_number("seed", seed, high=MAX_SEED, whole=True)
        self.weight_fn = weight_fn
        self.epoch = 0
        self.position = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self._warned_repeats = False

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.dataset_size, generator=generator)
            else:
                self._order = torch.arange(self.dataset_size)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def take(self, size: int) -> list[int]:
        """The next batch: ``size`` samples (or ``size`` weight with ``weight_fn``)."""
        positive_int("batch size", size)
        if self.weight_fn is None:
            batch = self._take_count(size)
        else:
            batch, weight = [], 0
            while weight < size:
                index = self._take_count(1)[0]
                batch.append(index)
                weight += _weight(self.weight_fn(index), index)
        if len(batch) > self.dataset_size and not self._warned_repeats:
            self._warned_repeats = True
            warn_repeats(len(batch), self.dataset_size)
        return batch

    def _take_count(self, count: int) -> list[int]:
        batch: list[int] = []
        while count > 0:
            order = self._permutation(self.epoch)
            run = order[self.position : self.position + count].tolist()
            batch += run
            count -= len(run)
            self.position += len(run)
            if self.position == self.dataset_size:
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seed, shuffle, epoch, position = self.checked_state(state)
        if (seed, shuffle) != (self.seed, self.shuffle):
            # the resumed run must draw the batches it was drawing, so the saved order wins;
            # a sampler built with another one is a change the user should hear of
            warn_at_caller(
                f"the saved sampler's order (seed={seed}, shuffle={shuffle}) replaces this "
                f"one's (seed={self.seed}, shuffle={self.shuffle}): a resumed run draws the "
                "batches the saved one was drawing"
            )
        self.seed, self.shuffle, self.epoch = seed, shuffle, epoch
        self.position = position  # past the dataset's end, take() would wait forever
        self._order_epoch = -1

    def checked_state(self, state: Any) -> tuple[int, bool, int, int]:
        # (seed, shuffle, epoch, position) of a saved state; ValueError where it is not one
        # this sampler can load
        missing = [k for k in self.state_dict() if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"not a VariableBatchSampler state: it lacks {', '.join(missing)}")
        if int(state["dataset_size"]) != self.dataset_size:
            raise ValueError(
                f"the checkpoint's sampler covered {state['dataset_size']} samples, "
                f"this dataset has {self.dataset_size}"
            )
        position = check_number("position", state["position"], high=self.dataset_size, whole=True)
        seed = check_number("seed", state["seed"], high=MAX_SEED, whole=True)
        epoch = check_number("epoch", state["epoch"], whole=True)
        return seed, bool(state["shuffle"]), epoch, position


class GlobalBatchSampler:
    """Micro-batches of a changing global batch, for loops that accumulate a fixed count.

    As a ``DataLoader``'s ``batch_sampler``, every group of ``micro_batches`` batches is
    one global batch of the current ``batch_size`` (this rank's :func:`shard_batch`
    part, the same count on every rank). Set ``batch_size`` between optimizer steps; a
    loader with workers applies it a few steps late. Iteration ends once ``max_samples``
    (global) are drawn (never without it); ``len()`` bounds the micro-batches left from
    above (from an iteration's start: loaders draw ahead), so no epoch ends early.
    """

    #: how many recent steps' plans and positions are kept (loaders draw ahead)
    PLAN_WINDOW = 64

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        micro_batches: int,
        max_samples: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self._sampler = VariableBatchSampler(dataset_size, shuffle=shuffle, seed=seed)
        positive_int("batch_size", batch_size)
        positive_int("micro_batches", micro_batches)
        rank, world_size = rank_in_world(rank, world_size)
        if max_samples is not None:
            max_samples = positive_int("max_samples", max_samples)
        if batch_size < micro_batches * world_size:
            raise ValueError(
                f"batch_size {batch_size} cannot give {micro_batches} micro-batches to each of "
                f"{world_size} ranks"
            )
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        #: the smallest batch a step may have (for ``len()``); a plugin sets it
        #: from its controller
        self.min_batch_size = micro_batches * world_size
        self.max_samples = max_samples
        self.rank, self.world_size = rank, world_size
        #: global samples drawn so far, and optimizer steps drawn
        self.samples = 0
        self.steps = 0
        #: the plan (every rank's micro-batch sizes) of each recently drawn step, by step index
        self.plans: dict[int, StepPlan] = {}
        # per recent step: the state before drawing it, and the size it was drawn with
        self._before: dict[int, tuple[dict[str, Any], int, int]] = {}
        self._replay: list[int] = []  # sizes of steps drawn before a checkpoint, to redraw
        self._counted_from: int | None = None  # the samples drawn as the iteration began

    @property
    def dataset_size(self) -> int:
        return self._sampler.dataset_size

    def __iter__(self) -> Iterator[list[int]]:
        # len() counts from here while the iteration runs: a loader's workers draw steps
        # ahead before a framework reads len() once (Lightning), which then ended the
        # epoch that many steps short of the budget
        self._counted_from = self.samples
        try:
            yield from self._draw()
        finally:
            self._counted_from = None

    def _draw(self) -> Iterator[list[int]]:
        while self.max_samples is None or self.samples < self.max_samples:
            minimum = self.micro_batches * self.world_size
            if self.batch_size < minimum:
                raise ValueError(
                    f"batch_size {self.batch_size} is below {minimum} "
                    "(micro_batches × world_size): every micro-batch needs a sample"
                )
            size = self._replay.pop(0) if self._replay else self.batch_size
            self._before[self.steps] = (self._sampler.state_dict(), self.samples, size)
            self._before.pop(self.steps - self.PLAN_WINDOW, None)
            indices = self._sampler.take(size)
            plan = plan_step(
                indices, rank=self.rank, world_size=self.world_size, count=self.micro_batches
            )
            self.plans[self.steps] = plan
            self.plans.pop(self.steps - self.PLAN_WINDOW, None)  # loaders draw ahead
            self.samples += len(indices)
            self.steps += 1
            for micro_batch in plan.micro_batches:
                yield list(micro_batch)

    def __len__(self) -> int:
        if self.max_samples is None:
            raise TypeError("an endless GlobalBatchSampler (no max_samples) has no length")
        drawn = self.samples if self._counted_from is None else self._counted_from
        left = max(0, self.max_samples - drawn)
        smallest = max(1, self.min_batch_size, self.micro_batches * self.world_size)
        return -(-left // smallest) * self.micro_batches

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The state to resume from; with ``step``, as of just before that step was drawn (a
        loader draws ahead of training)."""
        if step is None or step >= self.steps:
            position, samples, replay = self._sampler.state_dict(), self.samples, []
            step = self.steps
        else:
            if step not in self._before:
                raise ValueError(f"step {step} is too far back to resume from (drawn {self.steps})")
            position, samples, _ = self._before[step]
            replay = [self._before[s][2] for s in range(step, self.steps)]
        return {
            "sampler": position,
            "batch_size": self.batch_size,
            "samples": samples,
            "steps": step,
            "replay": replay,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state["sampler"])
        self.batch_size = int(state["batch_size"])
        self.samples, self.steps = int(state["samples"]), int(state["steps"])
        self._replay = [int(s) for s in state.get("replay", [])]
        self.plans, self._before = {}, {}


def _weight(value: Any, index: int) -> int:
    """A sample's weight: a whole number >= 1."""
    try:
        weight = operator.index(value)  # Python's, numpy's or a one-element tensor's integer
    except TypeError:
        weight = None
    if weight is None or weight < 1:
        raise ValueError(f"weight_fn({index}) must be a whole number >= 1, got {value!r}")
    return weight


def warn_repeats(batch: int, dataset_size: int) -> None:
    """The one warning that a batch of ``batch`` samples repeats some of a dataset's."""
    warnings.warn(
        f"a batch of {batch} samples from a dataset of {dataset_size}: it holds some samples "
        "twice, which the noise statistics (and the rate rules that read them) take as "
        "independent; cap the batch (the controller's max) at the dataset's size",
        stacklevel=4,
    )

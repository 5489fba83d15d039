"""The plain-PyTorch entry point: adaptive batching around your own training loop.

:class:`AdaptiveBatch` owns what changes the batch: the sampler, the
micro-batch plan, the gradient statistics, the controller and the learning
rate rule. Your loop keeps the model, the loss and the optimizer::

    loop = bb.AdaptiveBatch(model, optimizer, dataset, max_micro_batch=256)
    for step in loop.steps(max_samples=2_000_000):
        for x, y in step.micro_batches():
            step.backward(loss_fn(model(x), y))   # scales the loss, collects statistics
        step.apply()                              # scaled LR, optimizer step, next batch size
        print(step.batch_size, step.metrics["similarity"])

Under ``torchrun`` the same code runs with a ``DistributedDataParallel``
model: every rank draws the same global batch, keeps its shard, accumulates
its micro-batches under ``no_sync`` and reduces once per step.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ._checks import positive_int
from ._tensors import norms
from .batch.controllers import Controller, SimiGrad
from .batch.lr import Schedule, lr_factor, resolve_lr_rule, scaled_lr
from .batch.plan import even_split, micro_batch_sizes, split_by_weight
from .batch.sampler import VariableBatchSampler, shard_batch
from .dist.world import World
from .optim.registry import optimizer_family
from .optim.wrapper import StatisticsWrapper
from .stats.collector import GradientStats, MicroBatchStatistics

__all__ = ["AdaptiveBatch", "NonFiniteError", "Step"]

NONFINITE_POLICIES = ("skip", "raise")


class NonFiniteError(FloatingPointError):
    """A step's gradient or loss was NaN or infinite and the policy is ``"raise"``."""


class Step:
    """One optimizer step of :class:`AdaptiveBatch`: its micro-batches, backward and apply."""

    def __init__(
        self,
        loop: AdaptiveBatch,
        index: int,
        batches: list[list[int]],
        weights: list[int],
        rank_weights: list[list[int]],
    ) -> None:
        self._loop = loop
        self.index = index
        self._batches = batches
        #: size of each of this rank's micro-batches in samples (or weight, with ``weight_fn``)
        self.sizes = weights
        #: the micro-batch sizes of every rank (``[sizes]`` on one process)
        self.rank_sizes = rank_weights
        self._batch_size = sum(sum(r) for r in rank_weights)
        self._next = 0
        self._applied = False
        #: the step's gradient statistics (after ``apply``); None without statistics
        self.stats: GradientStats | None = None
        #: what ``apply`` measured and decided, as floats (for logging)
        self.metrics: dict[str, float] = {}

    @property
    def batch_size(self) -> int:
        """The global batch of this step (all ranks), in samples (or weight)."""
        return self._batch_size

    @property
    def indices(self) -> list[list[int]]:
        """This rank's micro-batches as dataset indices (positions in the drawn batch for an
        ``IterableDataset``)."""
        return [list(b) for b in self._batches]

    @property
    def samples(self) -> int:
        """Samples (or weight) seen before this step."""
        return self._loop.samples

    def micro_batches(self) -> Iterator[Any]:
        """The step's micro-batches, collated by the loop's ``DataLoader`` settings.

        Under DDP every micro-batch but the last is yielded inside
        ``model.no_sync()``, so the forward and backward you run on it
        accumulate locally and only the last one reduces the gradients.
        """
        last = len(self._batches) - 1
        for i, batch in enumerate(self._loop._load(self._batches)):
            with self._loop._sync(i == last):
                yield batch

    def backward(self, loss: Tensor) -> None:
        """Backward of the current micro-batch's loss, scaled so ``.grad`` ends as the batch mean.

        ``loss`` is the micro-batch's mean loss (``loss_reduction="mean"``, the
        default) or its sum (``"sum"``).
        """
        if self._next >= len(self.sizes):
            raise RuntimeError(
                f"step {self.index} has {len(self.sizes)} micro-batches; "
                "backward was called more often"
            )
        self._loop._backward(loss, self._next, self)
        self._next += 1

    def apply(self) -> None:
        """Optimizer step with the scaled learning rate; then choose the next batch size."""
        if self._applied:
            raise RuntimeError(f"step {self.index} was already applied")
        if self._next != len(self.sizes):
            raise RuntimeError(
                f"step {self.index} has {len(self.sizes)} micro-batches but backward ran "
                f"{self._next} times"
            )
        self._applied = True
        self.stats, self.metrics = self._loop._apply(self)


class AdaptiveBatch:
    """Adaptive batch sizes for a plain PyTorch loop (SimiGrad, Qin et al. 2021, on one process).

    Each step draws a global batch of the current size from ``dataset``, splits
    it into micro-batches (at least ``min_sub_batches``, each at most
    ``max_micro_batch``, sizes differing by at most one), measures the cosine
    of the two halves' gradients and the noise scale from them, steps the
    optimizer with the learning rate scaled for the batch, and asks the
    controller for the next batch size.

    Args:
        model: the module being trained (its parameters' gradients are measured).
        optimizer: any ``torch.optim.Optimizer`` (bigbatch's or torch's).
        dataset: a map-style dataset (every sample once per epoch, exact
            resume) or an ``IterableDataset`` (consumed in order; resume skips
            what was consumed, so it is exact only for a deterministic iterable).
        controller: a controller from ``bigbatch.batch`` (default
            :class:`~bigbatch.batch.SimiGrad` with its defaults).
        max_micro_batch: the largest micro-batch that fits in memory.
        min_sub_batches: the fewest micro-batches per step (≥ 2; 4 by default
            so the statistics have two per half).
        lr_scaling: how the learning rate follows the batch, relative to
            ``base_batch_size``: ``none``, ``linear``, ``sqrt``, ``adascale``,
            ``adascale-sqrt``, or ``auto`` (default: held for a controller that
            follows the noise scale, else ``sqrt`` for Adam-type optimizers and
            ``linear`` for SGD- and LARS-type; see ``bigbatch.batch.lr``). The
            rate of a step is ``lr × rule(B / base_batch_size) × schedule(samples)``,
            set just before the optimizer step and restored after it.
        base_batch_size: the batch the optimizer's learning rate was tuned for
            (default: the controller's initial batch).
        schedule: a function of samples seen returning a learning-rate
            multiplier (see ``bigbatch.schedules``); applied with the batch
            rule around each optimizer step.
        scaler: a ``torch.amp.GradScaler``; the loop scales losses, unscales
            and steps through it.
        statistics: collect gradient statistics (required by ``SimiGrad``,
            ``NoiseScale`` and the AdaScale rules).
        gsnr: also collect the element-wise gradient SNR (``step.stats.gsnr``).
        similarity: ``"split"`` (the measured cosine of two halves) or
            ``"scalar"`` (estimated from the noise scalars); default ``"split"``
            on one process and ``"scalar"`` under DDP. See
            :class:`~bigbatch.stats.MicroBatchStatistics`.
        comm_hook: a DDP communication hook to reduce the gradients with (e.g.
            :class:`~bigbatch.dist.CompressionHook` or torch's PowerSGD); the
            loop registers it (inside the two-group hook with
            ``similarity="split"``) and saves its ``state_dict()`` if it has one.
        ema_beta: smoothing of the noise-scale estimates.
        finite_correction: correct the noise estimates for batches that are a
            large fraction of a map-style dataset (sampling without replacement).
        loss_reduction: ``"mean"`` if ``step.backward`` gets micro-batch mean
            losses, ``"sum"`` if it gets sums.
        nonfinite: what a step with a NaN or infinite gradient or loss does:
            ``"skip"`` (default) drops the update, counts it in
            ``skipped_steps`` and ``metrics["skipped"]``, keeps the batch size;
            ``"raise"`` raises :class:`NonFiniteError` before anything is
            updated. Either way the model, optimizer, controller and
            statistics never absorb the value. With a ``GradScaler`` an
            overflow is the scaler's to skip (it lowers the scale).
        weight_fn: count the batch in weight (e.g. tokens) instead of samples:
            ``weight_fn(index)`` is sample ``index``'s weight.
        seed, shuffle: the sampler's permutation.
        collate_fn, num_workers, pin_memory, persistent_workers: as for
            ``torch.utils.data.DataLoader``.

    Under DDP (``model`` a ``DistributedDataParallel``) the batch is global:
    every rank draws the same batch from an identically seeded sampler and
    trains on its shard (:func:`~bigbatch.batch.shard_batch`), the ranks'
    micro-batches are the sub-batches of the statistics, and every rank makes
    the same batch-size decision from all-reduced statistics. The extra
    traffic is one all-reduce of a few scalars per step
    (``similarity="scalar"``, the default under DDP), or one extra
    gradient-sized all-reduce for the exact two-group cosine
    (``similarity="split"``, through a comm hook this loop registers).

    Models with BatchNorm normalise over each micro-batch, not the global batch.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset | IterableDataset,
        *,
        controller: Controller | None = None,
        max_micro_batch: int = 256,
        min_sub_batches: int = 4,
        lr_scaling: str = "auto",
        base_batch_size: int | None = None,
        schedule: Schedule | None = None,
        scaler: torch.amp.GradScaler | None = None,
        statistics: bool = True,
        gsnr: bool = False,
        similarity: str | None = None,
        comm_hook: Callable | None = None,
        ema_beta: float = 0.99,
        finite_correction: bool = True,
        loss_reduction: str = "mean",
        nonfinite: str = "skip",
        weight_fn: Callable[[int], int] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        self.model = model
        self.world = World.of(model)
        self.optimizer = optimizer
        self.dataset = dataset
        self.controller: Controller = controller if controller is not None else SimiGrad()
        self.max_micro_batch = positive_int("max_micro_batch", max_micro_batch)
        self.min_sub_batches = positive_int("min_sub_batches", min_sub_batches)
        if self.min_sub_batches < 2 and statistics and not self.world.distributed:
            raise ValueError(
                f"min_sub_batches must be at least 2 to measure statistics, got {min_sub_batches}"
            )
        smallest = self.min_sub_batches * self.world.size
        if self.controller.min < smallest:
            raise ValueError(
                f"the controller's smallest batch ({self.controller.min}) is below "
                f"min_sub_batches × ranks ({self.min_sub_batches} × {self.world.size}): "
                "every sub-batch needs a sample"
            )
        self.lr_scaling = resolve_lr_rule(lr_scaling, self.controller, optimizer_family(optimizer))
        self.base_batch_size = positive_int(
            "base_batch_size",
            base_batch_size if base_batch_size is not None else self.controller.initial,
        )
        needs_stats = getattr(self.controller, "needs_statistics", True) or (
            self.lr_scaling.startswith("adascale")
        )
        if needs_stats and not statistics:
            raise ValueError(
                f"{type(self.controller).__name__} with lr_scaling={self.lr_scaling!r} needs "
                "statistics=True"
            )
        if isinstance(optimizer, StatisticsWrapper):
            # VRGD and AGVM read each step's statistics
            if not statistics:
                raise ValueError(f"{type(optimizer).__name__} needs statistics=True")
            gsnr = gsnr or "gsnr" in optimizer.requirements()
            wrapper: Any = optimizer
            while isinstance(wrapper, StatisticsWrapper):
                if hasattr(wrapper, "check_sub_batches"):
                    wrapper.check_sub_batches(self.min_sub_batches * self.world.size)
                wrapper = wrapper.base
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        #: steps whose update was dropped for a non-finite gradient or loss
        self.skipped_steps = 0
        self.schedule = schedule
        self.scaler = scaler
        self.weight_fn = weight_fn
        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable and weight_fn is not None:
            raise ValueError("weight_fn needs a map-style dataset (samples are weighed by index)")
        size = None if self.iterable else len(dataset)  # type: ignore[arg-type]
        self.sampler = (
            None
            if self.iterable
            else VariableBatchSampler(
                size,
                shuffle=shuffle,
                seed=seed,
                weight_fn=weight_fn,  # type: ignore[arg-type]
            )
        )
        self._iterator: Iterator[Any] | None = None
        self._consumed_from_iterable = 0
        self.stats = (
            MicroBatchStatistics(
                optimizer.param_groups,
                ema_beta=ema_beta,
                gsnr=gsnr,
                dataset_size=size if finite_correction and weight_fn is None else None,
                similarity=similarity,
                world=self.world,
                lossy_reduction=comm_hook is not None,
            )
            if statistics
            else None
        )
        if comm_hook is not None and not self.world.distributed:
            raise ValueError("comm_hook needs a DistributedDataParallel model on 2+ ranks")
        self.comm_hook = comm_hook
        hook = comm_hook
        if self.stats is not None and self.stats.comm_hook is not None:
            self.stats.comm_hook.inner = comm_hook
            hook = self.stats.comm_hook
        if hook is not None:
            try:
                model.register_comm_hook(None, hook)
            except RuntimeError as err:
                raise ValueError(
                    "the model has a comm hook already; pass yours as comm_hook= so the loop "
                    f"can compose it with its own ({err})"
                ) from None
        self._loss_sum: Tensor | None = None
        self._loader_options = dict(
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
        )
        self._loader_generator = torch.Generator().manual_seed(seed)
        self._loader: DataLoader | None = None
        self._micro_plan: list[list[int]] = []
        self.batch_size = self.controller.initial
        self.step = 0
        self.samples = 0

    # ------------------------------------------------------------ iteration

    def steps(self, max_samples: int | None = None, max_steps: int | None = None) -> Iterator[Step]:
        """Yield steps until ``max_samples`` samples or ``max_steps`` steps are done.

        A resumed loop continues from its counters; the last step may overshoot
        ``max_samples`` by less than one batch.
        """
        if max_samples is None and max_steps is None:
            raise ValueError("give max_samples or max_steps")
        while (max_samples is None or self.samples < max_samples) and (
            max_steps is None or self.step < max_steps
        ):
            step = self._next_step()
            yield step
            if not step._applied:
                raise RuntimeError(f"step {step.index} was not applied: call step.apply()")

    def _next_step(self) -> Step:
        """Draw the global batch and plan every rank's micro-batches (the same on all ranks)."""
        if self.iterable:
            samples = self._take_from_iterable(self.batch_size)
            self._iterable_samples = samples
            indices = list(range(len(samples)))
        else:
            assert self.sampler is not None
            indices = self.sampler.take(self.batch_size)
        shards = [shard_batch(indices, r, self.world.size) for r in range(self.world.size)]
        # Every rank runs the same number of micro-batches: DDP may broadcast
        # buffers in every forward, a collective all ranks must join. A rank
        # whose shard is one sample short (or lighter) still splits into as
        # many parts; a part may then exceed max_micro_batch by a sample.
        natural = max(self._natural_count(shard) for shard in shards)
        count = min(natural, min(len(shard) for shard in shards))
        plans = [self._plan(shard, count) for shard in shards]
        batches, weights = plans[self.world.rank]
        return Step(self, self.step, batches, weights, [w for _, w in plans])

    def _natural_count(self, indices: list[int]) -> int:
        """How many micro-batches ``indices`` need on their own (size cap and minimum count)."""
        if self.weight_fn is None:
            return len(
                micro_batch_sizes(
                    len(indices),
                    max_micro_batch=self.max_micro_batch,
                    min_sub_batches=self.min_sub_batches,
                )
            )
        return len(
            split_by_weight(
                [int(self.weight_fn(i)) for i in indices],
                max_micro_batch=self.max_micro_batch,
                min_sub_batches=self.min_sub_batches,
            )
        )

    def _plan(self, indices: list[int], count: int) -> tuple[list[list[int]], list[int]]:
        """``indices`` as exactly ``count`` micro-batches (lists of indices) and their sizes."""
        if self.weight_fn is None:
            counts = even_split(len(indices), count)
            weights = counts
        else:
            sample_weights = [int(self.weight_fn(i)) for i in indices]
            # no cap: the count is fixed, the weights only place the boundaries
            counts = split_by_weight(
                sample_weights, max_micro_batch=sys.maxsize, min_sub_batches=count
            )
            weights, start = [], 0
            for c in counts:
                weights.append(sum(sample_weights[start : start + c]))
                start += c
        batches, start = [], 0
        for c in counts:
            batches.append(indices[start : start + c])
            start += c
        return batches, weights

    def _take_from_iterable(self, count: int) -> list[Any]:
        if self._iterator is None:
            self._iterator = iter(self.dataset)  # type: ignore[arg-type]
            for _ in range(self._consumed_from_iterable):  # resume: skip what was consumed
                next(self._iterator)
        samples = []
        for _ in range(count):
            try:
                samples.append(next(self._iterator))
            except StopIteration:  # a finite iterable: start it again
                self._iterator = iter(self.dataset)  # type: ignore[arg-type]
                self._consumed_from_iterable = 0
                samples.append(next(self._iterator))
        self._consumed_from_iterable += len(samples)
        return samples

    def _load(self, batches: list[list[int]]) -> Iterator[Any]:
        if self.iterable:
            collate = self._loader_options["collate_fn"] or torch.utils.data.default_collate
            for batch in batches:
                yield collate([self._iterable_samples[i] for i in batch])
            return
        self._micro_plan = batches
        if self._loader is None:
            # One DataLoader reads the plan of the current step: its workers
            # prefetch within the step, never a step whose size is not decided.
            self._loader = DataLoader(
                self.dataset,
                batch_sampler=_PlanSampler(self),
                generator=self._loader_generator,
                **self._loader_options,
            )
        yield from self._loader

    # ------------------------------------------------------------ backward and apply

    def _sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's ``no_sync`` for all but a step's last micro-batch; nothing on one process."""
        if self.world.distributed and not last:
            return self.model.no_sync()  # type: ignore[operator]
        return contextlib.nullcontext()

    def _backward(self, loss: Tensor, index: int, step: Step) -> None:
        # DDP averages over the ranks; W b_i / B makes .grad the batch's sample-weighted mean
        sizes, total = step.sizes, step.batch_size
        if self.loss_reduction == "mean":
            weight = self.world.size * sizes[index] / total
        else:
            weight = self.world.size / total
        if index == 0:
            self._loss_sum = None
        if self.stats is not None:
            if index == 0:
                self.stats.begin(sizes, step.rank_sizes)
            self.stats.before_backward(index)
        loss = loss * weight
        share = loss.detach()
        self._loss_sum = share if self._loss_sum is None else self._loss_sum + share
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def _apply(self, step: Step) -> tuple[GradientStats | None, dict[str, float]]:
        batch = step.batch_size
        stats = None
        metrics: dict[str, float] = {}
        assert self._loss_sum is not None
        if self.stats is not None:
            # the scaler's scale tensor, read without a host sync (get_scale() syncs)
            scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
            stats = self.stats.finish(loss_scale=scale, loss=self._loss_sum)
            metrics.update(stats.as_floats())  # the one host sync of the step
            finite = math.isfinite(metrics["grad_sq_norm"]) and math.isfinite(metrics["loss"])
        else:
            loss = self.world.all_reduce_sum((self._loss_sum.double() / self.world.size)[None])
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]]
            present = [g for g in grads if g is not None]
            total = torch.stack(norms(present)).sum().double() if present else torch.zeros(())
            # one host sync for the loss and the gradient's finiteness
            metrics["loss"], total_norm = torch.stack([loss[0], total.to(loss)]).tolist()
            finite = math.isfinite(metrics["loss"]) and math.isfinite(total_norm)
        self._loss_sum = None
        if not finite and self.scaler is None:
            if self.nonfinite == "raise":
                raise NonFiniteError(
                    f"step {self.step + 1}: the gradient or loss is not finite "
                    f"(loss {metrics['loss']}); nothing was updated"
                )
            return stats, self._skip(metrics, batch)
        if finite and stats is not None and isinstance(self.optimizer, StatisticsWrapper):
            self.optimizer.observe(stats)
        factor = lr_factor(
            self.lr_scaling,
            batch,
            self.base_batch_size,
            grad_sq_norm=metrics.get("grad_sq_norm_ema"),
            trace=metrics.get("trace_ema"),
        )
        if self.schedule is not None:
            factor *= float(self.schedule(self.samples))
        metrics["lr_factor"] = factor
        metrics["lr"] = self.optimizer.param_groups[0]["lr"] * factor
        with scaled_lr(self.optimizer, factor):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        if isinstance(self.optimizer, StatisticsWrapper):
            metrics.update(self.optimizer.metrics())
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples += batch
        metrics.update(step=self.step, samples=self.samples, batch_size=batch)
        if finite:  # an overflowed GradScaler step teaches the controller nothing
            self.batch_size = int(self.controller.next(metrics, batch, self.samples))
        metrics["next_batch_size"] = self.batch_size
        return stats, metrics

    def _skip(self, metrics: dict[str, float], batch: int) -> dict[str, float]:
        """Drop a non-finite step: no update, same next batch size, counted."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.step += 1
        self.samples += batch
        metrics.update(step=self.step, samples=self.samples, batch_size=batch, skipped=1.0)
        metrics.update(lr_factor=0.0, lr=0.0, next_batch_size=self.batch_size)
        return metrics

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, scaler, sampler, controller,
        statistics, counters and random states, as tensors and plain data
        (loads with ``torch.load(..., weights_only=True)``).

        Under DDP this is a collective (call it on every rank): it gathers
        every rank's random state, so any rank may save it. The model's keys
        are those of the module inside DDP, so a checkpoint loads with any
        number of processes.
        """
        return {
            "model": _unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "consumed_from_iterable": self._consumed_from_iterable,
            "controller": self.controller.state_dict(),
            "statistics": self.stats.state_dict() if self.stats is not None else None,
            "batch_size": self.batch_size,
            "skipped_steps": self.skipped_steps,
            "step": self.step,
            "samples": self.samples,
            "rng": self.world.all_gather_object(rng_state()),
            "comm_hook": self.world.all_gather_object(self.comm_hook.state_dict())
            if hasattr(self.comm_hook, "state_dict")
            else None,
            "loader_rng": self._loader_generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, saved with this or another number of processes.

        With the same number the run continues exactly; with another, rank
        ``r`` takes the random state of rank ``r mod saved ranks`` and the
        batches are re-sharded, so it continues correctly but not bitwise.
        """
        _unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        self._consumed_from_iterable = int(state["consumed_from_iterable"])
        self._iterator = None
        self.controller.load_state_dict(state["controller"])
        if self.stats is not None and state["statistics"] is not None:
            self.stats.load_state_dict(state["statistics"])
        self.batch_size = int(state["batch_size"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.step, self.samples = int(state["step"]), int(state["samples"])
        saved = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        set_rng_state(saved[self.world.rank % len(saved)])
        hooks = state.get("comm_hook")
        # each rank's error state is its own: with another world size it starts afresh
        if hooks and hasattr(self.comm_hook, "load_state_dict") and len(hooks) == self.world.size:
            self.comm_hook.load_state_dict(hooks[self.world.rank])
        self._loader_generator.set_state(state["loader_rng"])


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class _PlanSampler:
    """The DataLoader's batch sampler: the current step's micro-batches, nothing beyond."""

    def __init__(self, loop: AdaptiveBatch) -> None:
        self._loop = loop

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self._loop._micro_plan))

    def __len__(self) -> int:
        return len(self._loop._micro_plan)


# ---------------------------------------------------------------- random states as tensors


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch random states as tensors (``weights_only``-loadable)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": torch.tensor(list(internal), dtype=torch.int64),
        "python_version": int(version),
        "python_gauss": math.nan if gauss is None else float(gauss),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    gauss = state["python_gauss"]
    random.setstate(
        (
            int(state["python_version"]),
            tuple(int(x) for x in state["python"].tolist()),
            None if math.isnan(gauss) else gauss,
        )
    )
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_gauss"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

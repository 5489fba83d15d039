"""Adaptive batching for PyTorch Lightning: one callback and bigbatch's global-batch sampler.

Lightning steps the optimizer every ``accumulate_grad_batches`` batches by a
counter, so the batch must change by the size of those batches, never by
their number: a :class:`~bigbatch.batch.GlobalBatchSampler` hands out each
step's global batch as exactly ``k`` micro-batches (of this rank's shard under
DDP), and :class:`AdaptiveBatchCallback` measures the statistics over them,
scales the learning rate around the optimizer step and sets the next batch
size::

    sampler = bb.batch.GlobalBatchSampler(len(train), 64, micro_batches=4, max_samples=1_200_000)
    loader = DataLoader(train, batch_sampler=sampler)
    callback = AdaptiveBatchCallback(sampler, bb.batch.SimiGrad(target=1 / 3, initial=64))
    trainer = L.Trainer(accumulate_grad_batches=4, use_distributed_sampler=False,
                        max_epochs=1, callbacks=[callback])
    trainer.fit(model, loader)

The budget is ``max_samples`` (the loader ends there), the schedule a
function of samples (``bigbatch.schedules``); the callback's state (sampler,
controller, statistics, counters) goes into Lightning checkpoints. Lightning's
loop draws one batch ahead, so a new batch size takes effect one step late.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from ..batch.controllers import Controller, SimiGrad
from ..batch.lr import Schedule, check_lr_rule, lr_factor
from ..batch.sampler import GlobalBatchSampler
from ..dist.world import World
from ..stats.collector import MicroBatchStatistics

__all__ = ["AdaptiveBatchCallback"]


class AdaptiveBatchCallback(pl.Callback):
    """SimiGrad-style adaptive batching inside ``Trainer.fit`` (one optimizer).

    Args:
        sampler: the :class:`~bigbatch.batch.GlobalBatchSampler` of the train
            loader; its ``micro_batches`` must equal ``accumulate_grad_batches``.
        controller: chooses the next batch size (default ``SimiGrad()``).
        lr_scaling: ``none``, ``linear``, ``sqrt`` (default), ``adascale`` or
            ``adascale-sqrt``, relative to ``base_batch_size``.
        base_batch_size: the batch the optimizer's LR is tuned for (default:
            the sampler's first batch size).
        schedule: LR multiplier as a function of samples seen.
        similarity: ``"split"`` or ``"scalar"`` (default ``"split"`` on one
            process, ``"scalar"`` under DDP; ``"split"`` needs one process).
        ema_beta: smoothing of the noise-scale estimates.

    ``history`` keeps one dict per optimizer step (batch size, similarity,
    noise scale, LR factor, ...); with ``log=True`` they are also logged as
    ``bigbatch/<name>``.
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        controller: Controller | None = None,
        *,
        lr_scaling: str = "sqrt",
        base_batch_size: int | None = None,
        schedule: Schedule | None = None,
        similarity: str | None = None,
        ema_beta: float = 0.99,
        log: bool = True,
    ) -> None:
        if not isinstance(sampler, GlobalBatchSampler):
            raise TypeError(
                f"sampler must be a bigbatch GlobalBatchSampler, got {type(sampler).__name__}"
            )
        self.sampler = sampler
        self.controller = (
            controller if controller is not None else SimiGrad(initial=sampler.batch_size)
        )
        self.lr_scaling = check_lr_rule(lr_scaling)
        self.base_batch_size = base_batch_size or sampler.batch_size
        self.schedule = schedule
        self.similarity = similarity
        self.ema_beta = ema_beta
        self.log = log
        self.stats: MicroBatchStatistics | None = None
        self.step = 0
        self.samples = 0
        self.history: list[dict[str, float]] = []
        self._pending_state: dict[str, Any] | None = None
        self._saved_lrs: list[float] | None = None
        self._loss: torch.Tensor | None = None
        self._plan: list[list[int]] = []

    # ------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.accumulate_grad_batches != self.sampler.micro_batches:
            raise ValueError(
                f"accumulate_grad_batches ({trainer.accumulate_grad_batches}) must equal the "
                f"sampler's micro_batches ({self.sampler.micro_batches})"
            )
        self.sampler.rank, self.sampler.world_size = trainer.global_rank, trainer.world_size

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("AdaptiveBatchCallback supports exactly one optimizer")
        optimizer = trainer.optimizers[0]
        world = World.of(trainer.strategy.model) if trainer.world_size > 1 else World()
        if world.distributed and self.similarity == "split":
            raise ValueError("similarity='split' under DDP is not supported here; use 'scalar'")
        self.stats = MicroBatchStatistics(
            optimizer.param_groups,
            ema_beta=self.ema_beta,
            similarity=self.similarity,
            world=world,
            dataset_size=self.sampler.dataset_size,
        )
        if self._pending_state is not None:
            self.stats.load_state_dict(self._pending_state)
            self._pending_state = None
        optimizer.register_step_post_hook(self._restore_lr)

    # ------------------------------------------------------------ one step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.stats is not None
        k = self.sampler.micro_batches
        index = batch_idx % k
        if index == 0:
            self._plan = self.sampler.plans[self.step]
            mine = self._plan[self.sampler.rank]
            self.stats.begin(mine, self._plan, loss_weights=[1 / k] * k)
            self._loss = None
        self.stats.before_backward(index)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        share = loss.detach()  # Lightning has divided it by accumulate_grad_batches
        self._loss = share if self._loss is None else self._loss + share

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # the gradients are accumulated (and reduced under DDP), not yet clipped
        assert self.stats is not None
        stats = self.stats.finish(loss=self._loss)
        metrics = stats.as_floats()
        batch = sum(sum(r) for r in self._plan)
        factor = lr_factor(
            self.lr_scaling,
            batch,
            self.base_batch_size,
            grad_sq_norm=metrics["grad_sq_norm_ema"],
            trace=metrics["trace_ema"],
        )
        if self.schedule is not None:
            factor *= float(self.schedule(self.samples))
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self.step += 1
        self.samples += batch
        metrics.update(step=self.step, samples=self.samples, batch_size=batch, lr_factor=factor)
        metrics["lr"] = optimizer.param_groups[0]["lr"]
        self.sampler.batch_size = int(self.controller.next(metrics, batch, self.samples))
        metrics["next_batch_size"] = self.sampler.batch_size
        self.history.append(metrics)
        if self.log:
            names = ("batch_size", "similarity", "noise_scale", "lr_factor", "loss")
            pl_module.log_dict(
                {f"bigbatch/{n}": float(metrics[n]) for n in names if n in metrics}, on_step=True
            )

    def _restore_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Right after optimizer.step (before Lightning's schedulers step): the unscaled LR."""
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(step=self.step),  # the loader draws ahead
            "controller": self.controller.state_dict(),
            "statistics": self.stats.state_dict() if self.stats is not None else None,
            "step": self.step,
            "samples": self.samples,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state_dict["sampler"])
        self.controller.load_state_dict(state_dict["controller"])
        self._pending_state = state_dict["statistics"]
        self.step, self.samples = int(state_dict["step"]), int(state_dict["samples"])

"""Adaptive batching for the Hugging Face ``Trainer``: a callback and the Trainer it needs.

A ``TrainerCallback`` sees the steps but cannot change the batch: the Trainer
fixes its data loader and ``gradient_accumulation_steps`` at the start, and
clips gradients before any callback sees them. :class:`AdaptiveBatchTrainer`
therefore does what a callback cannot:

- its train loader draws from a :class:`~bigbatch.batch.GlobalBatchSampler`:
  each optimizer step is ``gradient_accumulation_steps`` micro-batches of the
  global batch the controller chose (this rank's shard under DDP; the loader
  is not re-sharded by accelerate);
- the budget is the sampler's ``max_samples``: training ends when it is spent,
  whatever the batch sizes were (``max_steps`` is only an upper bound it sets);
- the Trainer's own LR scheduler is constant; the schedule is a function of
  samples (``schedule=``), applied with the batch rule around each optimizer
  step by :class:`AdaptiveBatchCallback`;
- the statistics are finished before gradient clipping;
- the controller, sampler and statistics are saved in each checkpoint
  (``bigbatch.pt``) and restored with ``resume_from_checkpoint``.

Example::

    sampler = bb.batch.GlobalBatchSampler(len(train), 64, micro_batches=4, max_samples=1_000_000)
    trainer = AdaptiveBatchTrainer(
        model=model, args=TrainingArguments("out", gradient_accumulation_steps=4),
        train_dataset=train, sampler=sampler, controller=bb.batch.SimiGrad(initial=64),
    )
    trainer.train()
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..batch.controllers import Controller, SimiGrad
from ..batch.lr import Schedule, check_lr_rule, lr_factor
from ..batch.sampler import GlobalBatchSampler
from ..dist.world import World
from ..stats.collector import MicroBatchStatistics

__all__ = ["AdaptiveBatchCallback", "AdaptiveBatchTrainer"]

STATE_FILE = "bigbatch.pt"


class AdaptiveBatchCallback(TrainerCallback):
    """The per-step logic: statistics over the micro-batches, LR around the step, next size."""

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
    ) -> None:
        self.sampler = sampler
        self.controller = (
            controller if controller is not None else SimiGrad(initial=sampler.batch_size)
        )
        self.lr_scaling = check_lr_rule(lr_scaling)
        self.base_batch_size = base_batch_size or sampler.batch_size
        self.schedule = schedule
        self.similarity = similarity
        self.ema_beta = ema_beta
        self.stats: MicroBatchStatistics | None = None
        self.step = 0
        self.samples = 0
        #: one dict per optimizer step: batch_size, similarity, noise_scale, lr_factor, loss, ...
        self.history: list[dict[str, float]] = []
        self.loss: torch.Tensor | None = None  # this rank's share of the step's loss
        self.sample_weighted = False  # the Trainer normalised losses by num_items_in_batch
        self._finished: dict[str, float] | None = None
        self._saved_lrs: list[float] | None = None
        self._plan: list[list[int]] = []
        self._pending: dict[str, Any] | None = None

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        world = World.of(model) if torch.distributed.is_initialized() else World()
        self.stats = MicroBatchStatistics(
            optimizer.param_groups,
            ema_beta=self.ema_beta,
            similarity=self.similarity,
            world=world,
            dataset_size=self.sampler.dataset_size,
        )
        if self._pending is not None:
            self.stats.load_state_dict(self._pending)
            self._pending = None

    def on_step_begin(self, args, state, control, **kwargs):
        assert self.stats is not None
        k = self.sampler.micro_batches
        self._plan = self.sampler.plans[self.step]
        mine = self._plan[self.sampler.rank]
        weights = None if self.sample_weighted else [1 / k] * k
        self.stats.begin(mine, self._plan, loss_weights=weights)
        self.stats.before_backward(0)
        self._index, self.loss, self._finished = 0, None, None

    def on_substep_end(self, args, state, control, **kwargs):
        assert self.stats is not None
        self._index += 1
        self.stats.before_backward(self._index)

    def finish(self) -> None:
        """The step's statistics, from the accumulated (and reduced), not yet clipped gradients."""
        if self._finished is None:
            assert self.stats is not None
            self._finished = self.stats.finish(loss=self.loss).as_floats()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.finish()
        metrics = dict(self._finished or {})
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

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # right after optimizer.step, before the Trainer's scheduler steps
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None

    def on_step_end(self, args, state, control, **kwargs):
        budget = self.sampler.max_samples
        if budget is not None and self.samples >= budget:
            control.should_training_stop = True  # the budget is in samples

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.history:
            last = self.history[-1]
            for name in ("batch_size", "similarity", "noise_scale", "lr_factor", "samples"):
                if name in last:
                    logs[f"bigbatch/{name}"] = last[name]

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(step=self.step),
            "controller": self.controller.state_dict(),
            "statistics": self.stats.state_dict() if self.stats is not None else None,
            "step": self.step,
            "samples": self.samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.controller.load_state_dict(state["controller"])
        self._pending = state["statistics"]
        self.step, self.samples = int(state["step"]), int(state["samples"])


class _Endless:
    """The sampler without ``len()``: the Trainer then counts on ``max_steps``, not epochs."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)


class AdaptiveBatchTrainer(Trainer):
    """A ``transformers.Trainer`` whose batch size the statistics choose step by step.

    Takes the Trainer's arguments plus ``sampler`` (a
    :class:`~bigbatch.batch.GlobalBatchSampler` over ``train_dataset`` whose
    ``micro_batches`` equals ``gradient_accumulation_steps`` and which has a
    ``max_samples`` budget) and the options of :class:`AdaptiveBatchCallback`.
    """

    def __init__(self, *args: Any, sampler: GlobalBatchSampler, **kwargs: Any) -> None:
        options = {
            k: kwargs.pop(k)
            for k in ("controller", "lr_scaling", "base_batch_size", "schedule", "similarity")
            if k in kwargs
        }
        self.bigbatch = AdaptiveBatchCallback(sampler, **options)
        super().__init__(*args, **kwargs)
        if sampler.max_samples is None:
            raise ValueError("the sampler needs max_samples: the budget is in samples")
        if self.args.gradient_accumulation_steps != sampler.micro_batches:
            raise ValueError(
                f"gradient_accumulation_steps ({self.args.gradient_accumulation_steps}) must "
                f"equal the sampler's micro_batches ({sampler.micro_batches})"
            )
        if self.args.max_steps <= 0:  # an upper bound: the sampler ends the run
            smallest = max(1, getattr(self.bigbatch.controller, "min", sampler.batch_size))
            self.args.max_steps = math.ceil(sampler.max_samples / smallest) + 1
        self.args.ignore_data_skip = True  # the sampler resumes itself
        sampler.rank, sampler.world_size = self.args.process_index, self.args.world_size
        self.add_callback(self.bigbatch)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            self.train_dataset,
            batch_sampler=_Endless(self.bigbatch.sampler),
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # constant: the schedule is in samples, applied by the callback
        if self.lr_scheduler is None:
            target = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(target, lambda _: 1.0)
        return self.lr_scheduler

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.bigbatch.sample_weighted = num_items is not None
        if batches and self.bigbatch.stats is None:
            self.bigbatch.attach(self.model_wrapped, self.optimizer)
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        share = loss.detach()
        self.bigbatch.loss = share if self.bigbatch.loss is None else self.bigbatch.loss + share
        return loss

    def _clip_grad_norm(self, model):
        self.bigbatch.finish()  # the statistics see the gradients before clipping
        return super()._clip_grad_norm(model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.bigbatch.state_dict(), os.path.join(output_dir, STATE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
            state = torch.load(os.path.join(checkpoint, STATE_FILE), weights_only=True)
            self.bigbatch.load_state_dict(state)

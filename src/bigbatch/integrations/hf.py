"""Adaptive batching for the Hugging Face ``Trainer`` (:class:`AdaptiveBatchTrainer`): it
draws from a :class:`~bigbatch.batch.GlobalBatchSampler`, to its ``max_samples`` (docs/hf.md)."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback
from transformers.utils import is_datasets_available

if is_datasets_available():
    import datasets

from .._warn import warn_at_caller
from ..batch.controllers import Controller
from ..batch.sampler import GlobalBatchSampler
from ..options import StepOptions
from ..sinks import tagged
from ._driver import DriverView, StepDriver

__all__ = ["AdaptiveBatchCallback", "AdaptiveBatchTrainer"]

STATE_FILE = "bigbatch.pt"


class AdaptiveBatchCallback(DriverView, TrainerCallback):
    """The per-step logic, used by :class:`AdaptiveBatchTrainer`: statistics, LR, next size."""

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        controller: Controller | None = None,
        *,
        options: StepOptions | None = None,
        **step_options: Any,
    ) -> None:
        self.driver = StepDriver(sampler, controller, options, **step_options)
        self.sampler = sampler
        #: each micro-batch's mean loss's multiplier this step, as the Trainer applies it
        #: (None: it divides each loss by their number)
        self.loss_weights: list[float] | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.driver.begin(self.loss_weights)  # (None: the Trainer divides losses by k)
        self._index = 0
        self.driver.before_backward(0)

    def on_substep_end(self, args, state, control, **kwargs):
        self._index += 1
        self.driver.before_backward(self._index)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.driver.decide()  # already done before clipping; here when there is no clipping

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.driver.after_optimizer_step()  # before the Trainer's scheduler steps

    def on_step_end(self, args, state, control, **kwargs):
        if self.driver.spent:
            # the budget ends the run where max_steps would: the Trainer's own end (a last
            # evaluation and checkpoint) decided as its flow callback decides it there
            state.max_steps = state.global_step
            DefaultFlowCallback().on_step_end(args, state, control)


class _Endless:
    """The sampler without ``len()``: the Trainer then counts on ``max_steps``, not epochs."""

    def __init__(self, sampler: GlobalBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)


class AdaptiveBatchTrainer(Trainer):
    """A ``transformers.Trainer`` whose batch size the statistics choose step by step: the
    Trainer's arguments plus ``sampler`` (``micro_batches`` equal to
    ``gradient_accumulation_steps``, with ``max_samples``), ``controller`` and ``options``."""

    def __init__(
        self,
        *args: Any,
        sampler: GlobalBatchSampler,
        controller: Controller | None = None,
        options: StepOptions | None = None,
        **kwargs: Any,
    ) -> None:
        step_options = StepOptions.pop_from(kwargs)
        self.bigbatch = AdaptiveBatchCallback(sampler, controller, options=options, **step_options)
        super().__init__(*args, **kwargs)
        if sampler.max_samples is None:
            raise ValueError("the sampler needs max_samples: the budget is in samples")
        if self.args.gradient_accumulation_steps != sampler.micro_batches:
            raise ValueError(
                f"gradient_accumulation_steps ({self.args.gradient_accumulation_steps}) must "
                f"equal the sampler's micro_batches ({sampler.micro_batches})"
            )
        # the user's arguments unchanged (another Trainer may be given them)
        self.args = copy.copy(self.args)
        bounded = self.args.max_steps <= 0
        if bounded:  # an upper bound: the sampler ends the run
            smallest = max(1, self.bigbatch.driver.controller.min)
            self.args.max_steps = math.ceil(sampler.max_samples / smallest) + 1
        _warn_of_whole_run_intervals(self.args, bounded)
        self.args.ignore_data_skip = True  # the sampler resumes itself
        kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        if self.lr_scheduler is None and (kind not in ("linear", "constant") or (
            self.args.warmup_steps or getattr(self.args, "warmup_ratio", 0)
        )):  # fmt: skip
            # ("linear", the Trainer's default, cannot be told from one asked for)
            warn_at_caller(
                f"AdaptiveBatchTrainer makes the Trainer's scheduler constant: "
                f"lr_scheduler_type={kind!r} and its warm-up are not used; give the schedule "
                "in samples (schedule=bigbatch.schedules.warmup_cosine(...)), or a scheduler "
                "of your own in optimizers="
            )
        if self.train_dataset is not None:  # (its loader is ours, drawing with the sampler)
            self.bigbatch.driver.check_data(self.train_dataset, sampler)
        sampler.rank, sampler.world_size = self.args.process_index, self.args.world_size
        self.add_callback(self.bigbatch)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        # the fields the model's forward does not take dropped, as the Trainer's own loader
        # drops them (remove_unused_columns): from a datasets.Dataset, else in the collator
        dataset, collate = self.train_dataset, self.data_collator
        if is_datasets_available() and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        args = self.args
        workers = {}
        if args.dataloader_num_workers:  # the Trainer's worker options (refused without any)
            workers = {
                "persistent_workers": args.dataloader_persistent_workers,
                "prefetch_factor": args.dataloader_prefetch_factor,
            }
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=_Endless(self.bigbatch.sampler),
            collate_fn=collate,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            **workers,
            # its own generator: the loader's seed draw, made as the iterator starts, would
            # come from the global state the Trainer restores on a resume just before, and
            # shift every draw after it (dropout's) by one against the run never stopped
            generator=torch.Generator().manual_seed(self.args.seed),
        )

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # constant: the schedule is in samples, applied by the callback
        if self.lr_scheduler is None:
            target = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(target, lambda _: 1.0)
        return self.lr_scheduler

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batches and num_items is not None and self._loss_scaled_for_accumulation():
            # the loss divides each micro-batch's summed loss by the window's label count,
            # the labels counted as the Trainer counts them (a causal LM's shifted ones)
            counts = [float(_counted_labels(self, b).ne(-100).sum()) for b in batches]
            scale = self._across_processes_scale()
            self.bigbatch.loss_weights = [scale * c / float(num_items) for c in counts]
        elif batches:  # training_step divides each micro-batch's loss by their number
            self.bigbatch.loss_weights = None
        if batches and self.bigbatch.driver.engine is None:
            # the model: its world, and the layers the per-example statistics hook
            ddp = self.model_wrapped if torch.distributed.is_initialized() else self.model
            # accelerate wraps the optimizer; the engine needs the one it wraps (a VRGD or
            # AGVM must be seen as one, and it shares its param groups with the wrapper)
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
            # fp16: the gradients are read scaled (before clipping unscales them), and an
            # overflow the engine skips must lower the scale
            self.bigbatch.driver.attach(inner, ddp, getattr(self.accelerator, "scaler", None))
        return batches, num_items

    def _loss_scaled_for_accumulation(self) -> bool:
        # transformers' training_step: the loss came normalised over the whole window (by
        # the model or compute_loss_func) unless the user says otherwise
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        return bool(scaled)

    def _across_processes_scale(self) -> int:
        # compute_loss: a loss divided by every process's label count is multiplied by the
        # processes (by tensor-parallel groups where the Trainer has them), so that DDP's
        # mean of the ranks' gradients is the window's mean
        args = self.args
        if not (args.average_tokens_across_devices and (
            self.model_accepts_loss_kwargs or self.compute_loss_func
        )):  # fmt: skip
            return 1
        if args.n_gpu > 1:
            return args.n_gpu
        tensor_parallel = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
        return self.accelerator.num_processes // tensor_parallel

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # every number of the last step, named as bigbatch.sinks names it, into the logs
        # before the Trainer stores them and hands them to every reporting callback (a
        # callback's on_log comes after both)
        # (not an evaluation's, nor the end-of-training summary, which would log it again)
        summary = any(k.startswith("eval_") or k == "train_runtime" for k in logs)
        if self.bigbatch.history and not summary:
            logs = {**logs, **tagged(self.bigbatch.history[-1])}
        super().log(logs, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.bigbatch.driver.add_loss(loss)
        return loss

    def _clip_grad_norm(self, model):
        self.bigbatch.driver.decide()  # the statistics see the gradients before clipping
        return super()._clip_grad_norm(model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(self.bigbatch.driver.state_dict(), os.path.join(output_dir, STATE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
            # (resumed, the run would train its whole sample budget again from batch one)
            raise ValueError(
                f"the checkpoint {checkpoint} has no {STATE_FILE}: it keeps no sampler, "
                "controller or sample count (saved with save_only_model=True, or by another "
                "Trainer); resume from one AdaptiveBatchTrainer saved without save_only_model"
            )
        # saved on a GPU, resumed on a CPU: its tensors mapped there
        cpu = "cpu" if self.args.device.type == "cpu" else None
        state = torch.load(
            os.path.join(checkpoint, STATE_FILE), weights_only=True, map_location=cpu
        )
        self.bigbatch.driver.load_state_dict(state)


def _warn_of_whole_run_intervals(args: Any, bounded: bool) -> None:
    # the budget is one Trainer epoch, and max_steps (set here) only a bound on its steps
    unfit = [
        f"{name}='epoch'"
        for name in ("eval_strategy", "save_strategy", "logging_strategy")
        if getattr(getattr(args, name, None), "value", None) == "epoch"
    ]
    if bounded:
        unfit += [
            f"{name}={value}"
            for name in ("eval_steps", "save_steps", "logging_steps")
            if isinstance(value := getattr(args, name, None), float) and 0 < value < 1
        ]
    if unfit:
        warn_at_caller(
            f"AdaptiveBatchTrainer trains the sample budget as one epoch, its max_steps only a "
            f"bound: {', '.join(unfit)} would act once, at the end; give them in steps"
        )


def _counted_labels(trainer: Any, batch: dict[str, Any]) -> torch.Tensor:
    # the labels transformers' Trainer counts for num_items_in_batch (its
    # _get_num_items_in_batch): a collator's shift_labels, else a causal LM's shifted labels
    if "shift_labels" in batch:
        return batch["shift_labels"]
    if getattr(trainer, "_loss_shifts_labels", False):
        return batch["labels"][..., 1:]
    return batch["labels"]

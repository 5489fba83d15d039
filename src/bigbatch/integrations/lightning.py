"""Adaptive batching for PyTorch Lightning: :class:`AdaptiveBatchCallback` with a
:class:`~bigbatch.batch.GlobalBatchSampler` as the loader's ``batch_sampler``. A new
batch size takes effect at the next step (with loader workers later: docs/lightning.md)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from .._warn import warn_at_caller
from ..batch.controllers import Controller
from ..batch.sampler import GlobalBatchSampler
from ..options import StepOptions
from ..sinks import tagged
from ..state import rng_state, set_rng_state
from ._driver import DriverView, StepDriver

__all__ = ["AdaptiveBatchCallback"]


class AdaptiveBatchCallback(DriverView, pl.Callback):
    """Adaptive batching inside ``Trainer.fit`` (one optimizer); ``history`` keeps one dict
    per step.

    Args:
        sampler: the train loader's :class:`~bigbatch.batch.GlobalBatchSampler`; its
            ``micro_batches`` must equal ``accumulate_grad_batches``.
        controller: chooses the next batch size, starting at the sampler's.
        options: the per-step rules (:class:`~bigbatch.StepOptions`), or as keywords.
        log: log the step's metrics as ``bigbatch/<name>`` (:mod:`bigbatch.sinks`).
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        controller: Controller | None = None,
        *,
        options: StepOptions | None = None,
        log: bool = True,
        **step_options: Any,
    ) -> None:
        self.driver = StepDriver(sampler, controller, options, **step_options)
        self.sampler = sampler
        self.log = log
        self._rng: dict[str, Any] | None = None  # a checkpoint's random state, to restore
        self._done = 0  # the step's micro-batches so far, the one under way included
        self._backwards = 0  # the step's backward passes so far

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.sampler.max_samples is None:
            # the loader's len() would raise: Lightning reads it as unsized and draws a
            # batch ahead, so that each new batch size would apply a step late
            raise ValueError(
                "the sampler needs max_samples: the budget is in samples (Trainer's max_steps "
                "may still end the run before it)"
            )
        if trainer.accumulate_grad_batches != self.sampler.micro_batches:
            raise ValueError(
                f"accumulate_grad_batches ({trainer.accumulate_grad_batches}) must equal the "
                f"sampler's micro_batches ({self.sampler.micro_batches})"
            )
        self.sampler.rank, self.sampler.world_size = trainer.global_rank, trainer.world_size

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # (configure_optimizers returning None: Lightning trains with a stand-in of no params)
        optimizers = [o for o in trainer.optimizers if o.param_groups]
        if len(optimizers) != 1 or len(trainer.optimizers) != 1:
            raise ValueError(
                f"AdaptiveBatchCallback supports exactly one optimizer, got {len(optimizers)}"
            )
        loader = trainer.train_dataloader
        if isinstance(loader, torch.utils.data.DataLoader):
            self.driver.check_data(loader.dataset, loader.batch_sampler)
        optimizer = trainer.optimizers[0]
        _warn_of_whole_run_intervals(trainer)
        # the model: its world, and the layers the per-example statistics hook
        # 16-mixed: the gradients are read scaled (the decision comes before its unscale),
        # and an overflow the engine skips must lower the scale
        self.driver.attach(
            optimizer,
            trainer.strategy.model if trainer.world_size > 1 else pl_module,
            _scaler(trainer),
        )
        # restored right after the step: Lightning steps its schedulers before
        # on_train_batch_end
        optimizer.register_step_post_hook(
            lambda opt, args, kwargs: self.driver.after_optimizer_step()
        )
        if self._rng is not None:  # Lightning restores none: dropout's draws would differ
            set_rng_state(self._rng)
            self._rng = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        k = self.sampler.micro_batches
        if batch_idx % k == 0:
            self.driver.begin()  # Lightning divides losses by k
            self._backwards = 0
        self._done = batch_idx % k + 1
        self.driver.before_backward(batch_idx % k)

    @property
    def _last(self) -> bool:
        # the micro-batch under way is its step's last
        return self._done == self.sampler.micro_batches

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        # under 16-mixed Lightning hands over the loss already multiplied by the GradScaler's
        # scale: the logged loss (and BatchWarmup's loss slope) needs the loss itself
        scaler = _scaler(trainer)
        if scaler is not None:
            loss = loss.detach() / scaler.scale(torch.ones((), device=loss.device))
        self.driver.add_loss(loss)
        self._backwards += 1

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._last:  # the gradients accumulated (reduced under DDP), not yet unscaled
            self.driver.decide()  # (16-mixed) nor clipped: the engine reads them as measured

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if not self._last:  # an epoch cut short: the step was planned, measured, counted whole
            k = self.sampler.micro_batches
            raise RuntimeError(
                f"Lightning stepped the optimizer after {self._done} of its {k} micro-batches "
                "(limit_train_batches or fast_dev_run cut the epoch inside a step): give "
                f"limit_train_batches as a multiple of accumulate_grad_batches ({k}), or "
                "leave the end to the sampler's max_samples"
            )
        if self._backwards != self._done:  # the step's sizes and decision would be off
            raise RuntimeError(
                f"training_step returned None for {self._done - self._backwards} of this "
                f"step's {self._done} micro-batches (Lightning skips their backward, and "
                "steps): with AdaptiveBatchCallback every micro-batch of a step must give a "
                "loss; to skip a batch's learning, return its loss times 0"
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if self._last and self.log:  # after the step: logged at its own (1-based) step
            pl_module.log_dict(tagged(self.driver.history[-1]), on_step=True, on_epoch=False)
        if self._last and self.driver.spent:
            # the sampler's len() is only a bound: Lightning would wait for an epoch's end
            # (and its validation) that never comes
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        done, k = self._done, self.sampler.micro_batches
        if done not in (0, k):  # said as it is saved, not only when it fails to resume
            warn_at_caller(f"AdaptiveBatchCallback: this checkpoint {_inside_a_step(done, k)}")
        # this rank's random state (Lightning saves rank 0's callback state)
        return {**self.driver.state_dict(), "rng": rng_state(), "micro_batches_done": self._done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        k, done = self.sampler.micro_batches, state_dict.get("micro_batches_done", 0)
        if done not in (0, k):  # the sampler and Lightning's batch count would part
            raise ValueError(f"the checkpoint {_inside_a_step(done, k)}")
        self.driver.load_state_dict(state_dict)
        self._rng = state_dict["rng"]


def _inside_a_step(done: int, k: int) -> str:
    return (
        f"was saved inside an optimizer step, after {done} of its {k} micro-batches "
        "(validation every val_check_interval batches, not a multiple of "
        "accumulate_grad_batches, saves there), without the step's partial gradient, and "
        "cannot be resumed: resume from one saved at a step's end (ModelCheckpoint's "
        "every_n_train_steps), and give val_check_interval as a multiple of "
        f"accumulate_grad_batches ({k})"
    )


def _warn_of_whole_run_intervals(trainer: pl.Trainer) -> None:
    # the budget is one Lightning epoch, the loader's length only a bound on its batches
    unfit = ["a scheduler stepped by interval='epoch'"] * any(
        config.interval == "epoch" for config in trainer.lr_scheduler_configs
    )
    interval = trainer.val_check_interval
    if isinstance(interval, float) and interval < 1:
        unfit.append(f"val_check_interval={interval}")
    if unfit:
        warn_at_caller(
            f"AdaptiveBatchCallback trains the sample budget as one epoch, the loader's length "
            f"only a bound: {' and '.join(unfit)} would act once, at its end; step the "
            "scheduler by interval='step', and give val_check_interval in batches (a multiple "
            "of accumulate_grad_batches)"
        )


def _scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The precision plugin's enabled ``GradScaler`` (16-mixed), else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None

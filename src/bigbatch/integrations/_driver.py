"""What every framework plugin does per optimizer step, in one place.

A framework loop runs the micro-batches and the optimizer; the plugin
announces each micro-batch to the statistics, finishes them before the
optimizer step, scales the learning rate around the step, and sets the next
global batch size on the :class:`~bigbatch.batch.GlobalBatchSampler`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..batch.controllers import Controller, SimiGrad
from ..batch.lr import Schedule, check_lr_rule, lr_factor
from ..batch.sampler import GlobalBatchSampler
from ..dist.world import World
from ..stats.collector import MicroBatchStatistics


class StepDriver:
    """The per-step state and logic shared by the Lightning and Hugging Face plugins."""

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        controller: Controller | None,
        *,
        lr_scaling: str,
        base_batch_size: int | None,
        schedule: Schedule | None,
        similarity: str | None,
        ema_beta: float,
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
        self.stats: MicroBatchStatistics | None = None
        self.step = 0
        self.samples = 0
        #: one dict per optimizer step: batch_size, similarity, noise_scale, lr_factor, loss, ...
        self.history: list[dict[str, float]] = []
        self.loss: torch.Tensor | None = None  # this rank's share of the step's loss
        self._finished: dict[str, float] | None = None
        self._saved_lrs: list[float] | None = None
        self._plan: list[list[int]] = []
        self._pending: dict[str, Any] | None = None

    def attach(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
        """Build the statistics over ``optimizer``'s groups (``model``: the DDP model, if any)."""
        world = World.of(model) if model is not None else World()
        if world.distributed and self.similarity == "split":
            raise ValueError("similarity='split' under DDP needs AdaptiveBatch; use 'scalar'")
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

    def begin(self, loss_weights: list[float] | None) -> None:
        """The step's first micro-batch is next."""
        assert self.stats is not None, "attach() first"
        if self.step not in self.sampler.plans:
            raise RuntimeError(
                f"step {self.step}'s plan is gone: the loader drew more than "
                f"{self.sampler.PLAN_WINDOW} steps ahead (use fewer workers or a smaller "
                "prefetch_factor)"
            )
        self._plan = self.sampler.plans[self.step]
        self.stats.begin(self._plan[self.sampler.rank], self._plan, loss_weights=loss_weights)
        self.loss, self._finished = None, None

    def before_backward(self, index: int) -> None:
        assert self.stats is not None
        self.stats.before_backward(index)

    def add_loss(self, share: torch.Tensor) -> None:
        """This micro-batch's weighted loss, as backpropagated (for the logged batch loss)."""
        share = share.detach()
        self.loss = share if self.loss is None else self.loss + share

    def finish(self) -> None:
        """The step's statistics; call once the gradients are accumulated, before clipping."""
        if self._finished is None:
            assert self.stats is not None
            self._finished = self.stats.finish(loss=self.loss).as_floats()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Scale the LR for this step and choose the next batch size; the step's metrics."""
        # a GradScaler that skipped the last optimizer.step also skipped its post-hook:
        # undo that step's scaling first, so it never compounds
        self.restore_lr(optimizer)
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
        return metrics

    def restore_lr(self, optimizer: torch.optim.Optimizer) -> None:
        """Right after the optimizer step: the unscaled learning rates again."""
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict(step=self.step),  # loaders draw ahead
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


class DriverView:
    """What a plugin exposes of its :class:`StepDriver` (``self.driver``)."""

    driver: StepDriver

    @property
    def history(self) -> list[dict[str, float]]:
        """One dict per optimizer step: batch_size, similarity, noise_scale, lr_factor, ..."""
        return self.driver.history

    @property
    def samples(self) -> int:
        """Samples trained on so far (all ranks)."""
        return self.driver.samples

"""What every framework plugin does per optimizer step: hand the framework's hooks to
the :class:`~bigbatch.engine.StepEngine` and set the next batch on the sampler."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..assembly import resolve_controller
from ..batch.controllers import Controller
from ..batch.sampler import GlobalBatchSampler
from ..engine import StepEngine, StepResult
from ..options import StepOptions


class StepDriver:
    """The engine of one plugin, built when the framework hands over its optimizer.

    Args:
        sampler: the train loader's :class:`~bigbatch.batch.GlobalBatchSampler`.
        controller: chooses the batch sizes, starting at the sampler's batch (default
            :class:`~bigbatch.batch.BatchWarmup` from there).
        options: the per-step rules (:class:`~bigbatch.StepOptions`), or as keywords.
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        controller: Controller | None = None,
        options: StepOptions | None = None,
        **step_options: Any,
    ) -> None:
        if not isinstance(sampler, GlobalBatchSampler):
            raise TypeError(
                f"sampler must be a bigbatch GlobalBatchSampler, got {type(sampler).__name__}"
            )
        self.sampler = sampler
        self.options = StepOptions.of(options, **step_options)
        self.controller = resolve_controller(controller, sampler.batch_size)
        sampler.min_batch_size = max(sampler.min_batch_size, self.controller.min)
        self.engine: StepEngine | None = None
        #: one dict per optimizer step: batch_size, similarity, noise_scale, lr_factor, loss, ...
        self.history: list[dict[str, float]] = []
        self._result: StepResult | None = None
        self._pending: dict[str, Any] | None = None

    def check_data(self, dataset: Any, batch_sampler: Any) -> None:
        """A ``ValueError`` where the loader does not draw with this sampler, or its size."""
        # (a dataset of another size: an IndexError mid-run before)
        if batch_sampler is not self.sampler:
            raise ValueError(
                f"the train loader draws its batches with {type(batch_sampler).__name__}, not "
                "the plugin's GlobalBatchSampler: pass DataLoader(dataset, "
                "batch_sampler=sampler) (and, under Lightning, use_distributed_sampler=False)"
            )
        size = len(dataset) if hasattr(dataset, "__len__") else None
        if size is not None and size != self.sampler.dataset_size:
            raise ValueError(
                f"the sampler draws from {self.sampler.dataset_size} samples, the train "
                f"dataset has {size}: build the GlobalBatchSampler with len(dataset)"
            )

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Build the engine over ``optimizer`` (``model``: the module or its DDP wrapper)."""
        # scaler: the framework's fp16 one (the gradients are read scaled, its scale divided out)
        self.engine = StepEngine.build(
            optimizer,
            self.controller,
            self.options,
            scaler=scaler,
            model=model,
            sub_batches=self.sampler.micro_batches,
            dataset_size=self.sampler.dataset_size,
            registers_hooks=False,  # the framework wraps the model and owns its comm hook
        )
        if self._pending is not None:
            self.engine.load_state_dict(self._pending)
            self._pending = None

    @property
    def attached(self) -> StepEngine:
        if self.engine is None:
            raise RuntimeError("the plugin's engine is not attached to an optimizer yet")
        return self.engine

    @property
    def samples(self) -> int:
        return self.attached.samples if self.engine is not None else 0

    @property
    def spent(self) -> bool:
        # whether the sampler's max_samples are trained on (the budget is in samples)
        budget = self.sampler.max_samples
        return budget is not None and self.samples >= budget

    def begin(self, loss_weights: list[float] | None = None) -> None:
        """The step's first micro-batch is next (the framework weights losses itself: by
        ``loss_weights`` of each micro-batch's mean loss, else by 1/k of each loss)."""
        engine = self.attached
        step = engine.steps_taken
        if step not in self.sampler.plans:
            raise RuntimeError(
                f"step {step}'s plan is gone: the loader drew more than "
                f"{self.sampler.PLAN_WINDOW} steps ahead (use fewer workers or a smaller "
                "prefetch_factor)"
            )
        plan = self.sampler.plans[step]
        if loss_weights is None:
            # 1/k of each loss: of a summed one, b_i/k of its mean (the statistics take mean
            # gradients; read as 1/k, their norms came b_i² too large)
            k = len(plan.sizes)
            summed = self.options.loss_reduction == "sum"
            loss_weights = [(b if summed else 1) / k for b in plan.sizes]
        engine.begin(plan, loss_weights=loss_weights)
        self._result = None

    def before_backward(self, index: int) -> None:
        self.attached.before_backward(index)

    def add_loss(self, weighted: torch.Tensor) -> None:
        """This micro-batch's loss as backpropagated (weighted), for the logged batch loss."""
        self.attached.add_loss(weighted)

    def decide(self) -> dict[str, float]:
        """The engine's decision, once per step after accumulation and before clipping; a
        skipped (non-finite) step drops the gradients."""
        if self._result is None:
            engine = self.attached
            self._result = engine.before_optimizer_step()
            if self._result.skip:
                _drop_gradients(engine)
            self.sampler.batch_size = engine.batch_size
            self.history.append(self._result.metrics)
        return self._result.metrics

    def after_optimizer_step(self) -> None:
        """After the optimizer step: the rates restored as the user's scheduler set them."""
        if self.engine is not None:
            self.engine.after_optimizer_step(self._result)

    def state_dict(self) -> dict[str, Any]:
        engine = self.attached
        # loaders draw ahead: the sampler is saved as of the steps trained
        return {
            "sampler": self.sampler.state_dict(step=engine.steps_taken),
            "engine": engine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.engine is not None:
            self.engine.load_state_dict(state["engine"])
        else:  # the optimizer arrives later
            self._pending = state["engine"]


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


def _drop_gradients(engine: StepEngine) -> None:
    """A skipped step's gradients dropped before the framework steps (NaN under a scaler)."""
    # under the framework's fp16 GradScaler made NaN: the scaler skips the step and lowers
    # its scale as for any overflow (with no gradient at all its step would assert)
    if engine.scaler is None:
        engine.optimizer.zero_grad(set_to_none=True)
        return
    for group in engine.optimizer.param_groups:  # (a rare step: one fill a tensor)
        for p in group["params"]:
            if p.grad is not None:
                p.grad.fill_(math.nan)

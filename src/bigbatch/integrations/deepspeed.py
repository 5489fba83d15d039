"""Adaptive batching inside a DeepSpeed engine (ZeRO stages 0, 1 and 2): the plain loop
with the engine in place of the model and optimizer. Each rank estimates the noise
from its own micro-batches. ZeRO-3, pipelines, fp16, a DeepSpeed scheduler, VRGD,
AGVM and, under ZeRO 1-2, the layer-wise optimizers are refused (docs/deepspeed.md)."""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset, IterableDataset

from ..assembly import FrameworkStep
from ..batch.controllers import Controller
from ..engine import StepEngine, StepResult
from ..loop import AdaptiveBatch, _check_loadable
from ..optim._base import BigBatchOptimizer
from ..optim.wrapper import StatisticsWrapper
from ..options import StepOptions
from ..parallel.world import World
from ..state import rng_state, set_rng_state

__all__ = ["CLIENT_STATE_KEY", "AdaptiveBatchDeepSpeed", "client_optimizer"]

#: where the loop's state lives in a DeepSpeed checkpoint's ``client_state``
CLIENT_STATE_KEY = "bigbatch"


def client_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The optimizer given to ``deepspeed.initialize``, inside DeepSpeed's wrappers."""
    optimizer = engine.optimizer
    while isinstance(optimizer, deepspeed.runtime.base_optimizer.DeepSpeedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class AdaptiveBatchDeepSpeed(AdaptiveBatch):
    """Adaptive batch sizes for a loop around a ``deepspeed.initialize`` engine.

    Args:
        engine: the ``DeepSpeedEngine``, built with ``managed_gradient_accumulation``
            false, ZeRO stage 0, 1 or 2, fp32 or bf16, and no DeepSpeed scheduler.
        dataset: a map-style dataset or an ``IterableDataset``.
        controller: from ``bigbatch.batch`` (default :class:`~bigbatch.batch.BatchWarmup`).
        options: the per-step rules (:class:`~bigbatch.StepOptions`), or as keywords.
        min_sub_batches: the fewest micro-batches per rank per step (≥ 2).
        seed, shuffle, weight_fn, loader_options: as for :class:`~bigbatch.AdaptiveBatch`.

    A non-finite step is dropped, as in the plain loop.
    """

    checks_optimizer = False  # ZeRO's optimizer holds its own (flat) parameters

    def __init__(  # noqa: PLR0913 - a user-facing loop: every option is a keyword
        self,
        engine: Any,
        dataset: Dataset | IterableDataset,
        *,
        controller: Controller | None = None,
        options: StepOptions | None = None,
        min_sub_batches: int = 2,
        seed: int = 0,
        shuffle: bool = True,
        weight_fn: Any = None,
        loader_options: dict[str, Any] | None = None,
        **step_options: Any,
    ) -> None:
        check_engine(engine)
        optimizer = client_optimizer(engine)
        check_client_optimizer(engine, optimizer)
        if min_sub_batches < 2:
            raise ValueError(
                f"min_sub_batches must be at least 2 under DeepSpeed (the noise is estimated "
                f"within each rank), got {min_sub_batches}"
            )
        self.deepspeed = engine
        #: ZeRO stage (0, 1 or 2)
        self.stage = engine.zero_optimization_stage()
        super().__init__(
            engine,
            optimizer,
            dataset,
            controller=controller,
            options=options,
            max_micro_batch=engine.train_micro_batch_size_per_gpu(),
            min_sub_batches=min_sub_batches,
            weight_fn=weight_fn,
            seed=seed,
            shuffle=shuffle,
            loader_options=loader_options,
            **step_options,
        )

    def _build_engine(
        self, controller: Controller | None, options: StepOptions, dataset_size: int | None
    ) -> StepEngine:
        engine = self.deepspeed
        group = engine.data_parallel_group
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        world = World(dist.get_rank(group), size, group) if size > 1 else World()
        framework = FrameworkStep(
            world,
            [[p for p in engine.module.parameters() if p.requires_grad]],
            # ZeRO-2 reduces each micro-batch's gradient into its partitions and frees .grad
            grad_accumulates=not engine.zero_optimization_partition_gradients(),
        )
        return StepEngine.build(
            self.optimizer,
            controller,
            options,
            sub_batches=self.min_sub_batches,
            dataset_size=dataset_size,
            framework=framework,
        )

    def _backward(self, loss: Tensor, retain_graph: bool) -> None:
        # the loss is already weighted W·b_i/B: DeepSpeed must not divide it by its
        # accumulation steps as well
        self.deepspeed.backward(loss, retain_graph=retain_graph, scale_wrt_gas=False)

    def _check_clip(self, max_grad_norm: float) -> None:
        raise ValueError(
            "under DeepSpeed the gradient is clipped by its config's gradient_clipping, "
            f"inside its step: apply() takes no max_grad_norm (got {max_grad_norm})"
        )

    def _optimizer_step(self, max_grad_norm: float | None = None) -> StepResult:
        # (max_grad_norm: always None, any other refused by _check_clip)
        result = self.engine.before_optimizer_step()
        if result.skip:  # non-finite: left without an update (the engine counted it skipped)
            self._drop_gradient()
            return result
        batch = int(result.metrics["batch_size"])
        if batch % (self.max_micro_batch * self.world.size) == 0:
            self.deepspeed.set_train_batch_size(batch)  # its train_batch_size() and logs
        try:
            self.deepspeed.step()
        finally:
            self.engine.after_optimizer_step(result)
        return result

    def _drop_gradient(self) -> None:
        # stages 0-1 reduce inside engine.step(): until then the gradients are this rank's
        # own, in .grad (and ZeRO-1's grad_accum); stage 2 has reduced each micro-batch's into
        # buffers it sums them in until then. Clearing both drops the step. (The client
        # optimizer's zero_grad would miss them: under ZeRO and bf16 it holds DeepSpeed's
        # fp32 copies, whose .grad an offloaded optimizer needs.)
        self.deepspeed.zero_grad()
        if self.stage >= 1:
            self.deepspeed.optimizer.zero_grad(set_to_none=True)
        if self.stage == 2:
            _forget_reduced_gradient(self.deepspeed)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The loop's part of a checkpoint (a collective); see :meth:`save_checkpoint`."""
        self._check_between_steps()
        return {
            "source": self.source.state_dict(),
            "engine": self.engine.state_dict(),
            "rng": self.world.all_gather_object(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_loadable(state, self.engine.controller, needed=())  # (DeepSpeed holds the rest)
        self.source.check_state(state["source"])
        self._drop_gradient()  # a step under way (one that raised, say) is abandoned
        self._mid_step = False
        self.source.load_state_dict(state["source"])
        self.engine.load_state_dict(state["engine"])
        saved = state["rng"]
        set_rng_state(saved[self.world.rank % len(saved)])

    def save_checkpoint(self, save_dir: str, tag: str | None = None) -> None:
        """``engine.save_checkpoint`` with the loop's state as ``client_state`` (every rank)."""
        self.deepspeed.save_checkpoint(
            save_dir, tag=tag, client_state={CLIENT_STATE_KEY: self.state_dict()}
        )

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> None:
        """Restore the model, optimizer and loop saved by :meth:`save_checkpoint`."""
        path, client_state = self.deepspeed.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {load_dir!r} (tag {tag!r})")
        if not client_state or CLIENT_STATE_KEY not in client_state:
            raise ValueError(
                f"the DeepSpeed checkpoint {path!r} holds no bigbatch state: it was not "
                "saved by AdaptiveBatchDeepSpeed.save_checkpoint"
            )
        self.load_state_dict(client_state[CLIENT_STATE_KEY])


def _forget_reduced_gradient(engine: Any) -> None:
    # drop what ZeRO-2 has reduced of an unfinished step's micro-batches. DeepSpeed has no
    # call for it: these are the buffers its stage_1_and_2.py accumulates them in until
    # step() in unmanaged mode, as of 0.19 (tests/integrations/test_deepspeed.py holds them)
    zero = engine.optimizer
    zero.all_grad_tensors = {}
    zero.averaged_gradients = {}
    if engine.zero_cpu_offload():
        zero.accumulated_grads_in_cpu = {}
        zero._offload_accumulated_param_ids.clear()
    engine._unmanaged_backward_count = 0


def check_engine(engine: Any) -> None:
    """One error naming the first setting of ``engine`` the loop cannot work with."""
    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise TypeError(
            f"engine must be the DeepSpeedEngine from deepspeed.initialize, got "
            f"{type(engine).__name__}"
        )
    if isinstance(engine, deepspeed.PipelineEngine):
        raise ValueError(
            "pipeline parallelism is not supported: DeepSpeed's pipeline engine runs its own "
            "micro-batch schedule (train_batch), so the batch cannot change per step"
        )
    stage = engine.zero_optimization_stage()
    if stage > 2:
        raise ValueError(
            f"ZeRO stage {stage} is not supported (stages 0-2 are): stage 3 partitions the "
            "parameters between forward passes, and the micro-batch gradients reach no hook whole"
        )
    if engine.managed_gradient_accumulation():
        raise ValueError(
            'set "managed_gradient_accumulation": false in the DeepSpeed config: bigbatch '
            "ends each step after the micro-batches of the batch it chose, which DeepSpeed's "
            "fixed accumulation counter would not follow"
        )
    if engine.fp16_enabled():
        raise ValueError(
            "fp16 is not supported: DeepSpeed applies its dynamic loss scale inside its own "
            "backward, where the statistics cannot divide it out; use bf16"
        )
    if engine.lr_scheduler is not None:
        raise ValueError(
            "a DeepSpeed scheduler is not supported: it would step inside engine.step() on "
            "the rates scaled for the batch; give the schedule in samples instead "
            "(schedule=bigbatch.schedules.warmup_cosine(...))"
        )


def check_client_optimizer(engine: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a statistics wrapper, and a layer-wise optimizer under ZeRO 1-2."""
    if isinstance(optimizer, StatisticsWrapper):
        raise ValueError(
            f"{type(optimizer).__name__} is not supported under DeepSpeed: it reads the "
            "step's per-parameter statistics (the GSNR, or per-group noise) from the reduced "
            "gradient, which DeepSpeed forms only inside engine.step(); use "
            "bigbatch.AdaptiveBatch with DDP for it"
        )
    if not isinstance(optimizer, BigBatchOptimizer):
        return
    model_shapes = sorted(tuple(p.shape) for p in engine.module.parameters() if p.requires_grad)
    optimizer_shapes = sorted(
        tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
    )
    if model_shapes != optimizer_shapes:
        raise ValueError(
            f"{type(optimizer).__name__} works on whole parameter tensors (a layer-wise trust "
            "ratio), but DeepSpeed hands it flat "
            f"partitions here (ZeRO stage {engine.zero_optimization_stage()}"
            f"{', bf16' if engine.bfloat16_enabled() else ''}); use ZeRO stage 0 in fp32 "
            "for it, or an element-wise optimizer (AdamW, SGD, DeepSpeed's FusedAdam)"
        )

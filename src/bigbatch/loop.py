"""The plain-PyTorch entry point: adaptive batching around your own training loop::

    loop = bb.AdaptiveBatch(model, optimizer, dataset, max_micro_batch=256)
    for step in loop.steps(max_samples=2_000_000):
        for x, y in step.micro_batches():
            step.backward(loss_fn(model(x), y))   # scales the loss, collects statistics
        step.apply()                              # LR for the batch, optimizer step, next size

docs/adaptive_batching.md.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, IterableDataset

from ._checks import check_number, check_param_groups, positive_int, whole_number
from ._warn import warn_at_caller
from .batch.controllers import Controller
from .batch.plan import MAX_MICRO_BATCH, StepPlan, plan_step
from .batch.source import make_source
from .engine import NonFiniteError, StepEngine, StepResult, back_off
from .optim.wrapper import StatisticsWrapper
from .options import StepOptions
from .parallel import ddp, fsdp
from .parallel.hooks import CommHook
from .state import rng_state, set_rng_state
from .stats.halves import SplitMicroBatches
from .stats.result import GradientStats

__all__ = ["AdaptiveBatch", "NonFiniteError", "Step"]


class Step:
    """One optimizer step of :class:`AdaptiveBatch` (``index`` and ``samples``: before it)."""

    def __init__(self, loop: AdaptiveBatch, plan: StepPlan) -> None:
        self._loop = loop
        self.plan = plan
        self.index = loop.engine.steps_taken
        self.samples = loop.engine.samples
        self._backwards = 0
        self._applied = False
        #: the step's gradient statistics (after ``apply``); None without statistics
        self.stats: GradientStats | None = None
        #: what ``apply`` measured and decided, as floats (for logging)
        self.metrics: dict[str, float] = {}

    @property
    def batch_size(self) -> int:
        """The global batch of this step (all ranks), in samples (or weight)."""
        return self.plan.batch_size

    @property
    def sizes(self) -> tuple[int, ...]:
        """This rank's micro-batch sizes in samples (or weight, with ``weight_fn``)."""
        return self.plan.sizes

    @property
    def rank_sizes(self) -> tuple[tuple[int, ...], ...]:
        """Every rank's micro-batch sizes (``(sizes,)`` on one process)."""
        return self.plan.rank_sizes

    @property
    def indices(self) -> list[list[int]]:
        """This rank's micro-batches as indices (into the drawn batch for an iterable)."""
        return [list(b) for b in self.plan.micro_batches]

    def micro_batches(self) -> Iterator[Any]:
        """The step's micro-batches, collated; under DDP all but the last inside ``no_sync()``."""
        last = len(self.plan.micro_batches) - 1
        micro_batches = [list(b) for b in self.plan.micro_batches]
        batches = self._loop.source.load(micro_batches, rank=self._loop.world.rank)
        for i, batch in enumerate(batches):
            with ddp.accumulating(self._loop.model, i == last):
                yield batch

    def backward(self, loss: Tensor, *, retain_graph: bool = False) -> None:
        """Backward of the micro-batch's mean (or summed) loss, weighted for the batch mean."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"backward takes the micro-batch's loss tensor, got {loss!r}")
        if loss.numel() != 1:
            raise ValueError(
                f"backward takes the micro-batch's loss as one number (its mean or sum), got "
                f"a tensor of shape {tuple(loss.shape)} (a loss with reduction='none'?)"
            )
        if self._applied:
            raise RuntimeError(f"step {self.index} was applied: backward comes before apply()")
        count = len(self.plan.sizes)
        if self._backwards >= count:
            raise RuntimeError(
                f"step {self.index} has {count} micro-batch{'es' if count > 1 else ''}; "
                "backward was called more often: call it once per micro-batch, with the sum of "
                "that micro-batch's losses (step.backward(loss_a + loss_b))"
            )
        engine, index = self._loop.engine, self._backwards
        engine.before_backward(index)
        weight = engine.loss_weight(index)
        if weight != 1.0:  # one micro-batch of a mean loss: nothing to scale
            loss = loss * weight
        engine.add_loss(loss)
        self._loop._backward(loss, retain_graph)
        self._backwards += 1

    def apply(self, max_grad_norm: float | None = None) -> None:
        """Optimizer step at the batch's rate, then the next size; ``max_grad_norm`` clips after
        the statistics read the gradient (``asynchronous``: the step before's metrics)."""
        if max_grad_norm is not None:  # (refused before the step is spent: apply() again)
            self._loop._check_clip(max_grad_norm)
        if self._applied:
            raise RuntimeError(f"step {self.index} was already applied")
        if self._backwards != len(self.plan.sizes):
            raise RuntimeError(
                f"step {self.index} has {len(self.plan.sizes)} micro-batches but backward ran "
                f"{self._backwards} times"
            )
        self._applied = True
        self._loop._unapplied = self._loop._mid_step = False
        result = self._loop._optimizer_step(max_grad_norm)
        self.stats, self.metrics = result.stats, result.metrics


class AdaptiveBatch:
    """Adaptive batch sizes for a plain PyTorch loop, on one process or under DDP.

    Each step draws a global batch, splits it into micro-batches, measures the gradient
    statistics, steps the optimizer at the batch's rate and asks the controller for the next
    size; under DDP every rank draws the same batch and trains its shard (docs/distributed.md).

    Args:
        model: the module being trained, or its ``DistributedDataParallel``.
        optimizer: any ``torch.optim.Optimizer``.
        dataset: a map-style dataset (exact resume) or an ``IterableDataset``.
        controller: from ``bigbatch.batch``; default :class:`~bigbatch.batch.BatchWarmup`.
        max_micro_batch: the largest micro-batch that fits in memory.
        min_sub_batches: the fewest micro-batches of a measuring step (default: as needed).
        options: the per-step rules (:class:`~bigbatch.StepOptions`), or as keywords.
        scaler: a ``torch.amp.GradScaler`` to scale losses and step through.
        comm_hook: a DDP ``(state, hook)`` pair, registered and saved by the loop.
        weight_fn: count the batch in weight (e.g. tokens) of sample ``i``.
        seed, shuffle: the sampler's permutation.
        loader_options: ``DataLoader`` keywords (``collate_fn``, ``num_workers``, ...).
    """

    #: refuse an optimizer that holds none of the model's parameters (DeepSpeed's holds
    #: its own flat copies)
    checks_optimizer = True

    def __init__(  # noqa: PLR0913 - a user-facing loop: every option is a keyword
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset | IterableDataset,
        *,
        controller: Controller | None = None,
        options: StepOptions | None = None,
        max_micro_batch: int = MAX_MICRO_BATCH,
        min_sub_batches: int | None = None,
        scaler: torch.amp.GradScaler | None = None,
        comm_hook: tuple[Any, CommHook] | None = None,
        weight_fn: Callable[[int], int] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        loader_options: dict[str, Any] | None = None,
        **step_options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {model!r}")
        if self.checks_optimizer:
            _check_optimizer_trains(model, optimizer)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {scaler!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.max_micro_batch = positive_int("max_micro_batch", max_micro_batch)
        self.min_sub_batches = (
            None if min_sub_batches is None else positive_int("min_sub_batches", min_sub_batches)
        )
        loader = dict(loader_options or {})
        # the loader is iterated once a step: workers not kept would start again every step
        loader["persistent_workers"] = (
            loader.get("persistent_workers", True) and loader.get("num_workers", 0) > 0
        )
        self.source = make_source(
            dataset, shuffle=shuffle, seed=seed, weight_fn=weight_fn, loader_options=loader
        )
        self.comm_hook = comm_hook
        #: the per-step rules: statistics, learning rate, controller, counters
        self.engine = self._build_engine(
            controller,
            StepOptions.of(options, **step_options),
            # a batch counted in weight is not a fraction of the dataset's samples
            dataset_size=None if weight_fn else self.source.dataset_size,
        )
        self.world = self.engine.world
        self.min_sub_batches = self.engine.sub_batches
        # ranks built unalike part silently (other batches, other micro-batch counts): one
        # collective here says which setting differs
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        alike = {
            "controller": self.engine.controller,
            "max_micro_batch": self.max_micro_batch,
            "min_sub_batches": self.min_sub_batches,
            "seed": seed,
            "shuffle": shuffle,
            "optimizer": type(optimizer).__name__,
            "param_groups": groups,
            "dataset_size": self.source.dataset_size,
            **self.engine.options.as_dict(),
        }
        self.world.check_alike(alike, "AdaptiveBatch")
        # the last step yielded was not applied (a flag, not the step: a step holds its loop);
        # set at the start too: a gradient left on the model (another loop's step broken off)
        # is not this loop's first step's
        self._unapplied = True
        # a step's batch drawn and the step not yet applied: no state to save (below)
        self._mid_step = False
        self._closed = False
        #: the statistics collector (None with ``statistics=False``)
        self.collector = self.engine.collector
        # close()'s work, also done when the loop is collected: dropped unclosed, its gradient
        # hooks held its collector, a gradient's worth of memory, as long as the model lived
        self._release = weakref.finalize(self, _release, self.collector, self.source)
        self._halves_by_micro_batch = (
            isinstance(getattr(self.collector, "halves", None), SplitMicroBatches)
            and self.source.weight_fn is None
        )

    def _build_engine(
        self, controller: Controller | None, options: StepOptions, dataset_size: int | None
    ) -> StepEngine:
        return StepEngine.build(
            self.optimizer,
            controller,
            options,
            model=self.model,
            sub_batches=self.min_sub_batches,
            dataset_size=dataset_size,
            comm_hook=self.comm_hook,
            scaler=self.scaler,
            weighted=self.source.weight_fn is not None,
        )

    def _backward(self, loss: Tensor, retain_graph: bool) -> None:
        """Backpropagate a weighted micro-batch loss (a framework's engine may do it)."""
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward(retain_graph=retain_graph)

    # ------------------------------------------------------------ what the engine counts

    @property
    def batch_size(self) -> int:
        """The global batch size of the next step."""
        return self.engine.batch_size

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken so far (skipped non-finite ones included)."""
        return self.engine.steps_taken

    @property
    def samples(self) -> int:
        """Samples (or weight) of the steps taken so far, skipped ones too, all ranks."""
        return self.engine.samples

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was dropped for a non-finite gradient or loss."""
        return self.engine.skipped_steps

    # ------------------------------------------------------------ iteration

    def steps(self, max_samples: int | None = None, max_steps: int | None = None) -> Iterator[Step]:
        """Yield steps until ``max_samples`` samples or ``max_steps`` steps are done."""
        if self._closed:  # its statistics' hooks are off the model: they would measure nothing
            raise RuntimeError("the loop was closed (close()): build a new one to train on")
        if max_samples is None and max_steps is None:
            raise ValueError("give max_samples or max_steps")
        if max_samples is not None:
            max_samples = whole_number("max_samples", max_samples)
        if max_steps is not None:
            max_steps = whole_number("max_steps", max_steps)
        while (max_samples is None or self.samples < max_samples) and (
            max_steps is None or self.steps_taken < max_steps
        ):
            if self._unapplied:
                # a step left unapplied (a break before apply()): its gradient is dropped,
                # or the next step would add to it
                self._drop_gradient()
            step = Step(self, self._plan(self.batch_size))
            self._unapplied = self._mid_step = True
            self.engine.begin(step.plan)
            yield step
            if not step._applied:
                raise RuntimeError(f"step {step.index} was not applied: call step.apply()")

    def _plan(self, batch_size: int) -> StepPlan:
        """Draw the global batch and plan every rank's micro-batches (the same on all ranks)."""
        fewest = self.engine.next_sub_batches
        return plan_step(
            self.source.draw(batch_size),
            rank=self.world.rank,
            world_size=self.world.size,
            max_micro_batch=self.max_micro_batch,
            min_sub_batches=fewest,
            weight_fn=self.source.weight_fn,
            # a measured step's split similarity takes the micro-batches' two halves
            even=self._halves_by_micro_batch and fewest > 1,
        )

    def _optimizer_step(self, max_grad_norm: float | None = None) -> StepResult:
        try:
            result = self.engine.before_optimizer_step()
            ddp.settle_hook(self.comm_hook, applied=not result.skip)
            if result.overflowed:  # skipped here, not by the scaler's step: lowered here
                back_off(self.scaler)
            if not result.skip:
                scaled = self.scaler is not None and self.scaler.is_enabled()
                if scaled and result.found_inf is not None:  # the scaler checks the gradients
                    # only; before the clip's unscale_, which records what the step will read
                    _poison_where_found_inf(self.optimizer, result.found_inf)
                if max_grad_norm is not None:
                    self._clip(max_grad_norm)
                if scaled:
                    assert self.scaler is not None
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                elif result.found_inf is not None:
                    _step_unless_found_inf(self.optimizer, result.found_inf)
                else:
                    self.optimizer.step()
            self.engine.after_optimizer_step(result)
        finally:
            # a step that raised (NonFiniteError, or in the optimizer's own step: an interrupt)
            # leaves no gradient for the next to add to, and no scaled rate for a checkpoint
            self.engine.restore_rates()
            self.optimizer.zero_grad(set_to_none=True)
        return result

    def _check_clip(self, max_grad_norm: float) -> None:
        # (a framework that clips inside its own step refuses any)
        check_number("max_grad_norm", max_grad_norm, low_open=True)

    def _drop_gradient(self) -> None:
        # where the gradient of a step left unapplied lives (a framework's loop overrides it)
        self.optimizer.zero_grad(set_to_none=True)

    def flush(self) -> dict[str, float]:
        """With ``asynchronous=True``, the last step's metrics, read now (``{}``: none)."""
        result = self.engine.flush()
        return result.metrics if result is not None else {}

    def _clip(self, max_norm: float) -> None:
        """Clip the gradient's total norm, unscaled first under a ``GradScaler`` (no read)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, loadable with ``weights_only=True``. Under DDP a
        collective; under FSDP2 gathered whole to rank 0's CPU (save rank 0's)."""
        self._check_between_steps()
        if self.world.sharded:
            model_state, optimizer_state = fsdp.full_state(self.model, self.optimizer)
        else:
            model_state = ddp.unwrap(self.model).state_dict()
            optimizer_state = self.optimizer.state_dict()
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "optimizer_class": _optimizer_class(self.optimizer),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "source": self.source.state_dict(),
            "engine": self.engine.state_dict(),
            "rng": self.world.all_gather_object(rng_state()),
            "comm_hook": ddp.hook_state_dict(self.comm_hook, self.world),
        }

    def _check_between_steps(self) -> None:
        # inside a step the sampler has moved past its batch and the counters have not: a
        # run resumed from such a state would never train on that batch
        if self._mid_step:
            raise RuntimeError(
                f"step {self.steps_taken} is under way (its batch drawn, not applied): save "
                "the loop's state_dict() after step.apply(), where a resumed run starts"
            )

    def close(self) -> None:
        """Take the statistics' hooks off the model and end the loader's workers."""
        self._closed = True
        self._release()
        if self._unapplied:  # a step left unapplied: its gradient goes with the loop
            self._drop_gradient()
            self._unapplied = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: exact on as many processes, else re-sharded."""
        _check_loadable(state, self.engine.controller, ("model", "optimizer", "optimizer_class"))
        own = _optimizer_class(self.optimizer)
        if state["optimizer_class"] != own:  # torch's load takes any optimizer's state by position
            raise ValueError(
                f"the saved optimizer state is {state['optimizer_class']}'s where the loop's "
                f"optimizer is {own}: was it saved with another optimizer?"
            )
        if not self.world.sharded:  # (FSDP2's full state is checked where it is loaded)
            _check_model_fits(state["model"], ddp.unwrap(self.model))
            _check_optimizer_fits(state["optimizer"], self.optimizer)
        self.source.check_state(state["source"])
        # a step under way (one that raised, say) is abandoned: its gradient goes with it
        self._drop_gradient()
        self._mid_step = False
        if self.world.sharded:
            fsdp.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            ddp.unwrap(self.model).load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        _load_scaler(self.scaler, state["scaler"])
        self.source.load_state_dict(state["source"])
        self.engine.load_state_dict(state["engine"])
        saved = state["rng"]
        set_rng_state(saved[self.world.rank % len(saved)])
        ddp.load_hook_state_dict(self.comm_hook, state.get("comm_hook"), self.world)


def _release(collector: Any, source: Any) -> None:
    # what close() and the loop's collection end: the statistics' hooks, the loader's workers
    if collector is not None:
        collector.close()
    if hasattr(source, "close"):
        source.close()


def _load_scaler(scaler: torch.amp.GradScaler | None, saved: dict[str, Any] | None) -> None:
    # a scale on one side only is a change of precision the user should hear of: its scale
    # dropped, or the loop's started again from its initial value (a few skipped steps)
    scaling = scaler is not None and scaler.is_enabled()
    if scaling and saved:
        scaler.load_state_dict(saved)
    elif scaling:
        warn_at_caller(
            "the saved state holds no GradScaler state: the loop's scaler starts again from "
            f"its initial scale {scaler.get_scale():g}"
        )
    elif saved:
        warn_at_caller(
            f"the saved state's GradScaler (scale {saved.get('scale')}) is dropped: the loop "
            "has no enabled scaler"
        )


def _step_unless_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor) -> None:
    """The step, skipped on the device where ``found_inf`` is 1 (as a ``GradScaler`` asks)."""
    _start_sgd_momentum(optimizer)
    optimizer.grad_scale, optimizer.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def _poison_where_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor) -> None:
    # one gradient element made infinite where found_inf is 1, on the device: a GradScaler
    # checks the gradients only (a NaN loss whose gradient is finite would step); its own
    # check now skips the step, and lowers its scale as at an overflow
    _start_sgd_momentum(optimizer)
    grads = (p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
    grad = next(grads, None)
    if grad is not None:  # (no gradient at all: nothing to step)
        infinity = torch.where(found_inf.to(grad.device) > 0, torch.inf, 0.0)
        grad[(0,) * grad.dim()].add_(infinity.to(grad.dtype))  # 0 added elsewhere: unchanged


def _start_sgd_momentum(optimizer: torch.optim.Optimizer) -> None:
    # torch's fused SGD starts its momentum uninitialised (empty_like) and, where that first
    # step is skipped by found_inf, keeps it so: zeros give the same first step (no dampening)
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group["momentum"]:
                for p in group["params"]:
                    if optimizer.state[p].get("momentum_buffer") is None:
                        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _check_optimizer_trains(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` when ``optimizer`` holds none of ``model``'s parameters (others beside
    them, a loss's own, are allowed); ``TypeError`` when it is not an optimizer."""
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(
            "optimizer must be a torch optimizer built from the model's parameters "
            f"(bigbatch.optim.create_optimizer(model, 'lamb', lr=...)), got {optimizer!r:.80}"
        )
    try:
        step = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a signature Python can read
        step = None
    if step is not None and step.default is inspect.Parameter.empty:
        raise TypeError(
            f"{type(optimizer).__name__}.step needs a closure (it evaluates the loss itself), "
            "but a step of the loop is one optimizer.step() on the gradient the micro-batches "
            "summed: use an optimizer without one"
        )
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and own and not any(id(p) in own for p in held):
        raise ValueError(
            "the optimizer holds none of the model's parameters (built from another "
            "model?): build it from model.parameters()"
        )


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    # the class with the wrapped optimizer's, as a checkpoint names it: "VRGD(LAMB)"
    if isinstance(optimizer, StatisticsWrapper):
        return f"{type(optimizer).__name__}({_optimizer_class(optimizer.base)})"
    return type(optimizer).__name__


def _check_model_fits(saved: Any, model: nn.Module) -> None:
    # torch's load_state_dict copies every entry that fits before it raises for those that
    # do not: checked whole first, nothing is loaded from another model's state
    own = model.state_dict()
    if not isinstance(saved, dict):
        raise ValueError("the saved model state is not a state_dict")
    shape = lambda v: getattr(v, "shape", None)  # noqa: E731 (an extra state has none)
    unfit = [k for k in own if k not in saved or shape(saved[k]) != shape(own[k])]
    unfit += [k for k in saved if k not in own]
    if unfit:
        raise ValueError(
            f"the saved model state does not fit the loop's model ({len(unfit)} entries "
            f"missing, extra or of another shape: {', '.join(unfit[:3])}"
            f"{', ...' if len(unfit) > 3 else ''}): was it saved with another model?"
        )


def _check_optimizer_fits(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """The ``ValueError`` torch's ``load_state_dict`` would raise half-way through a load."""
    while isinstance(optimizer, StatisticsWrapper) and isinstance(saved, dict):
        saved, optimizer = saved.get("base"), optimizer.base  # VRGD, AGVM: the base's groups
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        raise ValueError("the saved optimizer state has no param_groups: not an optimizer's")
    sizes = [len(g.get("params", ())) for g in groups]
    check_param_groups(sizes, [len(g["params"]) for g in optimizer.param_groups])


def _check_loadable(
    state: Any, controller: Controller, needed: tuple[str, ...] = ("model", "optimizer")
) -> None:
    """One ``ValueError`` naming what a loop of ``controller`` cannot load, before any is loaded."""
    needed = (*needed, "source", "engine", "rng")
    missing = [k for k in needed if not isinstance(state, dict) or k not in state]
    engine = state.get("engine") if isinstance(state, dict) else None
    if not missing and isinstance(engine, dict):
        parts = ("controller", "batch_size", "step", "samples")
        missing = [f"engine.{k}" for k in parts if k not in engine]
    if missing:
        raise ValueError(f"not a state_dict of AdaptiveBatch: it lacks {', '.join(missing)}")
    saved, own = state["engine"]["controller"], controller.state_dict()
    if isinstance(saved, dict) and set(saved) != set(own):  # a controller that ignores it
        raise ValueError(
            f"the saved controller state (keys {sorted(saved)}) does not fit {controller!r} "
            f"(keys {sorted(own)}): was it saved with another controller?"
        )
    trial = copy.deepcopy(controller)  # its own load may fail half-way
    try:
        trial.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(
            f"the saved controller state does not fit {controller!r} "
            f"({type(err).__name__}: {err}): was it saved with another controller?"
        ) from None

"""The rules of one optimizer step, written once: what the loop and every plugin call
(docs/adaptive_batching.md, "One step engine", has a loop driving one)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._checks import positive_int
from ._tensors import norms, sq_norms
from ._warn import warn_at_caller
from .assembly import (
    assemble,
    check_asynchronous,
    check_statistics,
    describe,
    fewest_sub_batches,
    measuring_every,
)
from .batch.controllers import Controller, contract_of
from .batch.lr import LRScaling, lr_factor, resolve_lr_rule
from .batch.plan import StepPlan
from .batch.smoothing import SmoothedNoise
from .optim.registry import optimizer_family
from .optim.wrapper import StatisticsWrapper
from .options import NONFINITE_POLICIES, StepOptions
from .parallel.fsdp import local
from .parallel.world import World
from .stats.collector import MicroBatchStatistics
from .stats.estimators import inverse_size, population
from .stats.result import GradientStats, PendingStats

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteError",
    "StepEngine",
    "StepOptions",
    "StepResult",
    "back_off",
]


class NonFiniteError(FloatingPointError):
    """A step's gradient or loss was NaN or infinite and the policy is ``"raise"``."""


@dataclass
class StepResult:
    """What ``before_optimizer_step`` measured and decided."""

    #: the step's statistics (tensors), None without statistics
    stats: GradientStats | None
    #: floats for logging: statistics, loss, lr, lr_factor, step, samples, batch sizes
    metrics: dict[str, float] = field(default_factory=dict)
    #: the update must not happen (a non-finite step under ``nonfinite="skip"``)
    skip: bool = False
    #: with ``asynchronous``: 1.0 on the device where this step is not finite, for the
    #: optimizer to skip it by (its ``found_inf``); None otherwise
    found_inf: Tensor | None = None
    #: a ``GradScaler``'s overflow, skipped: whoever steps the scaler lowers its scale
    overflowed: bool = False


class StepEngine:
    """Per-step rules: loss weights, statistics, finiteness, LR around the step, next batch size.

    Build one with :meth:`build`; the constructor takes the parts already made.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (a statistics wrapper observes).
        controller: chooses the next batch size (``bigbatch.batch``).
        collector: the statistics (``bigbatch.stats.MicroBatchStatistics``), or None.
        world: the data-parallel world (one process by default).
        scaler: the loop's ``torch.amp.GradScaler``, if any.
        options: the per-step rules (:class:`~bigbatch.StepOptions`), or as keywords.
        sub_batches: the fewest micro-batches per rank of a measuring step.
        noise_why: why the noise statistics come from where they do, in words.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        controller: Controller,
        *,
        collector: MicroBatchStatistics | None = None,
        world: World | None = None,
        scaler: torch.amp.GradScaler | None = None,
        options: StepOptions | None = None,
        sub_batches: int | None = None,
        noise_why: str = "",
        **keywords: Any,
    ) -> None:
        self.options = StepOptions.of(options, **keywords)
        self.noise_why = noise_why
        self.optimizer, self.controller, self.collector = optimizer, controller, collector
        self.world = world if world is not None else World()
        self.lr_scaling = resolve_lr_rule(
            self.options.lr_scaling, controller, optimizer_family(optimizer)
        )
        base = self.options.base_batch_size
        self.base_batch_size = positive_int(
            "base_batch_size", controller.initial if base is None else base
        )
        self.schedule = self.options.schedule
        self.nonfinite = self.options.nonfinite
        self.loss_reduction = self.options.loss_reduction
        # a disabled GradScaler (``enabled=use_amp``) skips nothing: the engine must
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        check_statistics(optimizer, controller, collector, self.lr_scaling)
        if self.options.asynchronous:
            check_asynchronous(optimizer)
        self.options = measuring_every(self.options, optimizer, controller, collector)
        #: the batch size of the next step
        self.batch_size = controller.initial
        #: optimizer steps taken (skipped ones included) and samples trained on
        self.steps_taken = self.samples = 0
        #: optimizer steps whose update was dropped for a non-finite gradient or loss
        self.skipped_steps = 0
        self._lr = LRScaling()
        #: the fewest micro-batches per rank of a step that measures (more where memory asks)
        self.sub_batches = sub_batches or fewest_sub_batches(
            collector is not None,
            collector is not None and collector.per_example is not None,
            collector is not None and collector.similarity == "split",
            self.world.size,
            collector is not None and collector.lossy_reduction,
        )
        #: whether the step under way measures the statistics (``statistics_every``)
        self.measuring = False
        self._single_path_checked = False
        #: the last measured noise averages, for a rate rule between measurements (AdaScale)
        self._averages: dict[str, float] = {}
        #: the logged noise scale of a controller that has none of its own
        self._noise = SmoothedNoise(20)
        self._plan: StepPlan | None = None
        self._weights: list[float] = []
        self._loss: Tensor | None = None
        #: with ``asynchronous``, the last step, not yet read or decided on
        self._pending: _Reading | _Read | None = None

    @classmethod
    def build(
        cls,
        optimizer: torch.optim.Optimizer,
        controller: Controller | None = None,
        options: StepOptions | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
        **run: Any,
    ) -> StepEngine:
        """The engine of a run, assembled and checked by :func:`bigbatch.assembly.assemble`."""
        parts = assemble(optimizer, controller, options, **run)
        return cls(optimizer, scaler=scaler, **vars(parts))  # Parts: the arguments, by name

    def describe(self) -> dict[str, Any]:
        """What this engine was built to do, as plain data (equal for equal runs)."""
        return describe(self)

    # ------------------------------------------------------------ the micro-batches

    def measures(self) -> bool:
        """Whether the next step measures (:meth:`StepOptions.every_at`; by the step count)."""
        every = self.options.every_at(self.batch_size)
        return self.collector is not None and self.steps_taken % every == 0

    @property
    def next_sub_batches(self) -> int:
        """The next step's fewest micro-batches per rank: 1 between measurements."""
        return self.sub_batches if self.collector is None or self.measures() else 1

    def begin(self, plan: StepPlan, loss_weights: list[float] | None = None) -> None:
        """Start a step (``loss_weights``: the loop's own, else ``W b_i / B``)."""
        self._plan = plan
        self._weights = (
            list(loss_weights)
            if loss_weights is not None
            else plan.loss_weights(self.loss_reduction)
        )
        self._loss = None
        self.measuring = self.measures()
        if self.measuring:
            # the statistics take each micro-batch's mean gradient: a summed loss's factor
            # W/B is W b_i/B of its mean (given as W/B, its norms came b_i² too large)
            weights = self._weights
            if loss_weights is None and self.loss_reduction == "sum":
                weights = [w * b for w, b in zip(weights, plan.sizes, strict=True)]
            self.collector.begin(plan.sizes, plan.rank_sizes, loss_weights=weights)

    def loss_weight(self, index: int) -> float:
        """What micro-batch ``index``'s loss is multiplied by before backward."""
        return self._weights[index]

    def before_backward(self, index: int) -> None:
        if self.measuring:
            self.collector.before_backward(index)

    def add_loss(self, weighted: Tensor) -> None:
        """A micro-batch's weighted loss, for the logged batch loss (read after the backward)."""
        weighted = weighted.reshape(()) if weighted.dim() else weighted  # a loss of shape (1,)
        probe = self.collector.per_example if self.measuring else None
        if probe is not None and not self._single_path_checked and weighted.grad_fn is not None:
            probe.check_single_path(weighted)  # once a run: a walk of the whole graph
            self._single_path_checked = True
        with torch.no_grad():
            self._loss = weighted if self._loss is None else self._loss + weighted

    # ------------------------------------------------------------ the optimizer step

    def before_optimizer_step(self) -> StepResult:
        """Measure, check finiteness, set the rates, choose the next size: one host sync
        (with ``asynchronous``, none: the step before's numbers are read instead).
        A non-finite step with ``nonfinite="raise"`` raises :class:`NonFiniteError`."""
        if self._plan is None:
            raise RuntimeError("before_optimizer_step() without a step: call begin(plan) first")
        if _unscaled(self.scaler, self.optimizer):
            # the micro-batches' norms were taken scaled, the gradient read would not be
            raise RuntimeError(
                "scaler.unscale_(optimizer) ran before the step's statistics were read: they "
                "would mix scaled and unscaled gradients; leave the unscaling to the loop "
                "(clip with step.apply(max_grad_norm=...))"
            )
        self._lr.restore(self.optimizer)  # a scaling a framework's skipped step left behind
        if self._pending is not None and not self.options.asynchronous:
            # a checkpoint of an asynchronous run, resumed synchronously
            self._flush(following=self._plan.batch_size)
        reading = _Reading.of(self)
        self._plan = None
        if self.options.asynchronous:
            return self._step_asynchronously(reading)
        read = reading.resolve()
        if not read.finite:
            overflowed = self._refuse(read)
            self._count(read.batch, read.metrics)
            return StepResult(read.stats, self._drop(read), skip=True, overflowed=overflowed)
        self._learn_averages(read)
        self._set_rate(read.batch, read.metrics)
        self._decide(read)
        return StepResult(read.stats, read.metrics)

    def _step_asynchronously(self, reading: _Reading) -> StepResult:
        """This step's numbers start to the host, the step before's are decided on."""
        found_inf = reading.pending.nonfinite()
        reading.pending.start()
        result = StepResult(None)
        if self._pending is not None:  # taken first: a step that raises leaves none pending
            read, self._pending = self._resolved_pending(), None
            result = StepResult(read.stats, self._settle(read, following=reading.batch))
        self._pending = reading
        self._set_rate(reading.batch, reading.rate_metrics)
        result.found_inf = found_inf
        return result

    def flush(self) -> StepResult | None:
        """With ``asynchronous``, decide on the last step now (a run's end); None if none."""
        return self._flush()

    def _flush(self, following: int | None = None) -> StepResult | None:
        if self._pending is None:
            return None
        read, self._pending = self._resolved_pending(), None
        return StepResult(read.stats, self._settle(read, following))

    def _settle(self, read: _Read, following: int | None = None) -> dict[str, float]:
        """An asynchronous step's numbers, read one step late: skipped or learned from."""
        # following: the batch of the step drawn meanwhile, logged as the next
        if not read.finite:
            try:
                self._refuse(read)
            except NonFiniteError:
                # counted when its rate was set: uncounted, as a refused synchronous step is
                self.steps_taken, self.samples = read.step - 1, read.samples - read.batch
                raise
            return self._drop(read, following)  # the optimizer (or scaler) skipped it
        self._learn_averages(read)
        self._decide(read, following)
        return read.metrics

    def _refuse(self, read: _Read) -> bool:
        """Raise under ``nonfinite="raise"`` unless it is a ``GradScaler``'s overflow; which."""
        # an overflow (the loss finite, the scaled gradient's norm not) is the scaler's
        # routine: the step skipped, the scale lowered. A scale halved to 0 (overflow after
        # overflow) measures nothing and is refused. The scale is read only here (rare).
        collapsed = self.scaler is not None and self.scaler.get_scale() == 0
        overflowed = (
            self.scaler is not None
            and not collapsed
            and math.isfinite(read.metrics.get("loss", 0.0))
        )
        if self.nonfinite == "raise" and not overflowed:
            raise NonFiniteError(
                f"step {read.step}: the gradient or loss is not finite "
                f"(loss {read.metrics.get('loss', 'not given')}"
                f"{'; the GradScaler scale fell to 0' if collapsed else ''}); nothing was updated"
            )
        return overflowed

    def _drop(self, read: _Read, following: int | None = None) -> dict[str, float]:
        """A non-finite step counted as skipped (its update dropped)."""
        self.skipped_steps += 1
        following = self.batch_size if following is None else following
        read.metrics.update(skipped=1.0, lr_factor=0.0, lr=0.0, next_batch_size=following)
        return read.metrics

    def _learn_averages(self, read: _Read) -> None:
        """A finite measured step: VRGD or AGVM observes it, AdaScale's averages take it."""
        if not read.finite or not read.measured:
            return
        if isinstance(self.optimizer, StatisticsWrapper):
            self.optimizer.observe(read.stats)
        # AdaScale's gain reads the averages: kept for the steps between measurements
        metrics = read.metrics
        self._averages = dict(grad_sq_norm=metrics["grad_sq_norm_ema"], trace=metrics["trace_ema"])

    def _set_rate(self, batch: int, metrics: dict[str, float]) -> None:
        """The rate of a step of ``batch`` set on the optimizer; the step counted."""
        if self.schedule is not None:
            # controllers may hold the batch while the schedule still rises (a warm-up)
            metrics["schedule"] = _schedule_factor(self.schedule, self.samples)
        factor = metrics["lr_factor"] = _rate_factor(
            lr_factor(self.lr_scaling, batch, self.base_batch_size, **self._averages),
            metrics.get("schedule"),
            self.options.max_lr_factor,
        )
        lr = self.optimizer.param_groups[0]["lr"]
        if not isinstance(lr, Tensor) or lr.device.type == "cpu":
            metrics["lr"] = float(lr) * factor
        self._lr.apply(self.optimizer, factor)
        self._count(batch, metrics)

    def _decide(self, read: _Read, following: int | None = None) -> None:
        """The controller chooses the next batch from a step's numbers."""
        metrics = read.metrics
        # an overflowed GradScaler step teaches the controller nothing, and a step between
        # measurements only a controller that learns |G|² from the batch gradient alone
        informs = read.measured or "batch_grad_sq_norm" in metrics
        reads = contract_of(self.controller).needs_statistics
        # asynchronous: a step read after the batch changed measured the batch before it; a
        # rule that reads the statistics decides at its current batch (told the older one,
        # BatchWarmup's "no change yet" undid its growth, and the batch see-sawed)
        stale = reads and read.batch != self.batch_size
        if read.finite and (informs or not reads) and not stale:
            self.batch_size = int(self.controller.next(metrics, read.batch, read.samples))
        if read.finite:
            self._log_noise_scale(metrics)
        # asynchronous: the decision is the step after next's batch; the next one's was drawn
        metrics["next_batch_size"] = self.batch_size if following is None else following

    def _log_noise_scale(self, metrics: dict[str, float]) -> None:
        """The ``noise_scale`` logged: the controller's, else a default smoothed one."""
        estimate = getattr(self.controller, "estimate", None)
        if estimate is not None:
            metrics.update(estimate())
        elif "trace" in metrics:
            self._noise.update(metrics["grad_sq_norm"], metrics["trace"])
            metrics.update(self._noise.estimate(1.0))

    def after_optimizer_step(self, result: StepResult | None = None) -> None:
        """Restore the learning rates (and log what a statistics wrapper reports)."""
        self.restore_rates()
        if result is not None and not result.skip and isinstance(self.optimizer, StatisticsWrapper):
            result.metrics.update(self.optimizer.metrics())

    def restore_rates(self) -> None:
        """The optimizer's own rates back, the step's scaling undone (nothing if none)."""
        self._lr.restore(self.optimizer)

    def _count(self, batch: int, metrics: dict[str, float]) -> None:
        self.steps_taken += 1
        self.samples += batch
        metrics.update(step=self.steps_taken, samples=self.samples, batch_size=batch)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        # asynchronous: the last step read now (its statistics join the averages, as they
        # would at the next step) and decided on at the next step, as it would be
        pending = self._resolved_pending().state_dict() if self._pending is not None else None
        return {
            "controller": self.controller.state_dict(),
            "statistics": self.collector.state_dict() if self.collector is not None else None,
            "noise": self._noise.state_dict(),
            "averages": dict(self._averages),
            "batch_size": self.batch_size,
            "skipped_steps": self.skipped_steps,
            "step": self.steps_taken,
            "samples": self.samples,
            "pending": pending,
        }

    def _resolved_pending(self) -> _Read:
        """The pending step's numbers, read (waiting for them), kept pending."""
        if isinstance(self._pending, _Reading):
            self._pending = self._pending.resolve(self.scaler is None)
        return self._pending

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a step under way is abandoned: its plan, and the rates it scaled (the optimizer's
        # loaded rates are the unscaled ones)
        self._plan, self._lr = None, LRScaling()
        self.controller.load_state_dict(state["controller"])
        if self.collector is not None and state.get("statistics") is not None:
            self.collector.load_state_dict(state["statistics"])
        self._noise.load_state_dict(state["noise"])
        self._averages = dict(state["averages"])
        self.batch_size = _within_bounds(self.controller, int(state["batch_size"]))
        self.skipped_steps = int(state["skipped_steps"])
        self.steps_taken, self.samples = int(state["step"]), int(state["samples"])
        pending = state.get("pending")
        self._pending = _Read.from_state(pending) if pending is not None else None


def _within_bounds(controller: Controller, saved: int) -> int:
    """The saved batch clamped to ``controller``'s bounds, with a warning."""
    low, high = getattr(controller, "min", 1), getattr(controller, "max", saved)
    batch = min(max(saved, low), high)
    if batch != saved:
        warn_at_caller(
            f"the checkpoint's batch {saved} is outside the controller's bounds "
            f"[{low}, {high}]: resuming at {batch}"
        )
    return batch


def back_off(scaler: torch.amp.GradScaler) -> None:
    """What a ``GradScaler``'s step does at an overflow: the scale backed off, growth reset."""
    # here, not by its step: a scaled gradient whose float32 norm overflows may have no
    # infinite element for the scaler to find (it would step, at the base rate)
    state = scaler.state_dict()
    state.update(scale=state["scale"] * state["backoff_factor"], _growth_tracker=0)
    scaler.load_state_dict(state)


def _schedule_factor(schedule: Any, samples: int) -> float:
    """The schedule's multiplier at ``samples``, finite and >= 0, else ``ValueError``."""
    value = schedule(samples)
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = math.nan
    if not math.isfinite(factor) or factor < 0:
        raise ValueError(
            f"the schedule gave {value!r} at {samples} samples: a rate's multiplier must be "
            "a finite number >= 0"
        )
    return factor


def _rate_factor(rule: float, schedule: float | None, ceiling: float | None) -> float:
    """The batch rule's factor times the schedule's, at most ``max_lr_factor``."""
    factor = rule * schedule if schedule is not None else rule
    return min(factor, ceiling) if ceiling is not None else factor


def _unscaled(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` ran since its last ``update()``."""
    # torch's own record of it, a private one: False where a torch keeps it otherwise
    if scaler is None or not scaler.is_enabled():
        return False
    states = getattr(scaler, "_per_optimizer_states", {})
    stage = states.get(id(optimizer), {}).get("stage") if isinstance(states, dict) else None
    return getattr(stage, "name", None) == "UNSCALED"


def _loss_scale(scaler: torch.amp.GradScaler | None, device: torch.device) -> Tensor | None:
    """The loss scale as a tensor on ``device`` (no host read); None without a scaler."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), device=device))


@dataclass
class _Read:
    """A step's numbers on the host, with what the engine decides them with."""

    metrics: dict[str, float]
    finite: bool
    #: the statistics were measured (a step between measurements has its loss alone)
    measured: bool
    batch: int
    #: the step's number and the samples trained on after it
    step: int
    samples: int
    stats: GradientStats | None = None

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _READ_STATE} | {"metrics": dict(self.metrics)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _Read:
        return cls(**{name: state[name] for name in _READ_STATE})


_READ_STATE = ("metrics", "finite", "measured", "batch", "step", "samples")


@dataclass
class _Reading:
    """A step's numbers still on the device, with what the host knows of the step."""

    pending: PendingStats[Any]
    #: the decoded numbers as (statistics or None, metrics, finite)
    interpret: Callable[[Any], tuple[GradientStats | None, dict[str, float], bool]]
    batch: int
    step: int
    samples: int
    #: the loop gave the step's loss (``add_loss``): a loop that never did has none, not 0
    reported: bool
    #: the step's rate, set before its numbers are read (``asynchronous``)
    rate_metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: StepEngine) -> _Reading:
        """The step under way's numbers, gathered on the device (no host read)."""
        batch = engine._plan.batch_size
        loss = engine._loss if engine._loss is not None else _no_loss(engine.optimizer)
        if engine.measuring:
            pending = engine.collector.finish_pending(
                loss_scale=_loss_scale(engine.scaler, engine.collector.layout.device), loss=loss
            )
            interpret = _statistics
        else:
            pending, interpret = _between_measurements(engine, loss, batch), _loss_only
        return cls(
            pending,
            interpret,
            batch,
            engine.steps_taken + 1,
            engine.samples + batch,
            reported=engine._loss is not None,
        )

    def resolve(self, skipped_on_device: bool = False) -> _Read:
        """The numbers read, waited for (``skipped_on_device``: finite as ``found_inf`` says)."""
        stats, metrics, finite = self.interpret(self.pending.read())
        if skipped_on_device:
            finite = self.pending.finite
        if not self.reported:
            del metrics["loss"]
        metrics.update(self.rate_metrics)
        return _Read(metrics, finite, stats is not None, self.batch, self.step, self.samples, stats)


def _no_loss(optimizer: torch.optim.Optimizer) -> Tensor:
    # a loop that never called add_loss: a 0 on the gradients' device, read with them (one
    # made on the CPU could not be stacked with a CUDA model's norms)
    return torch.zeros((), device=optimizer.param_groups[0]["params"][0].device)


def _statistics(stats: GradientStats) -> tuple[GradientStats, dict[str, float], bool]:
    """A measured step's statistics (the loss among them) and its finiteness."""
    metrics = stats.as_floats()
    # the collector's β-average ratio is not what any controller decides on: the logged
    # noise_scale is the deciding estimate (StepEngine._log_noise_scale)
    del metrics["noise_scale"]
    return stats, metrics, math.isfinite(metrics["grad_sq_norm"] + metrics["loss"])


def _loss_only(read: tuple[dict[str, float], bool]) -> tuple[None, dict[str, float], bool]:
    return None, *read


def _between_measurements(
    engine: StepEngine, loss: Tensor, batch: int
) -> PendingStats[tuple[dict[str, float], bool]]:
    """A step that does not measure: its loss, finiteness and batch gradient's ``|g_B|²``."""
    collector = engine.collector
    wanted = (
        collector is not None
        and not collector.lossy_reduction
        and contract_of(engine.controller).learns_between_measurements
    )
    # the scale read with the rest: a scale halved to 0 makes torch's GradScaler step on NaN
    # (0 times its inverse), so such a step must be skipped here
    scale = _loss_scale(
        engine.scaler, loss.device if collector is None else collector.layout.device
    )
    if not wanted:
        return _mean_loss_and_finiteness(engine.optimizer, engine.world, loss, scale=scale)
    inverse = inverse_size(batch, population(collector.dataset_size, batch))
    return _mean_loss_and_finiteness(engine.optimizer, engine.world, loss, inverse, scale)


def _mean_loss_and_finiteness(
    optimizer: torch.optim.Optimizer,
    world: World,
    loss: Tensor,
    batch_inverse_size: float | None = None,
    scale: Tensor | None = None,
) -> PendingStats[tuple[dict[str, float], bool]]:
    """The mean loss and finiteness on every rank (and ``|g_B|²``): one all-reduce, one read."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
    present = [local(g) for g in grads if g is not None]  # under FSDP2, this rank's shards
    scaled = scale is not None

    def decode(read: list[float]) -> tuple[dict[str, float], bool]:
        if world.distributed:  # the loss, |g|² (this rank's share), the scale, reduced
            value, total_sq, rest = read[0], read[1], read[2:]
            finite = math.isfinite(value + total_sq)
        else:  # the loss, the scale, each gradient's norm: squared and added up here
            value, rest = read[0], read[1:]
            finite = all(map(math.isfinite, read))  # (a sum of squares may overflow)
            total_sq = sum(n * n for n in (rest[1:] if scaled else rest)) if finite else math.nan
        if scaled and rest[0] <= 0:  # a scale halved to 0 by overflow after overflow
            finite, total_sq = False, math.nan
        metrics = {"loss": value}
        if batch_inverse_size is not None:
            # a replicated gradient (DDP) is summed once per rank; a sharded one's shards add up
            full_sq = total_sq * world.size if world.sharded else total_sq
            metrics["batch_grad_sq_norm"] = full_sq / (rest[0] ** 2 if finite and scaled else 1.0)
            metrics["batch_inverse_size"] = batch_inverse_size
        return metrics, finite

    with torch.no_grad():
        if not world.distributed:
            # one process: the loss, the scale and the norms in one read (a NaN or an infinity
            # in a gradient makes its norm so); two operators beside the read
            head = [loss, scale.reshape(()).to(loss)] if scaled else [loss]
            return PendingStats(torch.stack([*head, *norms(present)]), decode)
        # squared norms: a NaN or an infinity survives the sum, and no square root is needed
        total = sq_norms(present).sum() if present else torch.zeros((), dtype=torch.float64)
        parts = [loss.double().reshape(()), total.to(loss.device)]
        if scaled:
            parts.append(scale.double().reshape(()).to(loss.device))
        return PendingStats(world.all_reduce_sum(torch.stack(parts) / world.size), decode)

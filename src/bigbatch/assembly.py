"""How the parts of a run fit together: its world, statistics and comm hooks, checked
once for every entry point (:meth:`bigbatch.StepEngine.build` calls :func:`assemble`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._checks import positive_int
from ._warn import warn_at_caller
from .batch.controllers import BatchWarmup, Controller, contract_of
from .batch.lr import resolve_lr_rule
from .optim.registry import optimizer_family
from .optim.wrapper import StatisticsWrapper
from .options import StepOptions
from .parallel import ddp, fsdp
from .parallel.hooks import CommHook, is_lossless
from .parallel.world import World
from .stats.collector import MicroBatchStatistics
from .stats.per_example import batch_coupled, shared_layers, uncovered

_log = logging.getLogger("bigbatch")

__all__ = [
    "FrameworkStep",
    "Parts",
    "assemble",
    "check_asynchronous",
    "check_statistics",
    "describe",
    "describe_collector",
    "fewest_sub_batches",
    "resolve_controller",
]


@dataclass(frozen=True)
class FrameworkStep:
    """A framework whose optimizer step reduces the gradients (DeepSpeed): its world,
    ``param_groups`` and whether ``.grad`` accumulates."""

    world: World
    param_groups: list[list[torch.Tensor]]
    grad_accumulates: bool = True


@dataclass(frozen=True)
class Parts:
    """What :func:`assemble` made: the engine's constructor arguments."""

    controller: Controller
    collector: MicroBatchStatistics | None
    world: World
    options: StepOptions
    #: the fewest micro-batches per rank per step
    sub_batches: int
    #: why the noise statistics come from each example's gradient norm or from the
    #: micro-batches (``StepEngine.noise_why``; empty without statistics)
    noise_why: str = ""


def assemble(  # noqa: PLR0913 - what a run is made of, each a keyword
    optimizer: torch.optim.Optimizer,
    controller: Controller | None = None,
    options: StepOptions | None = None,
    *,
    model: nn.Module | None = None,
    sub_batches: int | None = None,
    first_batch: int | None = None,
    dataset_size: int | None = None,
    comm_hook: tuple[Any, CommHook] | None = None,
    registers_hooks: bool = True,
    framework: FrameworkStep | None = None,
    weighted: bool = False,
) -> Parts:
    """The parts of a run's engine, checked together; the model's hooks registered.

    Args:
        optimizer: the run's optimizer.
        controller: chooses the batch sizes (default: :func:`resolve_controller`'s).
        options: the per-step rules.
        model: the trained module, its DDP or an FSDP2 model (None: one process).
        sub_batches: the fewest micro-batches per rank of a measuring step.
        first_batch: the batch a sampler starts at; the controller must start there.
        dataset_size: samples in a finite dataset (None: a stream or a weighted batch).
        comm_hook: a DDP ``(state, hook)`` pair for the engine to register.
        registers_hooks: False when a framework owns the DDP wrapper and its hook.
        framework: a :class:`FrameworkStep` (DeepSpeed).
        weighted: the batch is counted in weight (tokens), not in examples.
    """
    options = options if options is not None else StepOptions()
    if options.asynchronous and (framework is not None or not registers_hooks):
        raise ValueError(
            "asynchronous=True needs bigbatch.AdaptiveBatch's optimizer step, which skips a "
            "non-finite step on the device; a framework's own step cannot: leave it False"
        )
    if options.asynchronous and getattr(comm_hook[0] if comm_hook else None, "stateful", False):
        raise ValueError(
            "asynchronous=True: a step proves non-finite one step late, when the next step's "
            "reduction has already built on its compression error, which cannot be undone "
            "then; leave asynchronous False with a compressing comm_hook"
        )
    if framework is not None:
        world = framework.world
    else:
        world = World.of(model) if model is not None else World()
        processes = _processes_in_group()
        if registers_hooks and not world.distributed and processes > 1:
            warn_at_caller(
                f"torch.distributed runs {processes} processes, but the model is "
                "not wrapped in DistributedDataParallel or fully_shard: each process trains "
                "alone on the whole global batch (wrap it to train as one)"
            )
    _refuse_sparse_gradients(model)
    controller = resolve_controller(controller, first_batch)
    wrapped = isinstance(optimizer, StatisticsWrapper)
    gsnr = options.gsnr or (wrapped and "gsnr" in optimizer.requirements())
    options = _with_statistics(options, optimizer, controller, gsnr)
    in_use = _hook_in_use(comm_hook, registers_hooks, model)
    obstacles = _per_example_obstacles(framework is not None, gsnr, in_use, weighted)
    per_example, noise_why = _per_example_model(
        options, model, optimizer, obstacles, sub_batches, world
    )
    options = _similarity_for(options, controller, per_example, world)
    lossy = framework is not None or not is_lossless(in_use)  # as the collector will read it
    if sub_batches is None:
        sub_batches = fewest_sub_batches(
            options.statistics, per_example is not None, options.similarity == "split",
            world.size, lossy,
        )  # fmt: skip
    _check_sub_batches(
        controller, positive_int("sub_batches", sub_batches), world, options, per_example,
        noise_why, lossy,
    )  # fmt: skip
    if wrapped:
        optimizer.check_sub_batches(sub_batches * world.size)
    given = comm_hook if registers_hooks else None  # to register (else the model's own)
    comm_hook = _comm_hook(comm_hook, in_use, registers_hooks, world, options, framework)
    collector = None
    if options.statistics:
        collector = MicroBatchStatistics(
            optimizer.param_groups if framework is None else framework.param_groups,
            ema_beta=options.ema_beta,
            gsnr=gsnr,
            dataset_size=dataset_size if options.finite_correction else None,
            similarity="scalar" if framework is not None else options.similarity,
            world=world,
            # the gradients are reduced only inside the framework's step: each rank's own
            lossy_reduction=framework is not None or not is_lossless(comm_hook),
            grad_sources=fsdp.unsharded_parameters(model) if world.sharded else None,
            grad_accumulates=framework is None or framework.grad_accumulates,
            per_example=per_example,
            per_example_units=options.noise_units,
        )
    if registers_hooks and model is not None and (given is not None or in_use is None):
        ddp.register(model, given, collector.two_groups if collector is not None else None)
    return Parts(controller, collector, world, options, sub_batches, noise_why)


def _per_example_obstacles(
    framework: bool, gsnr: bool, comm_hook: tuple[Any, CommHook] | None, weighted: bool
) -> list[str]:
    """Why the noise cannot come from each example's gradient norm here (none: it can)."""
    obstacles = {
        "the framework reduces the gradients inside its own step": framework,
        "the GSNR (VRGD) reads the micro-batches": gsnr,
        "a lossy comm hook: each rank estimates from its own micro-batches": not is_lossless(
            comm_hook
        ),
        "the batch is counted in weight (weight_fn), not in examples": weighted,
    }
    return [why for why, holds in obstacles.items() if holds]


def _hook_in_use(
    comm_hook: tuple[Any, CommHook] | None, registers_hooks: bool, model: nn.Module | None
) -> tuple[Any, CommHook] | None:
    """The comm hook in use: the one given, or the one a framework (or the user) registered."""
    if comm_hook is not None and registers_hooks:
        return comm_hook
    return ddp.registered_hook(model) if model is not None else None


def _comm_hook(
    comm_hook: tuple[Any, CommHook] | None,
    in_use: tuple[Any, CommHook] | None,
    registers_hooks: bool,
    world: World,
    options: StepOptions,
    framework: FrameworkStep | None,
) -> tuple[Any, CommHook] | None:
    """The checked comm hook; ``ValueError`` where the asked similarity cannot be measured."""
    if comm_hook is not None and not (registers_hooks and world.distributed):
        raise ValueError(
            "comm_hook needs a DistributedDataParallel model on 2+ ranks that the loop "
            "wraps (a framework registers its own hook)"
        )
    if (
        registers_hooks
        and comm_hook is None
        and in_use is not None
        and options.similarity == "split"
    ):
        raise ValueError(
            "similarity='split' under DDP needs bigbatch's comm hook around yours: pass the "
            "hook registered on the model as comm_hook=(state, hook) instead"
        )
    if not registers_hooks and world.distributed and options.similarity == "split":
        raise ValueError(
            "similarity='split' under DDP needs bigbatch's comm hook, which a framework's "
            "DDP wrapper does not take: use 'scalar' or bigbatch.AdaptiveBatch"
        )
    if framework is not None and options.similarity == "split":
        raise ValueError(
            "similarity='split' needs the micro-batch gradients in .grad or bigbatch's comm "
            "hook; a framework that reduces inside its own step gives neither: use 'scalar'"
        )
    return in_use


def _similarity_for(
    options: StepOptions, controller: Controller, per_example: nn.Module | None, world: World
) -> StepOptions:
    """Whether per-example statistics on one process keep two micro-batches for the split."""
    reads = contract_of(controller).reads_similarity
    alone = not (world.distributed or world.sharded)
    if per_example is not None and options.similarity is None and reads and alone:
        return dataclasses.replace(options, similarity="split")
    return options


#: the sub-batches in all the sub-batch estimator wants a step (more, a steadier estimate)
SUB_BATCHES = 4


def fewest_sub_batches(
    statistics: bool, per_example: bool, split: bool, ranks: int = 1, lossy: bool = False
) -> int:
    """The micro-batches per rank a step's statistics need (``SUB_BATCHES`` over the ranks)."""
    if statistics and not per_example:
        # a lossy reduction (compression) leaves each rank to measure the noise in its own
        # micro-batches: two at least, however many ranks
        fewest = -(-SUB_BATCHES // ranks)
        return max(2, fewest) if lossy and ranks > 1 else fewest
    return 2 if statistics and split else 1


def _per_example_model(
    options: StepOptions,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    obstacles: list[str],
    sub_batches: int | None = None,
    world: World | None = None,
) -> tuple[nn.Module | None, str]:
    """The module for per-example norms (``"auto"``: only where a step is not split
    anyway), or None, and why in words."""
    if not options.statistics:
        return None, ""
    if options.noise_from == "sub_batches":
        return None, "noise_from = 'sub_batches'"
    reasons = list(obstacles)
    if options.noise_from == "auto" and sub_batches is not None and sub_batches >= 2:
        reasons.append(f"every step is split into {sub_batches} micro-batches anyway")
    ranks = world.size if world is not None else 1
    if options.noise_from == "auto" and sub_batches is None and ranks >= SUB_BATCHES:
        # McCandlish et al. 2018, App. A: each rank's gradient before the all-reduce is a
        # small batch's, measured with no hook on any layer
        reasons.append(f"{ranks} ranks: each rank's own gradient is a small batch's")
    if model is None:
        reasons.append("no model was given to hook")
    module = ddp.unwrap(model) if model is not None else None
    if module is not None and not reasons:
        reasons = _model_obstacles(module, optimizer, insisted=options.noise_from == "examples")
    if not reasons:
        if options.noise_from == "examples":
            return module, "noise_from = 'examples'"
        return module, "noise_from = 'auto': every trained parameter is in a layer with a rule"
    if options.noise_from == "examples":
        raise ValueError(f"noise_from='examples' is not possible here: {'; '.join(reasons)}")
    _log.info("bigbatch: the noise statistics use sub-batches: %s", "; ".join(reasons))
    return None, f"noise_from = 'auto', but {'; '.join(reasons)}"


def _model_obstacles(
    module: nn.Module, optimizer: torch.optim.Optimizer, insisted: bool
) -> list[str]:
    # what keeps the model's layers from giving each example's gradient norm, seen before
    # its forward runs
    reasons = []
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = uncovered(module, params)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        reasons.append(f"no per-example rule for {', '.join(missing[:5])}{more}")
    coupled = batch_coupled(module)  # (with no trained parameter of its own too)
    if coupled:
        reasons.append(f"BatchNorm {coupled[0]!r} normalises over the batch")
    shared = [] if insisted else shared_layers(module)
    if shared:  # (insisted on, an alias run once is measured; a second run is refused)
        reasons.append(f"one layer is registered as {shared[0]} (it runs under each name)")
    return reasons


def resolve_controller(controller: Controller | None, first_batch: int | None) -> Controller:
    """The given controller, or :class:`BatchWarmup` from ``first_batch``, its bounds
    widened to hold that batch."""
    if controller is None:
        own = BatchWarmup()
        if first_batch is None:
            return own
        low, high = min(own.min, first_batch), max(own.max, first_batch)
        return BatchWarmup(initial=first_batch, min=low, max=high)
    if isinstance(controller, type) or not callable(getattr(controller, "next", None)):
        raise TypeError(
            "controller must be a controller object (e.g. bigbatch.batch.BatchWarmup()), "
            f"got {controller!r}"
        )
    if first_batch is not None and controller.initial != first_batch:
        raise ValueError(
            f"the controller starts at batch {controller.initial} but the sampler at "
            f"{first_batch}: give both the same first batch"
        )
    return controller


def _with_statistics(
    options: StepOptions, optimizer: torch.optim.Optimizer, controller: Controller, gsnr: bool
) -> StepOptions:
    """``options`` with ``statistics`` decided: as set, else where something reads them."""
    if options.statistics is not None:
        return options
    read = statistics_read(optimizer, controller, options) or gsnr
    return dataclasses.replace(options, statistics=read)


def statistics_read(
    optimizer: torch.optim.Optimizer, controller: Controller, options: StepOptions
) -> bool:
    """Whether the controller, the rate rule or the optimizer reads the statistics."""
    rule = resolve_lr_rule(options.lr_scaling, controller, optimizer_family(optimizer))
    return (
        contract_of(controller).needs_statistics
        or rule.startswith("adascale")
        or isinstance(optimizer, StatisticsWrapper)
    )


def check_statistics(
    optimizer: torch.optim.Optimizer,
    controller: Controller,
    collector: MicroBatchStatistics | None,
    lr_scaling: str,
) -> None:
    """One error if something needs statistics the collector does not gather."""
    needs = contract_of(controller).needs_statistics or lr_scaling.startswith("adascale")
    if needs and collector is None:
        raise ValueError(
            f"{type(controller).__name__} with lr_scaling={lr_scaling!r} needs statistics=True"
        )
    if isinstance(optimizer, StatisticsWrapper) and collector is None:
        raise ValueError(f"{type(optimizer).__name__} needs statistics=True")
    if isinstance(optimizer, StatisticsWrapper) and collector is not None:
        missing = optimizer.requirements() - collector.provides()
        if missing:
            raise ValueError(
                f"{type(optimizer).__name__} needs {', '.join(sorted(missing))} collected "
                "(MicroBatchStatistics(gsnr=True))"
            )


def _processes_in_group() -> int:
    # the default process group's size (1 where there is none)
    available = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if available else 1


def check_asynchronous(optimizer: torch.optim.Optimizer) -> None:
    """One error where ``asynchronous`` could not skip a non-finite step on the device."""
    if isinstance(optimizer, StatisticsWrapper):
        raise ValueError(
            f"asynchronous=True: {type(optimizer).__name__} reads each step's statistics "
            "before its update, so they cannot be read one step late: leave it False"
        )
    dampened = isinstance(optimizer, torch.optim.SGD) and any(
        g["momentum"] and g["dampening"] for g in optimizer.param_groups
    )
    if dampened:
        raise ValueError(
            "asynchronous=True: torch's fused SGD leaves its momentum unset where its first "
            "step is skipped, which only zeros repair, and with dampening they do not: "
            "use dampening=0 or leave it False"
        )
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        # (a GradScaler would read its overflow flag on the host for such an optimizer)
        raise ValueError(
            f"asynchronous=True: {type(optimizer).__name__} cannot skip a non-finite step "
            "on the device; use one that takes found_inf (torch's Adam, AdamW, SGD or "
            "Adagrad with fused=True), or leave it False"
        )


def describe(engine: Any) -> dict[str, Any]:
    """A :class:`~bigbatch.StepEngine`'s settings as plain data (``StepEngine.describe``)."""
    schedule = engine.schedule
    return {
        **engine.options.as_dict(),
        "schedule": getattr(schedule, "__qualname__", repr(schedule)) if schedule else None,
        "lr_scaling": engine.lr_scaling,
        "base_batch_size": engine.base_batch_size,
        "controller": repr(engine.controller),
        "world_size": engine.world.size,
        "sharded": engine.world.sharded,
        "scaler": engine.scaler is not None,
        "optimizer": type(engine.optimizer).__name__,
        "collector": describe_collector(engine.collector),
    }


def describe_collector(collector: MicroBatchStatistics | None) -> dict[str, Any] | None:
    """A collector's settings as plain data (None without statistics)."""
    if collector is None:
        return None
    return {
        "similarity": collector.similarity,
        "gsnr": collector.gsnr,
        "ema_beta": collector.averages.beta,
        "dataset_size": collector.dataset_size,
        "lossy_reduction": collector.lossy_reduction,
        "per_example": collector.per_example.units if collector.per_example else False,
    }


def measuring_every(
    options: StepOptions,
    optimizer: torch.optim.Optimizer,
    controller: Controller,
    collector: MicroBatchStatistics | None,
) -> StepOptions:
    """``"auto"`` resolved, ``k > 1`` refused where the optimizer or ``gsnr`` reads every
    step's statistics."""
    if collector is None:
        return options
    wrapped = isinstance(optimizer, StatisticsWrapper)
    reader = type(optimizer).__name__ if wrapped else "gsnr=True" if collector.gsnr else ""
    if options.statistics_every == "auto":
        # a step between teaches a noise-scale controller |G|^2 from .grad's batch gradient,
        # which a lossy reduction does not leave; a similarity controller learns nothing there
        contract = contract_of(controller)
        between = contract.learns_between_measurements and not collector.lossy_reduction
        every = reader or (contract.needs_statistics and not between)
        return dataclasses.replace(options, statistics_every=1) if every else options
    if options.statistics_every > 1 and reader:
        raise ValueError(
            f"statistics_every={options.statistics_every} measures only some steps, but "
            f"{reader} reads every step's statistics: use statistics_every=1"
        )
    return options


#: the micro-batches a step, as a loop's user and a plugin's name them
_SUB_BATCHES_NAMED = (
    "min_sub_batches (micro-batches per step; a plugin's: the sampler's micro_batches)"
)


def _check_sub_batches(
    controller: Controller,
    sub_batches: int,
    world: World,
    options: StepOptions,
    per_example: nn.Module | None,
    noise_why: str,
    lossy: bool,
) -> None:
    split = options.similarity == "split" or per_example is None
    within_ranks = world.distributed and lossy and per_example is None  # each its own noise
    if sub_batches < 2 and options.statistics and within_ranks:
        raise ValueError(
            f"{_SUB_BATCHES_NAMED} must be at least 2 under a lossy reduction (compression, "
            "a framework's own): each rank measures the noise in its own micro-batches, "
            f"got {sub_batches}"
        )
    if sub_batches < 2 and options.statistics and not world.distributed and split:
        # (a plugin's user sets them as the sampler's micro_batches, and the per-example
        # statistics that need none may be out for a reason only the log said)
        why = f" ({noise_why})" if per_example is None and noise_why else ""
        raise ValueError(
            f"{_SUB_BATCHES_NAMED} must be at least 2 to measure "
            f"{'the split similarity' if per_example is not None else 'statistics'} on one "
            f"process{why}, got {sub_batches}"
        )
    smallest = sub_batches * world.size
    if controller.min < smallest:
        raise ValueError(
            f"the controller's smallest batch ({controller.min}) is below "
            f"min_sub_batches × ranks ({sub_batches} × {world.size}): "
            "every sub-batch needs a sample"
        )


def _refuse_sparse_gradients(model: nn.Module | None) -> None:
    """A ``ValueError`` naming a module of sparse gradients or a complex parameter."""
    # (the checks and the statistics take real, dense norms)
    for name, module in model.named_modules() if model is not None else ():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"module {name or 'the model'!r} ({type(module).__name__}) makes sparse gradients, "
                "which the loop cannot check or measure: build it with sparse=False"
            )
    for name, param in model.named_parameters() if model is not None else ():
        if param.requires_grad and param.is_complex():
            raise ValueError(
                f"parameter {name!r} is complex ({param.dtype}), which the loop cannot check or "
                "measure: keep it as a real view (torch.view_as_real) and train that"
            )

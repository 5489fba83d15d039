"""From a resolved config to the objects of a run: problem, optimizer, controller, loop."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from ..batch import (
    BatchWarmup,
    Constant,
    CriticalBatchRamp,
    DampedSimiGrad,
    NoiseScale,
    Ramp,
    SimiGrad,
)
from ..batch.controllers import CONTROLLERS
from ..batch.lr import lr_factor, resolve_lr_rule, schedule_by_name
from ..dist.compression import CompressionState, compression_hook
from ..dist.world import World
from ..loop import AdaptiveBatch
from ..optim import AGVM, create_optimizer, get_optimizer_info, module_param_groups
from .config import ConfigError
from .device import Precision, to_device
from .tasks import TASKS, Problem

#: config names of the compression methods that differ from the hook's
_METHOD = {"topk-only": "none"}


def with_task_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys left at 0 ("the task's default") from the task, and resolve the LR rule."""
    task = TASKS[config["task"]]
    config = dict(config)
    if config["model.context"] and not task.context:
        raise ConfigError(
            f"model.context = {config['model.context']} is set, but the {task.name} task "
            "has no sequences (lm and text do)"
        )
    for key, value in (
        ("model.width", task.width),
        ("model.depth", task.depth),
        ("model.context", task.context),
        ("max_samples", task.max_samples),
    ):
        if not config[key]:
            config[key] = value
    if not config["batch.base"]:
        config["batch.base"] = config["batch.initial"]
    family = get_optimizer_info(config["optimizer"]).family
    controller = CONTROLLERS[config["batch.controller"]]
    config["batch.lr_scaling"] = resolve_lr_rule(config["batch.lr_scaling"], controller, family)
    if not config["lr"]:
        held = config["batch.lr_scaling"] == "none"
        # a scaled rate is measured at the task's small batch: carry it to batch.base
        base_rate = task.lr(family, held)
        if not held:
            base_rate *= lr_factor(
                config["batch.lr_scaling"], config["batch.base"], task.base_batch
            )
        config["lr"] = base_rate
    return config


#: ``batch.noise_multiple = 0`` means each noise-following controller's own default κ
_DEFAULT_MULTIPLE = {"batch_warmup": 1.0, "critical_ramp": 6.0, "noise_scale": 1.0}


def make_controller(config: dict[str, Any]):
    """The controller a config names, with its settings. The noise-following controllers
    hold the batch while the rate warms up by watching the schedule multiplier, so the
    sample budget is not theirs to know."""
    kind = config["batch.controller"]
    bounds = dict(initial=config["batch.initial"], min=config["batch.min"], max=config["batch.max"])
    multiple = config["batch.noise_multiple"] or _DEFAULT_MULTIPLE.get(kind, 1.0)
    window = config["batch.window"]
    if kind == "batch_warmup":
        return BatchWarmup(
            multiple,
            factor=config["batch.factor"],
            confidence=config["batch.confidence"],
            window=window,
            decay_power=config["batch.decay_power"],
            clip=config["batch.clip"],
            **bounds,
        )
    if kind == "simigrad":
        return SimiGrad(target=config["batch.target"], window=window, **bounds)
    if kind == "critical_ramp":
        return CriticalBatchRamp(
            multiple,
            factor=config["batch.factor"],
            confidence=config["batch.confidence"],
            shrink=config["batch.shrink"],
            window=window,
            **bounds,
        )
    if kind == "damped_simigrad":
        return DampedSimiGrad(config["batch.target"], window=window, **bounds)
    if kind == "noise_scale":
        return NoiseScale(multiple=multiple, window=window, **bounds)
    if kind == "constant":
        return Constant(config["batch.initial"])
    samples = config["batch.ramp_samples"] or config["max_samples"] // 2
    return Ramp(config["batch.initial"], config["batch.max"], samples=samples)


def make_schedule(config: dict[str, Any]):
    total = config["max_samples"]
    return schedule_by_name(config["schedule.kind"], total, int(config["schedule.warmup"] * total))


def build(
    config: dict[str, Any], world: World | None = None, device: torch.device | None = None
) -> tuple[Problem, AdaptiveBatch, Precision]:
    """The task's problem on ``device``, the loop that trains it (its model in DDP on 2+
    ranks) and the precision its forward passes run in."""
    device = device if device is not None else torch.device("cpu")
    try:
        problem = TASKS[config["task"]].build(config)
    except ValueError as err:  # a setting the task cannot meet (train_samples)
        raise ConfigError(str(err)) from None
    problem.model.to(device)
    try:
        precision = Precision(config["precision"], device)
        return problem, _loop(config, problem, world, precision), precision
    except ValueError as err:  # settings the loop or an optimizer refuses
        raise ConfigError(str(err)) from None


def train_step(step: Any, problem: Problem, loop: AdaptiveBatch, precision: Precision) -> None:
    """One optimizer step of ``problem``: every micro-batch's loss on ``precision``'s device
    under its autocast, backward through ``step`` (which scales and measures), the update."""
    for batch in step.micro_batches():
        with precision.autocast():
            loss = problem.loss(loop.model, to_device(batch, precision.device))
        step.backward(loss)
    step.apply()


def _loop(
    config: dict[str, Any], problem: Problem, world: World | None, precision: Precision
) -> AdaptiveBatch:
    options: dict[str, Any] = {"lr": config["lr"], "weight_decay": config["weight_decay"]}
    accepted = get_optimizer_info(config["optimizer"]).signature().parameters
    if "impl" in accepted:
        options["impl"] = config["optimizer_impl"]
    if "gamma" in accepted:  # the vr-* optimizers
        options.update(gamma=config["vrgd.gamma"], normalizer=config["vrgd.normalizer"])
    sharded = world is not None and world.distributed and config["dist.strategy"] == "fsdp"
    if sharded:  # before the optimizer is built: fully_shard replaces the parameters
        if config["dist.compression"] != "none":
            raise ConfigError(
                "dist.compression compresses DDP's all-reduce; dist.strategy = 'fsdp' "
                "reduce-scatters without it: choose one"
            )
        shard_model(problem.model, precision.device)
    params: Any = problem.model
    if config["agvm"]:
        params = module_param_groups(problem.model, config["weight_decay"], config["agvm_rule"])
    optimizer = create_optimizer(params, config["optimizer"], **options)
    if config["agvm"]:
        optimizer = AGVM(
            optimizer,
            interval=config["agvm_interval"],
            start=config["agvm_start"],
            momentum=config["agvm_momentum"],
        )
    model: nn.Module = problem.model
    hook = None
    if world is not None and world.distributed and not sharded:
        on_gpu = precision.device.type == "cuda"
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[precision.device.index] if on_gpu else None,
            process_group=world.group,
        )
        if config["dist.compression"] == "powersgd":
            hook = _powersgd(config, world)
        elif config["dist.compression"] != "none":
            method = _METHOD.get(config["dist.compression"], config["dist.compression"])
            state = CompressionState(
                model,  # type: ignore[arg-type]
                method,
                config["dist.compressor"],
                config["dist.ratio"],
                eta=config["dist.sgdm_eta" if method == "ef21-sgdm" else "dist.eta"],
                warmup=config["dist.warmup"],
                seed=config["seed"],
            )
            hook = (state, compression_hook)
    elif config["dist.compression"] != "none":
        raise ConfigError(
            f"dist.compression = {config['dist.compression']!r} compresses the gradient "
            "traffic between processes: run with --nproc 2 or more"
        )
    return AdaptiveBatch(
        model,
        optimizer,
        problem.train,
        controller=make_controller(config),
        max_micro_batch=config["max_micro_batch"],
        min_sub_batches=config["min_sub_batches"],
        lr_scaling=config["batch.lr_scaling"],
        base_batch_size=config["batch.base"],
        schedule=make_schedule(config),
        similarity=None if config["batch.similarity"] == "auto" else config["batch.similarity"],
        comm_hook=hook,
        nonfinite=config["nonfinite"],
        seed=config["seed"],
        scaler=precision.scaler(),
        # batches reach a GPU from pinned memory, without blocking the host
        loader_options={"pin_memory": precision.device.type == "cuda"},
    )


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` sharded with FSDP2 over every process: each child module (each element of a
    ``ModuleList``) that holds parameters is one ``fully_shard`` unit, the root the last.

    One unit per layer gathers one layer's parameters at a time, as torchtitan
    shards a transformer block by block.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    units = []
    for child in model.children():
        parts = list(child) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        if isinstance(child, nn.ModuleDict):
            parts = list(child.values())
        units += [m for m in parts if any(p.requires_grad for p in m.parameters())]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _powersgd(config: dict[str, Any], world: World) -> tuple[Any, Any]:
    """torch's PowerSGD ``(state, hook)`` (Vogels et al. 2019), for comparisons."""
    state = powerSGD_hook.PowerSGDState(
        process_group=world.group,
        matrix_approximation_rank=config["dist.powersgd_rank"],
        start_powerSGD_iter=max(2, config["dist.warmup"]),
        random_seed=config["seed"],
    )
    return state, powerSGD_hook.powerSGD_hook

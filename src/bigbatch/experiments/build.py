"""From a run's plan (:mod:`.plan`) to its objects: problem, optimizer, controller, loop."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from ..batch.lr import schedule_by_name
from ..loop import AdaptiveBatch
from ..optim import AGVM, VRGD, create_optimizer, get_optimizer_info, module_param_groups
from ..parallel.compression import CompressionState, compression_hook
from ..parallel.world import World
from .config import ConfigError
from .device import Precision, resolve_device, to_device
from .plan import RunPlan, declared, make_controller
from .tasks import Problem


def run_device(plan: RunPlan) -> torch.device:
    """The device the run's ``device`` key names, on this machine; a name it cannot train
    on is one :class:`ConfigError`."""
    try:
        return resolve_device(plan.machine.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def make_schedule(plan: RunPlan):
    """The rate's schedule of a plan."""
    total, schedule = plan.run.max_samples, plan.schedule
    return schedule_by_name(schedule.kind, total, int(schedule.warmup * total), schedule.cooldown)


def build(
    plan: RunPlan, world: World | None = None, device: torch.device | None = None
) -> tuple[Problem, AdaptiveBatch, Precision]:
    """The task's problem on ``device``, the loop that trains it (its model in DDP on 2+
    ranks) and the precision its forward passes run in."""
    device = device if device is not None else torch.device("cpu")
    problem = build_problem(plan)
    problem.model.to(device)
    plan = fit_batches_to_data(plan, problem)
    try:
        precision = Precision(plan.machine.precision, device)
        return problem, _loop(plan, problem, world, precision), precision
    except ValueError as err:  # settings the loop or an optimizer refuses
        raise ConfigError(str(err)) from None


def build_problem(plan: RunPlan) -> Problem:
    """The task's data and model for ``plan`` (a :class:`ConfigError` where it cannot)."""
    try:
        return plan.task.build(plan.task_args)
    except ValueError as err:  # a setting the task cannot meet (train_samples)
        raise ConfigError(str(err)) from None


def fit_batches_to_data(plan: RunPlan, problem: Problem) -> RunPlan:
    """The plan with ``batch.max`` lowered to the training set's size where it is larger
    (noted in ``problem.info``); a first or smallest batch larger than the training set
    is a :class:`ConfigError`. A batch larger than the data would repeat samples within
    a step, and the noise estimates' finite-population correction assumes it does not."""
    try:
        size = len(problem.train)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset: no size to fit to
        return plan
    for key in ("batch.initial", "batch.min"):  # the controller's keys (its ``CONFIG``)
        if plan[key] > size:
            raise ConfigError(
                f"{key} = {plan[key]} is larger than the training set ({size:,} samples"
                f"{', train_samples' if plan.run.train_samples else ''})"
            )
    if plan["batch.max"] <= size:
        return plan
    problem.info["batch_max_lowered_from"] = plan["batch.max"]  # in the summary and report
    why = f"the training set's size (batch.max {plan['batch.max']:,} is larger)"
    return plan.replace("batch.max", size, why)


def check_batches_fit(plans: Iterable[RunPlan]) -> None:
    # fit_batches_to_data's refusals for runs yet to train (a command's every run, before
    # the first), each data set built once: its size is not the model's nor the seed's
    problems: dict[tuple, Problem] = {}
    for plan in plans:
        args = plan.task_args
        key = (plan.task.name, args.context, args.train_samples, repr(args.options))
        if key not in problems:
            problems[key] = build_problem(plan)
        fit_batches_to_data(plan, problems[key])


def train_step(step: Any, problem: Problem, model: nn.Module, precision: Precision) -> None:
    """One optimizer step of ``problem``: every micro-batch's loss through ``model`` on
    ``precision``'s device under its autocast, backward through ``step``, the update."""
    for batch in step.micro_batches():
        with precision.autocast():
            loss = problem.loss(model, to_device(batch, precision.device))
        step.backward(loss)
    step.apply()


def implementation(name: str, impl: str) -> dict[str, Any]:
    """How optimizer ``name`` is built for ``impl`` (torch's AdamW, SGD: ``fused=True``)."""
    accepted = get_optimizer_info(name).signature().parameters
    if "impl" in accepted:
        return {"impl": impl}
    return {"fused": True} if "fused" in accepted and impl == "fused" else {}


def training_model(model: nn.Module, mode: str) -> nn.Module:
    """``model`` compiled in ``mode`` (the ``compile`` key) unless it is ``"none"``."""
    if mode == "none":
        return model
    # a run's graphs alone, as in a process of its own: runs in one process (compare's arms)
    # each traced new ones, and from the fifth torch's recompile limit ran the model eagerly
    torch._dynamo.reset()
    return torch.compile(model, mode=None if mode == "default" else mode)


def _loop(
    plan: RunPlan, problem: Problem, world: World | None, precision: Precision
) -> AdaptiveBatch:
    opt, machine, batch, dist = plan.optimizer, plan.machine, plan.batch, plan.dist
    options: dict[str, Any] = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    options.update(implementation(opt.name, opt.impl))
    if get_optimizer_info(opt.name).vrgd_form:
        options.update(declared(plan, "vrgd.", VRGD.CONFIG))
    sharded = world is not None and world.distributed and dist.strategy == "fsdp"
    if dist.strategy == "fsdp" and not sharded:  # trains as asked, as "ddp" would on one
        warnings.warn(
            "dist.strategy = 'fsdp' shards the model over processes: this run's one process "
            "holds it whole (run with --nproc 2 or more to shard it)",
            stacklevel=2,
        )
    if sharded:  # before the optimizer is built: fully_shard replaces the parameters
        shard_model(problem.model, precision.device)
    params: Any = problem.model
    if opt.agvm:
        rule = plan["agvm.rule"]
        try:
            params = module_param_groups(problem.model, opt.weight_decay, rule)
        except ValueError as err:  # a rule that fits no parameter of this task's model
            raise ConfigError(f"agvm.rule = {rule!r}: {err}") from None
    optimizer = create_optimizer(params, opt.name, **options)
    if opt.agvm:
        optimizer = AGVM(optimizer, **declared(plan, "agvm.", AGVM.CONFIG))
    model: nn.Module = problem.model
    hook = None
    if world is not None and world.distributed and not sharded:
        on_gpu = precision.device.type == "cuda"
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[precision.device.index] if on_gpu else None,
            process_group=world.group,
        )
        hook = _comm_hook(plan, model, world)
    elif dist.compression != "none":
        raise ConfigError(
            f"dist.compression = {dist.compression!r} compresses the gradient "
            "traffic between processes: run with --nproc 2 or more"
        )
    return AdaptiveBatch(
        model,
        optimizer,
        problem.train,
        controller=make_controller(plan),
        max_micro_batch=machine.max_micro_batch,
        min_sub_batches=machine.min_sub_batches or None,
        noise_from=batch.noise_from,
        noise_units=batch.noise_units or None,
        statistics=True if batch.log_statistics else None,
        statistics_every=batch.statistics_every or "auto",
        lr_scaling=batch.lr_scaling,
        base_batch_size=batch.base,
        schedule=make_schedule(plan),
        max_lr_factor=opt.lr_max / opt.lr if opt.lr_max else None,
        similarity=None if batch.similarity == "auto" else batch.similarity,
        comm_hook=hook,
        nonfinite=machine.nonfinite,
        asynchronous=machine.asynchronous,
        seed=plan.run.seed,
        scaler=precision.scaler(),
        # batches reach a GPU from pinned memory, without blocking the host
        loader_options={"pin_memory": precision.device.type == "cuda"},
    )


def _comm_hook(plan: RunPlan, model: nn.Module, world: World) -> tuple[Any, Any] | None:
    """The ``(state, hook)`` that compresses DDP's all-reduce as ``dist.compression`` says
    (None: the plain all-reduce)."""
    dist = plan.dist
    if dist.compression == "powersgd":  # torch's PowerSGD (Vogels et al. 2019), to compare
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=world.group,
            matrix_approximation_rank=plan["dist.powersgd_rank"],
            # (a run planned before 1 was refused trained 2, torch's least: it resumes so)
            start_powerSGD_iter=max(2, plan["dist.warmup"]),
            random_seed=plan.run.seed,
        )
        return powersgd, powerSGD_hook.powerSGD_hook
    if dist.compression == "none":
        return None
    # topk-only: the hook's compression with no error control ("none")
    method = "none" if dist.compression == "topk-only" else dist.compression
    state = CompressionState(
        model,  # type: ignore[arg-type]
        method,
        eta=dist.sgdm_eta if method == "ef21-sgdm" else dist.eta,
        seed=plan.run.seed,
        **declared(plan, "dist.", CompressionState.CONFIG),
    )
    return state, compression_hook


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

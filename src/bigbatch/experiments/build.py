"""From a resolved config to the objects of a run: problem, optimizer, controller, loop."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from ..batch.controllers import CONTROLLERS, Controller, parse_points
from ..batch.lr import lr_factor, lr_rule_with_reason, schedule_by_name
from ..duration import Duration
from ..loop import AdaptiveBatch
from ..optim import AGVM, VRGD, create_optimizer, get_optimizer_info, module_param_groups
from ..parallel.compression import CompressionState, compression_hook
from ..parallel.world import World
from .config import (
    AUTO,
    BatchKeys,
    ConfigError,
    DistKeys,
    MachineKeys,
    OptimizerKeys,
    RunKeys,
    RunPlan,
    ScheduleKeys,
    fewest_sub_batches_of,
    fill_controller_defaults,
    resolve,
    schema,
    section,
    task_keys,
)
from .device import Precision, resolve_device, to_device
from .tasks import SEQUENCE_TASKS, TASKS, Problem


def plan_run(config: Mapping[str, Any]) -> RunPlan:
    """The run ``config`` (a config layer, or resolved) describes, every automatic value
    filled in one place:
    the keys left at 0 ("the task's default") from the task, those left at ``"auto"`` from
    the optimizer's recipe, the controller's own defaults and bounds, the micro-batches
    the statistics need, the LR rule and the rate; each with its origin
    (:attr:`RunPlan.origins`). A :class:`RunPlan` is returned as it is."""
    if isinstance(config, RunPlan):
        return config
    config = resolve(config)
    task = TASKS[config["task"]]
    origins: dict[str, str] = {}
    config = with_recipe(config, origins)
    _check_task_keys(config, task)
    for key, value in (
        ("model.width", task.width),
        ("model.depth", task.depth),
        ("model.context", task.context),
        ("max_samples", task.max_samples),
    ):
        if not config[key] and value:
            config[key] = value
            origins[key] = f"the {task.name} task's default"
    _schedule_shares(config, origins)
    kind = config["batch.controller"]
    if not config["min_sub_batches"] and config["noise_from"] != "auto":
        # what the statistics need, stated in the saved config (auto decides on the model)
        config["min_sub_batches"] = fewest_sub_batches_of(config)
        origins["min_sub_batches"] = (
            f"the fewest the statistics need (noise_from = {config['noise_from']})"
        )
    if kind == "ramp":
        _ramp_start(config, origins)
    fill_controller_defaults(config, origins)
    if config["max_samples"] < config["batch.initial"]:
        # the loop takes whole batches: such a budget would train one step of the first
        raise ConfigError(
            f"max_samples ({config['max_samples']:,}) is below the first batch "
            f"(batch.initial = {config['batch.initial']:,}): give a budget of a batch at least"
        )
    if not config["batch.base"]:
        config["batch.base"] = config["batch.initial"]
        origins["batch.base"] = "batch.initial: the rate is the one at the first batch"
    family = get_optimizer_info(config["optimizer"]).family
    config["batch.lr_scaling"], why = lr_rule_with_reason(
        config["batch.lr_scaling"],
        CONTROLLERS[kind],
        family,
        measured=task.lr_rule(config["optimizer"]),
    )
    if why != "as set":
        origins["batch.lr_scaling"] = why
    if not config["lr"]:
        _task_rate(config, task, origins)
    return RunPlan(config, origins)


def _check_task_keys(config: Mapping[str, Any], task: Any) -> None:
    """A :class:`ConfigError` for a key set that the task does not read: a sequence length
    where it has no sequences, another task's own key (``text.corpus``)."""
    if config["model.context"] and not task.context:
        raise ConfigError(
            f"model.context = {config['model.context']} is set, but the {task.name} task "
            f"has no sequences ({' and '.join(SEQUENCE_TASKS)} do)"
        )
    for key, owner in task_keys(task.name).items():
        if config[key] != schema()[key].default:
            raise ConfigError(
                f"{key} = {config[key]!r} is set, but the {task.name} task does not read it "
                f"({owner} does)"
            )


def _scaled_rate(task: Any, optimizer: str, batch: int, rule: str) -> tuple[float, str]:
    """The task's scaled rate at ``batch`` and why: its measured rate there, interpolated as
    a power of the batch between two measured batches, or carried from the nearest by
    ``rule``."""
    rates = task.measured_rates(optimizer)
    what = f"the {task.name} task's {optimizer} rate"
    if batch in rates:
        return rates[batch], f"{what} {rates[batch]:g} at batch {batch}"
    below = [b for b in rates if b < batch]
    above = [b for b in rates if b > batch]
    if below and above:
        low, high = below[-1], above[0]
        power = math.log(rates[high] / rates[low]) / math.log(high / low)
        rate = rates[low] * (batch / low) ** power
        return rate, (
            f"{what} between {rates[low]:g} at batch {low} and {rates[high]:g} at {high} "
            f"(x B^{power:.3g})"
        )
    near = below[-1] if below else above[0]
    factor, why = lr_factor(rule, batch, near), f"{what} {rates[near]:g} at batch {near}"
    if factor != 1:
        why += f" x {factor:.4g} ({rule} of {batch}/{near})"
    return rates[near] * factor, why


def _task_rate(config: dict[str, Any], task: Any, origins: dict[str, str]) -> None:
    """The task's rate for the optimizer at ``batch.base`` (held, or scaled:
    :func:`_scaled_rate`), and the task's ceiling on a step's rate."""
    if not config["lr_max"]:
        # a ceiling belongs to the rates it was measured with: only the task's own
        config["lr_max"] = task.lr_ceiling(config["optimizer"]) or 0.0
        if config["lr_max"]:
            origins["lr_max"] = f"the {task.name} task's ceiling for {config['optimizer']}"
    rule, optimizer = config["batch.lr_scaling"], config["optimizer"]
    try:
        if rule == "none":
            base_rate = task.lr(optimizer, held=True)
            why = f"the {task.name} task's {optimizer} rate {base_rate:g} held at every batch"
        else:
            base_rate, why = _scaled_rate(task, optimizer, config["batch.base"], rule)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    config["lr"] = base_rate
    origins["lr"] = why


def _ramp_start(config: dict[str, Any], origins: dict[str, str]) -> None:
    """A ramp's table of points gives its first batch: ``batch.initial`` left unset takes
    it, one set elsewhere is a :class:`ConfigError`; so is a length in tokens on a task
    without sequences."""
    text = config["batch.ramp_points"]
    points = parse_points(text) if text.strip() else []
    lengths = [("batch.ramp_points", w) for w, _ in points] or [
        ("batch.ramp_over", Duration.parse(config["batch.ramp_over"]))
    ]
    for key, length in lengths:
        if length.unit == "tokens" and not config["model.context"]:
            raise ConfigError(
                f"{key} = {config[key]!r} counts tokens, but the {config['task']} task has no "
                f"sequences ({' and '.join(SEQUENCE_TASKS)} do); give samples, steps or a "
                "share ('25%')"
            )
    if not points:
        return
    first = min(points, key=lambda point: point[0].value)[1]
    if config["batch.initial"] and config["batch.initial"] != first:
        raise ConfigError(
            f"batch.initial = {config['batch.initial']} but batch.ramp_points starts at "
            f"{first}; leave batch.initial unset (0) or make them agree"
        )
    if not config["batch.initial"]:
        origins["batch.initial"] = "the first of batch.ramp_points"
    config["batch.initial"] = first


def at_rate(config: dict[str, Any], lr: float) -> dict[str, Any]:
    """``config`` trained at rate ``lr`` (a grid point, a tuning trial).

    ``config`` is a config layer or a resolved config, not one that
    :func:`plan_run` has filled (its rate and ceiling would be fixed). Where
    it leaves the rate and the ceiling to its task and the task records a ceiling for
    the optimizer, the ceiling moves with the rate: a point at ``m`` times the task's
    rate is the task's recipe at ``m`` times its scale, so ×1 is exactly what
    ``bigbatch train`` runs. A rate or ceiling the config sets is its own and stays.
    """
    out = {**config, "lr": lr}
    if config.get("lr") or config.get("lr_max"):
        return out
    own = plan_run(config)
    if own["lr_max"]:
        out["lr_max"] = own["lr_max"] * (lr / own["lr"])  # exactly the ceiling at ×1
    return out


def _schedule_shares(config: dict[str, Any], origins: dict[str, str]) -> None:
    """``schedule.warmup`` and ``schedule.cooldown`` given as lengths ('20k samples',
    '1M tokens', '5%') as the fractions of ``max_samples`` the schedule takes."""
    total = config["max_samples"]
    for key in ("schedule.warmup", "schedule.cooldown"):
        text = config[key]
        if not isinstance(text, str):
            continue
        try:
            share = Duration.parse(text).share(**run_facts(config))
        except ValueError as err:
            raise ConfigError(f"{key} = {text!r}: {err}") from None
        if share > 1:
            raise ConfigError(f"{key} = {text!r} is longer than max_samples ({total:,})")
        config[key] = share
        origins[key] = f"{text!r} of max_samples {total:,}"


def with_recipe(config: dict[str, Any], origins: dict[str, str] | None = None) -> dict[str, Any]:
    """``config`` with the keys left at ``"auto"`` taken from its optimizer's recipe
    (``bigbatch.optim.RECIPES``); γ only for the VRGD forms, which take it."""
    recipe = get_optimizer_info(config["optimizer"]).recipe
    config = dict(config)
    for key, value in (
        ("weight_decay", recipe.weight_decay),
        ("schedule.kind", recipe.schedule),
        ("schedule.warmup", recipe.warmup),
        ("vrgd.gamma", recipe.options.get("gamma", AUTO)),
    ):
        if config[key] == AUTO:
            config[key] = value
            if origins is not None and value != AUTO:
                origins[key] = f"the {config['optimizer']} recipe"
    return config


def run_device(config: dict[str, Any]) -> torch.device:
    """The device the run's ``device`` key names, on this machine; a name it cannot train
    on is one :class:`ConfigError`."""
    try:
        return resolve_device(section(MachineKeys, config).device)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def make_controller(config: dict[str, Any]) -> Controller:
    """The controller a config names, built from the keys it declares (its ``CONFIG``),
    after :func:`plan_run` has filled in its own defaults. The noise-following
    controllers hold the batch while the rate warms up by watching the schedule
    multiplier, so the sample budget is not theirs to know."""
    cls = CONTROLLERS[config["batch.controller"]]
    # the run's facts a controller that reads durations (Ramp) takes
    accepted = inspect.signature(cls).parameters
    facts = {name: value for name, value in run_facts(config).items() if name in accepted}
    try:
        return cls(**_declared(config, "batch.", cls.CONFIG), **facts)
    except ValueError as err:
        # a rule the keys' own bounds do not hold (Seesaw's growth of 0 or >= 1): the error
        # names the argument; say which key set it
        named = str(err).split(maxsplit=1)[0]
        key = next((f"batch.{k}" for k, knob in cls.CONFIG.items() if knob.param == named), None)
        raise ConfigError(f"{key} = {config[key]!r}: {err}" if key else str(err)) from None


def run_facts(config: dict[str, Any]) -> dict[str, Any]:
    """What converting a duration needs to know of a run (:meth:`Duration.elapsed`'s
    keywords): its budget in samples and a sequence's tokens."""
    return {"budget": config["max_samples"], "tokens_per_sample": config["model.context"] or None}


def intervals(config: dict[str, Any]) -> dict[str, int | Duration]:
    """``eval_every`` and ``checkpoint_every`` as a run ticks them: a whole number of
    optimizer steps, or a duration the run can measure (a :class:`ConfigError` naming the
    key where it cannot: tokens on a task without sequences)."""
    out: dict[str, int | Duration] = {}
    for key in ("eval_every", "checkpoint_every"):
        every = Duration.interval(config[key])
        if isinstance(every, Duration):
            try:
                every.check(**run_facts(config))
            except ValueError as err:
                raise ConfigError(f"{key} = {config[key]!r}: {err}") from None
        out[key] = every
    return out


def _declared(config: dict[str, Any], prefix: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """A component's arguments from the config keys it declares."""
    return {knob.param: config[f"{prefix}{key}"] for key, knob in knobs.items()}


def make_schedule(config: dict[str, Any]):
    """The rate's schedule of a config :func:`plan_run` has filled."""
    total, schedule = config["max_samples"], section(ScheduleKeys, config)
    return schedule_by_name(schedule.kind, total, int(schedule.warmup * total), schedule.cooldown)


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
    config = fit_batches_to_data(config, problem)
    try:
        precision = Precision(config["precision"], device)
        return problem, _loop(config, problem, world, precision), precision
    except ValueError as err:  # settings the loop or an optimizer refuses
        raise ConfigError(str(err)) from None


def fit_batches_to_data(config: dict[str, Any], problem: Problem) -> dict[str, Any]:
    """The config with ``batch.max`` lowered to the training set's size where it is larger
    (noted in ``problem.info``); a first or smallest batch larger than the training set
    is a :class:`ConfigError`. A batch larger than the data would repeat samples within
    a step, and the noise estimates' finite-population correction assumes it does not."""
    try:
        size = len(problem.train)  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset: no size to fit to
        return config
    for key in ("batch.initial", "batch.min"):
        if config[key] > size:
            raise ConfigError(
                f"{key} = {config[key]} is larger than the training set ({size:,} samples"
                f"{', train_samples' if config.get('train_samples') else ''})"
            )
    if config["batch.max"] <= size:
        return config
    problem.info["batch_max_lowered_from"] = config["batch.max"]  # in the summary and report
    return {**config, "batch.max": size}


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
    run, machine = section(RunKeys, config), section(MachineKeys, config)
    batch, dist = section(BatchKeys, config), section(DistKeys, config)
    options: dict[str, Any] = {"lr": run.lr, "weight_decay": run.weight_decay}
    accepted = get_optimizer_info(run.optimizer).signature().parameters
    if "impl" in accepted:
        options["impl"] = run.optimizer_impl
    if "gamma" in accepted:  # the vr-* optimizers
        options.update(_declared(config, "vrgd.", VRGD.CONFIG))
    sharded = world is not None and world.distributed and dist.strategy == "fsdp"
    if sharded:  # before the optimizer is built: fully_shard replaces the parameters
        if dist.compression != "none":
            raise ConfigError(
                "dist.compression compresses DDP's all-reduce; dist.strategy = 'fsdp' "
                "reduce-scatters without it: choose one"
            )
        shard_model(problem.model, precision.device)
    params: Any = problem.model
    agvm = section(OptimizerKeys, config).agvm
    if agvm:
        params = module_param_groups(problem.model, run.weight_decay, config["agvm.rule"])
    optimizer = create_optimizer(params, run.optimizer, **options)
    if agvm:
        optimizer = AGVM(optimizer, **_declared(config, "agvm.", AGVM.CONFIG))
    model: nn.Module = problem.model
    hook = None
    if world is not None and world.distributed and not sharded:
        on_gpu = precision.device.type == "cuda"
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[precision.device.index] if on_gpu else None,
            process_group=world.group,
        )
        hook = _comm_hook(config, model, world)
    elif dist.compression != "none":
        raise ConfigError(
            f"dist.compression = {dist.compression!r} compresses the gradient "
            "traffic between processes: run with --nproc 2 or more"
        )
    return AdaptiveBatch(
        model,
        optimizer,
        problem.train,
        controller=make_controller(config),
        max_micro_batch=machine.max_micro_batch,
        min_sub_batches=machine.min_sub_batches or None,
        noise_from=batch.noise_from,
        noise_units=batch.noise_units or None,
        statistics=True if batch.log_statistics else None,
        statistics_every=batch.statistics_every or "auto",
        lr_scaling=batch.lr_scaling,
        base_batch_size=batch.base,
        schedule=make_schedule(config),
        max_lr_factor=run.lr_max / run.lr if run.lr_max else None,
        similarity=None if batch.similarity == "auto" else batch.similarity,
        comm_hook=hook,
        nonfinite=machine.nonfinite,
        seed=run.seed,
        scaler=precision.scaler(),
        # batches reach a GPU from pinned memory, without blocking the host
        loader_options={"pin_memory": precision.device.type == "cuda"},
    )


def _comm_hook(config: dict[str, Any], model: nn.Module, world: World) -> tuple[Any, Any] | None:
    """The ``(state, hook)`` that compresses DDP's all-reduce as ``dist.compression`` says
    (None: the plain all-reduce)."""
    dist = section(DistKeys, config)
    if dist.compression == "powersgd":  # torch's PowerSGD (Vogels et al. 2019), to compare
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=world.group,
            matrix_approximation_rank=config["dist.powersgd_rank"],
            start_powerSGD_iter=max(2, config["dist.warmup"]),
            random_seed=config["seed"],
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
        seed=config["seed"],
        **_declared(config, "dist.", CompressionState.CONFIG),
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

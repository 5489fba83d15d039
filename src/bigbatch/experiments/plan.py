"""A run's plan: every automatic value of a config filled in one place, with its origin
(the task's defaults, the optimizer's recipe, the controller's own defaults and bounds, the
micro-batches the statistics need, the LR rule, the rate), read as typed sections."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

from .._checks import batch_bounds
from ..assembly import SUB_BATCHES, fewest_sub_batches
from ..batch.controllers import CONTROLLERS, Controller, contract_of, parse_points
from ..batch.lr import FAMILY_RULES, lr_factor, lr_rule_with_reason
from ..duration import Duration
from ..optim import get_optimizer_info
from .config import (
    AUTO,
    BatchKeys,
    ConfigError,
    DistKeys,
    Key,
    LogKeys,
    MachineKeys,
    ModelKeys,
    OptimizerKeys,
    RunKeys,
    ScheduleKeys,
    resolve,
    schema,
    section,
    task_keys,
)
from .tasks import SEQUENCE_TASKS, TASKS, TaskArgs


class RunPlan(Mapping[str, Any]):
    """A resolved config with every automatic value filled in (:func:`plan_run`),
    read-only: what a run trains with, as its ``config.toml`` saves it, read as typed
    sections (``plan.optimizer.lr``, ``plan.batch.noise_from``), with where each filled value
    came from (``origins``, in words: ``bigbatch train --explain``). A run is planned once:
    planning a plan returns it."""

    def __init__(self, values: Mapping[str, Any], origins: Mapping[str, str] | None = None):
        self._values = dict(values)
        #: each filled key's source, in words
        self.origins: dict[str, str] = dict(origins or {})
        self.run = section(RunKeys, values)
        self.model = section(ModelKeys, values)
        self.optimizer = section(OptimizerKeys, values)
        self.machine = section(MachineKeys, values)
        self.log = section(LogKeys, values)
        self.batch = section(BatchKeys, values)
        self.schedule = section(ScheduleKeys, values)
        self.dist = section(DistKeys, values)
        self.task = TASKS[self.run.task]
        #: what the task's build reads: the model's size, the seed, the training set, the
        #: task's own keys
        own = self.task.options and section(self.task.options, values)
        model, run = self.model, self.run
        self.task_args = TaskArgs(
            model.width, model.depth, model.context, run.seed, run.train_samples, options=own
        )
        #: what converting a duration needs to know of the run (:func:`run_facts`)
        self.facts = run_facts(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"RunPlan({self._values!r})"

    def replace(self, key: str, value: Any, origin: str) -> RunPlan:
        """This plan with ``key`` set to ``value`` from ``origin``."""
        return RunPlan({**self._values, key: value}, {**self.origins, key: origin})


def plan_run(config: Mapping[str, Any]) -> RunPlan:
    """The run ``config`` (a config layer, or resolved) describes, every automatic value
    filled in one place: the keys left at 0 ("the task's default") from the task, those
    left at ``"auto"`` from the optimizer's recipe, the controller's own defaults and
    bounds, the micro-batches the statistics need, the LR rule and the rate; each with its
    origin (:attr:`RunPlan.origins`). A :class:`RunPlan` is returned as it is."""
    if isinstance(config, RunPlan):
        return config
    config = resolve(config)
    task = TASKS[config["task"]]
    origins: dict[str, str] = {}
    config = with_recipe(config, origins)
    _check_task_keys(config, task)
    _check_dist(config)
    if config["asynchronous"]:
        _asynchronous_impl(config, origins)
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
    if not config["min_sub_batches"] and config["noise_from"] == "examples":
        # what the statistics need, stated in the saved config (auto decides on the model;
        # the sub-batches' need is shared by the processes, however many a resume has)
        config["min_sub_batches"] = fewest_sub_batches_of(config)
        origins["min_sub_batches"] = "the fewest the statistics need (noise_from = examples)"
    elif not config["min_sub_batches"] and config["noise_from"] == "sub_batches":
        origins["min_sub_batches"] = (
            f"0: the fewest the statistics need, {SUB_BATCHES} micro-batches shared by the "
            "processes"
        )
    if kind == "ramp":
        _ramp_start(config, origins)
    _warn_of_unread_keys(config)
    fill_controller_defaults(config, origins)
    _check_bounds(config, origins)
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
    measured = task.lr_rule(config["optimizer"])
    config["batch.lr_scaling"], why = lr_rule_with_reason(
        config["batch.lr_scaling"], CONTROLLERS[kind], family, measured
    )
    if why != "as set":
        origins["batch.lr_scaling"] = why
    if not config["lr"]:
        _task_rate(config, task, origins, measured or FAMILY_RULES.get(family, "sqrt"))
    plan = RunPlan(config, origins)
    # what only the interval or the controller's own rules refuse: one line, before anything
    intervals(plan)
    make_controller(plan)
    return plan


def _warn_of_unread_keys(config: Mapping[str, Any]) -> None:
    # a key set for a controller (or the VRGD forms, or a compression) that the run's does
    # not read: warned of, not refused as another task's keys are, since a study's base
    # config sets the keys of its arms' several controllers; a saved config's keys are as
    # the fill wrote them (below)
    for key in schema().values():
        reader = unread_by(config, key)
        if reader is None:
            continue
        unset = {key.default}
        if key.owners:  # what fill_controller_defaults writes for a controller that reads none
            unset.add(next(iter(key.owners.values())))
        if config[key.name] not in unset:
            warnings.warn(f"{key.name} = {config[key.name]!r} is set, but {reader}", stacklevel=2)


def unread_by(config: Mapping[str, Any], key: Key) -> str | None:
    # which of the run's components, a controller, VRGD or a compression, does not read key
    # and which do ("the constant controller does not read it (seesaw does)"); None where
    # the run reads it
    if not key.readers or key.name in ("batch.initial", "batch.min", "batch.max"):
        return None  # (the bounds: the plan checks and moves them for every controller)
    kind, optimizer = config["batch.controller"], config["optimizer"]
    if key.name.startswith("batch."):
        chosen, reader = kind, f"the {kind} controller"
    elif key.name.startswith("vrgd."):
        chosen, reader = "vr-*" if optimizer.startswith("vr-") else optimizer, optimizer
    elif key.name.startswith("dist."):
        chosen = config["dist.compression"]
        reader = f"dist.compression = {chosen!r}"
    else:
        return None
    if chosen in key.readers:
        return None
    does = "does" if len(key.readers) == 1 else "do"
    return f"{reader} does not read it ({', '.join(key.readers)} {does})"


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


def _task_rate(config: dict[str, Any], task: Any, origins: dict[str, str], static: str) -> None:
    """The task's rate for the optimizer at ``batch.base`` (held, or :func:`_scaled_rate`:
    by the run's rule, ``static`` under AdaScale), and the task's ceiling on a step's rate."""
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
            # AdaScale's gain grows the base batch's rate as the batch grows (1 without
            # statistics): the rate at the base batch itself is carried as a static one
            carry = static if rule.startswith("adascale") else rule
            base_rate, why = _scaled_rate(task, optimizer, config["batch.base"], carry)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    if config["max_samples"] > task.max_samples:
        # measured on text: at 4x the budget the best rate is half the budget's own
        # (docs/results.md, "The default's start")
        times = config["max_samples"] / task.max_samples
        why += (
            f", measured at the task's budget of {task.max_samples:,} samples; at {times:.3g}x "
            "it a lower rate may train better (bigbatch tune)"
        )
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
    info = get_optimizer_info(config["optimizer"])
    recipe, impl = info.recipe, config["optimizer_impl"]
    if "impl" not in info.signature().parameters and impl not in ("foreach", "fused"):
        raise ConfigError(  # (built as foreach, unsaid)
            f"optimizer_impl = {impl!r}: {info.name} is torch's, which takes 'foreach' or "
            "'fused' (fused=True)"
        )
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


def _asynchronous_impl(config: dict[str, Any], origins: dict[str, str]) -> None:
    """``ConfigError`` unless the optimizer can skip a step on the device; then built fused."""
    name = config["optimizer"]
    info = get_optimizer_info(name)
    # torch's fused optimizers take found_inf; a VR form reads each step's statistics first
    if "fused" not in info.signature().parameters or info.vrgd_form or config["agvm.enabled"]:
        raise ConfigError(
            f"asynchronous = true skips a non-finite step on the device, which {name}"
            f"{' under AGVM' if config['agvm.enabled'] else ''} cannot: use optimizer = 'adamw' or "
            "'sgd' (built fused), or asynchronous = false"
        )
    if config["optimizer_impl"] != "fused":
        config["optimizer_impl"] = "fused"
        origins["optimizer_impl"] = "asynchronous = true: a fused step skips a non-finite one"


def run_facts(config: Mapping[str, Any]) -> dict[str, Any]:
    """What converting a duration needs to know of a run (:meth:`Duration.elapsed`'s
    keywords): its budget in samples and a sequence's tokens."""
    return {"budget": config["max_samples"], "tokens_per_sample": config["model.context"] or None}


def intervals(plan: RunPlan) -> dict[str, int | Duration]:
    """``eval_every`` and ``checkpoint_every`` as a run ticks them: a whole number of
    optimizer steps, or a duration the run can measure (a :class:`ConfigError` naming the
    key where it cannot: tokens on a task without sequences)."""
    out: dict[str, int | Duration] = {}
    for key, given in (
        ("eval_every", plan.machine.eval_every),
        ("checkpoint_every", plan.machine.checkpoint_every),
    ):
        every = Duration.interval(given)
        if isinstance(every, Duration):
            try:
                every.check(**plan.facts)
            except ValueError as err:
                raise ConfigError(f"{key} = {given!r}: {err}") from None
        out[key] = every
    return out


def _check_dist(config: Mapping[str, Any]) -> None:
    """A :class:`ConfigError` for what FSDP2 or a compression cannot do, before a launcher
    starts the ranks."""
    if config["dist.compression"] == "powersgd" and config["dist.warmup"] < 2:
        # torch's PowerSGD compresses from DDP's third iteration at the earliest (its
        # buckets are rebuilt after the first): a warm-up of 1 would silently be 2
        raise ConfigError(
            f"dist.warmup = {config['dist.warmup']}: torch's PowerSGD needs 2 or more "
            "uncompressed steps (DDP rebuilds its buckets after the first)"
        )
    if config["dist.strategy"] != "fsdp":
        return
    if config["dist.compression"] != "none":
        raise ConfigError(
            "dist.compression compresses DDP's all-reduce; dist.strategy = 'fsdp' "
            "reduce-scatters without it: choose one"
        )
    if config["batch.similarity"] == "split":
        raise ConfigError(
            "batch.similarity = 'split' needs each half's gradient, which FSDP2's "
            "reduce-scatter does not give: use 'scalar' under dist.strategy = 'fsdp'"
        )
    if get_optimizer_info(config["optimizer"]).vrgd_form or config["agvm.enabled"]:
        what = "agvm.enabled" if config["agvm.enabled"] else f"optimizer = {config['optimizer']!r}"
        raise ConfigError(
            f"{what} keeps state that a checkpoint under dist.strategy = 'fsdp' cannot hold "
            "(VRGD's and AGVM's, beside the base optimizer's): use dist.strategy = 'ddp'"
        )


def _check_bounds(config: Mapping[str, Any], origins: Mapping[str, str]) -> None:
    """A :class:`ConfigError` where the batch bounds, the controller's own filled in,
    disagree: a first batch outside them, or a smallest batch below the micro-batches
    the statistics need (every sub-batch needs a sample)."""
    names = ("batch.initial", "batch.min", "batch.max")
    try:
        batch_bounds(*(config[n] for n in names), names=names)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # 0: what the statistics need (auto: at least the one micro-batch the examples need)
    fewest = config["min_sub_batches"] or fewest_sub_batches_of(config)
    # a smallest batch moved to a first batch set below it is that key's value
    moved = f"; from {origins['batch.min']}" if "batch.min" in origins else ""
    smallest = f"batch.min ({config['batch.min']}{moved})"
    if config["batch.min"] < fewest:
        raise ConfigError(
            f"{smallest} is below min_sub_batches ({fewest}): every sub-batch needs a sample"
        )
    reads = contract_of(CONTROLLERS[config["batch.controller"]]).needs_statistics
    if config["batch.min"] < 2 and (reads or config["log_statistics"]):
        raise ConfigError(f"{smallest} is below 2: the noise statistics need two examples a step")


def fewest_sub_batches_of(config: Mapping[str, Any]) -> int:
    """The micro-batches per step a config's statistics need (``min_sub_batches = 0``), by
    the loop's own rule (:func:`bigbatch.assembly.fewest_sub_batches`): per-example
    statistics keep a split for a measured similarity, asked for or read by the
    controller (SimiGrad's rules); ``auto`` counts as per-example, its least need."""
    split = (
        config["batch.similarity"] == "split"
        or contract_of(CONTROLLERS[config["batch.controller"]]).reads_similarity
    )
    return fewest_sub_batches(True, config["noise_from"] != "sub_batches", split)


def fill_controller_defaults(config: dict[str, Any], origins: dict[str, str] | None = None) -> None:
    """The chosen controller's own defaults for the batch keys left at 0 (those whose
    controllers differ: :attr:`Key.owners`), so a run's saved config says what it ran
    with. Where a bound left at its default excludes what was set, only what was set was
    asked for: such a bound moves to a first batch set outside it (a constant batch of 8
    needs no ``batch.min = 8``) or to the other bound set past it (``batch.max = 8`` lowers
    the default ``batch.min``), and the controller's own first batch is raised to
    ``batch.min`` or lowered to ``batch.max``."""
    kind, origins = config["batch.controller"], origins if origins is not None else {}
    own_first = not config["batch.initial"]
    left = [n for n in ("batch.min", "batch.max") if config[n] == schema()[n].default]
    for key in schema().values():
        if key.owners is not None and config[key.name] == key.default:
            # a controller that takes no such key (a constant batch has no minimum) gets
            # the first owner's value, as component_keys gives one without a default
            owner = kind if kind in key.owners else next(iter(key.owners))
            config[key.name] = key.owners[owner]
            if config[key.name] != key.default:
                unread = "" if owner == kind else f" ({kind} does not read it)"
                origins[key.name] = f"the {owner} controller's default{unread}"
    _move_default_bounds(config, origins, own_first, left)


def _move_default_bounds(
    config: dict[str, Any], origins: dict[str, str], own_first: bool, left: list[str]
) -> None:
    """:func:`fill_controller_defaults`' rule for the batch bounds: a bound ``left`` at its
    default moves to what was set past it, the controller's own first batch into them."""
    first = config["batch.initial"]
    moves = []  # (bound, set key that moves it)
    if not own_first:  # a first batch set outside a bound left at its default
        moves += [(n, "batch.initial") for n in left]
    other = {"batch.min": "batch.max", "batch.max": "batch.min"}
    if len(left) == 1:  # the other bound, set past it
        moves.append((left[0], other[left[0]]))
    for bound, cause in moves:
        outside = (
            config[cause] < config[bound] if bound == "batch.min" else config[cause] > config[bound]
        )
        if outside:
            origins[bound] = f"{cause} ({config[cause]:,}), set past its default {config[bound]:,}"
            config[bound] = config[cause]
    if own_first:
        inside = min(config["batch.max"], max(config["batch.min"], first))
        if inside != first:
            own = origins.get("batch.initial", "the controller's default")
            origins["batch.initial"] = f"{own} {first}, moved into [batch.min, batch.max]"
        config["batch.initial"] = inside


def make_controller(plan: RunPlan) -> Controller:
    """The controller a plan names, built from the keys it declares (its ``CONFIG``) as
    :func:`plan_run` filled them in. The noise-following
    controllers hold the batch while the rate warms up by watching the schedule
    multiplier, so the sample budget is not theirs to know."""
    cls = CONTROLLERS[plan.batch.controller]
    # the run's facts a controller that reads durations (Ramp) takes
    accepted = inspect.signature(cls).parameters
    facts = {name: value for name, value in plan.facts.items() if name in accepted}
    try:
        return cls(**declared(plan, "batch.", cls.CONFIG), **facts)
    except ValueError as err:
        # a rule the keys' own bounds do not hold (Seesaw's growth of 0 or >= 1): the error
        # names the argument; say which key set it
        named = str(err).removeprefix(f"{cls.__name__}'s ").split(maxsplit=1)[0]
        key = next((f"batch.{k}" for k, knob in cls.CONFIG.items() if knob.param == named), None)
        raise ConfigError(f"{key} = {plan[key]!r}: {err}" if key else str(err)) from None


def declared(plan: RunPlan, prefix: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """A component's arguments from the config keys it declares."""
    return {knob.param: plan[f"{prefix}{key}"] for key, knob in knobs.items()}

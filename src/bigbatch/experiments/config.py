"""The experiment configuration's schema: keys, TOML files, ``--set``, each value checked.

Every key is a field of a frozen section class (:data:`RUN_SECTIONS`; :func:`run_key`,
:func:`recipe_key` for a number the optimizer's recipe fills) or a component's declared
knob (:data:`COMPONENTS`), with its default, type and meaning (``bigbatch train --help``).
TOML tables are dotted keys (``[batch] target = 0.5`` is ``--set batch.target=0.5``); a bad
value is one :class:`ConfigError` naming the key. :mod:`.plan` fills the automatic values.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the cli extra brings tomli
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None


from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from .._checks import did_you_mean
from ..batch.controllers import CONTROLLERS, contract_of
from ..batch.lr import LR_RULES, SCHEDULES
from ..batch.plan import MAX_MICRO_BATCH
from ..batch.sampler import MAX_SEED
from ..duration import Duration
from ..knobs import NO_DEFAULT, Knob, setting, signature_defaults
from ..optim import AGVM, IMPLS, VRGD, list_optimizers, module_param_groups
from ..optim.agvm import GROUPS_CONFIG
from ..options import AUTO_EXAMPLES, AUTO_MOST, NOISE_SOURCES, NONFINITE_POLICIES, StepOptions
from ..parallel.compression import DEFAULT_ETA, METHODS, CompressionState
from ..stats import SIMILARITY_MODES
from .device import COMPILE_MODES, PRECISIONS
from .tasks import SEQUENCE_TASKS, TASKS


def _toml() -> Any:
    """The TOML reader; without it (Python 3.10 without the cli extra) the error the
    command line turns into "install bigbatch[cli]"."""
    if tomllib is None:
        raise ModuleNotFoundError("No module named 'tomli'", name="tomli")
    return tomllib


#: the config key of torch's PowerSGD hook (its state's own default rank)
POWERSGD_CONFIG = {
    "powersgd_rank": Knob(
        "matrix_approximation_rank", "PowerSGD's matrix approximation rank", low=1
    )
}

#: config values of dist.compression beside the hook's methods
COMPRESSION_CHOICES = ("none", *(m for m in METHODS if m != "none"), "topk-only", "powersgd")


class ConfigError(ValueError):
    """A configuration a run cannot start with; the message names the key and value."""


@dataclass(frozen=True)
class Key:
    """One config key: its name, default and :class:`~bigbatch.knobs.Knob` (meaning,
    bounds, choices, grammar), as read off a section's field or a component's knob
    (:func:`schema`)."""

    name: str
    default: Any
    knob: Knob
    #: each component's own default where the components sharing the key differ (the key's
    #: ``default`` then means "the chosen component's own")
    owners: Mapping[str, Any] | None = None
    #: a number key whose default is :data:`AUTO`: the optimizer's recipe fills it
    #: (``bigbatch.optim.RECIPES``)
    from_recipe: bool = False
    #: the components that read a component's key (a controller's: the controllers')
    readers: tuple[str, ...] = ()

    @property
    def kind(self) -> type:
        return float if self.from_recipe else type(self.default)


#: the value of a key that the chosen optimizer's recipe fills in
AUTO = "auto"


def _whole_steps(text: str) -> NoReturn:
    """``statistics_every`` takes no text: 0 is what the library calls ``"auto"``."""
    raise ValueError("give a whole number of steps (0: by the batch, the library's 'auto')")


def share_of_budget(text: str) -> Duration:
    """A length of the schedule as text: samples, tokens or a share ('5%'); the schedule
    runs in samples, so optimizer steps, whose samples a changing batch decides, are not
    one."""
    duration = Duration.parse(text)
    if duration.unit == "steps":
        raise ValueError(
            "the schedule is laid over samples: give samples, tokens or a share ('5%'), "
            "not optimizer steps"
        )
    return duration


#: keys by an earlier name: refused with the name they have now (no old names before 1.0)
RENAMED = {
    "batch.ramp_samples": "batch.ramp_over",
    "agvm": "agvm.enabled",
    "agvm_rule": "agvm.rule",
    "agvm_interval": "agvm.interval",
    "agvm_start": "agvm.start",
    "agvm_momentum": "agvm.momentum",
    "noise_examples": "noise_units",
}


def component_keys(
    prefix: str, components: Mapping[str, tuple[Any, Mapping[str, Knob]]]
) -> list[Key]:
    """The keys that components declare (``bigbatch.knobs``), each once.

    A key several components take has their common default; where their
    defaults differ (only the controllers' do), its default is 0 ("the chosen
    controller's own", filled in by :func:`~.plan.fill_controller_defaults`), the owners'
    values listed in its help, and a component with no default of its own (a
    constant batch) takes the first component's (the registry's default). A
    key only some take names them in its help.
    """
    uses: dict[str, list[tuple[str, Knob, Any]]] = {}
    for name, (component, knobs) in components.items():
        defaults = signature_defaults(component, knobs)
        for key, knob in knobs.items():
            uses.setdefault(key, []).append((name, knob, defaults[key]))
    keys = []
    for key, used in uses.items():
        knob = used[0][1]
        given = {n: d for n, _, d in used if d is not None and d is not NO_DEFAULT}
        names = [n for n, _, _ in used]
        # which components take it, where only a few of many do
        few = len(components) > 2 and len(names) <= len(components) / 2
        scope = f"{', '.join(names)}: " if few else ""
        low, low_open, owners = knob.low, knob.low_open, None
        default = next(iter(given.values()))
        if len(set(given.values())) > 1:
            first = next(iter(given))
            owners = {n: given.get(n, given[first]) for n in names}
            default = type(default)(0)
            low, low_open = min(low if low is not None else 0, 0), False
            own = ", ".join(f"{n} {v}" for n, v in given.items())
            others = f"; the others {first}'s" if len(given) < len(names) else ""
            note = f"; 0: the controller's own ({own}{others})"
        else:
            note = ""
        knob = replace(knob, help=f"{scope}{knob.help}{note}", low=low, low_open=low_open)
        keys.append(Key(f"{prefix}{key}", default, knob, owners, readers=tuple(names)))
    return keys


def run_key(key: str, default: Any, help: str, **bounds: Any) -> Any:
    """A run key as a field of its section: its whole dotted name, default, help and bounds
    (:func:`bigbatch.knobs.setting`, the commands' options' idiom)."""
    return setting(default, help, key=key, **bounds)


def recipe_key(key: str, help: str = "", *, knob: Knob | None = None, **bounds: Any) -> Any:
    """A number key that defaults to the optimizer's recipe (:data:`AUTO`): its help and
    bounds, or a component's ``knob``."""
    knob = knob or Knob("", help, **bounds)
    knob = replace(knob, help=f"{knob.help}; auto: the optimizer's recipe")
    return field(default=AUTO, metadata={"knob": knob, "key": key, "recipe": True})


@dataclass(frozen=True)
class RunKeys:
    """The task, the seed and the budget."""

    task: str = run_key(
        "task", "mnist1d", "the task to train (see `bigbatch tasks`)", choices=tuple(TASKS)
    )
    seed: int = run_key(
        "seed", 0, "seed for model initialisation and data order", low=0, high=MAX_SEED
    )
    max_samples: int = run_key(
        "max_samples", 0, "training budget in samples; 0: the task's default", low=0
    )
    train_samples: int = run_key(
        "train_samples",
        0,
        "train on the task's first N training samples only (a smaller set opens a "
        "generalization gap); 0: all of them",
        low=0,
    )
    stop_at_target: bool = run_key(
        "stop_at_target",
        False,
        "end the run at the first evaluation that reaches the task's target (for "
        "steps-to-target studies; the schedule still spans max_samples)",
    )


@dataclass(frozen=True)
class ModelKeys:
    """The task's model's size (each task's own keys beside these: ``Task.options``)."""

    width: int = run_key(
        "model.width",
        0,
        "model width (channels, hidden units or d_model); 0: the task's default",
        low=0,
    )
    depth: int = run_key("model.depth", 0, "model depth (layers); 0: the task's default", low=0)
    context: int = run_key(
        "model.context",
        0,
        "sequence length of the sequence tasks "
        f"({', '.join(SEQUENCE_TASKS)}); 0: the task's default",
        low=0,
    )


@dataclass(frozen=True)
class OptimizerKeys:
    """The optimizer, its rate and recipe, the VRGD forms' γ and AGVM's switch (beside
    these, the keys the VRGD forms and AGVM declare: :data:`COMPONENTS`)."""

    name: str = run_key(
        "optimizer",
        "lamb",
        "optimizer name (bigbatch.optim.list_optimizers())",
        choices=tuple(list_optimizers()),
    )
    impl: str = run_key(
        "optimizer_impl",
        "foreach",
        "impl of bigbatch optimizers (fused: Triton kernels, CUDA only); torch's adamw and "
        "sgd take fused (fused=True) and foreach",
        choices=IMPLS,
    )
    lr: float = run_key(
        "lr",
        0.0,
        "learning rate at batch.base; 0: the task's measured rate for the optimizer's "
        "family and LR rule (see `bigbatch tasks`)",
        low=0,
    )
    lr_max: float = run_key(
        "lr_max",
        0.0,
        "the largest rate the batch rule and the schedule give a step (a rule that "
        "scales the rate stops there); 0: the task's measured ceiling for the "
        "optimizer where it has one and lr is the task's own, else none",
        low=0,
    )
    weight_decay: float | str = recipe_key(
        "weight_decay",
        "weight decay, not on biases and norms (coupled for SGD and LARS, decoupled for "
        "AdamW and LAMB)",
        low=0,
    )
    gamma: float | str = recipe_key("vrgd.gamma", knob=VRGD.CONFIG["gamma"])
    agvm: bool = run_key(
        "agvm.enabled",
        False,
        "AGVM: per-module-group LR from gradient variance (Xue et al. 2022)",
    )


@dataclass(frozen=True)
class MachineKeys:
    """How a run uses its machine: micro-batches, evaluation, checkpoints, device,
    precision, non-finite steps."""

    max_micro_batch: int = run_key(
        "max_micro_batch", MAX_MICRO_BATCH, "largest micro-batch per forward/backward", low=1
    )
    min_sub_batches: int = run_key(
        "min_sub_batches",
        0,
        "fewest micro-batches of a step that measures the statistics; 0: what they need "
        "(4 for sub-batch statistics, shared by the processes; 1 for per-example ones)",
        low=0,
    )
    eval_every: int | str = run_key(
        "eval_every",
        25,
        "evaluate on the test set every this many optimizer steps, or every duration "
        "('10%', '50k samples', '1M tokens')",
        low=1,
        parse=Duration.interval,
    )
    checkpoint_every: int | str = run_key(
        "checkpoint_every",
        100,
        "write a checkpoint every this many optimizer steps, or every duration ('5%')",
        low=1,
        parse=Duration.interval,
    )
    threads: int = run_key("threads", 0, "torch CPU threads; 0: torch's default", low=0)
    keep_freed_memory: bool = run_key(
        "keep_freed_memory",
        True,
        "on the CPU under glibc, keep freed memory for the next step instead of handing "
        "it back to the system (faster large batches; the resident size stays at the "
        "peak); false: the allocator as the process has it",
    )
    device: str = run_key(
        "device",
        "auto",
        "where to train: auto (the GPU when there is one, under torchrun the LOCAL_RANK-th), "
        "cpu, cuda or cuda:N",
    )
    precision: str = run_key(
        "precision",
        "fp32",
        "forward passes in fp32, bf16 (autocast) or fp16 (autocast with a GradScaler); "
        "parameters and optimizer state stay fp32",
        choices=PRECISIONS,
    )
    tf32: bool = run_key("tf32", True, "TF32 tensor cores for fp32 matrix products on CUDA")
    compile: str = run_key(
        "compile",
        "none",
        "torch.compile the model's training forward and backward in this mode (the "
        "measured layers traced with it); each new batch shape's first step compiles",
        choices=COMPILE_MODES,
    )
    nonfinite: str = run_key(
        "nonfinite",
        "skip",
        "a step with a NaN/Inf gradient or loss: skip its update (counted) or stop the run",
        choices=NONFINITE_POLICIES,
    )
    asynchronous: bool = run_key(
        "asynchronous",
        False,
        "read each step's numbers at the next step, so the host never waits for the GPU "
        "(the loop's asynchronous step): the batch follows the noise one step later; a "
        "non-finite step is skipped on the device, so the optimizer is adamw or sgd, "
        "built fused",
    )
    skip_limit: float = run_key(
        "skip_limit",
        0.25,
        "the largest share of optimizer steps a run may skip for a non-finite gradient "
        "or loss (under fp16, the GradScaler's overflows too); past it (after 20 steps) "
        "the run checkpoints and stops with exit code 3 (1: never)",
        low=0,
        high=1,
    )


@dataclass(frozen=True)
class LogKeys:
    """Where the metrics go besides metrics.jsonl (docs/logging.md)."""

    tensorboard: bool = run_key(
        "log.tensorboard",
        False,
        "also write every metric and batch change to DIR/tensorboard (needs the tensorboard extra)",
    )
    mlflow: str = run_key(
        "log.mlflow",
        "",
        "also log to MLflow: local (DIR/mlflow.db, a SQLite store) or a tracking URI; "
        "empty: off (needs the mlflow extra)",
    )
    wandb: bool = run_key(
        "log.wandb",
        False,
        "also log to Weights & Biases under DIR/wandb (WANDB_MODE=offline: no login, no "
        "network; needs the wandb extra)",
    )


def _summary(cls: type) -> str:
    """A controller in a few words: the first sentence of its docstring, as plain text."""
    paragraph = " ".join((cls.__doc__ or cls.__name__).strip().split("\n\n")[0].split())
    sentence = paragraph.split(". ")[0].rstrip(".")
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", sentence).replace("``", "")


def _following(lr_follows: str) -> str:
    """The controllers under which ``lr_scaling="auto"`` follows ``lr_follows``."""
    names = [n for n, cls in CONTROLLERS.items() if contract_of(cls).lr_follows == lr_follows]
    return ", ".join(names)


@dataclass(frozen=True)
class BatchKeys:
    """How the batch size is chosen and how the rate follows it (beside these, the keys
    the controllers declare: :data:`COMPONENTS`)."""

    controller: str = run_key(
        "batch.controller",
        "batch_warmup",
        "how the batch size is chosen: "
        + "; ".join(f"{name}: {_summary(cls)}" for name, cls in CONTROLLERS.items()),
        choices=tuple(CONTROLLERS),
    )
    lr_scaling: str = run_key(
        "batch.lr_scaling",
        "auto",
        "how the LR follows the batch relative to batch.base; auto: held (none) under "
        f"{_following('none')}; the family's rule under {_following('family')}; else "
        f"({_following('task')}) the rule measured for the optimizer on the task (bigbatch "
        "tasks), else sqrt for Adam-type and linear for SGD- and LARS-type optimizers",
        choices=("auto", *LR_RULES),
    )
    base: int = run_key("batch.base", 0, "batch the lr is tuned for; 0: batch.initial", low=0)
    noise_from: str = run_key(
        "noise_from",
        StepOptions.noise_from,
        "the noise scale's small-batch norms: sub_batches (each step split into "
        "min_sub_batches micro-batches), examples (each example's gradient norm from the "
        "one backward: no split; the model's layers must all be covered), auto (examples "
        "where the model allows, unless min_sub_batches splits every step anyway)",
        choices=NOISE_SOURCES,
    )
    noise_units: int = run_key(
        "noise_units",
        StepOptions.noise_units,
        "per-example statistics: each micro-batch of n examples is cut into units of "
        "floor(n / noise_units) examples (this many units or up to twice as many; each "
        "example alone below twice this many), each unit's gradient norm taken in the "
        "backward; 0: every example alone",
        low=0,
    )
    log_statistics: bool = run_key(
        "log_statistics",
        False,
        "measure (and log) the gradient statistics even where nothing reads them (a constant "
        "batch, a ramp); otherwise only a controller, rate rule or optimizer that reads them "
        "pays for them",
    )
    statistics_every: int = run_key(
        "statistics_every",
        0,
        "measure the statistics at every this many optimizer steps; the steps between run "
        "unsplit, as a plain step; a noise-scale controller learns |G|^2 from their batch "
        f"gradient, a similarity one keeps its batch; 0: one step in {AUTO_EXAMPLES}/B below "
        f"batch {AUTO_EXAMPLES} (at most one in {AUTO_MOST}), every step from there and "
        "wherever every step's statistics are read",
        low=0,
        parse=_whole_steps,
    )
    similarity: str = run_key(
        "batch.similarity",
        "auto",
        "split: measured cosine of two halves (micro-batches; rank groups under DDP, one "
        "extra gradient all-reduce); scalar: estimated from noise scalars; auto: split on "
        "one process where the step is split anyway or the controller reads it, else "
        "scalar",
        choices=("auto", *SIMILARITY_MODES),
    )


@dataclass(frozen=True)
class ScheduleKeys:
    """The learning rate's schedule over the samples (the rate itself is a run key)."""

    kind: str = run_key(
        "schedule.kind",
        AUTO,
        "LR decay over samples after the warm-up; auto: the optimizer's recipe",
        choices=(AUTO, *SCHEDULES),
    )
    warmup: float | str = recipe_key(
        "schedule.warmup",
        "linear warm-up: a fraction of max_samples, or a length in samples, tokens or "
        "'N%' ('20k samples', '1M tokens')",
        low=0,
        high=1,
        parse=share_of_budget,
    )
    cooldown: float | str = run_key(
        "schedule.cooldown",
        0.2,
        "wsd: the linear cool-down at the end: a fraction of max_samples, or a length as "
        "schedule.warmup takes (with the warm-up, at most the run)",
        low=0,
        high=1,
        parse=share_of_budget,
    )


@dataclass(frozen=True)
class DistKeys:
    """How --nproc 2+ processes share the model and its gradient traffic (beside these, the
    compression state's and PowerSGD's keys: :data:`COMPONENTS`)."""

    strategy: str = run_key(
        "dist.strategy",
        "ddp",
        "how --nproc 2+ processes share the model: ddp (each holds it whole) or fsdp "
        "(FSDP2 fully_shard: each holds a shard of parameters, gradients and state)",
        choices=("ddp", "fsdp"),
    )
    compression: str = run_key(
        "dist.compression",
        "none",
        "gradient compression with error control between processes (--nproc 2+): "
        "ef, ef21, ef21-sgdm, econtrol; topk-only: compression without error control; "
        "powersgd: torch's PowerSGD hook (rank dist.powersgd_rank)",
        choices=COMPRESSION_CHOICES,
    )
    eta: float = run_key(
        "dist.eta", DEFAULT_ETA["econtrol"], "EControl's feedback strength η (0: EF21)", low=0
    )
    sgdm_eta: float = run_key(
        "dist.sgdm_eta",
        DEFAULT_ETA["ef21-sgdm"],
        "EF21-SGDM's η: weight of the new gradient in each rank's moving average (1: EF21)",
        low=0,
        high=1,
        low_open=True,
    )
    timeout: float = run_key(
        "dist.timeout",
        300.0,
        "seconds a process waits in a collective before the run ends with an error "
        "naming the processes that stopped answering (torch's default is 30 minutes)",
        low=0,
        low_open=True,
    )


#: the run keys written here, section by section; each field names its whole key
RUN_SECTIONS = (
    RunKeys,
    ModelKeys,
    OptimizerKeys,
    MachineKeys,
    LogKeys,
    BatchKeys,
    ScheduleKeys,
    DistKeys,
)

#: the dist.compression values that read each compression key (the others take none of it:
#: a key set for another is warned of, plan._warn_of_unread_keys)
_SPARSE = tuple(c for c in COMPRESSION_CHOICES if c not in ("none", "powersgd"))
DIST_READERS = {
    "dist.compressor": _SPARSE,
    "dist.ratio": _SPARSE,
    "dist.warmup": (*_SPARSE, "powersgd"),
    "dist.eta": ("econtrol",),
    "dist.sgdm_eta": ("ef21-sgdm",),
    "dist.powersgd_rank": ("powersgd",),
}

#: the keys that components declare on their classes (``CONFIG``), listed after the written
#: key they belong with: (prefix, {name: (component, its knobs)}) for :func:`component_keys`
COMPONENTS: dict[str, tuple[str, dict[str, tuple[Any, Mapping[str, Knob]]]]] = {
    "batch.controller": ("batch.", {n: (cls, cls.CONFIG) for n, cls in CONTROLLERS.items()}),
    "dist.compression": ("dist.", {"compression": (CompressionState, CompressionState.CONFIG)}),
    "dist.sgdm_eta": ("dist.", {"powersgd": (PowerSGDState, POWERSGD_CONFIG)}),
    # the VRGD forms' keys but γ, which their recipes set (OptimizerKeys)
    "vrgd.gamma": (
        "vrgd.",
        {"vr-*": (VRGD, {k: v for k, v in VRGD.CONFIG.items() if k != "gamma"})},
    ),
    "agvm.enabled": (
        "agvm.",
        {"agvm": (AGVM, AGVM.CONFIG), "groups": (module_param_groups, GROUPS_CONFIG)},
    ),
}


_Section = TypeVar("_Section")


def section(cls: type[_Section], config: Mapping[str, Any]) -> _Section:
    """One section of a resolved config as its typed class: ``section(LogKeys,
    config).wandb`` is ``config["log.wandb"]``."""
    missing = [f.metadata["key"] for f in fields(cls) if f.metadata["key"] not in config]
    if missing:
        raise ConfigError(f"the config lacks {', '.join(missing)}: resolve it first")
    return cls(**{f.name: config[f.metadata["key"]] for f in fields(cls)})


def _keys() -> list[Key]:
    """Every config key, a section's fields each followed by the keys of the components it
    chooses (:data:`COMPONENTS`)."""
    keys = []
    for cls in RUN_SECTIONS:
        for f in fields(cls):
            name, recipe = f.metadata["key"], f.metadata.get("recipe", False)
            keys.append(Key(name, f.default, f.metadata["knob"], from_recipe=recipe))
            if name in COMPONENTS:
                keys += component_keys(*COMPONENTS[name])
            if name == "model.context":  # then each task's own keys
                keys += [Key(f.metadata["key"], f.default, f.metadata["knob"])
                         for _, f in _task_options()]  # fmt: skip
    return [replace(k, readers=DIST_READERS[k.name]) if k.name in DIST_READERS else k
            for k in keys]  # fmt: skip


def _task_options() -> list[tuple[str, Any]]:
    """Every task's own keys (:attr:`~bigbatch.experiments.tasks.Task.options`) as the
    fields that declare them, each with the task that owns it."""
    return [(t.name, f) for t in TASKS.values() if t.options for f in fields(t.options)]


def task_keys(task: str) -> dict[str, str]:
    """Every task's own keys but those of ``task``, each with the task that reads it."""
    return {f.metadata["key"]: owner for owner, f in _task_options() if owner != task}


@functools.cache
def schema() -> dict[str, Key]:
    return {k.name: k for k in _keys()}


def defaults() -> dict[str, Any]:
    return {name: key.default for name, key in schema().items()}


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {str(path)!r} {what}")
    toml = _toml()
    try:
        with path.open("rb") as f:
            return flatten(toml.load(f))
    except (toml.TOMLDecodeError, UnicodeDecodeError) as err:  # TOML is UTF-8 text
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` from ``--set``; the value is read as a TOML value, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--set takes key=value, got {text!r}")
    key, raw = (part.strip() for part in text.split("=", 1))
    toml = _toml()
    try:
        value = toml.loads(f"v = {raw}")["v"]
    except toml.TOMLDecodeError:
        value = raw
    return key, value


def _check(key: Key, value: Any) -> Any:
    """``value`` as the key's type within its bounds (:meth:`Knob.check`); a key with a
    grammar (a duration, a share) also takes text that parses, a text key a number as its
    text."""
    if key.from_recipe and value == AUTO:
        return value
    if key.knob.parse is not None and (isinstance(value, str) or key.kind is str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # every digit kept (:g rounded 1234567.0 to 1.23457e+06)
            whole = isinstance(value, float) and value.is_integer()
            value = str(int(value)) if whole else str(value)
        if isinstance(value, str):
            try:
                key.knob.parse(value)
            except ValueError as err:
                raise ConfigError(f"{key.name} = {value!r}: {err}") from None
            return value
    if key.from_recipe and isinstance(value, str):
        raise ConfigError(f"{key.name} must be a number or {AUTO!r}, got {value!r}")
    try:
        return key.knob.check(key.name, value, key.kind.__name__)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def resolve(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid by each layer in turn, every key and value checked (how the keys
    agree with each other, the batch bounds for one, is the plan's to check:
    :func:`~bigbatch.experiments.plan.plan_run`)."""
    known = schema()
    config = defaults()
    for layer in layers:
        for name, value in layer.items():
            if name in RENAMED:
                raise ConfigError(f"config key {name!r} is now {RENAMED[name]!r}")
            if name not in known:
                raise ConfigError(f"unknown config key {name!r}{did_you_mean(name, known)}")
            config[name] = _check(known[name], value)
    return config


def to_toml(config: Mapping[str, Any]) -> str:
    """The resolved config as TOML, dotted keys as tables."""
    top = {k: v for k, v in config.items() if "." not in k}
    tables: dict[str, dict[str, Any]] = {}
    for k, v in config.items():
        if "." in k:
            table, name = k.split(".", 1)
            tables.setdefault(table, {})[name] = v
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    for table, values in tables.items():
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def help_text() -> str:
    rows = []
    for key in schema().values():
        choices = f" [{', '.join(key.knob.choices)}]" if key.knob.choices else ""
        rows.append(f"  {key.name:22s} {_toml_value(key.default):10s} {key.knob.help}{choices}")
    return "config keys (--set key=value, or a TOML file; [table] key = dotted key):\n" + "\n".join(
        rows
    )


def with_overrides(config: Mapping[str, Any], assignments: Iterable[str]) -> dict[str, Any]:
    return resolve(config, dict(parse_assignment(a) for a in assignments))

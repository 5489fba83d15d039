"""One training run: build the task, train with AdaptiveBatch, write the run directory.

A run directory holds ``config.toml`` (the resolved config), ``metrics.jsonl``
(one JSON object per optimizer step; evaluation steps add ``eval_loss`` and
``eval_accuracy``), ``checkpoint.pt`` (written atomically every
``checkpoint_every`` steps and at the end), ``summary.json``, the PNG plots and
``report.md``. A killed run resumed with ``resume`` continues from its last
checkpoint to the result it would have had.

Under ``torchrun`` (or ``bigbatch train --nproc N``) every rank trains its
shard of each global batch through ``DistributedDataParallel``; rank 0
evaluates and writes the run directory, every rank loads the checkpoint on
resume.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import schedules
from ..batch import Constant, CriticalBatchRamp, DampedSimiGrad, NoiseScale, Ramp, SimiGrad
from ..batch.controllers import CONTROLLERS
from ..batch.lr import lr_factor, resolve_lr_rule
from ..dist.compression import CompressionHook
from ..dist.world import World, init_from_env
from ..loop import AdaptiveBatch
from ..optim import AGVM, create_optimizer, get_optimizer_info, module_param_groups
from .config import ConfigError, load_toml, resolve, to_toml
from .tasks import TASKS, Problem, Task

CHECKPOINT = "checkpoint.pt"
#: config names of the compression methods that differ from the hook's
_METHOD = {"topk-only": "none"}


def with_task_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys left at 0 ("the task's default") from the task, and resolve the LR rule."""
    task = TASKS[config["task"]]
    config = dict(config)
    for key, value in (
        ("model.width", task.width),
        ("model.depth", task.depth),
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


def make_controller(config: dict[str, Any]):
    kind = config["batch.controller"]
    bounds = dict(initial=config["batch.initial"], min=config["batch.min"], max=config["batch.max"])
    # the noise-following controllers hold the batch while the LR warms up: then the
    # small rate, not the gradient noise, limits progress
    warmup = int(config["schedule.warmup"] * config["max_samples"])
    if kind == "simigrad":
        return SimiGrad(target=config["batch.target"], window=config["batch.window"], **bounds)
    if kind == "critical_ramp":
        return CriticalBatchRamp(
            config["batch.noise_multiple"],
            factor=config["batch.factor"],
            confidence=config["batch.confidence"],
            shrink=config["batch.shrink"],
            warmup=warmup,
            **bounds,
        )
    if kind == "damped_simigrad":
        return DampedSimiGrad(config["batch.target"], warmup=warmup, **bounds)
    if kind == "noise_scale":
        return NoiseScale(multiple=config["batch.noise_multiple"], **bounds)
    if kind == "constant":
        return Constant(config["batch.initial"])
    samples = config["batch.ramp_samples"] or config["max_samples"] // 2
    return Ramp(config["batch.initial"], config["batch.max"], samples=samples)


def make_schedule(config: dict[str, Any]):
    total = config["max_samples"]
    warmup = int(config["schedule.warmup"] * total)
    if config["schedule.kind"] == "cosine":
        return schedules.warmup_cosine(total, warmup)
    if config["schedule.kind"] == "linear":
        return schedules.warmup_linear(total, warmup)
    return schedules.constant


def build(config: dict[str, Any], world: World | None = None) -> tuple[Problem, AdaptiveBatch]:
    """The task's problem and the loop that trains it (its model wrapped in DDP on 2+ ranks)."""
    problem = TASKS[config["task"]].build(config)
    try:
        return problem, _loop(config, problem, world)
    except ValueError as err:  # settings the loop or an optimizer refuses
        raise ConfigError(str(err)) from None


def _loop(config: dict[str, Any], problem: Problem, world: World | None) -> AdaptiveBatch:
    options: dict[str, Any] = {"lr": config["lr"], "weight_decay": config["weight_decay"]}
    accepted = get_optimizer_info(config["optimizer"]).signature().parameters
    if "impl" in accepted:
        options["impl"] = config["optimizer_impl"]
    if "gamma" in accepted:  # the vr-* optimizers
        options.update(gamma=config["vrgd.gamma"], normalizer=config["vrgd.normalizer"])
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
    if world is not None and world.distributed:
        model = nn.parallel.DistributedDataParallel(model, process_group=world.group)
        if config["dist.compression"] == "powersgd":
            hook = _powersgd(config, world)
        elif config["dist.compression"] != "none":
            hook = CompressionHook(
                model,  # type: ignore[arg-type]
                _METHOD.get(config["dist.compression"], config["dist.compression"]),
                config["dist.compressor"],
                config["dist.ratio"],
                eta=config["dist.eta"],
                warmup=config["dist.warmup"],
                seed=config["seed"],
            )
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
    )


def _powersgd(config: dict[str, Any], world: World) -> Any:
    """torch's PowerSGD hook (Vogels et al. 2019) with its state bound, for comparisons."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=world.group,
        matrix_approximation_rank=config["dist.powersgd_rank"],
        start_powerSGD_iter=max(2, config["dist.warmup"]),
        random_seed=config["seed"],
    )

    def powersgd(_ddp_state, bucket):  # unannotated: DDP checks annotations by identity
        return powerSGD_hook.powerSGD_hook(state, bucket)

    return powersgd


def new_run_dir(root: str | Path = "runs", task: str = "run") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{stamp}-{task}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_new_run_dir(path: Path) -> None:
    if path.exists() and (path.is_file() or any(path.iterdir())):
        raise ConfigError(
            f"--out {str(path)!r} already exists and is not empty; "
            "runs are never overwritten (use --resume to continue one)"
        )


def previous(path: Path) -> Path:
    """Where the checkpoint before ``path``'s current one is kept."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_atomically(obj: Any, path: Path, keep_previous: bool = False) -> None:
    """torch.save to a temporary file, flushed to disk, then renamed over ``path``.

    With ``keep_previous`` the file it replaces is kept as ``<name>.prev<suffix>``,
    so a checkpoint damaged later (a full disk, a bad copy) still has a good
    predecessor.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if keep_previous and path.exists():
        # a link, then a rename: checkpoint.pt exists at every moment
        staged = path.with_name(f".{previous(path).name}.tmp")
        staged.unlink(missing_ok=True)
        try:
            os.link(path, staged)
        except OSError:  # a file system without hard links
            shutil.copy2(path, staged)
        os.replace(staged, previous(path))
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    kept = previous(path)
    hint = (
        f"; the previous checkpoint is kept at {str(kept)!r}: rename it to "
        f"{path.name!r} to resume from there"
        if kept.is_file()
        else ""
    )
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {str(path)!r}: nothing to resume{hint}")
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # a truncated or corrupted file
        raise ConfigError(
            f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: "
            f"{err}); it is truncated or corrupted{hint}"
        ) from None


def train(
    config: dict[str, Any], out: Path, *, resume: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Train one run into ``out`` (new, or resumed from its checkpoint); return the summary.

    Under ``torchrun`` call it on every rank with the same arguments; rank 0
    writes ``out`` and returns the summary, the other ranks return it too.
    """
    config = with_task_defaults(config)
    world = init_from_env()
    _set_threads(config["threads"], world)
    problem, loop = build(config, world)
    writer = world.rank == 0
    metrics_path = out / "metrics.jsonl"
    state: dict[str, Any] = {"metrics_lines": 0, "wall_seconds": 0.0}
    if resume:
        checkpoint = load_checkpoint(out / CHECKPOINT)
        loop.load_state_dict(checkpoint["loop"])
        state.update(checkpoint["run"])
        if writer:
            lines = (
                metrics_path.read_text().splitlines(keepends=True) if metrics_path.exists() else []
            )
            metrics_path.write_text("".join(lines[: state["metrics_lines"]]))
    elif writer:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(config))
        metrics_path.write_text("")

    first_step = loop.step
    start = time.perf_counter() - state["wall_seconds"]
    bar = _progress(config["max_samples"], loop.samples, quiet or not writer)
    evaluation: dict[str, float] = {}
    with metrics_path.open("a") if writer else contextlib.nullcontext() as log:
        for step in loop.steps(max_samples=config["max_samples"]):
            for batch in step.micro_batches():
                step.backward(problem.loss(loop.model, batch))
            step.apply()
            row = dict(step.metrics)
            last = loop.samples >= config["max_samples"]
            if writer and (loop.step % config["eval_every"] == 0 or last or loop.step == 1):
                evaluation = problem.evaluate(problem.model)
                row.update(evaluation)
            state["wall_seconds"] = time.perf_counter() - start
            row["wall_seconds"] = state["wall_seconds"]
            state["metrics_lines"] += 1
            if log is not None:
                log.write(json.dumps(row) + "\n")
            if loop.step % config["checkpoint_every"] == 0 or last:
                loop_state = loop.state_dict()  # a collective under DDP: every rank calls it
                if log is not None:
                    log.flush()
                    save_atomically(
                        {"loop": loop_state, "run": dict(state)},
                        out / CHECKPOINT,
                        keep_previous=True,
                    )
            if bar is not None:
                bar.update(step.batch_size)
                bar.set_postfix(
                    step=loop.step,
                    batch=step.batch_size,
                    sim=f"{row.get('similarity', math.nan):+.2f}",
                    loss=f"{row['loss']:.3f}",
                    lr=f"{row['lr']:.2e}",
                    acc=f"{evaluation.get('eval_accuracy', math.nan):.3f}",
                    refresh=False,
                )
    if bar is not None:
        bar.close()
    if writer:
        traffic = _traffic_per_step(loop, loop.step - first_step)
        summary = _write_summary(out, config, loop, state, problem, traffic)
    # the other ranks wait for the summary so no rank returns before the run is complete
    return world.broadcast_object(summary if writer else None)


def _write_summary(
    out: Path,
    config: dict[str, Any],
    loop: AdaptiveBatch,
    state: dict[str, Any],
    problem: Problem,
    traffic: dict[str, float],
) -> dict[str, Any]:
    task = TASKS[config["task"]]
    rows = read_metrics(out)
    evals = [r for r in rows if "eval_accuracy" in r]
    summary = {
        "task": config["task"],
        "final_accuracy": evals[-1]["eval_accuracy"] if evals else math.nan,
        "best_accuracy": max((r["eval_accuracy"] for r in evals), default=math.nan),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else math.nan,
        "best_eval_loss": min((r["eval_loss"] for r in evals), default=math.nan),
        "avg_batch_size": loop.samples / max(1, loop.step),
        "steps": loop.step,
        "samples": loop.samples,
        "wall_seconds": state["wall_seconds"],
        "processes": loop.world.size,
        "skipped_steps": loop.skipped_steps,
        "batch_path_ratio": batch_path_ratio([r["batch_size"] for r in rows]),
        **target_summary(task, evals),
        **traffic,
        **problem.info,
    }
    if problem.evaluate_train is not None and evals:
        train_accuracy = problem.evaluate_train(problem.model)["eval_accuracy"]
        summary["final_train_accuracy"] = train_accuracy
        summary["generalization_gap"] = train_accuracy - summary["final_accuracy"]
    if evals and "max_attention_logit" in evals[-1]:
        summary["max_attention_logit"] = max(r["max_attention_logit"] for r in evals)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .report import render_run

    render_run(out)
    return summary


def batch_path_ratio(batches: list[int]) -> float | None:
    """``Σ |Δ log B| / |log(B_last / B_first)|``: 1.0 for a monotone path (or a constant batch).

    The sawtooth of a cycling controller makes it large; None when the batch
    moved but ended where it began (no monotone path to compare with).
    """
    travelled = sum(abs(math.log(b / a)) for a, b in itertools.pairwise(batches))
    if travelled == 0:
        return 1.0
    net = abs(math.log(batches[-1] / batches[0]))
    return travelled / net if net > 0 else None


def target_summary(task: Task, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """When the task's target was first reached, and the same in words either way."""
    reached = next((r for r in evals if task.reached(r)), None)
    values = [r[task.target_metric] for r in evals if task.target_metric in r]
    best = (min if task.lower_is_better else max)(values, default=math.nan)
    name = task.target_metric.removeprefix("eval_")
    if reached is not None:
        note = (
            f"target {name} {task.target:g} reached at step {reached['step']} "
            f"({reached['samples']:,} samples)"
        )
    else:
        note = f"target {name} {task.target:g} not reached; best {best:.4g}"
    return {
        "target_metric": task.target_metric,
        "target": task.target,
        "target_reached": reached is not None,
        "steps_to_target": reached["step"] if reached else None,
        "samples_to_target": reached["samples"] if reached else None,
        "target_note": note,
    }


def _traffic_per_step(loop: AdaptiveBatch, steps: int) -> dict[str, float]:
    """Bytes each rank put into all-reduces per step: gradients, and what statistics added."""
    if not loop.world.distributed:
        return {}
    params = [p for p in loop.model.parameters() if p.requires_grad]
    out = {"gradient_bytes_per_step": float(sum(p.numel() * p.element_size() for p in params))}
    if isinstance(loop.comm_hook, CompressionHook):
        out.update(loop.comm_hook.bytes_per_step())
    if loop.stats is not None:
        extra = loop.stats.bytes_communicated
        if loop.stats.comm_hook is not None:
            extra += loop.stats.comm_hook.extra_bytes
        out["statistics_bytes_per_step"] = extra / max(1, steps)
    return out


def _set_threads(threads: int, world: World) -> None:
    """``threads`` per process; under several local processes, the cores shared among them."""
    if threads:
        torch.set_num_threads(threads)
    elif world.distributed:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_config(out: Path) -> dict[str, Any]:
    return resolve(load_toml(Path(out) / "config.toml"))


def _progress(total: int, done: int, quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=done,
        unit="sample",
        unit_scale=True,
        dynamic_ncols=True,
        mininterval=0.5,
    )

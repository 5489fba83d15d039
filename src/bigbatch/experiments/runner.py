"""One training run: build the task, train with AdaptiveBatch, write the run directory.

A run directory holds ``config.toml`` (the resolved config), ``metrics.jsonl``
(one JSON object per optimizer step; evaluation steps add ``eval_loss`` and
``eval_accuracy``), ``checkpoint.pt`` (written atomically every
``checkpoint_every`` steps and at the end), ``summary.json``, the PNG plots and
``report.md``. A killed run resumed with ``resume`` continues from its last
checkpoint to the result it would have had.

Under ``torchrun`` (or ``bigbatch train --nproc N``) every rank trains its
shard of each global batch through ``DistributedDataParallel``, or FSDP2's
``fully_shard`` with ``dist.strategy = "fsdp"`` (where every rank joins the
evaluation's forward passes); rank 0 evaluates and writes the run
directory, every rank loads the checkpoint on resume.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..dist.world import World, init_from_env
from ..loop import AdaptiveBatch
from .build import build, train_step, with_task_defaults
from .config import ConfigError, to_toml
from .device import resolve_device, set_tf32, set_threads
from .report import render_run
from .rundir import CHECKPOINT, load_checkpoint, read_metrics, save_atomically
from .summary import batch_path_ratio, target_summary, traffic_per_step
from .tasks import TASKS, Problem, Task


def train(
    config: dict[str, Any], out: Path, *, resume: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """Train one run into ``out`` (new, or resumed from its checkpoint); return the summary.

    Under ``torchrun`` call it on every rank with the same arguments; rank 0
    writes ``out`` and returns the summary, the other ranks return it too.
    """
    config = with_task_defaults(config)
    try:
        device = resolve_device(config["device"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    set_tf32(config["tf32"])
    world = init_from_env(device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.size)) if world.distributed else 1
    set_threads(config["threads"], local)
    problem, loop, precision = build(config, world, device)
    task = TASKS[config["task"]]
    writer = world.rank == 0
    # under FSDP2 a forward is a collective (it gathers the parameters): every rank evaluates
    evaluates = writer or loop.world.sharded
    state = _open_run(out, config, loop, resume, writer)
    first_step = loop.steps_taken
    start = time.perf_counter() - state["wall_seconds"]
    bar = _progress(config["max_samples"], loop.samples, quiet or not writer)
    evaluation: dict[str, float] = {}
    with (out / "metrics.jsonl").open("a") if writer else contextlib.nullcontext() as log:
        for step in loop.steps(max_samples=config["max_samples"]):
            train_step(step, problem, loop, precision)
            row = dict(step.metrics)
            last = loop.samples >= config["max_samples"]
            due = loop.steps_taken % config["eval_every"] == 0 or loop.steps_taken == 1
            if evaluates and (due or last):
                evaluation = problem.evaluate(problem.model)
                row.update(evaluation)
            last = last or (config["stop_at_target"] and due and _reached(world, task, evaluation))
            state["wall_seconds"] = row["wall_seconds"] = time.perf_counter() - start
            state["metrics_lines"] += 1
            if log is not None:
                log.write(json.dumps(row) + "\n")
            if loop.steps_taken % config["checkpoint_every"] == 0 or last:
                _checkpoint(out, loop, state, log)
            if bar is not None:
                _show(bar, step.batch_size, loop.steps_taken, row, evaluation)
            if last:  # the budget is spent (the loop ends by itself) or the target reached
                break
    if bar is not None:
        bar.close()
    train_evaluation = None
    if evaluates and problem.evaluate_train is not None:
        train_evaluation = problem.evaluate_train(problem.model)
    if writer:
        traffic = traffic_per_step(loop, loop.steps_taken - first_step)
        summary = _write_summary(out, config, loop, state, problem, traffic, train_evaluation)
    # the other ranks wait for the summary so no rank returns before the run is complete
    return world.broadcast_object(summary if writer else None)


def _open_run(
    out: Path, config: dict[str, Any], loop: AdaptiveBatch, resume: bool, writer: bool
) -> dict[str, Any]:
    """A new run directory, or the resumed run's state (metrics cut back to its checkpoint)."""
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
    return state


def _reached(world: World, task: Task, evaluation: dict[str, float]) -> bool:
    """Whether rank 0's latest evaluation met the task's target, on every rank."""
    return world.broadcast_object(world.rank == 0 and task.reached(evaluation))


def _checkpoint(out: Path, loop: AdaptiveBatch, state: dict[str, Any], log: Any) -> None:
    loop_state = loop.state_dict()  # a collective under DDP: every rank calls it
    if log is not None:  # the writer
        log.flush()
        save_atomically({"loop": loop_state, "run": dict(state)}, out / CHECKPOINT, True)


def _show(bar: Any, batch: int, steps: int, row: dict[str, Any], evaluation: dict) -> None:
    bar.update(batch)
    bar.set_postfix(
        step=steps,
        batch=batch,
        sim=f"{row.get('similarity', math.nan):+.2f}",
        loss=f"{row['loss']:.3f}",
        lr=f"{row.get('lr', math.nan):.2e}",
        acc=f"{evaluation.get('eval_accuracy', math.nan):.3f}",
        refresh=False,
    )


def _write_summary(
    out: Path,
    config: dict[str, Any],
    loop: AdaptiveBatch,
    state: dict[str, Any],
    problem: Problem,
    traffic: dict[str, float],
    train_evaluation: dict[str, float] | None,
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
        "avg_batch_size": loop.samples / max(1, loop.steps_taken),
        "steps": loop.steps_taken,
        "samples": loop.samples,
        "wall_seconds": state["wall_seconds"],
        "processes": loop.world.size,
        "device": str(next(problem.model.parameters()).device),
        "precision": config["precision"],
        "skipped_steps": loop.skipped_steps,
        "controller": repr(loop.engine.controller),
        "batch_path_ratio": batch_path_ratio([r["batch_size"] for r in rows]),
        **target_summary(task, evals),
        **traffic,
        **problem.info,
    }
    if train_evaluation is not None and evals:
        train_accuracy = train_evaluation["eval_accuracy"]
        summary["final_train_accuracy"] = train_accuracy
        summary["generalization_gap"] = train_accuracy - summary["final_accuracy"]
    if evals and "max_attention_logit" in evals[-1]:
        summary["max_attention_logit"] = max(r["max_attention_logit"] for r in evals)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    render_run(out)
    return summary


def _progress(total: int, done: int, quiet: bool):
    if quiet:
        return None
    return tqdm(
        total=total,
        initial=done,
        unit="sample",
        unit_scale=True,
        dynamic_ncols=True,
        mininterval=0.5,
    )

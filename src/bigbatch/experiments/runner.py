"""One training run: build the task, train with AdaptiveBatch, write the run directory
(its files: docs/cli.md, `bigbatch train`). A killed run resumed with ``resume``
continues from its last checkpoint to the result it would have had. Under ``torchrun``
(or ``bigbatch train --nproc N``) every rank trains its shard of each global batch (DDP,
or FSDP2 with ``dist.strategy = "fsdp"``); rank 0 writes the directory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..duration import Duration
from ..loop import AdaptiveBatch
from ..parallel.world import World, init_from_env
from ..sinks import Sinks
from .build import build, run_device, train_step, training_model
from .config import ConfigError, to_toml
from .device import keep_freed_memory, set_tf32, set_threads
from .plan import RunPlan, intervals, plan_run
from .report import run as run_report
from .run_sinks import check_sinks, open_sinks
from .rundir import (
    CHECKPOINT,
    CHECKPOINTS_OF_ROOM,
    LOCK_HELD,
    RunLock,
    check_new_run_dir,
    check_room,
    claim_new_run_dir,
    cut_lines,
    discard_if_unused,
    disk_error,
    load_checkpoint,
    new_run_dir,
    read_config,
    read_metrics,
    resumable,
    save_atomically,
    write_atomically,
)
from .signals import Stopped, StopRequest, stop_between_runs, watch_launcher
from .summary import ENDS, batch_path_ratio, finished_summary, target_summary, traffic_per_step


def train(
    config: dict[str, Any],
    out: Path | None,
    *,
    resume: bool = False,
    quiet: bool = False,
    until: int | None = None,
    start_from: Path | None = None,
) -> dict[str, Any]:
    """Train one run into ``out`` (new, or resumed from its checkpoint; None: a new
    directory under ``runs/``); return the summary (``run_dir`` names the directory).

    ``start_from``, another run's checkpoint, makes this run a branch of it (its model,
    optimizer, data order, random state and samples, at the config's first batch).
    ``until`` below the budget pauses the run after the step that reaches it (evaluated,
    checkpointed; a :func:`paused` record is returned) on the whole budget's schedule;
    ``resume=True`` continues it to the result of a run never paused. Under ``torchrun``
    call it on every rank alike; rank 0 locks and writes ``out``. A second writer gets a
    :class:`ConfigError` before anything is built; SIGTERM or SIGINT stops after the
    current step with a checkpoint (:class:`~bigbatch.experiments.signals.Stopped`).
    """
    stop_between_runs(out)  # a command of many runs got a signal before this one
    plan = plan_run(config)
    machine, timeout = plan.machine, plan.dist.timeout
    device = run_device(plan)
    set_tf32(machine.tf32)
    check_sinks(plan.log)
    world = init_from_env(device, timeout=timeout)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.size)) if world.distributed else 1
    set_threads(machine.threads, local)
    if machine.keep_freed_memory and device.type == "cpu":
        keep_freed_memory()
    out, lock = _claim(out, resume, world, plan.run.task)
    agreed_stop: Exception | None = None
    try:
        with StopRequest(world, timeout) as stop:
            watch_launcher()
            # no name holds the run: its objects are gone before _leave (its docstring)
            summary = _train(_Run(plan, out, world, device, stop, until), resume, quiet, start_from)
    except OSError as err:  # a full disk, a directory made read-only midway: one line
        raise disk_error(err, err.filename or out) from None
    except (Stopped, TooManySkippedError) as err:
        # every rank stops after the same step: leave as on success (below), once the
        # traceback that holds the run's objects is dropped
        agreed_stop = err.with_traceback(None)
    except BaseException:
        if lock is not None and not resume:
            discard_if_unused(out, lock.made)
        raise
    finally:
        if lock is not None:
            lock.release()
    if world.distributed:  # not after a failure: a failed rank is stopped by its launcher
        _leave(world)
    if agreed_stop is not None:
        raise agreed_stop
    return summary


def _leave(world: World) -> None:
    """Tear the process group down in order: what uses it first, then the group.

    The DDP model, its reducer and a comm hook's state hold the process group and
    may hold its pending work; left to the interpreter's exit, they can be
    destroyed after the group, from a gloo thread, and the process aborts
    ("terminate called without an active exception"). The run's objects are gone
    once ``_train`` returns, save for reference cycles: collect those first.
    """
    gc.collect()
    world.barrier()  # gloo aborts a rank that tears down while a peer still talks
    dist.destroy_process_group()


def _claim(out: Path | None, resume: bool, world: World, task: str) -> tuple[Path, RunLock | None]:
    """Rank 0 names (``out`` None: a new one under ``runs/``) and locks the run directory,
    creating a new one in the same step; every rank learns the directory and whether
    that worked. Under ``bigbatch train --nproc N`` the launcher holds the lock."""
    lock, problem = None, None
    if world.rank == 0:
        out = Path(out) if out is not None else new_run_dir(task=task)
        try:
            if os.environ.get(LOCK_HELD) == str(out.resolve()):  # held by the launcher
                if not resume:
                    check_new_run_dir(out)
            elif resume:
                lock = RunLock(out).acquire()
            else:
                lock = claim_new_run_dir(out)
        except ConfigError as err:
            problem = str(err)
    name, problem = world.broadcast_object((str(out), problem))
    if problem:
        raise ConfigError(problem)
    return Path(name), lock


def _train(run: _Run, resume: bool, quiet: bool, start_from: Path | None) -> dict[str, Any]:
    plan, out, world = run.plan, run.out, run.world
    run.open(resume, start_from)
    loop, problem, writer = run.loop, run.problem, run.writer
    first_step = loop.steps_taken
    if run.pause_at is not None and loop.samples >= run.pause_at:  # paused here before
        return paused(out, loop, problem.evaluate(problem.model) if run.evaluates else {})
    run.bar = tqdm(
        total=plan.run.max_samples,
        initial=loop.samples,
        unit="sample",
        unit_scale=True,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=quiet or not writer,  # a disabled bar's calls do nothing
    )
    sinks = Sinks()
    try:
        if writer:  # (inside: a tracker that cannot open ends the run with its summary)
            sinks = open_sinks(plan, out, resume, first_step)
        with (out / "metrics.jsonl").open("a") if writer else contextlib.nullcontext() as log:
            run.log, run.sinks = log, sinks
            with sinks:
                end = None
                try:
                    done = run.ended == "target"  # a resumed run that met its target
                    for step in () if done else loop.steps(max_samples=plan.run.max_samples):
                        train_step(step, problem, run.model, run.precision)
                        end = run.after_step(step)
                        if end:  # paused, the budget spent or the target met
                            break
                except BaseException:
                    with contextlib.suppress(Exception):  # asynchronous: the step read last
                        run.record(loop.flush(), {})
                    raise
                if end == "pause":  # an asynchronous run's last step stays in the checkpoint
                    run.bar.close()
                    return paused(out, loop, run.evaluation)
                run.record(loop.flush(), {})  # asynchronous: the last step's row
    except (Exception, KeyboardInterrupt) as err:
        run.bar.close()
        if writer:
            _leave_summary(run, err)
        raise
    train_evaluation = None
    if run.evaluates and problem.evaluate_train is not None:
        run.bar.set_description("evaluating on the training set")
        train_evaluation = problem.evaluate_train(problem.model)
    run.bar.close()
    if writer:
        traffic = traffic_per_step(loop)
        summary = _write_summary(run, traffic, train_evaluation, ended=run.ended)
    # the other ranks wait for the summary so no rank returns before the run is complete
    return world.broadcast_object(summary if writer else None)


class _Run:
    """What a run keeps between optimizer steps, and what it does after each: evaluate,
    log, checkpoint, show progress, and decide whether the run ends (the budget, the
    target, a pause, a signal, the skip limit)."""

    def __init__(
        self,
        plan: RunPlan,
        out: Path,
        world: World,
        device: Any,
        stop: StopRequest,
        until: int | None,
    ) -> None:
        self.plan, self.out, self.world, self.stop = plan, out, world, stop
        self.problem, self.loop, self.precision = build(plan, world, device)
        #: what the training steps call (compiled where ``compile`` says)
        self.model = training_model(self.loop.model, plan.machine.compile)
        self.keys, self.machine, self.task = plan.run, plan.machine, plan.task
        self.writer = world.rank == 0
        # under FSDP2 a forward is a collective (it gathers the parameters): every rank
        # evaluates
        self.evaluates = self.writer or self.loop.world.sharded
        self.pause_at = until if until is not None and until < self.keys.max_samples else None
        #: the log's rows so far, the training's time, a step's evaluation and time held
        #: until its metrics come (``asynchronous``)
        self.state: dict[str, Any] = {"metrics_lines": 0, "wall_seconds": 0.0, "held": {}}
        self.keep_previous = True
        self.evaluation: dict[str, float] = {}
        self.ended = "budget"
        every = intervals(plan)
        self.eval_every, self.checkpoint_every = every["eval_every"], every["checkpoint_every"]
        self.facts = plan.facts  # what the durations' ticks are read with
        self.bar: Any = None
        self.log: Any = None
        self.sinks: Sinks = Sinks()

    def open(self, resume: bool, start_from: Path | None) -> None:
        """Check for room, then open a new run directory (a branch of ``start_from``'s run,
        if given) or restore the resumed run's state, its metrics cut back to its checkpoint.
        The next checkpoint keeps the current one as its predecessor unless the current one
        could not be read and the run resumed from its predecessor."""
        out, loop, metrics = self.out, self.loop, self.out / "metrics.jsonl"
        if self.writer:
            check_room(out, CHECKPOINTS_OF_ROOM * checkpoint_bytes(loop))
        if resume:
            checkpoint, source = load_checkpoint(out / CHECKPOINT, self.precision.device)
            _check_trained_config(checkpoint, self.plan, source)
            self.keep_previous = source == out / CHECKPOINT
            loop.load_state_dict(checkpoint["loop"])
            self.state.update(checkpoint["run"])
            self.ended = self.state.get("ended", self.ended)
            if self.writer:
                counted = self.state["metrics_lines"]
                self.state["metrics_lines"] = cut_lines(metrics, counted)
                if self.state["metrics_lines"] < counted:  # (a crash of the machine, an edit)
                    warnings.warn(
                        f"{str(metrics)!r} holds {self.state['metrics_lines']:,} rows where the "
                        f"checkpoint counts {counted:,}: the resumed run's log misses the "
                        "rows lost since it was written",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        else:
            if start_from is not None:  # a branch of another run, at its own first batch
                branched = load_checkpoint(Path(start_from), self.precision.device)[0]["loop"]
                # its own controller, fresh (the base run's may be another kind)
                branched["engine"]["controller"] = loop.engine.controller.state_dict()
                branched["engine"]["batch_size"] = loop.engine.controller.initial
                # the base run's last step, read but not decided on (asynchronous), is its own
                branched["engine"]["pending"] = None
                loop.load_state_dict(branched)
            # a run is resumable from its first moment: a kill before the first periodic
            # checkpoint must not leave a directory that neither resumes nor can be reused.
            # The config first (a checkpoint without it did not resume); until the
            # checkpoint lands the directory holds no run, and --out takes it again
            if self.writer:  # the directory was made and locked by _claim (or the launcher)
                write_atomically(out / "config.toml", to_toml(self.plan))
                metrics.write_text("")
            self.checkpoint()
        self.start = time.perf_counter() - self.state["wall_seconds"]

    def after_step(self, step: Any) -> str | None:
        """Record the step; "last" or "pause" when the run ends or pauses after it (raises
        the reason when a signal or the skip limit stops it)."""
        keys, loop = self.keys, self.loop
        own: dict[str, float] = {}  # what this step adds to its row: evaluation and time
        last = loop.samples >= keys.max_samples
        pause = self.pause_at is not None and loop.samples >= self.pause_at
        before = (loop.samples - step.batch_size, loop.steps_taken - 1)
        due = self._tick(self.eval_every, before) or loop.steps_taken == 1
        if self.evaluates and (due or last or pause):
            self.bar.set_description("evaluating")  # (a long evaluation is not a hang)
            self.evaluation = self.problem.evaluate(self.problem.model)
            self.bar.set_description("", refresh=False)
            if due or last:  # a pause's own evaluation is returned, not logged: the run's
                own.update(self.evaluation)  # rows and summary are a run's never paused
        if not last and keys.stop_at_target and due:  # rank 0's evaluation, on every rank
            last = self.world.broadcast_object(self.writer and self.task.reached(self.evaluation))
            if last:  # kept in the checkpoint: a resumed run that ended here trains no further
                self.ended = self.state["ended"] = "target"
        self.state["wall_seconds"] = own["wall_seconds"] = time.perf_counter() - self.start
        row = self.record(step.metrics, own)
        halt = self._halt()
        if self._tick(self.checkpoint_every, before) or last or halt or pause:
            self.checkpoint()
            self.keep_previous = True
        self.bar.update(step.batch_size)
        self.bar.set_postfix(
            step=loop.steps_taken,
            batch=step.batch_size,
            sim=f"{row.get('similarity', math.nan):+.2f}",
            loss=f"{row.get('loss', math.nan):.3f}",
            lr=f"{row.get('lr', math.nan):.2e}",
            acc=f"{self.evaluation.get('eval_accuracy', math.nan):.3f}",
            refresh=False,
        )
        if halt is not None:
            raise halt
        return "last" if last else "pause" if pause else None

    def record(self, metrics: dict[str, float], own: dict[str, float]) -> dict[str, float]:
        """Log a step's row: its metrics, evaluation and time (``asynchronous``: the metrics
        are the step before's; this step's part is held, checkpointed, until its come)."""
        if self.machine.asynchronous:
            row = {**metrics, **self.state["held"]} if metrics else {}
            self.state["held"] = own
        else:
            row = {**metrics, **own}
        if row:
            self.state["metrics_lines"] += 1
            if self.log is not None:
                self.log.write(json.dumps(row) + "\n")
            self.sinks.record(row)
        return row

    def _tick(self, every: int | Duration, before: tuple[int, int]) -> bool:
        """Whether the step just taken ends an interval: every ``every`` optimizer steps, or
        at each multiple of a duration the run passed in it."""
        loop = self.loop
        if isinstance(every, int):
            return loop.steps_taken % every == 0
        return every.crossed(before, (loop.samples, loop.steps_taken), **self.facts)

    def _halt(self) -> Exception | None:
        """Why the run must stop after this step (a signal, too many skipped steps), if it
        must; the same on every rank."""
        signum, loop, limit = self.stop.agreed(), self.loop, self.machine.skip_limit
        if signum:
            return Stopped(signum, loop.steps_taken, str(self.out))
        steps, skipped = loop.steps_taken, loop.skipped_steps  # identical on every rank
        if limit < 1 and steps >= SKIP_GRACE_STEPS and skipped > limit * steps:
            self.record(loop.flush(), {})  # asynchronous: the last step's late reading too
            return TooManySkippedError(loop.skipped_steps, loop.steps_taken, limit)
        return None

    def checkpoint(self) -> None:
        loop_state = self.loop.state_dict()  # a collective under DDP: every rank calls it
        if self.writer:
            if self.log is not None:
                self.log.flush()  # the metrics the checkpoint counts are on disk before it
            run = {"loop": loop_state, "run": dict(self.state), "config": dict(self.plan)}
            save_atomically(run, self.out / CHECKPOINT, self.keep_previous)


def _check_trained_config(checkpoint: dict[str, Any], plan: RunPlan, source: Path) -> None:
    """A one-line :class:`ConfigError` unless ``plan`` is the config ``checkpoint`` trained."""
    # a resume under another (an edited config.toml, another config given) trains neither
    trained = checkpoint.get("config")
    if not isinstance(trained, dict):
        raise ConfigError(f"{str(source)!r} was written by an earlier bigbatch: train it anew")
    key = _changed_key(trained, plan)
    if key is not None:
        raise ConfigError(
            f"{str(source)!r} trained {key} = {trained.get(key)!r}, the config to resume "
            f"it with says {plan[key]!r}: a resumed run keeps its config"
        )


def _leave_summary(run: _Run, err: BaseException) -> None:
    """Write the summary of a run that a signal, the skip limit or an error stopped: how it
    ended and why, beside what it measured so far. Never raises: the error that stopped
    the run is the one to report (a full disk fails this write too)."""
    if isinstance(err, TooManySkippedError):
        ended = "skip_limit"
    elif isinstance(err, (Stopped, KeyboardInterrupt)):
        ended = "signal"
    else:
        ended = "error"
    why = str(err) if ended != "error" else f"{type(err).__name__}: {err}"
    with contextlib.suppress(Exception):  # see the docstring
        _write_summary(run, {}, None, ended=ended, why=why)


def paused(out: Path, loop: AdaptiveBatch, evaluation: dict[str, float]) -> dict[str, Any]:
    """What :func:`train` returns for a run paused at ``until``: where it stands."""
    return {
        "run_dir": str(out),
        "paused": True,
        "samples": loop.samples,
        "steps": loop.steps_taken,
        **evaluation,
    }


#: a run is judged on its skipped share only after this many optimizer steps
SKIP_GRACE_STEPS = 20


class TooManySkippedError(FloatingPointError):
    """More than ``skip_limit`` of a run's optimizer steps were skipped as non-finite."""

    def __init__(self, skipped: int, steps: int, limit: float) -> None:
        self.skipped, self.steps, self.limit = skipped, steps, limit
        super().__init__(
            f"{skipped} of {steps} optimizer steps were skipped for a non-finite gradient or "
            f"loss, more than skip_limit = {limit:g} of them (a lower lr, or "
            "--set skip_limit=1 to train on regardless); the checkpoint is kept"
        )

    def __reduce__(self) -> tuple:
        # rebuilt from its fields when it crosses a process boundary (a sweep's workers)
        return type(self), (self.skipped, self.steps, self.limit)


def checkpoint_bytes(loop: AdaptiveBatch) -> int:
    """About what one checkpoint takes: the parameters and every tensor of the optimizer's
    state (read off the live objects; the data position and counters are small)."""
    tensors = [p for group in loop.optimizer.param_groups for p in group["params"]]
    tensors += [
        t for state in loop.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
    ]
    return sum(t.numel() * t.element_size() for t in tensors) + 2**20


def _write_summary(
    run: _Run,
    traffic: dict[str, float],
    train_evaluation: dict[str, float] | None,
    *,
    ended: str = "budget",
    why: str | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` (strict JSON) and the run's report; return the summary.

    ``ended`` is one of :data:`~bigbatch.experiments.summary.ENDS`, ``why`` the
    stop's message. A run stopped for non-finite steps has no score (it ranks
    last in a sweep) and says why under ``diverged``.
    """
    out, loop, problem, task = run.out, run.loop, run.problem, run.task
    state = run.state
    rows = read_metrics(out)
    evals = [r for r in rows if "eval_accuracy" in r]
    summary = {
        "task": task.name,
        "run_dir": str(out),
        "ended": ended,
        "why": why or ENDS[ended],
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
        "precision": run.machine.precision,
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
    if ended == "skip_limit":
        summary.update(dict.fromkeys(SCORES), diverged=summary["why"])
        summary.update(target_reached=False, steps_to_target=None, samples_to_target=None)
    strict = strict_json(summary)
    # (a kill while it is written must not leave a summary that reads as damaged)
    write_atomically(out / "summary.json", json.dumps(strict, indent=2, allow_nan=False) + "\n")
    if ended != "error":  # the report of a run that failed could fail the same way
        run_report.render(out)
    return summary


#: the scores a sweep ranks runs by; a diverged run has none
SCORES = ("final_accuracy", "best_accuracy", "final_eval_loss", "best_eval_loss")


def strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite number as None and the value named beside it under
    ``<key>_why`` (strict JSON has no NaN or Infinity)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            out[f"{key}_why"] = f"not a finite number ({value})"
        else:
            out[key] = value
    return out


#: keys in which a finished run may differ from the one asked for and still be reused:
#: the thread count changes float sums, not what the run measures; the allocator, its time
REUSE_IGNORES = frozenset({"threads", "keep_freed_memory"})


def check_same_config(path: Path, config: dict[str, Any]) -> None:
    """A :class:`ConfigError` if the finished run in ``path`` trained another config.

    Runs are found by name (``<stem>-lr<i>-seed<s>``), and a name's rate is an
    index into the arm's grid: when a task's rate or an optimizer's recipe
    changes between two invocations, the same name means another run, and
    reusing it would report one config's score under another's rate.
    """
    if not (path / "config.toml").is_file():
        return
    saved = read_config(path)
    wanted = plan_run(config)
    key = _changed_key({**wanted, **saved}, wanted)  # a key the saved one lacks: as wanted
    if key is not None:
        raise ConfigError(
            f"{str(path)!r} holds a finished run of another config ({key} = "
            f"{saved[key]!r} there, {wanted[key]!r} now): remove it or sweep into "
            "another folder"
        )


def _changed_key(saved: Mapping[str, Any], wanted: RunPlan) -> str | None:
    # the first key (by name) whose saved value is not the wanted one, the machine's aside
    return next(
        (k for k in sorted(wanted.keys() - REUSE_IGNORES) if saved.get(k) != wanted[k]), None
    )


def train_or_reuse(
    config: dict[str, Any],
    out: Path | str,
    *,
    until: int | None = None,
    quiet: bool = True,
    start_from: Path | None = None,
) -> dict[str, Any]:
    """The run in ``out`` to ``until`` samples (None: the end), for a sweep, a study or a
    measurement: reused if finished, else resumed or started (a branch of ``start_from``);
    a diverged run's summary has no scores and says why under ``diverged``."""
    out, config = Path(out), plan_run(config)  # planned once: checked, then trained
    check_same_config(out, config)
    done = finished_summary(out)
    if done is not None:
        return done
    resume = resumable(out)
    branch = {"start_from": start_from} if start_from is not None and not resume else {}
    try:
        return train(config, out, resume=resume, quiet=quiet, until=until, **branch)
    except TooManySkippedError as err:
        return finished_summary(out) or {"diverged": str(err), **dict.fromkeys(SCORES)}

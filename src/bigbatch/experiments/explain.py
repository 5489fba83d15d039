"""Where a run's automatic values come from, in words (``bigbatch train --explain``): the
plan's record of why it chose each value (:func:`~bigbatch.experiments.plan.plan_run`), the
rate first ("0.002 = the mnist1d task's lamb rate 0.004 at batch 64 x 0.5 (sqrt of
16/64)"); what only the model decides (``noise_from = "auto"``) read off the run's engine,
built on the CPU as the run's processes build it (``--nproc N``: N of them).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..batch.controllers import CONTROLLERS, BatchWarmup, contract_of
from ..options import AUTO_EXAMPLES, AUTO_MOST
from ..parallel.world import init_from_env
from .build import build, fit_batches_to_data, run_device
from .config import ConfigError
from .device import threads_of
from .launch import on_ranks
from .plan import RunPlan, plan_run

#: how each rule moves the rate as the batch ``B`` leaves ``B0`` (``batch.base``)
FOLLOWS = {
    "none": "held as the batch changes",
    "linear": "x B/{base} as the batch changes",
    "sqrt": "x sqrt(B/{base}) as the batch changes",
    "adascale": "x AdaScale's gain at B against {base}",
    "adascale-sqrt": "x AdaScale's gain at B against {base}, square-rooted",
}
#: the keys a reader asks about first, in this order; the other filled keys follow
FIRST = ("lr", "batch.lr_scaling", "lr_max", "schedule.kind", "schedule.warmup", "max_samples")


def explain(config: dict[str, Any], processes: int = 1) -> str:
    """The run ``config`` (resolved, not yet filled) describes: its rate, schedule, noise
    statistics and machine in one line each, then every value filled for it and where that
    value came from (``processes``: those ``--nproc`` starts)."""
    plan = plan_run(config)
    if processes > 1:  # what the ranks decide (the similarity, the sub-batches), theirs
        explained = on_ranks(processes, _explain_on_rank, plan, processes)
        if isinstance(explained, ConfigError):
            raise explained
        return explained
    if plan.dist.compression != "none":  # (one process refuses it: nothing is built)
        return _explained(plan, None, processes)
    problem, loop, _ = build(plan)  # what only the data and the model decide
    return _explained(fit_batches_to_data(plan, problem), loop.engine, processes)


def _explain_on_rank(plan: RunPlan, processes: int) -> str | ConfigError | None:
    # one of --nproc's processes: the run built as its rank builds it; rank 0's words
    world = init_from_env(timeout=plan.dist.timeout)
    try:
        if world.rank:  # (rank 0 says what they all would)
            warnings.simplefilter("ignore")
        problem, loop, _ = build(plan, world)
        engine = loop.engine
        return _explained(fit_batches_to_data(plan, problem), engine, processes)
    except ConfigError as err:  # every rank's, alike: the launcher raises rank 0's
        return err
    finally:
        torch.distributed.destroy_process_group()


def _explained(plan: RunPlan, engine: Any, processes: int) -> str:
    origins, opt, batch, schedule = plan.origins, plan.optimizer, plan.batch, plan.schedule
    shape = f"{schedule.kind} over {plan.run.max_samples:,} samples, {schedule.warmup:.0%} warm-up"
    if schedule.kind == "wsd":
        shape += f", {schedule.cooldown:.0%} cool-down"
    lines = [
        f"{plan.run.task}: {opt.name}, {batch.controller} from batch "
        f"{plan['batch.initial']}{_start_why(plan)}",
        f"rate  {opt.lr:.4g} = {origins.get('lr', 'as set (lr)')}; then "
        + FOLLOWS[batch.lr_scaling].format(base=batch.base)
        + " and x the schedule"
        + (f", at most {opt.lr_max:.4g} a step" if opt.lr_max else ""),
        f"schedule  {shape}",
        f"noise     {_noise(plan, engine)}",
        f"machine   {_machine(plan, processes)}",
        "",
        "filled in (every other key is as set or its default; bigbatch train --help):",
    ]
    keys = [k for k in FIRST if k in origins] + sorted(origins.keys() - set(FIRST))
    width = max((len(k) for k in keys), default=0)
    lines += [f"  {key:<{width}}  {plan[key]!r:<10}  {origins[key]}" for key in keys]
    return "\n".join(lines)


def _start_why(run: RunPlan) -> str:
    """Why :class:`BatchWarmup`'s own first batch is small: it grows with the noise scale and
    never shrinks, so a start above the task's best batch would cost loss no later step
    regains, and one below it costs steps the growth repays (docs/adaptive_batching.md)."""
    kind = run.batch.controller
    own = run.origins.get("batch.initial") == f"the {kind} controller's default"
    if not own or not issubclass(CONTROLLERS[kind], BatchWarmup):
        return ""
    return (
        " (its own start, small: the noise scale grows the batch and never shrinks it, so "
        "a start above the best batch would cost loss no later step regains)"
    )


def _noise(run: RunPlan, engine: Any) -> str:
    """Where the run's noise statistics come from and why, as its engine was built (on the
    CPU, one process: under DDP the ranks' halves give the split similarity); a
    compressed run's engine, which one process does not build, by the rule."""
    if engine is None:
        return (
            "the spread of each rank's own micro-batches "
            f"(dist.compression = {run.dist.compression!r}: a lossy reduction)"
        )
    collector = engine.collector
    if collector is None:
        name = type(engine.controller).__name__
        return f"not measured: nothing reads it ({name}; log_statistics = true measures it)"
    many, every = engine.sub_batches, engine.options.statistics_every
    first = engine.options.every_at(engine.batch_size)
    steps, notes = "every step" if first == 1 else f"one step in {first}", []
    if every == "auto":
        steps += f" at batch {engine.batch_size}"
        notes.append(
            f"by the batch: one in {AUTO_EXAMPLES}/B below {AUTO_EXAMPLES}, at most one in "
            f"{AUTO_MOST}, every step from {AUTO_EXAMPLES}"
        )
    between = engine.options.every_at(min(engine.controller.min, engine.batch_size)) > 1
    if between and contract_of(engine.controller).learns_between_measurements:
        notes.append("|G|^2 also from the batch gradient's norm between")
    if notes:
        steps += f" ({'; '.join(notes)})"
    if collector.per_example is not None:
        source = "each example's gradient norm in the one backward"
    else:
        source = "the spread of the micro-batches' gradients"
    return (
        f"{source}, {many} micro-batch{'es' if many > 1 else ''} "
        f"{'a process ' if engine.world.distributed else ''}at least, measured "
        f"{steps}; similarity {collector.similarity} ({engine.noise_why})"
    )


def _machine(run: RunPlan, processes: int = 1) -> str:
    """The device a process would train on, its CPU threads and the forward's precision."""
    device, machine = run_device(run), run.machine
    auto = machine.device == "auto"
    text = f"{device}{' (device auto: no GPU)' if auto and device.type == 'cpu' else ''}"
    if processes > 1:
        text = f"{processes} processes (--nproc), each on {text}"
    if device.type == "cpu":
        threads = threads_of(machine.threads, processes) or torch.get_num_threads()
        text += f", {threads} thread{'s' if threads > 1 else ''}"
        if not machine.threads:
            text += " (the cores shared among them)" if processes > 1 else " (torch's default)"
    text += f"; forward passes in {machine.precision}"
    if machine.compile != "none":
        text += f"; training steps compiled (torch.compile, mode {machine.compile})"
    if machine.asynchronous:
        text += "; each step's numbers read at the next step (asynchronous)"
    if run.dist.compression != "none":
        text += f"; gradients compressed ({run.dist.compression})"
        if processes == 1:  # (one process refuses it: nothing to compress)
            text += ": train with --nproc 2 or more"
    return text

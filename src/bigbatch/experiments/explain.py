"""Where a run's automatic values come from, in words (``bigbatch train --explain``).

A config leaves many keys to someone else: 0 for the task's default or the
controller's, ``"auto"`` for the optimizer's recipe or the rate rule. They are
filled in one place, :func:`~bigbatch.experiments.build.plan_run`,
which records why it chose each value; this module lays that record out, the
rate first, as "0.002 = the mnist1d task's lamb rate 0.004 at batch 64 x 0.5
(sqrt of 16/64)". What only the model decides (``noise_from = "auto"``: each
example's gradient norm where every layer has a rule) is read off the run's
engine, built on the CPU as one process builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..batch.controllers import CONTROLLERS, BatchWarmup, contract_of
from ..options import AUTO_EXAMPLES, AUTO_MOST
from .build import build, fit_batches_to_data, plan_run, run_device

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


def explain(config: dict[str, Any]) -> str:
    """The run ``config`` (resolved, not yet filled) describes: its rate, schedule, noise
    statistics and machine in one line each, then every value filled for it and where that
    value came from."""
    run = plan_run(config)
    origins = dict(run.origins)
    # one process builds the run: what only the data and the model decide
    built = build(run) if run["dist.compression"] == "none" else None
    fitted = fit_batches_to_data(run, built[0]) if built else run  # as build fitted its own
    if fitted["batch.max"] != run["batch.max"]:
        origins["batch.max"] = f"the training set's size (batch.max {run['batch.max']:,} is larger)"
        run = fitted
    schedule = (
        f"{run['schedule.kind']} over {run['max_samples']:,} samples, "
        f"{run['schedule.warmup']:.0%} warm-up"
    )
    if run["schedule.kind"] == "wsd":
        schedule += f", {run['schedule.cooldown']:.0%} cool-down"
    lines = [
        f"{run['task']}: {run['optimizer']}, {run['batch.controller']} from batch "
        f"{run['batch.initial']}{_start_why(run, origins)}",
        f"rate  {run['lr']:.4g} = {origins.get('lr', 'as set (lr)')}; then "
        + FOLLOWS[run["batch.lr_scaling"]].format(base=run["batch.base"])
        + " and x the schedule"
        + (f", at most {run['lr_max']:.4g} a step" if run["lr_max"] else ""),
        f"schedule  {schedule}",
        f"noise     {_noise(run, built[1].engine if built else None)}",
        f"machine   {_machine(run)}",
        "",
        "filled in (every other key is as set or its default; bigbatch train --help):",
    ]
    keys = [k for k in FIRST if k in origins] + sorted(origins.keys() - set(FIRST))
    width = max((len(k) for k in keys), default=0)
    lines += [f"  {key:<{width}}  {run[key]!r:<10}  {origins[key]}" for key in keys]
    return "\n".join(lines)


def _start_why(run: Mapping[str, Any], origins: Mapping[str, str]) -> str:
    """Why :class:`BatchWarmup`'s own first batch is small: it grows with the noise scale and
    never shrinks, so a start above the task's best batch would cost loss no later step
    regains, and one below it costs steps the growth repays (docs/adaptive_batching.md)."""
    own = origins.get("batch.initial") == f"the {run['batch.controller']} controller's default"
    if not own or not issubclass(CONTROLLERS[run["batch.controller"]], BatchWarmup):
        return ""
    return (
        " (its own start, small: the noise scale grows the batch and never shrinks it, so "
        "a start above the best batch would cost loss no later step regains)"
    )


def _noise(run: dict[str, Any], engine: Any) -> str:
    """Where the run's noise statistics come from and why, as its engine was built (on the
    CPU, one process: under DDP the ranks' halves give the split similarity); a
    compressed run's engine, which one process does not build, by the rule."""
    if engine is None:
        return (
            "the spread of each rank's own micro-batches "
            f"(dist.compression = {run['dist.compression']!r}: a lossy reduction)"
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
        f"{source}, {many} micro-batch{'es' if many > 1 else ''} at least, measured "
        f"{steps}; similarity {collector.similarity} ({engine.noise_why})"
    )


def _machine(run: dict[str, Any]) -> str:
    """The device this process would train on, its CPU threads and the forward's precision."""
    device = run_device(run)
    auto = run["device"] == "auto"
    text = f"{device}{' (device auto: no GPU)' if auto and device.type == 'cpu' else ''}"
    if device.type == "cpu":
        threads = run["threads"] or torch.get_num_threads()
        text += f", {threads} thread{'s' if threads > 1 else ''}"
        text += "" if run["threads"] else " (torch's default)"
    return f"{text}; forward passes in {run['precision']}"

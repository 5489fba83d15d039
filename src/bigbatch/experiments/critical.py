"""The critical batch along a run, measured by branched training (``bigbatch critical-batch``).

Merrill et al. 2025 ("Critical batch size revisited", arXiv:2505.23971)
measure the critical batch where the noise scale only estimates it: train a
small-batch run; from its checkpoints, train short branches at larger
batches with the learning-rate rule under test; the critical batch at that
point is the largest batch whose branch ends within a tolerance of the
small batch's loss after the same number of samples. A batch at or below it
trades no samples for its fewer steps; one above it does.

Here the small-batch run is a ``constant`` run at the smallest batch of the
list, snapshots are taken in memory at the chosen fractions of its budget,
and every branch (the smallest batch's included: it is the reference, and
equals continuing the run) restores a snapshot exactly — model, optimizer,
data order, random state and sample count, so the schedule continues — and
trains ``branch_samples`` samples. Beside each measured point the report
puts the noise scale that the base run logged there, with its bounds, and
the estimate the config's controller would compare with the next size there
(``BatchWarmup.critical_batch()``, from a copy of the controller that watches
the base run's statistics without deciding anything), so the three can be
compared.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .build import build, make_controller, train_step, with_task_defaults
from .config import ConfigError, resolve
from .device import resolve_device, set_tf32, set_threads
from .plots import pyplot
from .tasks import Problem

#: the rows of the base run averaged for the noise scale beside a point
NOISE_ROWS = 20


@dataclass
class Point:
    """What was measured at one branching point."""

    fraction: float
    samples: int
    schedule: float
    losses: dict[int, float]
    critical_batch: int
    noise_scale: float
    noise_scale_low: float
    noise_scale_high: float
    #: what the config's controller would compare with the next size at this point
    #: (BatchWarmup's ``critical_batch()``); NaN for a controller without one
    controller_estimate: float = math.nan


def critical_batch(losses: dict[int, float], tolerance: float) -> int:
    """The largest batch whose branch loss is within ``tolerance`` of the smallest batch's.

    The smallest batch is the reference, so the answer is at least it; a
    non-finite loss (a diverged branch) never passes.
    """
    if not losses:
        raise ValueError("no branch losses to choose a critical batch from")
    reference = losses[min(losses)]
    passing = [
        b for b, loss in losses.items() if math.isfinite(loss) and loss <= reference + tolerance
    ]
    return max(passing, default=min(losses))


def check_options(
    batches: Sequence[int], points: Sequence[float], branch_samples: int, tolerance: float
) -> None:
    """A :class:`ConfigError` naming the first bad option, if any."""
    if len(batches) < 2 or any(b < 1 for b in batches) or len(set(batches)) < len(batches):
        raise ConfigError(
            f"--batches needs two or more distinct positive sizes, got {list(batches)}"
        )
    if not points or any(not 0 < p < 1 for p in points):
        raise ConfigError(f"--points are fractions of the budget in (0, 1), got {list(points)}")
    if branch_samples < 0 or not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ConfigError(
            f"--branch-samples must be >= 0 and --tolerance a finite number >= 0, got "
            f"{branch_samples} and {tolerance}"
        )


def measure(
    config: dict[str, Any],
    out: Path,
    *,
    batches: Sequence[int],
    points: Sequence[float],
    branch_samples: int = 0,
    tolerance: float = 0.01,
    lr_rule: str = "auto",
    quiet: bool = False,
) -> list[Point]:
    """Train the base run, branch at ``points``, write ``out``; return the measured points.

    ``branch_samples`` 0 means 5% of the budget, rounded up to a multiple of
    the largest batch (so every branch trains whole steps of the same samples).
    """
    batches = sorted(batches)
    check_options(batches, points, branch_samples, tolerance)
    small = batches[0]
    base = _config(config, small, small, lr_rule)
    lr_rule = base["batch.lr_scaling"]  # auto resolved: the task's rule, else the family's
    budget = base["max_samples"]
    if not branch_samples:
        branch_samples = math.ceil(0.05 * budget / batches[-1]) * batches[-1]
    device = resolve_device(base["device"])
    set_tf32(base["tf32"])
    set_threads(base["threads"])
    out.mkdir(parents=True, exist_ok=True)
    marks = sorted(math.ceil(p * budget) for p in points)
    # the config's own controller watches the base run without deciding anything, so each
    # point shows what it would have compared with the next size there
    shadow = make_controller(with_task_defaults(config))
    snapshots, rows = _train_base(base, device, marks, out, quiet, shadow)
    measured = []
    for fraction, snapshot in zip(sorted(points), snapshots):
        losses = {}
        for batch in batches:
            branch = _config(config, batch, small, lr_rule)
            losses[batch] = _branch(branch, device, snapshot, branch_samples)
            if not quiet:
                print(f"  point {fraction:g}: batch {batch} -> eval loss {losses[batch]:.4f}")
        measured.append(_point(fraction, snapshot, losses, tolerance, rows))
        _write(out, config, repr(shadow), batches, branch_samples, tolerance, lr_rule, measured)
    render(out)
    return measured


def _config(config: dict[str, Any], batch: int, small: int, lr_rule: str) -> dict[str, Any]:
    overrides = {
        "batch.controller": "constant",
        "batch.initial": batch,
        "batch.min": min(batch, config["batch.min"]),
        "batch.lr_scaling": lr_rule,
        "batch.base": small,
    }
    return with_task_defaults(resolve(config, overrides))


def _evaluate(problem: Problem) -> dict[str, float]:
    return problem.evaluate(problem.model)


def _train_base(
    config: dict[str, Any],
    device: Any,
    marks: list[int],
    out: Path,
    quiet: bool,
    shadow: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The small-batch run: its metrics rows (written to ``base.jsonl``) and a snapshot of
    the loop at the first step past each mark. ``shadow``, a controller, sees every step's
    statistics; where it has a ``critical_batch()`` estimate, each row logs it."""
    watches = callable(getattr(shadow, "critical_batch", None))
    problem, loop, precision = build(config, None, device)
    snapshots, rows = [], []
    with (out / "base.jsonl").open("w") as log:
        for step in loop.steps(max_samples=marks[-1]):
            train_step(step, problem, loop, precision)
            row = dict(step.metrics)
            if watches:
                # told it is at its largest batch already, it never proposes a change, so
                # its average is never restarted
                shadow.next(step.metrics, shadow.max, loop.samples)
                row["controller_estimate"] = shadow.critical_batch()
            if loop.steps_taken % config["eval_every"] == 0:
                row.update(_evaluate(problem))
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            while len(snapshots) < len(marks) and loop.samples >= marks[len(snapshots)]:
                snapshots.append(copy.deepcopy(loop.state_dict()))
                if not quiet:
                    print(f"snapshot at {loop.samples:,} samples (step {loop.steps_taken})")
    return snapshots, rows


def _branch(config: dict[str, Any], device: Any, snapshot: dict[str, Any], samples: int) -> float:
    """The eval loss after ``samples`` more samples at the config's batch, from ``snapshot``."""
    problem, loop, precision = build(config, None, device)
    loop.load_state_dict(copy.deepcopy(snapshot))
    loop.engine.batch_size = config["batch.initial"]
    for step in loop.steps(max_samples=loop.samples + samples):
        train_step(step, problem, loop, precision)
    return _evaluate(problem)["eval_loss"]


def _point(
    fraction: float,
    snapshot: dict[str, Any],
    losses: dict[int, float],
    tolerance: float,
    rows: list[dict[str, Any]],
) -> Point:
    samples = snapshot["engine"]["samples"]
    before = [r for r in rows if r["samples"] <= samples][-NOISE_ROWS:]

    def near(key: str) -> float:
        values = [r[key] for r in before if math.isfinite(r.get(key, math.nan))]
        return statistics.fmean(values) if values else math.nan

    return Point(
        fraction=fraction,
        samples=samples,
        schedule=before[-1].get("schedule", 1.0) if before else 1.0,
        losses=losses,
        critical_batch=critical_batch(losses, tolerance),
        noise_scale=near("noise_scale"),
        noise_scale_low=near("noise_scale_low"),
        noise_scale_high=near("noise_scale_high"),
        controller_estimate=before[-1].get("controller_estimate", math.nan) if before else math.nan,
    )


def _write(
    out: Path,
    config: dict[str, Any],
    controller: str,
    batches: list[int],
    branch_samples: int,
    tolerance: float,
    lr_rule: str,
    measured: list[Point],
) -> None:
    data = {
        "config": config,
        "batches": batches,
        "branch_samples": branch_samples,
        "tolerance": tolerance,
        "lr_rule": lr_rule,
        "controller": controller,
        "points": [asdict(p) for p in measured],
    }
    (out / "critical_batch.json").write_text(json.dumps(data, indent=2) + "\n")


def render(out: Path) -> str:
    """``critical_batch.md`` and ``critical_batch.png`` from ``critical_batch.json``; the table."""
    data = json.loads((out / "critical_batch.json").read_text())
    batches, points = data["batches"], data["points"]
    lines = [
        f"# Critical batch of {data['config']['task']}, measured by branching",
        "",
        f"Base run at batch {batches[0]}; branches of {data['branch_samples']:,} samples with "
        f"the {data['lr_rule']} rate rule; tolerance {data['tolerance']:g} in eval loss. "
        "Each batch's column is its branch loss minus the reference (the base batch's); "
        "B_simple is the base run's 20-step noise scale, the controller's estimate what "
        f"{data.get('controller', 'the controller')} would compare with the next size there.",
        "",
        "| fraction | samples | schedule | reference loss | critical batch "
        + "| B_simple [low, high] | controller's estimate | "
        + " | ".join(str(b) for b in batches)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(batches),
    ]
    for p in points:
        losses = {int(b): v for b, v in p["losses"].items()}
        reference = losses[batches[0]]
        deltas = " | ".join(f"{losses[b] - reference:+.4f}" for b in batches)
        lines.append(
            f"| {p['fraction']:g} | {p['samples']:,} | {p['schedule']:.2f} | {reference:.4f} "
            f"| **{p['critical_batch']}** | {p['noise_scale']:.1f} "
            f"[{p['noise_scale_low']:.1f}, {p['noise_scale_high']:.1f}] "
            f"| {p.get('controller_estimate', math.nan):.1f} | {deltas} |"
        )
    lines += ["", "![critical batch](critical_batch.png)", ""]
    table = "\n".join(lines)
    (out / "critical_batch.md").write_text(table)
    _plot(out, batches, points)
    return table


def _plot(out: Path, batches: list[int], points: list[dict[str, Any]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in batches:
        ax.axhline(b, color="0.85", lw=0.6, zorder=0)
    samples = [p["samples"] for p in points]
    ax.plot(
        samples, [p["critical_batch"] for p in points], "o-", label="critical batch (branching)"
    )
    ax.plot(samples, [p["noise_scale"] for p in points], "s--", color="tab:gray", label="B_simple")
    estimates = [p.get("controller_estimate", math.nan) for p in points]
    if any(math.isfinite(e) for e in estimates):
        ax.plot(samples, estimates, "^:", color="tab:orange", label="the controller's estimate")
    ax.fill_between(
        samples,
        [max(p["noise_scale_low"], 1e-3) for p in points],
        [min(p["noise_scale_high"], 10 * batches[-1]) for p in points],
        color="tab:gray",
        alpha=0.2,
        lw=0,
    )
    ax.set(xlabel="samples", ylabel="batch (samples)", yscale="log")
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "critical_batch.png", dpi=110)
    plt.close(fig)

"""The critical batch along a run, measured by branched training (``bigbatch critical-batch``).

Merrill et al. 2025 (arXiv:2505.23971): from checkpoints of a small-batch run, train
short branches at larger batches under the rate rule; the critical batch at that point
is the largest whose branch ends within a tolerance of the small batch's loss after the
same samples. The base run (``DIR/base``, a constant batch) is paused at the chosen
fractions with a snapshot kept; every branch is a run from a snapshot
(``DIR/branch-<i>-<batch>``), continued when the command runs again. The report puts the
base run's noise scale and the config's controller's estimate beside each point.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import runner
from .build import check_batches_fit
from .config import ConfigError, resolve
from .options import CriticalSettings
from .plan import make_controller, plan_run
from .report.critical_batch import PLAN, render
from .rundir import CHECKPOINT, claim_plan, copy_atomically, read_metrics, write_atomically
from .signals import stops_as_a_whole

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


def measure(
    config: dict[str, Any],
    out: Path,
    settings: CriticalSettings | None = None,
    *,
    quiet: bool = False,
) -> list[Point]:
    """Train the base run, branch where ``settings`` say, write ``out``; return the points.

    No batches: the config's first batch and its doublings up to 32 times it. No
    ``branch_samples``: 5% of the budget, rounded up to a multiple of every batch
    (so every branch trains whole steps of the same samples).
    """
    settings = settings or CriticalSettings()
    planned = plan_run(config)
    first = planned["batch.initial"]
    batches = sorted(settings.batches or [first * 2**k for k in range(6)])
    small = batches[0]
    base = _config(config, small, small, settings.lr_rule)
    lr_rule = base["batch.lr_scaling"]  # auto resolved: the task's rule, else the family's
    budget = base["max_samples"]
    steps_of_all = math.lcm(*batches)  # a branch of whole steps at every batch
    branch_samples = settings.branch_samples
    if not branch_samples:
        branch_samples = math.ceil(0.05 * budget / steps_of_all) * steps_of_all
    _check_branches_fit(batches, sorted(settings.points), budget, branch_samples)
    # every branch planned (and so checked) before the measurement's folder is claimed
    branches = {batch: _config(config, batch, small, lr_rule) for batch in batches}
    # ... and the largest against the training set (its own run would find it too large
    # only after the base run and the smaller branches had trained)
    check_batches_fit([branches[batches[-1]]])
    plan = {"config": config, "batches": batches, "points": sorted(settings.points)}
    plan.update(branch_samples=branch_samples, tolerance=settings.tolerance, lr_rule=lr_rule)
    lock = claim_plan(out, PLAN, plan, "critical-batch measurement", config_at="config")
    marks = sorted(math.ceil(p * budget) for p in settings.points)
    # the config's own controller replays the base run without deciding anything, so each
    # point shows what it would have compared with the next size there
    shadow, measured = make_controller(planned), []
    plan["controller"] = repr(shadow)  # as it starts
    try:
        with stops_as_a_whole(out):  # a run inside stopped: the measurement goes on as a whole
            snapshots = _train_base(base, out, marks, quiet)
            rows = _with_estimates(read_metrics(out / BASE), shadow)
            for index, (fraction, mark) in enumerate(zip(plan["points"], marks)):
                at = next(r["samples"] for r in rows if r["samples"] >= mark)  # the base's pause
                losses = {}
                for batch, branch in branches.items():
                    where = out / f"branch-{index}-{batch}"
                    losses[batch] = _branch(branch, where, snapshots[index], at + branch_samples)
                    if not quiet:
                        print(
                            f"  point {fraction:g}: batch {batch} -> eval loss {losses[batch]:.4f}"
                        )
                measured.append(_point(fraction, at, losses, settings.tolerance, rows))
                data = _finite_or_none({**plan, "points": [asdict(p) for p in measured]})
                text = json.dumps(data, indent=2, allow_nan=False)  # strict JSON: no NaN
                write_atomically(out / "critical_batch.json", text + "\n")
    finally:
        lock.release()
    render(out)
    return measured


def _check_branches_fit(
    batches: list[int], points: list[float], budget: int, branch_samples: int
) -> None:
    # branches cut short by the budget, or of part steps, train unequal samples: their
    # losses would compare unlike things (a larger batch "passing" on more samples)
    for batch in batches:
        if branch_samples % batch:
            raise ConfigError(
                f"branches of {branch_samples:,} samples are not whole steps at batch "
                f"{batch:,}: give --branch-samples a multiple of {math.lcm(*batches):,}"
            )
    last = math.ceil(points[-1] * budget / batches[0]) * batches[0]  # where the base pauses
    if last + branch_samples > budget:
        raise ConfigError(
            f"point {points[-1]:g} leaves {max(budget - last, 0):,} samples of max_samples "
            f"({budget:,}) for branches of {branch_samples:,}: lower the point, shorten "
            "--branch-samples, or raise max_samples"
        )


def _finite_or_none(value: Any) -> Any:
    # NaN and infinities (a noise scale not measured, an unbounded interval) as null
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def _config(config: dict[str, Any], batch: int, small: int, lr_rule: str) -> dict[str, Any]:
    overrides = {
        "batch.controller": "constant",
        "batch.initial": batch,
        "batch.min": min(batch, config["batch.min"]),
        "batch.lr_scaling": lr_rule,
        "batch.base": small,
        # the measurement reports the noise scale along the run beside the branches' losses
        "log_statistics": True,
        # every branch is compared at the same samples: none may end early at the target
        "stop_at_target": False,
    }
    return plan_run(resolve(config, overrides))


#: the base run's directory inside the measurement's
BASE = "base"


def _train_base(config: dict[str, Any], out: Path, marks: list[int], quiet: bool) -> list[Path]:
    """The small-batch run, paused at the first step past each mark, where its checkpoint
    is kept as that mark's snapshot; a snapshot kept by an earlier call is reused."""
    base, snapshots = out / BASE, []
    for index, mark in enumerate(marks):
        snapshot = out / f"snapshot-{index}.pt"
        if not snapshot.is_file():
            record = runner.train_or_reuse(config, base, quiet=quiet, until=mark)
            copy_atomically(base / CHECKPOINT, snapshot)
            if not quiet:
                print(f"snapshot at {record['samples']:,} samples (step {record['steps']})")
        snapshots.append(snapshot)
    return snapshots


def _with_estimates(rows: list[dict[str, Any]], shadow: Any) -> list[dict[str, Any]]:
    """The base run's rows, each with what ``shadow`` (a controller) would compare with
    the next size after it, where the controller has such an estimate."""
    if not callable(getattr(shadow, "critical_batch", None)):
        return rows
    for row in rows:
        # told it is at its largest batch already, it never proposes a change, so its
        # average is never restarted
        shadow.next(row, shadow.max, row["samples"])
        row["controller_estimate"] = shadow.critical_batch()
    return rows


def _branch(config: dict[str, Any], out: Path, snapshot: Path, until: int) -> float:
    """The eval loss of a branch from ``snapshot`` at the config's batch after it reaches
    ``until`` samples (or the end of the budget, if that comes first); NaN if it diverged."""
    record = runner.train_or_reuse(config, out, until=until, start_from=snapshot)
    loss = record.get("eval_loss") if record.get("paused") else record.get("final_eval_loss")
    # the run's skip limit counts the base's steps before the snapshot too: a branch of NaN
    # steps stayed under it and scored the snapshot's own loss; judged on its own rows here
    if loss is None:
        return math.nan
    rows = read_metrics(out)
    skipped = sum(1 for r in rows if r.get("skipped"))
    return math.nan if skipped > config["skip_limit"] * len(rows) else loss


def _point(
    fraction: float,
    samples: int,
    losses: dict[int, float],
    tolerance: float,
    rows: list[dict[str, Any]],
) -> Point:
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

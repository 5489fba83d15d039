"""Adaptive batching against the static-batch frontier, with the same tuning budget for every arm.

    python benchmarks/evidence_batch.py --task mnist1d --out runs/evidence-mnist1d --jobs 2
    python benchmarks/evidence_batch.py --task lm --out runs/evidence-lm --jobs 2
    python benchmarks/evidence_batch.py --task mnist1d --quick        # a first look, one seed
    python benchmarks/evidence_batch.py --task lm --arms static       # only the static batches

Arms, each trained for the task's sample budget with a cosine schedule:

- static batches 64, 256, 1024, 4096 and 16384 (the constant controller), at
  the task's scaled rate × {0.5, 1, 2} carried from batch 64 by the family's
  rule (``sqrt`` for LAMB);
- ``simigrad`` (the published controller, target 1/3, the same scaled rates);
- ``critical_ramp`` with its defaults and ``damped_simigrad`` at the
  similarity that corresponds to the ramp's multiple (``s* = κ / (κ + 2)``,
  0.8), both from batch 256 with the rate held (``lr_scaling = auto``), at
  the task's held rate × {0.5, 1, 2};
- with ``--kappas``, ``critical_ramp`` at other multiples κ, the same way.

Every arm gets a 3-point grid on seed 0; its best rate (fewest steps to the
task's target, then the best metric) is rerun on seeds 1 and 2. For each arm:
optimizer steps and samples to the target (mean ± std over the 3 seeds), the
best accuracy (lm: eval loss) and the batch path ratio. The static frontier
is the seed-mean (samples, steps) of the static batches, interpolated in
log-log; an adaptive run's saving is ``1 - steps / frontier(samples)``, where
outside the static range the frontier is held at its nearest end (fewer
samples than any static run: the static run with the fewest samples; more:
the last segment extended), both conservative for the adaptive run. ``--arms``
trains only the arms whose names start with the given words (a long grid can
be trained in parts; the table then covers the arms trained so far). Writes
``evidence.md``, ``evidence.json`` and ``steps_vs_samples.png`` into ``--out``
(runs already there are reused, so a killed benchmark continues).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bigbatch.experiments.sweep import Arm, sweep

STATIC = (64, 256, 1024, 4096, 16384)
MULTIPLIERS = (0.5, 1.0, 2.0)
CONTROLLERS = ("simigrad", "critical_ramp", "damped_simigrad")


def base(task_name: str) -> dict[str, Any]:
    return {
        "task": task_name,
        "batch.base": 64,
        "batch.min": 16,
        "batch.max": 16384,
        "eval_every": 10,
        "threads": 1,
    }


def arms(task_name: str, quick: bool, kappas: tuple[float, ...] = ()) -> list[Arm]:
    """Each arm's overrides of the base, its ``lr`` the middle of its grid."""
    from bigbatch.experiments.tasks import TASKS

    task = TASKS[task_name]
    scaled, held = task.lr("adam", held=False), task.lr("adam", held=True)
    out: dict[str, dict[str, Any]] = {}
    for batch in (256, 1024, 4096) if quick else STATIC:
        out[f"static {batch}"] = {
            "batch.controller": "constant",
            "batch.initial": batch,
            "lr": scaled,
        }
    for kind in CONTROLLERS:
        settings: dict[str, Any] = {"batch.controller": kind}
        if kind == "simigrad":  # as published: from the small batch, target 1/3, sqrt rule
            settings.update({"batch.initial": 64, "batch.target": 1 / 3, "lr": scaled})
        else:  # the defaults; the damped target at the ramp's multiple: s* = κ / (κ + 2)
            settings.update({"batch.initial": 256, "lr": held})
            if kind == "damped_simigrad":
                settings["batch.target"] = 0.8
        out[kind] = settings
    for kappa in kappas:  # the ramp at other multiples κ, each with its own grid
        out[f"critical_ramp k={kappa:g}"] = {
            "batch.controller": "critical_ramp",
            "batch.initial": 256,
            "batch.noise_multiple": kappa,
            "lr": held,
        }
    return [Arm(name, overrides, name.replace(" ", "")) for name, overrides in out.items()]


def frontier(points: list[tuple[float, float]], samples: float) -> float:
    """Static steps at ``samples``: log-log interpolation, held at the ends (see the docstring)."""
    points = sorted(points)
    if samples <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if samples <= x1:
            t = math.log(samples / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    if len(points) == 1:
        return points[0][1]
    (x0, y0), (x1, y1) = points[-2], points[-1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y1 * (samples / x1) ** slope


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mnist1d", choices=("mnist1d", "lm", "teacher", "digits"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="3 static batches, no grid, 1 seed")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--kappas", type=float, nargs="*", default=[], help="more arms: critical_ramp at these κ"
    )
    parser.add_argument(
        "--arms", nargs="*", default=None, help="only the arms whose names start with these"
    )
    args = parser.parse_args()

    from bigbatch.experiments.tasks import TASKS

    task = TASKS[args.task]
    lower = task.lower_is_better
    root = Path(args.out or f"runs/evidence-{args.task}{'-quick' if args.quick else ''}")
    root.mkdir(parents=True, exist_ok=True)
    grid = arms(args.task, args.quick, tuple(args.kappas))
    if args.arms is not None:
        grid = [a for a in grid if a.name.startswith(tuple(args.arms))]
        if not grid:
            parser.error(f"--arms {' '.join(args.arms)}: no arm starts with these")

    results = sweep(
        base(args.task),
        grid,
        root,
        multipliers=(1.0,) if args.quick else MULTIPLIERS,
        seeds=1 if args.quick else args.seeds,
        rank="steps",
        jobs=args.jobs,
    )
    table: dict[str, dict[str, Any]] = {}
    for result in results:
        runs = result.runs
        reached = [r for r in runs if r["steps_to_target"] is not None]
        metric = [r["best_eval_loss"] if lower else r["best_accuracy"] for r in runs]
        table[result.name] = {
            "lr": result.lr,
            "grid_lrs": result.lrs,
            "reached": f"{len(reached)}/{len(runs)}",
            "steps": [r["steps_to_target"] for r in runs],
            "samples": [r["samples_to_target"] for r in runs],
            "best": metric,
            "path_ratio": [r["batch_path_ratio"] for r in runs],
            "avg_batch": [r["avg_batch_size"] for r in runs],
        }
    static_points = []
    for arm, row in table.items():
        if arm.startswith("static") and all(s is not None for s in row["steps"]):
            static_points.append((statistics.fmean(row["samples"]), statistics.fmean(row["steps"])))
    best_static = (min if lower else max)(
        (statistics.fmean(r["best"]) for a, r in table.items() if a.startswith("static")),
        default=math.nan,
    )
    for arm, row in table.items():
        if arm.startswith("static") or not static_points:
            continue
        savings = [
            1 - st / frontier(static_points, sa) if st is not None else None
            for st, sa in zip(row["steps"], row["samples"])
        ]
        row["saving"] = savings
        row["frontier_at_mean"] = (
            frontier(static_points, statistics.fmean(row["samples"]))
            if all(s is not None for s in row["samples"])
            else None
        )
        row["best_vs_static"] = statistics.fmean(row["best"]) - best_static

    (root / "evidence.json").write_text(json.dumps(table, indent=2) + "\n")
    write_report(root, args, task, table, static_points)


def _fmt(mean_std: tuple[float, float], digits: int = 0) -> str:
    mean, std = mean_std
    if math.isnan(mean):
        return "—"
    return f"{mean:,.{digits}f} ± {std:,.{digits}f}"


def write_report(root: Path, args, task, table, static_points) -> None:
    lower = task.lower_is_better
    metric = "best eval loss" if lower else "best accuracy"
    name = task.target_metric.removeprefix("eval_")
    lines = [
        f"# Adaptive against static batches: {args.task}",
        "",
        f"Target: {name} {task.target:g}; budget {task.max_samples:,} samples; "
        f"{1 if args.quick else args.seeds} seed(s).",
        "",
        f"| arm | lr (grid) | reached | steps to target | samples to target | {metric} "
        "| path ratio | saving vs frontier |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, row in table.items():
        ok = all(s is not None for s in row["steps"])
        steps = _mean_std([s for s in row["steps"] if s is not None]) if ok else (math.nan, 0)
        samples = _mean_std([s for s in row["samples"] if s is not None]) if ok else (math.nan, 0)
        savings = [s for s in row.get("saving", []) if s is not None]
        saving = (
            f"{statistics.fmean(savings):+.0%} (worst {min(savings):+.0%})"
            if savings and len(savings) == len(row["steps"])
            else "—"
        )
        grid = ", ".join(f"{x:.3g}" for x in row["grid_lrs"])
        paths = [p for p in row["path_ratio"] if p is not None]
        lines.append(
            f"| {arm} | {row['lr']:.3g} ({grid}) | {row['reached']} | {_fmt(steps)} "
            f"| {_fmt(samples)} | {_fmt(_mean_std(row['best']), 4)} "
            f"| {max(paths) if paths else math.nan:.2f} | {saving} |"
        )
    lines += ["", "![steps vs samples to the target](steps_vs_samples.png)", ""]
    (root / "evidence.md").write_text("\n".join(lines))
    print("\n".join(lines))
    plot(root, args, task, table, static_points)


def plot(root: Path, args, task, table, static_points) -> None:
    from bigbatch.experiments.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    if static_points:
        xs = [p[0] for p in sorted(static_points)]
        ax.plot(
            xs,
            [p[1] for p in sorted(static_points)],
            "o-",
            color="black",
            label="static frontier (seed means)",
        )
        for arm, row in table.items():
            if arm.startswith("static") and all(s is not None for s in row["steps"]):
                ax.annotate(
                    arm.replace("static ", "B="),
                    (statistics.fmean(row["samples"]), statistics.fmean(row["steps"])),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    markers = itertools.cycle(("*", "D", "^", "s", "v", "P", "X"))
    for arm, row in table.items():
        if arm.startswith("static"):
            continue
        pts = [(sa, st) for sa, st in zip(row["samples"], row["steps"]) if st is not None]
        if not pts:
            continue
        marker = next(markers)
        line = ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker,
            ms=9,
            alpha=0.6,
            linestyle="none",
            label=f"{arm} (each seed)",
        )[0]
        ax.plot(
            [statistics.fmean(p[0] for p in pts)],
            [statistics.fmean(p[1] for p in pts)],
            marker,
            ms=14,
            color=line.get_color(),
            markeredgecolor="black",
        )
    name = task.target_metric.removeprefix("eval_")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"samples to {name} {task.target:g}")
    ax.set_ylabel(f"optimizer steps to {name} {task.target:g}")
    ax.set_title(f"{args.task}: below the line = fewer steps at equal samples", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "steps_vs_samples.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""Adaptive batching against static batches, under a protocol a sceptic would accept.

    python benchmarks/evidence_batch.py --task text --out runs/evidence-text
    python benchmarks/evidence_batch.py --task lm --out runs/evidence-lm
    python benchmarks/evidence_batch.py --task mnist1d --out runs/evidence-mnist1d
    python benchmarks/evidence_batch.py --task lm --quick          # a smoke test, minutes

The protocol:

- **Arms.** Static batches (``--static``, default 32 64 128 256 1024: they
  bracket the best static batch and go below the adaptive start), the
  default controller of ``bigbatch train`` (``default``: nothing about the
  batch overridden), and named extra arms (``--arm NAME:key=value,...``).
- **One rate grid for all.** Every arm trains on the same absolute rates
  (``--lrs``; default the task's Adam-type rate × 1/2, 1, 2, 4), each the
  arm's rate at its first batch (static arms hold it: ``lr_scaling =
  none``); a best rate at an end of the grid widens it by ×2 on that side,
  up to ``--widen`` times (``bigbatch.experiments.sweep``).
- **Chosen by final quality**: each arm's rate is the one with the best
  final metric (eval loss; accuracy on mnist1d) on seed 0, then trained on
  ``--seeds`` seeds.
- **Evaluation** every 640 samples on a static arm (every 10 steps on
  batch 64), every 10 steps on an adaptive one.
- **One budget and schedule**: the task's sample budget (or
  ``--max-samples``) and its cosine schedule in samples, for every arm.
- **Targets**: 50, 75, 90, 95, 99 and 100% of the way from the initial
  metric (the static arms' first evaluation) to the best static arm's final
  metric (seed mean). For each, the static arms' seed-mean (samples, steps)
  make the frontier, interpolated in log-log and held at its ends; an
  adaptive seed's ratio is its steps over the frontier's at its own samples
  (below 1: fewer steps at equal samples). Reported: the mean and worst
  seed's ratio, each arm's final-metric gap to the best static arm, and the
  wall-clock seconds to each target (``wall_seconds`` in metrics.jsonl: runs
  that share the machine, ``--jobs`` > 1, slow each other).

With ``--tune``, each arm's rate is searched by ``bigbatch tune`` over the
range of ``--lrs`` (chosen by the final metric, not widened) instead of
training every point: cheaper on a wide range; the grid stays the reference.

Writes ``evidence.md``, ``evidence.json``, ``steps_vs_samples.png`` and
``curves.png`` into ``--out``; finished runs there are reused, so a killed
benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from bigbatch.experiments.analysis import first_reaching, mean_std, targets_between
from bigbatch.experiments.config import parse_assignment
from bigbatch.experiments.rundir import read_metrics
from bigbatch.experiments.sweep import Arm, ArmResult, sweep
from bigbatch.experiments.tasks import TASKS, Task

FRACTIONS = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
#: samples between evaluations of a static arm (batch 64 evaluates every 10 steps, like the
#: adaptive arms at their start); evaluation costs a small batch as much as its training
EVAL_SAMPLES = 640


def make_arms(statics: list[int], extra: list[str]) -> list[Arm]:
    arms = [
        Arm(
            f"static {b}",
            {
                "batch.controller": "constant",
                "batch.initial": b,
                "batch.lr_scaling": "none",
                "eval_every": max(1, round(EVAL_SAMPLES / b)),
            },
            f"static{b}",
        )
        for b in statics
    ]
    arms.append(Arm("default", {}, "default"))
    for text in extra:
        name, _, settings = text.partition(":")
        overrides = dict(parse_assignment(s) for s in settings.split(",") if s)
        arms.append(Arm(name, overrides, name.replace(" ", "_")))
    return arms


def frontier(points: list[tuple[float, float]], samples: float) -> float:
    """Static steps at ``samples``: log-log interpolation, held at the ends beyond them."""
    points = sorted(points)
    if samples <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if samples <= x1:
            t = math.log(samples / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def analyse(task: Task, results: list[ArmResult], root: Path) -> dict[str, Any]:
    """Targets, per-arm steps and samples to each, frontier ratios and final gaps."""
    key, lower = task.target_metric, task.lower_is_better
    rows = {r.name: [read_metrics(root / d) for d in r.dirs] for r in results}
    evals = {name: [[x for x in run if key in x] for run in runs] for name, runs in rows.items()}
    static = [r for r in results if r.name.startswith("static")]
    start = statistics.fmean(evals[r.name][0][0][key] for r in static)
    finals = {r.name: mean_std(run[-1][key] for run in evals[r.name]) for r in results}
    best_static = (min if lower else max)(finals[r.name][0] for r in static)
    targets = targets_between(start, best_static, FRACTIONS)
    table: dict[str, Any] = {"start": start, "best_static": best_static, "arms": {}}
    for r in results:
        reach = [[_reaching(run, value, key, lower) for run in evals[r.name]] for value in targets]
        gap = finals[r.name][0] - best_static
        table["arms"][r.name] = {
            "lr": r.lr,
            "grid": dict(zip(r.lrs, (g[f"final_{_final_key(task)}"] for g in r.grid))),
            "at_edge": r.at_edge,
            "final": finals[r.name],
            "gap": gap if lower else -gap,
            "reach": reach,
            "steps": [s["steps"] for s in r.runs],
            "avg_batch": [s["avg_batch_size"] for s in r.runs],
        }
    for i, _ in enumerate(targets):
        points = []
        for r in static:
            hits = table["arms"][r.name]["reach"][i]
            if all(h is not None for h in hits):
                points.append(
                    (statistics.fmean(h[1] for h in hits), statistics.fmean(h[0] for h in hits))
                )
        for r in results:
            arm = table["arms"][r.name]
            arm.setdefault("ratio", []).append(
                [h[0] / frontier(points, h[1]) if h and points else None for h in arm["reach"][i]]
            )
        table.setdefault("frontier", []).append(points)
    table["targets"] = targets
    return table


def _reaching(rows: list[dict], value: float, key: str, lower: bool) -> list | None:
    """``[step, samples, wall seconds or None]`` at the first evaluation reaching ``value``."""
    hit = first_reaching(rows, value, key, lower)
    if hit is None:
        return None
    # None where the run logged no time (older runs): JSON has no NaN
    wall = next(x.get("wall_seconds") for x in rows if x["step"] == hit[0])
    return [*hit, wall]


def _final_key(task: Task) -> str:
    return "eval_loss" if task.lower_is_better else "accuracy"


def write_report(root: Path, task: Task, table: dict[str, Any], args: argparse.Namespace) -> None:
    lower, unit = task.lower_is_better, ("nats" if task.lower_is_better else "pt")
    scale = 1.0 if lower else 100.0
    name = task.target_metric.removeprefix("eval_")
    lines = [
        f"# Adaptive against static batches: {task.name}",
        "",
        f"Budget {args.max_samples or task.max_samples:,} samples, cosine schedule in samples; "
        f"{args.seeds} seed(s) at each arm's best rate (chosen by final {name}). Initial {name} "
        f"{table['start']:.4f}; best static final {table['best_static']:.4f}.",
        "",
        "## Rate grid (seed 0, final metric per rate; * chosen)",
        "",
        "| arm | rate: final metric (seed 0) |",
        "|---|---|",
    ]
    for arm, row in table["arms"].items():
        cells = ", ".join(
            f"{lr:.3g}: {v:.4f}{'*' if lr == row['lr'] else ''}" for lr, v in row["grid"].items()
        )
        lines.append(f"| {arm} | {cells}{' (best at the edge)' if row['at_edge'] else ''} |")
    header = " | ".join(f"{f:.0%}" for f in FRACTIONS)
    lines += [
        "",
        f"## Steps ratio to the static frontier at equal samples (mean, worst seed; {name} "
        "target in brackets)",
        "",
        f"| arm | {header} | final {name} | behind the best static ({unit}) | avg batch |",
        "|---|" + "---|" * (len(FRACTIONS) + 3),
        "| target | " + " | ".join(f"{t:.4f}" for t in table["targets"]) + " | | | |",
    ]
    for arm, row in table["arms"].items():
        cells = []
        for hits, ratios, points in zip(row["reach"], row["ratio"], table["frontier"]):
            reached = sum(h is not None for h in hits)
            if reached < len(hits):
                cells.append(f"{reached}/{len(hits)} reached")
            elif not points:  # reached by every seed, but by no static arm on every seed
                cells.append("no frontier")
            else:
                cells.append(f"{statistics.fmean(ratios):.2f} ({max(ratios):.2f})")
        mean, std = row["final"]
        lines.append(
            f"| {arm} | {' | '.join(cells)} | {mean:.4f} ± {std:.4f} "
            f"| {row['gap'] * scale:+.4f} | {statistics.fmean(row['avg_batch']):,.0f} |"
        )
    lines += [
        "",
        "## Wall-clock seconds to each target (mean, worst seed; runs that shared the machine "
        "slowed each other, and reused runs keep the times of the invocation that trained them)",
        "",
        f"| arm | {header} |",
        "|---|" + "---|" * len(FRACTIONS),
    ]
    for arm, row in table["arms"].items():
        cells = []
        for hits in row["reach"]:
            got = [h[2] for h in hits if h is not None and h[2] is not None]
            cells.append(
                f"{statistics.fmean(got):.0f} ({max(got):.0f})" if len(got) == len(hits) else "-"
            )
        lines.append(f"| {arm} | {' | '.join(cells)} |")
    lines += ["", "![steps vs samples](steps_vs_samples.png)", "", "![curves](curves.png)", ""]
    (root / "evidence.md").write_text("\n".join(lines))
    print("\n".join(lines))


def plot(root: Path, task: Task, table: dict[str, Any], results: list[ArmResult]) -> None:
    from bigbatch.experiments.plots import pyplot

    plt = pyplot()
    picks = [i for i, f in enumerate(FRACTIONS) if f in (0.9, 0.99)]
    fig, axes = plt.subplots(1, len(picks), figsize=(6 * len(picks), 4.5))
    for ax, i in zip(axes, picks):
        points = sorted(table["frontier"][i])
        if points:
            ax.plot(*zip(*points), "o-", color="black", label="static frontier")
        markers = itertools.cycle("*D^svPX")
        for arm, row in table["arms"].items():
            hits = [h for h in row["reach"][i] if h is not None]
            if arm.startswith("static") or not hits:
                continue
            ax.plot([h[1] for h in hits], [h[0] for h in hits], next(markers), ms=9, label=arm)
        ax.set(xscale="log", yscale="log", xlabel="samples to target", ylabel="steps to target")
        ax.set_title(f"{task.name}: {FRACTIONS[i]:.0%} of the way ({table['targets'][i]:.4f})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "steps_vs_samples.png", dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        rows = read_metrics(root / r.dirs[0])
        evals = [x for x in rows if task.target_metric in x]
        left.plot([x["step"] for x in evals], [x[task.target_metric] for x in evals], label=r.name)
        right.plot([x["samples"] for x in rows], [x["batch_size"] for x in rows], label=r.name)
    left.set(xscale="log", xlabel="optimizer step", ylabel=task.target_metric)
    if task.lower_is_better:
        left.set_ylim(table["best_static"] - 0.05, table["start"])
    right.set(yscale="log", xlabel="samples", ylabel="batch size")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "curves.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="text", choices=tuple(TASKS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--static", type=int, nargs="*", default=[32, 64, 128, 256, 1024])
    parser.add_argument("--arm", action="append", default=[], help="NAME:key=value,...")
    parser.add_argument("--arms", nargs="*", default=None, help="only arms starting with these")
    parser.add_argument("--lrs", type=float, nargs="*", default=None, help="the rate grid")
    parser.add_argument("--widen", type=int, default=2, help="extra x2 points per side at most")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-samples", type=int, default=0)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config key for all arms"
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument("--quick", action="store_true", help="2 static batches, 2 rates, 1 seed")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="each arm's rate by bigbatch tune over the --lrs range (no widening), not the grid",
    )
    args = parser.parse_args()

    task = TASKS[args.task]
    if args.quick:
        args.static, args.seeds = args.static[1:3], 1
        args.max_samples = args.max_samples or task.max_samples // 10
    root = Path(args.out or f"runs/evidence-{args.task}{'-quick' if args.quick else ''}")
    root.mkdir(parents=True, exist_ok=True)
    rate = task.lr("lamb", held=False)
    lrs = args.lrs or ([rate, 2 * rate] if args.quick else [rate / 2, rate, 2 * rate, 4 * rate])
    arms = make_arms(args.static, args.arm)
    if args.arms is not None:
        arms = [a for a in arms if a.name.startswith(tuple(args.arms))]
    arms = [Arm(a.name, {**a.overrides, "lr": lrs[0]}, a.stem) for a in arms]
    base = {"task": args.task, "eval_every": 10, "threads": 1}  # static arms set their own
    base.update(parse_assignment(a) for a in args.set)
    if args.max_samples:
        base["max_samples"] = args.max_samples
    results = sweep(
        base,
        arms,
        root,
        multipliers=[lr / lrs[0] for lr in lrs],
        seeds=args.seeds,
        rank="final",
        jobs=args.jobs,
        widen=0 if args.quick else args.widen,
        tune=_tune_settings() if args.tune else None,
    )
    table = analyse(task, results, root)
    (root / "evidence.json").write_text(json.dumps(table, indent=2) + "\n")
    write_report(root, task, table, args)
    plot(root, task, table, results)


def _tune_settings():
    from bigbatch.experiments.tune import TuneSettings  # the tune extra (Optuna)

    return TuneSettings()


if __name__ == "__main__":
    main()

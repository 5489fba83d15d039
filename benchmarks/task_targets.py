"""Does each built-in task keep its promise? Its default run and two static batches vs its target.

    python benchmarks/task_targets.py --out runs/task-targets --jobs 2
    python benchmarks/task_targets.py --tasks digits teacher

For each task: the default run (``bigbatch train --set task=<task>``) and
static batches of 256 and 1024 at the task's scaled rate (the constant
controller, the rate carried from batch 64 by the sqrt rule), seed 0, the
default budget, evaluation every 10 steps. A task keeps its promise when
every run reaches its target (``Task.target`` of ``Task.target_metric``).
Prints one row per run and exits 1 when a run misses its target, so the
benchmark is a check as well as a record (runs already in ``--out`` are
reused).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigbatch.experiments.sweep import run_all

TASKS = ("mnist1d", "teacher", "digits", "lm")
STATIC = (256, 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/task-targets")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    args = parser.parse_args()

    root = Path(args.out)
    common = {"eval_every": 10, "threads": 1, "device": "cpu", "seed": 0}
    jobs, names = [], []
    for task in args.tasks:
        arms = {"default": {}}
        for batch in STATIC:
            arms[f"static {batch}"] = {"batch.controller": "constant", "batch.initial": batch}
        for arm, overrides in arms.items():
            jobs.append(
                (
                    {"task": task, **common, **overrides},
                    str(root / f"{task}-{arm.replace(' ', '')}"),
                )
            )
            names.append((task, arm))
    summaries = run_all(jobs, args.jobs)

    print("| task | run | target | reached | steps to target | samples to target | best | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    missed = 0
    for (task, arm), s in zip(names, summaries):
        best = s["best_eval_loss"] if s["target_metric"].endswith("loss") else s["best_accuracy"]
        missed += not s["target_reached"]
        steps = s["steps_to_target"] if s["steps_to_target"] is not None else "—"
        samples = f"{s['samples_to_target']:,}" if s["samples_to_target"] is not None else "—"
        print(
            f"| {task} | {arm} | {s['target']:g} | {'yes' if s['target_reached'] else '**no**'} "
            f"| {steps} | {samples} | {best:.4f} | {s['wall_seconds']:.0f} |"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

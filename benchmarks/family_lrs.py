"""Each task's learning rate per optimizer family, measured by a small grid at the default batch.

    python benchmarks/family_lrs.py --out runs/family-lrs --jobs 2
    python benchmarks/family_lrs.py --tasks digits --families sgd   # one cell

A task's rate for a family (``Task.lrs``) is what ``lr = 0`` means in a
config. For each task and each family (its representative optimizer:
``lamb`` for adam, ``sgd`` with momentum 0.9 for sgd, ``lars`` for lars),
train the default run — ``critical_ramp`` from batch 256, the rate held —
at a quarter of the task's sample budget (a grid at the full budget of every
task would take hours on 2 cores) for each rate of a ×√10 grid, seed 0, and
keep the rate with the best metric (accuracy; lm: eval loss). That is the
``<family>/held`` rate. The scaled rate (``<family>``, at batch 64, carried
to larger batches by the family's rule) is the held rate × 64/256: for the
linear rule of the sgd and lars families that is the rate the rule would
give back at batch 256. A best rate at the edge of the grid is flagged:
extend the grid before trusting it. Writes ``family_lrs.json`` and prints
a table with each task's ``lrs`` entries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bigbatch.experiments.sweep import run_all

#: the representative optimizer of each family and its grid (a factor √10 apart)
GRIDS = {
    "adam": ("lamb", (1e-3, 3.16e-3, 1e-2, 3.16e-2, 1e-1)),
    "sgd": ("sgd", (3.16e-2, 1e-1, 3.16e-1, 1.0, 3.16)),
    "lars": ("lars", (1.0, 3.16, 10.0, 31.6, 100.0)),
}
TASKS = ("mnist1d", "teacher", "digits", "lm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/family-lrs")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--families", nargs="+", default=["sgd", "lars"], choices=list(GRIDS))
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument("--fraction", type=float, default=0.25, help="of each task's budget")
    args = parser.parse_args()

    from bigbatch.experiments.tasks import TASKS as REGISTRY

    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    jobs, cells = [], []
    for task in args.tasks:
        budget = int(REGISTRY[task].max_samples * args.fraction)
        for family in args.families:
            optimizer, grid = GRIDS[family]
            for lr in grid:
                config = {
                    "task": task,
                    "optimizer": optimizer,
                    "lr": lr,
                    "max_samples": budget,
                    "eval_every": 10,
                    "threads": 1,
                    "device": "cpu",
                }
                jobs.append((config, str(root / f"{task}-{family}-lr{lr:g}")))
                cells.append((task, family, lr))
    summaries = run_all(jobs, args.jobs)

    table: dict[str, dict[str, Any]] = {}
    for (task, family, lr), summary in zip(cells, summaries):
        lower = REGISTRY[task].lower_is_better
        metric = summary["best_eval_loss"] if lower else summary["best_accuracy"]
        row = table.setdefault(f"{task}/{family}", {"grid": {}, "lower_is_better": lower})
        row["grid"][f"{lr:g}"] = metric
    lines = [
        "| task | family | best held rate | metric at each rate | lrs entries |",
        "|---|---|---|---|---|",
    ]
    for key, row in table.items():
        task, family = key.split("/")
        grid = {float(k): v for k, v in row["grid"].items()}
        pick = (min if row["lower_is_better"] else max)(grid, key=lambda lr: (grid[lr], -lr))
        edge = pick in (min(grid), max(grid))
        row.update(held=pick, scaled=pick * 64 / 256, edge=edge)
        cells_text = ", ".join(f"{lr:g}: {v:.4f}" for lr, v in sorted(grid.items()))
        entries = f'"{family}": {pick * 64 / 256:.3g}, "{family}/held": {pick:.3g}'
        lines.append(
            f"| {task} | {family} | {pick:g}{' (grid edge)' if edge else ''} | {cells_text} "
            f"| {entries} |"
        )
    (root / "family_lrs.json").write_text(json.dumps(table, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Does VRGD narrow the generalization gap where large batches open one? (issue 17, claim 3)

    python benchmarks/vrgd_gap.py --out runs/vrgd-gap --jobs 2
    python benchmarks/vrgd_gap.py --quick            # a first look: no grid, one seed

VRGD (arXiv 2309.13681) scales each gradient coordinate by its normalised
gradient signal-to-noise ratio, clipped below at γ, and reports a smaller
generalization gap (train − test accuracy) at large batches. On the full
MNIST-1D training set the gap is about one point at any batch (docs/results.md,
"VRGD at a large batch"), too small to narrow; here the training set is cut to
its first ``--train-samples`` (10,000 by default, a quarter), which opens a gap.

Arms: for each base optimizer (momentum SGD, AdamW, LAMB) and each constant
batch (16× and 64× the task's small batch of 64 by default; every batch stays
below the training set's size), the base alone and VRGD on it (``vr-momentum``,
``vr-adam``, ``vr-lamb``) at γ = 0.04, 0.1 and 0.2. Every step has 8
micro-batches (the sub-batches VRGD's variance is taken over; the same for the
baselines). Every arm gets the family's rate at batch 64 carried by its rule
(linear for SGD, sqrt for the Adam type) times 0.5, 1 and 2 (``--multipliers``) on seed 0 and
keeps the rate with the best final test accuracy, rerun on seeds 1 and 2
(bigbatch.experiments.sweep). Reports final test and train accuracy and the
gap, mean ± std over seeds. Writes ``vrgd_gap.md`` and ``vrgd_gap.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bigbatch.experiments.analysis import mean_std
from bigbatch.experiments.sweep import Arm, sweep

PAIRS = {"sgd": "vr-momentum", "adamw": "vr-adam", "lamb": "vr-lamb"}
GAMMAS = (0.04, 0.1, 0.2)
MULTIPLES = (16, 64)


def arms(bases: list[str], multiples: list[int], gammas: tuple[float, ...]) -> list[Arm]:
    from bigbatch.experiments.tasks import TASKS

    task = TASKS["mnist1d"]
    out = []
    for base in bases:
        rate = task.lr(base, held=False)
        for multiple in multiples:
            batch = task.base_batch * multiple
            common = {"batch.initial": batch, "lr": rate}
            out.append(Arm(f"{base} {batch}", {**common, "optimizer": base}, f"{base}-b{batch}"))
            for gamma in gammas:
                vr = PAIRS[base]
                overrides = {**common, "optimizer": vr, "vrgd.gamma": gamma}
                out.append(Arm(f"{vr} γ={gamma:g} {batch}", overrides, f"{vr}-g{gamma:g}-b{batch}"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/vrgd-gap")
    parser.add_argument("--bases", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--multiples", nargs="+", type=int, default=list(MULTIPLES))
    parser.add_argument("--train-samples", type=int, default=10_000)
    parser.add_argument("--fraction", type=float, default=1.0, help="of the task's sample budget")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (1 thread each)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--multipliers",
        nargs="+",
        type=float,
        default=[0.5, 1.0, 2.0],
        help="the rate grid, times each arm's carried rate (the same for every arm)",
    )
    parser.add_argument("--quick", action="store_true", help="no grid, one seed, γ = 0.1 only")
    args = parser.parse_args()

    from bigbatch.experiments.tasks import TASKS

    budget = int(TASKS["mnist1d"].max_samples * args.fraction)
    base = {
        "task": "mnist1d",
        "train_samples": args.train_samples,
        "max_samples": budget,
        "batch.controller": "constant",
        "batch.base": 64,
        "batch.max": 16384,
        "min_sub_batches": 8,
        "eval_every": 10,
        "threads": 1,
        "device": "cpu",
    }
    root = Path(args.out)
    results = sweep(
        base,
        arms(args.bases, args.multiples, (0.1,) if args.quick else GAMMAS),
        root,
        multipliers=(1.0,) if args.quick else tuple(args.multipliers),
        seeds=1 if args.quick else args.seeds,
        rank="final",
        jobs=args.jobs,
    )
    table = {
        r.name: {
            "lr": r.lr,
            "grid_lrs": r.lrs,
            "test": [s["final_accuracy"] for s in r.runs],
            "train": [s.get("final_train_accuracy") for s in r.runs],
            "gap": [s.get("generalization_gap") for s in r.runs],
            "grid_test": [s["final_accuracy"] for s in r.grid],
        }
        for r in results
    }
    (root / "vrgd_gap.json").write_text(json.dumps(table, indent=2) + "\n")
    seeds = 1 if args.quick else args.seeds
    lines = [
        f"# VRGD and the generalization gap: MNIST-1D, first {args.train_samples:,} training "
        f"samples, {budget:,} samples, {seeds} seed(s)",
        "",
        "| arm | lr (grid) | final test accuracy | final train accuracy | gap (train − test) |",
        "|---|---|---|---|---|",
    ]
    for name, row in table.items():
        cells = [_cell(row[k]) for k in ("test", "train", "gap")]
        grid = ", ".join(f"{x:.3g}" for x in row["grid_lrs"])
        lines.append(f"| {name} | {row['lr']:.3g} ({grid}) | " + " | ".join(cells) + " |")
    (root / "vrgd_gap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _cell(values: list[float]) -> str:
    mean, std = mean_std(values)
    return f"{mean:.4f} ± {std:.4f}"


if __name__ == "__main__":
    main()

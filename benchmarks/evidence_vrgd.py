"""VRGD at a large batch on the default task: SGD vs VR-SGD, LAMB vs VR-LAMB, 3 seeds.

    python benchmarks/evidence_vrgd.py --out runs/evidence-vrgd     # ~10 min on 2 cores

The default task (MNIST-1D, 1-D CNN) with a constant batch of 1024, 16× the
default's small batch of 64, for its default budget of 1.2M samples (1172
steps), cosine schedule with 5% warm-up, 8 micro-batches of 128 per step (the
sub-batches VRGD's variance is taken over; the same for the baselines).
LAMB runs at the task's learning rate scaled by the sqrt rule
(4e-3 · sqrt(1024/64)). The SGD pair is ``sgd`` (momentum 0.9, the
registry's SGD) against ``vr-momentum`` (VRGD on the same momentum SGD),
each at the best rate of a small grid (``--sgd-lr``, ``--vr-lr``; the grids are
in docs/results.md). VR-LAMB uses LAMB's rate. The VR variants use VRGD's
defaults (γ = 0.1, mean normaliser; ratio momentum 0.9 for
VR-LAMB). Reports final test accuracy, final train accuracy and the
generalization gap (train − test), per seed and as mean ± standard deviation.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bigbatch.experiments.config import resolve
from bigbatch.experiments.runner import train

BASE = {
    "task": "mnist1d",
    "batch.controller": "constant",
    "batch.initial": 1024,
    "batch.min": 1024,
    "batch.max": 1024,
    "min_sub_batches": 8,
    "max_micro_batch": 1024,
    "eval_every": 50,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/evidence-vrgd")
    parser.add_argument("--sgd-lr", type=float, default=0.2)
    parser.add_argument("--vr-lr", type=float, default=0.2, help="vr-momentum's rate")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    arms = {
        "sgd": {"optimizer": "sgd", "lr": args.sgd_lr, "batch.base": 1024},
        "vr-momentum": {"optimizer": "vr-momentum", "lr": args.vr_lr, "batch.base": 1024},
        "lamb": {"optimizer": "lamb", "lr": 4e-3, "batch.base": 64},
        "vr-lamb": {"optimizer": "vr-lamb", "lr": 4e-3, "batch.base": 64},
    }
    root = Path(args.out)
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in range(args.seeds):
        for arm, overrides in arms.items():
            out = root / f"{arm}-seed{seed}"
            if (out / "summary.json").is_file():  # a finished run is kept
                summary = json.loads((out / "summary.json").read_text())
            else:
                config = resolve(BASE, overrides, {"seed": seed})
                summary = train(config, out, quiet=True)
            results[arm].append(summary)
            print(
                f"{arm:11s} seed {seed}: test {summary['final_accuracy']:.4f} "
                f"train {summary['final_train_accuracy']:.4f} "
                f"gap {summary['generalization_gap']:+.4f}",
                flush=True,
            )

    def mean_sd(values: list[float]) -> str:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.4f} ± {sd:.4f}"

    print()
    print("| optimizer | final test accuracy | final train accuracy | gap (train − test) |")
    print("|---|---|---|---|")
    for arm, runs in results.items():
        print(
            f"| {arm} | {mean_sd([r['final_accuracy'] for r in runs])} | "
            f"{mean_sd([r['final_train_accuracy'] for r in runs])} | "
            f"{mean_sd([r['generalization_gap'] for r in runs])} |"
        )


if __name__ == "__main__":
    main()

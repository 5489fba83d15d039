"""Gradient compression: bytes per step and accuracy, 2 (and 4) processes, several seeds.

    python benchmarks/compression.py --out runs/compression        # ~15 min on 2 cores
    python benchmarks/compression.py --seeds 3 --arms "all-reduce" "top-k 1% + EF21-SGDM"
    python benchmarks/compression.py --adaptive                    # the default controller
    python benchmarks/compression.py --set dist.eta=0.5 --arms "top-k 1% + EControl"

A task (default: MNIST-1D, 1-D CNN) at a constant batch of 256 (so every arm
takes the same steps; the task's optimizer at its rate scaled by the family's
rule), or with ``--adaptive`` under the default batch controller, for the
task's sample budget, trained with ``bigbatch train --nproc N`` and each
gradient reduction: plain all-reduce, Top-K 1% without error control, Top-K
1% with EF, EF21, EF21-SGDM and EControl (each at its default η), and torch's
PowerSGD (rank 1), all after 10 uncompressed warm-up steps. ``--set`` passes
config values to every arm (an η grid). Bytes are what each rank puts into
collectives per step, averaged over the run (PowerSGD's are computed from its
P and Q matrices: it does not count them). Finished runs in ``--out`` are
reused; the table gives mean ± std over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _timing import at_least

ARMS = {
    "all-reduce": [],
    "top-k 1%, no error control": ["--set", "dist.compression=topk-only"],
    "top-k 1% + EF": ["--set", "dist.compression=ef"],
    "top-k 1% + EF21": ["--set", "dist.compression=ef21"],
    "top-k 1% + EF21-SGDM": ["--set", "dist.compression=ef21-sgdm"],
    "top-k 1% + EControl": ["--set", "dist.compression=econtrol"],
    "PowerSGD rank 1": ["--set", "dist.compression=powersgd"],
}
CONSTANT = ["--set", "batch.controller=constant", "--set", "batch.initial=256"]
BASE = ["--quiet", "--set", "batch.base=64", "--set", "eval_every=100"]


def powersgd_bytes(task: str) -> float:
    """Per-step payload of PowerSGD rank 1 on the task's model (P and Q, float32)."""
    import torch

    from bigbatch.experiments.plan import plan_run
    from bigbatch.experiments.tasks import TASKS

    model = TASKS[task].build(plan_run({"task": task}).task_args).model
    total = 0
    for p in model.parameters():
        if p.ndim <= 1:
            total += p.numel()  # vectors travel uncompressed
            continue
        m, n = p.shape[0], p[0].numel()
        # compressed only where it saves at least half (PowerSGD's min_compression_rate 2)
        total += (m + n) if (m + n) * 2 <= m * n else m * n
    return float(total * torch.tensor([], dtype=torch.float32).element_size())


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} ± {std:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/compression")
    parser.add_argument("--task", default="mnist1d")
    parser.add_argument("--nproc", type=at_least(2), nargs="+", default=[2])
    parser.add_argument("--seeds", type=at_least(1), default=1)
    parser.add_argument("--adaptive", action="store_true", help="the default batch controller")
    parser.add_argument(
        "--ratio", type=float, default=0.01, help="K/d of the Top-K arms (labels say 1%%)"
    )
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every arm")
    parser.add_argument(
        "--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="a subset of the arms"
    )
    args = parser.parse_args()
    from bigbatch.experiments.tasks import TASKS

    lower = TASKS[args.task].lower_is_better
    metric = "eval_loss" if lower else "accuracy"
    root = Path(args.out)
    tag = "-".join(
        [
            args.task,
            "adaptive" if args.adaptive else "b256",
            *(kv.replace("=", "") for kv in args.set),
        ]
    )
    rows = []
    for nproc in args.nproc:
        for label in args.arms:
            extra = [*ARMS[label], "--set", f"dist.ratio={args.ratio}"]
            extra += [x for kv in args.set for x in ("--set", kv)]
            extra += [] if args.adaptive else CONSTANT
            if args.ratio != 0.01:
                label = label.replace("1%", f"{args.ratio:.0%}")
            summaries = []
            for seed in range(args.seeds):
                name = label.replace(" ", "_").replace("%", "").replace(",", "")
                out = root / f"{tag}-n{nproc}-{name}-seed{seed}"
                if not (out / "summary.json").is_file():
                    command = [sys.executable, "-m", "bigbatch.cli", "train", *BASE, *extra]
                    command += ["--set", f"task={args.task}", "--set", f"seed={seed}"]
                    command += ["--nproc", str(nproc), "--out", str(out)]
                    subprocess.run(command, check=True)
                summaries.append(json.loads((out / "summary.json").read_text()))
                print(f"{nproc} {label} seed {seed}: {summaries[-1][f'final_{metric}']:.4f}")
            first = summaries[0]
            gradient = first["gradient_bytes_per_step"]
            sent = statistics.fmean(s.get("compressed_bytes_per_step", gradient) for s in summaries)
            if "PowerSGD" in label:
                warm = 10 / first["steps"]
                sent = warm * gradient + (1 - warm) * powersgd_bytes(args.task)
            rows.append((nproc, label, sent, gradient, summaries))
    name = metric.replace("_", " ")
    print()
    print(
        f"{args.task}, {'adaptive batch' if args.adaptive else 'batch 256'}, {args.seeds} seed(s)"
    )
    print(f"| processes | reduction | bytes/step | vs all-reduce | final {name} | best | s |")
    print("|---|---|---|---|---|---|---|")
    for nproc, label, sent, gradient, runs in rows:
        print(
            f"| {nproc} | {label} | {sent:,.0f} | {sent / gradient:.3f}× "
            f"| {_mean_std([s[f'final_{metric}'] for s in runs])} "
            f"| {_mean_std([s[f'best_{metric}'] for s in runs])} "
            f"| {statistics.fmean(s['wall_seconds'] for s in runs):.0f} |"
        )


if __name__ == "__main__":
    main()

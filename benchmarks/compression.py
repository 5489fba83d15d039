"""Gradient compression on the default task: bytes per step and accuracy, 2 (and 4) processes.

    python benchmarks/compression.py --out runs/compression        # ~15 min on 2 cores

The default task (MNIST-1D, 1-D CNN) at a constant batch of 256 (so every arm
takes the same steps; LAMB at the task's rate scaled by the sqrt rule) for
the default 1.2M samples, trained with ``bigbatch train --nproc N`` and each
gradient reduction: plain all-reduce, Top-K 1% without error control, Top-K
1% with EF, EF21 and EControl (η = 0.1), and torch's PowerSGD (rank 1), all
after 10 uncompressed warm-up steps. Bytes are what each rank puts into
collectives per step, averaged over the run (PowerSGD's are computed from
its P and Q matrices: it does not count them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ARMS = {
    "all-reduce": [],
    "top-k 1%, no error control": ["--set", "dist.compression=topk-only"],
    "top-k 1% + EF": ["--set", "dist.compression=ef"],
    "top-k 1% + EF21": ["--set", "dist.compression=ef21"],
    "top-k 1% + EControl": ["--set", "dist.compression=econtrol"],
    "PowerSGD rank 1": ["--set", "dist.compression=powersgd"],
}
BASE = [
    "--quiet",
    "--set",
    "batch.controller=constant",
    "--set",
    "batch.initial=256",
    "--set",
    "batch.base=64",
    "--set",
    "eval_every=100",
]


def powersgd_bytes(world: int) -> float:
    """Per-step payload of PowerSGD rank 1 on the default model (P and Q, float32)."""
    import torch

    from bigbatch.experiments.build import with_task_defaults
    from bigbatch.experiments.config import resolve
    from bigbatch.experiments.tasks import TASKS

    model = TASKS["mnist1d"].build(with_task_defaults(resolve({}))).model
    total = 0
    for p in model.parameters():
        if p.ndim <= 1:
            total += p.numel()  # vectors travel uncompressed
            continue
        m, n = p.shape[0], p[0].numel()
        # compressed only where it saves at least half (PowerSGD's min_compression_rate 2)
        total += (m + n) if (m + n) * 2 <= m * n else m * n
    return float(total * torch.tensor([], dtype=torch.float32).element_size())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/compression")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument(
        "--ratio", type=float, default=0.01, help="K/d of the Top-K arms (labels say 1%%)"
    )
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="a subset of the arms")
    args = parser.parse_args()
    root = Path(args.out)
    rows = []
    for nproc in args.nproc:
        for label in args.arms:
            extra = [*ARMS[label], "--set", f"dist.ratio={args.ratio}"]
            if args.ratio != 0.01:
                label = label.replace("1%", f"{args.ratio:.0%}")
            out = root / f"n{nproc}-{label.replace(' ', '_').replace('%', '').replace(',', '')}"
            if not (out / "summary.json").is_file():
                command = [sys.executable, "-m", "bigbatch.cli", "train", *BASE, *extra]
                command += ["--nproc", str(nproc), "--out", str(out)]
                subprocess.run(command, check=True)
            summary = json.loads((out / "summary.json").read_text())
            gradient = summary["gradient_bytes_per_step"]
            sent = summary.get("compressed_bytes_per_step", gradient)
            if "PowerSGD" in label:
                warm = 10 / summary["steps"]
                sent = warm * gradient + (1 - warm) * powersgd_bytes(nproc)
            rows.append((nproc, label, sent, gradient, summary))
            print(f"{nproc} {label}: {summary['final_accuracy']:.4f}", flush=True)
    print()
    print("| processes | reduction | bytes/step | vs all-reduce | final test acc | best | s |")
    print("|---|---|---|---|---|---|---|")
    for nproc, label, sent, gradient, s in rows:
        print(
            f"| {nproc} | {label} | {sent:,.0f} | {sent / gradient:.3f}× | "
            f"{s['final_accuracy']:.4f} | {s['best_accuracy']:.4f} | {s['wall_seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()

"""Memory over a long run: 10,000 steps of a tiny model with statistics on.

    python benchmarks/long_run_memory.py            # about a minute on 2 cores
    python benchmarks/long_run_memory.py --steps 2000

``AdaptiveBatch`` with SimiGrad (from batch 32; on this tiny, noisy model it
climbs to its cap of 512 within the first thousand steps), statistics and
GSNR on, a VR-LAMB optimizer, on a small MLP; the resident set size (from /proc on Linux) is
read every 1000 steps. A leak in the per-step machinery (hooks, plans,
history kept by mistake, loader objects) shows as growth after the first
thousand steps.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb


def rss_mib() -> float:
    """Current resident set size (Linux), else the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--cap", type=int, default=512, help="SimiGrad's largest batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(20_000, 16)
    data = TensorDataset(x, (x @ torch.randn(16, 4)).argmax(1))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = bb.optim.create_optimizer(model, "vr-lamb", lr=1e-3)
    loop = bb.AdaptiveBatch(
        model,
        optimizer,
        data,
        controller=bb.batch.SimiGrad(target=0.5, initial=32, min=16, max=args.cap, window=5),
        min_sub_batches=8,
        max_micro_batch=64,
    )
    print(f"torch {torch.__version__}; {args.steps} steps, the batch at most {args.cap}")
    print(f"{'step':>6} {'RSS MiB':>8} {'batch':>6} {'s':>6}")
    start, readings = time.perf_counter(), []
    for step in loop.steps(max_steps=args.steps):
        for xb, yb in step.micro_batches():
            step.backward(nn.functional.cross_entropy(model(xb), yb))
        step.apply()
        if loop.steps_taken % 1000 == 0:
            gc.collect()
            readings.append(rss_mib())
            elapsed = time.perf_counter() - start
            steps = loop.steps_taken
            print(f"{steps:>6} {readings[-1]:>8.1f} {step.batch_size:>6} {elapsed:>6.0f}")
    if len(readings) > 1:
        growth = readings[-1] - readings[0]
        print(f"growth from step 1000 to {loop.steps_taken}: {growth:+.1f} MiB")


if __name__ == "__main__":
    main()

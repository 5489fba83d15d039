"""What adaptive batching costs under DDP: bytes and step time per statistics mode.

    python benchmarks/dist_overhead.py             # 2 and 4 gloo processes (~2 min on 2 cores)
    python benchmarks/dist_overhead.py --quick

Each world (2 and 4 CPU processes, one thread each, gloo) trains one MLP
(784-1024-1024-10, 1.9M parameters, 7.5 MB of float32 gradient) through
``bigbatch.AdaptiveBatch`` with a ``Constant`` batch per rank in 2
micro-batches: 64 samples (little compute per byte of gradient, the worst
case for statistics that read the gradient) and 512. Three arms:

- ``none``: ``statistics=False``, DDP's own all-reduce only;
- ``scalar``: statistics from the micro-batch norms, one extra all-reduce of
  ``2 G + 1`` float64 scalars per step (the default under DDP);
- ``split``: the exact two-group cosine through the ``TwoGroupCosine`` comm
  hook, which all-reduces a second gradient-sized row.

Arms alternate step by step (order rotated each round) so the shared
machine's drift hits all alike; the table gives the median step time and the
bytes each rank puts into all-reduces per step (payload; a ring all-reduce
moves about ``2 (W-1)/W`` times that over the wire per rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import bigbatch as bb
from _gloo import run_gloo

ARMS = ("none", "scalar", "split")


def make_loop(arm: str, data: TensorDataset, per_rank: int) -> bb.AdaptiveBatch:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(bb.optim.param_groups(model, weight_decay=0.0), lr=0.01)
    world = dist.get_world_size()
    return bb.AdaptiveBatch(
        ddp,
        optimizer,
        data,
        controller=bb.batch.Constant(per_rank * world),
        max_micro_batch=per_rank // 2,
        min_sub_batches=2,
        lr_scaling="none",
        statistics=arm != "none",
        similarity=None if arm == "none" else arm,
    )


def one_step(loop: bb.AdaptiveBatch) -> float:
    start = time.perf_counter()
    step = next(loop.steps(max_steps=loop.steps_taken + 1))
    for x, y in step.micro_batches():
        step.backward(nn.functional.cross_entropy(loop.model(x), y))
    step.apply()
    return time.perf_counter() - start


def worker(steps: int, per_rank: int) -> dict | None:
    """One world's measurements (rank 0 returns them)."""
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8192, 784, generator=gen), torch.randint(0, 10, (8192,)))
    loops = {arm: make_loop(arm, data, per_rank) for arm in ARMS}
    for loop in loops.values():
        for _ in range(3):  # warm-up (DDP rebuilds its buckets after the first step)
            one_step(loop)
    counted = {arm: loop.steps_taken for arm, loop in loops.items()}
    bytes_before = {
        arm: loop.collector.traffic() if loop.collector else 0 for arm, loop in loops.items()
    }
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(steps):
        order = ARMS[round_ % 3 :] + ARMS[: round_ % 3]
        for arm in order:
            dist.barrier()
            times[arm].append(one_step(loops[arm]))
    if dist.get_rank() != 0:
        return None
    params = sum(p.numel() * p.element_size() for p in loops["none"].model.parameters())
    rows = {}
    for arm, loop in loops.items():
        sent = loop.collector.traffic() if loop.collector else 0
        rows[arm] = {
            "ms": 1000 * statistics.median(times[arm]),
            "gradient_bytes": params,
            "extra_bytes": (sent - bytes_before[arm]) / (loop.steps_taken - counted[arm]),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    steps = 10 if args.quick else 40
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 1 thread per rank")
    print(
        f"{'ranks':>5} {'batch/rank':>10} {'arm':>7} {'step ms':>8} {'vs none':>8} "
        f"{'gradient B/step':>16} {'extra B/step':>13} {'extra/gradient':>15}"
    )
    for world, per_rank in [(w, b) for w in (2, 4) for b in (64, 512)]:
        rows = run_gloo(worker, world, steps, per_rank)
        base = rows["none"]["ms"]
        for arm in ARMS:
            r = rows[arm]
            print(
                f"{world:>5} {per_rank:>10} {arm:>7} {r['ms']:>8.1f} {r['ms'] / base:>7.3f}x "
                f"{r['gradient_bytes']:>16,.0f} {r['extra_bytes']:>13,.0f} "
                f"{r['extra_bytes'] / r['gradient_bytes']:>14.6f}x"
            )


if __name__ == "__main__":
    main()

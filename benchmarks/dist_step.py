"""What adaptive batching costs across processes: step time, bytes and collectives.

    python benchmarks/dist_step.py                 # DDP, statistics modes (~2 min on 2 cores)
    python benchmarks/dist_step.py --part fsdp     # FSDP2 against DDP (~2 min)
    python benchmarks/dist_step.py --quick         # fewer steps

CPU processes (gloo, one thread each) train through ``bigbatch.AdaptiveBatch`` with a
``Constant`` batch per rank in 2 micro-batches; arms alternate step by step (order
rotated each round, ranks meeting at a barrier before each step), so the shared
machine's drift hits all alike; the tables give median step times.

**ddp** (2 and 4 ranks, 64 and 512 samples per rank): an MLP (784-1024-1024-10, 1.9M
parameters, 7.5 MB of float32 gradient), SGD. Arms: ``none`` (``statistics=False``,
DDP's own all-reduce only); ``scalar`` (statistics from the micro-batch norms, one
extra all-reduce of ``2 G + 1`` float64 per step: the default under DDP); ``split``
(the exact two-group cosine through the ``TwoGroupCosine`` comm hook, which
all-reduces a second gradient-sized row); ``examples`` (the per-example statistics,
the default where the model allows: each example's gradient norm from hooks in the
backward, the same one small all-reduce). Bytes are each rank's payload into
all-reduces per step (a ring all-reduce moves about ``2 (W-1)/W`` times that).

**fsdp** (2 ranks, 16 sequences per rank): the ``lm`` task's transformer shape (4
blocks, width 256, vocabulary 512, 64 tokens), LAMB (``impl="foreach"``), DDP or FSDP2
(each block, then the root, ``fully_shard``-ed), statistics off or on; also counted,
the all-reduces one ``optimizer.step()`` calls (FSDP's all-gathers and
reduce-scatters happen in forward and backward, not in the optimizer).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import bigbatch as bb
from _gloo import run_gloo
from _timing import interleaved, medians
from bigbatch.experiments.tasks import TinyTransformer

OFF = {"statistics": False}
#: a Constant batch reads no statistics: an arm that measures them asks (else none are taken)
SUB_BATCHES = {"statistics": True, "noise_from": "sub_batches", "similarity": "scalar"}
#: each part's arms: name -> (wrapper, the loop's statistics options)
PARTS = {
    "ddp": {
        "none": ("ddp", OFF),
        "scalar": ("ddp", SUB_BATCHES),
        "split": ("ddp", {"statistics": True, "noise_from": "sub_batches", "similarity": "split"}),
        "examples": ("ddp", {"statistics": True, "noise_from": "examples"}),
    },
    "fsdp": {
        "ddp": ("ddp", OFF),
        "ddp+stats": ("ddp", SUB_BATCHES),
        "fsdp": ("fsdp", OFF),
        "fsdp+stats": ("fsdp", SUB_BATCHES),
    },
}
VOCAB, CONTEXT = 512, 64


def make_data(part: str) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    if part == "ddp":
        return TensorDataset(torch.randn(8192, 784, generator=gen), torch.randint(0, 10, (8192,)))
    tokens = torch.randint(0, VOCAB, (4096, CONTEXT + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_loop(part: str, arm: str, data: TensorDataset, per_rank: int) -> bb.AdaptiveBatch:
    from torch.distributed.fsdp import fully_shard

    wrapper, options = PARTS[part][arm]
    torch.manual_seed(0)
    if part == "ddp":
        inner: nn.Module = nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
    else:
        inner = TinyTransformer(VOCAB, CONTEXT, 256, 4, heads=8)
    model = inner
    if wrapper == "fsdp":  # before the optimizer: fully_shard swaps the parameters for shards
        for block in inner.blocks:
            fully_shard(block)
        fully_shard(inner)
    else:
        model = DistributedDataParallel(inner)
    if part == "ddp":
        optimizer = torch.optim.SGD(bb.optim.param_groups(inner, weight_decay=0.0), lr=0.01)
    else:
        optimizer = bb.optim.LAMB(bb.optim.param_groups(inner, weight_decay=0.01), lr=1e-3)
    return bb.AdaptiveBatch(
        model,
        optimizer,
        data,
        controller=bb.batch.Constant(per_rank * dist.get_world_size()),
        max_micro_batch=per_rank // 2,
        min_sub_batches=2,
        lr_scaling="none",
        **options,
    )


def one_step(loop: bb.AdaptiveBatch) -> None:
    step = next(loop.steps(max_steps=loop.steps_taken + 1))
    for x, y in step.micro_batches():
        logits = loop.model(x)
        step.backward(nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten()))
    step.apply()


def optimizer_collectives(loop: bb.AdaptiveBatch) -> int:
    """The all-reduces ``optimizer.step()`` calls in one training step."""
    calls = 0
    real_all_reduce, real_step = dist.all_reduce, loop.optimizer.step

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real_all_reduce(*args, **kwargs)

    def counted_step(*args, **kwargs):
        dist.all_reduce = counting
        try:
            return real_step(*args, **kwargs)
        finally:
            dist.all_reduce = real_all_reduce

    loop.optimizer.step = counted_step
    try:
        one_step(loop)
    finally:
        del loop.optimizer.step  # the class's method again
    return calls


def worker(part: str, steps: int, per_rank: int) -> dict | None:
    """One world's measurements (rank 0 returns them)."""
    data = make_data(part)
    loops = {arm: make_loop(part, arm, data, per_rank) for arm in PARTS[part]}
    # warm-up: DDP rebuilds its buckets after the first step
    times = interleaved(
        {arm: lambda loop=loop: one_step(loop) for arm, loop in loops.items()},
        steps,
        warmup=3,
        before=dist.barrier,
    )
    sent = {arm: loop.collector.traffic() if loop.collector else 0 for arm, loop in loops.items()}
    counted = {arm: loop.steps_taken for arm, loop in loops.items()}
    collectives = {arm: optimizer_collectives(loop) for arm, loop in loops.items()}
    if dist.get_rank() != 0:
        return None
    first = next(iter(loops.values())).model
    return {
        "ms": {arm: 1000 * t for arm, t in medians(times).items()},
        "stats_bytes": {arm: sent[arm] / counted[arm] for arm in loops},
        "collectives": collectives,
        "gradient_bytes": sum(p.numel() * p.element_size() for p in first.parameters()),
        "tensors": sum(1 for _ in first.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=tuple(PARTS), default="ddp")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    steps = (10 if args.quick else 40) if args.part == "ddp" else (6 if args.quick else 20)
    worlds = [(w, b) for w in (2, 4) for b in (64, 512)] if args.part == "ddp" else [(2, 16)]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 1 thread per rank")
    print(
        "| ranks | per rank | arm | step ms | × first | statistics bytes/step "
        "| gradient bytes | all-reduces in optimizer.step() |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world, per_rank in worlds:
        rows = run_gloo(worker, world, args.part, steps, per_rank)
        base = next(iter(rows["ms"].values()))
        for arm, ms in rows["ms"].items():
            print(
                f"| {world} | {per_rank} | {arm} | {ms:.1f} | {ms / base:.2f} "
                f"| {rows['stats_bytes'][arm]:,.0f} | {rows['gradient_bytes']:,} "
                f"| {rows['collectives'][arm]} (for {rows['tensors']} tensors) |",
                flush=True,
            )


if __name__ == "__main__":
    main()

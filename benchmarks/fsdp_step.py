"""FSDP2 against DDP under adaptive batching: step time, statistics on/off, collectives.

    python benchmarks/fsdp_step.py             # 2 gloo processes (~2 min on 2 cores)
    python benchmarks/fsdp_step.py --quick

Two CPU processes (gloo, one thread each) train one pre-norm transformer
(4 blocks, d 256, 8 heads, vocabulary 512, sequences of 64 tokens; 3.4M
parameters) through ``bigbatch.AdaptiveBatch`` with LAMB (``impl="foreach"``)
and a ``Constant`` batch of 16 sequences per rank in 2 micro-batches. Four
arms: DDP or FSDP2 (each block, then the root, ``fully_shard``-ed), with the
statistics off or on. Arms alternate step by step (order rotated each round)
so the shared machine's drift hits all alike.

Also counted, in one optimizer step of each arm: the collectives its
``step()`` calls (``all_reduce``; FSDP's own all-gathers and reduce-scatters
happen in forward and backward, not in the optimizer).
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

ARMS = ("ddp", "ddp+stats", "fsdp", "fsdp+stats")
VOCAB, CONTEXT, D, BLOCKS = 512, 64, 256, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 8, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_loop(arm: str, data: TensorDataset, per_rank: int) -> bb.AdaptiveBatch:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model: nn.Module = Transformer()
    if arm.startswith("fsdp"):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    optimizer = bb.optim.LAMB(bb.optim.param_groups(inner, weight_decay=0.01), lr=1e-3)
    return bb.AdaptiveBatch(
        model,
        optimizer,
        data,
        controller=bb.batch.Constant(per_rank * dist.get_world_size()),
        max_micro_batch=per_rank // 2,
        min_sub_batches=2,
        lr_scaling="none",
        statistics=arm.endswith("stats"),
    )


def one_step(loop: bb.AdaptiveBatch) -> float:
    start = time.perf_counter()
    step = next(loop.steps(max_steps=loop.steps_taken + 1))
    for x, y in step.micro_batches():
        logits = loop.model(x)
        step.backward(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    step.apply()
    return time.perf_counter() - start


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


def worker(steps: int, per_rank: int) -> dict | None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4096, CONTEXT + 1), generator=gen)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loops = {arm: make_loop(arm, data, per_rank) for arm in ARMS}
    for loop in loops.values():
        for _ in range(3):  # warm-up (DDP rebuilds its buckets after the first step)
            one_step(loop)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_ in range(steps):
        order = ARMS[round_ % len(ARMS) :] + ARMS[: round_ % len(ARMS)]
        for arm in order:
            dist.barrier()
            times[arm].append(one_step(loops[arm]))
    collectives = {arm: optimizer_collectives(loop) for arm, loop in loops.items()}
    if dist.get_rank() != 0:
        return None
    tensors = sum(1 for _ in loops["ddp"].model.parameters())
    return {
        arm: {
            "ms": 1000 * statistics.median(times[arm]),
            "collectives": collectives[arm],
            "tensors": tensors,
            "stats_bytes": loops[arm].collector.traffic() / loops[arm].steps_taken
            if loops[arm].collector is not None
            else 0.0,
        }
        for arm in ARMS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    args = parser.parse_args()
    steps = 6 if args.quick else 20
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo, 2 ranks, 1 thread per rank")
    rows = run_gloo(worker, 2, steps, 16)
    base = rows["ddp"]["ms"]
    print("| arm | step ms | × DDP | statistics bytes/step | all-reduces in optimizer.step() |")
    print("|---|---|---|---|---|")
    for arm in ARMS:
        r = rows[arm]
        print(
            f"| {arm} | {r['ms']:.1f} | {r['ms'] / base:.2f} | {r['stats_bytes']:.0f} "
            f"| {r['collectives']} (for {r['tensors']} tensors) |"
        )


if __name__ == "__main__":
    main()

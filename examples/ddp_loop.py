"""The plain-loop example under torchrun: the same code with a DDP model.

    torchrun --standalone --nproc-per-node 2 examples/ddp_loop.py

Each rank trains its shard of every global batch; the batch size, similarity
and loss printed by rank 0 are global (every rank decides the same). The lines
marked ``# DDP`` are what DDP adds to ``examples/plain_loop.py``; besides them
the batch follows SimiGrad's similarity (the statistic DDP splits across the
ranks) from 32, where the plain loop keeps the default rule from 16 and clips
the gradient. Runs in about a minute on 2 CPU cores.
"""

import os

import torch
import torch.distributed as dist
from plain_loop import progress, teacher_student
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import bigbatch as bb


def main() -> None:
    dist.init_process_group("gloo")  # DDP ("nccl" with CUDA)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # DDP
    torch.manual_seed(0)
    data = teacher_student(n=55_000)
    train, test = torch.utils.data.random_split(data, [50_000, 5_000])
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = bb.optim.LAMB(bb.optim.param_groups(model, weight_decay=0.01), lr=2e-3)
    ddp = DistributedDataParallel(model)  # DDP
    loop = bb.AdaptiveBatch(
        ddp,  # DDP
        optimizer,
        train,
        max_micro_batch=512,
        controller=bb.batch.SimiGrad(target=1 / 3, initial=32, min=16, max=8192),
        schedule=bb.schedules.warmup_cosine(total=1_500_000, warmup=50_000),
    )
    rank0 = dist.get_rank() == 0  # DDP
    for step in loop.steps(max_samples=1_500_000):
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(ddp(x), y))
        step.apply()
        if rank0 and step.index % 40 == 0:
            print(progress(step.metrics))
    if rank0:
        with torch.no_grad():
            x, y = data.tensors[0][test.indices], data.tensors[1][test.indices]
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(
            f"{loop.steps_taken} steps, average batch {loop.samples / loop.steps_taken:.0f}, "
            f"test accuracy {accuracy:.3f}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

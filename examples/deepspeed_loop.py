"""Adaptive batching inside a DeepSpeed engine (ZeRO-2 here; stages 0-2 work).

    torchrun --standalone --nproc-per-node 2 examples/deepspeed_loop.py
    deepspeed --num_gpus 2 examples/deepspeed_loop.py        # on a GPU machine

The lines marked ``# bigbatch`` are what a DeepSpeed script adds: the config
lets bigbatch end each step (``managed_gradient_accumulation: false``), and
the loop draws each step's global batch, weights each micro-batch's loss and
calls ``engine.backward``/``engine.step``. The batch, the similarity and the
loss printed by rank 0 are global. On CPU, DeepSpeed compiles a small
shared-memory communication op with g++ the first time (about a minute);
the training itself takes about a minute on 2 cores.
"""

import os

import deepspeed
import torch
from plain_loop import progress, teacher_student
from torch import nn

import bigbatch as bb
from bigbatch.integrations.deepspeed import AdaptiveBatchDeepSpeed

SAMPLES = 1_000_000


def main() -> None:
    deepspeed.init_distributed()
    world = torch.distributed.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    data = teacher_student(n=55_000)
    train, test = torch.utils.data.random_split(data, [50_000, 5_000])
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01),
        config={
            "train_micro_batch_size_per_gpu": 256,  # the largest micro-batch that fits
            "managed_gradient_accumulation": False,  # bigbatch: it ends each step
            "zero_optimization": {"stage": 2},
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
        },
    )
    loop = AdaptiveBatchDeepSpeed(  # bigbatch
        engine,
        train,
        controller=bb.batch.BatchWarmup(initial=64, max=8192),
        schedule=bb.schedules.warmup_cosine(total=SAMPLES, warmup=50_000),
    )
    rank0 = engine.global_rank == 0
    for step in loop.steps(max_samples=SAMPLES):  # bigbatch
        for x, y in step.micro_batches():
            step.backward(nn.functional.cross_entropy(engine(x), y))  # engine.backward
        step.apply()  # the rate for the batch, engine.step(), the next batch size
        if rank0 and step.index % 40 == 0:
            print(progress(step.metrics))
    loop.save_checkpoint("runs/deepspeed_loop")  # DeepSpeed's checkpoint, with bigbatch's state
    if rank0:
        with torch.no_grad():
            x, y = data.tensors[0][test.indices], data.tensors[1][test.indices]
            accuracy = (engine.module(x).argmax(1) == y).float().mean().item()
        print(
            f"{loop.steps_taken} steps, average batch {loop.samples / loop.steps_taken:.0f}, "
            f"test accuracy {accuracy:.3f}"
        )


if __name__ == "__main__":
    main()

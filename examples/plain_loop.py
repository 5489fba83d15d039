"""Adaptive batching in a plain PyTorch loop, on a synthetic teacher-student task.

    python examples/plain_loop.py

Compared with an ordinary gradient-accumulation loop, the lines marked
``# bigbatch`` are the changes. Prints the batch size as the controller
grows it (every 40 steps); runs in well under 2 minutes on 2 CPU cores. The
controller is the default rule (``bb.batch.BatchWarmup``) from batch 16 (the
default starts at 8): the batch doubles whenever an eighth of the smoothed noise scale is
confidently (one standard error) above the next size, and the learning rate
follows LAMB's rule, ×√2 per doubling (``lr_scaling="auto"``).
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb


def teacher_student(n: int = 50_000, d: int = 32, classes: int = 10, seed: int = 0):
    """Inputs from N(0, I), labels from a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    return TensorDataset(x, (x @ torch.randn(d, classes, generator=gen)).argmax(1))


def progress(m: dict) -> str:
    """One line of a step's metrics (the examples print one every 40 steps)."""
    return (
        f"step {m['step']:5d}  samples {m['samples']:8d}  batch {m['batch_size']:5d} -> "
        f"{m['next_batch_size']:5d}  similarity {m['similarity']:+.3f}  "
        f"B_simple {m['noise_scale']:8.1f}  loss {m['loss']:.3f}  lr {m['lr']:.2e}"
    )


def main() -> None:
    torch.manual_seed(0)
    data = teacher_student(n=55_000)
    train, test = torch.utils.data.random_split(data, [50_000, 5_000])
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = bb.optim.LAMB(bb.optim.param_groups(model, weight_decay=0.01), lr=2e-3)
    loop = bb.AdaptiveBatch(  # bigbatch
        model,
        optimizer,
        train,
        max_micro_batch=512,
        controller=bb.batch.BatchWarmup(initial=16, max=8192),  # the default rule, from 16
        schedule=bb.schedules.warmup_cosine(total=1_500_000, warmup=50_000),
    )
    for step in loop.steps(max_samples=1_500_000):  # bigbatch
        for x, y in step.micro_batches():  # bigbatch
            step.backward(nn.functional.cross_entropy(model(x), y))  # bigbatch
        # bigbatch: clip here, in apply (after the statistics read the batch's gradient,
        # before the update), not before it; LAMB also clips at 1 itself (max_grad_norm)
        step.apply(max_grad_norm=1.0)
        if step.index % 40 == 0:
            print(progress(step.metrics))
    with torch.no_grad():
        x, y = data.tensors[0][test.indices], data.tensors[1][test.indices]
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(
        f"{loop.steps_taken} steps, {loop.samples} samples, average batch "
        f"{loop.samples / loop.steps_taken:.0f}, test accuracy {accuracy:.3f}"
    )


if __name__ == "__main__":
    main()

"""The two ways to get SimiGrad's similarity under DDP, side by side at a fixed point.

    python benchmarks/similarity_modes.py          # 2 and 4 gloo processes (~1 min on 2 cores)

A small regression MLP (12-8-1, float64) is held at its initial point
(learning rate 0) while a ``Constant`` batch of ``B`` samples is drawn step
after step, so the gradient statistics are stationary. Each step measures
the exact two-group cosine (``similarity="split"``, ranks ``[0, W/2)``
against the rest) and, from the same step's ``|G|²`` and ``tr Σ`` estimates,
the scalar estimate (``similarity="scalar"``). The table compares their means
and step-to-step spread with the similarity that the mean noise estimates
imply (docs/algorithms.md, "Gradient statistics").
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import bigbatch as bb
from _gloo import run_gloo
from bigbatch.stats import expected_similarity, scalar_similarity

STEPS = 1500


def worker(batch: int) -> dict | None:
    """One world's series (rank 0 returns the summary)."""
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(12, generator=gen)
    x = torch.randn(2048, 12, generator=gen)
    y = x @ w_star + torch.randn(2048, generator=gen)
    data = TensorDataset(x.double(), y[:, None].double())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    loop = bb.AdaptiveBatch(
        DistributedDataParallel(model),
        torch.optim.SGD(model.parameters(), lr=0.0),
        data,
        controller=bb.batch.Constant(batch),
        max_micro_batch=8,
        min_sub_batches=2,
        lr_scaling="none",
        statistics=True,  # a Constant batch reads none
        similarity="split",
    )
    split, scalar, signal, trace = [], [], [], []
    for step in loop.steps(max_steps=STEPS):
        for xb, yb in step.micro_batches():
            step.backward(nn.functional.mse_loss(loop.model(xb), yb))
        step.apply()
        first = sum(sum(r) for r in step.rank_sizes[: world // 2])
        s = step.stats
        split.append(float(s.similarity))
        estimate = scalar_similarity(s.grad_sq_norm, s.trace, first, batch - first, len(data))
        scalar.append(float(estimate))
        signal.append(float(s.grad_sq_norm))
        trace.append(float(s.trace))
    if dist.get_rank() != 0:
        return None
    b_simple = statistics.mean(trace) / statistics.mean(signal)
    return {
        "split": (statistics.mean(split), statistics.stdev(split)),
        "scalar": (statistics.mean(scalar), statistics.stdev(scalar)),
        "implied": expected_similarity(b_simple, first, batch - first),
        "b_simple": b_simple,
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # (--help)
    print(f"{STEPS} steps at a fixed point; mean ± step-to-step standard deviation")
    print(
        f"{'ranks':>5} {'B':>5} {'B_simple':>8} {'implied':>8} {'split (exact)':>16} {'scalar':>16}"
    )
    for world, per_rank in [(w, b) for w in (2, 4) for b in (16, 64)]:
        batch = world * per_rank
        r = run_gloo(worker, world, batch)
        print(
            f"{world:>5} {batch:>5} {r['b_simple']:>8.1f} {r['implied']:>8.3f} "
            f"{r['split'][0]:>8.3f} ± {r['split'][1]:.3f} {r['scalar'][0]:>8.3f} ± "
            f"{r['scalar'][1]:.3f}"
        )


if __name__ == "__main__":
    main()

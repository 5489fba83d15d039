"""Error-control methods on simulated ranks in one process: a fast look at compression.

    python benchmarks/compression_sim.py                              # LAMB, Top-K 1%, 2 ranks
    python benchmarks/compression_sim.py --optimizer sgd --momentum 0 --lr 0.25 \\
        --methods ef21-sgdm          # the EF21-SGDM paper's setting: plain SGD, momentum inside
    python benchmarks/compression_sim.py --methods econtrol --eta 0.000025   # theory's η = δ/400
    python benchmarks/compression_sim.py --compressor randk --lr 0.001     # Rand-K, a lower rate

Each step draws a batch (256 by default) with replacement, splits it into
``--ranks`` shards, takes each shard's gradient divided by the number of ranks
(its share of the mean), and reduces the shares the way
``bigbatch.parallel.compression_hook`` does on real ranks: plainly for the first
10 steps, then through :func:`bigbatch.parallel.error_control.local_step` with
Top-K of the whole flattened gradient (one DDP bucket holds these models
whole). The optimizer steps with the result under the task's cosine
schedule. No process group, so an arm takes about a minute on one core
instead of several on two gloo processes; it reproduced the two-process
results of docs/results.md within 0.001 (all-reduce, EF) and their failures
(EF21-SGDM, EControl) on MNIST-1D. ``--lr 0`` takes the task's rate for the
optimizer's family at batch 64 carried to the batch by the task's rule for it
(``bigbatch tasks``), else the family's.
Prints final and best test accuracy (``lm``: eval loss) per method.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _timing import at_least
from bigbatch.batch.lr import lr_factor, schedule_by_name
from bigbatch.experiments.plan import plan_run
from bigbatch.experiments.tasks import TASKS
from bigbatch.optim import create_optimizer
from bigbatch.parallel.compression import rand_k, top_k
from bigbatch.parallel.error_control import SHARED_ESTIMATE, local_step, start

WARMUP = 10
METHODS = ("all-reduce", "ef", "ef21", "ef21-sgdm", "econtrol", "none")


def train(args: argparse.Namespace, method: str, seed: int) -> list[float]:
    """The run's evaluation scores, every 100 steps and at the end."""
    base = {"task": args.task, "optimizer": args.optimizer, "seed": seed, "lr": args.lr}
    base.update({"batch.controller": "constant", "batch.initial": args.batch, "batch.base": 64})
    config = plan_run(base)
    rate = config["lr"] * lr_factor(config["batch.lr_scaling"], args.batch, 64)
    problem = TASKS[args.task].build(config.task_args)
    model, data = problem.model, problem.train.tensors
    options = {"lr": rate, "weight_decay": config["weight_decay"]}
    if args.momentum is not None:
        options["momentum"] = args.momentum
    optimizer = create_optimizer(model, args.optimizer, **options)
    params = list(model.parameters())
    total = int(TASKS[args.task].max_samples * args.fraction)
    schedule = schedule_by_name("cosine", total, int(0.05 * total))
    generator = torch.Generator().manual_seed(seed)
    states: list = []
    scores = []
    metric = "eval_loss" if TASKS[args.task].lower_is_better else "eval_accuracy"

    def select(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if args.compressor == "topk":
            return top_k(message, args.ratio)  # the hook's own Top-K
        # Rand-K: every rank draws the same coordinates in a step (``step``, the
        # loop's), as in the hook
        return rand_k(message, args.ratio, torch.Generator().manual_seed(seed * 1_000_003 + step))

    steps = total // args.batch
    for step in range(steps):
        rows = torch.randint(0, len(data[0]), (args.batch,), generator=generator)
        shares = []
        for shard in rows.chunk(args.ranks):
            model.zero_grad()
            problem.loss(model, tuple(t[shard] for t in data)).backward()
            shares.append(torch.cat([p.grad.flatten() for p in params]) / args.ranks)
        if method == "all-reduce" or step < WARMUP:
            reduced = torch.stack(shares).sum(0)
            if method != "all-reduce" and step == WARMUP - 1:
                states = [start(method, x) for x in shares]
        else:
            reduced = torch.zeros_like(shares[0])
            for i, x in enumerate(shares):
                values, indices, states[i] = local_step(method, x, states[i], args.eta, select)
                reduced.index_add_(0, indices, values)
            if method in SHARED_ESTIMATE:  # the step is the sum of the ranks' estimates
                reduced = torch.stack([s["estimate"] for s in states]).sum(0)
        torch.nn.utils.vector_to_parameters(reduced, [p.grad for p in params])
        for group in optimizer.param_groups:
            group["lr"] = rate * schedule(step * args.batch)
        optimizer.step()
        if (step + 1) % 100 == 0 or step + 1 == steps:
            scores.append(problem.evaluate(model)[metric])
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="mnist1d", choices=tuple(TASKS))
    parser.add_argument(
        "--methods", nargs="+", default=["all-reduce", "ef", "ef21-sgdm", "econtrol"]
    )
    parser.add_argument("--optimizer", default="lamb")
    parser.add_argument("--lr", type=float, default=0.0, help="at batch 64; 0: the task's rate")
    parser.add_argument("--momentum", type=float, default=None, help="SGD's momentum")
    parser.add_argument("--eta", type=at_least(0.0, float), default=0.1)
    parser.add_argument("--ratio", type=float, default=0.01, help="in (0, 1]")
    parser.add_argument("--compressor", default="topk", choices=("topk", "randk"))
    parser.add_argument("--ranks", type=at_least(1), default=2)
    parser.add_argument("--batch", type=at_least(1), default=256)
    parser.add_argument("--fraction", type=float, default=1.0, help="of the task's budget")
    parser.add_argument("--seeds", type=at_least(1), default=1)
    args = parser.parse_args()
    if not 0 < args.ratio <= 1:  # (the compressor would clamp it to one coordinate or all)
        parser.error(f"argument --ratio: must be in (0, 1], got {args.ratio:g}")
    if not args.fraction > 0:
        parser.error(f"argument --fraction: must be > 0, got {args.fraction:g}")
    bad = sorted(set(args.methods) - set(METHODS))
    if bad:
        parser.error(f"--methods: unknown {', '.join(bad)}")
    torch.set_num_threads(1)
    lower = TASKS[args.task].lower_is_better
    setting = f"{args.optimizer}, {args.compressor} {args.ratio:g}, η {args.eta:g}"
    print(f"| method | final | best |  ({setting})")
    print("|---|---|---|")
    for method in args.methods:
        runs = [train(args, method, seed) for seed in range(args.seeds)]
        final = [r[-1] for r in runs]
        best = [min(r) if lower else max(r) for r in runs]
        print(f"| {method} | {_cell(final)} | {_cell(best)} |", flush=True)


def _cell(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.4f} ± {std:.4f}"


if __name__ == "__main__":
    main()

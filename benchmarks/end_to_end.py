"""Wall-clock to a loss: ``bigbatch train`` against a plain PyTorch loop at static batches.

    python benchmarks/end_to_end.py                          # text, CPU, one thread
    python benchmarks/end_to_end.py --seeds 0,1,2 --batches 8,16,32,64
    python benchmarks/end_to_end.py --device cuda --set model.width=256 \\
        --set model.depth=4 --set model.context=256 --set precision=bf16   # GPU scale
    python benchmarks/end_to_end.py --device cuda --bf16 --set precision=bf16 ... \\
        --set optimizer=adamw --set optimizer_impl=fused --set asynchronous=true  # read late
    python benchmarks/end_to_end.py --device cuda ... --set compile=default  # both compiled

The plain arm is the loop a user writes by hand, nanoGPT style, with no bigbatch in it
but the optimizer: the task's data and model built as ``bigbatch train`` builds them
(same seed, same initial weights), a fresh permutation of the training windows each
epoch, a static batch, the same optimizer built the same way (the task's, LAMB by default,
or ``--set optimizer=...``: its parameter groups, weight decay and impl) at the rate
``bigbatch train`` gives a constant batch of that size, the same warm-up and
cosine schedule in samples, and an evaluation on the same held-out windows at the same
sample points, its model compiled as ``bigbatch train``'s is where ``--set compile=MODE``
says. The bigbatch arm is ``bigbatch train`` with the task's defaults (the default
controller), evaluated at those sample points. Every run is its own process, run
one after another (one thread by default), and, as ``bigbatch train`` does on a CPU,
keeps glibc's freed memory in both arms.

The table: each arm's final validation loss (mean over seeds) and wall-clock (training and
evaluation, from the first step) to ``T``, the best static batch's final loss plus
``--margin`` (0.01): the first evaluation at or below it, per seed, then the mean over
the seeds that reach it (how many do: "T reached"). The ratios are each arm's time to T
and total time over the plain loop's at the best static batch. ``--save FILE`` keeps every
run's evaluations (JSON) for another look.

Caveats: each static batch runs at the rate its size gets from the task's rule, not at
the best rate of a grid (``--lr-scales`` runs a grid of multiples); times are this
machine's, one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _timing import at_least, listed

#: what each run prints on its last line: a JSON list of [samples, seconds, eval loss, step]
RESULT = "RESULT "


def config_for(task: str, sets: list[str], **overrides) -> dict:
    from bigbatch.experiments.config import resolve, with_overrides
    from bigbatch.experiments.plan import plan_run

    config = with_overrides(resolve({"task": task}), sets)
    return plan_run(resolve(config, overrides))


def plain_run(args: argparse.Namespace) -> list[list[float]]:
    """The plain loop at a static batch: [samples, seconds, eval loss, step] at each evaluation."""
    from bigbatch.batch.lr import schedule_by_name
    from bigbatch.experiments.build import implementation, training_model
    from bigbatch.experiments.device import keep_freed_memory
    from bigbatch.experiments.tasks import TASKS
    from bigbatch.optim import create_optimizer

    keep_freed_memory()
    config = config_for(
        args.task,
        args.set,
        seed=args.seed,
        **{"batch.controller": "constant", "batch.initial": args.batch, "batch.min": args.batch},
    )
    lr = config["lr"] * args.lr_scale
    total = config["max_samples"]
    schedule = schedule_by_name(
        config["schedule.kind"], total, int(config["schedule.warmup"] * total)
    )
    device = torch.device(args.device)
    problem = TASKS[args.task].build(config.task_args)
    model = problem.model.to(device)
    optimizer = create_optimizer(
        model, config["optimizer"], lr=lr, weight_decay=config["weight_decay"],
        **implementation(config["optimizer"], config["optimizer_impl"]),
    )  # fmt: skip
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.bf16)
    forward = training_model(model, config["compile"])  # compiled alike; evaluation eager
    tensors = problem.train.tensors
    rows_count = len(tensors[0])
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(rows_count, generator=generator)
    position = samples = step = next_eval = 0
    rows = []
    start = time.perf_counter()
    while samples < total:
        if position + args.batch > rows_count:
            order, position = torch.randperm(rows_count, generator=generator), 0
        index = order[position : position + args.batch]
        position += args.batch
        batch = [t[index].to(device, non_blocking=True) for t in tensors]
        for group in optimizer.param_groups:
            group["lr"] = lr * schedule(samples)
        with autocast:
            loss = problem.loss(forward, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples += args.batch
        step += 1
        if samples >= next_eval or samples >= total:
            rows.append([samples, time.perf_counter() - start, _evaluate(problem, model), step])
            next_eval = samples - samples % args.eval_samples + args.eval_samples
    return rows


def _evaluate(problem, model) -> float:
    model.eval()
    with torch.no_grad():
        value = problem.evaluate(model)["eval_loss"]
    model.train()
    return float(value)


def bigbatch_run(args: argparse.Namespace) -> list[list[float]]:
    """``bigbatch train`` with the task's defaults: [samples, seconds, eval loss, step] at each
    evaluation, the seconds its own clock's (from the first step)."""
    from bigbatch.experiments.runner import train

    sets = [*args.set, f"seed={args.seed}", f"eval_every={args.eval_samples} samples"]
    config = config_for(args.task, sets)
    with tempfile.TemporaryDirectory() as out:
        train(config, Path(out) / "run", quiet=True)
        lines = (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [
        [r["samples"], r["wall_seconds"], r["eval_loss"], r["step"]]
        for r in rows
        if "eval_loss" in r and "wall_seconds" in r
    ]


def run_in_process(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    rows = plain_run(args) if args.arm == "plain" else bigbatch_run(args)
    print(RESULT + json.dumps(rows), flush=True)


def spawn(args: argparse.Namespace, arm: str, seed: int, batch: int = 0, scale: float = 1.0):
    command = [
        sys.executable, __file__, "--arm", arm, "--seed", str(seed), "--batch", str(batch),
        "--lr-scale", str(scale), "--task", args.task, "--threads", str(args.threads),
        "--device", args.device, "--eval-samples", str(args.eval_samples),
        *(["--bf16"] if args.bf16 else []), *[x for s in args.set for x in ("--set", s)],
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{arm} seed {seed} batch {batch}: {done.stderr[-2000:]}")
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def time_to(rows: list[list[float]], target: float) -> tuple[float, float]:
    """(seconds, steps) at the first evaluation at or below ``target`` (inf if none)."""
    for _, seconds, loss, step in rows:
        if loss <= target:
            return seconds, step
    return math.inf, math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="text")
    parser.add_argument(
        "--batches",
        default="8,16,32,64",
        type=listed(at_least(1)),
        help="the plain loop's static batches",
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--lr-scales", default="1", help="multiples of each batch's rate")
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="the plain loop under bf16 autocast")
    parser.add_argument("--eval-samples", type=at_least(1), default=3000)
    parser.add_argument("--margin", type=float, default=0.01)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--save", type=Path, help="write every run's evaluations here (JSON)")
    # one run (the processes this script starts)
    parser.add_argument("--arm", choices=("plain", "bigbatch"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--lr-scale", type=float, default=1.0)
    args = parser.parse_args()
    if args.arm:
        run_in_process(args)
        return
    if args.save and not args.save.parent.is_dir():
        parser.error(f"--save {args.save}: no folder {args.save.parent}")
    seeds = [int(s) for s in args.seeds.split(",")]
    arms: dict[str, dict[int, list]] = {}
    for seed in seeds:  # the arms interleaved, seed by seed
        for scale in (float(s) for s in args.lr_scales.split(",")):
            for batch in args.batches:
                name = f"plain {batch}" + (f" x{scale:g}" if scale != 1 else "")
                arms.setdefault(name, {})[seed] = spawn(args, "plain", seed, batch, scale)
                print(f"# {name}, seed {seed}: {arms[name][seed][-1]}", flush=True)
        arms.setdefault("bigbatch", {})[seed] = spawn(args, "bigbatch", seed)
        print(f"# bigbatch, seed {seed}: {arms['bigbatch'][seed][-1]}", flush=True)
    if args.save:
        args.save.write_text(json.dumps(arms))
    final = {name: statistics.mean(r[-1][2] for r in runs.values()) for name, runs in arms.items()}
    best = min((n for n in final if n != "bigbatch"), key=final.get)
    target = final[best] + args.margin
    print(f"\n# torch {torch.__version__}, {args.device}, {args.threads} thread(s); {args.task} "
          f"{' '.join(args.set)}; seeds {args.seeds}")  # fmt: skip
    print(f"best static: {best} (final {final[best]:.4f}); T = {target:.4f}\n")
    print("| arm | final loss | T reached | steps to T | seconds to T | total seconds | "
          "x best static: to T, total |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    rows = {name: _row(runs, target) for name, runs in arms.items()}
    base = rows[best]
    for name, (seeds, steps, seconds, total) in rows.items():
        print(f"| {name} | {final[name]:.4f} ({final[name] - final[best]:+.4f}) | "
              f"{seeds}/{len(arms[name])} | {steps:,.0f} | {seconds:.1f} | {total:.1f} | "
              f"{seconds / base[2]:.2f}, {total / base[3]:.2f} |")  # fmt: skip
    print("\nto T: the mean over the seeds that reach it (each arm's own seeds: T reached)")


def _row(runs: dict[int, list], target: float) -> tuple[int, float, float, float]:
    """Seeds that reach ``target``; their mean steps and seconds to it (NaN where none
    does); the mean total seconds over every seed."""
    reached = [time_to(r, target) for r in runs.values()]
    reached = [(seconds, steps) for seconds, steps in reached if math.isfinite(seconds)]
    total = statistics.mean(r[-1][1] for r in runs.values())
    if not reached:
        return 0, math.nan, math.nan, total
    seconds = statistics.mean(s for s, _ in reached)
    return len(reached), statistics.mean(n for _, n in reached), seconds, total


if __name__ == "__main__":
    main()

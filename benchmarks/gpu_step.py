"""The cost of the statistics on a compute-bound GPU step, and bigbatch train's throughput.

    python benchmarks/gpu_step.py                      # on a CUDA machine
    python benchmarks/gpu_step.py --device cpu --quick # a smoke run anywhere

A GPT-like pre-norm transformer (8 layers, d 512, 8 heads, sequences of 256
tokens of a synthetic Markov language) trained through ``AdaptiveBatch`` with
LAMB at a constant batch, in 4 and 16 micro-batches of 16 sequences. The
arms differ only in ``statistics=False / True / True + gsnr=True`` and run
interleaved, step by step, so drifts in clock speed fall on all of them;
median step time from CUDA events (wall clock on the CPU), host
synchronisations per step from ``torch.cuda.set_sync_debug_mode``. Then the
samples per second of ``bigbatch train`` on the ``lm`` task at width 512,
depth 8 (bf16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import bigbatch as bb
from bigbatch.experiments.tasks import TinyTransformer, markov_language
from bigbatch.testing import host_syncs

ARMS = ("off", "on", "on + gsnr")


def data(sequences: int, context: int) -> TensorDataset:
    transition, _ = markov_language(vocab=512, alpha=0.05)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.empty(sequences, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, 512, (sequences,), generator=gen)
    for t in range(context):
        tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]].float(), 1, generator=gen)[
            :, 0
        ]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_loop(arm: str, dataset, micro: int, args) -> tuple[nn.Module, bb.AdaptiveBatch]:
    torch.manual_seed(0)
    model = TinyTransformer(512, args.context, args.width, args.depth, heads=8).to(args.device)
    loop = bb.AdaptiveBatch(
        model,
        bb.optim.LAMB(bb.optim.param_groups(model, 0.01), lr=1e-3),
        dataset,
        controller=bb.batch.Constant(16 * micro),
        max_micro_batch=16,
        min_sub_batches=micro,
        statistics=arm != "off",
        gsnr=arm == "on + gsnr",
        loader_options={"pin_memory": args.device.type == "cuda"},
    )
    return model, loop


def timed_step(model, loop, device: torch.device) -> tuple[float, int]:
    """One step's time (CUDA events on a GPU) and its host synchronisations."""
    step = next(loop.steps(max_steps=loop.steps_taken + 1))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    with host_syncs(device) as counted:
        for x, y in step.micro_batches():
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            step.backward(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
        step.apply()
    syncs = counted.count
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000, syncs
    return time.perf_counter() - began, syncs


def statistics_cost(args, micro: int, dataset) -> None:
    loops = {arm: make_loop(arm, dataset, micro, args) for arm in ARMS}
    for model, loop in loops.values():
        for _ in range(3):  # warm-up: state, allocator, kernels
            timed_step(model, loop, args.device)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    syncs: dict[str, list[int]] = {arm: [] for arm in ARMS}
    for round_ in range(args.steps):
        order = ARMS[round_ % 3 :] + ARMS[: round_ % 3]
        for arm in order:
            seconds, count = timed_step(*loops[arm], args.device)
            times[arm].append(seconds)
            syncs[arm].append(count)
    base = statistics.median(times["off"])
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(
            f"| {micro} × 16 | {arm} | {1000 * median:.1f} | {median / base - 1:+.1%} "
            f"| {statistics.median(syncs[arm]):.0f} |"
        )


def throughput(args) -> None:
    from bigbatch.experiments.config import resolve
    from bigbatch.experiments.runner import train

    config = resolve(
        {
            "task": "lm",
            "model.width": args.width,
            "model.depth": args.depth,
            "max_samples": args.train_samples,
            "device": str(args.device),
            "precision": "bf16" if args.device.type == "cuda" else "fp32",
            "eval_every": 1000,
            "checkpoint_every": 100_000,
        }
    )
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as out:
        summary = train(config, Path(out) / "run", quiet=True)
    rate = summary["samples"] / summary["wall_seconds"]
    print(
        f"\nbigbatch train, lm, width {args.width}, depth {args.depth}, {config['precision']}: "
        f"{summary['samples']} sequences in {summary['wall_seconds']:.1f} s = {rate:.0f} "
        f"sequences/s ({summary['steps']} steps, average batch {summary['avg_batch_size']:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny model, few steps")
    args = parser.parse_args()
    args.device = torch.device(args.device)
    args.width, args.depth, args.context = (64, 2, 32) if args.quick else (512, 8, 256)
    args.steps = 3 if args.quick else 15
    args.train_samples = 2_000 if args.quick else 200_000
    name = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}")
    print("| micro-batches | statistics | median step ms | vs off | host syncs per step |")
    print("|---|---|---|---|---|")
    dataset = data(4096 if args.quick else 16384, args.context)
    for micro in (4, 16):
        statistics_cost(args, micro, dataset)
    throughput(args)


if __name__ == "__main__":
    main()

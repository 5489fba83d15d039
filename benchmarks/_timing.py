"""How the micro-benchmarks time a step: one clock, one interleaving, one median.

A step is timed with CUDA events on a GPU (the kernels' time, the host's
launches included) and the wall clock on a CPU. Arms are timed interleaved,
in an order rotated every round, so the machine's drift and a warm cache hit
every arm alike; the tables give medians, which one slow round cannot move.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch


def seconds(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    """Seconds ``fn()`` takes: CUDA events on a GPU, the wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def interleaved(
    arms: Mapping[str, Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    before: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Each arm's step times over ``rounds`` rounds, after ``warmup`` untimed rounds
    (allocators, kernels, loaders), the arms' order rotated every round; ``before()``
    runs untimed before each timed step (a barrier, so that ranks start together)."""
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            if before is not None:
                before()
            times[name].append(seconds(arms[name], device))
    return times


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    """Each arm's median time."""
    return {name: statistics.median(values) for name, values in times.items()}

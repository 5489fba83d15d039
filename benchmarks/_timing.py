"""How the micro-benchmarks time a step: one clock, one interleaving, one median.

A step is timed with CUDA events on a GPU (the kernels' time, the host's
launches included) and the wall clock on a CPU. Arms are timed interleaved,
in an order rotated every round, so the machine's drift and a warm cache hit
every arm alike; the tables give medians, which one slow round cannot move.
"""

from __future__ import annotations

import argparse
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


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """An ``argparse`` type: a number of ``kind`` of at least ``low`` (a bad value is one line
    of usage, not a traceback from deep inside a benchmark)."""

    def parse(text: str) -> Any:
        value = kind(text)  # (argparse turns the ValueError into "invalid ... value")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def listed(item: Callable[[str], Any]) -> Callable[[str], list]:
    """An ``argparse`` type: a comma-separated list of ``item``."""

    def parse(text: str) -> list:
        return [item(part) for part in text.split(",")]

    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse

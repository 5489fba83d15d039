"""Runs in fresh processes: what a sweep and a tuning study share."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from .signals import stop_between_runs, stop_requested

__all__ = ["in_processes"]


def in_processes(function: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``function`` over ``items``, in order; ``workers`` fresh processes at a time when > 1
    (each its own torch: a run's threads and state do not leak into the next)."""
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        min(workers, len(items)), mp_context=context
    ) as pool:
        futures = [pool.submit(function, item) for item in items]
        while concurrent.futures.wait(futures, timeout=0.5).not_done:
            if stop_requested():  # a signal to this process alone: no further run starts
                for future in futures:
                    future.cancel()
        results = [f.result() for f in futures if not f.cancelled()]  # a worker's Stopped
        stop_between_runs(None)
        return results

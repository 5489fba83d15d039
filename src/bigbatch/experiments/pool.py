"""Runs in fresh processes: what a sweep and a tuning study share."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from .signals import stop_between_runs, stop_requested

__all__ = ["Processes", "in_processes"]


class Processes:
    """Up to ``workers`` fresh processes, kept from one :meth:`map` to the next."""

    # each its own torch (a run's threads and state stay out of this process); a study's
    # rungs share them, so each imports torch once

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def map(self, function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        # ``function`` over ``items``, in order; here when one worker or one item
        if self.workers <= 1 or len(items) <= 1:
            return [function(item) for item in items]
        if self._pool is None:  # spawned on demand: a rung of fewer items starts fewer
            context = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context)
        futures = [self._pool.submit(function, item) for item in items]
        while concurrent.futures.wait(futures, timeout=0.5).not_done:
            if stop_requested():  # a signal to this process alone: no further run starts
                for future in futures:
                    future.cancel()
        results = [f.result() for f in futures if not f.cancelled()]  # a worker's Stopped
        stop_between_runs(None)
        return results


def in_processes(function: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``function`` over ``items`` in order, in up to ``workers`` fresh processes."""
    with Processes(min(workers, len(items))) as processes:
        return processes.map(function, items)

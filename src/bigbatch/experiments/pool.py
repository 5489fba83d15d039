"""Runs in fresh processes: what a sweep and a tuning study share."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .signals import stop_between_runs, stop_requested

#: the exit code of a worker whose command was killed
WORKER_ORPHANED = 137

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
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=context,
                initializer=_start_worker,
                initargs=(os.getpid(),),
            )
        # as many submitted as there are workers, none after a signal: a run never starts
        # after one, and no future is cancelled (which can wedge the pool's manager thread)
        waiting, running, finished = list(enumerate(items)), {}, {}
        try:
            while waiting or running:
                while waiting and len(running) < self.workers and not stop_requested():
                    index, item = waiting.pop(0)
                    running[self._pool.submit(function, item)] = index
                if not running:
                    break
                done, _ = concurrent.futures.wait(
                    running, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
                )
                finished.update((running.pop(future), future) for future in done)
            results = [finished[index].result() for index in sorted(finished)]  # a Stopped
        except BrokenProcessPool:
            stop_between_runs(None)  # a worker the signal reached as it started
            raise
        stop_between_runs(None)
        return results


def _start_worker(parent: int) -> None:
    # a worker between runs leaves a terminal's Ctrl-C (sent to the whole process group) to
    # this process; a run it trains installs its own handlers (and puts these back after)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    # a command killed outright (SIGKILL, the OOM killer) cannot stop its workers: each ends
    # itself once its parent is gone, as a killed run ends (its folder resumes), rather than
    # train on holding the folder's lock for a command that no longer waits for it
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(WORKER_ORPHANED)


def in_processes(function: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``function`` over ``items`` in order, in up to ``workers`` fresh processes."""
    with Processes(min(workers, len(items))) as processes:
        return processes.map(function, items)

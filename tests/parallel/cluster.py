"""A pool of gloo processes that stays up across tests (process start-up is the slow part).

``Cluster(world_size).run(fn, *args)`` calls ``fn(*args)`` on every rank at
once and returns the ranks' results in rank order; ``fn`` must be importable
(a module-level function) and may use the default process group. One thread
per rank, as the tests run on a 2-core machine.
"""

from __future__ import annotations

import importlib
import queue
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from bigbatch.testing import free_port, init_gloo

TIMEOUT = 300  # seconds a program may take before the pool is declared hung


def _serve(rank: int, world_size: int, port: int, inbox: mp.Queue, outbox: mp.Queue) -> None:
    init_gloo(rank, world_size, port, timeout_s=120)
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, args, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report anything, including assertion errors
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Cluster:
    """``world_size`` spawned processes joined in one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, world_size, port, self._inboxes[rank], self._outbox),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        if self.broken:
            raise RuntimeError("the cluster is broken by an earlier failure")
        for inbox in self._inboxes:
            inbox.put((fn.__module__, fn.__name__, args, kwargs))
        results: list[Any] = [None] * self.world_size
        failures = []
        deadline = time.monotonic() + TIMEOUT
        for _ in range(self.world_size):
            while True:
                try:
                    rank, ok, value = self._outbox.get(timeout=1)
                    break
                except queue.Empty:
                    dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.close()
                        why = f"ranks {dead} died" if dead else f"no result in {TIMEOUT} s"
                        raise RuntimeError(f"{fn.__name__}: {why}") from None
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
                # the other ranks may wait in a collective forever: stop waiting
                self.close()
                break
        if failures:
            raise AssertionError("\n".join(failures))
        return results

    def close(self) -> None:
        if not self.broken:
            for inbox in self._inboxes:
                inbox.put(None)
        self.broken = True
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

"""Running a benchmark program on N spawned gloo ranks (shared by the distributed benchmarks)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from bigbatch.testing import free_port, init_gloo


def run_gloo(program: Callable[..., Any], world: int, *args: Any) -> Any:
    """``program(*args)`` on ``world`` spawned ranks (gloo, 1 thread each); rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(program, rank, world, port, args, results))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    while True:  # a rank that fails before rank 0's result would leave the wait hanging
        try:
            value = results.get(timeout=1.0)
            break
        except queue.Empty:
            failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode]
            if failed or all(p.exitcode is not None for p in procs):
                for p in procs:
                    p.terminate()
                    p.join()
                how = (
                    f"rank {failed[0][0]} failed (exit code {failed[0][1]})"
                    if failed
                    else ("the ranks ended without a result")
                )
                raise RuntimeError(f"{how}; its error is above") from None
    for p in procs:
        p.join()
    return value


def _rank(program, rank: int, world: int, port: int, args: tuple, results) -> None:
    init_gloo(rank, world, port)
    value = program(*args)
    if rank == 0:
        results.put(value)
    dist.barrier()
    dist.destroy_process_group()

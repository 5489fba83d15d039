"""Running a benchmark program on N spawned gloo ranks (shared by the distributed benchmarks)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_gloo(program: Callable[..., Any], world: int, *args: Any) -> Any:
    """``program(*args)`` on ``world`` spawned ranks (gloo, 1 thread each); rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank, args=(program, rank, world, port, args, results))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    value = results.get()
    for p in procs:
        p.join()
    return value


def _rank(program, rank: int, world: int, port: int, args: tuple, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    value = program(*args)
    if rank == 0:
        results.put(value)
    dist.barrier()
    dist.destroy_process_group()

"""Helpers the tests and the benchmarks share: counting host synchronisations on a GPU,
and starting local gloo ranks."""

from __future__ import annotations

import contextlib
import datetime
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SyncCount", "free_port", "host_syncs", "init_gloo"]


@dataclass
class SyncCount:
    """What :func:`host_syncs` counted (set when its block ends)."""

    count: int = 0


@contextlib.contextmanager
def host_syncs(device: torch.device | str = "cuda") -> Iterator[SyncCount]:
    """Count the host synchronisations the block makes on CUDA, as torch's sync debug mode
    reports them (``count`` stays 0 on another device, where there are none to count).

    Only the warnings that name a synchronizing operation count: the first
    switch into the mode also warns that it is a prototype ("... does not yet
    detect all synchronizing operations"), which is no sync.
    """
    counted = SyncCount()
    if torch.device(device).type != "cuda":
        yield counted
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            yield counted
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counted.count = sum("called a synchronizing" in str(w.message) for w in caught)


def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 300) -> None:
    """Join a local gloo process group as ``rank`` of ``world_size``, with one torch thread
    (the ranks share a small machine's cores)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )

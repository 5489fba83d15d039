"""Helpers the tests and the benchmarks share: counting host synchronisations on a GPU,
counting the operators a step dispatches, and starting local gloo ranks."""

from __future__ import annotations

import collections
import contextlib
import datetime
import socket
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCount", "count_ops", "free_port", "host_syncs", "init_gloo"]


@dataclass
class SyncCount:
    """What :func:`host_syncs` counted (set when its block ends)."""

    count: int = 0


@contextlib.contextmanager
def host_syncs(device: torch.device | str = "cuda") -> Iterator[SyncCount]:
    """Count the host synchronisations the block makes on CUDA, as torch's sync debug mode
    reports them (its "prototype" warning is not one); 0 on other devices."""
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


class _OpCounter(TorchDispatchMode):
    """Counts every ATen operator dispatched below autograd, by name (meta reads give zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and source.device.type == "meta":
            if func is torch.ops.aten._local_scalar_dense.default:
                return False if source.dtype == torch.bool else 0
            target = kwargs.get("device")
            copies = func is torch.ops.aten._to_copy.default and target is not None
            if copies and torch.device(target).type != "meta":
                dtype = kwargs.get("dtype") or source.dtype
                return torch.zeros(source.shape, dtype=dtype, device=target)
        return func(*args, **kwargs)


def count_ops(fn: Callable[[], Any]) -> collections.Counter[str]:
    """The ATen operators ``fn()`` dispatches, by name (views and in-place ones included).

    The count is the same on every machine, so a CPU test can bound a GPU step's kernel
    launches; on the ``meta`` device a large model's step counts in seconds.
    """
    with _OpCounter() as counter:
        fn()
    return counter.ops


def free_port() -> int:
    """A TCP port on the loopback interface that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 300) -> None:
    """Join a local gloo process group as ``rank`` of ``world_size``, with one torch thread."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )

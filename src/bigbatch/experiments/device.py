"""Where a run computes and in what precision: the machine keys (help in docs/cli.md).

``device = "auto"`` is the GPU when there is one (under ``torchrun`` the process's
``LOCAL_RANK``-th), else the CPU; where a node runs more processes than it has GPUs,
every process takes the CPU (NCCL needs a GPU of its own per rank, and all ranks must
choose alike). Batches move to the device from pinned memory with non-blocking copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import warnings
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
#: the ``compile`` key: none, or a mode of ``torch.compile`` (those without CUDA graphs: a
#: step's micro-batches keep the backward's outputs past the next replay)
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device a config names (``auto``, ``cpu``, ``cuda`` or ``cuda:N``), checked."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_processes > torch.cuda.device_count():
            warnings.warn(
                f"device = 'auto': {local_processes} processes on this node but "
                f"{torch.cuda.device_count()} GPU(s); training on the CPU "
                "(set device = 'cuda' with one process per GPU to use them)",
                stacklevel=2,
            )
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device = {name!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device = {name!r}: bigbatch runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device = {name!r} but no CUDA device is available here")
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device = {name!r} but this machine has {torch.cuda.device_count()} GPU(s)"
            )
        device = torch.device("cuda", index)
    return device


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for float32 matrix products and convolutions (CUDA only)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def threads_of(threads: int, local_processes: int = 1) -> int | None:
    """A process's torch threads: ``threads``, else its share of cores (None: torch's default)."""
    if threads:
        return threads
    return share_of_cores(local_processes) if local_processes > 1 else None


def set_threads(threads: int, local_processes: int = 1) -> None:
    """Sets :func:`threads_of`'s threads (None: leaves torch's default)."""
    chosen = threads_of(threads, local_processes)
    if chosen is None:
        return
    share = share_of_cores(local_processes)
    if chosen > share:  # threads beyond the cores wait on each other: slower, not faster
        each = f" each of {local_processes} processes has" if local_processes > 1 else " here"
        warnings.warn(f"threads = {chosen} is more than the {share} core(s){each}", stacklevel=2)
    torch.set_num_threads(chosen)


def share_of_cores(processes: int) -> int:
    """The CPU cores each of ``processes`` local processes gets (at least one): of the cores
    this process may run on (a container's or a job's CPU set), not the machine's."""
    if hasattr(os, "sched_getaffinity"):  # Linux; elsewhere every core is usable
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, cores // processes)


#: glibc's ``mallopt`` parameters (``malloc.h``)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: both thresholds: blocks under the mmap one come from the heap (glibc may cap it lower),
#: and the heap's free top is handed back only past the trim one
_KEPT_BYTES = 1 << 30
#: the environment through which a user sets glibc's malloc: theirs to decide
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Keep freed memory in the process for the next step (glibc's malloc only).

    glibc hands a large freed block back to the system, so a CPU step whose activations
    are megabytes each faults their pages in again at every step. Raising the mmap and
    trim thresholds (to 1 GiB) keeps them, as PyTorch's CPU tuning guide does with
    jemalloc or tcmalloc, at a resident size that stays at the run's peak
    (docs/results.md, "The CPU allocator"). False (nothing done) off glibc or where the
    user set glibc's malloc through its environment.
    """
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _MALLOC_ENV) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEPT_BYTES) and mallopt(_M_TRIM_THRESHOLD, _KEPT_BYTES))


class Precision:
    """Autocast for the forward passes, and the ``GradScaler`` fp16 needs."""

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
        self.name, self.device = name, device

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.name])

    def scaler(self) -> torch.amp.GradScaler | None:
        """A loss scaler for float16 (whose gradients underflow without one); else None."""
        if self.name != "fp16":
            return None
        return torch.amp.GradScaler(self.device.type)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in tuples, lists, dicts) on ``device``, copied without blocking."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch

"""Which process this is among how many: rank, world size and the collectives bigbatch uses."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checks import rank_in_world
from .fsdp import is_dtensor, is_fully_sharded, mesh_group

__all__ = ["World", "init_from_env"]


@dataclass(frozen=True)
class World:
    """The data-parallel world of a model: one process, or the ranks of its DDP or FSDP2 group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    #: each rank holds a shard of the parameters and of the reduced gradient (FSDP2)
    sharded: bool = False

    def __post_init__(self) -> None:
        rank_in_world(self.rank, self.size, "size")  # World(rank=3, size=2) was taken

    @classmethod
    def of(cls, model: nn.Module) -> World:
        """The world of ``model``: its DDP process group, its FSDP2 mesh, or one process. Other
        sharding (FSDP1, bare DTensors) is a ``ValueError``, not taken for one process."""
        if is_fully_sharded(model):
            group = mesh_group(model)
            return cls(dist.get_rank(group), dist.get_world_size(group), group, sharded=True)
        sharding = _sharding(model)
        if sharding is not None:
            raise ValueError(
                f"the model is sharded ({sharding}); bigbatch supports plain modules, "
                "DistributedDataParallel and FSDP2 fully_shard models"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            group = model.process_group
            return cls(dist.get_rank(group), dist.get_world_size(group), group)
        return cls()

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (nothing on one process)."""
        if self.distributed:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` on one process)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_alike(self, settings: dict[str, Any], what: str) -> None:
        # one ValueError, on every rank, where a setting differs between the ranks; a callable
        # by its name (its repr holds an address, which differs between processes)
        mine = {k: getattr(v, "__qualname__", None) or repr(v) for k, v in settings.items()}
        gathered = self.all_gather_object(mine)
        for key in mine:
            other = next((r for r, g in enumerate(gathered) if g[key] != gathered[0][key]), None)
            if other is not None:
                raise ValueError(
                    f"{what}: {key} differs between the ranks (rank 0: {gathered[0][key]}; "
                    f"rank {other}: {gathered[other][key]}); build it alike on every rank"
                )

    def barrier(self) -> None:
        """Wait for every rank (nothing on one process)."""
        if self.distributed:
            dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def _sharding(model: nn.Module) -> str | None:
    """How ``model`` is sharded across ranks, in words; None for an unsharded module."""
    fsdp = getattr(torch.distributed, "fsdp", None)
    if fsdp is not None and isinstance(model, getattr(fsdp, "FullyShardedDataParallel", ())):
        return "FullyShardedDataParallel"
    if any(is_dtensor(p) for p in model.parameters()):
        if any(is_fully_sharded(m) for m in model.modules()):  # its blocks, not its root
            return "DTensor parameters; fully_shard(model) on the root too makes it FSDP2's"
        return "DTensor parameters"
    return None


def init_from_env(device: torch.device | None = None, timeout: float | None = None) -> World:
    """Join the process group ``torchrun`` describes (NCCL on CUDA, else gloo) and return
    its world; one process otherwise. ``timeout`` (seconds) bounds every collective."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_initialized():
        cuda = device is not None and device.type == "cuda"
        if cuda:  # NCCL's object collectives use the current device: one GPU per rank
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        limit = datetime.timedelta(seconds=timeout) if timeout is not None else None
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=limit)
    return World(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)

"""LAMB, LARS and MERIT on FSDP2 shards: local element-wise updates, whole-tensor norms
and maxima from per-rank partials in one collective per group (docs/algorithms.md,
"Layer-wise optimizers on shards")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..parallel.fsdp import is_dtensor, local

__all__ = ["Shards", "local", "shards_of"]


class Shards:
    """The ranks a list of DTensor parameters is sharded over, and the reductions across them."""

    def __init__(self, group: object) -> None:
        self.group = group

    def sum(self, t: Tensor) -> Tensor:
        """``t`` summed over the ranks, in place."""
        dist.all_reduce(t, group=self.group)
        return t

    def max(self, t: Tensor) -> Tensor:
        """``t`` maximised over the ranks, in place."""
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def norms(self, *local_norms: Tensor) -> tuple[Tensor, ...]:
        """Whole-tensor L2 norms from the shards' norms (vectors of one length): one collective."""
        squares = self.sum(torch.stack(local_norms).square())
        return tuple(squares.sqrt().unbind(0))


def shards_of(tensors: Sequence[Tensor]) -> Shards | None:
    """The :class:`Shards` of DTensors sharded on dim 0 over a 1-D mesh, None for plain
    tensors; anything else raises."""
    dtensors = [is_dtensor(t) for t in tensors]
    if not any(dtensors):
        return None
    if not all(dtensors):
        raise ValueError("a param group mixes DTensor shards and plain tensors")
    from torch.distributed.tensor import Shard

    first = tensors[0]
    placements = {tuple(t.placements) for t in tensors}
    if first.device_mesh.ndim != 1 or placements != {(Shard(0),)}:
        raise ValueError(
            f"bigbatch optimizers run on DTensors sharded on dim 0 over a 1-D mesh (FSDP2 "
            f"fully_shard); got placements {sorted(placements)} on a "
            f"{first.device_mesh.ndim}-D mesh"
        )
    return Shards(first.device_mesh.get_group())

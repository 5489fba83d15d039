"""LAMB, LARS and MERIT on FSDP2 shards: local updates, whole-tensor reductions in one collective.

Under ``fully_shard`` each parameter, its gradient and its optimizer state are
DTensors holding this rank's rows (dim 0). Element-wise work is local: the
``foreach`` update runs on the local tensors (``to_local()`` views, updated
in place). What needs a whole tensor is a reduction over its rows, and every
one of them is a sum or a maximum of per-rank partial results:

- L2 norms (LAMB's and LARS's trust ratios, LAMB's global clip): each rank's
  squared norm of its shard, summed over the ranks;
- MERIT's column maxima (over dim 0, the sharded one) and layer maxima: each
  rank's maxima, maximised over the ranks; its row maxima are local.

The partial results of all tensors of a step are packed into one tensor and
reduced in one ``all_reduce``, so a step makes a fixed number of collectives
(LAMB: one for the clip and one per param group; LARS and MERIT: one per
group), whatever the number of tensors. Ranks whose shard of a tensor is
empty contribute zeros. The result equals the unsharded optimizer's up to the
order of float additions.
"""

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
    """The :class:`Shards` of ``tensors`` if they are DTensors sharded on dim 0 over a 1-D
    mesh (FSDP2), None for plain tensors; anything else is one clear error."""
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

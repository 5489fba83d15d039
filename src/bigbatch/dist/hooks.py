"""DDP communication hooks of bigbatch.

:class:`TwoGroupCosine` measures SimiGrad's own signal exactly: the cosine
between the mean gradients of two groups of ranks (REFERENCE.md §2). It costs
one extra gradient-sized all-reduce per step (the first group's sum travels
beside the full sum), which is what the scalar estimate of
:class:`~bigbatch.stats.MicroBatchStatistics` avoids; it is here to compare
the two. It wraps any other hook (plain all-reduce by default, PowerSGD or a
compression hook), because DDP takes one hook per model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._tensors import dots, norms

__all__ = ["TwoGroupCosine"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class TwoGroupCosine:
    """Comm hook measuring ``<g_A, g_B>``, ``|g_A|²``, ``|g_B|²`` per parameter group.

    Ranks ``[0, W//2)`` form group A, the others group B. Each bucket is
    all-reduced as two rows, ``[local, local if rank in A else 0] / W``: the
    first row is DDP's usual mean, the second ``a = (B_A/B) g_A`` when local
    gradients are scaled by the rank's share of the batch (as
    ``AdaptiveBatch`` does), so ``b = mean - a = (B_B/B) g_B`` and
    ``cos(a, b) = cos(g_A, g_B)``. The sums are identical on every rank.

    Args:
        param_groups: lists of parameters (or param-group dicts) of the DDP
            module; statistics are per group.
        process_group: the DDP model's process group (default: the world).
        inner: the hook that really reduces the gradient (e.g. PowerSGD);
            None uses the plain all-reduce result of the first row.
        inner_state: the state passed to ``inner``.

    Register with ``ddp_model.register_comm_hook(None, hook)``; read with
    :meth:`read` after the synchronising backward.
    """

    def __init__(
        self,
        param_groups: Sequence[Sequence[Tensor] | dict],
        process_group: Any = None,
        *,
        inner: CommHook | None = None,
        inner_state: Any = None,
    ) -> None:
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        if self.world_size < 2:
            raise ValueError("the two-group cosine needs at least 2 ranks")
        self.in_first = dist.get_rank(self.group) < self.world_size // 2
        groups = [list(g["params"]) if isinstance(g, dict) else list(g) for g in param_groups]
        self.num_groups = len(groups)
        self._group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        self.inner, self.inner_state = inner, inner_state
        # DDP reads a hook's name (it expects a function)
        self.__name__ = self.__qualname__ = "two_group_cosine_hook"
        # bucket index -> (3, groups) sums; a dict because buckets may finish on
        # different communication threads
        self._parts: dict[int, Tensor] = {}
        self._owners: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
        #: bytes this hook added to the all-reduce traffic (one row per bucket)
        self.extra_bytes = 0

    # no annotations: DDP checks them by identity, which string annotations fail
    def __call__(self, state, bucket):
        buffer = bucket.buffer()
        rows = torch.zeros(2, buffer.numel(), dtype=buffer.dtype, device=buffer.device)
        torch.div(buffer, self.world_size, out=rows[0])
        if self.in_first:
            rows[1].copy_(rows[0])
        self.extra_bytes += buffer.numel() * buffer.element_size()
        index, params = bucket.index(), bucket.parameters()
        offsets = [
            (g.data_ptr() - buffer.data_ptr()) // buffer.element_size() for g in bucket.gradients()
        ]
        work = dist.all_reduce(rows, group=self.group, async_op=True)

        def measure(fut: torch.futures.Future) -> Tensor:
            total, a = fut.value()[0]
            b = total - a
            self._parts[index] = self._sums(params, offsets, a, b)
            if self.inner is None:
                buffer.copy_(total)
            return buffer

        measured = work.get_future().then(measure)
        if self.inner is None:
            return measured
        reduced = self.inner(self.inner_state, bucket)
        return torch.futures.collect_all([measured, reduced]).then(lambda f: f.value()[1].value())

    def _sums(self, params: list[Tensor], offsets: list[int], a: Tensor, b: Tensor) -> Tensor:
        pieces_a = [a[o : o + p.numel()] for p, o in zip(params, offsets)]
        pieces_b = [b[o : o + p.numel()] for p, o in zip(params, offsets)]
        per_param = torch.stack(
            [
                torch.stack(norms(pieces_a)).double().square(),
                torch.stack(norms(pieces_b)).double().square(),
                torch.stack(dots(pieces_a, pieces_b)).double(),
            ]
        )
        # parameters outside the optimizer's groups (frozen by the user) count nowhere
        key = tuple(id(p) for p in params)
        if key not in self._owners:
            owners = [self._group_of.get(id(p), -1) for p in params]
            self._owners[key] = (
                torch.tensor([i for i, o in enumerate(owners) if o >= 0], device=a.device),
                torch.tensor([o for o in owners if o >= 0], device=a.device),
            )
        keep, owner = self._owners[key]
        out = torch.zeros(3, self.num_groups, dtype=torch.float64, device=a.device)
        return out.index_add_(1, owner, per_param[:, keep])

    def reset(self) -> None:
        """Forget the sums of the previous step."""
        self._parts.clear()

    def read(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(|a|², |b|², <a, b>)`` per parameter group, summed over the buckets of this step."""
        if not self._parts:
            raise RuntimeError(
                "the two-group hook saw no bucket this step: is it registered on the DDP model "
                "(ddp.register_comm_hook(None, hook)) and did the last backward synchronise?"
            )
        total = torch.stack(list(self._parts.values())).sum(0)
        return total[0], total[1], total[2]

"""DDP communication hooks in torch's ``(state, hook)`` form: :func:`two_group_cosine_hook`
measures SimiGrad's two-group cosine exactly (one extra gradient-sized all-reduce a
step), around any other hook::

    state = TwoGroupCosine(optimizer.param_groups, inner=(powersgd_state, powerSGD_hook))
    ddp.register_comm_hook(state, two_group_cosine_hook)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .._tensors import dots, norms

__all__ = ["CommHook", "TwoGroupCosine", "is_lossless", "two_group_cosine_hook"]

#: a DDP communication hook function: ``hook(state, bucket) -> Future[Tensor]``
CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def is_lossless(comm_hook: tuple[Any, CommHook] | None) -> bool:
    """Whether a ``(state, hook)`` pair reduces exactly: a state's ``lossless`` attribute, or
    torch's ``allreduce_hook``; any other hook is taken to be lossy."""
    if comm_hook is None:
        return True
    state, hook = comm_hook
    if hasattr(state, "lossless"):
        return bool(state.lossless)
    return hook is default_hooks.allreduce_hook


class TwoGroupCosine:
    """The state of :func:`two_group_cosine_hook`: ``<g_A, g_B>``, ``|g_A|²``, ``|g_B|²`` per group.

    Ranks ``[0, W//2)`` form group A. Read with :meth:`read` after the synchronising
    backward. docs/algorithms.md, "Gradient statistics".

    Args:
        param_groups: lists of parameters (or param-group dicts) of the DDP module.
        process_group: the DDP model's process group (default: the world).
        inner: the ``(state, hook)`` pair that reduces the gradient (None: plain).
    """

    def __init__(
        self,
        param_groups: Sequence[Sequence[Tensor] | dict],
        process_group: Any = None,
        *,
        inner: tuple[Any, CommHook] | None = None,
    ) -> None:
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        if self.world_size < 2:
            raise ValueError("the two-group cosine needs at least 2 ranks")
        self.in_first = dist.get_rank(self.group) < self.world_size // 2
        groups = [list(g["params"]) if isinstance(g, dict) else list(g) for g in param_groups]
        self.num_groups = len(groups)
        self._group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        #: the ``(state, hook)`` that reduces the gradient (None: the plain all-reduce)
        self.inner = inner
        # bucket index -> (3, groups) sums; a dict because buckets may finish on
        # different communication threads
        self._parts: dict[int, Tensor] = {}
        self._owners: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}
        #: bytes this hook added to the all-reduce traffic (one row per bucket)
        self.extra_bytes = 0

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

    @property
    def lossless(self) -> bool:
        """The reduction is exact when the inner hook's is."""
        return is_lossless(self.inner)

    def traffic(self) -> int:
        """Bytes this hook added to the all-reduces so far (one extra row per bucket)."""
        return self.extra_bytes

    def reset(self) -> None:
        """Forget the sums of the previous step."""
        self._parts.clear()

    def read(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(|a|², |b|², <a, b>)`` per parameter group, summed over the buckets of this step."""
        if not self._parts:
            raise RuntimeError(
                "the two-group hook saw no bucket this step: is it registered on the DDP model "
                "(ddp.register_comm_hook(state, two_group_cosine_hook)) and did the last "
                "backward synchronise?"
            )
        total = torch.stack(list(self._parts.values())).sum(0)
        return total[0], total[1], total[2]


# no annotations: DDP checks a hook's annotations by identity, which string annotations fail
def two_group_cosine_hook(state, bucket):
    """All-reduce a bucket as ``[local, local if in group A else 0] / W`` and accumulate the
    halves' ``(|a|², |b|², <a, b>)``."""
    buffer = bucket.buffer()
    rows = torch.zeros(2, buffer.numel(), dtype=buffer.dtype, device=buffer.device)
    torch.div(buffer, state.world_size, out=rows[0])
    if state.in_first:
        rows[1].copy_(rows[0])
    state.extra_bytes += buffer.numel() * buffer.element_size()
    index, params = bucket.index(), bucket.parameters()
    offsets = [
        (g.data_ptr() - buffer.data_ptr()) // buffer.element_size() for g in bucket.gradients()
    ]
    work = dist.all_reduce(rows, group=state.group, async_op=True)

    def measure(fut: torch.futures.Future) -> Tensor:
        total, a = fut.value()[0]
        b = total - a
        state._parts[index] = state._sums(params, offsets, a, b)
        if state.inner is None:
            buffer.copy_(total)
        return buffer

    measured = work.get_future().then(measure)
    if state.inner is None:
        return measured
    inner_state, inner_hook = state.inner
    reduced = inner_hook(inner_state, bucket)
    return torch.futures.collect_all([measured, reduced]).then(lambda f: f.value()[1].value())

"""The half-split terms ``(|g_A|², |g_B|², <g_A, g_B>)`` per group, three ways; one is chosen once.

- :class:`SplitMicroBatches` (one process, ``similarity="split"``): ``.grad``
  at the first micro-batch of half B holds half A's gradient; one copy into a
  persistent buffer and three reductions at the end.
- :class:`SplitRanks` (DDP, ``"split"``): SimiGrad's two groups of ranks,
  measured by the :func:`~bigbatch.dist.hooks.two_group_cosine_hook` (one
  extra gradient-sized all-reduce).
- :class:`FromNoiseScalars` (``"scalar"``): the expected terms from the step's
  ``|G|²`` and ``tr Σ`` (docs/algorithms.md, "The similarity from scalars"):
  no buffer, no traffic.

The measured forms hold each half's gradient up to a positive factor (its
share of the batch), which no cosine sees.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tensors import dots, norms
from ..dist.hooks import TwoGroupCosine
from ..dist.world import World
from .estimators import scalar_halves
from .layout import ParamLayout, SubBatches

SIMILARITY_MODES = ("split", "scalar")


class SplitMicroBatches:
    """Half A is the first ``k // 2`` micro-batches of the step, half B the rest."""

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self._half: list[Tensor] | None = None  # .grad after half A (allocated once)
        self._taken = False

    def begin(self, batches: SubBatches) -> None:
        if len(batches.sizes) < 2:
            raise ValueError(
                f"the split similarity needs at least 2 micro-batches, got sizes {batches.sizes}"
            )
        self._taken = False

    def before_backward(self, index: int, batches: SubBatches) -> None:
        if index == batches.half:
            grads = self.layout.grads()
            if self._half is None:
                self._half = [g.detach().clone() for g in grads]
            else:
                torch._foreach_copy_(self._half, grads)
            self._taken = True

    def read(
        self,
        grads: list[Tensor],
        sq_full: Tensor,
        signal: Tensor,
        trace: Tensor,
        batches: SubBatches,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if not self._taken or self._half is None:
            raise RuntimeError("the half-way micro-batch was never announced (before_backward)")
        sq_a = self.layout.per_group(norms(self._half), square=True)
        dot_a_full = self.layout.per_group(dots(self._half, grads))
        # .grad = a + b: |b|² = |g|² - 2<a, g> + |a|², <a, b> = <a, g> - |a|²
        return sq_a, sq_full - 2 * dot_a_full + sq_a, dot_a_full - sq_a

    def traffic(self) -> int:
        return 0

    def memory(self) -> int:
        return _bytes(self._half or [])


class SplitRanks:
    """Ranks ``[0, W // 2)`` against the rest, measured in the DDP comm hook."""

    def __init__(self, layout: ParamLayout, world: World) -> None:
        #: the comm hook's state: register it (``bigbatch.dist.ddp.register`` does)
        self.hook_state = TwoGroupCosine(layout.groups, world.group)

    def begin(self, batches: SubBatches) -> None:
        self.hook_state.reset()

    def before_backward(self, index: int, batches: SubBatches) -> None:
        pass

    def read(
        self,
        grads: list[Tensor],
        sq_full: Tensor,
        signal: Tensor,
        trace: Tensor,
        batches: SubBatches,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.hook_state.read()

    def traffic(self) -> int:
        return self.hook_state.traffic()

    def memory(self) -> int:
        return 0


class FromNoiseScalars:
    """The halves' expected terms from the step's noise estimates (both halves of every group)."""

    def __init__(self, dataset_size: int | None) -> None:
        self.dataset_size = dataset_size

    def begin(self, batches: SubBatches) -> None:
        pass

    def before_backward(self, index: int, batches: SubBatches) -> None:
        pass

    def read(
        self,
        grads: list[Tensor],
        sq_full: Tensor,
        signal: Tensor,
        trace: Tensor,
        batches: SubBatches,
    ) -> tuple[Tensor, Tensor, Tensor]:
        size_a = sum(batches.half_sizes())
        if not 0 < size_a < batches.total:  # one micro-batch (per-example norms): its halves
            size_a = batches.total / 2
        return scalar_halves(signal, trace, size_a, batches.total - size_a, self.dataset_size)

    def traffic(self) -> int:
        return 0

    def memory(self) -> int:
        return 0


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

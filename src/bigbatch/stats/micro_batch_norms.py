"""The squared norm of each micro-batch's mean gradient, taken in a hook before it
reaches ``.grad`` (the other source of the same sum:
:class:`~bigbatch.stats.per_example.PerExampleNorms`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._tensors import norms
from .estimators import inverse_size, population
from .layout import ParamLayout, SubBatches
from .noise import SmallNorms


class MicroBatchNorms:
    """``Σ_i |g_i|²`` per parameter group over a step's micro-batches ``i``."""

    def __init__(
        self,
        layout: ParamLayout,
        current: Callable[[], SubBatches | None],
        dataset_size: int | None = None,
    ) -> None:
        self.layout, self.dataset_size = layout, dataset_size
        self._current = current
        self._sub_sq: Tensor | None = None  # (micro-batches, groups): |g_i|² / l_i²
        self.handles = [
            torch.autograd.graph.register_multi_grad_hook(
                layout.hooked, self._on_gradients, mode="all"
            )
        ]

    def begin(self, batches: SubBatches) -> None:
        """Start a step of these sub-batches: no norms yet."""
        self._sub_sq = torch.zeros(
            len(batches.sizes), self.layout.num_groups, device=self.layout.device,
            dtype=torch.float64,
        )  # fmt: skip

    def next_micro_batch(self) -> None:
        pass

    def finish(self, batches: SubBatches) -> SmallNorms:
        """The sum over this rank's micro-batches, per group (float64); ends the step."""
        sub_sq, self._sub_sq = self._sub_sq, None
        if sub_sq is None:
            raise RuntimeError("micro-batch norms: finish() without begin()")
        sizes = batches.all_sizes
        drawn_from = population(self.dataset_size, batches.total)
        h = sum(inverse_size(b, drawn_from) for b in sizes) / len(sizes)
        return SmallNorms(count=len(sizes), h=h, sums=sub_sq.sum(0))

    def _on_gradients(self, grads: Sequence[Tensor | None]) -> None:
        """Every parameter's increment of this backward, before it reaches ``.grad``."""
        batches, sub_sq = self._current(), self._sub_sq
        if batches is None or batches.current is None or sub_sq is None:
            return  # a backward outside a step (e.g. the user's own): not ours
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        index = batches.current
        sq = torch.stack([n.double() for n in norms([grads[i] for i in present])]).square()
        # |increment / l_i|²: the micro-batch's mean gradient (a Python scalar: no copy)
        sq = sq * (1.0 / batches.loss_weights[index] ** 2)
        sub_sq[index].index_add_(0, self.layout.owners(present), sq)

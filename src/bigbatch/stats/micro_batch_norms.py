"""The squared norm of each micro-batch's mean gradient, taken in a hook before it
reaches ``.grad`` (the other source of the same sum: ``per_example.PerExampleNorms``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

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
        self._pending: list[tuple[int, Tensor]] = []  # this backward's increments so far
        # one hook a tensor and a callback at the backward's end, not torch's
        # register_multi_grad_hook: its "all" mode asks the engine which hooks will run,
        # which torch refuses inside torch.autograd.grad (a user's own, outside any step)
        self.handles = [
            p.register_hook(functools.partial(self._on_gradient, i))
            for i, p in enumerate(layout.hooked)
        ]

    def begin(self, batches: SubBatches) -> None:
        """Start a step of these sub-batches: no norms yet."""
        self._pending = []  # (left by a backward that raised)
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

    def _on_gradient(self, index: int, grad: Tensor) -> None:
        """One parameter's increment of this backward, before it reaches ``.grad``."""
        batches = self._current()
        if batches is None or batches.current is None or self._sub_sq is None:
            return  # a backward outside a step (e.g. the user's own): not ours
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self._pending.append((index, grad))

    def _on_backward_end(self) -> None:
        """Every increment of the backward that just ended, as one micro-batch's norms."""
        pending, self._pending = sorted(self._pending, key=lambda p: p[0]), []
        batches, sub_sq = self._current(), self._sub_sq
        if not pending or batches is None or batches.current is None or sub_sq is None:
            return
        index = batches.current
        present = [i for i, _ in pending]
        sq = torch.stack([n.double() for n in norms([g for _, g in pending])]).square()
        # |increment / l_i|²: the micro-batch's mean gradient (a Python scalar: no copy)
        sq = sq * (1.0 / batches.loss_weights[index] ** 2)
        sub_sq[index].index_add_(0, self.layout.owners(present), sq)

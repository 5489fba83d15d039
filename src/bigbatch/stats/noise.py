"""``(|G|², tr Σ)`` per group from the step's sub-batch norms, two ways; one is chosen once.

- :class:`ReducedNoise`: the sub-batches are every rank's micro-batches;
  their summed squared norms and ``|g|²`` of the reduced gradient (and the
  loss) travel in one all-reduce of ``2 G + 1`` float64 under DDP or FSDP2
  (where ``|g|²`` is the sum of the ranks' shards'; nothing on one process),
  so every rank decides from bitwise identical numbers.
- :class:`PerRankNoise`: the reduced gradient is not the exact mean (a lossy
  comm hook, e.g. compression): each rank estimates from its own
  micro-batches and the uncompressed ``|g|²`` of its local mean (taken in a
  tensor hook at its last micro-batch, before DDP reduces), and the
  estimates are averaged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from .._tensors import norms
from ..dist.world import World
from .estimators import ema_update, noise_from_examples, noise_from_mean
from .layout import ParamLayout, SubBatches


class ReducedNoise:
    """Noise estimates from all sub-batches and the reduced ``.grad``."""

    def __init__(self, world: World, dataset_size: int | None) -> None:
        self.world, self.dataset_size = world, dataset_size
        self.bytes = 0
        self.handles: list = []

    def begin(self, batches: SubBatches) -> None:
        pass

    def reduce(
        self,
        sub_sq_sum: Tensor,
        sq_full: Tensor,
        loss: Tensor,
        scale_sq: Tensor | float,
        batches: SubBatches,
        examples: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(|G|², trΣ, loss)`` per group from ``sub_sq_sum``, the sum of the squared norms
        of this rank's sub-batch mean gradients (with ``examples``, of the gradients of
        the examples measured, that many on all ranks), and ``sq_full``, the reduced
        gradient's."""
        groups = len(sq_full)
        if self.world.distributed:
            size = self.world.size
            # DDP: every rank holds the whole reduced gradient (average the equal values);
            # FSDP2: each holds a shard (sum the shards' squared norms)
            sq_part = sq_full if self.world.sharded else sq_full / size
            packed = torch.cat([sub_sq_sum, sq_part, (loss / size)[None]])
            self.world.all_reduce_sum(packed)
            self.bytes += packed.numel() * packed.element_size()
            sub_sq_sum, sq_full, loss = packed[:groups], packed[groups:-1], packed[-1]
        if examples:  # every sub-batch one example
            signal, trace = noise_from_examples(
                sub_sq_sum / examples, batches.total, sq_full / scale_sq, self.dataset_size
            )
            return signal, trace, loss
        sizes = batches.all_sizes
        signal, trace = noise_from_mean(
            sub_sq_sum / len(sizes), sizes, sq_full / scale_sq, self.dataset_size
        )
        return signal, trace, loss

    def traffic(self) -> int:
        return self.bytes


class PerRankNoise:
    """Each rank's own estimate, averaged: for a reduction that is not exact."""

    def __init__(
        self,
        layout: ParamLayout,
        current: Callable[[], SubBatches | None],
        world: World,
        dataset_size: int | None,
        grad_accumulates: bool = True,
    ) -> None:
        self.layout, self._current = layout, current
        self.world, self.dataset_size = world, dataset_size
        self.grad_accumulates = grad_accumulates
        self.bytes = 0
        self._local_sq: Tensor | None = None  # |this rank's accumulated gradient|² per group
        # this rank's earlier micro-batches, where .grad does not keep them (ZeRO-2 reduces
        # and frees each micro-batch's gradient): dropped at the step's last micro-batch
        self._sums: dict[int, Tensor] = {}
        self.handles = [
            p.register_hook(functools.partial(self._local_total, i))
            for i, p in enumerate(layout.params)
        ]

    def begin(self, batches: SubBatches) -> None:
        if len(batches.sizes) < 2:
            raise ValueError(
                "with a lossy comm hook the noise is estimated within each rank: every rank "
                f"needs 2+ micro-batches, got sizes {batches.sizes} (raise min_sub_batches)"
            )
        self._local_sq = torch.zeros(
            self.layout.num_groups, device=self.layout.device, dtype=torch.float64
        )
        self._sums = {}

    def _local_total(self, param_index: int, increment: Tensor) -> None:
        """At the last micro-batch: ``|earlier + increment|²``, this rank's accumulated gradient.

        A tensor hook fires before its own increment is added, so ``.grad``
        holds the earlier micro-batches (accumulated under ``no_sync``), or,
        where ``.grad`` does not accumulate, this part's own sum does.
        """
        batches = self._current()
        if batches is None or self._local_sq is None:
            return
        earlier = (
            self.layout.params[param_index].grad
            if self.grad_accumulates
            else self._sums.get(param_index)
        )
        if not batches.last:
            if not self.grad_accumulates:
                self._sums[param_index] = (
                    increment.detach().clone() if earlier is None else earlier.add_(increment)
                )
            return
        total = increment if earlier is None else earlier + increment
        self._local_sq[self.layout.group_of(param_index)] += norms([total])[0].double().square()
        self._sums.pop(param_index, None)

    def reduce(
        self,
        sub_sq_sum: Tensor,
        sq_full: Tensor,
        loss: Tensor,
        scale_sq: Tensor | float,
        batches: SubBatches,
    ) -> tuple[Tensor, Tensor, Tensor]:
        assert self._local_sq is not None
        groups = len(sq_full)
        # the rank's local mean: its accumulated gradient over its summed loss weights
        local_sq = self._local_sq / sum(batches.loss_weights) ** 2 / scale_sq
        signal, trace = noise_from_mean(
            sub_sq_sum / len(batches.sizes), batches.sizes, local_sq, self.dataset_size
        )
        packed = torch.cat([signal, trace, loss[None]]) / self.world.size
        self.world.all_reduce_sum(packed)
        self.bytes += packed.numel() * packed.element_size()
        return packed[:groups], packed[groups:-1], packed[-1]

    def traffic(self) -> int:
        return self.bytes


class NoiseAverages:
    """Bias-corrected moving averages of ``|G|²`` and ``tr Σ``, apart (gpt-neox, β 0.99).

    The noise scale is the ratio of the two averages, never an average of
    ratios; a non-finite step's estimates are skipped without a host read.
    """

    def __init__(self, beta: float, device: torch.device) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"ema_beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self._signal = torch.zeros((), device=device, dtype=torch.float64)
        self._trace = torch.zeros((), device=device, dtype=torch.float64)
        self._steps = 0

    def update(self, signal: Tensor, trace: Tensor) -> tuple[Tensor, Tensor]:
        """Add one step's estimates; the corrected averages ``(|G|², tr Σ)``."""
        ema_update(self._signal, signal, self.beta)
        ema_update(self._trace, trace, self.beta)
        self._steps += 1
        correction = 1 - self.beta**self._steps
        return self._signal / correction, self._trace / correction

    def state_dict(self) -> dict[str, object]:
        return {
            "signal_ema": self._signal.clone(),
            "trace_ema": self._trace.clone(),
            "ema_steps": self._steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._signal.copy_(state["signal_ema"])  # type: ignore[arg-type]
        self._trace.copy_(state["trace_ema"])  # type: ignore[arg-type]
        self._steps = int(state["ema_steps"])  # type: ignore[call-overload]

"""``(|G|², tr Σ)`` per group from the step's small-batch norms: :class:`ReducedNoise`
from every rank's (one all-reduce of ``2 G + 1`` float64), or :class:`PerRankNoise`,
each rank's own estimate averaged, for a lossy reduction."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._tensors import norms
from ..batch.plan import loss_weights as default_loss_weights
from ..parallel.world import World
from .estimators import inverse_size, noise_from_mean, population, unbiased
from .layout import ParamLayout, SubBatches
from .result import Gather


@dataclass
class SmallNorms:
    """The step's small-batch gradient norms: ``sums`` (a device vector of ``Σ |g_b|²`` per
    group) or ``norms`` (device scalars summed into ``groups`` on the host), over
    ``count`` small batches with mean variance factor ``h``."""

    count: int
    h: float
    factor: float = 1.0
    sums: Tensor | None = None
    norms: Sequence[Tensor] = ()
    groups: Sequence[int] = ()


def _group_sums(squares: Sequence[float], groups: Sequence[int], num_groups: int) -> list[float]:
    out = [0.0] * num_groups
    for value, group in zip(squares, groups):
        out[group] += value
    return out


class ReducedNoise:
    """Noise estimates from all small batches and the reduced ``.grad``."""

    def __init__(self, layout: ParamLayout, world: World, dataset_size: int | None) -> None:
        self.layout, self.world, self.dataset_size = layout, world, dataset_size
        self.bytes = 0
        self.handles: list = []
        self._owners: dict[tuple[int, ...], Tensor] = {}

    def begin(self, batches: SubBatches) -> None:
        pass

    def gather(
        self,
        into: Gather,
        grad_norms: Sequence[Tensor],
        small: SmallNorms,
        loss: Tensor,
    ) -> None:
        """Put this rank's numbers into the read (summed over the ranks under DDP or FSDP2)."""
        if not self.world.distributed:
            into.scalars("loss", [loss])
            into.scalars("grad", grad_norms)
            if small.sums is not None:
                into.vector("small", small.sums)
            else:
                into.scalars("small", small.norms)
            return
        size, groups = self.world.size, self.layout.num_groups
        sq_full = self.layout.per_group(torch.stack(list(grad_norms)), square=True)
        # DDP: every rank holds the whole reduced gradient (average the equal values);
        # FSDP2: each holds a shard (sum the shards' squared norms)
        sq_part = sq_full if self.world.sharded else sq_full / size
        sums = small.sums if small.sums is not None else self._sum_norms(small)
        packed = torch.cat([sums, sq_part, (loss.double() / size).reshape(1)])
        self.world.all_reduce_sum(packed)
        self.bytes += packed.numel() * packed.element_size()
        into.vector("reduced", packed)
        assert len(packed) == 2 * groups + 1

    def _sum_norms(self, small: SmallNorms) -> Tensor:
        """The squared norms summed per group on the device (for the all-reduce)."""
        key = tuple(small.groups)
        owners = self._owners.get(key)
        if owners is None:
            owners = self._owners[key] = torch.tensor(key, device=self.layout.device)
        squares = torch.stack(list(small.norms)).double().square()
        out = torch.zeros(self.layout.num_groups, dtype=torch.float64, device=squares.device)
        return out.index_add_(0, owners, squares)

    def estimate(
        self, read: dict[str, list[float]], small: SmallNorms, batches: SubBatches, scale_sq: float
    ) -> tuple[list[float], list[float], float, list[float]]:
        """``(|G|², trΣ, loss, |g|² before unscaling)``, the first two per group."""
        groups = self.layout.num_groups
        if "reduced" in read:
            packed = read["reduced"]
            sums, sq_full, loss = packed[:groups], packed[groups:-1], packed[-1]
        else:
            loss = read["loss"][0]
            sq_full = _group_sums([v * v for v in read["grad"]], self.layout.owner_list, groups)
            if small.sums is not None:
                sums = read["small"]
            else:
                sums = _group_sums([v * v for v in read["small"]], small.groups, groups)
        phi, weighing = _weighed(batches, population(self.dataset_size, batches.total))
        if small.h - phi <= 0:
            raise ValueError(
                f"small batches of mean inverse size {small.h:.4g} in a batch of "
                f"{batches.total} carry no noise information (dataset_size={self.dataset_size})"
            )
        signal, trace = [], []
        for s, full in zip(sums, sq_full):
            mean_small = s * small.factor / small.count / scale_sq
            g, t = unbiased(mean_small, full / scale_sq / weighing, small.h, phi)
            signal.append(g)
            trace.append(t)
        return signal, trace, loss, list(sq_full)

    def traffic(self) -> int:
        return self.bytes


def _weighed(batches: SubBatches, drawn_from: int | None) -> tuple[float, float]:
    """``φ`` of the reduced gradient and ``(Σ w)²`` (docs/algorithms.md, "Gradient statistics")."""
    sizes, weights = batches.sizes, batches.loss_weights
    if batches.world.size > 1 or weights == default_loss_weights(sizes, batches.total):
        return inverse_size(batches.total, drawn_from), 1.0
    total = sum(weights)
    shares = [w / total for w in weights]
    squared = sum(a * a for a in shares)
    phi = sum(a * a * inverse_size(b, drawn_from) for a, b in zip(shares, sizes, strict=True))
    if drawn_from is not None and drawn_from > 1:  # disjoint parts of one draw covary
        phi -= (1 - squared) / (drawn_from - 1)
    return phi, total * total


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
        """At the last micro-batch: ``|earlier + increment|²``, this rank's accumulated gradient
        (a tensor hook fires before its increment reaches ``.grad``)."""
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

    def gather(
        self,
        into: Gather,
        grad_norms: Sequence[Tensor],
        small: SmallNorms,
        loss: Tensor,
        scale_sq: Tensor | float,
        batches: SubBatches,
    ) -> None:
        """This rank's estimate, averaged over the ranks (one all-reduce of ``2 G + 1``)."""
        assert self._local_sq is not None and small.sums is not None
        groups = self.layout.num_groups
        # the rank's local mean: its accumulated gradient over its summed loss weights
        local_sq = self._local_sq / sum(batches.loss_weights) ** 2 / scale_sq
        signal, trace = noise_from_mean(
            small.sums / len(batches.sizes) / scale_sq, batches.sizes, local_sq, self.dataset_size
        )
        packed = torch.cat([signal, trace, loss.double().reshape(1)]) / self.world.size
        self.world.all_reduce_sum(packed)
        self.bytes += packed.numel() * packed.element_size()
        into.vector("rank_estimates", packed)
        assert len(packed) == 2 * groups + 1

    def estimate(
        self, read: dict[str, list[float]], small: SmallNorms, batches: SubBatches, scale_sq: float
    ) -> tuple[list[float], list[float], float, list[float]]:
        packed, groups = read["rank_estimates"], self.layout.num_groups
        return packed[:groups], packed[groups:-1], packed[-1], []

    def traffic(self) -> int:
        return self.bytes


class NoiseAverages:
    """Bias-corrected moving averages of ``|G|²`` and ``tr Σ``, apart, on the host;
    non-finite estimates are skipped."""

    def __init__(self, beta: float) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"ema_beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self._signal = self._trace = 0.0
        self._steps = 0

    def update(self, signal: float, trace: float) -> tuple[float, float]:
        """Add one step's estimates; the corrected averages ``(|G|², tr Σ)``."""
        if math.isfinite(signal):
            self._signal = self.beta * self._signal + (1 - self.beta) * signal
        if math.isfinite(trace):
            self._trace = self.beta * self._trace + (1 - self.beta) * trace
        self._steps += 1
        return self.current()

    def current(self) -> tuple[float, float]:
        """The corrected averages ``(|G|², tr Σ)`` as they stand (0 before any step)."""
        correction = 1 - self.beta**self._steps
        if correction == 0:
            return 0.0, 0.0
        return self._signal / correction, self._trace / correction

    def state_dict(self) -> dict[str, object]:
        return {"signal_ema": self._signal, "trace_ema": self._trace, "ema_steps": self._steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._signal = float(state["signal_ema"])  # type: ignore[arg-type]
        self._trace = float(state["trace_ema"])  # type: ignore[arg-type]
        self._steps = int(state["ema_steps"])  # type: ignore[call-overload]

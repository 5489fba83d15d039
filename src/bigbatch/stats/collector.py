"""Gradient statistics from the sub-batches of one optimizer step (docs/algorithms.md,
"Gradient statistics"). Nothing moves between host and device during a step:
everything is read at once in :meth:`MicroBatchStatistics.finish`, the step's one
synchronisation. Around an accumulation loop (``bigbatch.AdaptiveBatch`` does this)::

    stats = MicroBatchStatistics(optimizer.param_groups)
    stats.begin(sizes)                      # sizes of this step's micro-batches
    for i, (x, y) in enumerate(micro_batches):
        stats.before_backward(i)
        (loss_fn(model(x), y) * sizes[i] / sum(sizes)).backward()
    result = stats.finish()                 # before optimizer.step(): GradientStats
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .._checks import check_flag, choice, positive_int
from .._tensors import norms
from ..batch.plan import loss_weights as default_loss_weights
from ..parallel.world import World
from .estimators import half_split_cosine
from .gsnr import ShiftedGSNR, WelfordGSNR
from .halves import (
    SIMILARITY_MODES,
    FromNoiseScalars,
    SplitMicroBatches,
    SplitRanks,
    warn_unequal_halves,
)
from .layout import ParamLayout, SubBatches
from .micro_batch_norms import MicroBatchNorms
from .noise import NoiseAverages, PerRankNoise, ReducedNoise, SmallNorms
from .per_example import UNITS, PerExampleNorms
from .result import Gather, GradientStats, PendingStats

__all__ = ["SIMILARITY_MODES", "GradientStats", "MicroBatchStatistics"]


class MicroBatchStatistics:
    """Collects :class:`GradientStats` over the micro-batches of each step.

    Micro-batch losses must be weighted by ``W b_i / B`` (``bigbatch.batch.loss_weights``)
    or the weights passed to :meth:`begin`. Under DDP :meth:`finish` is a collective.

    Args:
        param_groups: lists of parameters (or param-group dicts).
        ema_beta: smoothing of |G|² and tr Σ for the noise scale.
        gsnr: also collect the element-wise gradient signal-to-noise ratio.
        dataset_size: samples drawn without replacement (the finite-population correction).
        similarity: ``"split"`` (measured; under DDP through ``two_groups``, which the
            caller registers) or ``"scalar"``; default ``"split"`` on one process.
        world: the data-parallel world (``bigbatch.parallel.World.of(ddp_model)``).
        lossy_reduction: a lossy comm hook reduces: average per-rank estimates.
        grad_sources: under FSDP2, the unsharded tensors by parameter ``id``.
        per_example: the trained module, for norms of units of examples
            (:mod:`~bigbatch.stats.per_example`).
        per_example_units: the most units per micro-batch (None: every example).
        grad_accumulates: ``.grad`` keeps this rank's earlier micro-batches.
    """

    def __init__(  # noqa: PLR0913 - where the gradients come from, each a keyword
        self,
        param_groups: Sequence[Sequence[Tensor] | dict],
        *,
        ema_beta: float = 0.99,
        gsnr: bool = False,
        dataset_size: int | None = None,
        similarity: str | None = None,
        world: World | None = None,
        lossy_reduction: bool = False,
        grad_sources: dict[int, Tensor] | None = None,
        grad_accumulates: bool = True,
        per_example: nn.Module | None = None,
        per_example_units: int | None = UNITS,
    ) -> None:
        gsnr = check_flag("gsnr", gsnr)
        lossy_reduction = check_flag("lossy_reduction", lossy_reduction)
        if dataset_size is not None:
            dataset_size = positive_int("dataset_size", dataset_size)
        if per_example_units is not None:
            per_example_units = positive_int("per_example_units", per_example_units)
        if per_example is not None and not isinstance(per_example, nn.Module):
            raise TypeError(f"per_example must be the trained nn.Module, got {per_example!r}")
        self.world = world if world is not None else World()
        scalar = self.world.distributed or self.world.sharded or per_example is not None
        self.similarity = choice(
            "similarity", similarity or ("scalar" if scalar else "split"), SIMILARITY_MODES
        )
        _check_sources(self.world, self.similarity, per_example, lossy_reduction, gsnr,
                       grad_accumulates)  # fmt: skip
        self.gsnr = gsnr
        self.dataset_size = dataset_size
        self.layout = ParamLayout(param_groups, grad_sources)
        # on one process the rank's own estimate is the estimate, unless only it sees the sum
        self.lossy_reduction = lossy_reduction and (self.world.distributed or not grad_accumulates)
        self._batches: SubBatches | None = None
        current = self._current_batches
        # the three parts, each chosen once
        self.halves = _halves(self.similarity, self.layout, self.world, dataset_size)
        self.noise = (
            PerRankNoise(self.layout, current, self.world, dataset_size, grad_accumulates)
            if self.lossy_reduction
            else ReducedNoise(self.layout, self.world, dataset_size)
        )
        self.gsnr_part = _gsnr_part(self.layout, current, self.world) if gsnr else None
        self.averages = NoiseAverages(ema_beta)
        self._traffic_before = 0  # bytes counted before a resume (the parts count since)
        #: the per-example norms, where they replace the micro-batches'
        self.per_example = (
            PerExampleNorms(per_example, self.layout, per_example_units, dataset_size)
            if per_example is not None
            else None
        )
        #: where the small-batch norms come from: units of examples, or micro-batches
        self.small_norms = (
            self.per_example
            if self.per_example is not None
            else MicroBatchNorms(self.layout, current, dataset_size)
        )
        #: the last step's statistics, until they are read (read in order, for the averages)
        self._unread: PendingStats | None = None
        self._hooks = [
            *self.small_norms.handles,
            *self.noise.handles,
            *(self.gsnr_part.handles if self.gsnr_part is not None else []),
        ]

    @property
    def two_groups(self):
        """The two-group comm hook's state (split similarity under DDP), else None."""
        return self.halves.hook_state if isinstance(self.halves, SplitRanks) else None

    @property
    def half(self) -> int:
        """Micro-batches ``[0, half)`` form half A, the rest half B (one process)."""
        return self._batches.half if self._batches is not None else 0

    def _current_batches(self) -> SubBatches | None:
        return self._batches

    # ------------------------------------------------------------ step lifecycle

    def begin(
        self,
        sizes: Sequence[int],
        rank_sizes: Sequence[Sequence[int]] | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> None:
        """Start a step of micro-batches of these sizes (``rank_sizes``: every rank's);
        ``loss_weights``: this rank's loss factors (default ``W b_i / B``)."""
        self.layout.check_unchanged()
        batches = _sub_batches(
            sizes, rank_sizes, loss_weights, self.world, self.per_example is not None
        )
        self._batches = batches
        self.halves.begin(batches)
        self.noise.begin(batches)
        if self.gsnr_part is not None:
            self.gsnr_part.begin(batches)
        self.small_norms.begin(batches)

    def before_backward(self, index: int) -> None:
        """Announce that the next backward pass is micro-batch ``index``'s."""
        if self._batches is None:
            raise RuntimeError("call begin(sizes) before before_backward")
        self.halves.before_backward(index, self._batches)
        self._batches.current = index
        self.small_norms.next_micro_batch()

    def finish(
        self, loss_scale: Tensor | float | None = None, loss: Tensor | None = None
    ) -> GradientStats:
        """The step's statistics, read now (one host sync), after the last backward and before
        the optimizer step; ``loss``: this rank's weighted share of the batch loss."""
        return self.finish_pending(loss_scale, loss).read()

    def finish_pending(
        self, loss_scale: Tensor | float | None = None, loss: Tensor | None = None
    ) -> PendingStats:
        """:meth:`finish` without the read; the result's ``read()`` synchronises."""
        batches = self._batches
        if batches is None or batches.current is None:
            raise RuntimeError("finish() without a step: call begin() and before_backward()")
        if self._unread is not None:  # the averages take every step, in order
            self._unread.read()
        self._batches = None
        scale, host_scale = _loss_scale(loss_scale)
        grads = self.layout.grads()
        with torch.no_grad():
            into = Gather()
            grad_norms = _norms(grads)
            small = self.small_norms.finish(batches)
            loss_sum = loss if loss is not None else grad_norms[0].new_zeros(())
            if isinstance(self.noise, PerRankNoise):
                scale_sq = scale.double() ** 2 if scale is not None else host_scale**2
                self.noise.gather(into, grad_norms, small, loss_sum, scale_sq, batches)
            else:
                self.noise.gather(into, grad_norms, small, loss_sum)
            if scale is not None:
                into.scalars("scale", [scale])
            self.halves.gather(into, grads)
            gsnr = self.gsnr_part.finish(grads, batches) if self.gsnr_part is not None else None
            values = into.tensor()

        def decode(floats: list[float]) -> GradientStats:
            self._unread = None
            read = into.split(floats)
            scale_sq = read["scale"][0] ** 2 if "scale" in read else host_scale**2
            # a scaler that overflowed every step halves its scale to 0: nothing is measured
            scale_sq = scale_sq or math.nan
            stats = _estimate(self, read, scale_sq, small, batches)
            stats.gsnr, stats.loss = gsnr, stats.loss if loss is not None else None
            return stats

        self._unread = PendingStats(values, decode)
        return self._unread

    def provides(self) -> frozenset[str]:
        """What beyond the scalars this collector gathers (``"gsnr"``)."""
        return frozenset({"gsnr"}) if self.gsnr_part is not None else frozenset()

    def traffic(self) -> int:
        """Bytes the statistics added to the ranks' collectives so far (0 on one process)."""
        return self._traffic_before + self._parts_traffic()

    def _parts_traffic(self) -> int:
        # what the parts counted in this process
        parts = (self.noise, self.halves, self.gsnr_part)
        return sum(p.traffic() for p in parts if p is not None)

    def memory(self) -> int:
        """Bytes of the gradient-sized buffers the statistics keep (0 in scalar mode)."""
        parts = (self.halves, self.gsnr_part)
        return sum(p.memory() for p in parts if p is not None)

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, object]:
        own = self.gsnr_part.state_dict() if self.gsnr_part is not None else {}
        return {**self.averages.state_dict(), "traffic": self.traffic(), **own}

    def load_state_dict(self, state: dict[str, object]) -> None:
        # a step under way, or one not yet read, is abandoned: it must not join the averages
        self._batches = self._unread = None
        self.averages.load_state_dict(state)
        if self.gsnr_part is not None:
            self.gsnr_part.load_state_dict(state)
        saved = int(state["traffic"])  # type: ignore[call-overload]
        self._traffic_before = saved - self._parts_traffic()


def _estimate(
    collector: MicroBatchStatistics,
    read: dict[str, list[float]],
    scale_sq: float,
    small: SmallNorms,
    batches: SubBatches,
) -> GradientStats:
    """A step's statistics from the floats read, on the host (the averages take the step)."""
    signal_g, trace_g, loss, sq_full = collector.noise.estimate(read, small, batches, scale_sq)
    signal, trace = math.fsum(signal_g), math.fsum(trace_g)
    sq_a, sq_b, dot_ab = collector.halves.read(read, sq_full, signal_g, trace_g, batches)
    # a step the loop skips as non-finite (|G|² or the loss) never reaches the averages, nor
    # one whose tr Σ is not finite (the two averages share one count for their corrections)
    if math.isfinite(signal + trace + loss):
        signal_ema, trace_ema = collector.averages.update(signal, trace)
    else:
        signal_ema, trace_ema = collector.averages.current()
    return GradientStats(
        similarity=half_split_cosine(math.fsum(sq_a), math.fsum(sq_b), math.fsum(dot_ab)),
        group_similarity=[half_split_cosine(*t) for t in zip(sq_a, sq_b, dot_ab)],
        grad_sq_norm=signal,
        trace=trace,
        noise_scale=_ratio(trace_ema, signal_ema),
        grad_sq_norm_ema=signal_ema,
        trace_ema=trace_ema,
        sizes=batches.all_sizes,
        loss=loss,
        group_halves=[list(sq_a), list(sq_b), list(dot_ab)],
    )


def _check_sources(
    world: World,
    similarity: str,
    per_example: nn.Module | None,
    lossy_reduction: bool,
    gsnr: bool,
    grad_accumulates: bool,
) -> None:
    """A ValueError naming the first combination of gradient sources that cannot work."""
    if per_example is not None and (lossy_reduction or gsnr):
        raise ValueError(
            "per-example statistics read the reduced gradient and the examples, not the "
            "micro-batches: not with a lossy comm hook, a framework's own reduction or gsnr"
        )
    if world.sharded and (similarity == "split" or lossy_reduction):
        raise ValueError(
            "under FSDP2 the similarity is the scalar one: similarity='split' and lossy "
            "comm hooks need a DDP model"
        )
    if not grad_accumulates and not lossy_reduction:
        raise ValueError(
            "grad_accumulates=False needs the rank-local noise estimate "
            "(lossy_reduction=True): no reduced gradient is kept either"
        )


def _halves(
    similarity: str, layout: ParamLayout, world: World, dataset_size: int | None
) -> FromNoiseScalars | SplitRanks | SplitMicroBatches:
    """What measures the halves' similarity: the scalars, two rank groups, or micro-batches."""
    if similarity == "scalar":
        return FromNoiseScalars(dataset_size)
    if world.distributed:
        if world.size % 2:  # the ranks cannot split in two equal halves
            a = world.size // 2
            warn_unequal_halves(
                f"{world.size} processes",
                f"{a} with {world.size - a}",
                "similarity='scalar' takes two equal halves",
            )
        return SplitRanks(layout, world)
    return SplitMicroBatches(layout)


def _gsnr_part(
    layout: ParamLayout, current: Callable[[], SubBatches | None], world: World
) -> ShiftedGSNR | WelfordGSNR:
    """The element-wise GSNR: shifted sums across ranks, Welford on one process."""
    if world.distributed or world.sharded:
        return ShiftedGSNR(layout, current, world)
    return WelfordGSNR(layout, current)


def _sub_batches(
    sizes: Sequence[int],
    rank_sizes: Sequence[Sequence[int]] | None,
    loss_weights: Sequence[float] | None,
    world: World,
    per_example: bool = False,
) -> SubBatches:
    """A step's sub-batches, checked."""
    local = [int(s) for s in sizes]
    every = [[int(s) for s in r] for r in rank_sizes] if rank_sizes is not None else [local]
    if len(every) != world.size:
        raise ValueError(f"rank_sizes has {len(every)} entries for {world.size} ranks")
    if every[world.rank] != local:
        raise ValueError(
            f"rank {world.rank}'s entry of rank_sizes {every[world.rank]} "
            f"differs from its sizes {local}"
        )
    if per_example:
        if sum(sum(r) for r in every) < 2:
            raise ValueError(f"statistics need at least 2 examples per step, got sizes {every}")
    elif sum(len(r) for r in every) < 2:
        raise ValueError(
            f"statistics need at least 2 sub-batches (at least 2 micro-batches on one "
            f"process), got sizes {every} (a batch counted in weight holds one sample "
            "where that sample outweighs it)"
        )
    total = sum(sum(r) for r in every)
    if loss_weights is None:
        loss_weights = default_loss_weights(local, total, world.size)
    if len(loss_weights) != len(local) or not all(w > 0 for w in loss_weights):
        raise ValueError(
            f"loss_weights must be {len(local)} positive numbers, got {list(loss_weights)}"
        )
    return SubBatches(local, every, [float(w) for w in loss_weights], world)


def _loss_scale(scale: Tensor | float | None) -> tuple[Tensor | None, float]:
    """The loss scale: a tensor (read with the rest of the step), or a number (1 for none)."""
    if scale is None:
        return None, 1.0
    if isinstance(scale, Tensor):
        return scale.detach().reshape(()), 1.0
    if not math.isfinite(float(scale)) or float(scale) <= 0:
        raise ValueError(f"loss_scale must be a positive finite number, got {scale!r}")
    return None, float(scale)


def _norms(grads: list[Tensor]) -> list[Tensor]:
    """Each gradient's L2 norm, one fused call per accumulation dtype, in order."""
    return norms(grads)


def _ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, NaN (not an error) where it is undefined."""
    try:
        return numerator / denominator
    except ZeroDivisionError:
        return math.nan

"""How a global batch becomes micro-batches: one contiguous shard per rank, each cut
into the same number of nearly equal micro-batches; and how their losses are weighted."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._checks import choice, positive_int, rank_in_world

LOSS_REDUCTIONS = ("mean", "sum")
#: the default largest micro-batch (per process) of every loop and of ``bigbatch train``:
#: one forward/backward of a small model's whole batch up to 1,024 samples, which a GPU runs
#: fastest; set it to what fits in memory for a larger model (on a CPU, 256 can be faster)
MAX_MICRO_BATCH = 1024


def loss_weights(
    sizes: Sequence[int], batch_size: int, world_size: int = 1, reduction: str = "mean"
) -> list[float]:
    """The factor each micro-batch's loss is multiplied by before backward: ``W b_i / B``
    for a mean loss (``W / B`` for a sum), so ``.grad`` ends as the batch's
    sample-weighted mean after DDP averages over the ``W`` ranks."""
    choice("loss_reduction", reduction, LOSS_REDUCTIONS)
    if reduction == "sum":
        return [world_size / batch_size] * len(sizes)
    return [world_size * b / batch_size for b in sizes]


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: ``rank_sizes[r]``, rank ``r``'s micro-batch sizes (the same count
    on every rank), and this rank's ``micro_batches`` as indices."""

    rank_sizes: tuple[tuple[int, ...], ...]
    rank: int = 0
    micro_batches: tuple[tuple[int, ...], ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        """This rank's micro-batch sizes."""
        return self.rank_sizes[self.rank]

    @property
    def world_size(self) -> int:
        return len(self.rank_sizes)

    @property
    def batch_size(self) -> int:
        """The global batch: every rank's samples (or weight)."""
        return sum(sum(r) for r in self.rank_sizes)

    def loss_weights(self, reduction: str = "mean") -> list[float]:
        """This rank's :func:`loss_weights`."""
        return loss_weights(self.sizes, self.batch_size, self.world_size, reduction)


def shard_batch(indices: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous part of a global batch over ``world_size`` ranks (parts
    differ by at most one, the first ranks larger)."""
    rank, world_size = rank_in_world(rank, world_size)
    if len(indices) < world_size:
        raise ValueError(
            f"a batch of {len(indices)} samples cannot give each of {world_size} ranks a sample"
        )
    sizes = even_split(len(indices), world_size)
    start = sum(sizes[:rank])
    return indices[start : start + sizes[rank]]


def plan_step(
    indices: list[int],
    *,
    rank: int = 0,
    world_size: int = 1,
    count: int | None = None,
    max_micro_batch: int = sys.maxsize,
    min_sub_batches: int = 1,
    weight_fn: Callable[[int], int] | None = None,
    even: bool = False,
) -> StepPlan:
    """Shard a drawn global batch over the ranks and split every shard into micro-batches.

    ``count`` fixes the micro-batches per rank; without it, the largest natural count of
    any shard. A short shard may then exceed ``max_micro_batch`` by a sample. With
    ``weight_fn`` the sizes are weights.
    """
    rank, world_size = rank_in_world(rank, world_size)
    if count is not None:
        count = positive_int("count", count)
    if weight_fn is not None and len(indices) < world_size:  # a draw of a few heavy samples
        raise ValueError(
            f"a batch of {sum(int(weight_fn(i)) for i in indices)} in weight (weight_fn) drew "
            f"{len(indices)} samples, fewer than the {world_size} ranks that each need one: "
            "raise the controller's smallest batch (min), or train on fewer ranks"
        )
    shards = [shard_batch(indices, r, world_size) for r in range(world_size)]
    weights = [[int(weight_fn(i)) for i in s] for s in shards] if weight_fn else None
    if count is None:
        natural = max(
            len(
                micro_batch_sizes(
                    len(s), max_micro_batch=max_micro_batch, min_sub_batches=min_sub_batches
                )
            )
            if weights is None
            else len(  # a heavy draw may hold fewer samples than sub-batches wanted
                split_by_weight(
                    w, max_micro_batch=max_micro_batch, min_sub_batches=min(min_sub_batches, len(w))
                )
            )
            for s, w in zip(shards, weights or shards)
        )
        fewest = min(len(s) for s in shards)
        count = min(natural, fewest)
        if even and count % 2 and count < fewest:  # two halves of as many micro-batches
            count += 1
    rank_sizes, mine = [], ()
    for r, shard in enumerate(shards):
        if weights is None:
            counts = even_split(len(shard), count)
            sizes = counts
        else:
            # no cap: the count is fixed, the weights only place the boundaries
            counts = split_by_weight(weights[r], max_micro_batch=sys.maxsize, min_sub_batches=count)
            sizes = [sum(part) for part in _cut(weights[r], counts)]
        rank_sizes.append(tuple(sizes))
        if r == rank:
            mine = tuple(tuple(part) for part in _cut(shard, counts))
    return StepPlan(tuple(rank_sizes), rank, mine)


def _cut(items: Sequence, counts: Sequence[int]) -> list[Sequence]:
    out, start = [], 0
    for c in counts:
        out.append(items[start : start + c])
        start += c
    return out


def even_split(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total`` that differ by at most one (larger ones first)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def micro_batch_sizes(
    batch_size: int, *, max_micro_batch: int, min_sub_batches: int = 4
) -> list[int]:
    """Micro-batch sizes for ``batch_size``: nearly equal, each ≤ ``max_micro_batch``.

    >>> micro_batch_sizes(10, max_micro_batch=4, min_sub_batches=2)
    [4, 3, 3]
    """
    positive_int("batch_size", batch_size)
    positive_int("max_micro_batch", max_micro_batch)
    positive_int("min_sub_batches", min_sub_batches)
    if batch_size < min_sub_batches:
        raise ValueError(
            f"batch_size {batch_size} is smaller than min_sub_batches {min_sub_batches}: "
            "each sub-batch needs at least one sample"
        )
    count = max(min_sub_batches, math.ceil(batch_size / max_micro_batch))
    return even_split(batch_size, count)


def split_by_weight(
    weights: Sequence[int], *, max_micro_batch: int, min_sub_batches: int = 4
) -> list[int]:
    """Counts of consecutive samples per micro-batch of nearly equal weight, each at most
    ``max_micro_batch`` unless it is one sample heavier than that."""
    positive_int("max_micro_batch", max_micro_batch)
    n, total = len(weights), sum(weights)
    if n < min_sub_batches:
        raise ValueError(f"{n} samples cannot make {min_sub_batches} sub-batches (min_sub_batches)")
    cumulative = list(itertools.accumulate(weights))
    # the fewest parts of nearly equal weight that keep under the cap: equal-weight goals
    # can put two samples over it where their weights do not divide evenly
    count = min(n, max(min_sub_batches, math.ceil(total / max_micro_batch)))
    while True:
        counts = _equal_weight_counts(cumulative, count)
        parts = _cut(weights, counts)
        heavy = any(len(part) > 1 and sum(part) > max_micro_batch for part in parts)
        if not heavy or count == n:
            return counts
        count += 1


def _equal_weight_counts(cumulative: Sequence[int], count: int) -> list[int]:
    # `count` runs of consecutive samples, each boundary nearest its equal-weight goal
    n, total = len(cumulative), cumulative[-1]
    counts, start = [], 0
    for j in range(1, count):
        goal = total * j / count
        # the boundary after sample `end - 1`; leave at least one sample per remaining part
        end = start + 1
        while end < n - (count - j) and abs(cumulative[end] - goal) <= abs(
            cumulative[end - 1] - goal
        ):
            end += 1
        counts.append(end - start)
        start = end
    counts.append(n - start)
    return counts

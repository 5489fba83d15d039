"""The half-split terms ``(|g_A|², |g_B|², <g_A, g_B>)`` per group: measured on one process
(:class:`SplitMicroBatches`) or over two rank groups (:class:`SplitRanks`), or expected
from the noise scalars (:class:`FromNoiseScalars`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._tensors import dots, norms
from .._warn import warn_at_caller
from ..parallel.hooks import TwoGroupCosine
from ..parallel.world import World
from .estimators import scalar_halves
from .layout import ParamLayout, SubBatches
from .noise import _group_sums
from .result import Gather

#: per group: the three terms, each a list of floats
Halves = tuple[list[float], list[float], list[float]]

SIMILARITY_MODES = ("split", "scalar")


def warn_unequal_halves(split: str, compared: str, remedy: str) -> None:
    # the one wording for a split similarity whose halves cannot be equal
    warn_at_caller(
        f"similarity='split' on {split} compares {compared}: halves of unequal size, whose "
        "cosine reads lower than an even split's (SimiGrad's target then holds a larger "
        f"batch); {remedy}"
    )


class SplitMicroBatches:
    """Half A is the first ``k // 2`` micro-batches of the step, half B the rest."""

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self._half: list[Tensor] | None = None  # .grad after half A (allocated once)
        self._taken = False
        self._said_unequal = False

    def begin(self, batches: SubBatches) -> None:
        sizes = batches.sizes
        if len(sizes) < 2:
            raise ValueError(
                f"the split similarity needs at least 2 micro-batches, got sizes {sizes}"
            )
        if len(sizes) % 2 and not self._said_unequal:  # (said once: the count varies by step)
            self._said_unequal = True
            a = sum(sizes[: batches.half])
            warn_unequal_halves(
                f"{len(sizes)} micro-batches (sizes {list(sizes)})",
                f"{a} samples with {sum(sizes) - a}",
                "an even count (max_micro_batch, min_sub_batches) or similarity='scalar' takes "
                "equal halves",
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

    def gather(self, into: Gather, grads: list[Tensor]) -> None:
        if not self._taken or self._half is None:
            raise RuntimeError("the half-way micro-batch was never announced (before_backward)")
        into.scalars("half_norms", norms(self._half))
        into.scalars("half_dots", dots(self._half, grads))

    def read(
        self, read: dict[str, list[float]], sq_full: list[float], signal, trace, batches
    ) -> Halves:
        owners, groups = self.layout.owner_list, self.layout.num_groups
        sq_a = _group_sums([v * v for v in read["half_norms"]], owners, groups)
        dot_a_full = _group_sums(read["half_dots"], owners, groups)
        # .grad = a + b: |b|² = |g|² - 2<a, g> + |a|², <a, b> = <a, g> - |a|²
        return (
            sq_a,
            [f - 2 * d + a for f, d, a in zip(sq_full, dot_a_full, sq_a)],
            [d - a for d, a in zip(dot_a_full, sq_a)],
        )

    def traffic(self) -> int:
        return 0

    def memory(self) -> int:
        return _bytes(self._half or [])


class SplitRanks:
    """Ranks ``[0, W // 2)`` against the rest, measured in the DDP comm hook."""

    def __init__(self, layout: ParamLayout, world: World) -> None:
        #: the comm hook's state: register it (``bigbatch.parallel.ddp.register`` does)
        self.hook_state = TwoGroupCosine(layout.groups, world.group)

    def begin(self, batches: SubBatches) -> None:
        self.hook_state.reset()

    def before_backward(self, index: int, batches: SubBatches) -> None:
        pass

    def gather(self, into: Gather, grads: list[Tensor]) -> None:
        into.vector("halves", torch.stack(self.hook_state.read()).reshape(-1))

    def read(
        self, read: dict[str, list[float]], sq_full: list[float], signal, trace, batches
    ) -> Halves:
        values, groups = read["halves"], len(read["halves"]) // 3
        return values[:groups], values[groups : 2 * groups], values[2 * groups :]

    def traffic(self) -> int:
        return self.hook_state.traffic()

    def memory(self) -> int:
        return 0


class FromNoiseScalars:
    """The expected terms of two equal halves of the batch from the step's noise estimates."""

    def __init__(self, dataset_size: int | None) -> None:
        self.dataset_size = dataset_size

    def begin(self, batches: SubBatches) -> None:
        pass

    def before_backward(self, index: int, batches: SubBatches) -> None:
        pass

    def gather(self, into: Gather, grads: list[Tensor]) -> None:
        pass

    def read(
        self,
        read: dict[str, list[float]],
        sq_full: list[float],
        signal: list[float],
        trace: list[float],
        batches: SubBatches,
    ) -> Halves:
        # equal halves, however the step is laid out: the same similarity on any number of
        # processes or micro-batches (split by rank, 3 ranks made halves of 1/3 and 2/3)
        half = batches.total / 2
        terms = [scalar_halves(g, t, half, half, self.dataset_size) for g, t in zip(signal, trace)]
        return tuple([list(column) for column in zip(*terms)])  # type: ignore[return-value]

    def traffic(self) -> int:
        return 0

    def memory(self) -> int:
        return 0


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

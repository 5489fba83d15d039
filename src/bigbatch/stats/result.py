"""What one optimizer step's statistics hold, and how they come to the host in one read."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import Tensor

#: what a :class:`PendingStats` decodes its numbers to
Decoded = TypeVar("Decoded")

#: the scalar fields :meth:`GradientStats.as_floats` gives, in order
SCALARS = ("similarity", "grad_sq_norm", "trace", "noise_scale", "grad_sq_norm_ema", "trace_ema")


class Gather:
    """Device numbers for one step's single read, by named part, stacked into one tensor."""

    def __init__(self) -> None:
        self._scalars: list[Tensor] = []
        self._vectors: list[Tensor] = []
        self._spans: dict[str, tuple[bool, int, int]] = {}

    def scalars(self, name: str, values: Sequence[Tensor]) -> None:
        """Zero-dimensional tensors (of any float dtype)."""
        self._spans[name] = (True, len(self._scalars), len(values))
        self._scalars.extend(values)

    def vector(self, name: str, values: Tensor) -> None:
        """A one-dimensional tensor."""
        start = sum(len(v) for v in self._vectors)
        self._spans[name] = (False, start, len(values))
        self._vectors.append(values)

    def tensor(self) -> Tensor:
        """Everything as one vector, in the widest dtype given (scalars first)."""
        parts = [torch.stack(self._scalars)] if self._scalars else []
        parts.extend(self._vectors)
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # dtypes promoted

    def split(self, floats: Sequence[float]) -> dict[str, list[float]]:
        """The read floats, by part."""
        scalars = len(self._scalars)
        out = {}
        for name, (scalar, start, length) in self._spans.items():
            offset = start if scalar else scalars + start
            out[name] = list(floats[offset : offset + length])
        return out


@dataclass
class GradientStats:
    """What one optimizer step measured, as Python floats (``gsnr``: device tensors).

    ``similarity``: the cosine of the two halves' mean gradients (``group_similarity``:
    per group); ``grad_sq_norm`` (|G|²) and ``trace`` (tr Σ): this step's unbiased
    estimates; ``noise_scale``: ``B_simple`` of their moving averages; ``gsnr``: per
    parameter, ``mean² / variance`` of the sub-batch gradients. docs/algorithms.md,
    "Gradient statistics".
    """

    similarity: float
    group_similarity: list[float]
    grad_sq_norm: float
    trace: float
    noise_scale: float
    grad_sq_norm_ema: float
    trace_ema: float
    sizes: list[int]
    gsnr: list[Tensor] | None = field(default=None, repr=False)
    #: the batch's mean loss, when the caller passed its local share to ``finish``
    loss: float | None = None
    #: per group, ``(|g_A|², |g_B|², <g_A, g_B>)`` (measured, or their scalar estimates):
    #: the cosine of any set of groups is ``Σ dot / sqrt(Σ sq_a · Σ sq_b)`` over its
    #: columns (AGVM's module groups)
    group_halves: list[list[float]] | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return sum(self.sizes)

    def as_floats(self) -> dict[str, float]:
        """The scalar statistics, the per-group similarities and the loss, by name."""
        out = {name: getattr(self, name) for name in SCALARS}
        if self.loss is not None:
            out["loss"] = self.loss
        for i, s in enumerate(self.group_similarity):
            out[f"similarity/group{i}"] = s
        return out

    def host_group_halves(self) -> list[list[float]]:
        """``group_halves`` as three lists of floats."""
        return [list(row) for row in self.group_halves or []]


class PendingStats(Generic[Decoded]):
    """A step's numbers on the device: :meth:`read` brings them to the host in one transfer
    and decodes them; :meth:`start` begins it without waiting (pinned memory on a GPU)."""

    def __init__(self, values: Tensor, decode: Callable[[list[float]], Decoded]) -> None:
        self._values: Tensor | None = values
        self._decode = decode
        self._copy: Tensor | None = None
        self._event = None
        self._stats: Decoded | None = None
        self._floats: list[float] = []  # as read (for :attr:`finite`)

    @property
    def finite(self) -> bool:
        """After :meth:`read`: every number read was finite (as :meth:`nonfinite` says)."""
        return all(map(math.isfinite, self._floats))

    def nonfinite(self) -> Tensor:
        """1.0 where a number is NaN or infinite, else 0.0, on the device: a ``found_inf``."""
        if self._values is None:
            raise RuntimeError("the numbers were already read")
        # x * 0 is 0 for a finite x and NaN for a NaN or an infinity, and a sum of zeros
        # cannot overflow: every number is checked, as :attr:`finite` checks them on the host
        return self._values.mul(0).sum().to(torch.float32).nan_to_num_(1.0)

    def start(self) -> None:
        """Begin copying the numbers to the host (on a GPU: pinned memory, no wait)."""
        values = self._values
        if values is None or self._copy is not None or values.device.type != "cuda":
            return
        self._copy = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._copy.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        # on the copy's stream, the values' device's (the current device may be another GPU,
        # whose stream the event would wait on instead)
        self._event.record(torch.cuda.current_stream(values.device))

    def read(self) -> Decoded:
        """The decoded numbers (the first call waits for them and decodes them)."""
        if self._stats is None:
            if self._copy is not None:
                self._event.synchronize()
                floats = self._copy.tolist()
            else:
                floats = self._values.tolist()  # the one host synchronisation
            self._values = self._copy = self._event = None
            self._floats = floats
            self._stats = self._decode(floats)
        return self._stats

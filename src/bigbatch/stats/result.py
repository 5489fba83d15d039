"""What one optimizer step's statistics hold."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

#: the scalar fields :meth:`GradientStats.as_floats` reads, in order
SCALARS = ("similarity", "grad_sq_norm", "trace", "noise_scale", "grad_sq_norm_ema", "trace_ema")


@dataclass
class GradientStats:
    """What one optimizer step measured; tensors on the parameters' device.

    ``similarity`` is the cosine of the mean gradients of the two halves of the
    sub-batches (SimiGrad's signal); ``group_similarity`` the same per
    parameter group. ``grad_sq_norm`` (|G|²) and ``trace`` (tr Σ) are this
    step's unbiased estimates; ``noise_scale`` is ``B_simple = trΣ/|G|²`` from
    their exponential moving averages (numerator and denominator smoothed
    apart). ``gsnr`` (when collected) holds per parameter the element-wise
    ``mean² / variance`` of the sub-batch gradients. See ``docs/algorithms.md``.
    """

    similarity: Tensor
    group_similarity: Tensor
    grad_sq_norm: Tensor
    trace: Tensor
    noise_scale: Tensor
    grad_sq_norm_ema: Tensor
    trace_ema: Tensor
    sizes: list[int]
    gsnr: list[Tensor] | None = field(default=None, repr=False)
    #: the batch's mean loss, when the caller passed its local share to ``finish``
    loss: Tensor | None = None
    #: per group, ``(|g_A|², |g_B|², <g_A, g_B>)`` (measured, or their scalar
    #: estimates), shape ``(3, groups)``: the cosine of any set of groups
    #: is ``Σ dot / sqrt(Σ sq_a · Σ sq_b)`` over its columns (AGVM's module groups)
    group_halves: Tensor | None = field(default=None, repr=False)

    _host: tuple[dict[str, float], list[list[float]]] | None = field(
        default=None, init=False, repr=False
    )

    @property
    def batch_size(self) -> int:
        return sum(self.sizes)

    def as_floats(self) -> dict[str, float]:
        """The scalar statistics (and the loss) as Python floats.

        The first call reads them, the per-group similarities and the half
        terms in one device-to-host transfer (the step's one synchronisation);
        later calls and :meth:`host_group_halves` reuse it.
        """
        return dict(self._read()[0])

    def host_group_halves(self) -> list[list[float]]:
        """``group_halves`` as three lists of floats, from the same one read."""
        return [list(row) for row in self._read()[1]]

    def _read(self) -> tuple[dict[str, float], list[list[float]]]:
        if self._host is None:
            names = list(SCALARS) + (["loss"] if self.loss is not None else [])
            parts = [getattr(self, n).detach().reshape(1).float() for n in names]
            parts.append(self.group_similarity.detach().reshape(-1).float())
            if self.group_halves is not None:
                parts.append(self.group_halves.detach().reshape(-1).float())
            floats = torch.cat(parts).tolist()  # the one host synchronisation
            out = dict(zip(names, floats))
            groups = self.group_similarity.numel()
            rest = floats[len(names) :]
            for i, s in enumerate(rest[:groups]):
                out[f"similarity/group{i}"] = s
            halves = rest[groups:]
            rows = [halves[i * groups : (i + 1) * groups] for i in range(3)] if halves else []
            self._host = (out, rows)
        return self._host

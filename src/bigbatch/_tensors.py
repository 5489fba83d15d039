"""Small tensor helpers shared by the optimizers and the statistics."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["dots", "norm_dtype", "norms", "sq_norms"]


def norm_dtype(t: Tensor) -> torch.dtype:
    """The dtype norms of ``t`` are accumulated in: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


#: On the CPU a tensor of at least this many elements takes a BLAS dot of its own: torch's
#: norm kernel runs at a fraction of memory bandwidth there (1M floats: 202 us against a
#: dot's 125; 154 MB: 15 ms against 6.5). Smaller tensors share one ``_foreach_norm``,
#: where a dot each would cost more in dispatch than in arithmetic (the 30 tensors of the
#: ``lm`` task's transformer: 416 us as dots, 112 us as one call).
CPU_DOT_ELEMENTS = 1 << 16


def norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Per-tensor L2 norms in ``norm_dtype`` (float16 squares would overflow)."""
    dotted = _dotted(tensors)
    out: list[Tensor] = [torch.empty(0)] * len(tensors)
    for idx, fused in _fused_norms(tensors, dotted):
        for i, n in zip(idx, fused):
            out[i] = n
    for i in dotted:
        out[i] = _self_dot(tensors[i]).sqrt()
    return out


def sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Per-tensor squared L2 norms as one float64 vector (``norm_dtype`` accumulation), in
    as few kernels as the device allows: a large CPU tensor's is its dot with itself (no
    square root to undo), the others' the squares of one fused norm call per dtype."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    dotted = _dotted(tensors)
    groups = _fused_norms(tensors, dotted)
    if len(groups) == 1 and not dotted:  # one dtype, no large CPU tensor: already in order
        return torch.stack(groups[0][1]).double().square()
    out: list[Tensor] = [torch.empty(0)] * len(tensors)
    for idx, fused in groups:
        # unbind views the rows of one stacked result: no kernel per tensor, no index upload
        for i, value in zip(idx, torch.stack(fused).double().square().unbind(0)):
            out[i] = value
    for i in dotted:
        out[i] = _self_dot(tensors[i]).double()
    return torch.stack(out)


def _dotted(tensors: Sequence[Tensor]) -> list[int]:
    """The indices of the tensors whose norm is a dot of their own (``CPU_DOT_ELEMENTS``)."""
    return [
        i for i, t in enumerate(tensors) if t.device.type == "cpu" and t.numel() >= CPU_DOT_ELEMENTS
    ]


def _self_dot(t: Tensor) -> Tensor:
    flat = t.reshape(-1).to(norm_dtype(t))
    return torch.dot(flat, flat)


def _fused_norms(
    tensors: Sequence[Tensor], dotted: list[int]
) -> list[tuple[list[int], Sequence[Tensor]]]:
    """The norms of every tensor but the ``dotted`` ones, one ``_foreach_norm`` per
    accumulation dtype: (the tensors' indices, their norms) for each."""
    own_dot = set(dotted)
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if i not in own_dot:
            by_dtype[norm_dtype(t)].append(i)
    return [
        (idx, torch._foreach_norm([tensors[i] for i in idx], 2, dtype=dtype))
        for dtype, idx in by_dtype.items()
    ]


def dots(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    """Per-pair inner products ``<a_i, b_i>`` in ``norm_dtype``, without host sync."""
    out = []
    for x, y in zip(a, b):
        dtype = norm_dtype(x)
        out.append(torch.dot(x.reshape(-1).to(dtype), y.reshape(-1).to(dtype)))
    return out

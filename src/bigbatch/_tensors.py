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


def norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Per-tensor L2 norms in ``norm_dtype`` (float16 squares would overflow), one fused
    ``_foreach_norm`` per accumulation dtype (fewer dispatched operators)."""
    groups = _fused_norms(tensors)
    if len(groups) == 1:
        return list(groups[0][1])
    out: list[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
    for idx, fused in groups:
        for i, n in zip(idx, fused):
            out[i] = n
    return out


def sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Per-tensor squared L2 norms as one float64 vector (``norm_dtype`` accumulation)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(norms(tensors)).double().square()


def _fused_norms(tensors: Sequence[Tensor]) -> list[tuple[list[int], Sequence[Tensor]]]:
    """(indices, norms) per accumulation dtype, one ``_foreach_norm`` each."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[norm_dtype(t)].append(i)
    if len(by_dtype) == 1:
        (dtype,) = by_dtype
        return [(list(range(len(tensors))), torch._foreach_norm(list(tensors), 2, dtype=dtype))]
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

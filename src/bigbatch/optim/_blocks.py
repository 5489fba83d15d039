"""Cache blocking for multi-tensor updates on the CPU: the whole element-wise chain runs
on one cache-sized block at a time, so only the state is streamed
(docs/algorithms.md, "The memory floor of an optimizer step"). On CUDA, where
blocking only adds launches, ``block_elements`` is ``None`` (whole tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

#: Elements per block on the CPU (1 MB of float32): large enough that the
#: per-op overhead is amortised, small enough that a block's arrays stay in cache.
#: Chosen by ``benchmarks/optim_step.py --block-sweep`` (docs/results.md).
CPU_BLOCK_ELEMENTS = 1 << 18

Piece = tuple[int, int, int]  # (tensor index, first element, end element)


def block_elements(device: torch.device) -> int | None:
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else None


def plan(lists: Sequence[Sequence[Tensor]], size: int | None) -> list[list[Piece]]:
    """Split the tensors of parallel ``lists`` into blocks of at most ``size`` elements (a
    non-contiguous tensor stays whole; ``size=None``: whole tensors)."""
    first = lists[0]
    if size is None:
        return [[(i, 0, t.numel()) for i, t in enumerate(first)]]
    blocks: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for i, t in enumerate(first):
        n = t.numel()
        if not all(lst[i].is_contiguous() for lst in lists):
            blocks.append([(i, 0, n)])
            continue
        start = 0
        while start < n:
            stop = min(n, start + size - filled)
            current.append((i, start, stop))
            filled += stop - start
            start = stop
            if filled == size:
                blocks.append(current)
                current, filled = [], 0
    if current:
        blocks.append(current)
    return blocks


def take(tensors: Sequence[Tensor], block: list[Piece]) -> list[Tensor]:
    """Views of ``tensors`` for the pieces of one block."""
    out = []
    for i, start, stop in block:
        t = tensors[i]
        out.append(t if start == 0 and stop == t.numel() else t.view(-1)[start:stop])
    return out


def combine_norms(pieces: list[Piece], piece_norms: list[Tensor], count: int) -> Tensor:
    """Per-tensor L2 norms (shape ``(count,)``) from the norms of their pieces."""
    norms = torch.stack(piece_norms)
    owners = [i for i, _, _ in pieces]
    if owners == list(range(count)):  # one piece per tensor: nothing to sum
        return norms
    index = torch.tensor(owners, device=norms.device)
    return (
        torch.zeros(count, dtype=norms.dtype, device=norms.device)
        .index_add_(0, index, norms.square())
        .sqrt_()
    )

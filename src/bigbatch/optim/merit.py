"""MERIT: max-norm element-wise trust ratios (Luo et al., ICML 2025), as the authors'
code (docs/algorithms.md, "MERIT")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from . import _blocks
from ._base import BigBatchOptimizer, check_adam_group
from ._shards import Shards
from ._trust import trust_ratio

__all__ = ["MERIT", "merit_foreach", "merit_ratio", "merit_reference"]


def _max_abs(t: Tensor, dim: int | None = None) -> Tensor:
    """``|t|.amax(dim, keepdim=True)`` without materialising ``|t|`` (along a dim, ``amin``
    and ``amax`` apart are faster on the CPU than ``aminmax``)."""
    if dim is None:
        low, high = torch.aminmax(t)
    else:
        low, high = t.amin(dim, keepdim=True), t.amax(dim, keepdim=True)
    return torch.maximum(high, low.neg())


def merit_ratio(p: Tensor, u: Tensor) -> Tensor:
    """The element-wise trust ratio τ of weight ``p`` and update ``u`` (docs/algorithms.md,
    "MERIT"); 1 wherever a maximum is 0."""
    if p.ndim < 2:
        w, a = _max_abs(p), _max_abs(u)
        return trust_ratio(w, a, w / a)
    row_w, row_a = _max_abs(p, 1), _max_abs(u, 1)
    col_w, col_a = _max_abs(p, 0), _max_abs(u, 0)
    layer = row_w.amax() / row_a.amax()
    ratio = torch.maximum(torch.maximum(row_w / row_a, col_w / col_a), layer)
    degenerate = (row_w == 0) | (row_a == 0) | (col_w == 0) | (col_a == 0)
    return torch.where(degenerate, torch.ones_like(ratio), ratio)


def merit_reference(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One MERIT step, tensor by tensor: the readable specification (also what is compiled)."""
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = m / (v.sqrt() + eps)
        if weight_decay != 0:
            u = u + weight_decay * p
        p.sub_((u * merit_ratio(p, u)).clamp_(-1.0, 1.0) * lr)


def _row_blocks(t: Tensor, size: int | None) -> list[slice]:
    """Slices of dim 0 holding about ``size`` elements each (one slice: the whole tensor)."""
    rows = t.shape[0] if t.ndim else 1
    if size is None or t.ndim == 0 or t.numel() <= size:
        return [slice(0, rows)]
    per_block = max(1, size // max(1, t.numel() // rows))
    return [slice(start, min(rows, start + per_block)) for start in range(0, rows, per_block)]


def merit_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    shards: Shards | None = None,
) -> None:
    """The same step as :func:`merit_reference`, in two passes over blocks of rows; on FSDP2
    ``shards`` the column and layer maxima are maximised over the ranks."""
    size = _blocks.block_elements(params[0].device)
    views = [_as_rows(t) for t in zip(params, grads, exp_avgs, exp_avg_sqs)]
    found = [_gather_maxima(*v, size, beta1, beta2, eps, weight_decay) for v in views]
    if shards is not None:
        packed = shards.max(torch.cat([m.packed() for m in found]))
        offset = 0
        for m in found:
            offset = m.unpack(packed, offset)
    for (p, _, m, v), maxima in zip(views, found):
        for rows in _row_blocks(p, size):
            u = _direction(p[rows], m[rows], v[rows], eps, weight_decay)
            _descend(p[rows], u.mul_(maxima.ratio(rows)).clamp_(-1.0, 1.0), lr)


def _as_rows(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """A 0-d tensor as one row of one element (the same ratio rule as a vector)."""
    return tuple(t.view(1) for t in tensors) if tensors[0].ndim == 0 else tensors


def _direction(p: Tensor, m: Tensor, v: Tensor, eps: float, weight_decay: float) -> Tensor:
    """``u = m / (sqrt(v) + eps) + weight_decay * p`` in a new tensor."""
    u = v.sqrt().add_(eps)
    torch.div(m, u, out=u)
    if weight_decay != 0:
        u.add_(p, alpha=weight_decay)
    return u


class _Maxima:
    """Row, column and layer maxima of ``|p|`` and ``|u|`` of one tensor, and its ratios."""

    def __init__(self, p: Tensor) -> None:
        self.matrix = p.ndim >= 2
        self.rows_w: list[Tensor] = []
        self.rows_u: list[Tensor] = []
        zeros = p.new_zeros((1, *p.shape[1:]) if self.matrix else ())
        self.col_w, self.col_u = zeros.clone(), zeros.clone()  # |x| >= 0: zeros are neutral
        self.layer_w, self.layer_u = p.new_zeros(()), p.new_zeros(())

    def add(self, pb: Tensor, u: Tensor) -> None:
        """Fold in a block of rows (possibly empty: an FSDP2 rank may hold no rows)."""
        if pb.numel() == 0:
            return
        if not self.matrix:
            self.layer_w = torch.maximum(self.layer_w, _max_abs(pb))
            self.layer_u = torch.maximum(self.layer_u, _max_abs(u))
            return
        rw, ru = _max_abs(pb, 1), _max_abs(u, 1)
        self.rows_w.append(rw)
        self.rows_u.append(ru)
        self.col_w = torch.maximum(self.col_w, _max_abs(pb, 0))
        self.col_u = torch.maximum(self.col_u, _max_abs(u, 0))
        self.layer_w = torch.maximum(self.layer_w, rw.amax())
        self.layer_u = torch.maximum(self.layer_u, ru.amax())

    def packed(self) -> Tensor:
        """What the ranks maximise together: column and layer maxima."""
        parts = [self.col_w.flatten(), self.col_u.flatten()] if self.matrix else []
        return torch.cat([*parts, self.layer_w.reshape(1), self.layer_u.reshape(1)])

    def unpack(self, packed: Tensor, offset: int) -> int:
        if self.matrix:
            n = self.col_w.numel()
            self.col_w = packed[offset : offset + n].view_as(self.col_w)
            self.col_u = packed[offset + n : offset + 2 * n].view_as(self.col_u)
            offset += 2 * n
        self.layer_w, self.layer_u = packed[offset], packed[offset + 1]
        return offset + 2

    def ratio(self, rows: slice) -> Tensor:
        """τ for the rows ``rows``: see :func:`merit_ratio`."""
        if not self.matrix or not self.rows_w:  # a vector; or a shard of no rows
            return trust_ratio(self.layer_w, self.layer_u, self.layer_w / self.layer_u)
        if len(self.rows_w) > 1:  # the blocks' row maxima, joined once
            self.rows_w, self.rows_u = [torch.cat(self.rows_w)], [torch.cat(self.rows_u)]
        rw, ru = self.rows_w[0][rows], self.rows_u[0][rows]
        layer = self.layer_w / self.layer_u
        tau = torch.maximum(rw / ru, self.col_w / self.col_u).clamp_(min=layer)
        bad = (rw == 0) | (ru == 0) | (self.col_w == 0) | (self.col_u == 0)
        return tau.masked_fill_(bad, 1.0)


def _gather_maxima(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, size: int | None, *hyper: float
) -> _Maxima:
    """The first pass over one tensor: the moments, and the maxima of ``|p|`` and ``|u|``."""
    beta1, beta2, eps, weight_decay = hyper
    maxima = _Maxima(p)
    for rows in _row_blocks(p, size):
        pb, gb, mb, vb = p[rows], g[rows], m[rows], v[rows]
        mb.lerp_(gb, 1 - beta1)
        vb.mul_(beta2).addcmul_(gb, gb, value=1 - beta2)
        maxima.add(pb, _direction(pb, mb, vb, eps, weight_decay))
    return maxima


def _descend(p: Tensor, update: Tensor, lr: float | Tensor) -> None:
    """``p -= lr * update`` (``update`` is a temporary; a tensor lr stays on the device)."""
    if isinstance(lr, Tensor):
        p.sub_(update.mul_(lr))
    else:
        p.add_(update, alpha=-lr)


class MERIT(BigBatchOptimizer):
    """MERIT (Luo et al., ICML 2025): Adam with max-norm element-wise trust ratios.

    ``u = m / (sqrt(v) + eps) + weight_decay * p`` (no bias correction),
    ``p ← p - lr * clip(u * merit_ratio(p, u), -1, 1)``.

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay: as in Adam (weight decay inside ``u``).
        impl: ``"foreach"``, ``"reference"``, ``"compiled"`` or ``"fused"`` (CUDA).
    """

    #: how its rate follows the batch (``bigbatch.optim.FAMILIES``)
    family: ClassVar[str] = "adam"

    fused_update: ClassVar[str] = "merit_fused"
    fused_accepts: ClassVar[str | None] = "merit_supports"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        impl: str = "foreach",
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, impl)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        check_adam_group(group)

    def _step(self) -> None:
        for index, group in enumerate(self.param_groups):
            params = self._params_with_grad(group)
            if not params:
                continue
            states = [self._state_for(p) for p in params]
            self._increment_steps([s["step"] for s in states])
            beta1, beta2 = group["betas"]
            self._dispatch(
                merit_reference,
                merit_foreach,
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                lr=self._scalar(index, "lr", group["lr"], params[0].device),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )

"""The element-wise GSNR ``mean² / variance`` over a step's sub-batches (for VRGD), the
variance from deviations: Welford on one process (West 1979), shifted sums in one
float32 all-reduce under DDP and FSDP2."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..parallel.world import World
from .layout import ParamLayout, SubBatches

EPS = 1e-30


class WelfordGSNR:
    """Weighted Welford over the micro-batches of one process."""

    def __init__(self, layout: ParamLayout, current: Callable[[], SubBatches | None]) -> None:
        self.layout, self._current = layout, current
        self._m2: list[Tensor] | None = None
        self._seen: list[int] = []
        self.handles = [
            p.register_hook(functools.partial(self._update, i)) for i, p in enumerate(layout.params)
        ]

    def begin(self, batches: SubBatches) -> None:
        if self._m2 is None:
            self._m2 = [torch.zeros_like(p, dtype=torch.float32) for p in self.layout.params]
        torch._foreach_zero_(self._m2)
        self._seen = [-1] * len(self.layout.params)  # each one's last micro-batch with a hook

    def _update(self, param_index: int, increment: Tensor) -> None:
        """``M2 += w (x - mean_old)(x - mean_new)`` for parameter ``param_index``, with
        ``x = incr / l`` the micro-batch's mean gradient and ``mean_old`` read from ``.grad``."""
        batches = self._current()
        if batches is None or batches.current is None or self._m2 is None:
            return
        index, weights = batches.current, batches.loss_weights
        p = self.layout.params[param_index]
        self._skipped(param_index, p.grad, weights, index)
        if index == 0:
            return  # one sub-batch has no deviation yet
        x = increment.float() / weights[index]
        scale = sum(weights)  # .grad is Σ l x: the weights that define it
        w = weights[index] / scale
        before = sum(weights[:index]) / scale
        accumulated = (p.grad if p.grad is not None else torch.zeros_like(p)).float() / scale
        mean_old = accumulated / before
        mean_new = (accumulated + x * w) / (before + w)
        self._m2[param_index].add_((x - mean_old) * (x - mean_new), alpha=w)

    def _skipped(self, i: int, grad: Tensor | None, weights: list[float], upto: int) -> None:
        # micro-batches before `upto` in which parameter i got no gradient (a branch not
        # taken): each a zero x, whose Welford term w·m_old·m_new the hook never added
        # (the running mean only shrinks across them: .grad holds still)
        last, self._seen[i] = self._seen[i], upto
        if grad is None or upto - last < 2:
            return
        assert self._m2 is not None
        scale, total = sum(weights), grad.float() / sum(weights)
        for j in range(max(last + 1, 1), upto):
            before, after = sum(weights[:j]) / scale, sum(weights[: j + 1]) / scale
            self._m2[i].add_(total.square(), alpha=weights[j] / scale / (before * after))

    def finish(self, grads: list[Tensor], batches: SubBatches) -> list[Tensor]:
        assert self._m2 is not None
        weights = batches.loss_weights
        for i, p in enumerate(self.layout.params):  # those the last micro-batches skipped
            self._skipped(i, p.grad, weights, len(weights))
        scale = sum(weights)  # 1 unless the caller weighted differently
        return [(g.float() / scale).square() / (m2 + EPS) for g, m2 in zip(grads, self._m2)]

    def traffic(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:  # (nothing outlives a step)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def memory(self) -> int:
        return _bytes(self._m2 or [])


class ShiftedGSNR:
    """Shifted sums of squares on every rank, combined in one all-reduce."""

    def __init__(
        self, layout: ParamLayout, current: Callable[[], SubBatches | None], world: World
    ) -> None:
        self.layout, self._current, self.world = layout, current, world
        self._m1: list[Tensor] | None = None  # Σ w (x - c)
        self._m2: list[Tensor] | None = None  # Σ w (x - c)²
        self._weighed: list[float] = []  # Σ w of the micro-batches that gave it a gradient
        self._shift: list[Tensor] | None = None  # c: the previous step's mean gradient
        self.bytes = 0
        self.handles = [
            p.register_hook(functools.partial(self._update, i)) for i, p in enumerate(layout.hooked)
        ]

    def begin(self, batches: SubBatches) -> None:
        if self._m2 is None:
            params = self.layout.hooked  # whole tensors (FSDP2: the unsharded parameters)
            self._m1 = [torch.zeros_like(p, dtype=torch.float32) for p in params]
            self._m2 = [torch.zeros_like(m) for m in self._m1]
        if self._shift is None:
            self._shift = [torch.zeros_like(m) for m in self._m1]
        assert self._m1 is not None
        torch._foreach_zero_(self._m1)
        torch._foreach_zero_(self._m2)
        self._weighed = [0.0] * len(self._m1)

    def _update(self, param_index: int, increment: Tensor) -> None:
        batches = self._current()
        if batches is None or batches.current is None or self._m2 is None:
            return
        assert self._m1 is not None and self._shift is not None
        index = batches.current
        w = self._weight(batches, index)
        x = increment.float() / batches.loss_weights[index]  # its mean gradient
        deviation = x - self._shift[param_index]
        self._m1[param_index].add_(deviation, alpha=w)
        self._m2[param_index].add_(deviation.square_(), alpha=w)
        self._weighed[param_index] += w

    @staticmethod
    def _weight(batches: SubBatches, index: int) -> float:
        return batches.sizes[index] / batches.total  # the sample weight of this sub-batch

    def finish(self, grads: list[Tensor], batches: SubBatches) -> list[Tensor]:
        """The ranks' sums in one float32 all-reduce; ``var = Σ w (x-c)² - (Σ w (x-c))²`` about
        the shift ``c``."""
        assert self._m1 is not None and self._m2 is not None and self._shift is not None
        mine = sum(self._weight(batches, i) for i in range(len(batches.sizes)))
        for i, c in enumerate(self._shift):  # micro-batches without its gradient: x = 0
            missed = mine - self._weighed[i]
            if missed > 1e-12:
                self._m1[i].sub_(c, alpha=missed)
                self._m2[i].add_(c.square(), alpha=missed)
        flat = torch.cat([m.flatten() for m in (*self._m1, *self._m2)])
        self.world.all_reduce_sum(flat)
        self.bytes += flat.numel() * flat.element_size()
        half = flat.numel() // 2
        out, start = [], 0
        for m2, c in zip(self._m2, self._shift):
            first = flat[start : start + m2.numel()].view_as(m2)
            second = flat[half + start : half + start + m2.numel()].view_as(m2)
            start += m2.numel()
            mean = c + first
            variance = (second - first.square()).clamp_(min=0)
            out.append(mean.square() / (variance + EPS))
            # an overflowed step (GradScaler) must not poison the next shift
            c.copy_(torch.where(torch.isfinite(mean), mean, c))
        return out

    def traffic(self) -> int:
        return self.bytes

    def state_dict(self) -> dict[str, Any]:
        # the shift, alike on every rank: a resumed run sums about the same c as the straight
        # one, so its float32 sums round alike (it resumed up to 2e-7 off, from c = 0)
        return {"gsnr_shift": [c.clone() for c in self._shift or []]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("gsnr_shift") or None  # (none: saved on one process, or before a step)
        if saved is not None:
            pairs = zip(saved, self.layout.hooked, strict=True)
            self._shift = [c.to(p.device, torch.float32) for c, p in pairs]
        else:
            self._shift = None

    def memory(self) -> int:
        return _bytes((self._m1 or []) + (self._m2 or []) + (self._shift or []))


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)

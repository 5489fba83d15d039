"""LARS: layer-wise adaptive rate scaling (You, Gitman, Ginsburg, 2017,
arXiv:1708.03888), as timm ``Lars`` and apex ``LARC`` (docs/algorithms.md, "LARS")."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import check_flag, check_number
from .._tensors import norm_dtype, norms
from . import _blocks
from ._base import BigBatchOptimizer, check_lr
from ._shards import Shards
from ._trust import lars_ratio

__all__ = ["LARS", "lars_foreach", "lars_reference"]


def lars_reference(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    trust_clip: bool,
    always_adapt: bool,
    first_step: bool,
) -> None:
    """One LARS step, tensor by tensor: the readable specification. On a buffer's
    ``first_step`` it is set to the adapted gradient (no dampening)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        if weight_decay != 0 or always_adapt:
            ratio = lars_ratio(
                torch.linalg.vector_norm(p, dtype=norm_dtype(p)),
                torch.linalg.vector_norm(g, dtype=norm_dtype(g)),
                lr=lr,
                weight_decay=weight_decay,
                trust_coefficient=trust_coefficient,
                eps=eps,
                trust_clip=trust_clip,
            )
            g = (g + weight_decay * p) * ratio  # a new tensor: p.grad stays as it was
        if momentum != 0:
            buf = momentum_buffers[i]
            if first_step:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g + momentum * buf if nesterov else buf
        p.sub_(g * lr)


def lars_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    trust_coefficient: float,
    eps: float,
    trust_clip: bool,
    always_adapt: bool,
    first_step: bool,
    shards: Shards | None = None,
) -> None:
    """The same step as :func:`lars_reference`, multi-tensor, cache-blocked on the CPU; on
    FSDP2 ``shards`` the norms are summed over the ranks."""
    adapt = weight_decay != 0 or always_adapt
    ratios: tuple[Tensor, ...] = ()
    if adapt:
        w_norm, g_norm = torch.stack(norms(params)), torch.stack(norms(grads))
        if shards is not None:
            w_norm, g_norm = shards.norms(w_norm, g_norm)
        ratios = lars_ratio(
            w_norm,
            g_norm,
            lr=lr,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            trust_clip=trust_clip,
        ).unbind(0)
    lists = (params, grads, momentum_buffers) if momentum != 0 else (params, grads)
    for block in _blocks.plan(lists, _blocks.block_elements(params[0].device)):
        P, G = _blocks.take(params, block), _blocks.take(grads, block)
        if adapt:
            R = [ratios[i] for i, _, _ in block]
            if weight_decay != 0:
                G = torch._foreach_add(G, P, alpha=weight_decay)
                torch._foreach_mul_(G, R)
            else:
                G = torch._foreach_mul(G, R)
        if momentum != 0:
            B = _blocks.take(momentum_buffers, block)
            if first_step:
                torch._foreach_copy_(B, G)
            else:
                torch._foreach_mul_(B, momentum)
                torch._foreach_add_(B, G, alpha=1 - dampening)
            G = torch._foreach_add(G, B, alpha=momentum) if nesterov else B
        if isinstance(lr, Tensor):  # a copy: G may be the buffers or the gradients themselves
            torch._foreach_add_(P, torch._foreach_mul(G, -lr))
        else:
            torch._foreach_add_(P, G, alpha=-lr)


class LARS(BigBatchOptimizer):
    """LARS (You et al., 2017, "Large Batch Training of Convolutional Networks").

    Per tensor ``τ = trust_coefficient * |w| / (|g| + weight_decay * |w| + eps)`` (1 where
    a norm is 0), then momentum SGD on ``(g + weight_decay * w) * τ``; only groups with
    ``weight_decay != 0`` are adapted unless ``always_adapt``.

    Args:
        params: parameters or param groups.
        lr: learning rate (required).
        momentum, dampening, weight_decay, nesterov: as in ``torch.optim.SGD``.
        trust_coefficient: η of the paper.
        eps: added to the ratio's denominator.
        trust_clip: LARC clipping, ``τ ← min(τ / lr, 1)``.
        always_adapt: adapt groups without weight decay too.
        impl: ``"foreach"``, ``"reference"``, ``"compiled"`` or ``"fused"`` (CUDA).
    """

    #: how its rate follows the batch (``bigbatch.optim.FAMILIES``)
    family: ClassVar[str] = "lars"

    fused_update: ClassVar[str] = "lars_fused"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        trust_clip: bool = False,
        always_adapt: bool = False,
        impl: str = "foreach",
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            trust_coefficient=trust_coefficient,
            eps=eps,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
        )
        super().__init__(params, defaults, impl)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        group["lr"] = check_lr(group["lr"])
        group["momentum"] = check_number("momentum", group["momentum"], high=1.0, high_open=True)
        group["dampening"] = check_number("dampening", group["dampening"], high=1.0)
        group["weight_decay"] = check_number("weight_decay", group["weight_decay"])
        group["trust_coefficient"] = check_number(
            "trust_coefficient", group["trust_coefficient"], low_open=True
        )
        group["eps"] = check_number("eps", group["eps"])
        for flag in ("nesterov", "trust_clip", "always_adapt"):
            group[flag] = check_flag(flag, group[flag])
        if group["nesterov"] and (group["momentum"] == 0 or group["dampening"] != 0):
            raise ValueError(
                "nesterov=True needs momentum > 0 and dampening == 0, got "
                f"momentum={group['momentum']!r}, dampening={group['dampening']!r}"
            )

    def _step(self) -> None:
        for index, group in enumerate(self.param_groups):
            params = self._params_with_grad(group)
            if not params:
                continue
            momentum = group["momentum"]
            # Params whose buffer exists take the momentum update; new ones are
            # initialised to this step's adapted gradient (torch SGD, timm).
            parts: dict[bool, list[Tensor]] = {False: [], True: []}
            for p in params:
                parts[momentum != 0 and "momentum_buffer" not in self.state[p]].append(p)
            for first_step, ps in parts.items():
                if not ps:
                    continue
                buffers = []
                if momentum != 0:
                    for p in ps:
                        if first_step:
                            self.state[p]["momentum_buffer"] = self._zeros_for(p)
                        buffers.append(self.state[p]["momentum_buffer"])
                self._dispatch(
                    lars_reference,
                    lars_foreach,
                    ps,
                    [p.grad for p in ps],
                    buffers,
                    lr=self._scalar(index, "lr", group["lr"], ps[0].device),
                    momentum=momentum,
                    dampening=group["dampening"],
                    weight_decay=group["weight_decay"],
                    nesterov=group["nesterov"],
                    trust_coefficient=group["trust_coefficient"],
                    eps=group["eps"],
                    trust_clip=group["trust_clip"],
                    always_adapt=group["always_adapt"],
                    first_step=first_step,
                )

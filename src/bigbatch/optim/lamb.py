"""LAMB: layer-wise adaptive moments (You et al., 2019, arXiv:1904.00962), with apex
``FusedLAMB``'s and timm ``Lamb``'s defaults (docs/algorithms.md, "LAMB")."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import check_flag, check_number
from .._tensors import norm_dtype, norms
from . import _blocks
from ._base import (
    BigBatchOptimizer,
    add_scaled,
    check_adam_group,
    global_grad_norm,
)
from ._shards import Shards
from ._trust import trust_ratio

__all__ = ["LAMB", "lamb_foreach", "lamb_reference"]


def lamb_reference(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    clip: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float | Tensor,
    bias_correction2: float | Tensor,
    decoupled_weight_decay: bool,
    trust_clip: bool,
    always_adapt: bool,
) -> None:
    """One LAMB step per tensor, the readable specification (also what ``"compiled"``
    compiles); ``clip`` is ``max(1, |g| / max_grad_norm)`` or None."""
    bc1, bc2 = bias_correction1, bias_correction2
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if clip is not None:
            # a new tensor: p.grad stays as the user left it (a 0-dim g took the clip's
            # float64 and failed in the moments' lerp)
            g = (g / clip.to(g.device)).to(g.dtype)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / (v.sqrt() / bc2**0.5 + eps)
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                u = u + weight_decay * p
        # Layer-wise adaptation only where weight decay applies (biases and norm
        # weights usually have none), as in apex and timm, unless always_adapt.
        if weight_decay != 0 or always_adapt:
            w_norm = torch.linalg.vector_norm(p, dtype=norm_dtype(p))
            u_norm = torch.linalg.vector_norm(u, dtype=norm_dtype(u))
            ratio = trust_ratio(w_norm, u_norm, w_norm / u_norm)
            if trust_clip:
                ratio = ratio.clamp(max=1.0)
            u = u * ratio
        p.sub_(u * lr)


def lamb_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Tensor,
    clip: Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float,
    bias_correction2: float,
    decoupled_weight_decay: bool,
    trust_clip: bool,
    always_adapt: bool,
    shards: Shards | None = None,
) -> None:
    """The same step as :func:`lamb_reference`, multi-tensor, in two cache-blocked passes on
    the CPU (no ``u`` buffer); on FSDP2 ``shards`` the norms are summed over the ranks."""
    bc1, bc2 = bias_correction1, bias_correction2
    # m̂ / (sqrt(v̂) + eps) == scale * m / (sqrt(v) + eps * sqrt(bc2)): folding the
    # corrections into scalars saves two passes; U below is the update / scale.
    scale = math.sqrt(bc2) / bc1
    eps_hat = eps * math.sqrt(bc2)
    coupled_decay = weight_decay if not decoupled_weight_decay else 0.0
    decay_first = decoupled_weight_decay and weight_decay != 0
    adapt = weight_decay != 0 or always_adapt
    if clip is not None:
        clip = clip.to(params[0].device)

    lists = (params, grads, exp_avgs, exp_avg_sqs)
    blocks = _blocks.plan(lists, _blocks.block_elements(params[0].device))

    def direction(P: list[Tensor], M: list[Tensor], V: list[Tensor]) -> list[Tensor]:
        U = torch._foreach_sqrt(V)
        torch._foreach_add_(U, eps_hat)
        U = torch._foreach_div(M, U)
        if coupled_decay != 0:
            torch._foreach_add_(U, P, alpha=coupled_decay / scale)
        return U

    pieces: list[_blocks.Piece] = []
    u_norms: list[Tensor] = []
    w_norms: list[Tensor] = []
    for block in blocks:
        P, G, M, V = (_blocks.take(t, block) for t in lists)
        if clip is not None:
            G = [h if h.dtype == m.dtype else h.to(m.dtype)  # (0-dim: the clip's float64)
                 for h, m in zip(torch._foreach_div(G, clip), M)]  # fmt: skip
        torch._foreach_lerp_(M, G, 1 - beta1)
        torch._foreach_mul_(V, beta2)
        torch._foreach_addcmul_(V, G, G, value=1 - beta2)
        U = direction(P, M, V)
        if decay_first:  # decoupled decay first: the ratio sees the decayed p
            torch._foreach_mul_(P, 1 - lr * weight_decay)
        if not adapt:
            add_scaled(P, U, -lr * scale)
            continue
        pieces += block
        u_norms += norms(U)
        w_norms += norms(P)
    if not adapt:
        return

    step_sizes = _step_sizes(pieces, w_norms, u_norms, params, scale, lr, trust_clip, shards)
    for block in blocks:
        P, M, V = (_blocks.take(t, block) for t in (params, exp_avgs, exp_avg_sqs))
        U = direction(P, M, V)
        # a list of device scalars: foreach_addcmul_ would read them to the host (a sync)
        torch._foreach_mul_(U, [step_sizes[i] for i, _, _ in block])
        torch._foreach_add_(P, U)


def _step_sizes(
    pieces: list[_blocks.Piece],
    w_norms: list[Tensor],
    u_norms: list[Tensor],
    params: list[Tensor],
    scale: float,
    lr: float | Tensor,
    trust_clip: bool,
    shards: Shards | None,
) -> tuple[Tensor, ...]:
    """Per tensor ``-lr * scale * ratio`` from the blocks' norms of ``p`` and ``U``."""
    if pieces:
        w_norm = _blocks.combine_norms(pieces, w_norms, len(params))
        u_norm = _blocks.combine_norms(pieces, u_norms, len(params)) * scale
    else:  # every local shard is empty (FSDP2): this rank adds nothing to the norms
        w_norm = u_norm = params[0].new_zeros(len(params), dtype=norm_dtype(params[0]))
    if shards is not None:
        w_norm, u_norm = shards.norms(w_norm, u_norm)
    ratio = trust_ratio(w_norm, u_norm, w_norm / u_norm)
    if trust_clip:
        ratio = ratio.clamp(max=1.0)
    return (ratio * (-lr * scale)).unbind(0)


class LAMB(BigBatchOptimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning").

    ``u = m̂ / (sqrt(v̂) + eps) + weight_decay * p``, then ``p ← p - lr * (|p| / |u|) * u``
    per tensor (ratio 1 where a norm is 0). State in float32 for low-precision params.

    Args:
        params: parameters or param groups (see :func:`bigbatch.optim.param_groups`).
        lr, betas, eps, weight_decay: as in Adam; weight decay enters ``u``.
        bias_correction: Adam's bias correction of the moments.
        max_grad_norm: clip the global gradient norm to this first (``None``: off).
        always_adapt: apply the trust ratio to groups without weight decay too.
        trust_clip: clip the trust ratio at 1 (LAMBC).
        decoupled_weight_decay: decay ``p`` outside the trust ratio (timm's).
        impl: ``"foreach"``, ``"reference"``, ``"compiled"`` or ``"fused"`` (CUDA).

    Example:
        >>> opt = LAMB(param_groups(model, weight_decay=0.01), lr=2e-3)
    """

    #: how its rate follows the batch (``bigbatch.optim.FAMILIES``)
    family: ClassVar[str] = "adam"

    fused_update: ClassVar[str] = "lamb_fused"

    # Inductor would store u (a new parameter-sized buffer every step, paid in
    # page faults) to share it between the norm and the update; recomputing it
    # from m, v and p in the update loop reads two more arrays and is faster.
    compile_options: ClassVar[dict[str, Any] | None] = {"realize_reads_threshold": 64}

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        max_grad_norm: float | None = 1.0,
        always_adapt: bool = False,
        trust_clip: bool = False,
        decoupled_weight_decay: bool = False,
        impl: str = "foreach",
    ) -> None:
        if max_grad_norm is not None:
            max_grad_norm = check_number(
                "max_grad_norm", max_grad_norm, low_open=True, allow_inf=True
            )
        self.max_grad_norm = max_grad_norm
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            always_adapt=always_adapt,
            trust_clip=trust_clip,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, impl)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        check_adam_group(group)
        for flag in ("bias_correction", "always_adapt", "trust_clip", "decoupled_weight_decay"):
            group[flag] = check_flag(flag, group[flag])

    def _step(self) -> None:
        active = [(i, g, self._params_with_grad(g)) for i, g in enumerate(self.param_groups)]
        clip = None
        if self.max_grad_norm is not None:
            grads = [p.grad for _, _, ps in active for p in ps]
            if grads:
                clip = (global_grad_norm(grads) / self.max_grad_norm).clamp_(min=1.0)
        for index, group, params in active:
            if not params:
                continue
            states = [self._state_for(p) for p in params]
            steps = [s["step"] for s in states]
            self._increment_steps(steps)
            beta1, beta2 = group["betas"]
            device = params[0].device
            for step, idx in self._partition_by_step(steps).items():
                # The corrections are computed here in double precision, not in the
                # update: inside a compiled kernel beta**step would be evaluated per
                # element (and in float32).
                bc1, bc2 = (
                    (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1, 1)
                )
                self._dispatch(
                    lamb_reference,
                    lamb_foreach,
                    [params[i] for i in idx],
                    [params[i].grad for i in idx],
                    [states[i]["exp_avg"] for i in idx],
                    [states[i]["exp_avg_sq"] for i in idx],
                    lr=self._scalar(index, "lr", group["lr"], device),
                    clip=clip,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    bias_correction1=self._scalar(index, "bias_correction1", bc1, device),
                    bias_correction2=self._scalar(index, "bias_correction2", bc2, device),
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                    trust_clip=group["trust_clip"],
                    always_adapt=group["always_adapt"],
                )

"""Trust ratios: the layer-wise rate multipliers of LARS and LAMB (and MERIT's guard)."""

from __future__ import annotations

import torch
from torch import Tensor


def trust_ratio(w_norm: Tensor, u_norm: Tensor, ratio: Tensor) -> Tensor:
    """``ratio`` where both norms are positive, else 1 (the convention of apex, timm, optax)."""
    one = torch.ones_like(ratio)
    return torch.where(w_norm > 0, torch.where(u_norm > 0, ratio, one), one)


def lars_ratio(
    w_norm: Tensor,
    g_norm: Tensor,
    *,
    lr: float | Tensor,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    trust_clip: bool,
) -> Tensor:
    """LARS's per-tensor ratio ``η |w| / (|g| + λ |w| + ε)`` (You et al. 2017), 1 where a norm
    is zero; with ``trust_clip`` (NVIDIA's LARC) divided by the rate and capped at 1."""
    ratio = trust_coefficient * w_norm / (g_norm + w_norm * weight_decay + eps)
    ratio = trust_ratio(w_norm, g_norm, ratio)
    if trust_clip:  # LARC: the adapted rate never exceeds the global one
        ratio = (ratio / lr).clamp(max=1.0)
    return ratio

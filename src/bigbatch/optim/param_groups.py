"""Weight-decay parameter groups, the way LAMB/LARS recipes expect them."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from torch import nn

from .._checks import check_number

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decay and a no-decay group.

    Biases, normalisation layers' parameters, others of ``ndim <= 1``, ``no_decay``
    patterns (``fnmatch``) and ``model.no_weight_decay()``'s names (the model's own, in
    ``torch.compile`` or DDP) get ``weight_decay=0``, no trust ratio; no empty groups.

    Example:
        >>> opt = LAMB(param_groups(model, weight_decay=0.01), lr=2e-3)
    """
    weight_decay = check_number("weight_decay", weight_decay)
    if isinstance(no_decay, str):
        no_decay = (no_decay,)
    if not isinstance(no_decay, Iterable):
        raise ValueError(f"no_decay takes name patterns, got {no_decay!r}")
    patterns = list(no_decay)
    model, prefix = _unwrapped(model)
    if callable(getattr(model, "no_weight_decay", None)):
        patterns += list(model.no_weight_decay())
    normalised = {id(p) for m in model.modules() if isinstance(m, _NORMS) for p in m.parameters()}
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if (
            p.ndim <= 1
            or name.rpartition(".")[2] == "bias"  # a bias of any shape, as timm's rule
            or id(p) in normalised
            # (a pattern of the wrapper's names, `_orig_mod.pos_embed`, as it lists them)
            or any(fnmatch.fnmatchcase(n, pat) for pat in patterns for n in (name, prefix + name))
        ):
            exempt.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


#: the layers whose parameters (of any shape: LayerNorm([3, 4])) are a normalisation's
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _unwrapped(model: nn.Module) -> tuple[nn.Module, str]:
    # the user's own module inside torch.compile's and DDP's wrappers, whose parameter
    # names are prefixed (`_orig_mod.`, `module.`) and which hide no_weight_decay()
    prefix = ""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model, prefix = model.module, prefix + "module."
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model, prefix = model._orig_mod, prefix + "_orig_mod."
        else:
            return model, prefix

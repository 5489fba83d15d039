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

    Parameters with ``ndim <= 1``, those matching a ``no_decay`` ``fnmatch`` pattern and
    those a ``model.no_weight_decay()`` names get ``weight_decay=0`` (and so no trust
    ratio in LAMB and LARS). Empty groups are left out.

    Example:
        >>> opt = LAMB(param_groups(model, weight_decay=0.01), lr=2e-3)
    """
    weight_decay = check_number("weight_decay", weight_decay)
    if isinstance(no_decay, str):
        no_decay = (no_decay,)
    patterns = list(no_decay)
    if callable(getattr(model, "no_weight_decay", None)):
        patterns += list(model.no_weight_decay())
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            exempt.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]

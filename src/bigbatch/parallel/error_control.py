"""The error-control rules of compressed gradient reduction on one rank's flat share
``x``: ``"none"``, ``"ef"`` (Seide et al. 2014; Stich et al. 2018), ``"ef21"``
(Richtárik et al. 2021), ``"ef21-sgdm"`` (Fatkhullin et al. 2023), ``"econtrol"`` (Gao,
Islamov, Stich 2024, arXiv:2311.05645); docs/algorithms.md, "Compression with error
control"."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["METHODS", "SHARED_ESTIMATE", "STATE", "local_step", "start"]

#: the state tensors each method keeps per rank
STATE: dict[str, tuple[str, ...]] = {
    "none": (),
    "ef": ("error",),
    "ef21": ("estimate",),
    "ef21-sgdm": ("momentum", "estimate"),
    "econtrol": ("error", "estimate"),
}
METHODS = tuple(STATE)
#: methods whose step is the shared estimate (the sum of the ranks' estimates)
SHARED_ESTIMATE = ("ef21", "ef21-sgdm", "econtrol")

#: ``select(message) -> (values, indices)``: the compressor
Select = Callable[[Tensor], tuple[Tensor, Tensor]]


def start(method: str, x: Tensor) -> dict[str, Tensor]:
    """The state after an uncompressed step with share ``x``: estimators at ``x``, errors at 0."""
    fresh = {"error": torch.zeros_like(x), "estimate": x, "momentum": x}
    return {name: fresh[name] for name in STATE[method]}


def local_step(
    method: str, x: Tensor, state: dict[str, Tensor], eta: float, select: Select
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One rank's compressed message and its next state: ``(values, indices, new_state)``;
    ``eta`` is the method's η; ``state`` is not modified."""
    new: dict[str, Tensor] = {}
    if method == "none":
        message = x
    elif method == "ef":
        message = x + state["error"]
    elif method == "ef21":
        message = x - state["estimate"]
    elif method == "ef21-sgdm":
        new["momentum"] = torch.lerp(state["momentum"], x, eta)
        message = new["momentum"] - state["estimate"]
    elif method == "econtrol":
        message = eta * state["error"] + x - state["estimate"]
    else:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    values, indices = select(message)
    if not STATE[method]:  # nothing kept: no need for the dense message
        return values, indices, new
    sent = torch.zeros_like(message).index_put_((indices,), values)
    if method == "ef":
        new["error"] = message - sent
    elif method == "econtrol":
        new["error"] = state["error"] + x - state["estimate"] - sent
    if method in SHARED_ESTIMATE:
        new["estimate"] = state["estimate"] + sent
    return values, indices, new

"""The error-control rules of compressed gradient reduction, on one rank's flat tensors.

The functional core of :class:`~bigbatch.parallel.compression.CompressionState`
(which adds the buckets, the collectives and the bookkeeping): what a rank
compresses, and how its state moves once the compressed message is known.
``x`` is this rank's share of the gradient (its gradient divided by the world
size, so that the sum over ranks is the mean), ``state`` the method's tensors
for the same coordinates. All in gradient units (docs/algorithms.md,
"Compression with error control").

- ``"none"``: compress ``x`` itself (the biased baseline).
- ``"ef"``, error feedback (Seide et al. 2014; Stich et al. 2018):
  ``p = x + e``, send ``Δ = C(p)``, keep ``e ← p − Δ``; the step is ``Σ Δ``.
- ``"ef21"`` (Richtárik, Sokolov, Fatkhullin 2021): send ``c = C(x − g_i)``,
  ``g_i += c``; the shared ``G = Σ g_i`` moves by ``Σ c`` and is the step.
- ``"ef21-sgdm"`` (Fatkhullin, Tyurin, Richtárik 2023): EF21 on a moving
  average of the stochastic gradient, ``v_i ← (1 − η) v_i + η x``, then
  ``c = C(v_i − g_i)``, ``g_i += c``; ``η = 1`` is EF21.
- ``"econtrol"`` (Gao, Islamov, Stich 2024): ``Δ = C(η e_i + x − h_i)``,
  ``e_i += x − h_i − Δ`` (``h_i`` before its update), ``h_i += Δ``; the
  shared ``H = Σ h_i`` is the step; ``η = 0`` is EF21.
"""

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
    """One rank's compressed message and its next state.

    Returns ``(values, indices, new_state)``: the message sent is ``values`` at
    ``indices`` (zero elsewhere); ``eta`` is the method's η (EF21-SGDM's
    averaging weight, EControl's feedback strength; the others ignore it).
    ``state`` is not modified.
    """
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

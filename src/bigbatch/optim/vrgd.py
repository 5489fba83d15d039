"""VRGD: gradient signal-to-noise ratio scaling on top of any optimizer
(arXiv:2309.13681, from its equations; docs/algorithms.md, "VRGD")."""

from __future__ import annotations

import math
import operator
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import check_number, choice
from .._warn import warn_at_caller
from ..knobs import Knob
from ..parallel.fsdp import local, shard_like
from ..stats.result import GradientStats
from .wrapper import StatisticsWrapper

__all__ = ["MIN_SUB_BATCHES", "VRGD", "FewSubBatchesWarning", "gsnr_ratio"]

#: below this many sub-batches the per-layer normaliser is set by outliers
#: (``(k-1) r`` ~ F(1, k-1) has an infinite mean for k ≤ 3)
MIN_SUB_BATCHES = 4
#: the paper's smallest setting; below it VRGD warns
ADVISED_SUB_BATCHES = 8
NORMALIZERS = ("mean", "median")


class FewSubBatchesWarning(UserWarning):
    """VRGD runs with fewer than 8 sub-batches: its GSNR estimate is heavy-tailed."""


def gsnr_ratio(gsnr: Tensor, gamma: float, normalizer: str = "mean") -> Tensor:
    """``clamp(r / center(r), γ, 1)`` for one parameter tensor's element-wise GSNR ``r``."""
    center = gsnr.mean() if normalizer == "mean" else _median(gsnr.flatten())
    return (gsnr / center.clamp(min=torch.finfo(gsnr.dtype).tiny)).clamp_(gamma, 1.0)


def _median(flat: Tensor) -> Tensor:
    # the middle value, or the two middle ones' mean (torch's median takes the lower one:
    # a bias of two elements was never damped); NaN where any is, as torch's (on the
    # device: no host read)
    if flat.numel() == 0:
        return flat.median()
    lower = flat.kthvalue((flat.numel() + 1) // 2).values
    middle = (lower + flat.kthvalue(flat.numel() // 2 + 1).values) / 2
    return torch.where(flat.isnan().any(), flat.new_tensor(math.nan), middle)


class VRGD(StatisticsWrapper):
    """Feed ``r ⊙ g`` to ``base``, with ``r`` the normalised, clipped GSNR (arXiv:2309.13681).

    Args:
        base: the optimizer to wrap (SGD, Adam/AdamW, LARS, LAMB, ...).
        gamma: lower clip of the ratio.
        normalizer: ``"mean"`` (the paper) or ``"median"``.
        gsnr_momentum: β3 of a bias-corrected moving average of the ratio (0: none).

    Needs at least 4 sub-batches per step and warns below 8. Example::

        optimizer = VRGD(LAMB(param_groups(model, 0.01), lr=2e-3), gamma=0.1, gsnr_momentum=0.9)
        loop = bb.AdaptiveBatch(model, optimizer, data, min_sub_batches=8)
    """

    #: the config keys (``vrgd.<key>``) of the vr-* optimizers (bigbatch.knobs)
    CONFIG: ClassVar[dict[str, Knob]] = {
        "gamma": Knob(
            "gamma", "vr-* optimizers: lower clip of the GSNR ratio", low=0, low_open=True, high=1
        ),
        "normalizer": Knob(
            "normalizer", "vr-* optimizers: per-tensor GSNR normaliser", choices=NORMALIZERS
        ),
    }

    needs = frozenset({"gsnr"})

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        gamma: float = 0.1,
        normalizer: str = "mean",
        gsnr_momentum: float = 0.0,
    ) -> None:
        gamma = check_number("gamma", gamma)
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
        gsnr_momentum = check_number("gsnr_momentum", gsnr_momentum)
        if not 0 <= gsnr_momentum < 1:
            raise ValueError(f"gsnr_momentum must be in [0, 1), got {gsnr_momentum!r}")
        self.gamma = gamma
        self.normalizer = choice("normalizer", normalizer, NORMALIZERS)
        self.gsnr_momentum = gsnr_momentum
        super().__init__(base)
        self._params: list[Tensor] = []
        self._ratio_avg: list[Tensor] | None = None
        self._counts: list[int] = []  # each average's steps
        self._groups_changed()
        self._warned_of: set[int] = set()

    def _groups_changed(self) -> None:
        self._follow_trainable()

    def _follow_trainable(self) -> None:
        # the statistics measure the parameters trainable now (a layer unfrozen since, a
        # group added): the ratios and their averages pair with those, by identity; a
        # parameter newly trainable starts its average (and bias correction) at zero
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if len(params) == len(self._params) and all(map(operator.is_, params, self._params)):
            return
        if self._ratio_avg is not None:
            kept = {id(p): (a, n) for p, a, n in zip(self._params, self._ratio_avg, self._counts)}
            pairs = [kept.get(id(p), (torch.zeros_like(p), 0)) for p in params]
            self._ratio_avg, self._counts = [a for a, _ in pairs], [n for _, n in pairs]
        self._params = params

    def check_sub_batches(self, count: int) -> None:
        """Refuse fewer than 4 sub-batches per step; warn below 8."""
        super().check_sub_batches(count)
        if count < MIN_SUB_BATCHES:
            raise ValueError(
                f"VRGD needs at least {MIN_SUB_BATCHES} sub-batches per step to estimate the "
                f"gradient variance, got {count}: raise min_sub_batches (more micro-batches) "
                "or train on more ranks"
            )
        if count < ADVISED_SUB_BATCHES and count not in self._warned_of:
            # once per count: the loop asks when it is built and the step again
            self._warned_of.add(count)
            warn_at_caller(
                f"VRGD with {count} sub-batches per step: the GSNR of few sub-batches is "
                f"heavy-tailed (the paper uses {ADVISED_SUB_BATCHES} or more); consider "
                "min_sub_batches=8 or normalizer='median'",
                FewSubBatchesWarning,
            )

    def ratios(self, gsnr: list[Tensor], measured: list[bool] | None = None) -> list[Tensor]:
        """This step's multipliers (the momentum updated where ``measured``, else held)."""
        if len(gsnr) != len(self._params):
            raise ValueError(
                f"GSNR for {len(gsnr)} tensors, but the optimizer has {len(self._params)} "
                "trainable parameters: build the statistics from this optimizer's param_groups "
                "(in a loop: a parameter frozen since it was built; build a new loop)"
            )
        ratios = [gsnr_ratio(r, self.gamma, self.normalizer) for r in gsnr]
        if self.gsnr_momentum == 0:
            return ratios
        beta = self.gsnr_momentum
        if self._ratio_avg is None:
            self._ratio_avg, self._counts = [torch.zeros_like(r) for r in ratios], [0] * len(ratios)
        # the zero GSNR of a parameter no micro-batch reached is no measurement: averaged
        # in, it pulled the ratio toward γ (as AGVM holds μ where a group has no gradient)
        moving = [i for i, m in enumerate(measured or [True] * len(ratios)) if m]
        if moving:
            averages = [self._ratio_avg[i] for i in moving]
            torch._foreach_lerp_(averages, [ratios[i] for i in moving], 1 - beta)
        for i in moving:
            self._counts[i] += 1
        return [
            avg / (1 - beta**n) if n else r
            for avg, n, r in zip(self._ratio_avg, self._counts, ratios, strict=True)
        ]

    @torch.no_grad()
    def modulated_step(self, stats: GradientStats) -> None:
        """``g ← r ⊙ g`` with the clipped, normalised GSNR ratio, then the base step."""
        if stats.gsnr is None:
            raise RuntimeError("VRGD needs the element-wise GSNR: collect it with gsnr=True")
        self.check_sub_batches(len(stats.sizes))
        self._follow_trainable()
        measured = [p.grad is not None for p in self._params]
        ratios = self.ratios(stats.gsnr, measured)
        present = [(p, r) for p, r, m in zip(self._params, ratios, measured) if m]
        if present:
            # FSDP2: the ratios are whole tensors, the gradients this rank's rows
            grads = [local(p.grad) for p, _ in present]
            torch._foreach_mul_(grads, [shard_like(r, p.grad) for p, r in present])
        self.base.step()

    def _wrapper_state(self) -> dict[str, Any]:
        return {
            "ratio_avg": [r.clone() for r in self._ratio_avg] if self._ratio_avg else None,
            "steps": list(self._counts),
        }

    def _check_wrapper_state(self, state: dict[str, Any]) -> None:
        self._follow_trainable()
        saved = state["ratio_avg"]
        if saved and len(saved) != len(self._params):
            raise ValueError(
                f"the saved VRGD state averages the ratios of {len(saved)} trainable "
                f"parameters, but this optimizer has {len(self._params)}: load it where the "
                "same parameters train (requires_grad) as when it was saved"
            )

    def _load_wrapper_state(self, state: dict[str, Any]) -> None:
        saved = state["ratio_avg"]
        self._ratio_avg = [r.to(p.device) for r, p in zip(saved, self._params)] if saved else None
        steps = state["steps"]  # each average's (one for all in a state saved before)
        self._counts = (
            [int(n) for n in steps]
            if isinstance(steps, list)
            else [int(steps)] * len(self._ratio_avg or [])
        )

"""Learning-rate rules for a changing batch (``none``, ``linear``, ``sqrt``, ``adascale``,
``adascale-sqrt``, ``auto``), schedules in samples, and :class:`LRScaling`, which
applies both around the optimizer step (docs/algorithms.md, "Learning-rate rules")."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence

import torch

from .._checks import check_number, choice, positive_int, whole_number
from .controllers import contract_of

LR_RULES = ("none", "linear", "sqrt", "adascale", "adascale-sqrt")

#: the rule ``auto`` picks per optimizer family (``bigbatch.optim.FAMILIES``) when the
#: controller does not hold the rate: Adam-type steps are normalised per coordinate, so
#: their noise falls as sqrt(B) (Malladi et al. 2022); SGD's falls as B (Goyal et al.
#: 2017); LARS was introduced with the linear rule (You et al. 2017)
FAMILY_RULES = {"adam": "sqrt", "sgd": "linear", "lars": "linear"}

Schedule = Callable[[int], float]


def check_lr_rule(rule: str, *, allow_auto: bool = False) -> str:
    return choice("lr_scaling", rule, (*LR_RULES, "auto") if allow_auto else LR_RULES)


def resolve_lr_rule(
    rule: str, controller: object, family: str | None, measured: str | None = None
) -> str:
    """The rule ``auto`` stands for, by the controller's ``Contract.lr_follows``: ``none``;
    the family's rule (:data:`FAMILY_RULES`, ``sqrt`` if unknown); or ``measured`` where
    given, else the family's. Any other rule is returned as it is."""
    return lr_rule_with_reason(rule, controller, family, measured)[0]


def lr_rule_with_reason(
    rule: str, controller: object, family: str | None, measured: str | None = None
) -> tuple[str, str]:
    """:func:`resolve_lr_rule`'s rule and, in words, why it is that one."""
    check_lr_rule(rule, allow_auto=True)
    if rule != "auto":
        return rule, "as set"
    name = type(controller).__name__ if not isinstance(controller, type) else controller.__name__
    follows = contract_of(controller).lr_follows
    if follows == "none":
        return "none", f"auto: {name} holds the rate (its batch follows the noise scale)"
    family_rule = FAMILY_RULES.get(family or "", "sqrt")
    # a batch that replaces the schedule's decay keeps the run the same run in fewer steps
    # only under the family's equivalence rule, not a rule measured for static batches; a
    # fixed ramp follows the same rule, as OLMo-core's batch-size schedule does
    if follows == "family":
        return family_rule, f"auto: the {family or 'unknown'} family's rule, as {name} asks"
    if measured is not None:
        return check_lr_rule(measured), "auto: the rule measured for this optimizer on the task"
    return family_rule, f"auto: the {family or 'unknown'} family's rule"


def lr_factor(
    rule: str,
    batch_size: int,
    base_batch_size: int,
    *,
    grad_sq_norm: float | None = None,
    trace: float | None = None,
) -> float:
    """The multiplier of the base rate at ``batch_size`` under ``rule`` (AdaScale's: 1 until
    the smoothed ``|G|²`` and ``tr Σ ≥ 0`` are finite; ``S`` while ``|G|² ≤ 0``, all noise)."""
    check_lr_rule(rule)
    batch_size = positive_int("batch_size", batch_size)
    scale = batch_size / positive_int("base_batch_size", base_batch_size)
    if rule == "none":
        return 1.0
    if rule == "linear":
        return scale
    if rule == "sqrt":
        return math.sqrt(scale)
    gain = adascale_gain(scale, grad_sq_norm, trace, base_batch_size)
    return gain if rule == "adascale" else math.sqrt(gain)


def adascale_gain(
    scale: float, grad_sq_norm: float | None, trace: float | None, base_batch_size: int
) -> float:
    """AdaScale's gain ``(σ² + μ²) / (σ²/S + μ²)`` with ``σ² = trΣ/B0``, ``μ² = |G|²``, in
    ``[1, S]``; 1 while the estimates are not usable."""
    if grad_sq_norm is None or trace is None:
        return 1.0
    if not (math.isfinite(grad_sq_norm) and math.isfinite(trace)) or trace < 0:
        return 1.0
    var = trace / base_batch_size
    mu2 = max(grad_sq_norm, 0.0)
    if var + mu2 <= 0:
        return 1.0
    gain = (var + mu2) / (var / scale + mu2)
    return min(max(gain, min(1.0, scale)), max(1.0, scale))


class LRScaling:
    """Multiply param groups' learning rates for one optimizer step, then restore them exactly.

    A user's scheduler keeps owning ``group["lr"]``. Applying again before a restore
    first restores, so factors never compound.
    """

    def __init__(self) -> None:
        self._saved: list | None = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    def apply(self, optimizer: torch.optim.Optimizer, factors: float | Sequence[float]) -> None:
        """Multiply group ``i``'s rate by ``factors[i]`` (or every group's by one factor)."""
        self.restore(optimizer)
        groups = optimizer.param_groups
        each = [factors] * len(groups) if isinstance(factors, numbers.Real) else list(factors)
        if len(each) != len(groups):
            raise ValueError(f"{len(each)} learning-rate factors for {len(groups)} param groups")
        self._saved = [group["lr"] for group in groups]
        for group, factor in zip(groups, each):
            group["lr"] = group["lr"] * factor

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the saved rates back (nothing if none are applied)."""
        if self._saved is not None:
            for group, lr in zip(optimizer.param_groups, self._saved):
                group["lr"] = lr
            self._saved = None


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factors: float | Sequence[float]) -> Iterator[None]:
    """Multiply every group's ``lr`` by ``factors`` inside the block, then restore it exactly."""
    if isinstance(factors, numbers.Real):
        check_number("factors", factors)
    else:
        factors = [check_number(f"factors[{i}]", f) for i, f in enumerate(factors)]
    scaling = LRScaling()
    scaling.apply(optimizer, factors)
    try:
        yield
    finally:
        scaling.restore(optimizer)


def _warmup_then(total: int, warmup: int, decay: Callable[[float], float]) -> Schedule:
    """Linear warm-up over ``warmup`` samples, then ``decay(t)``, t going 0→1 at ``total``."""
    whole_number("total", total)
    whole_number("warmup", warmup)
    if warmup > total:
        raise ValueError(f"warmup ({warmup}) exceeds the total ({total}) samples")

    def schedule(samples: int) -> float:
        if samples < warmup:
            return (samples + 1) / warmup
        if samples >= total:  # (a decay of no length, warmup == total, is over at total too)
            return decay(1.0)
        return decay((samples - warmup) / (total - warmup))

    return schedule


def warmup_cosine(total: int, warmup: int = 0, final: float = 0.0) -> Schedule:
    """Linear warm-up over ``warmup`` samples, then cosine decay to ``final`` at ``total``."""
    final = check_number("final", final)
    return _warmup_then(
        total, warmup, lambda t: final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))
    )


def warmup_linear(total: int, warmup: int = 0, final: float = 0.0) -> Schedule:
    """Linear warm-up over ``warmup`` samples, then linear decay to ``final`` at ``total``."""
    final = check_number("final", final)
    return _warmup_then(total, warmup, lambda t: 1 - (1 - final) * t)


def warmup_poly(total: int, warmup: int = 0, power: float = 2.0) -> Schedule:
    """Linear warm-up over ``warmup`` samples, then ``(1 - t)^power`` to 0 at ``total``
    (the LARS paper's decay at power 2)."""
    power = check_number("power", power, low_open=True)
    return _warmup_then(total, warmup, lambda t: (1 - t) ** power)


def warmup_stable_decay(
    total: int, warmup: int = 0, cooldown: float = 0.2, final: float = 0.0
) -> Schedule:
    """Linear warm-up over ``warmup`` samples, the peak held, then a linear cool-down to
    ``final`` over the last ``cooldown`` fraction of ``total`` (WSD; Hu et al. 2024,
    MiniCPM; Hägele et al. 2024)."""
    check_number("cooldown", cooldown, high=1.0)
    final = check_number("final", final)
    whole_number("total", total)
    if warmup + round(cooldown * total) > total:  # the cool-down would start in the warm-up
        raise ValueError(
            f"a warm-up of {warmup:,} samples and a cool-down of {cooldown:g} of {total:,} "
            "are longer than the run together"
        )
    start = total - round(cooldown * total)
    length = total - start

    def decay(samples: int) -> float:
        if samples < start:
            return 1.0
        if samples >= total:  # (a cool-down of no length is over at total too)
            return final
        return 1 - (1 - final) * (samples - start) / length

    warm = _warmup_then(total, warmup, lambda t: 1.0)
    return lambda samples: warm(samples) if samples < warmup else decay(samples)


def constant(samples: int) -> float:
    """The schedule that leaves the learning rate alone."""
    return 1.0


#: the schedules a config names (``schedule.kind``): warm-up then decay, or none
SCHEDULES = ("cosine", "linear", "poly", "wsd", "constant")


def schedule_by_name(kind: str, total: int, warmup: int, cooldown: float = 0.2) -> Schedule:
    """``warmup_cosine``, ``warmup_linear``, ``warmup_poly`` or ``warmup_stable_decay`` over
    ``total`` samples, or the constant schedule."""
    choice("schedule", kind, SCHEDULES)
    if kind == "wsd":
        return warmup_stable_decay(total, warmup, cooldown)
    if kind == "cosine":
        return warmup_cosine(total, warmup)
    if kind == "linear":
        return warmup_linear(total, warmup)
    if kind == "poly":
        return warmup_poly(total, warmup)
    return constant

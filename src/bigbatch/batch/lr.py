"""Learning-rate rules for a changing batch, and schedules in samples.

A batch-size rule gives the factor by which the learning rate tuned at the
base batch ``B0`` is multiplied at batch ``B`` (docs/algorithms.md, "Batch-size controllers"):

- ``none``: 1;  ``linear``: ``B/B0`` (Goyal et al. 2017);  ``sqrt``: ``sqrt(B/B0)``
  (SimiGrad; Krizhevsky 2014);
- ``adascale``: AdaScale's gain ``r = (σ² + |G|²) / (σ²/S + |G|²)`` with
  ``S = B/B0`` and ``σ² = trΣ / B0`` (Johnson et al. 2020), ``1 ≤ r ≤ S``;
- ``adascale-sqrt``: ``sqrt(r)``, which AdaptDL found right for Adam-type
  optimizers (Adam, AdamW, LAMB, MERIT);
- ``auto``: what the controller's contract says (``Contract.lr_follows``):
  ``none`` under a controller that follows the noise scale, the family's rule
  under one whose batch takes over the schedule's decay, or follows a fixed
  ramp, else the rule measured for the optimizer on the task at hand
  where it has one, else the optimizer family's rule (:data:`FAMILY_RULES`:
  ``sqrt`` for Adam-type, ``linear`` for SGD- and LARS-type), see
  :func:`resolve_lr_rule`.

Why hold the rate when the batch follows the noise: at batch ``B`` the
step size that reduces the loss most is ``ε_max / (1 + B_noise / B)``
(McCandlish et al. 2018, eq. 2.6). A controller that keeps ``B ≈ κ B_noise``
keeps that at ``ε_max κ / (1 + κ)``, the same fraction of the noise-free rate
at every batch; scaling the rate with the batch on top would undo the
noise reduction the larger batch bought (growing the batch at a held rate
acts like a learning-rate decay: Smith et al. 2018).

Since the batch varies, schedules are functions of samples seen, not steps:
``warmup_cosine(total, warmup)``, ``warmup_linear(total, warmup)`` and
``warmup_stable_decay(total, warmup, cooldown)`` return
``f(samples) -> multiplier``; any such callable works as a user schedule.
:class:`LRScaling` multiplies each group's learning rate around the optimizer
step and restores it after, so a user's own ``torch.optim.lr_scheduler`` still
owns ``group["lr"]``.
"""

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
    """The rule ``auto`` stands for (any other rule is returned as it is).

    ``none`` for a controller whose contract's ``lr_follows`` is ``"none"`` (it follows the
    noise scale); the family's rule for one whose is ``"family"`` (its batch
    takes over the schedule's decay, :class:`~bigbatch.batch.Seesaw`, or follows a ramp
    fixed in advance, :class:`~bigbatch.batch.Ramp`); otherwise
    ``measured`` (the rule measured for this optimizer on
    this task, if any), else the family's rule from :data:`FAMILY_RULES`,
    ``sqrt`` for an optimizer of unknown family.
    """
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
    """The multiplier of the base learning rate at ``batch_size`` under ``rule``.

    The AdaScale rules need the smoothed ``|G|²`` and ``tr Σ``; until they are
    finite and positive (the first steps) the gain is 1.
    """
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
    """AdaScale's gain ``(σ² + μ²) / (σ²/S + μ²)`` with ``σ² = trΣ/B0``, ``μ² = |G|²``.

    Between 1 (no noise: a bigger batch does not help) and ``S`` (pure noise:
    linear scaling). Not yet measurable (None, NaN, or non-positive
    estimates): 1 for ``S ≥ 1``.
    """
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

    The one mechanism for every temporary learning-rate change (the batch
    rule and schedule around a step, AGVM's per-group multipliers): the rates
    a user's scheduler set are saved, multiplied, and put back untouched.
    Applying again before a restore first restores (a framework whose
    ``GradScaler`` skipped a step never calls the restore hook), so factors
    never compound.
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
        return decay(min(1.0, (samples - warmup) / max(1, total - warmup)))

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
    """Linear warm-up over ``warmup`` samples, then ``(1 - t)^power`` to 0 at ``total``:
    the LARS paper's and MLPerf ResNet-50's polynomial decay (power 2)."""
    power = check_number("power", power, low_open=True)
    return _warmup_then(total, warmup, lambda t: (1 - t) ** power)


def warmup_stable_decay(
    total: int, warmup: int = 0, cooldown: float = 0.2, final: float = 0.0
) -> Schedule:
    """Linear warm-up over ``warmup`` samples, the peak rate held, then a linear
    cool-down to ``final`` over the last ``cooldown`` fraction of ``total`` samples.

    Warm-up-stable-decay (WSD; Hu et al. 2024, MiniCPM; Hägele et al. 2024), the
    schedule most language-model pretraining runs now use: the stable phase can be
    extended or branched from, and only the cool-down decays.
    """
    check_number("cooldown", cooldown, high=1.0)
    final = check_number("final", final)
    whole_number("total", total)
    start = max(warmup, total - round(cooldown * total))
    length = total - start

    def decay(samples: int) -> float:
        if samples < start:
            return 1.0
        return 1 - (1 - final) * min(1.0, (samples - start) / max(1, length))

    warm = _warmup_then(total, warmup, lambda t: 1.0)
    return lambda samples: warm(samples) if samples < warmup else decay(samples)


def constant(samples: int) -> float:
    """The schedule that leaves the learning rate alone."""
    return 1.0


#: the schedules a config names (``schedule.kind``): warm-up then decay, or none
SCHEDULES = ("cosine", "linear", "poly", "wsd", "constant")


def schedule_by_name(kind: str, total: int, warmup: int, cooldown: float = 0.2) -> Schedule:
    """``warmup_cosine`` / ``warmup_linear`` / ``warmup_poly`` (power 2) /
    ``warmup_stable_decay`` (its last ``cooldown`` of ``total``) over ``total``
    samples, or the constant schedule."""
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

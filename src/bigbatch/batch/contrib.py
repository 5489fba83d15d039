"""Research controllers, each with a section in docs/algorithms.md:
:class:`CriticalBatchRamp`, :class:`WarmupSeesaw`, :class:`DampedSimiGrad`,
:class:`NoiseScale`."""

from __future__ import annotations

import math
from dataclasses import KW_ONLY
from typing import Any

from ..knobs import setting, settings
from .controllers import (
    _CONFIDENCE,
    _CRITICAL_MULTIPLE,
    _FACTOR,
    _GROWTH,
    _INITIAL,
    _MAX,
    _MIN,
    _MULTIPLE,
    _TARGET,
    _WINDOW,
    BatchWarmup,
    Contract,
    _check,
    _check_growth,
    _clamp,
    _Decay,
    _grown,
    _logit,
    _takeover_cap,
    _WarmUp,
    register,
)
from .smoothing import SmoothedNoise, SmoothedValue

__all__ = ["CriticalBatchRamp", "DampedSimiGrad", "NoiseScale", "WarmupSeesaw"]


@register("critical_ramp")
@settings
class CriticalBatchRamp:
    """Grow the batch by ``factor`` once ``multiple · B_simple`` is confidently above the next size.

    Past the rate's warm-up (and ``warmup`` samples), the batch grows to ``⌈factor · B⌉``
    when ``multiple`` × the lower end of the smoothed ``B_simple``'s interval reaches it;
    with ``shrink`` it also shrinks when even the upper end is below the smaller size.
    docs/algorithms.md, "CriticalBatchRamp (the default before BatchWarmup)".
    """

    multiple: float = setting(6.0, **_MULTIPLE)
    initial: int = setting(64, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    factor: float = setting(2.0, **_FACTOR)
    confidence: float = setting(1.0, **_CONFIDENCE)
    window: int = setting(20, **_WINDOW)
    warmup: int = setting(0, "samples before the first decision", low=0)
    shrink: bool = setting(False, "also shrink when the noise scale falls", key="shrink")

    contract = Contract(learns_between_measurements=True, lr_follows="none")
    #: its noise scale learns |G|² from the steps between measurements too

    def __post_init__(self) -> None:
        _check(self)
        self._noise = SmoothedNoise(self.window)
        self._warming = _WarmUp(self.warmup)

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._noise.observe(measured)
        # half a window of evidence before the first decision: two steps' spread is no error bar
        if self._warming(measured, samples) or not self._noise.ready:
            return batch_size
        lower, upper = self._noise.bounds(self.confidence)
        bigger = _grown(self, batch_size)
        if bigger > batch_size and self.multiple * lower >= bigger:
            return bigger
        smaller = max(self.min, math.floor(batch_size / self.factor))
        if self.shrink and smaller < batch_size and self.multiple * upper < smaller:
            return smaller
        return _clamp(self, batch_size)

    def estimate(self) -> dict[str, float]:
        """For logging: the smoothed ``B_simple`` and its bounds."""
        return self._noise.estimate(self.confidence)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self._noise.state_dict(), "schedule": self._warming.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])
        self._warming.last = float(state["schedule"])


@register("warmup_seesaw")
@settings
class WarmupSeesaw(BatchWarmup):
    """:class:`BatchWarmup`'s doublings while the rate is at its peak, then the batch takes over
    the schedule's decay as :class:`Seesaw` does.

    The level doubles as :class:`BatchWarmup`'s batch does (its evidence × ``d`` with
    ``level_at_peak``); past the rate's warm-up the batch is ``level / d``, capped at
    :meth:`cap`. docs/algorithms.md, "WarmupSeesaw: the noise finds the start, the decay
    grows it".
    """

    _: KW_ONLY
    growth: float = setting(8.0, **_GROWTH)
    critical_multiple: float = setting(0.5, **_CRITICAL_MULTIPLE)
    level_at_peak: bool = setting(
        True,
        "the level doubles on the noise scale at the peak rate (B_simple x "
        "the schedule's fall); false: on B_simple as measured, so the decay also raises the "
        "level and the critical-batch cap alone bounds the batch",
        key="level_at_peak",
    )

    contract = Contract(learns_between_measurements=True, lr_follows="family")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_growth(self)
        self._decay = _Decay()
        self._level = self.initial  # the batch the noise asks for at the peak rate

    def critical_batch(self) -> float:
        """:class:`BatchWarmup`'s estimate, times ``d`` with ``level_at_peak``."""
        return super().critical_batch() * (self._decay.value if self.level_at_peak else 1.0)

    def cap(self) -> float:
        """``min(max, growth × level, critical_multiple × upper(B_simple))``; 0 until ready."""
        return _takeover_cap(self, self._level, self._noise)

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._decay.update(measured, samples)
        self._level = super().next(measured, self._level, samples)
        # the level is the noise's own choice; the cap bounds only the decay's growth on it
        wanted = max(self._level, min(self._level * self._decay.growth(1.0), self.cap()))
        return _clamp(self, max(batch_size, math.floor(wanted + 1e-9)))

    def estimate(self) -> dict[str, float]:
        """:class:`BatchWarmup`'s, the level, the schedule's decay and the cap."""
        return {
            **super().estimate(),
            "level": float(self._level),
            "decay": self._decay.value,
            "batch_cap": self.cap(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "level": self._level, "takeover": self._decay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._level = int(state["level"])
        self._decay.load_state_dict(state["takeover"])


@register("damped_simigrad")
@settings
class DampedSimiGrad:
    """SimiGrad's target similarity, held by a damped log-space PI loop that settles.

    ``log B`` moves by ``proportional · Δerror + integral · error`` (at most ``max_rate``
    a step), the error being ``log(B*/B)`` outside the evidence's interval and
    ``dead_band``; the batch changes once ``log B`` has moved ``min_change``.
    docs/algorithms.md, "DampedSimiGrad".
    """

    # a logit's domain: (0, 1)
    target: float = setting(1 / 3, **{**_TARGET, "low": 0, "low_open": True, "high_open": True})
    initial: int = setting(64, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    window: int = setting(20, **_WINDOW)
    confidence: float = setting(2.0, "standard errors of the similarity's interval", low=0)
    dead_band: float = setting(0.2, "log-batch error ignored around the target", low=0)
    integral: float = setting(0.2, "integral gain", low=0, low_open=True)
    proportional: float = setting(0.5, "proportional gain", low=0)
    max_rate: float = setting(0.1, "largest move of log B per step", low=0, low_open=True)
    min_change: float = setting(0.25, "smallest move of log B that changes the batch", low=0)
    warmup: int = setting(0, "samples before the first decision", low=0)

    contract = Contract(reads_similarity=True, lr_follows="none")
    #: decides on the measured half-batch cosine: keep the split (two micro-batches)

    def __post_init__(self) -> None:
        _check(self)
        self._similarity = SmoothedValue(self.window)
        self._error = 0.0
        self._log_batch = math.log(self.initial)
        self._warming = _WarmUp(self.warmup)

    def error(self) -> float:
        """``log(B*/B)`` beyond the evidence's interval and the dead band; 0 inside."""
        low, high = self._similarity.interval(self.confidence)
        goal = _logit(self.target)
        # a higher similarity means a batch larger than needed: the error has the other sign
        below = goal - _logit(min(0.99, max(0.01, high))) - self.dead_band
        above = goal - _logit(min(0.99, max(0.01, low))) + self.dead_band
        if math.isinf(high) or below <= 0 <= above:
            return 0.0
        return below if below > 0 else above

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._similarity.update(measured.get("similarity", math.nan))
        if self._warming(measured, samples):
            self._log_batch = math.log(batch_size)
            return batch_size
        error = self.error()
        move = self.proportional * (error - self._error) + self.integral * error
        self._error = error
        move = min(self.max_rate, max(-self.max_rate, move))
        low, high = math.log(self.min), math.log(self.max)
        self._log_batch = min(high, max(low, self._log_batch + move))
        if abs(self._log_batch - math.log(batch_size)) < self.min_change:
            return batch_size
        # round away from the current size, so the move is never below min_change
        target = math.exp(self._log_batch)
        new = math.ceil(target) if target > batch_size else math.floor(target)
        return _clamp(self, new)

    def state_dict(self) -> dict[str, Any]:
        return {
            "similarity": self._similarity.state_dict(),
            "error": self._error,
            "log_batch": self._log_batch,
            "schedule": self._warming.last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._similarity.load_state_dict(state["similarity"])
        self._error = float(state["error"])
        self._log_batch = float(state["log_batch"])
        self._warming.last = float(state["schedule"])


@register("noise_scale")
@settings
class NoiseScale:
    """``B = multiple · B_simple``, clamped, re-chosen when it moves by more than ``threshold``.

    docs/algorithms.md, "NoiseScale, Constant, Ramp".
    """

    multiple: float = setting(1.0, **_MULTIPLE)
    initial: int = setting(64, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    threshold: float = setting(0.05, "relative move of the wanted batch that changes it", low=0)
    window: int = setting(20, **_WINDOW)

    contract = Contract(learns_between_measurements=True, lr_follows="none")
    #: its noise scale learns |G|² from the steps between measurements too

    def __post_init__(self) -> None:
        _check(self)
        self._noise = SmoothedNoise(self.window)

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._noise.observe(measured)
        noise = self._noise.noise_scale()
        if not math.isfinite(noise) or noise <= 0:
            return batch_size
        # clamped before rounding: a noise scale near the float limit times κ is inf
        wanted = _clamp(self, self.multiple * noise)
        if abs(wanted - batch_size) <= self.threshold * batch_size:
            return batch_size
        return wanted

    def estimate(self) -> dict[str, float]:
        """For logging: the smoothed ``B_simple`` (bounds at one standard error)."""
        return self._noise.estimate(1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self._noise.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])

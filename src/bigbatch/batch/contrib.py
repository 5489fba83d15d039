"""Research controllers: kept, measured, and not the ones to pick first.

Each is in the command line's registry (``batch.controller``) and documented with its
results in docs/results.md and docs/algorithms.md:

- :class:`CriticalBatchRamp` (the default before ``batch_warmup``): a monotone ramp that
  doubles the batch once ``κ · B_simple`` is confidently above the next size, the rate
  held (the critical batch grows during training: McCandlish et al. 2018; Merrill et
  al. 2025).
- :class:`WarmupSeesaw`: :class:`~bigbatch.batch.BatchWarmup`'s doublings find the batch
  while the rate is at its peak, then the batch takes over the decay as in
  :class:`~bigbatch.batch.Seesaw` (a negative result against the two alone).
- :class:`DampedSimiGrad`: SimiGrad's similarity target held by a damped log-space
  proportional–integral loop with a dead band, so it settles instead of cycling.
- :class:`NoiseScale`: ``B = κ · B_simple`` (McCandlish et al. 2018), re-chosen only when
  it moves by more than 5%, as AdaptDL re-chooses.
"""

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

    The critical batch, beyond which a larger batch stops saving optimizer
    steps, is about the noise scale ``B_simple = tr Σ / |G|²`` (McCandlish et
    al. 2018) and grows as training proceeds (McCandlish et al.; Zhang et al.
    2024; Merrill et al. 2025, whose batch-size warm-up from the measured
    critical batch took 43% of OLMo's steps away). This controller follows it
    upward in discrete steps and never comes back down, so it has no cycle to
    fall into:

    - every step, the step's unbiased ``|G|²`` and ``tr Σ`` estimates feed a
      :class:`~bigbatch.batch.smoothing.SmoothedNoise` (numerator and
      denominator averaged apart over ``window`` steps, with standard errors);
    - once the learning rate has warmed up (``warmup`` samples have passed
      and the schedule multiplier, ``measured["schedule"]``, has stopped
      rising), when the lower end of ``B_simple``'s interval
      at ``confidence`` standard errors, times ``multiple``, reaches the next
      size ``⌈factor · B⌉``, the batch grows to it (clamped to ``max``); a
      noise scale that is merely jumping around never passes that test;
    - with ``shrink=True`` it also halves (by ``factor``) once even the upper
      end of the interval, times ``multiple``, is below the smaller size;
      off by default.

    Choosing ``multiple`` (κ): 1 trains at the critical batch, where doubling
    the batch still nearly halves the steps; larger values buy fewer steps
    with more samples. Growing the batch while the learning rate is *not*
    scaled up with it (``lr_scaling="none"``) also lowers the gradient noise
    the way a learning-rate decay does (Smith et al. 2018, "Don't decay the
    learning rate, increase the batch size"). During a learning-rate warm-up
    the noise scale is high but the small learning rate, not the noise,
    limits progress, so the batch is held while the schedule rises (and for
    ``warmup`` samples, for a warm-up the controller cannot see).

    κ = 6 and ×2 were chosen on MNIST-1D and the ``lm`` task only, from batch 256
    (docs/results.md, the evidence benchmark: κ = 4, 6 and 8); the first batch
    is 64, as for every controller.
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
        """What decides, for logging: the smoothed ``B_simple`` and its bounds."""
        return self._noise.estimate(self.confidence)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self._noise.state_dict(), "schedule": self._warming.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])
        self._warming.last = float(state["schedule"])


@register("warmup_seesaw")
@settings
class WarmupSeesaw(BatchWarmup):
    """:class:`BatchWarmup`'s doublings while the rate is at its peak, then the batch takes
    over the schedule's decay as :class:`Seesaw` does.

    Seesaw grows from a fixed start, and the start decides what it saves: below the
    best static batch it pays for the small batch all run, above it the loss is lost
    before the decay begins (docs/results.md, issue 53). Here the start is found as the
    default controller finds its batch: from ``initial``, the *level* doubles once
    ``κ · B_simple`` is confidently above the next size (:class:`BatchWarmup`, every
    setting of which applies). Past the rate's warm-up, where the schedule has fallen to
    ``d = m / m_peak``, the batch is ``level / d`` (Smith et al. 2018; Meterez et al.
    2025), up to the cap: ``max``, ``growth × level`` and ``critical_multiple`` times
    the upper end of ``B_simple`` (McCandlish et al. 2018), as for Seesaw. Beyond the
    cap the rest of the decay stays with the rate, so the run ends annealed.

    With ``level_at_peak`` (the default) the level's evidence is the noise scale times
    ``d``: near a noise-dominated equilibrium ``|G|²`` falls with the rate, so
    ``B_simple`` rises as ``1/d`` during the decay. Weighed by ``d``, it is the noise
    scale at the peak rate, and the decay's growth is the takeover's alone instead of
    being counted twice; without it the level doubles on ``B_simple`` as measured and
    only the critical-batch cap bounds the takeover. The rate follows the batch by the
    optimizer family's rule (``Contract.lr_follows``): ×√ratio for Adam-type optimizers, at
    both kinds of change. Measured against the default on four tasks (docs/results.md,
    "The start from the noise scale"), either form trades steps for loss rather than
    saving both, so it is not the default.
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
        """The estimate a doubling of the level must clear: :class:`BatchWarmup`'s, times
        the schedule's decay ``d`` (the noise scale at the peak rate) with ``level_at_peak``."""
        return super().critical_batch() * (self._decay.value if self.level_at_peak else 1.0)

    def cap(self) -> float:
        """The largest batch now: ``max``, ``growth × level``, ``critical_multiple ×
        upper(B_simple)``; 0 while that estimate has fewer than ``window / 2`` steps."""
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

    Under the noise model of the statistics, equal halves of a batch ``B``
    have similarity ``s = 1 / (1 + 2 B_simple / B)``, so ``logit(s*) -
    logit(s) = log(B* / B)``: the error in logit space is the log-ratio
    between the batch that would give the target and the current one. The
    controller acts on it like a process controller, not a thermostat:

    - the similarity is averaged over ``window`` steps with a standard error
      (:class:`~bigbatch.batch.smoothing.SmoothedValue`); the error is the
      logit distance from the target to the interval ``mean ± confidence``
      standard errors, less a ``dead_band`` (log-batch units), and zero when
      the target lies within: hysteresis sized by the evidence, so noise
      around the set point moves nothing;
    - ``log B`` moves by ``proportional · Δerror + integral · error`` (the
      velocity form of a PI controller), at most ``max_rate`` per step, and
      stays within ``[log min, log max]`` (no integral wind-up at a bound);
    - the batch itself changes only once ``log B`` has moved ``min_change``
      away from it (×1.28 by default): it moves in discrete steps, never by a
      sample at a time.

    With the defaults a batch far from its target moves by about 10% per step
    (SimiGrad's pace) and stops inside the interval instead of overshooting
    behind a 20-step average. The batch is held while the learning-rate
    schedule rises (``measured["schedule"]``) and for ``warmup`` samples. The
    published controller is :class:`SimiGrad`.
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

    ``B_simple`` is the steps' ``|G|²`` and ``tr Σ`` averaged apart over
    ``window`` steps (:class:`~bigbatch.batch.smoothing.SmoothedNoise`);
    ``multiple`` (κ) 1 trains at the critical batch. A noise scale not yet
    known (a noise-dominated start can give a negative ``|G|²`` average)
    keeps the batch.
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
        """What decides, for logging: the smoothed ``B_simple`` (bounds at one standard error)."""
        return self._noise.estimate(1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self._noise.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])

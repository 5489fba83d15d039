"""Batch-size controllers: pure decisions from statistics and explicit state.

Each controller answers one question, "given what this step measured and the
current batch size, what is the next batch size?", and keeps whatever memory
it needs in plain Python state that ``state_dict()`` returns. None touches a
model, so all are tested without one.

- :class:`SimiGrad` (Qin et al., NeurIPS 2021): hold the half-split gradient
  cosine at a target, growing the batch ×1.1 when it is below and shrinking
  ×0.9 when above (docs/algorithms.md, "Batch-size controllers").
- :class:`BatchWarmup` (the default): start small and double the batch once
  a quarter of the smoothed noise scale has grown past the next size
  (Merrill et al. 2025's batch-size warm-up, kept sample-efficient for a
  budget in samples; up to the noise scale itself where the loss has
  stopped falling with more samples), the rate following by the optimizer
  family's rule (in ``bigbatch train``, a built-in task's measured rule first).
- :class:`Seesaw`: the batch takes over the learning-rate schedule's decay
  (Smith et al. 2018; Meterez et al. 2025), capped by the critical batch.
- :class:`Constant` and :class:`Ramp`: the static and scheduled baselines.

The research controllers (the former default ``CriticalBatchRamp``,
``WarmupSeesaw``, ``DampedSimiGrad``, ``NoiseScale``) are in
:mod:`bigbatch.batch.contrib`. Why the published SimiGrad rule cycles, and what
the damped one does instead, is in ``docs/algorithms.md`` ("Batch-size
controllers"). Each controller says what it reads and how the rate follows its
batch in one :class:`Contract`, and :func:`register` names it for the command
line's ``batch.controller``.

Every controller is a dataclass of its settings (:func:`bigbatch.knobs.settings`):
each argument's default, bounds, help and config key are written once, as a
field; the checks, the ``repr`` and ``CONFIG`` come from them. The state a
controller learns is kept apart, in private attributes that ``state_dict``
returns.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

from .._checks import batch_bounds, pair, positive_int
from ..duration import Duration
from ..knobs import check_settings, setting, settings
from .smoothing import LossSlope, SmoothedNoise

# The settings several controllers share (bigbatch.knobs.setting's arguments): the config
# key (``batch.<key>``), its help and its bounds, written once
_INITIAL = dict(key="initial", help="first batch size (samples)", low=1)
_MIN = dict(key="min", help="smallest batch size", low=1)
_MAX = dict(key="max", help="largest batch size", low=1)
_WINDOW = dict(key="window", help="steps of evidence averaged per decision", low=1)
_MULTIPLE = dict(
    key="noise_multiple",
    help="kappa: the batch follows kappa * B_simple (the critical batch at 1)",
    low=0,
    low_open=True,
)
_FACTOR = dict(key="factor", help="growth factor of each change", low=1, low_open=True)
_CONFIDENCE = dict(key="confidence", help="standard errors of evidence a change needs", low=0)
_TARGET = dict(
    key="target",
    help="similarity s* held (B settles near 2 B_simple s*/(1-s*); 1/3: the critical batch)",
    low=-1,
    high=1,
)
_CLIP = dict(low=0, low_open=True)
# the controllers whose batch takes over the schedule's decay
_GROWTH = dict(
    key="max_growth",
    help="the batch grows to at most this multiple of its start (seesaw: batch.initial; "
    "warmup_seesaw: the batch the noise scale chose) (0: no such cap)",
    low=0,
)
_CRITICAL_MULTIPLE = dict(
    key="critical_multiple",
    help="the batch stops at this multiple of the noise scale B_simple's upper bound, the "
    "run's critical-batch estimate (0: no such cap)",
    low=0,
)


@dataclass(frozen=True)
class Contract:
    """What a controller reads and how the learning rate follows its batch: the one record
    the loop, the engine and the command line ask a controller about.

    ``needs_statistics``: it reads the gradient statistics (else a run may take none).
    ``reads_similarity``: it decides on the measured half-batch cosine, so per-example
    statistics keep two micro-batches for it. ``learns_between_measurements``: with
    ``statistics_every > 1`` it is also called on the steps between measurements, whose
    ``measured`` holds the batch gradient's ``batch_grad_sq_norm`` and its
    ``batch_inverse_size`` instead of the statistics
    (:meth:`~bigbatch.batch.smoothing.SmoothedNoise.observe`). ``lr_follows``: what
    ``lr_scaling="auto"`` is under it (``bigbatch.batch.lr``): ``"none"`` where its batch
    follows the noise scale (the rate held), ``"family"`` where its batch takes over the
    schedule's decay or follows a fixed ramp (the optimizer family's rule), ``"task"`` (the
    rule a task measured for the optimizer, else the family's).
    """

    needs_statistics: bool = True
    reads_similarity: bool = False
    learns_between_measurements: bool = False
    lr_follows: str = "task"

    def __post_init__(self) -> None:
        if self.lr_follows not in LR_FOLLOWS:
            raise ValueError(
                f"lr_follows must be one of {', '.join(map(repr, LR_FOLLOWS))}, "
                f"got {self.lr_follows!r}"
            )


#: what ``lr_scaling="auto"`` may follow under a controller (:attr:`Contract.lr_follows`)
LR_FOLLOWS = ("none", "family", "task")


def contract_of(controller: Any) -> Contract:
    """``controller``'s :class:`Contract` (its ``contract`` attribute); a controller of the
    user's own without one reads the statistics and lets the rate follow the task's rule."""
    contract = getattr(controller, "contract", None)
    return contract if isinstance(contract, Contract) else Contract()


#: every controller by its config name (``batch.controller``), as :func:`register` adds them
CONTROLLERS: dict[str, type] = {}


def register(name: str):
    """Add a controller class to :data:`CONTROLLERS` under ``name`` (a class decorator)."""

    def add(cls: type) -> type:
        if name in CONTROLLERS:
            raise ValueError(f"a controller is registered as {name!r} already")
        CONTROLLERS[name] = cls
        return cls

    return add


class Controller(Protocol):
    """``next(measured, batch_size, samples) -> batch_size``; plain-data state.

    ``measured`` holds the step's statistics as floats (``similarity``, and
    the step's unbiased ``grad_sq_norm`` and ``trace``), its rate multiplier
    ``lr_factor`` and ``schedule``; ``samples`` the samples trained on
    including this step. ``contract`` (a :class:`Contract`) says what it reads and
    how the learning rate follows its batch.

    A controller that decides on the noise scale also has ``estimate() ->
    dict[str, float]``: the ``noise_scale`` it acts on, with its
    ``noise_scale_low`` and ``noise_scale_high`` bounds (and whatever else
    it compares), which the engine logs as the step's noise scale.
    """

    initial: int
    min: int
    max: int
    contract: Contract

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@register("batch_warmup")
@settings
class BatchWarmup:
    """Start small; double the batch once a fraction of the noise scale has grown past it.

    The batch-size warm-up of Merrill et al. 2025 ("Critical batch size
    revisited", arXiv:2505.23971), who measure the critical batch of a
    language model by branched training, find it small early and growing,
    and double the batch when it has grown, with Adam's rate ×√2 per
    doubling. Branched runs are too costly for every run, so this
    controller follows the noise scale ``B_simple = tr Σ / |G|²``
    (McCandlish et al. 2018) that every step measures almost for free:

    - **A fraction of it, because the budget is in samples.** A batch ``B``
      spends ``1 + B / B_noise`` times the samples the smallest batches
      would need for the same progress (McCandlish et al.'s
      ``(S/S_min − 1)(E/E_min − 1) = 1`` with ``S = S_min (1 + B_noise/B)``): at
      the noise scale itself (``multiple = 1``) half the budget's samples
      are wasted, which a run whose budget is fixed in samples pays in
      final loss (measured on ``text``: +0.06 nats per byte). The default
      ``multiple = 0.25`` keeps about 80% of the samples' worth.
    - **Unless samples no longer buy loss.** The waste costs about
      ``slope · ln(1 + κ)`` of loss, ``slope`` being the training loss's fall
      per e-fold of samples (:class:`~bigbatch.batch.smoothing.LossSlope`,
      fitted over ``slope_span`` e-folds once the rate's warm-up is over).
      κ rises to ``expm1(loss_lag / slope)`` at the slope's upper bound, at
      most ``max_multiple``: on ``lm``, whose loss is flat after a tenth of
      its budget, the batch then follows the noise scale itself; on ``text``
      the loss keeps falling and κ stays ``multiple`` (on ``mnist1d`` until
      the last 3% of the budget). The
      span is a whole e-fold and κ stops at the critical batch because a loss
      can also stall and then fall again (``text`` at twice its best rate:
      a half-e-fold fit with κ up to 4 grew the batch on such a plateau and
      cost 0.09 nats). ``loss_lag`` is in the loss's units (0: κ fixed).
    - **It rises late, and growth there is cheap.** Where the rate decays,
      ``|G|²`` falls and ``B_simple`` rises; a larger batch then acts as a
      further decay of the noise (Smith et al. 2018, "Don't decay the
      learning rate, increase the batch size"), and on the three tuning
      tasks the late doublings cost no measurable loss while the early ones
      did. ``decay_power`` > 0 weighs the estimate by the schedule's
      multiplier ``s`` (``measured["schedule"]``) to the power given, for
      users who want that growth held back.
    - **One step's estimate is noisy** (``|G|²`` spreads 0.7–2× its mean on
      the default task): numerator and denominator are averaged apart over
      ``window`` steps (:class:`~bigbatch.batch.smoothing.SmoothedNoise`),
      each new value winsorised at ``clip`` spreads so one outlier cannot
      trigger a change, and the lower end of the interval at ``confidence``
      standard errors must clear the next size.

    After each change the average restarts (the estimates were taken at the
    old batch and rate) and the next decision waits for ``window / 2`` new
    steps. The batch never shrinks.

    Its contract's ``lr_follows`` is ``"task"``: under ``lr_scaling="auto"`` the rate
    follows the batch by the optimizer family's rule (``sqrt`` for Adam-type optimizers,
    Merrill et al.'s ×√2 per doubling; ``linear`` for SGD- and LARS-type), or
    in ``bigbatch train`` by the rule a built-in task measured for the optimizer.
    The defaults were chosen on ``mnist1d``, ``lm`` and ``text``
    (docs/results.md, "Adaptive batching on a task nobody tuned it on").
    """

    multiple: float = setting(0.25, **_MULTIPLE)
    initial: int = setting(16, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    factor: float = setting(2.0, **_FACTOR)
    confidence: float = setting(1.0, **_CONFIDENCE)
    window: int = setting(20, **_WINDOW)
    decay_power: float = setting(
        0.0,
        "the noise scale is weighed by the schedule's LR multiplier to this power, so its "
        "rise where the rate is small (warm-up, decay) grows the batch less (0: off)",
        key="decay_power",
        low=0,
    )
    clip: float = setting(
        3.0,
        "each step's |G|^2 and tr(Sigma) are held within this many spreads of their "
        "averages (one outlier step cannot change the batch)",
        key="clip",
        **_CLIP,
    )
    loss_lag: float = setting(
        0.015,
        "where the loss falls slowly with more samples (after the schedule's warm-up), "
        "kappa rises so that the batch leaves the loss behind by at most this much "
        "(loss units; 0: kappa fixed)",
        key="loss_lag",
        low=0,
    )
    max_multiple: float = setting(
        1.0,
        "the largest kappa the loss_lag rule may choose (at or below noise_multiple: off)",
        key="max_multiple",
        low=0,
        low_open=True,
    )
    slope_span: float = setting(
        1.0,
        "e-folds of samples over which the loss's slope is fitted (the loss_lag rule)",
        key="slope_span",
        low=0,
        low_open=True,
    )

    #: its noise scale learns |G|² from the steps between measurements too
    contract = Contract(learns_between_measurements=True)

    def __post_init__(self) -> None:
        _check(self)
        self._noise = SmoothedNoise(self.window)
        self._slope = LossSlope(span=self.slope_span)
        self._schedule = 1.0  # the last step's rate multiplier
        self._warming = _WarmUp(0)
        self._warmed = False  # the rate's warm-up is over: the loss's slope means something

    def current_multiple(self) -> float:
        """κ now: ``multiple``, raised to ``expm1(loss_lag / slope)`` (at most
        ``max_multiple``) where the loss falls slowly per e-fold of samples.

        A batch at ``κ · B_noise`` needs ``1 + κ`` times the samples for the
        same progress, so it leaves the loss behind by ``slope · ln(1 + κ)``
        (:class:`~bigbatch.batch.smoothing.LossSlope`); this is the κ whose
        lag is ``loss_lag`` at the largest plausible size of the slope,
        ``|slope|`` plus ``confidence`` standard errors: an uncertain slope
        does not grow the batch, and neither does a rising loss (a rate too
        high, which growth with a rate that follows the batch would feed).
        The slope is fitted only from the step after the schedule's warm-up
        (a loss flat because the rate is still small is no sign that samples
        stopped helping), and only where the controller sees the schedule
        (``measured["schedule"]``): a warm-up it cannot see would read as a
        flat loss, so without one κ stays ``multiple``.
        """
        if self.loss_lag == 0:
            return self.multiple
        slope, error = self._slope.fit()
        if not math.isfinite(slope):
            return self.multiple
        size = abs(slope) + self.confidence * error
        ratio = self.loss_lag / size if size > 0 else math.inf
        return max(self.multiple, min(self.max_multiple, math.expm1(min(ratio, 50.0))))

    def critical_batch(self) -> float:
        """The estimate a change must clear: ``κ · lower(B_simple) · s^decay_power``."""
        lower, _ = self._noise.bounds(self.confidence)
        return self.current_multiple() * lower * self._schedule**self.decay_power

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._noise.observe(measured, self.clip)
        schedule = measured.get("schedule", math.nan)
        # while the rate warms up the loss is flat because the rate is small, not because
        # samples no longer help: the slope is fitted from the first step after the warm-up
        if math.isfinite(schedule):
            self._warmed = self._warmed or not self._warming(measured, samples)
        if self.loss_lag > 0 and self._warmed:
            self._slope.update(measured.get("loss", math.nan), samples)
        self._schedule = max(0.0, schedule) if math.isfinite(schedule) else 1.0
        if not self._noise.ready:
            return batch_size
        bigger = _grown(self, batch_size)
        if bigger > batch_size and self.critical_batch() >= bigger:
            self._noise.reset()
            return bigger
        return _clamp(self, batch_size)

    def estimate(self) -> dict[str, float]:
        """What decides, for logging: ``B_simple`` with its bounds, and the critical batch."""
        out = {**self._noise.estimate(self.confidence), "critical_batch": self.critical_batch()}
        if self.loss_lag > 0:
            out.update(loss_slope=self._slope.slope(), noise_multiple=self.current_multiple())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "noise": self._noise.state_dict(),
            "schedule": self._schedule,
            "slope": self._slope.state_dict(),
            "warming": self._warming.last,
            "warmed": self._warmed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])
        self._schedule = float(state["schedule"])
        self._slope.load_state_dict(state["slope"])
        self._warming.last = float(state["warming"])
        self._warmed = bool(state["warmed"])


@register("seesaw")
@settings
class Seesaw:
    """Grow the batch where the schedule lowers the rate, up to the critical batch.

    Past the rate's warm-up, wherever the learning-rate schedule has fallen
    to a fraction ``d = m(s) / m_peak`` of its peak, the batch is
    ``initial / d``: the batch takes over the decay. Under the optimizer
    family's rule (``lr_scaling="auto"`` resolves to it for this controller,
    its contract's ``lr_follows``) the rate then moves so that the run is the
    same run in its noise, only in fewer steps:

    - SGD-type (momentum SGD, LARS, their VR forms; the ``linear`` rule):
      the rate ``η0 · (B/B0) · m`` stays at its peak while the batch grows
      by ``1/d`` — a batch ×α at a held rate acts like a rate ÷α (Smith et
      al. 2018, "Don't decay the learning rate, increase the batch size");
    - Adam-type (AdamW, LAMB, MERIT, their VR forms; the ``sqrt`` rule):
      the rate ``η0 · √(B/B0) · m`` falls by ``√d`` — a batch ×α with the
      rate ÷√α acts like a rate ÷α (Seesaw, Meterez et al. 2025,
      arXiv:2510.14717).

    The batch stops at its cap, the smallest of ``max``, ``growth × initial``
    and ``critical_multiple`` times the upper end of the smoothed noise
    scale ``B_simple`` (McCandlish et al. 2018; the interval at
    ``confidence`` standard errors, :class:`~bigbatch.batch.smoothing.SmoothedNoise`):
    past the critical batch a larger batch no longer acts like a decay
    (Seesaw's own finding; McCandlish et al.'s steps-samples trade-off).
    Beyond the cap the schedule's remaining decay stays with the rate
    (the rule's factor times ``m``), so the run still ends annealed. The
    cap is logged beside the batch (:meth:`estimate`, ``batch_cap``).

    ``granularity`` 1 follows the schedule continuously (any whole batch);
    2 moves in doublings (``initial × 2^k``, the largest power the decay has
    passed), as Seesaw and OLMo-core's batch-size schedule do. The batch
    never shrinks. A warm-up (the schedule multiplier rising,
    ``measured["schedule"]``) and a stable phase (warm-up-stable-decay)
    grow nothing; without a schedule the batch stays at ``initial``.

    The savings are bounded by the schedule: a run that decays to zero
    saves at most ``1 − mean(m)`` of its steps (half for cosine), less the
    part of the decay the cap returns to the rate. Defaults and their
    measurements: docs/algorithms.md ("The batch takes over the decay") and
    docs/results.md.
    """

    initial: int = setting(16, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    growth: float = setting(8.0, **_GROWTH)
    granularity: float = setting(
        1.0,
        "the batch moves in powers of this factor (1: follows the schedule "
        "continuously; 2: doublings)",
        key="granularity",
        low=1,
    )
    critical_multiple: float = setting(0.5, **_CRITICAL_MULTIPLE)
    confidence: float = setting(1.0, **_CONFIDENCE)
    window: int = setting(20, **_WINDOW)
    clip: float = setting(3.0, "spreads each step's |G|^2 and tr(Sigma) are held within", **_CLIP)

    #: the batch replaces the schedule's decay: ``lr_scaling="auto"`` is the optimizer
    #: family's equivalence rule (``bigbatch.batch.lr.FAMILY_RULES``), never a rule measured
    #: for a static batch; its noise scale learns |G|² from the steps between measurements
    #: too, and it reads none without the noise cap (set by the settings)
    contract = Contract(learns_between_measurements=True, lr_follows="family")

    def __post_init__(self) -> None:
        _check(self)
        _check_growth(self)
        self.contract = Contract(
            needs_statistics=self.critical_multiple > 0,
            learns_between_measurements=True,
            lr_follows="family",
        )
        self._noise = SmoothedNoise(self.window)
        self._decay = _Decay()

    def cap(self) -> float:
        """The largest batch now: ``max``, ``growth × initial``, ``critical_multiple ×
        upper(B_simple)``; 0 while that estimate has fewer than ``window / 2`` steps
        behind it (the batch holds: two steps' spread is no error bar)."""
        return _takeover_cap(self, self.initial, self._noise)

    def wanted(self) -> float:
        """The batch that takes over the decay so far: ``initial / d`` (in powers of
        ``granularity`` unless it is 1), before the cap."""
        return self.initial * self._decay.growth(self.granularity)

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._noise.observe(measured, self.clip)
        self._decay.update(measured, samples)
        # the cap is at most max, so this is finite; round down to a whole batch, never below
        # the current one: the batch never shrinks
        new = max(batch_size, math.floor(min(self.wanted(), self.cap()) + 1e-9))
        return _clamp(self, new)

    def estimate(self) -> dict[str, float]:
        """What decides, for logging: ``B_simple`` with its bounds, the schedule's decay
        ``d``, and the cap the batch stops at."""
        return {
            **self._noise.estimate(self.confidence),
            "decay": self._decay.value,
            "batch_cap": self.cap(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"noise": self._noise.state_dict(), **self._decay.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])
        self._decay.load_state_dict(state)


@register("simigrad")
@settings
class SimiGrad:
    """SimiGrad's controller: hold the mean half-batch gradient cosine at ``target``.

    Every ``interval`` steps, with ``s`` the mean of the last ``window`` finite
    similarities: if ``s < target`` the gradient is noisy, so
    ``B ← max(B + 1, ⌊growth · B⌋)``; if ``s > target``,
    ``B ← max(1, min(B - 1, ⌊shrink · B⌋))``; then clamp to ``[min, max]``.
    Non-finite similarities are skipped (the batch does not move on them).

    Choosing ``target``: equal halves of a batch ``B`` have similarity about
    ``1 / (1 + 2 B_simple / B)`` (docs/algorithms.md, "Gradient statistics"), so
    the controller settles near ``B = 2 B_simple s* / (1 - s*)``. The default
    ``s* = 1/3`` settles at ``B ≈ B_simple``, the critical batch of McCandlish et al. (2018), where
    doubling the batch still nearly halves the steps; a higher target buys
    fewer steps with more samples (0.8 → ``8 B_simple``, SimiGrad's BERT
    setting), a lower one the reverse (its CIFAR-10 runs used 0–0.2).

    This is the published rule, kept exactly: with a noisy similarity it is a
    bang-bang loop behind a ``window``-step delay and saws the batch up and
    down (a limit cycle; see :class:`DampedSimiGrad` for a controller that
    settles).
    """

    target: float = setting(1 / 3, **_TARGET)
    initial: int = setting(64, **_INITIAL)
    min: int = setting(16, **_MIN)
    max: int = setting(16384, **_MAX)
    _: KW_ONLY
    window: int = setting(20, **_WINDOW)
    interval: int = setting(1, "steps between decisions", low=1)
    growth: float = setting(1.1, "factor of a growth", low=1, low_open=True)
    shrink: float = setting(0.9, "factor of a shrink", low=0, high=1, low_open=True, high_open=True)

    #: decides on the measured half-batch cosine: keep the split (two micro-batches)
    contract = Contract(reads_similarity=True)

    def __post_init__(self) -> None:
        _check(self)
        self._recent: deque[float] = deque(maxlen=self.window)
        self._steps = 0

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        similarity = measured.get("similarity", math.nan)
        if math.isfinite(similarity):
            self._recent.append(similarity)
        self._steps += 1
        if not self._recent or self._steps % self.interval:
            return batch_size
        mean = sum(self._recent) / len(self._recent)
        if mean < self.target:
            batch_size = max(batch_size + 1, math.floor(self.growth * batch_size))
        elif mean > self.target:
            batch_size = max(1, min(batch_size - 1, math.floor(self.shrink * batch_size)))
        return _clamp(self, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent = deque((float(s) for s in state["recent"]), maxlen=self.window)
        self._steps = int(state["steps"])


class _WarmUp:
    """Whether the learning rate is still warming up: before ``samples`` or while the
    schedule multiplier rises from step to step."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.last = -math.inf  # the previous step's schedule multiplier

    def __call__(self, measured: dict[str, float], samples: int) -> bool:
        schedule = measured.get("schedule", math.nan)
        rising = math.isfinite(schedule) and schedule > self.last
        if math.isfinite(schedule):
            self.last = schedule
        return samples < self.samples or rising


class _Decay:
    """The schedule's fall from its peak, ``d = m / m_peak``, once its warm-up is over
    (1 before it, and without a schedule): what a controller that takes over the decay
    multiplies its batch by, as ``1 / d``."""

    def __init__(self) -> None:
        self.peak = -math.inf  # the schedule's largest multiplier so far
        self.warming = _WarmUp(0)  # a rising multiplier is a warm-up
        self.value = 1.0

    def update(self, measured: dict[str, float], samples: int) -> None:
        schedule = measured.get("schedule", math.nan)
        rising = self.warming(measured, samples)
        if math.isfinite(schedule):
            self.peak = max(self.peak, schedule)
            if not rising and self.peak > 0:
                self.value = max(0.0, schedule) / self.peak

    def growth(self, granularity: float) -> float:
        """``1 / d``, in powers of ``granularity`` unless it is 1 (the largest power the
        decay has passed); infinite for a decay to (a float's) nothing."""
        ratio = 1.0 / self.value if self.value > 0 else math.inf
        if granularity > 1 and math.isfinite(ratio):
            # a hair of slack for 1/0.5 = 2.0000001
            ratio = granularity ** math.floor(math.log(ratio, granularity) + 1e-9)
        return ratio

    def state_dict(self) -> dict[str, float]:
        return {"peak": self.peak, "last": self.warming.last, "decay": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.peak, self.warming.last = float(state["peak"]), float(state["last"])
        self.value = float(state["decay"])


def _check_growth(controller: Any) -> None:
    """A takeover's growth cap is off (0) or a multiple of at least 1: its key's bound
    (``>= 0``) cannot say the hole between."""
    if 0 < controller.growth < 1:
        raise ValueError(f"growth must be 0 (no cap) or at least 1, got {controller.growth!r}")


def _takeover_cap(controller: Any, base: int, noise: SmoothedNoise) -> float:
    """The largest batch a controller that takes over the decay may reach: its ``max``,
    ``growth × base`` and ``critical_multiple ×`` the upper end of ``B_simple``; 0 while
    that estimate has fewer than ``window / 2`` steps behind it."""
    cap = float(controller.max)
    if controller.growth:
        cap = min(cap, controller.growth * base)
    if controller.critical_multiple:
        if not noise.ready:
            return 0.0
        _, upper = noise.bounds(controller.confidence)
        cap = min(cap, controller.critical_multiple * upper)
    return cap


def _grown(controller: Any, batch_size: int) -> int:
    """The size a growing controller steps to from ``batch_size``: ``⌈factor · B⌉``, at most
    its ``max`` (``batch_size`` itself at the top)."""
    return math.ceil(min(controller.max, batch_size * controller.factor))


def _clamp(controller: Any, size: float) -> int:
    """``size`` within the controller's ``[min, max]``, a whole batch (rounded to the
    nearest; clamped first, so an infinite wish is ``max``)."""
    return round(min(controller.max, max(controller.min, size)))


def _check(controller: Any) -> None:
    """A controller's settings against their bounds, and ``min <= initial <= max``."""
    check_settings(controller)
    batch_bounds(controller.initial, controller.min, controller.max)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


@register("constant")
@settings
class Constant:
    """A static batch: the baseline every adaptive method is compared with."""

    batch_size: int = setting(**_INITIAL)

    contract = Contract(needs_statistics=False)

    def __post_init__(self) -> None:
        check_settings(self)
        self.initial = self.min = self.max = self.batch_size

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        return self.initial

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"Constant({self.initial})"


@register("ramp")
@settings
class Ramp:
    """A batch fixed in advance: a linear ramp, or a table of points, in the user's units.

    ``Ramp(start, end, over)`` grows linearly from ``start`` to ``end`` over the first
    ``over`` of the run, then holds ``end`` (Megatron's rampup, in samples, and the
    linear ramps of Goyal et al.); ``Ramp(points=[(0, 256), ("25%", 512), ("50%",
    1024)])`` uses the batch of the last point the run has reached (OLMo-core's
    ``BatchSizeSchedulerCallback``). Each position is a :class:`~bigbatch.duration.
    Duration`: a number of samples, or text such as ``"25%"`` (of ``budget``),
    ``"2M tokens"`` (needs ``tokens_per_sample``) or ``"500 steps"`` (optimizer steps);
    a table's points share one unit. A point above ``end`` is held at ``end`` (the
    largest batch the run allows, lowered to the data by ``bigbatch train``).

    The position is read from the samples and the optimizer steps the engine has
    counted (``measured["step"]``), both saved in every checkpoint, so a resumed run
    follows the same ramp. Under ``lr_scaling="auto"`` the rate follows the optimizer
    family's rule at each change (``lr_follows="family"``: ×√ratio for Adam-type, as in
    OLMo-core; ×ratio for SGD- and LARS-type).
    """

    start: int | None = setting(None, **_INITIAL)
    end: int | None = setting(None, **_MAX)
    over: Duration | str | int | None = setting(
        "50%",
        "the length of the linear ramp from batch.initial to batch.max: samples, "
        "'N%' of max_samples, 'N tokens' or 'N steps' (e.g. '2M tokens')",
        key="ramp_over",
        parse=Duration.parse,
    )
    _: KW_ONLY
    points: Sequence[tuple[Duration | str | int, int]] | str | None = setting(
        None,
        "a table of 'WHEN:BATCH' points instead of the linear ramp, each WHEN a duration "
        "in one unit, in order, the first 0 (e.g. '0:16, 25%:32, 50%:64'); empty: the linear "
        "ramp",
        key="ramp_points",
        unset="",
        parse=lambda text: parse_points(text) if text.strip() else None,
    )
    #: the run's context, which ``bigbatch train`` passes (not config keys)
    budget: int | None = None
    tokens_per_sample: int | None = None

    contract = Contract(needs_statistics=False, lr_follows="family")

    def __post_init__(self) -> None:
        check_settings(self)  # the keyed bounds; the lengths and the table are read below
        start, end, over, points = self.start, self.end, self.over, self.points
        if isinstance(points, str):
            points = parse_points(points) if points.strip() else None
        if self.budget is not None:
            self.budget = positive_int("budget", self.budget)
        if self.tokens_per_sample is not None:
            self.tokens_per_sample = positive_int("tokens_per_sample", self.tokens_per_sample)
        if points is not None:
            self._table = self._points(points, start)
            self._over = None
            cap = max(b for _, b in self._table) if end is None else positive_int("end", end)
            self._table = [(when, min(b, cap)) for when, b in self._table]
            sizes = [b for _, b in self._table]
        else:
            if start is None or end is None or over is None:
                raise ValueError("Ramp needs start, end and over (or points=[...])")
            self._table = []
            self._over = self._known(Duration.parse(over))
            if self._over.value <= 0:
                raise ValueError(f"Ramp's over must be a positive length, got {self._over}")
            sizes = [positive_int("start", start), positive_int("end", end)]
        self.min, self.max = min(sizes), max(sizes)
        self.initial = self._at(0, 0)

    def _points(self, points: Sequence[tuple[Any, int]], start: int | None) -> list:
        if not isinstance(points, Sequence):
            raise ValueError(f"Ramp's points must be a list of (WHEN, BATCH) pairs, got {points!r}")
        pairs = [pair("a ramp point", point, "(WHEN, BATCH)") for point in points]
        table = [
            (self._known(Duration.parse(w)), positive_int("batch in points", b)) for w, b in pairs
        ]
        units = {d.unit for d, _ in table if d.value > 0}
        if len(units) > 1:
            raise ValueError(f"Ramp's points must share one unit, got {sorted(units)}")
        whens = [when.value for when, _ in table]
        if any(later <= earlier for earlier, later in itertools.pairwise(whens)):
            written = ", ".join(f"{when}:{batch}" for when, batch in table)
            raise ValueError(
                f"Ramp's points must be in order, each later than the one before, got {written!r}"
            )
        if not table or table[0][0].value != 0:
            raise ValueError(f"Ramp's points must start at 0, got {list(points)!r}")
        if start is not None and start != table[0][1]:
            raise ValueError(
                f"Ramp's start ({start}) is not its first point's batch ({table[0][1]})"
            )
        return table

    def _known(self, duration: Duration) -> Duration:
        duration.check(tokens_per_sample=self.tokens_per_sample, budget=self.budget)
        return duration

    def _elapsed(self, duration: Duration, samples: int, steps: int) -> float:
        return duration.elapsed(
            samples, steps, tokens_per_sample=self.tokens_per_sample, budget=self.budget
        )

    def _at(self, samples: int, steps: int) -> int:
        if self._table:
            return next(
                b
                for when, b in reversed(self._table)
                if self._elapsed(when, samples, steps) >= when.value
            )
        over = self._over
        fraction = min(1.0, self._elapsed(over, samples, steps) / over.value)  # type: ignore[arg-type, union-attr]
        return round(self.start + (self.end - self.start) * fraction)  # type: ignore[operator]

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        return self._at(samples, int(measured.get("step", 0)))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        if self._table:
            return f"Ramp(points={[(str(w), b) for w, b in self._table]!r})"
        return f"Ramp({self.start}, {self.end}, over={str(self._over)!r})"


def parse_points(text: str) -> list[tuple[Duration, int]]:
    """``"0:16, 25%:32, 2M tokens:64"`` as ``[(Duration, batch), ...]``."""
    points = []
    for item in text.split(","):
        when, sep, batch = item.rpartition(":")
        if not sep or not batch.strip().isdigit():
            raise ValueError(
                f"a ramp point is WHEN:BATCH (e.g. '25%:32'), got {item.strip()!r} in {text!r}"
            )
        points.append((Duration.parse(when), int(batch)))
    return points

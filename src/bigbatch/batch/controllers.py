"""Batch-size controllers: pure decisions from statistics and explicit state (none
touches a model). Each is a dataclass of its settings (:func:`bigbatch.knobs.settings`),
says what it reads in a :class:`Contract` and is named for ``batch.controller`` by
:func:`register`; the research ones are in :mod:`bigbatch.batch.contrib`.
docs/algorithms.md, "Batch-size controllers"."""

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
    """What a controller reads and how the learning rate follows its batch.

    ``needs_statistics``: it reads the statistics. ``reads_similarity``: it decides on the
    measured half-batch cosine. ``learns_between_measurements``: it is also called on the
    steps between measurements (``measured`` then holds ``batch_grad_sq_norm`` and
    ``batch_inverse_size``). ``lr_follows``: what ``lr_scaling="auto"`` resolves to:
    ``"none"`` (the rate held), ``"family"`` (the optimizer family's rule) or ``"task"``
    (a task's measured rule, else the family's); anything else is a ``ValueError``.
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
    """``controller.contract``, or the default :class:`Contract` where it has none."""
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
    """``next(measured, batch_size, samples) -> batch_size``, with plain-data state (the
    same keys at every step: a loop tells another controller's state by them).

    ``measured`` holds the step's statistics as floats (``similarity``, ``grad_sq_norm``,
    ``trace``, ``lr_factor``, ``schedule``, ``loss``). A controller deciding on the noise
    scale also has ``estimate()``: ``noise_scale`` and its ``_low``/``_high`` bounds, logged.
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

    The batch-size warm-up of Merrill et al. 2025 (arXiv:2505.23971) on the noise scale
    ``B_simple = tr Σ / |G|²`` (McCandlish et al. 2018), smoothed over ``window`` steps and
    clipped at ``clip`` spreads. The batch grows to ``⌈factor · B⌉`` once
    :meth:`critical_batch` (κ × the lower end of ``B_simple``'s interval at
    ``confidence`` standard errors) reaches it, then the average restarts; it never
    shrinks. κ is ``multiple``, raised up to ``max_multiple`` where the loss is flat
    (:meth:`current_multiple`). docs/algorithms.md, "BatchWarmup (the default)".
    """

    multiple: float = setting(0.125, **_MULTIPLE)
    initial: int = setting(8, **_INITIAL)
    min: int = setting(8, **_MIN)
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
        self._decided_on: dict[str, float] | None = None  # a change's estimate, for its log

    def current_multiple(self) -> float:
        """κ now: ``multiple``, raised to ``expm1(loss_lag / (|slope| + confidence · error))``,
        at most ``max_multiple``, with the loss's slope fitted after the schedule's warm-up."""
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
        self._decided_on = None
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
            self._decided_on = self.estimate()  # what the change's step logs, not the restart
            self._noise.reset()
            return bigger
        return _clamp(self, batch_size)

    def estimate(self) -> dict[str, float]:
        """What decides, for logging: ``B_simple`` with its bounds, and the critical batch."""
        if self._decided_on is not None:
            return dict(self._decided_on)
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
            # an asynchronous step read after the change logs it too: resumed, it logged 0
            "decided_on": self._decided_on,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._noise.load_state_dict(state["noise"])
        self._schedule = float(state["schedule"])
        self._slope.load_state_dict(state["slope"])
        self._warming.last = float(state["warming"])
        self._warmed = bool(state["warmed"])
        self._decided_on = state.get("decided_on")  # (None: no change pending a log)


@register("seesaw")
@settings
class Seesaw:
    """Grow the batch where the schedule lowers the rate, up to the critical batch.

    Past the rate's warm-up, where the schedule has fallen to ``d = m / m_peak``, the
    batch is ``initial / d`` (in powers of ``granularity`` unless 1), capped at
    :meth:`cap`, never shrinking; the rate follows by the family's rule (Smith et al.
    2018; Meterez et al. 2025, arXiv:2510.14717). docs/algorithms.md, "Seesaw: the batch
    takes over the rate's decay".
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
        """``min(max, growth × initial, critical_multiple × upper(B_simple))``; 0 until ready."""
        return _takeover_cap(self, self.initial, self._noise)

    def wanted(self) -> float:
        """``initial / d`` (in powers of ``granularity`` unless it is 1), before the cap."""
        return self.initial * self._decay.growth(self.granularity)

    def next(self, measured: dict[str, float], batch_size: int, samples: int) -> int:
        self._noise.observe(measured, self.clip)
        self._decay.update(measured, samples)
        # the cap is at most max, so this is finite; round down to a whole batch, never below
        # the current one: the batch never shrinks
        new = max(batch_size, math.floor(min(self.wanted(), self.cap()) + 1e-9))
        return _clamp(self, new)

    def estimate(self) -> dict[str, float]:
        """For logging: ``B_simple`` with its bounds, the decay ``d`` and ``batch_cap``."""
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

    As published (Qin et al., NeurIPS 2021): every ``interval`` steps, with ``s`` the mean
    of the finite ones of the last ``window`` similarities, the batch grows to
    ``max(B + 1, ⌊growth · B⌋)`` if ``s < target`` and shrinks to
    ``max(1, min(B − 1, ⌊shrink · B⌋))`` if ``s > target``, within ``[min, max]``.
    docs/algorithms.md, "SimiGrad, as published".
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
        # as the authors' fork: a non-finite cosine takes its place in the window (whose
        # mean skips it) and its step holds the batch
        similarity = float(measured.get("similarity", math.nan))
        self._recent.append(similarity)
        self._steps += 1
        finite = [s for s in self._recent if math.isfinite(s)]
        if not math.isfinite(similarity) or not finite or self._steps % self.interval:
            return batch_size
        mean = sum(finite) / len(finite)
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
    """Whether the rate is still warming up: before ``samples`` or while the schedule rises."""

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
    """The schedule's fall from its peak, ``d = m / m_peak``, past its warm-up (else 1)."""

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
        """``1 / d``, in powers of ``granularity`` unless it is 1; infinite for a decay to 0."""
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
    """A growth cap is 0 (off) or at least 1."""
    if 0 < controller.growth < 1:
        raise ValueError(f"growth must be 0 (no cap) or at least 1, got {controller.growth!r}")


def _takeover_cap(controller: Any, base: int, noise: SmoothedNoise) -> float:
    """``min(max, growth × base, critical_multiple × upper(B_simple))``; 0 until ready."""
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
    """``⌈factor · B⌉``, at most ``max``."""
    return math.ceil(min(controller.max, batch_size * controller.factor))


def _clamp(controller: Any, size: float) -> int:
    """``size`` clamped to ``[min, max]`` and rounded (an infinite wish is ``max``)."""
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

    ``Ramp(start, end, over)`` grows linearly over ``over`` then holds ``end``;
    ``Ramp(points=[(0, 256), ("25%", 512)])`` takes the last point reached. Each position
    is a :class:`~bigbatch.duration.Duration`, all in one unit, from 0, increasing
    (``"25%"`` needs ``budget``, tokens ``tokens_per_sample``); a malformed ramp is a
    ``ValueError``. docs/algorithms.md, "NoiseScale, Constant, Ramp".
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

"""Smoothed statistics with standard errors, so a controller acts only when the evidence
clears its error bars (docs/algorithms.md, "Smoothed statistics with error bars")."""

from __future__ import annotations

import math
from typing import Any

from .._checks import check_number

_SUMS = ("w", "w2", "x", "xx")
#: steps since the last value, and between the last two (0: not yet two)
_GAPS = ("since", "spacing")
#: a count within this share of the most its values' spacing lets it reach is full
_REACHED = 0.9

#: the fewest ``tr Σ`` values behind a decision when steps between measurements add
#: ``|G|²`` alone (:meth:`SmoothedNoise.observe`): two values' spread is no error bar
MIN_TRACE = 4


class SmoothedValue:
    """An exponentially weighted, bias-corrected mean over about ``window`` steps, with its
    standard error ``σ / sqrt(n_eff)`` (Kish 1965); non-finite values are skipped."""

    def __init__(self, window: float = 20.0) -> None:
        self.window = check_number("window", window, low=1.0)
        self._sums = dict.fromkeys(_SUMS + _GAPS, 0.0)

    def update(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.age()
        sums = self._sums
        if sums["w"] > 0:
            sums["spacing"] = sums["since"]
        sums["since"] = 0.0
        sums["w"] += 1.0
        sums["w2"] += 1.0
        sums["x"] += value
        sums["xx"] += value * value

    def age(self) -> None:
        """One step passes without a value: the old weights decay as :meth:`update`'s do."""
        keep = 1.0 - 1.0 / self.window
        sums = self._sums
        sums["w"] *= keep
        sums["w2"] *= keep * keep
        sums["x"] *= keep
        sums["xx"] *= keep
        sums["since"] += 1.0

    @property
    def count(self) -> float:
        """The effective number of values averaged (0 before any)."""
        w, w2 = self._sums["w"], self._sums["w2"]
        return w * w / w2 if w2 > 0 else 0.0

    @property
    def reachable(self) -> float:
        """The most :attr:`count` reaches with values as far apart as the last two (or inf)."""
        # (1 + q) / (1 - q): the Kish count of weights q^i, q the weight kept over the spacing
        spacing = self._sums["spacing"]
        if spacing <= 0:
            return math.inf
        q = (1.0 - 1.0 / self.window) ** spacing
        return (1.0 + q) / (1.0 - q) if q < 1.0 else math.inf

    def holds(self, count: float) -> bool:
        """Whether :attr:`count` reaches ``count``, or nearly all its values' spacing allows."""
        # (a short window, values every k-th step: four values' weight is out of reach)
        return self.count >= min(count, _REACHED * self.reachable)

    @property
    def mean(self) -> float:
        """The bias-corrected weighted mean; NaN before the first value."""
        w = self._sums["w"]
        return self._sums["x"] / w if w > 0 else math.nan

    @property
    def spread(self) -> float:
        """The weighted standard deviation of the values (inf with fewer than two)."""
        n = self.count
        if n <= 1.0:
            return math.inf
        mean = self.mean
        return math.sqrt(max(self._sums["xx"] / self._sums["w"] - mean * mean, 0.0) * n / (n - 1))

    @property
    def standard_error(self) -> float:
        return self.spread / math.sqrt(self.count) if self.count > 1.0 else math.inf

    def clipped(self, value: float, z: float) -> float:
        """``value`` held within ``mean ± z`` spreads (unchanged while the spread is unknown)."""
        spread = self.spread
        if not math.isfinite(value) or math.isinf(spread):
            return value
        return min(self.mean + z * spread, max(self.mean - z * spread, value))

    def reset(self) -> None:
        """Forget every value (after a change that makes the old ones stale)."""
        self._sums = dict.fromkeys(_SUMS + _GAPS, 0.0)

    def interval(self, z: float) -> tuple[float, float]:
        """``mean ∓ z`` standard errors (``(-inf, inf)`` while unknown)."""
        mean, error = self.mean, self.standard_error
        if math.isnan(mean) or math.isinf(error):
            return -math.inf, math.inf
        return mean - z * error, mean + z * error

    def state_dict(self) -> dict[str, Any]:
        return dict(self._sums)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sums = {name: float(state[name]) for name in _SUMS}
        self._sums.update({name: float(state.get(name, 0.0)) for name in _GAPS})


class SmoothedNoise:
    """``B_simple = tr Σ / |G|²`` from numerator and denominator smoothed apart;
    :meth:`bounds` is the extreme ratio over their intervals (infinite where ``|G|²`` ≤ 0)."""

    def __init__(self, window: float = 20.0) -> None:
        self.signal = SmoothedValue(window)
        self.trace = SmoothedValue(window)
        #: the weighted share of ``|G|²``'s mean that is ``-φ(B) tr Σ`` (:meth:`observe`): its
        #: error moves with the trace's, which the signal's own spread does not show
        self.borrowed = SmoothedValue(window)

    def update(self, signal: float, trace: float, clip: float | None = None) -> None:
        """Add one step's ``|G|²`` and ``tr Σ`` (both finite), each clipped at ``clip`` spreads."""
        if math.isfinite(signal) and math.isfinite(trace):
            if clip is not None:
                signal, trace = self.signal.clipped(signal, clip), self.trace.clipped(trace, clip)
            self.signal.update(signal)
            self.trace.update(trace)
            self.borrowed.update(0.0)

    def observe(self, measured: dict[str, float], clip: float | None = None) -> None:
        """One step's evidence: ``grad_sq_norm`` and ``trace``; between measurements, ``|G|²``
        as ``batch_grad_sq_norm`` less ``batch_inverse_size`` × the smoothed ``tr Σ``
        (docs/algorithms.md, "Smoothed statistics with error bars")."""
        if math.isfinite(measured.get("trace", math.nan)):
            self.update(measured.get("grad_sq_norm", math.nan), measured["trace"], clip)
            return
        batch_sq = measured.get("batch_grad_sq_norm", math.nan)
        factor = measured.get("batch_inverse_size", math.nan)
        self.trace.age()  # its mean as recent as the signal's (above)
        trace = self.trace.mean
        if not (math.isfinite(batch_sq) and math.isfinite(factor) and math.isfinite(trace)):
            return
        signal = batch_sq - factor * trace
        if clip is not None:
            signal = self.signal.clipped(signal, clip)
        self.signal.update(signal)
        self.borrowed.update(factor)

    def reset(self) -> None:
        """Forget every step (the measurements before a batch or rate change are stale)."""
        self.signal.reset()
        self.trace.reset()
        self.borrowed.reset()

    @property
    def count(self) -> float:
        return self.signal.count

    @property
    def ready(self) -> bool:
        """Half a window of weight and ``MIN_TRACE`` traces' (or what the cadence allows)."""
        half = self.signal.window / 2
        return self.signal.holds(half) and self.trace.holds(min(half, MIN_TRACE))

    def noise_scale(self) -> float:
        """``B_simple`` of the smoothed means (NaN while ``|G|²`` is not positive)."""
        s, t = self.signal.mean, self.trace.mean
        return t / s if s > 0 and t >= 0 else math.nan

    def bounds(self, z: float) -> tuple[float, float]:
        """``(lower, upper)`` plausible ``B_simple`` at ``z`` standard errors."""
        s_low, s_high = self._signal_interval(z)
        t_low, t_high = self.trace.interval(z)
        lower = t_low / s_high if t_low > 0 and 0 < s_high < math.inf else 0.0
        upper = t_high / s_low if s_low > 0 and t_high < math.inf else math.inf
        return lower, upper

    def _signal_interval(self, z: float) -> tuple[float, float]:
        """``|G|²``'s mean ∓ ``z`` standard errors, widened by ``φ̄ σ_T`` for borrowed values."""
        borrowed = self.borrowed.mean
        if not borrowed > 0:
            return self.signal.interval(z)
        mean = self.signal.mean
        error = math.hypot(self.signal.standard_error, borrowed * self.trace.standard_error)
        if math.isinf(error):
            return -math.inf, math.inf
        return mean - z * error, mean + z * error

    def estimate(self, z: float) -> dict[str, float]:
        """The logged form: ``noise_scale`` with its bounds at ``z`` (``_low``, ``_high``)."""
        low, high = self.bounds(z)
        return {"noise_scale": self.noise_scale(), "noise_scale_low": low, "noise_scale_high": high}

    def state_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal.state_dict(),
            "trace": self.trace.state_dict(),
            "borrowed": self.borrowed.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.signal.load_state_dict(state["signal"])
        self.trace.load_state_dict(state["trace"])
        self.borrowed.load_state_dict(state["borrowed"])


_FIT = ("n", "x", "y", "xx", "xy", "yy")


class LossSlope:
    """The loss's fall per e-fold of samples, ``-dL / d ln(samples)``, with its error: least
    squares over the last ``span`` e-folds, kept as ``bins`` slices of sums."""

    def __init__(self, span: float = 1.0, bins: int = 8, min_points: int = 16) -> None:
        self.span = check_number("span", span, low_open=True)
        self.bins = check_number("bins", bins, low=2, whole=True)
        self.min_points = check_number("min_points", min_points, low=3, whole=True)
        self._width = self.span / self.bins
        self._slices: dict[int, dict[str, float]] = {}  # by slice index from the first value
        self._start = math.nan  # ln(samples) of the first value
        self._index = -1  # the slice the last value fell in

    def update(self, loss: float, samples: float) -> None:
        """Add one step's loss, after ``samples`` samples in all (non-finite: skipped)."""
        if not (math.isfinite(loss) and samples > 0):
            return
        x = math.log(samples)
        if math.isnan(self._start):
            self._start = x
        self._index = max(self._index, int((x - self._start) / self._width))
        for old in [i for i in self._slices if i < self._index - self.bins]:
            del self._slices[old]  # wholly older than the window
        sums = self._slices.setdefault(self._index, dict.fromkeys(_FIT, 0.0))
        sums["n"] += 1.0
        sums["x"] += x
        sums["y"] += loss
        sums["xx"] += x * x
        sums["xy"] += x * loss
        sums["yy"] += loss * loss

    def fit(self) -> tuple[float, float]:
        """``(slope, standard error)``; ``(nan, inf)`` until ``span`` and ``min_points`` are met."""
        if not self._slices or self._index - min(self._slices) < self.bins:
            return math.nan, math.inf  # the values kept do not yet reach a span back
        t = {k: sum(s[k] for s in self._slices.values()) for k in _FIT}
        n = t["n"]
        if n < self.min_points:
            return math.nan, math.inf
        sxx = t["xx"] - t["x"] ** 2 / n
        if sxx <= 0:
            return math.nan, math.inf
        sxy = t["xy"] - t["x"] * t["y"] / n
        syy = t["yy"] - t["y"] ** 2 / n
        residual = max(syy - sxy * sxy / sxx, 0.0) / (n - 2)
        return -sxy / sxx, math.sqrt(residual / sxx)

    def slope(self) -> float:
        """The loss's fall per e-fold of samples (NaN while :meth:`fit` has none)."""
        return self.fit()[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "span": self.span,
            "bins": self.bins,
            "slices": {str(i): dict(s) for i, s in self._slices.items()},
            "start": self._start,
            "index": self._index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a fit; one taken with another ``span`` or ``bins`` is dropped."""
        if float(state["span"]) != self.span or int(state["bins"]) != self.bins:
            self._slices, self._start, self._index = {}, math.nan, -1
            return
        self._slices = {int(i): {k: float(s[k]) for k in _FIT} for i, s in state["slices"].items()}
        self._start = float(state["start"])
        self._index = int(state["index"])

"""Smoothed statistics with an uncertainty, for controllers that must not chase noise.

One step's estimates of ``|G|²``, ``tr Σ`` and the half-batch similarity are
unbiased but noisy: on the default task their step-to-step spread is
0.7–2× the mean for ``|G|²`` (often negative late in training), 0.25–0.8× for
``tr Σ`` and ±0.2 for the similarity, with four sub-batches. A controller
that acts on them directly saws the batch up and down. The pieces here
average them with exponential weights *and* say how sure the average is, so
a controller can act only when the evidence clears its error bars.

Plain Python floats: the state is a few numbers and round-trips through
``state_dict()``.
"""

from __future__ import annotations

import math
from typing import Any

from .._checks import check_number

_SUMS = ("w", "w2", "x", "xx")

#: the fewest ``tr Σ`` values behind a decision when steps between measurements add
#: ``|G|²`` alone (:meth:`SmoothedNoise.observe`): two values' spread is no error bar
MIN_TRACE = 4


class SmoothedValue:
    """An exponentially weighted mean of a per-step value, with its standard error.

    Each :meth:`update` multiplies the old weights by ``1 - 1/window`` and
    adds the new value with weight 1, so ``window`` is the averaging horizon
    in steps; the mean is bias-corrected (divided by the sum of weights, so
    the first values are not pulled towards 0). The standard error is
    ``σ / sqrt(n)`` with ``σ²`` the weighted variance and ``n = (Σw)² / Σw²``
    the effective number of values averaged (Kish 1965); with fewer than two
    it is infinite. Non-finite values are skipped.
    """

    def __init__(self, window: float = 20.0) -> None:
        self.window = check_number("window", window, low=1.0)
        self._sums = dict.fromkeys(_SUMS, 0.0)

    def update(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.age()
        sums = self._sums
        sums["w"] += 1.0
        sums["w2"] += 1.0
        sums["x"] += value
        sums["xx"] += value * value

    def age(self) -> None:
        """One step passes without a value: the old weights decay as :meth:`update`'s do,
        so a value measured every k-th step is averaged over the same steps as one
        measured at every step (its mean no older, its count k times smaller)."""
        keep = 1.0 - 1.0 / self.window
        sums = self._sums
        sums["w"] *= keep
        sums["w2"] *= keep * keep
        sums["x"] *= keep
        sums["xx"] *= keep

    @property
    def count(self) -> float:
        """The effective number of values averaged (0 before any)."""
        w, w2 = self._sums["w"], self._sums["w2"]
        return w * w / w2 if w2 > 0 else 0.0

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
        """``value`` held within ``mean ± z`` spreads (unchanged while the spread is unknown).

        Winsorising one step's estimate keeps a single outlier (a rare batch
        whose gradient points far off) from moving the mean by more than
        ``z`` spreads' worth of one sample's weight.
        """
        spread = self.spread
        if not math.isfinite(value) or math.isinf(spread):
            return value
        return min(self.mean + z * spread, max(self.mean - z * spread, value))

    def reset(self) -> None:
        """Forget every value (after a change that makes the old ones stale)."""
        self._sums = dict.fromkeys(_SUMS, 0.0)

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


class SmoothedNoise:
    """``B_simple = tr Σ / |G|²`` from numerator and denominator smoothed apart.

    The ratio of two noisy means is taken after averaging, never averaged
    itself (McCandlish et al. 2018, App. A; gpt-neox does the same).
    :meth:`bounds` gives the plausible range at ``z`` standard errors of each
    mean: ``(T - z σ_T) / (S + z σ_S)`` to ``(T + z σ_T) / (S - z σ_S)``, the
    extremes of the ratio over the box of plausible means. It is conservative
    and stays defined when the mean ``|G|²`` is near zero or negative (the
    upper end is then infinite: the gradient is lost in the noise).
    """

    def __init__(self, window: float = 20.0) -> None:
        self.signal = SmoothedValue(window)
        self.trace = SmoothedValue(window)
        #: the weighted share of ``|G|²``'s mean that is ``-φ(B) tr Σ`` (:meth:`observe`): its
        #: error moves with the trace's, which the signal's own spread does not show
        self.borrowed = SmoothedValue(window)

    def update(self, signal: float, trace: float, clip: float | None = None) -> None:
        """Add one step's ``|G|²`` and ``tr Σ`` estimates (skipped unless both are finite);
        with ``clip``, each first held within ``clip`` spreads of its mean
        (:meth:`SmoothedValue.clipped`)."""
        if math.isfinite(signal) and math.isfinite(trace):
            if clip is not None:
                signal, trace = self.signal.clipped(signal, clip), self.trace.clipped(trace, clip)
            self.signal.update(signal)
            self.trace.update(trace)
            self.borrowed.update(0.0)

    def observe(self, measured: dict[str, float], clip: float | None = None) -> None:
        """One step's evidence: its ``|G|²`` and ``tr Σ`` estimates (``grad_sq_norm``,
        ``trace``) on a measured step (:meth:`update`); between measurements
        (``statistics_every``) the batch gradient's ``|g_B|²`` alone.

        ``E |g_B|² = |G|² + φ(B) tr Σ`` (``φ = 1/B``, or the finite-population factor:
        ``batch_inverse_size``), so such a step gives ``|G|²`` as ``|g_B|² − φ(B)`` times
        the smoothed ``tr Σ``: ``|G|²`` gathers evidence at every step, ``tr Σ`` only at
        the measured ones. The trace's weights decay at every step
        (:meth:`SmoothedValue.age`), so its mean is as recent as the signal's: ``|G|²`` is
        small beside ``φ tr Σ`` at a small batch, and a trace averaged over k times the
        steps, too high while it falls, left ``|G|²`` too low (on ``text`` at batch 16 by
        half, doubling at a quarter of the steps; docs/results.md, "Measuring every
        k-th step"). Those values share the smoothed trace's error, so :meth:`bounds`
        adds it to ``|G|²``'s: the mean share ``φ̄`` of the values that borrowed it
        times the trace's standard error. Nothing is learnt before the trace has a mean.
        """
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
        """Half a window of weight behind the estimate (the steps' decayed weights, about
        half a window of steps): before it, two steps' spread is no error bar, and no
        decision may rest on the bounds. Between measurements (:meth:`observe`) ``tr Σ``
        gathers fewer values: it needs ``MIN_TRACE`` of them, or the half window."""
        half = self.signal.window / 2
        return self.count >= half and self.trace.count >= min(half, MIN_TRACE)

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
        """``|G|²``'s mean ∓ ``z`` standard errors: its own values' and, for the share that
        borrowed the smoothed trace, the trace's (``φ̄ σ_T``)."""
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
    """How fast the loss falls per e-fold of samples, ``-dL / d ln(samples)``, with its error.

    A least-squares line through each step's training loss against the log
    of the samples trained so far, over the last ``span`` e-folds. The
    window is kept as slices of equal width ``span / bins`` in
    ``ln(samples)``, each holding the six sums of the fit, so the state is a
    few numbers whatever the run's length: the fit covers the ``bins``
    whole slices before the one filling, and that one (between ``span`` and
    ``span + span / bins`` e-folds). The standard error is the ordinary
    least-squares one from the residuals (each step's loss is one noisy
    sample of the mean loss); a fit of fewer than ``min_points`` steps is
    not trusted.

    Why the slope: a batch ``B`` against noise scale ``B_noise`` needs
    ``1 + B / B_noise`` times the samples of the smallest batches for the
    same progress (McCandlish et al. 2018), so it leaves the loss behind by
    about ``slope · ln(1 + B / B_noise)``: a batch is cheap where the loss
    no longer falls with more samples, and dear where it still does.
    """

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
        """``(slope, standard error)``; ``(nan, inf)`` until the values kept reach
        ``span`` e-folds back and number ``min_points``."""
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
        """Restore a fit; one taken with another ``span`` or ``bins`` is dropped (its slices
        would mean other windows), and the fit starts afresh from the next value."""
        if float(state["span"]) != self.span or int(state["bins"]) != self.bins:
            self._slices, self._start, self._index = {}, math.nan, -1
            return
        self._slices = {int(i): {k: float(s[k]) for k in _FIT} for i, s in state["slices"].items()}
        self._start = float(state["start"])
        self._index = int(state["index"])

"""The smoothed statistics controllers act on: means, error bars, bounds."""

import math
import random

import pytest

from bigbatch.batch import LossSlope, SmoothedNoise, SmoothedValue
from bigbatch.batch.smoothing import MIN_TRACE


def test_value_is_a_bias_corrected_exponential_mean():
    v = SmoothedValue(window=4)
    assert math.isnan(v.mean) and v.count == 0
    v.update(10.0)
    assert v.mean == 10.0  # no pull towards zero at the start
    assert v.standard_error == math.inf  # one value: no spread yet
    v.update(2.0)
    # weights 0.75 and 1
    assert v.mean == pytest.approx((0.75 * 10 + 2) / 1.75)
    assert v.count == pytest.approx(1.75**2 / (0.75**2 + 1))
    v.update(math.nan)  # skipped
    assert v.mean == pytest.approx((0.75 * 10 + 2) / 1.75)


def test_standard_error_shrinks_like_one_over_root_n_for_iid_values():
    rng = random.Random(0)
    v = SmoothedValue(window=50)
    for _ in range(5000):
        v.update(rng.gauss(3.0, 2.0))
    # an exponential window of 50 averages about 2*50-1 = 99 values
    assert v.count == pytest.approx(99, rel=0.01)
    assert v.standard_error == pytest.approx(2.0 / math.sqrt(99), rel=0.15)
    low, high = v.interval(2.0)
    assert low < 3.0 < high


def test_noise_bounds_bracket_the_true_ratio_and_widen_with_noise():
    rng = random.Random(1)
    quiet, loud = SmoothedNoise(20), SmoothedNoise(20)
    for _ in range(400):
        quiet.update(1.0 + 0.1 * rng.gauss(0, 1), 100 * (1 + 0.1 * rng.gauss(0, 1)))
        loud.update(1.0 + 2.0 * rng.gauss(0, 1), 100 * (1 + 0.5 * rng.gauss(0, 1)))
    q_low, q_high = quiet.bounds(1.0)
    l_low, l_high = loud.bounds(1.0)
    assert q_low < 100 < q_high
    assert l_low < 100 < l_high
    assert l_high - l_low > 5 * (q_high - q_low)
    assert quiet.noise_scale() == pytest.approx(100, rel=0.05)


def test_noise_lost_in_the_noise_has_no_upper_bound():
    n = SmoothedNoise(10)
    for i in range(30):
        n.update((-1) ** i * 0.5, 50.0)  # |G|² averages ~0: B_simple is unbounded above
    low, high = n.bounds(1.0)
    assert high == math.inf and low >= 0
    assert math.isnan(SmoothedNoise().noise_scale())
    assert SmoothedNoise().bounds(1.0) == (0.0, math.inf)


def test_state_round_trip():
    a, b = SmoothedNoise(8), SmoothedNoise(8)
    for i in range(12):
        a.update(1.0 + i, 10.0 * i)
    b.load_state_dict(a.state_dict())
    assert b.bounds(1.5) == a.bounds(1.5)
    a.update(3.0, 7.0)
    b.update(3.0, 7.0)
    assert b.noise_scale() == a.noise_scale()


def test_clipped_holds_a_value_within_z_spreads_and_reset_forgets():
    v = SmoothedValue(window=10)
    assert v.clipped(1e9, 3.0) == 1e9  # no spread yet: nothing to hold it to
    for x in (1.0, 3.0) * 10:
        v.update(x)
    high = v.mean + 3.0 * v.spread
    assert v.clipped(1e9, 3.0) == pytest.approx(high)
    assert v.clipped(2.5, 3.0) == 2.5
    v.reset()
    assert v.count == 0 and math.isnan(v.mean)


def test_noise_estimate_is_the_ratio_with_its_bounds():
    n = SmoothedNoise(10)
    for i in range(40):
        n.update(1.0 + 0.1 * (-1) ** i, 50.0, clip=3.0)
    logged = n.estimate(1.0)
    assert logged["noise_scale"] == pytest.approx(n.noise_scale())
    assert (logged["noise_scale_low"], logged["noise_scale_high"]) == n.bounds(1.0)
    assert logged["noise_scale_low"] < 50 < logged["noise_scale_high"]


# ---------------------------------------------------------------- LossSlope


def power_law_losses(slope, steps, batch=16, noise=0.0, seed=0):
    """``(loss, samples)`` of a loss ``3 - slope · ln(samples)`` seen through noise."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        samples = step * batch
        yield 3.0 - slope * math.log(samples) + noise * rng.gauss(0, 1), samples


def test_slope_is_the_fall_per_e_fold_of_samples_once_the_window_is_full():
    fit = LossSlope(span=1.0, bins=8)
    for loss, samples in power_law_losses(0.2, 100):  # 16 .. 1600 samples: 4.6 e-folds
        fit.update(loss, samples)
    slope, error = fit.fit()
    assert slope == pytest.approx(0.2) and error == pytest.approx(0.0, abs=1e-6)


def test_slope_waits_for_a_whole_span_and_enough_points():
    fit = LossSlope(span=1.0, bins=8, min_points=16)
    samples = [100 * math.exp(0.99 * i / 40) for i in range(41)]  # 0.99 e-folds, 41 points
    for n in samples:
        fit.update(2.0, n)
    assert math.isnan(fit.slope())  # less than a span
    fit.update(2.0, 100 * math.exp(1.01))  # the first value is now a whole span behind
    assert fit.slope() == 0.0
    sparse = LossSlope(span=1.0, bins=8, min_points=16)
    for n in (10, 100, 1000, 10_000):  # a span, but four points
        sparse.update(2.0, n)
    assert math.isnan(sparse.slope())


def test_a_jump_in_samples_leaves_only_what_lies_within_the_span():
    fit = LossSlope(span=1.0, bins=8)
    for i in range(20):  # 20 points over a quarter e-fold, falling fast
        fit.update(3.0 - 0.5 * i / 80, 1000 * math.exp(i / 80))
    after = [(2.0 + 0.001 * i, 1000 * math.exp(3 + i / 200)) for i in range(20)]
    for loss, samples in after:  # three e-folds later: 20 flat points over a tenth
        fit.update(loss, samples)
    kept = sorted(fit._slices)
    assert kept[-1] - kept[0] <= fit.bins  # nothing from before the jump
    assert math.isnan(fit.slope())  # and what is kept reaches a tenth of a span back, not one
    for i in range(20, 260):  # once it reaches a span back, the fit is over those points only
        fit.update(2.0 + 0.001 * i, 1000 * math.exp(3 + i / 200))
    assert fit.slope() == pytest.approx(-0.2, rel=1e-6)


def window_oracle(points, span, bins):
    """The least-squares slope and its standard error over the points whose slice (counted
    from the first point in widths of span / bins) lies within bins of the last one's."""
    import numpy as np

    x = np.log([n for _, n in points])
    y = np.array([loss for loss, _ in points])
    index = np.floor((x - x[0]) / (span / bins)).astype(int)
    keep = index >= index.max() - bins
    x, y = x[keep], y[keep]
    (b, a), cov = np.polyfit(x, y, 1, cov="unscaled")
    residual = ((y - (a + b * x)) ** 2).sum() / (len(x) - 2)
    return -b, math.sqrt(residual * cov[0, 0])


@pytest.mark.parametrize("span, bins", [(1.0, 8), (0.5, 4), (2.0, 16)])
def test_slope_fits_exactly_the_window_it_promises(span, bins):
    # a loss that falls fast, then slowly: a window of another length gives another slope
    rng = random.Random(1)
    points, fit = [], LossSlope(span=span, bins=bins)
    for step in range(1, 3001):
        samples = 16 * step
        loss = 3 - 0.4 * math.log(min(samples, 8000)) - 0.02 * math.log(samples)
        points.append((loss + 0.05 * rng.gauss(0, 1), samples))
        fit.update(*points[-1])
    slope, error = fit.fit()
    expected, expected_error = window_oracle(points, span, bins)
    assert slope == pytest.approx(expected, rel=1e-9)
    assert error == pytest.approx(expected_error, rel=1e-6)


def test_slope_forgets_what_lies_beyond_its_span():
    # the loss fell until 16,000 samples, then stopped: a one-e-fold window at 64,000 sees
    # only the flat part; a three-e-fold one still sees the fall
    short, long = LossSlope(span=1.0), LossSlope(span=3.0)
    for step in range(1, 4001):
        samples = 16 * step
        loss = 3.0 - 0.2 * math.log(min(samples, 16_000))
        short.update(loss, samples)
        long.update(loss, samples)
    assert short.slope() == pytest.approx(0.0, abs=1e-9)
    assert long.slope() > 0.01


def test_noisy_slope_has_an_error_bar_that_covers_it():
    hits = 0
    for seed in range(40):
        fit = LossSlope(span=0.5)
        for loss, samples in power_law_losses(0.05, 2000, noise=0.3, seed=seed):
            fit.update(loss, samples)
        slope, error = fit.fit()
        hits += abs(slope - 0.05) <= error
    assert 20 <= hits <= 36  # one standard error: about 68% of 40


def test_slope_state_round_trip_and_non_finite_losses_are_skipped():
    fit = LossSlope(span=0.3)
    for loss, samples in power_law_losses(0.1, 300, noise=0.1):
        fit.update(loss, samples)
    fit.update(math.nan, 10_000)
    copy = LossSlope(span=0.3)
    copy.load_state_dict(fit.state_dict())
    assert copy.fit() == fit.fit()
    for loss, samples in power_law_losses(0.1, 20, noise=0.1, seed=3):
        fit.update(loss, 4800 + samples)
        copy.update(loss, 4800 + samples)
    assert copy.fit() == fit.fit() and copy.state_dict() == fit.state_dict()
    other = LossSlope(span=0.6)  # another window: the saved slices would mean other things
    other.load_state_dict(fit.state_dict())
    assert math.isnan(other.slope()) and other.state_dict()["slices"] == {}


def test_slope_bad_settings_are_named():
    with pytest.raises(ValueError, match="span"):
        LossSlope(span=0)
    with pytest.raises(ValueError, match="bins"):
        LossSlope(bins=1)


def test_the_noise_estimate_is_ready_after_half_a_window_and_again_after_a_reset():
    noise = SmoothedNoise(window=8)
    steps = 0
    while not noise.ready:  # the steps' decayed weight reaches half the window
        noise.update(1.0, 10.0)
        steps += 1
    assert 4 <= steps <= 8 and noise.count >= 4
    noise.update(math.nan, 10.0)  # a step without both estimates adds nothing
    noise.reset()
    assert not noise.ready


def between(batch_sq, factor):
    """What the engine gives a controller on a step between measurements."""
    return {"batch_grad_sq_norm": batch_sq, "batch_inverse_size": factor}


def test_steps_between_measurements_add_the_signal_from_the_batch_gradient_alone():
    """``E|g_B|² = |G|² + tr Σ / B``: a step between measurements gives ``|G|²`` as
    ``|g_B|² − tr Σ / B`` with the smoothed trace; over 40 runs of 2,000 steps (every 4th
    measured) the ratio finds ``B_simple``, and its bounds cover it in over half the runs
    (in 83 of 100 against 79 measuring every step; 52 before the bounds added the error
    the borrowed trace carries, 66 before the trace aged at every step)."""
    signal, trace, batch = 1.0, 100.0, 16

    def run(seed: int, every: int) -> tuple[float, bool]:
        rng = random.Random(seed)
        noise = SmoothedNoise(40)
        for step in range(2000):
            if step % every == 0:  # measured: the step's unbiased estimates
                noise.observe({"grad_sq_norm": signal + rng.gauss(0, 1.0),
                               "trace": trace * (1 + 0.3 * rng.gauss(0, 1))})  # fmt: skip
            else:
                noise.observe(between(signal + trace / batch + rng.gauss(0, 1.0), 1 / batch))
        low, high = noise.bounds(1.0)
        return noise.noise_scale(), low < trace / signal < high

    for every in (1, 4):
        runs = [run(seed, every) for seed in range(40)]
        assert sum(r[0] for r in runs) / 40 == pytest.approx(trace / signal, rel=0.1)
        assert sum(r[1] for r in runs) >= 20  # 35 and 35 of 40 (24 before the trace aged)


def test_a_falling_trace_does_not_drag_the_signal_of_the_steps_between_down():
    """``tr Σ`` falls as a run trains. A step between measurements subtracts ``φ`` times the
    smoothed trace, which must be as recent as the signal's values: averaged over k times
    the steps it is too high, and ``|G|²`` comes out too low (0.81 of the truth, bounds
    covering it in 35 of 100 runs; 0.96 and 79 with the trace aged at every step)."""
    signal, batch, steps = 1.0, 16, 2000

    def run(seed: int) -> tuple[float, bool]:
        rng = random.Random(seed)
        noise = SmoothedNoise(40)
        for step in range(steps):
            trace = 100.0 * (1 - 0.5 * step / steps)  # halves over the run
            if step % 4 == 0:
                noise.observe({"grad_sq_norm": signal + rng.gauss(0, 1.0),
                               "trace": trace * (1 + 0.3 * rng.gauss(0, 1))})  # fmt: skip
            else:
                noise.observe(between(signal + trace / batch + rng.gauss(0, 1.0), 1 / batch))
        low, high = noise.bounds(1.0)
        return noise.signal.mean, low < trace / signal < high

    runs = [run(seed) for seed in range(40)]
    assert sum(r[0] for r in runs) / 40 == pytest.approx(signal, rel=0.08)
    assert sum(r[1] for r in runs) >= 24


def test_a_value_aged_without_a_new_one_keeps_its_mean_and_loses_weight():
    value = SmoothedValue(window=4)
    for x in (1.0, 3.0):
        value.update(x)
    mean, count = value.mean, value.count
    value.age()
    assert value.mean == pytest.approx(mean) and value.count == pytest.approx(count)
    value.update(5.0)  # the older values decayed one step more, as if a value came between
    weights, values = (0.75**3, 0.75**2, 1.0), (1.0, 3.0, 5.0)
    assert value.mean == pytest.approx(sum(w * x for w, x in zip(weights, values)) / sum(weights))


def test_a_step_between_measurements_subtracts_the_trace_it_is_given_the_factor_of():
    noise = SmoothedNoise(10)
    noise.observe(between(5.0, 0.5))  # no trace yet: nothing learnt
    assert noise.count == 0
    noise.observe({"grad_sq_norm": 2.0, "trace": 4.0})
    noise.observe(between(5.0, 0.25))  # the finite-population factor, as given
    assert noise.signal.mean == pytest.approx((0.9 * 2.0 + (5.0 - 0.25 * 4.0)) / 1.9)
    assert noise.trace.count == 1
    noise.observe(between(math.nan, 0.25))  # a step without its norm adds nothing
    assert noise.signal.count == pytest.approx(1.9**2 / (0.81 + 1))


def test_the_noise_waits_for_a_few_traces_when_steps_between_add_the_signal_alone():
    noise = SmoothedNoise(window=20)
    for step in range(200):
        if step % 8 == 0:
            noise.observe({"grad_sq_norm": 1.0, "trace": 10.0})
        else:
            noise.observe(between(1.0 + 10.0 / 16, 1 / 16))
        assert noise.ready == (noise.count >= 10 and noise.trace.count >= MIN_TRACE)
        if noise.ready:
            break
    assert step > 24  # half a window of the signal came at step 10; the traces later


@pytest.mark.parametrize(("window", "every"), [(20, 10), (20, 16), (8, 4), (6, 4)])
def test_a_trace_measured_too_rarely_for_four_values_weight_still_makes_the_noise_ready(
    window, every
):
    """Values ``every`` steps apart, decayed at every step, never weigh four when the window
    is short beside the spacing (``(1 + q) / (1 - q) < 4``): the noise never became ready,
    and the noise-scale controllers kept their first batch all run. Ready once the trace
    holds nearly all its cadence allows; the default cadence still waits for four."""
    noise, twin = SmoothedNoise(window=window), SmoothedNoise(window=window)
    for step in range(20 * every):
        if step % every == 0:
            noise.observe({"grad_sq_norm": 1.0, "trace": 10.0})
        else:
            noise.observe(between(1.0 + 10.0 / 16, 1 / 16))
        if step == 3 * every:  # the spacing survives a checkpoint
            twin.load_state_dict(noise.state_dict())
        elif step > 3 * every:
            twin.observe({"grad_sq_norm": 1.0, "trace": 10.0} if step % every == 0 else
                         between(1.0 + 10.0 / 16, 1 / 16))  # fmt: skip
            assert twin.ready == noise.ready
        if noise.ready:
            break
    assert noise.ready and noise.trace.count < MIN_TRACE
    assert noise.trace.reachable < MIN_TRACE / 0.9 + 0.5


def test_the_default_cadence_still_waits_for_four_traces_weight():
    noise = SmoothedNoise(window=20)  # one step in 4: the trace can reach 9.8
    for step in range(200):
        noise.observe({"grad_sq_norm": 1.0, "trace": 10.0} if step % 4 == 0 else
                      between(1.0 + 10.0 / 16, 1 / 16))  # fmt: skip
        assert noise.ready == (noise.count >= 10 and noise.trace.count >= MIN_TRACE)


def test_the_signal_that_borrowed_the_trace_carries_the_traces_error_and_resumes():
    """The values of |G|² that subtracted the smoothed trace all share its error: the bounds
    add ``φ̄ σ_T`` to |G|²'s own standard error, and the share survives a checkpoint (one
    saved before it existed loads as no share)."""
    rng = random.Random(3)
    noise = SmoothedNoise(20)
    for step in range(200):
        if step % 4 == 0:
            noise.observe({"grad_sq_norm": 1.0 + rng.gauss(0, 0.3),
                           "trace": 50.0 * (1 + 0.5 * rng.gauss(0, 1))})  # fmt: skip
        else:
            noise.observe(between(1.0 + 50.0 / 16 + rng.gauss(0, 0.3), 1 / 16))
    share = noise.borrowed.mean
    assert 0.75 / 16 < share < 1 / 16  # most values borrowed, each at φ = 1/16
    own_low, own_high = noise.signal.interval(1.0)
    low, high = noise._signal_interval(1.0)
    widened = math.hypot(noise.signal.standard_error, share * noise.trace.standard_error)
    assert high - low == pytest.approx(2 * widened) and high - low > own_high - own_low
    copy = SmoothedNoise(20)
    copy.load_state_dict(noise.state_dict())
    assert copy.bounds(1.0) == noise.bounds(1.0)


def test_the_spread_is_the_sample_standard_deviation():
    value = SmoothedValue(window=1e9)  # (no forgetting: plain samples)
    value.update(1.0)
    value.update(3.0)
    assert value.spread == pytest.approx(math.sqrt(2))  # not the population's 1


def test_a_sparse_cadence_resumes_as_ready_as_it_ran():
    """A value every 5th step: its spacing is state; reset on load, a resumed controller
    was not ready for a while and held its batch."""
    running = SmoothedValue(window=4)
    for i in range(40):
        running.update(1.0) if i % 5 == 0 else running.age()
    resumed = SmoothedValue(window=4)
    resumed.load_state_dict(running.state_dict())
    assert running.holds(4) and resumed.holds(4)
    assert resumed.state_dict() == running.state_dict()

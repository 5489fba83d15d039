"""The critical-batch fit against curves of known critical batch."""

import math

import numpy as np
import pytest

from bigbatch.experiments.analysis import fit_critical_batch, mean_std

BATCHES = [64, 256, 1024, 4096, 16384]


@pytest.mark.parametrize("critical", [100.0, 1000.0, 5000.0])
def test_recovers_the_critical_batch_of_the_empirical_model(critical):
    points = [(b, 40 * (1 + critical / b)) for b in BATCHES]
    floor, fitted = fit_critical_batch(points)
    assert floor == pytest.approx(40, rel=1e-9)
    assert fitted == pytest.approx(critical, rel=1e-9)


def test_within_a_third_under_ten_percent_noise():
    rng = np.random.default_rng(0)
    for _ in range(50):
        points = [(b, 40 * (1 + 800 / b) * rng.uniform(0.9, 1.1)) for b in BATCHES]
        assert fit_critical_batch(points)[1] == pytest.approx(800, rel=1 / 3)


def test_steps_that_still_halve_or_never_fall_are_outside_the_range():
    halving = [(b, 1e6 / b) for b in BATCHES]
    assert fit_critical_batch(halving) == (0.0, math.inf)  # (its floor: round-off, 1e-14)
    flat = [(b, 50.0) for b in BATCHES]
    assert fit_critical_batch(flat) == (50.0, 0.0)
    rising = [(64, 50.0), (256, 60.0), (1024, 80.0)]  # its floor: the fewest steps
    assert fit_critical_batch(rising) == (50.0, 0.0)
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_critical_batch([(64, 10.0)])
    with pytest.raises(ValueError, match="must be positive"):
        fit_critical_batch([(0, 50.0), (256, 60.0)])


def test_mean_std_skips_what_is_missing():
    assert mean_std([1.0, None, 3.0, float("nan")]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_std([5.0]) == (5.0, 0.0)
    assert all(math.isnan(v) for v in mean_std([None]))


def test_first_reaching_finds_the_first_row_past_a_value_either_way():
    from bigbatch.experiments.analysis import first_reaching, targets_between

    rows = [
        {"step": 1, "samples": 64},  # a training row without an evaluation
        {"step": 10, "samples": 640, "eval_loss": 2.0, "eval_accuracy": 0.5},
        {"step": 20, "samples": 1280, "eval_loss": float("nan"), "eval_accuracy": 0.7},
        {"step": 30, "samples": 2560, "eval_loss": 1.5, "eval_accuracy": 0.9},
    ]
    assert first_reaching(rows, 1.8, "eval_loss", True) == (30, 2560)
    assert first_reaching(rows, 2.0, "eval_loss", True) == (10, 640)
    assert first_reaching(rows, 0.7, "eval_accuracy", False) == (20, 1280)
    assert first_reaching(rows, 1.0, "eval_loss", True) is None
    assert targets_between(5.0, 1.0, [0.5, 1.0]) == [3.0, 1.0]

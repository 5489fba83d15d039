import pytest
from hypothesis import given
from hypothesis import strategies as st

from bigbatch.duration import Duration


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25%", Duration(0.25, "budget")),
        ("2M tokens", Duration(2_000_000, "tokens")),
        ("500 steps", Duration(500, "steps")),
        ("1 step", Duration(1, "steps")),
        ("100k samples", Duration(100_000, "samples")),
        ("100000", Duration(100_000, "samples")),
        ("1.5k", Duration(1500, "samples")),
        ("1e6 tokens", Duration(1_000_000, "tokens")),
        (4096, Duration(4096, "samples")),
        (" 0 ", Duration(0, "samples")),
    ],
)
def test_parse(text, expected):
    assert Duration.parse(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("a while", "not a duration: 'a while'"),
        ("120%", "more than the whole budget"),
        ("1.5 steps", "whole number of steps"),
        ("-5 steps", "not a duration"),
        (True, "not a duration"),
    ],
)
def test_bad_text_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        Duration.parse(text)


@given(st.sampled_from(["samples", "tokens", "steps"]), st.integers(0, 10**12))
def test_text_round_trips(unit, value):
    duration = Duration(value, unit)
    assert Duration.parse(str(duration)) == duration


def test_elapsed_reads_each_unit_from_samples_and_steps():
    at = {"samples": 1000, "steps": 40}
    assert Duration.parse("10").elapsed(**at) == 1000
    assert Duration.parse("10 steps").elapsed(**at) == 40
    assert Duration.parse("10 tokens").elapsed(**at, tokens_per_sample=128) == 128_000
    assert Duration.parse("10%").elapsed(**at, budget=4000) == 0.25
    with pytest.raises(ValueError, match="give budget"):
        Duration.parse("10%").elapsed(**at)


def test_an_interval_ticks_where_the_run_passes_each_multiple():
    every = Duration.parse("10%")
    budget = 1000
    ticks = [s for s in range(64, 1001, 64) if every.crossed((s - 64, 0), (s, 0), budget=budget)]
    # each multiple of 100 samples is passed by exactly one step
    assert ticks == [128, 256, 320, 448, 512, 640, 704, 832, 960]
    # a share of the budget is a float: 0.3 / 0.1 must count as 3, not 2.999...
    assert every.crossed((299, 0), (300, 0), budget=1000)
    assert Duration.parse("1k tokens").crossed((30, 0), (32, 0), tokens_per_sample=32)
    assert Duration.parse("3 steps").crossed((0, 2), (16, 3)) and not (
        Duration.parse("3 steps").crossed((0, 3), (16, 4))
    )


def test_an_interval_is_a_count_of_steps_or_a_duration_longer_than_zero():
    assert Duration.interval(25) == 25
    assert Duration.interval("10%") == Duration(0.1, "budget")
    with pytest.raises(ValueError, match="longer than 0"):
        Duration.interval("0 steps")
    with pytest.raises(ValueError, match="longer than 0"):
        Duration.parse("0").crossed((0, 0), (1, 1))
    with pytest.raises(ValueError, match="at least 1 step, got 0"):
        Duration.interval(0)  # was returned as it was: an evaluation every 0 steps


@pytest.mark.parametrize(
    "value, unit, message",
    [
        (2.5, "steps", "a duration of steps is whole, got 2.5"),
        (True, "samples", "a number that is not negative, got True"),
        (3, "budget", "at most 1 .100%., got 3"),
    ],
)
def test_a_duration_built_directly_is_checked_as_its_text_is(value, unit, message):
    with pytest.raises(ValueError, match=message):
        Duration(value, unit)


def test_a_duration_as_a_share_of_the_budget():
    assert Duration.parse("25%").share(budget=1000) == 0.25
    assert Duration.parse("300k").share(budget=1_200_000) == 0.25
    assert Duration.parse("1M tokens").share(tokens_per_sample=8, budget=500_000) == 0.25
    with pytest.raises(ValueError, match="counts optimizer steps"):
        Duration.parse("500 steps").share(budget=1000)
    with pytest.raises(ValueError, match="give tokens_per_sample"):
        Duration.parse("1M tokens").share(budget=1000)
    with pytest.raises(ValueError, match="give budget"):
        Duration.parse("300k").share()


def test_the_whole_budget_is_a_share_of_it():
    assert Duration.parse("100%") == Duration(1.0, "budget")

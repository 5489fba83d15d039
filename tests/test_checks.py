"""The one validator of numbers, flags and choices: what it accepts and how it says no."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bigbatch._checks import check_flag, check_number, choice, did_you_mean, pair, whole_number


@pytest.mark.parametrize(
    "bounds, value, message",
    [
        ({}, -1, "x must be >= 0, got -1"),
        ({"low_open": True}, 0, "x must be > 0, got 0"),
        ({"low": -math.inf, "high": 1}, 2.5, "x must be <= 1, got 2.5"),
        ({"low": -math.inf, "high": 1, "high_open": True}, 1, "x must be < 1, got 1"),
        ({"low": 0, "high": 1, "low_open": True}, 0.0, r"x must be in \(0, 1\], got 0.0"),
        ({"low": 1e-8, "high": 1, "high_open": True}, 1, r"x must be in \[1e-08, 1\), got 1"),
        ({}, math.inf, "x must be finite, got inf"),
        ({}, math.nan, "x must be finite, got nan"),
        ({}, "1", "x must be a number, got '1'"),
        ({}, True, "x must be a number, got True"),
        ({"whole": True}, 1.0, "x must be a whole number, got 1.0"),
        ({"whole": True, "low": 1}, 0, "x must be a whole number >= 1, got 0"),
        (
            {"whole": True, "low": 0, "high": 8, "low_open": True},
            9,
            r"x must be a whole number in \(0, 8\], got 9",
        ),
    ],
)
def test_a_refused_number_names_the_value_and_the_interval(bounds, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        check_number("x", value, **bounds)


@given(
    st.floats(-10, 10),
    st.floats(-10, 10),
    st.booleans(),
    st.booleans(),
    st.floats(-20, 20),
)
def test_a_number_is_accepted_exactly_inside_its_interval(low, high, low_open, high_open, value):
    inside = (low < value if low_open else low <= value) and (
        value < high if high_open else value <= high
    )
    bounds = {"low": low, "high": high, "low_open": low_open, "high_open": high_open}
    if inside:
        assert check_number("x", value, **bounds) == value
    else:
        with pytest.raises(ValueError, match="x must be"):
            check_number("x", value, **bounds)


def test_numpys_integers_are_whole_numbers():
    import numpy as np

    assert whole_number("n", np.int64(5)) == 5 and type(whole_number("n", np.int64(5))) is int
    with pytest.raises(ValueError, match=r"n must be a whole number, got 5\.0"):
        whole_number("n", 5.0)


def test_a_whole_number_stays_whole_and_infinity_can_be_allowed():
    assert whole_number("n", 3) == 3 and isinstance(whole_number("n", 3), int)
    assert isinstance(check_number("x", 3), float)  # a number is returned as a float
    assert check_number("x", math.inf, allow_inf=True) == math.inf


def test_flags_and_choices():
    assert check_flag("on", False) is False
    with pytest.raises(ValueError, match=r"^on must be true or false, got 1$"):
        check_flag("on", 1)
    assert choice("mode", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError, match=r"^mode must be one of 'adam', 'sgd', got 'adm'; did"):
        choice("mode", "adm", ("adam", "sgd"))
    with pytest.raises(ValueError, match=r"^mode must be one of 'a', got 3$"):  # no hint to text
        choice("mode", 3, ("a",))
    assert did_you_mean("lamb", ["lars", "lamb2"]) == "; did you mean 'lamb2'?"
    assert did_you_mean("zzz", ["lars"]) == ""
    assert did_you_mean("LAMB", ["lars", "lamb"]) == "; did you mean 'lamb'?"  # case alone


def test_a_pair_is_two_items_and_anything_else_is_named():
    assert pair("bounds", [1, 2], "(low, high)") == (1, 2)
    for value in [(1,), (1, 2, 3), 5, "ab", None]:
        with pytest.raises(ValueError, match=r"bounds must be a pair \(low, high\), got "):
            pair("bounds", value, "(low, high)")

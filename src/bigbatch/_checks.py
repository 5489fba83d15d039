"""Argument checks shared across modules: one message shape for every bad value."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any


def whole_number(name: str, value: Any, low: int = 0) -> int:
    """``value`` if it is a whole number >= ``low``, else ``ValueError`` naming both."""
    return check_number(name, value, low=low, whole=True)


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a whole number >= 1, else ``ValueError`` naming ``name`` and ``value``."""
    return whole_number(name, value, low=1)


def pair(name: str, value: Any, shape: str) -> tuple[Any, Any]:
    """``value`` as a 2-tuple, else ``ValueError`` naming it and the ``shape`` expected."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be a pair {shape}, got {value!r}")
    return value[0], value[1]


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming both (and the
    closest choice)."""
    if value not in choices:
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}"
        )
    return value


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the option closest to ``word``, or nothing."""
    options = list(options)
    # case first: difflib scores 'LAMB' against 'lamb' as unlike
    close = [o for o in options if o.lower() == word.lower()]
    close = close or difflib.get_close_matches(word, options, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_number(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    whole: bool = False,
) -> Any:
    """``value`` as a float (a whole number as itself), else ``ValueError`` naming ``name``,
    the bounds and ``value``. Real numbers only (no tensors); no NaN, no infinity unless
    ``allow_inf``; ``whole``: an integer."""
    kind = "a whole number" if whole else "a number"
    expected = numbers.Integral if whole else numbers.Real
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if whole:  # numpy's integers are whole numbers too, kept as Python's
        value = int(value)
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        bounds = _bounds(low, high, low_open, high_open)
        raise ValueError(f"{name} must be {kind + ' ' if whole else ''}{bounds}, got {value!r}")
    return value if whole else number


def _bounds(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """``>= 0``, ``< 1`` or ``in (0, 1]``: an interval as an error message says it."""
    low_text, high_text = _shown(low), _shown(high)
    if math.isinf(high):
        return f"{'>' if low_open else '>='} {low_text}"
    if math.isinf(low):
        return f"{'<' if high_open else '<='} {high_text}"
    return f"in {'(' if low_open else '['}{low_text}, {high_text}{')' if high_open else ']'}"


def _shown(bound: float) -> str:
    """A bound as written: a whole one in full (4294967295, not 4.29497e+09)."""
    whole = math.isfinite(bound) and float(bound).is_integer() and abs(bound) < 1e16
    return str(int(bound)) if whole else f"{bound:g}"


def rank_in_world(rank: Any, world_size: Any, size_name: str = "world_size") -> tuple[int, int]:
    """``rank`` in ``[0, world_size)`` and ``world_size`` at least 1, as Python ints."""
    world_size = positive_int(size_name, world_size)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise ValueError(f"rank must be a whole number in [0, {world_size}), got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    return int(rank), world_size


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def batch_bounds(
    initial: Any, low: Any, high: Any, names: Sequence[str] = ("initial", "min", "max")
) -> tuple[int, int, int]:
    """Whole-number batch bounds with ``min <= initial <= max``; ``names`` name them in errors."""
    initial, low, high = (positive_int(n, v) for n, v in zip(names, (initial, low, high)))
    if low > high:
        raise ValueError(f"{names[1]} ({low}) is larger than {names[2]} ({high})")
    if not low <= initial <= high:
        raise ValueError(
            f"{names[0]} ({initial}) is outside [{names[1]}, {names[2]}] = [{low}, {high}]"
        )
    return initial, low, high


def check_param_groups(saved: list[int], own: list[int]) -> None:
    # a saved optimizer state's parameters per group against the optimizer's: torch matches
    # them by place, and would load another's half-way before it raised
    if saved != own:
        raise ValueError(
            f"the saved optimizer state has param groups of {saved} parameters where the "
            f"loop's optimizer has {own}: was it saved with another model or optimizer?"
        )

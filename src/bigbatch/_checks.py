"""Argument checks shared across modules: one message shape for every bad value."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any


def whole_number(name: str, value: Any, low: int = 0) -> int:
    """``value`` if it is a whole number >= ``low``, else ``ValueError`` naming both."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return value


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a whole number >= 1, else ``ValueError`` naming ``name`` and ``value``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    return value


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else ``ValueError`` naming both."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_number(
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """Return ``value`` as a float, or raise ``ValueError`` naming ``name`` and ``value``.

    Any real number is accepted (Python, numpy or 0-dim tensor scalars are
    not: a tensor hyper-parameter is a different feature); NaN and, unless
    ``allow_inf``, infinities are not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high or (math.isinf(value) and not allow_inf):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be a finite number in {lo}{low}, {high}{hi}, got {value!r}")
    return value


def check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
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

"""Matplotlib for the reports, drawn to files (the Agg backend: no screen needed)."""

from __future__ import annotations

import math
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

__all__ = ["pyplot", "series"]


def pyplot():
    """``matplotlib.pyplot`` with the file backend."""
    return plt


def series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """The rows' ``x`` and ``y`` where ``y`` is a finite number: one line to draw."""
    pairs = [(r[x], r[y]) for r in rows if y in r and r[y] is not None and math.isfinite(r[y])]
    return [p[0] for p in pairs], [p[1] for p in pairs]

"""Matplotlib for the reports, drawn to files (the Agg backend: no screen needed), and
their markdown tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

__all__ = ["plt", "save", "series", "table"]


def series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """The rows' ``x`` and ``y`` where ``y`` is a finite number: one line to draw."""
    pairs = [(r[x], r[y]) for r in rows if y in r and r[y] is not None and math.isfinite(r[y])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def save(fig: Any, path: Path, dpi: int = 100) -> None:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines: the header, its rule, a line per row."""
    lines = [f"| {' | '.join(map(str, cells))} |" for cells in (header, *rows)]
    return [lines[0], "|" + "---|" * len(header), *lines[1:]]

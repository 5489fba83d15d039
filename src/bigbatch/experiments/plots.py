"""Matplotlib for the reports, drawn to files (the Agg backend: no screen needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

__all__ = ["pyplot"]


def pyplot():
    """``matplotlib.pyplot`` with the file backend."""
    return plt

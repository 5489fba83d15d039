"""Numbers drawn from several runs: seed statistics and the critical batch of a steps curve."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import numpy as np


def mean_std(values: Iterable[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite values (NaN, NaN when there are none)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def fit_critical_batch(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(S_min, B_crit)`` of ``steps ≈ S_min · (1 + B_crit / B)`` through ``(batch, steps)``.

    McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11): at
    ``B_crit`` the steps to a target are twice their floor ``S_min``. Linear in ``1/B``,
    fitted on relative errors (each batch weighs alike); ``B_crit`` is ``inf`` where the
    steps halve across the whole range, 0 where they do not fall with the batch.
    """
    if len(points) < 2:
        raise ValueError(f"a critical batch needs steps at two batch sizes at least, got {points}")
    batch = np.array([p[0] for p in points], dtype=float)
    steps = np.array([p[1] for p in points], dtype=float)
    if np.any(batch <= 0) or np.any(steps <= 0):
        raise ValueError(f"batches and steps must be positive, got {list(points)}")
    # (S - a - b/B) / S = 1 - a/S - (b/B)/S: least squares of [1/S, 1/(B S)] @ [a, b] ≈ 1
    design = np.stack([1 / steps, 1 / (batch * steps)], axis=1)
    (floor, slope), *_ = np.linalg.lstsq(design, np.ones_like(steps), rcond=None)
    # a term below a billionth of the steps is the solver's round-off (exact 1/B steps
    # gave a floor of 1e-14 and B_crit 4.7e17), so it is taken as none
    negligible = 1e-9 * float(np.max(steps))
    if slope / float(np.min(batch)) <= negligible:
        return float(np.min(steps)), 0.0
    if floor <= negligible:
        return 0.0, math.inf
    return float(floor), float(slope / floor)


def first_reaching(
    rows: Iterable[dict], value: float, key: str, lower_is_better: bool
) -> tuple[int, int] | None:
    """``(step, samples)`` of the first evaluation row whose ``key`` reaches ``value``
    (at or below it for a loss, at or above for an accuracy); None if none does."""
    for row in rows:
        got = row.get(key)
        if got is None or not math.isfinite(got):
            continue
        if (got <= value) if lower_is_better else (got >= value):
            return int(row["step"]), int(row["samples"])
    return None


def targets_between(start: float, end: float, fractions: Sequence[float]) -> list[float]:
    """The values ``fraction`` of the way from ``start`` (the initial metric) to ``end``
    (the best static arm's final metric): targets that every task has, whatever its units."""
    return [start + f * (end - start) for f in fractions]

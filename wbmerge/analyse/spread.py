"""The spread of a metric across ranks, one definition for `report` and `--skew-metrics`.

spread = (max - min) / |median| over the ranks' finite values at one step, with the true
median (the mean of the two middle values when the count is even). It is undefined (NaN)
for fewer than two values or a median of zero. For example, ranks logging 0.5, 1.0 and 1.5
have the spread (1.5 - 0.5) / 1.0 = 1.0.
"""

from __future__ import annotations

import numpy as np


def spread_of(
    count: np.ndarray, low: np.ndarray, median: np.ndarray, high: np.ndarray
) -> np.ndarray:
    """The spread of each step from the count, min, median and max of its finite values;
    NaN where undefined."""
    with np.errstate(all="ignore"):
        value = (high - low) / np.abs(median)
    return np.where((count >= 2) & (median != 0), value, np.nan)


def spreads(grid: np.ndarray) -> np.ndarray:
    """The spread of every column of `grid` (ranks x steps; NaN where a rank has no value)."""
    grid = np.where(np.isfinite(grid), grid, np.nan)
    result = np.full(grid.shape[1], np.nan)
    count = np.isfinite(grid).sum(axis=0)
    counted = count >= 2
    if not counted.any():
        return result
    part = grid[:, counted]
    with np.errstate(all="ignore"):
        median = np.nanmedian(part, axis=0)
        low, high = np.nanmin(part, axis=0), np.nanmax(part, axis=0)
    result[counted] = spread_of(count[counted], low, median, high)
    return result

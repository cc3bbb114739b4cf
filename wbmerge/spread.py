"""The spread of a metric across ranks, one definition for `report` and `--skew-metrics`.

spread = (max - min) / |median| over the ranks' finite values at one step, with the true
median (the mean of the two middle values when the count is even). It is undefined (None,
NaN in arrays) for fewer than two values or a median of zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def spread(values: Iterable[float]) -> float | None:
    """The spread of one step's values across ranks, or None when undefined."""
    finite = sorted(v for v in values if math.isfinite(v))
    count = len(finite)
    if count < 2:
        return None
    middle = count // 2
    median = finite[middle] if count % 2 else (finite[middle - 1] + finite[middle]) / 2
    if median == 0:
        return None
    return (finite[-1] - finite[0]) / abs(median)


def spreads(grid: np.ndarray) -> np.ndarray:
    """`spread` of every column of `grid` (ranks x steps; NaN where a rank has no value),
    NaN where undefined. The same numbers as `spread`, computed for all steps at once."""
    grid = np.where(np.isfinite(grid), grid, np.nan)
    result = np.full(grid.shape[1], np.nan)
    counted = np.isfinite(grid).sum(axis=0) >= 2
    if not counted.any():
        return result
    part = grid[:, counted]
    with np.errstate(all="ignore"):
        median = np.nanmedian(part, axis=0)
        value = (np.nanmax(part, axis=0) - np.nanmin(part, axis=0)) / np.abs(median)
    value[median == 0] = np.nan
    result[counted] = value
    return result

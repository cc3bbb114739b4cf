"""Statistics across ranks, and which keys keep a series per rank: shared runs W&B can show.

A shared run labels every key per rank, so 1024 ranks that log 20 metrics make 20,480
distinct metrics, twice what W&B recommends for a whole project (fewer than 10,000 for a
responsive UI). Instead of (or besides) a series per rank, a key can get per-step statistics
across ranks, six keys however many ranks there are: `{key}/ranks/min`, `median`, `max`,
`mean`, and `min_rank`, `max_rank`, the rank that logged the minimum and the maximum (the
statistic takes the place of the rank's label in `--key-format`).

The statistics of one key at one step are over the ranks that logged a number for it at
that step, the values exactly as the per-rank series show them:

- a value that is not a JSON number (a string, `true`, null, a dict, a list) is left out,
  as if that rank had not logged the key at that step; a step where no rank logged a number
  gets no statistics;
- NaN counts as a value greater than every number, +Infinity included (the order numpy
  sorts in): one rank's NaN makes `max` and `mean` NaN and names that rank in `max_rank`,
  so a diverged rank shows; infinities are ordinary values;
- the median is the true median, the mean of the two middle values for an even count;
- ties for the minimum or the maximum go to the lowest rank;
- a rank that logged a key twice in one row counts once, with its last value.

This module is pure: the statistics are computed with numpy over a batch of steps at once
(`across_ranks`), in one of two ways chosen by how full the batch is, with the same result.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import WbmergeError

STATS = ("min", "median", "max", "mean", "min_rank", "max_rank")
# W&B's recommendation: fewer distinct metrics than this in a project, for a responsive UI
METRIC_BOUND = 10_000


# -- which keys keep a series per rank -----------------------------------------------------


@dataclass(frozen=True)
class PerRank:
    """Which keys of a shared run keep a series per rank (`--per-rank`).

    `patterns` None is the default, every key, with a warning past W&B's bound; `("*",)`
    is every key as chosen (`--per-rank all`, no warning); `()` is none (`--per-rank none`);
    else keys and globs (`*`, `?`, `[...]`, matched against the whole key as logged, `/`
    included, case-sensitive).
    """

    patterns: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, values: Sequence[str] | None) -> PerRank:
        """From the values of `--per-rank` (repeatable): `all`, `none`, or keys and globs."""
        if not values:
            return cls(None)
        words = [v for v in values if v in ("all", "none")]
        if words and len(values) > 1:
            raise WbmergeError(
                f"--per-rank {words[0]} cannot be combined with other values "
                f"(got {', '.join(values)})"
            )
        if words:
            return cls(("*",) if words[0] == "all" else ())
        empty = [v for v in values if not v.strip()]
        if empty:
            raise WbmergeError("--per-rank needs a key or glob, got an empty value")
        return cls(tuple(values))

    def keeps(self, key: str) -> bool:
        """Whether the top-level key `key` (the part a rank's label is added to) keeps a
        series per rank."""
        if self.patterns is None:
            return True
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.patterns)

    def unmatched(self, keys: Iterable[str]) -> list[str]:
        """The patterns that match none of `keys` (probably misspelled)."""
        if not self.patterns or self.patterns == ("*",):
            return []
        keys = list(keys)
        return [p for p in self.patterns if not any(fnmatch.fnmatchcase(k, p) for k in keys)]


def stat_key(key_format: str, key: str, stat: str) -> str:
    """The key of a statistic of `key`: `--key-format` with `ranks/{stat}` as the label."""
    return key_format.format(key=key, label=f"ranks/{stat}")


# -- the bound -----------------------------------------------------------------------------


def bound_notice(
    run_id: str, metrics: int, ranks: int, per_rank: PerRank, bound: int = METRIC_BOUND
) -> str | None:
    """One line when a merged run has more distinct metrics than W&B recommends for a whole
    project, naming the options that shrink it; None under the bound, or when the user
    chose every key per rank (`--per-rank all`)."""
    if metrics <= bound or per_rank.patterns == ("*",):
        return None
    return (
        f"run {run_id} has {metrics:,} distinct metrics ({ranks} ranks, each key labelled "
        f"per rank), over the {bound:,} W&B recommends per project for a responsive UI; "
        "--rank-stats adds min/median/max/mean across ranks per step, --per-rank none "
        "(or --per-rank KEY, globs allowed) keeps per-rank series of fewer keys, "
        "--per-rank all keeps them all without this warning"
    )


# -- the statistics ------------------------------------------------------------------------


@dataclass
class AcrossRanks:
    """Statistics across ranks, one entry per (step, key) that any rank logged a number
    for, sorted by step, then key. Ranks are the ids the caller gave."""

    step: np.ndarray  # int64
    key: np.ndarray  # int64
    count: np.ndarray  # int64: ranks that logged a number (NaN included)
    min: np.ndarray  # float64
    median: np.ndarray
    max: np.ndarray
    mean: np.ndarray
    min_rank: np.ndarray  # int64
    max_rank: np.ndarray

    def __len__(self) -> int:
        return len(self.step)

    def column(self, stat: str) -> np.ndarray:
        return getattr(self, stat)


_GRID_FILL = 4  # the grid way when the (step, key) x rank grid is at most this x the entries


def across_ranks(
    step: np.ndarray, key: np.ndarray, rank: np.ndarray, value: np.ndarray
) -> AcrossRanks:
    """The statistics of every (step, key) across ranks, from one entry per logged number:
    rank `rank[i]` logged `value[i]` for key `key[i]` (an integer id) at step `step[i]`.
    An entry repeated for the same (step, key, rank) counts once, the later one.

    Full batches (every rank logging the same keys at the same steps, the usual case) are
    laid out as a grid of (step, key) rows and rank columns and reduced along the rows;
    sparse ones are sorted instead, which costs more per entry but nothing per empty cell.
    """
    step, key, rank = (np.asarray(a, np.int64) for a in (step, key, rank))
    value = np.asarray(value, np.float64)
    if not len(step):
        empty_i, empty_f = np.empty(0, np.int64), np.empty(0, np.float64)
        return AcrossRanks(empty_i, empty_i, empty_i, *[empty_f] * 4, empty_i, empty_i)
    column, ranks = dense_ids(rank)
    step_id, steps = dense_ids(step)
    key_id, keys = dense_ids(key)
    row, groups = dense_ids(step_id * len(keys) + key_id)
    cells = len(groups) * len(ranks)
    cell = row * len(ranks) + column
    grid = cells <= _GRID_FILL * len(cell)
    if grid:
        repeated = np.bincount(cell, minlength=cells).max() > 1
    else:
        repeated = len(np.unique(cell)) < len(cell)
    if repeated:
        last = last_of_each(cell)
        cell, row, column, value = cell[last], row[last], column[last], value[last]
    if grid:
        stats = _grid_stats(len(groups), len(ranks), cell, value)
    else:
        stats = _sorted_stats(row, column, value)
    count, low, median, high, mean, low_col, high_col = stats
    return AcrossRanks(
        steps[groups // len(keys)],
        keys[groups % len(keys)],
        count,
        low,
        median,
        high,
        mean,
        ranks[low_col],
        ranks[high_col],
    )


def dense_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each value's index among the distinct values, the distinct values ascending): by a
    table of the values' range when it is small (no sort), else by sorting."""
    low, high = int(values.min()), int(values.max())
    if high - low <= 4 * len(values) + 1024:
        offset = values - low
        seen = np.zeros(high - low + 1, bool)
        seen[offset] = True
        return (np.cumsum(seen) - 1)[offset], np.flatnonzero(seen) + low
    distinct, ids = np.unique(values, return_inverse=True)
    return ids.reshape(-1), distinct


def last_of_each(cell: np.ndarray) -> np.ndarray:
    """Indices of the last entry of each cell, in entry order."""
    _, first_from_end = np.unique(cell[::-1], return_index=True)
    return np.sort(len(cell) - 1 - first_from_end)


def _grid_stats(rows: int, cols: int, cell: np.ndarray, value: np.ndarray) -> tuple:
    grid = np.full(rows * cols, np.nan)
    present = np.zeros(rows * cols, bool)
    grid[cell] = value
    present[cell] = True
    grid, present = grid.reshape(rows, cols), present.reshape(rows, cols)
    nan = present & np.isnan(grid)
    number = present & ~nan
    count = present.sum(1)
    numbers = number.sum(1)
    any_nan = nan.any(1)
    first_nan = np.argmax(nan, 1)
    with np.errstate(invalid="ignore", over="ignore"):  # (a sum past 1.8e308 is infinite)
        low = np.where(number, grid, np.inf).min(1)
        high = np.where(number, grid, -np.inf).max(1)
        total = np.where(present, grid, 0.0).sum(1)
    # the first (lowest) rank holding the extreme; NaN (above every number) when only NaN
    low_col = np.where(numbers > 0, np.argmax(number & (grid == low[:, None]), 1), first_nan)
    low = np.where(numbers > 0, low, np.nan)
    high_col = np.where(any_nan, first_nan, np.argmax(number & (grid == high[:, None]), 1))
    high = np.where(any_nan, np.nan, high)
    ordered = np.sort(np.where(number, grid, np.nan), 1)  # numbers first, ascending
    median = _middle(ordered.reshape(-1), np.arange(rows) * cols, count)
    mean = _mean(
        total, count, low, high, lambda scale: np.where(present, grid / scale[:, None], 0.0).sum(1)
    )
    return count, low, median, high, mean, low_col, high_col


def _sorted_stats(row: np.ndarray, column: np.ndarray, value: np.ndarray) -> tuple:
    nan = np.isnan(value)
    order = np.lexsort((column, np.where(nan, 0.0, value), nan, row))
    row, column, value, nan = row[order], column[order], value[order], nan[order]
    starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
    ends = np.append(starts[1:], len(row))
    count = ends - starts
    # the first entry of the run of entries equal to each one (NaN equal to NaN)
    same = (row[1:] == row[:-1]) & (nan[1:] == nan[:-1])
    same &= (value[1:] == value[:-1]) | nan[1:]
    run_start = np.maximum.accumulate(
        np.where(np.concatenate([[False], same]), 0, np.arange(len(row)))
    )
    with np.errstate(invalid="ignore", over="ignore"):  # (a sum past 1.8e308 is infinite)
        total = np.add.reduceat(value, starts)
    low, high = value[starts], value[ends - 1]
    mean = _mean(
        total,
        count,
        low,
        high,
        lambda scale: np.add.reduceat(value / np.repeat(scale, count), starts),
    )
    median = _middle(value, starts, count)
    top = run_start[ends - 1]
    return count, low, median, high, mean, column[starts], column[top]


def _mean(
    total: np.ndarray,
    count: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    scaled_total: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """Each group's mean from its sum. A sum of finite numbers may pass 1.8e308 on its way:
    to an infinity, or to NaN where numpy's pairwise summation adds one half's -inf to the
    other's inf (8 values or more: -1e308, -1e308, 0 x 4, 1e308, 1e308). So: with NaN
    among the values (the group's `high` is NaN then) the mean is NaN; with an infinity it
    is that infinity (NaN with both); where only finite numbers were summed and the sum is
    not finite, it is the sum of the values divided by the group's largest magnitude
    (`scaled_total(scale)`), which cannot overflow, times that magnitude: the mean of
    [1e308, 1e308] is 1e308."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        mean = total / count
        up, down = high == np.inf, low == -np.inf
        infinite = np.where(up & down, np.nan, np.where(up, np.inf, -np.inf))
        mean = np.where(~np.isnan(high) & (up | down), infinite, mean)
        spilled = ~np.isfinite(mean) & np.isfinite(low) & np.isfinite(high)
        if not spilled.any():
            return mean
        scale = np.maximum(np.abs(low), np.abs(high))
        return np.where(spilled, scaled_total(scale) / count * scale, mean)


def _middle(ordered: np.ndarray, starts: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The median of each group of `ordered` (ascending, NaN last) from `starts[i]`, of
    `count[i]` values: the middle one, or the mean of the two middle ones."""
    low = ordered[starts + (count - 1) // 2]
    high = ordered[starts + count // 2]
    with np.errstate(invalid="ignore", over="ignore"):
        halfway = (low + high) / 2
        spilled = np.isinf(halfway) & np.isfinite(low) & np.isfinite(high)  # 1e308 twice
        halfway = np.where(spilled, low / 2 + high / 2, halfway)
        return np.where(count % 2 == 1, low, halfway)


def one_step(values: Mapping[int, float]) -> dict[str, float | int] | None:
    """The statistics of one step's values by rank (rank -> number), as a dict with the
    keys of `STATS` and `count`; None without values."""
    if not values:
        return None
    ranks = np.fromiter(values, np.int64, len(values))
    numbers = np.fromiter(values.values(), np.float64, len(values))
    zeros = np.zeros(len(ranks), np.int64)
    stats = across_ranks(zeros, zeros, ranks, numbers)
    found: dict[str, float | int] = {"count": int(stats.count[0])}
    for stat in STATS:
        number = stats.column(stat)[0]
        found[stat] = int(number) if stat.endswith("_rank") else float(number)
    return found

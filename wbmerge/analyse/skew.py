"""`wbmerge report`: per-rank skew of a job's metrics, from the offline runs alone.

For each metric: every rank's mean, last, min and max; across ranks, at the steps two or
more ranks logged, the spread (`wbmerge.analyse.spread`: (max - min) / |median|, the definition
`--skew-metrics` uses too; its mean and worst over the steps); the
highest and lowest rank by mean and, for metrics whose name says which way is faster
(throughput, step time), the slowest and fastest; and the outlier ranks: those whose mean
is far from the median rank's (robust z-score over 3.5, from the median absolute deviation,
and at least 5 % off). System metrics have no steps, so their spread is that of the means.
With `rank_stats`, each history metric also gets the statistics across ranks
(`wbmerge.analyse.rankstats`) at its last step: the values the merged run's summary gives the
`{key}/ranks/...` keys of `--rank-stats`.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import WbmergeError
from ..identify import Hints, Job, discover, few_ranks, group_jobs
from ..runtime import streaming
from .columns import HISTORY, rank_columns, rank_sources
from .rankstats import one_step
from .spread import spreads

_FASTER_WHEN_HIGHER = re.compile(r"per_s(ec)?\b|/s$|throughput|samples_per|tokens_per|it/s|fps")
_FASTER_WHEN_LOWER = re.compile(r"time|latency|duration|_ms$|seconds")
OUTLIER_Z = 3.5
OUTLIER_MIN_DEVIATION = 0.05


@dataclass
class RankStats:
    rank: int
    label: str
    count: int
    mean: float
    last: float
    min: float
    max: float


@dataclass
class MetricReport:
    key: str
    kind: str  # history or system
    ranks: list[RankStats]
    spread_mean: float | None  # (max - min) / median across ranks, mean over aligned steps
    spread_max: float | None
    aligned_steps: int
    highest: int  # rank with the highest mean
    lowest: int
    faster: str | None  # "higher" / "lower" when the name says so, else None
    slowest: int | None
    fastest: int | None
    outliers: list[int] = field(default_factory=list)
    # with rank_stats: min, median, max, mean, min_rank, max_rank, count at `step`, the last
    across_ranks: dict | None = None
    # with series (for a picture, not in the JSON): rank -> (steps or times, values) in
    # order, and the spread across ranks at each step two or more ranks logged
    series: dict[int, tuple[list, list]] | None = None
    spread_series: tuple[list, list] | None = None


@dataclass
class RankPlace:
    """Where a rank ran: its node (worker), local rank, host and label, and its restarts."""

    rank: int
    label: str
    worker: int
    local_rank: int
    host: str
    restarts: int


@dataclass
class JobReport:
    job_id: str
    world_size: int
    metrics: list[MetricReport]
    damage: list[str] = field(default_factory=list)  # what damaged logs lost
    warnings: list[str] = field(default_factory=list)  # what was assumed about ranks
    places: list[RankPlace] = field(default_factory=list)  # with series: ranks and nodes

    def to_dict(self) -> dict:
        """The report as JSON has it: the series and places kept for a picture left out."""
        plain = asdict(replace(self, metrics=[], places=[]))
        plain.pop("places")
        plain["metrics"] = [
            asdict(replace(metric, series=None, spread_series=None)) for metric in self.metrics
        ]
        for metric in plain["metrics"]:
            metric.pop("series")
            metric.pop("spread_series")
        return _finite(plain)


def report(
    paths: Sequence[str | Path],
    metrics: Sequence[str] = (),
    job: str | None = None,
    hints: Hints | None = None,
    rank_stats: bool = False,
    series: bool = False,
) -> list[JobReport]:
    """A report per job found under `paths` (or for `job`); `metrics` narrows the keys;
    `hints` say how to read the ranks of runs written without wbmerge; `rank_stats` adds
    each history metric's statistics across ranks at its last step; `series` keeps every
    rank's values and the spread over steps, and where each rank ran (for `skew_html`)."""
    reports = []
    with streaming():
        found_jobs = group_jobs(discover(paths, hints=hints), job, allow_missing_ranks=True)
        for found in found_jobs:
            made = _job_report(found, metrics, rank_stats, series)
            made.warnings = found.warnings
            if series:
                made.places = _places(found)
            if found.missing_ranks:
                missing = few_ranks(found.missing_ranks)
                made.warnings.append(
                    f"job {found.job_id}: rank(s) {missing} of {found.world_size} have no "
                    "offline run; the report covers the others"
                )
            reports.append(made)
    return reports


def _places(found: Job) -> list[RankPlace]:
    by_rank: dict[int, list] = {}
    for run in found.runs:
        by_rank.setdefault(run.rank.rank, []).append(run)
    places = []
    for rank, runs in sorted(by_rank.items()):
        first = min(runs, key=lambda run: run.rank.restart)
        info = first.rank
        places.append(
            RankPlace(rank, first.label, info.worker, info.local_rank, first.host, len(runs) - 1)
        )
    return places


def _job_report(
    found: Job, metrics: Sequence[str], rank_stats: bool = False, series: bool = False
) -> JobReport:
    values: dict[tuple[str, str], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    labels: dict[int, str] = {}
    damage: list[str] = []
    for sources in rank_sources(found):
        rank = sources[0].rank.rank
        labels[rank] = sources[0].label
        chunks: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
        for columns in rank_columns(sources, damage):
            number = columns.value.is_valid().to_numpy(zero_copy_only=False)
            keys = columns.key.to_numpy(zero_copy_only=False)[number]
            value = columns.value.to_numpy(zero_copy_only=False)[number]
            if columns.kind == HISTORY:
                order = columns.step.to_numpy(zero_copy_only=False)[number]
            else:
                order = columns.timestamp.to_numpy(zero_copy_only=False)[number]
            for key in np.unique(keys):
                chosen = keys == key
                chunks.setdefault((columns.kind, key), []).append((order[chosen], value[chosen]))
        for name, parts in chunks.items():
            values.setdefault(name, {})[rank] = (
                np.concatenate([p[0] for p in parts]),
                np.concatenate([p[1] for p in parts]),
            )
    chosen = _choose(values, len(labels), metrics)
    return JobReport(
        found.job_id,
        found.world_size,
        [_metric(kind, key, values[kind, key], labels, rank_stats, series) for kind, key in chosen],
        damage,
    )


def _choose(values: dict, ranks: int, metrics: Sequence[str]) -> list[tuple[str, str]]:
    if metrics:
        chosen = []
        for key in metrics:
            found = [name for name in values if name[1] == key]
            if not found:
                raise WbmergeError(f"no numeric metric {key!r} in the runs ({_known(values, key)})")
            chosen.extend(found)
        return chosen
    return sorted(
        (name for name, by_rank in values.items() if len(by_rank) == ranks),
        key=lambda name: (name[0] != HISTORY, name[1]),
    )


def _known(values: dict, key: str) -> str:
    """The metrics a mistyped `key` may have meant, else some there are, history first."""
    names = sorted({k for _, k in values})
    close = [name for name in names if name.endswith("/" + key)][:3]  # (`loss`: `train/loss`)
    if close := close or difflib.get_close_matches(key, names, n=3, cutoff=0.6):
        return f"did you mean {' or '.join(map(repr, close))}?"
    history_first = sorted(values, key=lambda name: (name[0] != HISTORY, name[1]))
    return f"some that are: {', '.join(dict.fromkeys(k for _, k in history_first[:8]))}"


def _metric(
    kind: str,
    key: str,
    by_rank: dict,
    labels: dict[int, str],
    rank_stats: bool = False,
    series: bool = False,
) -> MetricReport:
    ranks = []
    for rank, (order, value) in sorted(by_rank.items()):
        finite = value[np.isfinite(value)]
        last = value[np.argmax(order)] if len(order) else math.nan
        ranks.append(
            RankStats(
                rank,
                labels[rank],
                len(value),
                float(finite.mean()) if len(finite) else math.nan,
                float(last),
                float(finite.min()) if len(finite) else math.nan,
                float(finite.max()) if len(finite) else math.nan,
            )
        )
    means = np.array([r.mean for r in ranks])
    ids = [r.rank for r in ranks]
    if kind == HISTORY:
        spreads = _aligned_spreads(by_rank)
    else:
        spreads = _spreads(means[:, None]) if len(ranks) > 1 else np.array([])
    faster = _direction(key)
    valid = np.isfinite(means)
    highest = ids[int(np.nanargmax(means))] if valid.any() else ids[0]
    lowest = ids[int(np.nanargmin(means))] if valid.any() else ids[0]
    return MetricReport(
        key=key,
        kind=kind,
        ranks=ranks,
        spread_mean=float(spreads.mean()) if len(spreads) else None,
        spread_max=float(spreads.max()) if len(spreads) else None,
        aligned_steps=len(spreads) if kind == HISTORY else 0,
        highest=highest,
        lowest=lowest,
        faster=faster,
        slowest=None if faster is None else (lowest if faster == "higher" else highest),
        fastest=None if faster is None else (highest if faster == "higher" else lowest),
        outliers=[ids[i] for i in outliers(means)],
        across_ranks=_last_step_stats(by_rank) if rank_stats and kind == HISTORY else None,
        series=_series(by_rank) if series else None,
        spread_series=_spread_over_steps(by_rank) if series and kind == HISTORY else None,
    )


def _series(by_rank: dict) -> dict[int, tuple[list, list]]:
    """Each rank's values in the order of their steps (or times)."""
    found = {}
    for rank, (order, value) in sorted(by_rank.items()):
        sort = np.argsort(order, kind="stable")
        found[rank] = (order[sort].tolist(), value[sort].tolist())
    return found


def _spread_over_steps(by_rank: dict) -> tuple[list, list]:
    """(steps, spread) at each step two or more ranks logged where the spread is defined."""
    steps = np.unique(np.concatenate([order for order, _ in by_rank.values()]))
    grid = np.full((len(by_rank), len(steps)), np.nan)
    for row, (order, value) in enumerate(by_rank.values()):
        grid[row, np.searchsorted(steps, order)] = value
    spread = spreads(grid) if len(steps) else np.array([])
    defined = np.isfinite(spread)
    return steps[defined].tolist(), spread[defined].tolist()


def _last_step_stats(by_rank: dict) -> dict | None:
    """The statistics across ranks of the values at the last step any rank logged (a rank
    that logged the key twice at that step: its last value, as in a merged row)."""
    ends = [int(order.max()) for order, _ in by_rank.values() if len(order)]
    if not ends:
        return None
    step = max(ends)
    at_step = {}
    for rank, (order, value) in by_rank.items():
        where = np.flatnonzero(order == step)
        if len(where):
            at_step[rank] = float(value[where[-1]])
    found = one_step(at_step)
    return None if found is None else {"step": step, **found}


def _direction(key: str) -> str | None:
    name = key.lower()
    if _FASTER_WHEN_HIGHER.search(name):
        return "higher"
    if _FASTER_WHEN_LOWER.search(name):
        return "lower"
    return None


def _aligned_spreads(by_rank: dict) -> np.ndarray:
    """(max - min) / median across ranks at each step that two or more ranks logged."""
    steps = np.unique(np.concatenate([order for order, _ in by_rank.values()]))
    grid = np.full((len(by_rank), len(steps)), np.nan)
    for row, (order, value) in enumerate(by_rank.values()):
        grid[row, np.searchsorted(steps, order)] = value
    shared = (np.isfinite(grid).sum(axis=0)) >= 2
    return _spreads(grid[:, shared])


def _spreads(grid: np.ndarray) -> np.ndarray:
    if grid.shape[1] == 0:
        return np.array([])
    spread = spreads(grid)
    return spread[np.isfinite(spread)]


def outliers(means: np.ndarray) -> list[int]:
    """Ranks whose mean is far from the others': robust z over OUTLIER_Z and at least
    OUTLIER_MIN_DEVIATION off the median (so that tiny, tidy differences are not flagged)."""
    valid = np.isfinite(means)
    if valid.sum() < 3:
        return []
    median = float(np.median(means[valid]))
    deviation = np.abs(means - median)
    mad = float(np.median(deviation[valid]))
    found = []
    for i, dev in enumerate(deviation):
        if not valid[i] or dev <= OUTLIER_MIN_DEVIATION * abs(median):
            continue
        if mad == 0 or 0.6745 * dev / mad > OUTLIER_Z:
            found.append(i)
    return found


def _finite(value: object) -> object:
    """JSON has no NaN: non-finite numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value

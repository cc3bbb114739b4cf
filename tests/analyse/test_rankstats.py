"""Statistics across ranks (`wbmerge.analyse.rankstats`) against an obviously correct reference.

The reference works on one (step, key) at a time with Python's `sorted`, `min`, `max`,
`statistics.median` and `math.fsum`, written from the rules in the module's docstring: NaN
above every number, ties to the lowest rank, a repeated entry counting once (the later).
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wbmerge.analyse import STATS, PerRank, across_ranks, bound_notice, stat_key
from wbmerge.analyse.rankstats import METRIC_BOUND, one_step
from wbmerge.errors import WbmergeError

NAN, INF = math.nan, math.inf


def _order(item: tuple[int, float]) -> tuple:
    rank, value = item
    return (math.isnan(value), 0.0 if math.isnan(value) else value, rank)


def same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def halfway(low: float, high: float) -> float:
    """The mean of two numbers, also of two whose sum passes 1.8e308 (Python's own
    `statistics.median([1e308, 1e308])` is inf)."""
    if math.isfinite(low) and math.isfinite(high) and math.isinf(low + high):
        return low / 2 + high / 2
    return (low + high) / 2


def reference_one(by_rank: dict[int, float]) -> dict:
    ranked = sorted(by_rank.items(), key=_order)
    values = [v for _, v in ranked]
    count = len(values)
    low_rank, low = ranked[0]
    high = ranked[-1][1]
    high_rank = min(rank for rank, value in ranked if same_value(value, high))
    middle = values[(count - 1) // 2], values[count // 2]
    median = middle[0] if count % 2 else halfway(*middle)
    if any(math.isnan(v) for v in values):
        mean = NAN
    elif all(math.isfinite(v) for v in values):
        mean = float(sum(map(Fraction, values)) / count)  # exact, even past 1.8e308
    else:  # the mean of numbers with an infinity is that infinity; with both, NaN
        mean = NAN if INF in values and -INF in values else (INF if INF in values else -INF)
    return dict(
        count=count,
        min=low,
        median=median,
        max=high,
        mean=mean,
        min_rank=low_rank,
        max_rank=high_rank,
    )


def reference(entries: list[tuple[int, int, int, float]]) -> dict[tuple[int, int], dict]:
    last: dict[tuple[int, int, int], float] = {}
    for step, key, rank, value in entries:
        last[step, key, rank] = value
    groups: dict[tuple[int, int], dict[int, float]] = {}
    for (step, key, rank), value in last.items():
        groups.setdefault((step, key), {})[rank] = value
    return {group: reference_one(by_rank) for group, by_rank in sorted(groups.items())}


def computed(entries: list[tuple[int, int, int, float]]) -> dict[tuple[int, int], dict]:
    columns = list(zip(*entries, strict=True)) if entries else [[], [], [], []]
    stats = across_ranks(*(np.array(c) for c in columns))
    found = {}
    for i in range(len(stats)):
        row = {"count": int(stats.count[i])}
        row.update({stat: stats.column(stat)[i].item() for stat in STATS})
        found[int(stats.step[i]), int(stats.key[i])] = row
    return found


def assert_matches(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the same (step, key) groups, in step then key order
    for group, expected in want.items():
        row = got[group]
        for exact in ("count", "min_rank", "max_rank"):
            assert row[exact] == expected[exact], (group, exact)
        for stat in ("min", "max", "median"):
            assert same_value(row[stat], expected[stat]), (group, stat, row[stat], expected[stat])
        if math.isnan(expected["mean"]) or math.isinf(expected["mean"]):
            assert same_value(row["mean"], expected["mean"]), (group, row["mean"])
        else:
            scale = max(abs(v) for v in (row["min"], row["max"]) if not math.isnan(v))
            assert row["mean"] == pytest.approx(expected["mean"], rel=1e-12, abs=1e-12 * scale)


# -- tables --------------------------------------------------------------------------------

ONE_STEP = [
    # (values by rank, expected statistics)
    (
        {0: 3.0, 1: 1.0, 2: 2.0},
        dict(min=1.0, median=2.0, max=3.0, mean=2.0, min_rank=1, max_rank=0),
    ),
    (
        {0: 4.0, 1: 1.0, 2: 2.0, 3: 3.0},  # an even count: the mean of the two middle values
        dict(min=1.0, median=2.5, max=4.0, mean=2.5, min_rank=1, max_rank=0),
    ),
    (
        {5: 1.0, 2: 1.0, 9: 7.0, 4: 7.0},  # ties: the lowest rank
        dict(min=1.0, median=4.0, max=7.0, mean=4.0, min_rank=2, max_rank=4),
    ),
    (
        {0: 1.0, 1: NAN, 2: 2.0},  # NaN above every number: max, its rank, the mean
        dict(min=1.0, median=2.0, max=NAN, mean=NAN, min_rank=0, max_rank=1),
    ),
    ({0: NAN, 1: NAN}, dict(min=NAN, median=NAN, max=NAN, mean=NAN, min_rank=0, max_rank=0)),
    (
        {0: INF, 1: 1.0, 2: -INF},
        dict(min=-INF, median=1.0, max=INF, mean=NAN, min_rank=2, max_rank=0),
    ),
    ({3: INF, 1: NAN}, dict(min=INF, median=NAN, max=NAN, mean=NAN, min_rank=3, max_rank=1)),
    ({7: 0.5}, dict(min=0.5, median=0.5, max=0.5, mean=0.5, min_rank=7, max_rank=7)),
    (
        {0: INF, 1: -1e308, 2: -1e308},  # summed from the least: -inf, then inf - inf
        dict(min=-1e308, median=-1e308, max=INF, mean=INF, min_rank=1, max_rank=0),
    ),
    (
        {0: 1e308, 1: 1e308},  # a sum past 1.8e308
        dict(min=1e308, median=1e308, max=1e308, mean=1e308, min_rank=0, max_rank=0),
    ),
    # summed in pairs: -inf in one half, inf in the other, NaN together (found by Hypothesis)
    (
        {0: -1e308, 1: -1e308, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0, 6: 1e308, 7: 1e308},
        dict(min=-1e308, median=0.0, max=1e308, mean=0.0, min_rank=0, max_rank=6),
    ),
]


@pytest.mark.parametrize(("values", "expected"), ONE_STEP)
def test_one_step_table(values, expected):
    got = one_step(values)
    assert got["count"] == len(values)
    for stat, want in expected.items():
        assert same_value(got[stat], want), (stat, got[stat], want)


def test_no_values_no_statistics():
    assert one_step({}) is None
    assert len(across_ranks([], [], [], [])) == 0


def test_ranks_missing_at_a_step_count_only_those_that_logged():
    # rank 1 logs key 0 at step 0 only; rank 2 logs key 1 only: each group its own ranks
    entries = [(0, 0, 0, 1.0), (0, 0, 1, 5.0), (1, 0, 0, 2.0), (0, 1, 2, 9.0), (1, 1, 2, 8.0)]
    got = computed(entries)
    assert got[0, 0]["count"] == 2 and got[0, 0]["max_rank"] == 1
    assert got[1, 0] == dict(
        count=1, min=2.0, median=2.0, max=2.0, mean=2.0, min_rank=0, max_rank=0
    )
    assert got[1, 1]["min_rank"] == 2 and got[1, 1]["min"] == 8.0


def test_a_repeated_entry_counts_once_with_its_later_value():
    entries = [(3, 0, 1, 100.0), (3, 0, 0, 1.0), (3, 0, 1, 2.0)]
    assert computed(entries)[3, 0] == dict(
        count=2, min=1.0, median=1.5, max=2.0, mean=1.5, min_rank=0, max_rank=1
    )


def test_sparse_and_full_batches_agree_with_the_reference():
    """A full grid (every rank, every key, every step) and a sparse one (each key logged by
    one of 16 ranks), which take the two ways of computing."""
    rng = np.random.default_rng(7)
    full = [
        (s, k, r, float(rng.integers(0, 5))) for s in range(6) for k in range(3) for r in range(4)
    ]
    sparse = [(s, r, r, float(rng.normal())) for s in range(0, 600, 7) for r in range(16)]
    for entries in (full, sparse, full + sparse):
        assert_matches(computed(entries), reference(entries))


def test_numbers_whose_sum_overflows_warn_nothing():
    """Two ranks logging 1e308 overflow the sum behind the mean: numpy's RuntimeWarning
    would print two stray lines on the user's stderr (with --skew-metrics too, whose spread
    comes from these statistics). In a full grid and in a sparse batch (the sorted way)."""
    full = [(0, 0, rank, 1e308) for rank in range(2)]
    sparse = full + [(step, 0, step, 1.0) for step in range(2, 12)]  # a grid mostly empty
    for entries in (full, sparse):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stats = across_ranks(*(np.array(column) for column in zip(*entries, strict=True)))
        assert (stats.count[0], stats.min[0], stats.max[0]) == (2, 1e308, 1e308)
        assert (stats.median[0], stats.mean[0]) == (1e308, 1e308)  # not inf


# -- properties ----------------------------------------------------------------------------

values = st.one_of(
    st.floats(min_value=-1e100, max_value=1e100),
    st.sampled_from([NAN, INF, -INF, 0.0, -0.0, 1.0, 1e308, -1e308, 1.7e308]),
)
entry = st.tuples(
    st.integers(0, 6), st.integers(0, 3), st.integers(0, 12), values
)  # (step, key, rank, value)


@given(st.lists(entry, max_size=120))
def test_statistics_equal_the_reference(entries):
    assert_matches(computed(entries), reference(entries))


@given(
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(1, 9),
    st.data(),
)
def test_full_grids_equal_the_reference(steps, keys, ranks, data):
    """Every rank logs every key at every step, in any order, with far-apart step numbers
    and rank ids (the usual shape of a batch of a training job)."""
    step_ids = data.draw(
        st.lists(st.integers(0, 2**40), min_size=steps, max_size=steps, unique=True)
    )
    rank_ids = data.draw(
        st.lists(st.integers(0, 4096), min_size=ranks, max_size=ranks, unique=True)
    )
    cells = [(s, k, r) for s in step_ids for k in range(keys) for r in rank_ids]
    order = data.draw(st.permutations(range(len(cells))))
    entries = [(*cells[i], data.draw(values)) for i in order]
    assert_matches(computed(entries), reference(entries))


# -- keys per rank, key names, the bound ---------------------------------------------------


@pytest.mark.parametrize(
    ("given", "kept", "dropped"),
    [
        ((), ["train/loss", "x"], []),
        (("all",), ["train/loss", "x"], []),
        (("none",), [], ["train/loss", "x"]),
        (("train/loss",), ["train/loss"], ["train/loss2", "eval/loss", "train"]),
        (("train/*",), ["train/loss", "train/a/b"], ["eval/loss", "train"]),
        (("*loss", "lr"), ["train/loss", "eval/loss", "lr"], ["lr2", "Loss", "train/loss/x"]),
        (("step_[0-9]",), ["step_3"], ["step_10", "step_a"]),
    ],
)
def test_which_keys_keep_a_series_per_rank(given, kept, dropped):
    per_rank = PerRank.parse(given)
    assert [k for k in kept if per_rank.keeps(k)] == kept
    assert [k for k in dropped if per_rank.keeps(k)] == []


@pytest.mark.parametrize("given", [("all", "x"), ("none", "all"), ("",)])
def test_per_rank_words_stand_alone(given):
    with pytest.raises(WbmergeError, match="--per-rank"):
        PerRank.parse(given)


def test_patterns_that_match_no_key_are_named():
    per_rank = PerRank.parse(["train/*", "val/los"])
    assert per_rank.unmatched(["train/loss", "val/loss"]) == ["val/los"]
    assert PerRank.parse(["all"]).unmatched([]) == []


def test_statistic_keys_put_the_statistic_where_the_label_goes():
    assert stat_key("{key}/{label}", "train/loss", "max") == "train/loss/ranks/max"
    assert stat_key("{label}/{key}", "loss", "min_rank") == "ranks/min_rank/loss"


def test_the_bound_warning_is_one_line_naming_the_options():
    assert bound_notice("r", METRIC_BOUND, 512, PerRank()) is None
    line = bound_notice("job-1", 20_480, 1024, PerRank())
    assert "\n" not in line
    assert "20,480" in line and "10,000" in line and "job-1" in line
    for option in ("--rank-stats", "--per-rank none", "--per-rank KEY", "--per-rank all"):
        assert option in line
    assert bound_notice("r", 20_480, 1024, PerRank.parse(["train/*"])) is not None
    assert bound_notice("r", 20_480, 1024, PerRank.parse(["all"])) is None  # chosen

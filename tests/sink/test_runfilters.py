"""The run filters the sink answers (`runfilters`), on runs as `Store.runs` gives them."""

from __future__ import annotations

import pytest

from wbmerge.sink import FilterError, matcher

RUNS = [
    {
        "id": "a",
        "group": "g1",
        "job_type": "train",
        "tags": ["x", "y"],
        "state": "finished",
        "display_name": "A",
    },
    {
        "id": "b",
        "group": "g1",
        "job_type": "eval",
        "tags": [],
        "state": "failed",
        "display_name": "B",
    },
    {
        "id": "c",
        "group": None,
        "job_type": None,
        "tags": ["y"],
        "state": "running",
        "display_name": "C",
    },
]


def ids(filters):
    passes = matcher(filters)
    return [run["id"] for run in RUNS if passes(run)]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (None, ["a", "b", "c"]),
        ({}, ["a", "b", "c"]),
        ({"group": "g1"}, ["a", "b"]),
        ({"group": None}, ["c"]),
        ({"jobType": "eval"}, ["b"]),
        ({"job_type": {"$eq": "train"}}, ["a"]),
        ({"tags": "y"}, ["a", "c"]),
        ({"tags": {"$in": ["x", "z"]}}, ["a"]),
        ({"tags": {"$nin": ["y"]}}, ["b"]),
        ({"state": {"$ne": "finished"}}, ["b", "c"]),
        ({"name": {"$in": ["a", "c"]}}, ["a", "c"]),
        ({"displayName": "B"}, ["b"]),
        ({"$and": [{"group": "g1"}, {"tags": "x"}]}, ["a"]),
        ({"$or": [{"state": "failed"}, {"tags": "y"}]}, ["a", "b", "c"]),
        (
            {"$or": [{"$and": [{"group": "g1"}, {"state": "failed"}]}, {"displayName": "C"}]},
            ["b", "c"],
        ),
        ({"group": "g1", "state": "finished"}, ["a"]),
    ],
)
def test_a_filter_passes_exactly_the_runs_it_names(filters, expected):
    assert ids(filters) == expected


@pytest.mark.parametrize(
    ("filters", "named"),
    [
        ({"config.lr": 0.1}, "'config.lr'"),
        ({"summary_metrics.loss": {"$lt": 1}}, "'summary_metrics.loss'"),
        ({"tags": {"$all": ["x"]}}, "$all"),
        ({"state": {"$regex": "fin"}}, "$regex"),
        ({"$nor": [{"group": "g1"}]}, "$nor"),
        ({"$not": {"group": "g1"}}, "$not"),
        ({"group": {"$in": "g1"}}, "$in"),
        ({"$and": []}, "$and"),
        ({"group": {"nested": 1}}, "'group'"),
        ([{"group": "g1"}], "JSON object"),
    ],
)
def test_what_it_does_not_support_is_refused_by_name(filters, named):
    with pytest.raises(FilterError) as refused:
        matcher(filters)
    assert named in str(refused.value)


def test_a_filter_nested_past_the_limit_is_refused_not_recursed():
    deep: dict = {"group": "g1"}
    for _ in range(5000):
        deep = {"$and": [deep]}
    with pytest.raises(FilterError, match="nested deeper"):
        matcher(deep)

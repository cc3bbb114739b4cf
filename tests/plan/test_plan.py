"""The plan against the online Flyte plugin's run-mode table (README), written out by hand."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from wbmerge.errors import WbmergeError
from wbmerge.identify import MergedBy, merged_by
from wbmerge.plan import (
    PROJECT_RESERVED,
    RUN_ID_RESERVED,
    Source,
    app_url,
    as_logged,
    check_destination,
    check_run_id,
    group_url,
    links,
    plan,
    run_url,
)
from wbmerge.sink import names as sink_names
from wbmerge.training import RankInfo

from ..conftest import ROOT


def job(nodes, nproc, restarts=1):
    world = nodes * nproc
    return [
        Source(
            Path(f"/runs/r{rank}-{restart}/run-x.wandb"),
            info := RankInfo(rank, rank % nproc, world, nproc, rank // nproc, restart, "B"),
            info.label,
        )
        for rank in range(world)
        for restart in range(restarts)
    ]


def summary(targets):
    return [
        (t.id, t.group, t.primary_rank, sorted({s.rank.rank for s in t.sources})) for t in targets
    ]


# (nodes, nproc, run_mode, rank_scope) -> [(id, group, primary, source ranks)]
TABLE = {
    (1, 4, "auto", "global"): [("B", None, 0, [0])],
    (1, 4, "auto", "worker"): [("B", None, 0, [0])],
    (1, 4, "shared", "global"): [("B", None, 0, [0, 1, 2, 3])],
    (1, 4, "shared", "worker"): [("B", None, 0, [0, 1, 2, 3])],
    (1, 4, "new", "global"): [(f"B-rank-{r}", "B", r, [r]) for r in range(4)],
    (1, 4, "new", "worker"): [(f"B-rank-{r}", "B", r, [r]) for r in range(4)],
    (2, 2, "auto", "global"): [("B", None, 0, [0])],
    (2, 2, "auto", "worker"): [("B-worker-0", None, 0, [0]), ("B-worker-1", None, 2, [2])],
    (2, 2, "shared", "global"): [("B", None, 0, [0, 1, 2, 3])],
    (2, 2, "shared", "worker"): [
        ("B-worker-0", None, 0, [0, 1]),
        ("B-worker-1", None, 2, [2, 3]),
    ],
    (2, 2, "new", "global"): [(f"B-rank-{r}", "B", r, [r]) for r in range(4)],
    (2, 2, "new", "worker"): [
        ("B-worker-0-rank-0", "B-worker-0", 0, [0]),
        ("B-worker-0-rank-1", "B-worker-0", 1, [1]),
        ("B-worker-1-rank-0", "B-worker-1", 2, [2]),
        ("B-worker-1-rank-1", "B-worker-1", 3, [3]),
    ],
    (3, 2, "new", "worker"): [
        (f"B-worker-{w}-rank-{lr}", f"B-worker-{w}", 2 * w + lr, [2 * w + lr])
        for w in range(3)
        for lr in range(2)
    ],
}


@pytest.mark.parametrize("case", sorted(TABLE), ids=lambda c: "-".join(map(str, c)))
def test_run_mode_table(case):
    nodes, nproc, mode, scope = case
    assert summary(plan(job(nodes, nproc), mode, scope)) == TABLE[case]


@pytest.mark.parametrize(
    "nodes, nproc, mode, scope, count",
    [
        (2, 4, "auto", "global", 1),
        (2, 4, "auto", "worker", 2),
        (2, 4, "shared", "global", 1),
        (2, 4, "shared", "worker", 2),
        (2, 4, "new", "global", 8),
        (2, 4, "new", "worker", 8),
    ],
)
def test_run_counts(nodes, nproc, mode, scope, count):
    targets = plan(job(nodes, nproc), mode, scope)
    assert len(targets) == count
    if mode == "new":
        assert len({t.group for t in targets}) == (nodes if scope == "worker" else 1)


def test_base_id_and_restarts_in_order():
    targets = plan(job(1, 2, restarts=2), "shared", "global", base_id="exp-7")
    assert targets[0].id == "exp-7"
    assert [(s.rank.rank, s.restart) for s in targets[0].sources] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_auto_with_all_system_metrics():
    [target] = plan(job(2, 2), "auto", "global", system_metrics="all")
    assert [s.rank.rank for s in target.sources] == [0]
    assert [s.rank.rank for s in target.extra_system_sources] == [1, 2, 3]


@pytest.mark.parametrize(
    "names, expected",
    [
        # plain `wandb sync` keeps a run's own id and names; one left empty stays empty
        (("abc123", "exp", "rank-1", "train"), ("abc123", "exp", "rank-1", "train")),
        (("abc123", "", "", ""), ("abc123", None, "", None)),
    ],
)
def test_a_run_as_logged_keeps_its_own_names(names, expected):
    source = job(1, 2)[1]
    target = as_logged(source, *names)
    assert (target.id, target.group, target.display_name, target.job_type) == expected
    assert (target.kind, target.sources, target.primary_rank) == ("as-logged", (source,), 1)


def test_a_run_as_logged_needs_an_id_w_and_b_takes():
    with pytest.raises(WbmergeError, match="invalid run id"):
        as_logged(job(1, 1)[0], "a/b", "", "", "")


@pytest.mark.parametrize("bad", ["a/b", "x:y", "q?", "h#", "", " pad", "semi;", "it's", "exp%1"])
def test_run_id_rules(bad):
    with pytest.raises(WbmergeError, match="invalid run id"):
        check_run_id(bad)


def test_bad_base_id_is_refused_by_plan():
    with pytest.raises(WbmergeError, match="cannot contain"):
        plan(job(1, 2), "new", base_id="team/exp")


def test_links_like_the_plugin():
    targets = plan(job(2, 2), "new", "worker")
    assert links(targets, "https://wandb.ai", "me", "p", "new") == [
        {"kind": "group", "name": "B-worker-0", "url": "https://wandb.ai/me/p/groups/B-worker-0"},
        {"kind": "group", "name": "B-worker-1", "url": "https://wandb.ai/me/p/groups/B-worker-1"},
    ]
    targets = plan(job(2, 2), "auto", "worker")
    assert [link["url"] for link in links(targets, "http://h:1", "e", "p", "auto")] == [
        "http://h:1/e/p/runs/B-worker-0",
        "http://h:1/e/p/runs/B-worker-1",
    ]
    assert app_url("https://api.wandb.ai") == "https://wandb.ai"


@pytest.mark.parametrize("mode", ["auto", "shared"])
@pytest.mark.parametrize("scope", ["global", "worker"])
def test_a_missing_primary_is_named_in_shared_and_auto(mode, scope):
    # ranks 1-3 of a one-node job of 4: nobody holds the primary's config and exit code
    sources = [s for s in job(1, 4) if s.rank.rank != 0]
    with pytest.raises(WbmergeError, match="primary rank 0 has no offline run"):
        plan(sources, mode, scope)
    assert len(plan(sources, "new", scope)) == 3


@pytest.mark.parametrize(
    "asked, run_modes, said",
    [
        ({}, {"new"}, []),
        ({"rank_stats": True}, {"shared"}, []),
        ({"rank_stats": True}, {"auto", "shared"}, []),  # (used by one of the jobs)
        (
            {"rank_stats": True},
            {"new"},
            ["--rank-stats applies to shared runs only; ignored for --run-mode new"],
        ),
        (
            {"skew_metrics": True, "per_rank": ["train/*"], "key_format": "{label}/{key}"},
            {"auto", "new"},
            [
                "--skew-metrics, --per-rank, --key-format apply to shared runs only; ignored for "
                "--run-mode auto/new"
            ],
        ),
        ({"per_rank": ()}, {"new"}, []),  # (what the CLI passes when --per-rank is not given)
        ({"system_metrics": "all"}, {"auto"}, []),
        ({"system_metrics": "all"}, {"shared"}, []),
        (
            {"system_metrics": "all"},
            {"new"},
            [
                "--system-metrics all applies to auto and shared runs (a run of its own keeps "
                "each rank's); ignored for --run-mode new"
            ],
        ),
        ({"rank_stats": True}, set(), []),  # no job: nothing to say
    ],
)
def test_options_no_planned_run_mode_uses_are_said(asked, run_modes, said):
    from wbmerge.sync import MergeRequest, ignored_options

    assert ignored_options(MergeRequest(["."], **asked), run_modes) == said


MERGED_BLOCK = {
    "job_id": "J",
    "run_mode": "shared",
    "rank_scope": "worker",
    "world_size": 4,
    "local_world_size": 2,
    "primary_rank": 2,
    "sources": [{"rank": 2, "label": "worker-1-rank-0", "restart": 0, "run_id": "abc"}],
}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, MergedBy("J", "shared", "worker", 2, 4, 2)),
        ({"sources": None}, None),  # a rank's own block: no sources
        ({"primary_rank": 4}, None),  # no rank 4 in a world of 4
        ({"primary_rank": True}, None),
        ({"world_size": -1}, None),
        ({"local_world_size": 0}, None),
        ({"run_mode": "mixed"}, None),
        ({"rank_scope": "node"}, None),
        ({"job_id": "a/b"}, None),  # no run id: a merge never writes one
        ({"job_id": None}, None),
    ],
)
def test_a_merged_runs_block_is_read_or_refused_whole(change, expected):
    block = {k: v for k, v in {**MERGED_BLOCK, **change}.items() if v is not None}
    assert merged_by(block) == expected
    assert merged_by([block]) is None and merged_by("J") is None


@pytest.mark.parametrize(
    "make, name, url",
    [
        (run_url, "fx-1", "https://wandb.ai/me/proj/runs/fx-1"),
        (run_url, "a b", "https://wandb.ai/me/proj/runs/a%20b"),
        (group_url, "exp 1/b", "https://wandb.ai/me/proj/groups/exp%201%2Fb"),
    ],
)
def test_a_link_quotes_each_name_in_it(make, name, url):
    """A group (any text) or a name with a space stays one part of the link."""
    assert make("https://wandb.ai/", "me", "proj", name) == url


@pytest.mark.parametrize("char", sorted(set(string.printable) | {"é", "\x7f"}))
def test_the_planner_and_the_sink_accept_the_same_run_ids(char):
    # One rule for both: a run id `sync` plans is one the sink files, and the other way.
    run_id = f"exp{char}1"
    try:
        check_run_id(run_id)
        planned = True
    except WbmergeError:
        planned = False
    try:
        sink_names.check_run_id(run_id)
        filed = True
    except sink_names.BadName:
        filed = False
    assert planned == filed, run_id


@pytest.mark.parametrize("length", [127, 128, 129, 255, 256])
@pytest.mark.parametrize("char", ["x", "é", "€"])
def test_the_planner_and_the_sink_agree_on_long_names(length, char):
    name = char * length
    try:
        check_run_id(name)
        planned_id = True
    except WbmergeError:
        planned_id = False
    try:
        sink_names.check_run_id(name)
        filed_id = True
    except sink_names.BadName:
        filed_id = False
    assert planned_id == filed_id == (len(name.encode()) <= 255)
    try:
        check_destination(name, None)
        planned_project = True
    except WbmergeError:
        planned_project = False
    try:
        sink_names.check_project(name)
        filed_project = True
    except sink_names.BadName:
        filed_project = False
    assert planned_project == filed_project == (length <= 128 and len(name.encode()) <= 255)


def test_the_docs_list_the_reserved_characters_of_the_rules():
    readme = (ROOT / "docs" / "sink.md").read_text()
    assert f"run ids without any of `{RUN_ID_RESERVED}`" in readme
    assert f"project names without `{PROJECT_RESERVED}`" in readme

"""Table tests of how runs written without wbmerge get their ranks and jobs (pure rules)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.errors import WbmergeError
from wbmerge.identify import Hints, identify, make_hints
from wbmerge.identify.jobs import GivenRank, RunFacts
from wbmerge.identify.rankclaims import (
    compile_pattern,
    config_claim,
    parse_spelling,
    parse_with_pattern,
)
from wbmerge.training import RankInfo

from ..conftest import job_dir

# text -> (node, number, form); None: the text spells no rank
SPELLINGS = [
    ("rank-3", None, 3, "rank-{}"),
    ("rank_3", None, 3, "rank_{}"),
    ("rank3", None, 3, "rank{}"),
    ("Rank 3", None, 3, "rank {}"),
    ("RANK_12", None, 12, "rank_{}"),
    ("gpu3", None, 3, "gpu{}"),
    ("gpu-0", None, 0, "gpu-{}"),
    ("worker-1-rank-0", 1, 0, "worker-{}-rank-{}"),
    ("node1_rank0", 1, 0, "node{}_rank{}"),
    ("node1-gpu0", 1, 0, "node{}-gpu{}"),
    ("Node 2 Rank 5", 2, 5, "node {} rank {}"),
    ("host-a-rank-3", "host-a", 3, "{}-rank-{}"),
    ("dgx-a100-07_rank1", "dgx-a100-07", 1, "{}_rank{}"),
    ("trainer-rank-2", "trainer", 2, "{}-rank-{}"),
]
NOT_A_RANK = [
    "worker-a",
    "worker-3",  # a worker alone is not a rank
    "rank",
    "rank-",
    "3",
    "rank-3-4",  # two unrelated numbers
    "seed42_rank0",  # a number glued to a word, then a rank: two unrelated numbers
    "exp2-rank3",
    "gpu0-rank3",
    "lr0.1_bs32",
    "rank--3",
    "rank 3 of 8",
    "vivid-sun-12",
    "",
]


@pytest.mark.parametrize("text, node, number, form", SPELLINGS)
def test_label_spellings(text, node, number, form):
    claim = parse_spelling(text)
    assert claim is not None
    assert (claim.node, claim.number, claim.form) == (node, number, form)
    assert claim.rank is None and claim.local_rank is None  # global or local: the job decides


@pytest.mark.parametrize("text", NOT_A_RANK)
def test_texts_that_spell_no_rank(text):
    assert parse_spelling(text) is None


@pytest.mark.parametrize(
    "pattern, text, expected",
    [
        ("rank_{rank}", "rank_7", (7, None, None)),
        ("trainer.{rank}", "trainer.7", (7, None, None)),
        ("trainer.{rank}", "trainerX7", None),  # the dot is literal
        ("n{worker}g{local_rank}", "n3g1", (None, 1, 3)),
        ("{local_rank}@{worker}", "0@2", (None, 0, 2)),
        ("rank_{rank}", "rank_7b", None),
    ],
)
def test_label_patterns(pattern, text, expected):
    claim = parse_with_pattern(text, compile_pattern(pattern), "label")
    if expected is None:
        assert claim is None
    else:
        assert (claim.rank, claim.local_rank, claim.node) == expected


@pytest.mark.parametrize(
    "pattern", ["rank_{rnak}", "{worker}", "{rank}-{rank}", "plain text", "rank_{}"]
)
def test_bad_label_patterns_are_one_line_errors(pattern):
    result = CliRunner().invoke(
        main, ["inspect", str(job_dir("plain_labels")), "--label-pattern", pattern]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("wbmerge: error: bad --label-pattern")
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"rank": 3, "world_size": 8}, (3, None, 8, None, None)),
        ({"RANK": "3", "World_Size": 8}, (3, None, 8, None, None)),
        ({"global_rank": 5, "local_rank": 1, "local_world_size": 4}, (5, 1, None, 4, None)),
        ({"rank": 5, "node_rank": 1}, (5, None, None, None, 1)),
        ({"rank": 5, "group_rank": 1}, (5, None, None, None, 1)),
        ({"rank": 2.0}, (2, None, None, None, None)),
        ({"rank": True}, None),
        ({"rank": -1}, None),
        ({"rank": "three"}, None),
        ({"world_size": 4}, None),
        ({"lr": 0.1}, None),
    ],
)
def test_config_claims(config, expected):
    claim = config_claim(config)
    if expected is None:
        assert claim is None
    else:
        got = (claim.rank, claim.local_rank, claim.world_size, claim.local_world_size, claim.node)
        assert got == expected


def facts(run_id, start=0.0, end=100.0, **kw):
    return RunFacts(run_id=run_id, project="p", start=start, end=end, **kw)


def places(runs, hints=None):
    """run id -> (rank, local rank, worker, world, local world, source, label, job id)."""
    found = identify(runs, hints)
    assert not found.problems, found.problems
    return {
        runs[i].run_id: (
            ident.rank.rank,
            ident.rank.local_rank,
            ident.rank.worker,
            ident.rank.world_size,
            ident.rank.local_world_size,
            ident.source,
            ident.label,
            ident.rank.job_id,
        )
        for i, ident in found.identities.items()
    }


def test_single_node_labels_keep_their_spelling():
    runs = [facts(f"r{i}", start=i, label=f"rank_{i}") for i in (2, 0, 1)]
    assert places(runs) == {
        "r0": (0, 0, 0, 3, 3, "label", "rank_0", "r0"),
        "r1": (1, 1, 0, 3, 3, "label", "rank_1", "r0"),
        "r2": (2, 2, 0, 3, 3, "label", "rank_2", "r0"),
    }


def test_node_labels_that_count_from_zero_per_node_are_local_ranks():
    runs = [facts(f"r{w}{lr}", label=f"node{w}_rank{lr}") for w in (0, 1) for lr in (0, 1)]
    got = places(runs)
    assert {k: v[:5] for k, v in got.items()} == {
        "r00": (0, 0, 0, 4, 2),
        "r01": (1, 1, 0, 4, 2),
        "r10": (2, 0, 1, 4, 2),
        "r11": (3, 1, 1, 4, 2),
    }
    assert got["r10"][6] == "node1_rank0"


def test_node_labels_with_distinct_numbers_are_global_ranks():
    labels = ["node0_rank0", "node0_rank1", "node1_rank2", "node1_rank3"]
    runs = [facts(f"r{i}", label=label) for i, label in enumerate(labels)]
    got = places(runs)
    assert [got[f"r{i}"][:5] for i in range(4)] == [
        (0, 0, 0, 4, 2),
        (1, 1, 0, 4, 2),
        (2, 0, 1, 4, 2),
        (3, 1, 1, 4, 2),
    ]


def test_named_hosts_in_labels_are_workers_in_name_order():
    runs = [facts(f"{h}{r}", label=f"host-{h}-rank-{r}") for h in "ba" for r in (0, 1)]
    got = places(runs)
    assert got["a1"][:5] == (1, 1, 0, 4, 2)
    assert got["b0"][:5] == (2, 0, 1, 4, 2)


def test_the_recorded_host_tells_nodes_apart_when_nothing_else_does():
    # global ranks from the config, two hosts: the ranks of a host are one worker
    runs = [
        facts(f"r{rank}", host="node-b" if rank >= 2 else "node-a", config={"rank": rank})
        for rank in (3, 0, 2, 1)
    ]
    got = places(runs)
    assert [got[f"r{r}"][:5] for r in range(4)] == [
        (0, 0, 0, 4, 2),
        (1, 1, 0, 4, 2),
        (2, 0, 1, 4, 2),
        (3, 1, 1, 4, 2),
    ]
    assert got["r2"][5:7] == ("config", "worker-1-rank-0")  # no label: the plugin's


def test_gpu_numbers_that_repeat_across_hosts_are_local_ranks():
    runs = [facts(f"{h}{g}", host=h, label=f"gpu{g}") for h in ("x", "y") for g in (0, 1)]
    got = places(runs)
    assert got["y1"][:5] == (3, 1, 1, 4, 2)
    # `gpu1` names a rank on each host: one label for two ranks would mix their keys in a
    # shared run, so the job is labelled the plugin's way, with a warning.
    assert got["y1"][6] == "worker-1-rank-1"
    labels, hosts = identify(runs).warnings
    assert "share a label" in labels.message
    # and local ranks on two hosts leave which host is worker 0 to the names: a guess
    assert "which host is worker 0" in hosts.message


def test_the_name_says_the_rank_when_the_label_does_not():
    runs = [facts(f"r{i}", name=f"rank-{i}", label=None) for i in (0, 1)]
    got = places(runs)
    assert got["r1"] == (1, 1, 0, 2, 2, "name", "rank-1", "r0")


def test_sources_most_explicit_first():
    info = RankInfo(1, 1, 2, 2, 0, job_id="job-a")
    runs = [
        facts("meta", metadata=info, metadata_label="rank-1", config={"rank": 0}),
        facts("conf", config={"rank": 1}, label="rank_0", name="rank-0"),
        facts("conf0", config={"rank": 0}, label="rank_9"),
    ]
    got = places(runs)
    assert got["meta"][5:] == ("wbmerge", "rank-1", "job-a")
    assert got["conf"][:1] + got["conf"][5:6] == (1, "config")
    assert got["conf0"][:1] == (0,)


def test_given_ranks_win_over_everything():
    runs = [facts("a", label="rank_0"), facts("b", label="rank_1")]
    hints = Hints(given={"a": GivenRank(1), "b": GivenRank(0)})
    got = places(runs, hints)
    assert got["a"][0] == 1 and got["a"][5] == "given" and got["a"][7] == "b"
    hints = Hints(given={"a": GivenRank(1, job="my-job"), "b": GivenRank(0, job="my-job")})
    assert {v[7] for v in places(runs, hints).values()} == {"my-job"}


def test_a_label_pattern_comes_before_the_built_in_spellings():
    runs = [facts("a", label="rank3-of-4"), facts("b", label="rank1-of-4")]
    hints = Hints(label_pattern=compile_pattern("rank{rank}-of-4"))
    got = places(runs, hints)
    assert (got["a"][0], got["b"][0]) == (3, 1)


def test_nothing_said_numbers_by_start_order_with_main_first_and_warns_once():
    runs = [
        facts("late", start=5.0, name="calm-sea-3"),
        facts("early", start=1.0),
        facts("boss", start=9.0, job_type="main", label="leader"),
    ]
    found = identify(runs)
    ranks = {runs[i].run_id: (x.rank.rank, x.source, x.label) for i, x in found.identities.items()}
    assert ranks == {
        "boss": (0, "order", "leader"),
        "early": (1, "order", "early"),
        "late": (2, "order", "calm-sea-3"),
    }
    assert len(found.warnings) == 1 and "start order" in found.warnings[0].message


def test_a_single_run_that_says_nothing_is_a_job_of_one_rank_without_warning():
    found = identify([facts("solo")])
    [ident] = found.identities.values()
    assert (ident.rank.rank, ident.rank.world_size, ident.rank.job_id) == (0, 1, "solo")
    assert not found.warnings and not found.problems


# Job grouping: run id -> (group, project, start, end, label); expected jobs as sets of ids.
GROUPING = [
    (
        "the same group is one job, whatever the labels",
        [("a", "g", "p", 0, 10, "rank_0"), ("b", "g", "p", 1, 10, "gpu1")],
        [{"a", "b"}],
    ),
    (
        "two groups are two jobs, even overlapping in time",
        [("a", "g1", "p", 0, 10, "rank_0"), ("b", "g2", "p", 0, 10, "rank_0")],
        [{"a"}, {"b"}],
    ),
    (
        "one group used twice, one run after the other, is two jobs",
        [
            ("a0", "DDP", "p", 0, 10, None),
            ("a1", "DDP", "p", 1, 10, None),
            ("b0", "DDP", "p", 20, 30, None),
            ("b1", "DDP", "p", 21, 29, None),
        ],
        [{"a0", "a1"}, {"b0", "b1"}],
    ),
    (
        "the same group in two projects is two jobs",
        [("a", "g", "p", 0, 10, None), ("b", "g", "q", 0, 10, None)],
        [{"a"}, {"b"}],
    ),
    (
        "no group: overlapping runs that spell labels alike are one job",
        [("a", "", "p", 0, 10, "rank_0"), ("b", "", "p", 2, 5, "rank_1")],
        [{"a", "b"}],
    ),
    (
        "no group: overlapping runs that spell labels differently are two jobs",
        [("a", "", "p", 0, 10, "rank_0"), ("b", "", "p", 2, 5, "gpu0")],
        [{"a"}, {"b"}],
    ),
    (
        "no group: runs apart in time are two jobs",
        [("a", "", "p", 0, 10, "rank_0"), ("b", "", "p", 11, 20, "rank_0")],
        [{"a"}, {"b"}],
    ),
    (
        "overlap is transitive: a short run inside a long one joins it",
        [
            ("long", "", "p", 0, 100, "rank_0"),
            ("short", "", "p", 1, 2, "rank_1"),
            ("late", "", "p", 50, 60, "rank_2"),
        ],
        [{"long", "short", "late"}],
    ),
]


@pytest.mark.parametrize("case, table, expected", GROUPING, ids=[c[0] for c in GROUPING])
def test_job_grouping(case, table, expected):
    runs = [
        RunFacts(run_id=i, group=g, project=p, start=s, end=e, label=lab)
        for i, g, p, s, e, lab in table
    ]
    found = identify(runs)
    jobs: dict[str, set[str]] = {}
    for index, ident in found.identities.items():
        jobs.setdefault(ident.rank.job_id, set()).add(runs[index].run_id)
    assert not found.problems
    assert sorted(jobs.values(), key=sorted) == sorted(expected, key=sorted)


def test_two_runs_claiming_one_rank_name_both_runs_and_the_options():
    runs = [
        facts("a", label="rank_0", name="first"),
        facts("b", label="rank_0", name="second"),
        facts("c", label="rank_1"),
    ]
    found = identify(runs)
    assert not found.identities
    [problem] = found.problems
    for fragment in ("a (label 'rank_0', name 'first'", "b (label 'rank_0'", "--ranks"):
        assert fragment in problem.message


def test_a_run_that_says_nothing_beside_runs_that_do_is_named():
    runs = [facts("a", group="g", label="rank_0"), facts("quiet", group="g")]
    [problem] = identify(runs).problems
    assert problem.message.startswith("quiet (no label)") and "--label-pattern" in problem.message


def test_ranks_file_json_and_csv(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"a": 1, "b": {"rank": 0, "job": "j"}}))
    hints = make_hints(ranks_file=tmp_path / "r.json")
    assert hints.given == {"a": GivenRank(1), "b": GivenRank(0, job="j")}
    (tmp_path / "r.csv").write_text("run_id,rank,local_rank,worker\na,3,1,1\nb,0,0,0\n")
    hints = make_hints(ranks_file=tmp_path / "r.csv")
    assert hints.given["a"] == GivenRank(3, local_rank=1, worker=1)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"a": -1}', "rank must be a whole number"),
        ('{"a:b": 1}', "invalid run id"),
        ('{"a": {"rank": 1, "worker": 0}}', "local_rank and worker together"),
        ("run,rank\na,1\n", "header with run_id and rank"),
        ("run_id,rank\na,1\na,2\n", "given twice"),
        ("run_id,rank\n", "names no run"),
        ("[]", "names no run"),
        ("{}", "names no run"),
    ],
)
def test_bad_ranks_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "ranks.txt"
    path.write_text(content)
    result = CliRunner().invoke(
        main, ["inspect", str(job_dir("no_metadata")), "--ranks", str(path)]
    )
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_ranks_file_reorders_real_runs_and_names_unknown_ids(tmp_path):
    runs = json.loads(
        CliRunner().invoke(main, ["inspect", str(job_dir("no_metadata")), "--json"]).output
    )
    by_rank = {r["rank"]: r["run_id"] for r in runs}
    swapped = {by_rank[0]: 1, by_rank[1]: 0}
    (tmp_path / "ranks.json").write_text(json.dumps(swapped))
    result = CliRunner().invoke(
        main,
        ["inspect", str(job_dir("no_metadata")), "--json", "--ranks", str(tmp_path / "ranks.json")],
    )
    assert result.exit_code == 0, result.output
    got = {r["run_id"]: (r["rank"], r["source"]) for r in json.loads(result.output)}
    assert got == {by_rank[0]: (1, "given"), by_rank[1]: (0, "given")}
    (tmp_path / "ranks.json").write_text(json.dumps({**swapped, "nosuchrun": 2}))
    result = CliRunner().invoke(
        main, ["inspect", str(job_dir("no_metadata")), "--ranks", str(tmp_path / "ranks.json")]
    )
    assert result.exit_code == 2 and "nosuchrun" in result.stderr


def test_plain_runs_of_two_directories_are_one_job_when_they_overlap(tmp_path):
    # plugin-labelled runs split over two directories (as two nodes' disks would be)
    runs = sorted((job_dir("plain_labels_2x2") / "wandb").iterdir())
    for index, run_dir in enumerate(runs):
        shutil.copytree(run_dir, tmp_path / f"node{index % 2}" / "wandb" / run_dir.name)
    result = CliRunner().invoke(
        main, ["inspect", "--json", str(tmp_path / "node0"), str(tmp_path / "node1")]
    )
    rows = json.loads(result.output)
    assert len({r["job_id"] for r in rows}) == 1
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]


# Cases found by trying wbmerge as users would (an adversarial review of the first version).


def test_a_job_whose_runs_name_their_node_only_in_part_is_a_problem_not_a_crash():
    runs = [facts("a", group="g", config={"rank": 0}), facts("b", group="g", label="node0_rank1")]
    found = identify(runs)
    assert not found.identities
    [problem] = found.problems
    assert "a (no label" in problem.message


def test_a_config_rank_that_is_no_process_rank_gives_way_to_the_labels():
    # `rank` as a LoRA hyperparameter, the same on every run; the labels say the ranks
    runs = [facts(f"r{i}", config={"rank": 8}, label=f"rank_{i}") for i in range(2)]
    assert {k: v[:1] + v[5:7] for k, v in places(runs).items()} == {
        "r0": (0, "label", "rank_0"),
        "r1": (1, "label", "rank_1"),
    }
    # a stale argparse --local_rank default, logged with config.update(args)
    runs = [facts(f"r{i}", config={"local_rank": 0}, label=f"rank_{i}") for i in range(2)]
    assert places(runs)["r1"][:1] == (1,)


def test_a_label_pattern_wins_over_config_keys():
    runs = [facts(f"r{i}", config={"rank": 1 - i}, label=f"trainer.{i}") for i in range(2)]
    assert places(runs)["r1"][0] == 0  # the config says so
    hints = Hints(label_pattern=compile_pattern("trainer.{rank}"))
    assert places(runs, hints)["r1"][:1] + places(runs, hints)["r1"][5:6] == (1, "label")


@pytest.mark.parametrize("name", ["bert-lr0-gpu0", "llama-7b-gpu8", "baseline-rank-2"])
def test_display_names_are_read_only_in_the_plain_spellings(name):
    assert parse_spelling(name, "name") is None
    assert parse_spelling(name, "label") is not None  # as an x_label it names a node


def test_a_lone_run_is_a_job_of_one_rank_whatever_its_name_says():
    [ident] = identify([facts("solo", name="rank-3")]).identities.values()
    assert (ident.rank.rank, ident.rank.world_size, ident.source) == (0, 1, "order")


def test_runs_that_say_nothing_and_differ_in_config_are_separate_jobs():
    runs = [facts("a", settings={"lr": "0.1"}), facts("b", start=1.0, settings={"lr": "0.2"})]
    found = identify(runs)
    assert {x.rank.job_id for x in found.identities.values()} == {"a", "b"}
    assert not found.warnings


def test_a_job_whose_runs_differ_in_config_is_merged_with_a_warning():
    runs = [
        facts(f"r{i}", group="DDP", label=f"rank_{i}", settings={"lr": f"0.{i}", "bs": "8"})
        for i in range(2)
    ]
    found = identify(runs)
    assert len(found.identities) == 2
    [warning] = found.warnings
    assert "differ in config (lr; lr = 0.0: r0; 0.1: r1)" in warning.message
    assert "job column" in warning.message


def test_seeds_and_shards_of_each_rank_of_one_job_give_no_config_warning():
    # (one DDP job: every rank its own seed, data shard and device, the rest shared)
    runs = [
        facts(
            f"r{i}",
            group="DDP",
            label=f"rank_{i}",
            settings={
                "seed": str(1000 + i),
                "data_shard": f'"shard-{i:02d}"',
                "shardSeed": str(7 * i),
                "device": f'"cuda:{i % 2}"',
                "lr": "0.1",
            },
        )
        for i in range(4)
    ]
    assert len(identify(runs).identities) == 4
    assert identify(runs).warnings == []
    # the same by start order alone (no run says its rank): only the guess is said
    plain = [
        facts(f"p{i}", start=float(i), group="DDP", settings={"seed": str(i)}) for i in range(2)
    ]
    assert not [w for w in identify(plain).warnings if "differ in config" in w.message]


def test_a_prefix_shared_by_every_label_is_not_a_node():
    runs = [
        facts(f"{h}{lr}", host=f"node{h}", label=f"ddp_rank{lr}") for h in (0, 1) for lr in (0, 1)
    ]
    got = places(runs)
    assert got["11"][:5] == (3, 1, 1, 4, 2)


def test_local_ranks_on_one_host_are_the_ranks():
    runs = [facts(f"r{i}", config={"local_rank": i}) for i in range(2)]
    assert {k: v[0] for k, v in places(runs).items()} == {"r0": 0, "r1": 1}
    runs = [facts(f"r{i}", label=f"gpu-{i}") for i in range(2)]
    hints = Hints(label_pattern=compile_pattern("gpu-{local_rank}"))
    assert {k: v[0] for k, v in places(runs, hints).items()} == {"r0": 0, "r1": 1}


def test_a_missing_last_rank_on_several_hosts_keeps_the_world_of_the_hosts():
    runs = [facts(f"r{r}", host=f"h{r // 2}", label=f"rank_{r}") for r in range(3)]
    got = places(runs)
    assert {v[3:5] for v in got.values()} == {(4, 2)}  # rank 3 is missing, not a 3-rank world
    assert got["r2"][:3] == (2, 0, 1)


@pytest.mark.parametrize(
    "text",
    [
        'run_id, "rank"\n a , 1\nb,0\n',  # a quoted header cell after a space
        "\n\nrun_id,rank\na,1\nb,0\n",  # blank lines first
        "run_id,rank\na,1,extra\nb,0\n",  # a cell past the header's
    ],
)
def test_ranks_files_as_people_write_them(tmp_path, text):
    path = tmp_path / "ranks.csv"
    path.write_text(text)
    assert make_hints(ranks_file=path).given == {"a": GivenRank(1), "b": GivenRank(0)}


def test_ranks_file_from_a_spreadsheet(tmp_path):
    path = tmp_path / "ranks.csv"
    path.write_text("run_id, rank, job\n a , 1, exp-1\nb,0,exp-1\n", encoding="utf-8-sig")
    hints = make_hints(ranks_file=path)
    assert hints.given == {"a": GivenRank(1, job="exp-1"), "b": GivenRank(0, job="exp-1")}
    path.write_text("run_id,rank,job\na,1,exp:1\n")
    with pytest.raises(WbmergeError, match="job: invalid run id"):
        make_hints(ranks_file=path)


def test_partial_worker_columns_in_a_ranks_file_are_one_line(tmp_path):
    rows = inspect_json(job_dir("no_metadata"))
    ids = [r["run_id"] for r in rows]
    (tmp_path / "p.csv").write_text(
        f"run_id,rank,local_rank,worker\n{ids[0]},0,0,0\n{ids[1]},1,,\n"
    )
    result = CliRunner().invoke(
        main, ["sync", str(job_dir("no_metadata")), "--dry-run", "--ranks", str(tmp_path / "p.csv")]
    )
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "no node" in result.stderr


def inspect_json(path, *args):
    result = CliRunner().invoke(main, ["inspect", "--json", str(path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_run_killed_before_it_wrote_a_run_record_is_left_out_with_a_warning(tmp_path):
    shutil.copytree(job_dir("plain_labels") / "wandb", tmp_path / "wandb")
    empty = tmp_path / "wandb" / "offline-run-20261121_182900-k1lled00"
    empty.mkdir()
    (empty / "run-k1lled00.wandb").write_bytes(b":W&B\xe1\xbe\x00")  # the header alone
    result = CliRunner().invoke(
        main, ["sync", str(tmp_path), "--dry-run", "--json", "--run-mode", "shared"]
    )
    assert result.exit_code == 0, result.output
    assert "k1lled00" in result.stderr and "no run record" in result.stderr
    [target] = json.loads(result.stdout)
    assert len(target["sources"]) == 3


def test_a_ranks_file_that_names_a_job_in_part_leaves_the_rest_a_problem():
    # Two runs of one job (the same group) and one of another: naming only "a" would cut
    # the first job in two, each half uploaded; naming all of a job, or none, is fine.
    runs = [facts("a", group="g"), facts("b", group="g"), facts("c", group="other")]
    found = identify(runs, Hints(given={"a": GivenRank(0)}))
    assert [runs[i].run_id for i in found.identities] == ["a", "c"]
    [problem] = found.problems
    assert problem.runs == (1,)
    assert "names run(s) a but not b of the same job" in problem.message
    named_whole = places(runs, Hints(given={"a": GivenRank(1), "b": GivenRank(0)}))
    assert {k: v[0] for k, v in named_whole.items()} == {"a": 1, "b": 0, "c": 0}
    many = [facts(f"r{n}", group="g") for n in range(10)]
    [problem] = identify(many, Hints(given={"r0": GivenRank(0)})).problems
    assert "not r1, r2, r3, r4 and 5 more of the same job" in problem.message


def test_a_ranks_file_that_names_one_run_of_a_wbmerge_job_leaves_the_rest_a_problem():
    # Runs with a wbmerge block are one job by its id: naming one of them in the file
    # would make it a job of its own, and the others a job without it.
    runs = [
        facts(f"r{r}", metadata=RankInfo(r, r, 3, 3, 0, job_id="J"), label=f"rank-{r}")
        for r in range(3)
    ]
    found = identify(runs, Hints(given={"r1": GivenRank(0)}))
    assert [runs[i].run_id for i in found.identities] == ["r1"]
    [problem] = found.problems
    assert problem.runs == (0, 2) and "names run(s) r1 but not r0, r2" in problem.message
    whole = places(runs, Hints(given={f"r{r}": GivenRank(2 - r) for r in range(3)}))
    assert {k: (v[0], v[5]) for k, v in whole.items()} == {
        "r0": (2, "given"),
        "r1": (1, "given"),
        "r2": (0, "given"),
    }


def test_a_ranks_file_naming_one_of_two_real_ranks_stops_the_sync(tmp_path):
    ids = [r["run_id"] for r in inspect_json(job_dir("no_metadata"))]
    (tmp_path / "ranks.json").write_text(json.dumps({ids[1]: 0}))
    args = ["sync", str(job_dir("no_metadata")), "--dry-run", "--json"]
    args += ["--ranks", str(tmp_path / "ranks.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"names run(s) {ids[1]} but not {ids[0]}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    # With --job the user picks the named run's job and nothing else is uploaded.
    result = CliRunner().invoke(main, [*args, "--job", ids[1]])
    assert result.exit_code == 0, result.output
    [target] = json.loads(result.stdout)
    assert target["id"] == ids[1] and [s["path"][-8:] for s in target["sources"]] == [ids[1]]


def test_a_label_pattern_that_matches_no_run_says_so():
    runs = [facts("a", label="rank_0"), facts("b", label="rank_1")]
    found = identify(runs, Hints(label_pattern=compile_pattern("trainer{rank}")))
    assert {x.rank.rank for x in found.identities.values()} == {0, 1}  # from the spelling
    assert not found.warnings
    assert found.notes == [
        "--label-pattern matched the label or name of none of the 2 run(s) it was tried on; "
        "their ranks were read as if it were not given"
    ]
    matched = identify(runs, Hints(label_pattern=compile_pattern("rank_{rank}")))
    assert not matched.notes
    # Runs with a wbmerge block are not read with the pattern: it is unused, not wrong.
    blocks = [facts("c", metadata=RankInfo(0, 0, 1, 1, 0, job_id="J"), label="rank-0")]
    unused = identify([*blocks, *runs], Hints(label_pattern=compile_pattern("rank_{rank}")))
    assert not unused.notes
    [note] = identify(blocks, Hints(label_pattern=compile_pattern("rank-{rank}"))).notes
    assert note == "--label-pattern is unused: every run has a wbmerge block or a --ranks entry"


def test_a_label_pattern_note_is_said_once_for_several_jobs():
    jobs = [job_dir(name) for name in ("plain_labels", "recipe_name")]
    result = CliRunner().invoke(
        main, ["sync", "--dry-run", *map(str, jobs), "--label-pattern", "xx{rank}"]
    )
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("--label-pattern matched the label or name of none") == 1


def test_a_label_pattern_that_reads_ranks_twice_is_named_to_be_corrected():
    """`worker-{rank}-rank-{local_rank}` on labels `worker-W-rank-L` gives two runs rank 1:
    the error says to correct the pattern, not to give one."""
    args = ["merge", "--run-mode", "shared", "--out", "unused", str(job_dir("plain_labels_2x2"))]
    result = CliRunner().invoke(main, [*args, "--label-pattern", "worker-{rank}-rank-{local_rank}"])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("wbmerge: error: rank 1 claimed by more than one run: ")
    assert line.endswith(
        "say each run's rank with --ranks FILE (run id -> rank), or correct --label-pattern"
    )
    without = CliRunner().invoke(main, ["inspect", str(job_dir("plain_labels_2x2"))])
    assert without.exit_code == 0, without.output  # (its labels say the ranks as they are)


@pytest.mark.parametrize(
    "pattern, hint",
    [
        (None, "say each run's rank with --ranks FILE (run id -> rank) or --label-pattern"),
        # the pattern reads job g1 (node0-gpu0, node0-gpu1), not g2: only --ranks is left
        ("node{worker}-gpu{local_rank}", "say each run's rank with --ranks FILE (run id -> rank)"),
        # it reads both jobs, and gives g2's runs one rank: the pattern is to be corrected
        (
            "{rank}",
            "say each run's rank with --ranks FILE (run id -> rank), or correct --label-pattern",
        ),
    ],
)
def test_the_hint_names_the_label_pattern_only_where_it_can_help(pattern, hint):
    runs = [
        facts("c", label="node0-gpu0", group="g1"),
        facts("d", label="node0-gpu1", group="g1"),
        facts("e", label="rank_1", group="g2"),
        facts("f", label="rank_1", group="g2"),
    ]
    if pattern == "{rank}":
        runs = [
            facts("c", label="0", group="g1"),
            facts("d", label="1", group="g1"),
            facts("e", label="1", group="g2"),
            facts("f", label="1", group="g2"),
        ]
    hints = make_hints(pattern, None) if pattern else None
    [problem] = identify(runs, hints).problems
    assert problem.message.startswith("rank 1 claimed by more than one run: e ")
    assert problem.message.endswith(f"; {hint}")


@pytest.mark.parametrize("command", ["sync", "merge", "inspect", "export", "report"])
def test_a_label_pattern_given_twice_is_refused_not_cut_to_the_last(command):
    """Two patterns (one per spelling of the names) would not both apply: click kept the
    last in silence. Every command that reads ranks refuses it, before reading a run."""
    args = [command, str(job_dir("plain_labels")), "--label-pattern", "rank_{rank}"]
    result = CliRunner().invoke(main, [*args, "--label-pattern", "gpu{rank}"])
    assert result.exit_code == 2, result.output
    assert "--label-pattern': given 2 times; one pattern reads every run" in result.stderr


def test_the_config_warning_names_the_key_that_splits_the_runs():
    # seed differs per run (not said: a seed is per rank), lr per experiment, opt is long,
    # note is missing on one run.
    long_opt = json.dumps({"name": "adamw", "betas": [0.9, 0.999], "eps": 1e-8, "wd": 0.01})
    runs = [
        facts(
            f"r{i}",
            group="DDP",
            label=f"rank_{i}",
            settings={
                "seed": str(i),
                "lr": "0.1" if i < 2 else "0.2",
                "opt": long_opt,
                **({"note": '"x"'} if i else {}),
            },
        )
        for i in range(4)
    ]
    [warning] = identify(runs).warnings
    assert "differ in config (lr, note; lr = 0.1: r0, r1; 0.2: r2, r3)" in warning.message
    many = [
        facts(f"r{i}", group="G", label=f"rank_{i}", settings={"opt": f'"{"x" * 60}{i}"'})
        for i in range(6)
    ]
    [warning] = identify(many).warnings
    assert f'opt = "{"x" * 36}...: r0; ' in warning.message
    assert warning.message.count("...: r") == 4 and "; and 2 more values)" in warning.message
    missing = [
        facts("a", group="G", label="rank_0", settings={"note": '"unset"'}),
        facts("b", group="G", label="rank_1"),
    ]
    [warning] = identify(missing).warnings
    assert 'note = "unset": a; (missing): b)' in warning.message


def test_missing_ranks_are_listed_short():
    from wbmerge.identify import few_ranks

    assert few_ranks([1, 3]) == "1, 3"
    assert few_ranks(list(range(1, 1024, 2))) == "1, 3, 5, 7, 9, 11, 13, 15 and 504 more"


def test_ranks_killed_before_wandb_flushed_are_named_where_ranks_are_missing(tmp_path):
    job = shutil.copytree(job_dir("one_node_4"), tmp_path / "job")
    rows = {r["rank"]: r for r in inspect_json(job)}
    for rank in (2, 3):  # what wandb leaves of a rank killed in its first seconds
        [log] = Path(rows[rank]["path"]).glob("run-*.wandb")
        log.write_bytes(log.read_bytes()[:7])
    result = CliRunner().invoke(main, ["sync", "--dry-run", str(job)])
    assert result.exit_code == 2
    [error] = [line for line in result.stderr.splitlines() if "error" in line]
    assert "rank(s) 2, 3 of 4 have no offline run" in error
    assert "; 2 run file(s) found hold no run record, e.g. " in error and "flush_every" in error

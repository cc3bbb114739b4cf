"""`wbmerge inspect` on every real fixture, checked against how each job was launched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main

from ..conftest import FIXTURES, MANIFEST, job_dir


def inspect_json(*paths):
    result = CliRunner().invoke(main, ["inspect", "--json", *map(str, paths)])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def expected_label(rank, nodes, nproc):
    return f"worker-{rank // nproc}-rank-{rank % nproc}" if nodes > 1 else f"rank-{rank}"


HELPER_JOBS = [n for n, j in MANIFEST["jobs"].items() if "--plain" not in j["train_args"]]
LABEL_JOBS = [
    n for n, j in MANIFEST["jobs"].items() if j["train_args"][-2:] == ["--plain", "label"]
]


@pytest.mark.parametrize("name", HELPER_JOBS)
def test_topology_of_helper_jobs(name):
    job = MANIFEST["jobs"][name]
    rows = inspect_json(job_dir(name))
    world = job["nodes"] * job["nproc"]
    restarts = 2 if name == "elastic_restart" else 1
    assert len(rows) == world * restarts
    assert {r["job_id"] for r in rows} == {job["job_id"]}
    assert sorted((r["rank"], r["restart"]) for r in rows) == sorted(
        (rank, restart) for rank in range(world) for restart in range(restarts)
    )
    for r in rows:
        assert r["source"] == "wbmerge"
        assert (r["world_size"], r["local_world_size"]) == (world, job["nproc"])
        assert (r["worker"], r["local_rank"]) == divmod(r["rank"], job["nproc"])
        assert r["label"] == expected_label(r["rank"], job["nodes"], job["nproc"])


@pytest.mark.parametrize("name", ["one_node_4", "two_nodes_2x2", "media", "slow_rank"])
def test_clean_jobs_are_complete_with_every_step(name):
    job = MANIFEST["jobs"][name]
    for r in inspect_json(job_dir(name)):
        assert r["complete"] and r["exit_code"] == 0 and not r["truncated"]
        assert (r["history_rows"], r["last_step"]) == (job["steps"], job["steps"] - 1)
        assert r["dropped_records"] == 0


def test_cadence():
    rows = {r["rank"]: r for r in inspect_json(job_dir("cadence"))}
    assert rows[0]["history_rows"] == 30
    for rank in (1, 2, 3):
        assert rows[rank]["history_rows"] == len(range(0, 30, 5))
        assert rows[rank]["last_step"] == 25


def test_killed_rank_is_truncated_and_incomplete_without_failing():
    job = MANIFEST["jobs"]["killed_rank"]
    rows = {r["rank"]: r for r in inspect_json(job_dir("killed_rank"))}
    killed = rows[2]
    assert killed["truncated"] and not killed["complete"] and killed["exit_code"] is None
    assert 0 < killed["history_rows"] < 150  # the blocks wandb-core had flushed
    for rank in (0, 1, 3):  # survivors fail on the lost peer: exit record with code 1
        assert rows[rank]["complete"] and rows[rank]["exit_code"] == 1
        assert rows[rank]["last_step"] >= 150 and rows[rank]["last_step"] < job["steps"]
    # The table says how the killed rank ended, not a "0 B tail", and every exit code.
    table = CliRunner().invoke(main, ["inspect", str(job_dir("killed_rank"))]).output
    cells = {
        line.split()[0]: line.split(maxsplit=14)[12:]  # complete, exit, damage
        for line in table.splitlines()[2:]
        if line.strip()
    }
    assert cells[killed["run_id"]] == ["no", "-", "no exit record (killed, or still writing)"]
    assert cells[rows[0]["run_id"]] == ["yes", "1", "-"]


def test_elastic_restart_continues_steps():
    rows = inspect_json(job_dir("elastic_restart"))
    by = {(r["rank"], r["restart"]): r for r in rows}
    for rank in (0, 1):
        first, second = by[(rank, 0)], by[(rank, 1)]
        assert first["exit_code"] == 1 and second["exit_code"] == 0
        assert first["last_step"] < 9 <= second["last_step"]
        assert second["last_step"] == 19


@pytest.mark.parametrize("name", LABEL_JOBS)
def test_plain_wandb_runs_with_plugin_labels(name):
    job = MANIFEST["jobs"][name]
    rows = inspect_json(job_dir(name))
    world = job["nodes"] * job["nproc"]
    assert sorted(r["rank"] for r in rows) == list(range(world))
    rank0 = next(r for r in rows if r["rank"] == 0)
    for r in rows:
        assert r["source"] == "label"
        assert r["label"] == expected_label(r["rank"], job["nodes"], job["nproc"])
        assert r["world_size"] == world and r["local_world_size"] == job["nproc"]
        assert r["job_id"] == rank0["run_id"]


def test_runs_that_say_nothing_are_numbered_by_start_order_with_a_note():
    result = CliRunner().invoke(main, ["inspect", str(job_dir("no_metadata"))])
    assert result.exit_code == 0
    assert "assumed from start order" in result.output and "--ranks" in result.output
    rows = inspect_json(job_dir("no_metadata"))
    by_start = sorted(rows, key=lambda r: _start_time(r["path"]))
    assert [r["rank"] for r in by_start] == [0, 1]
    assert {r["source"] for r in rows} == {"order"}
    assert {r["job_id"] for r in rows} == {by_start[0]["run_id"]}
    assert all(r["label"] == r["run_id"] for r in rows)  # no x_label, no display name


def _start_time(run_dir: str) -> float:
    """The run record's start time, read with protobuf (not with wbmerge's reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    from wbmerge.log import read_payloads

    for payload in read_payloads(next(Path(run_dir).glob("run-*.wandb"))):
        record = pb.Record.FromString(payload)
        if record.HasField("run"):
            return record.run.start_time.ToNanoseconds() / 1e9
    raise AssertionError("no run record")


def test_damaged_copies():
    corrupt = inspect_json(FIXTURES / "damaged" / "corrupt_block")[0]
    assert corrupt["dropped_records"] > 0 and not corrupt["truncated"]
    assert corrupt["rank"] is not None  # identity survives: it is in block 0
    cut = inspect_json(FIXTURES / "damaged" / "truncated_mid_chunk")[0]
    assert cut["truncated"] and not cut["complete"]


def test_one_run_directory_and_one_file_are_accepted():
    run_dir = next((job_dir("media") / "wandb").glob("offline-run-*"))
    assert len(inspect_json(run_dir)) == 1
    assert len(inspect_json(next(run_dir.glob("*.wandb")))) == 1


def test_human_table_lists_jobs():
    result = CliRunner().invoke(main, ["inspect", str(job_dir("two_nodes_2x2"))])
    assert result.exit_code == 0
    assert "job fx-two-nodes-2x2" in result.output
    assert "worker-1-rank-1" in result.output


@pytest.mark.parametrize(
    "path, message",
    [
        ("damaged/not_a_log", "not a W&B transaction log"),
        ("does-not-exist", "no such file or directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(path, message):
    result = CliRunner().invoke(main, ["inspect", str(FIXTURES / path)])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_one_unreadable_file_is_listed_beside_the_runs_that_can_be_read():
    result = CliRunner().invoke(main, ["inspect", "--json", str(FIXTURES / "damaged")])
    assert result.exit_code == 2
    assert "notalog" in result.stderr and "not a W&B transaction log" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    rows = {r["path"].rsplit("/", 3)[-3]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"corrupt_block", "not_a_log", "truncated_mid_chunk"}
    bad = rows["not_a_log"]
    assert bad["run_id"] == "notalog" and bad["rank"] is None and bad["size"] == 40
    assert bad["unreadable"].endswith("not a W&B transaction log (bad file header)")
    assert rows["corrupt_block"]["rank"] == 0 and rows["corrupt_block"]["unreadable"] is None
    assert rows["corrupt_block"]["history_rows"] == 98
    # The table marks it, and says why under the runs of unknown rank.
    table = CliRunner().invoke(main, ["inspect", str(FIXTURES / "damaged")]).stdout
    assert "unreadable" in table and "note: " in table and "truncated (62 B tail)" in table
    # A sync still stops before anything is written.
    sync = CliRunner().invoke(main, ["sync", "--dry-run", str(FIXTURES / "damaged")])
    assert sync.exit_code == 2 and "not a W&B transaction log" in sync.stderr


def test_directory_without_runs_is_exit_2(tmp_path):
    (tmp_path / "wandb").mkdir()
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and "no offline W&B run" in result.stderr


def test_an_unreadable_run_named_in_a_ranks_file_is_listed_not_missing(tmp_path):
    (tmp_path / "ranks.json").write_text(json.dumps({"notalog": 0}))
    args = ["inspect", "--json", str(FIXTURES / "damaged" / "not_a_log")]
    result = CliRunner().invoke(main, [*args, "--ranks", str(tmp_path / "ranks.json")])
    assert result.exit_code == 2 and "not found" not in result.stderr
    [row] = json.loads(result.stdout)
    assert row["run_id"] == "notalog" and "not a W&B transaction log" in row["unreadable"]


def test_inspect_says_what_sync_would_refuse_in_a_job():
    # Two copies of one rank (a corrupt and a truncated one): merge stops at them.
    paths = [FIXTURES / "damaged" / "corrupt_block", FIXTURES / "damaged" / "truncated_mid_chunk"]
    rows = inspect_json(*paths)
    assert [len(row["warnings"]) for row in rows] == [1, 0]  # said once, on the job's first
    [note] = rows[0]["warnings"]
    assert note.startswith("sync and merge stop here: job fx-killed-rank: rank 0 (restart 0)")
    refused = CliRunner().invoke(main, ["merge", "--out", "/nonexistent", *map(str, paths)])
    assert refused.exit_code == 2 and note.split("here: ")[1] in refused.stderr
    # One rank of four: the ranks missing, and the option that merges the rest.
    [alone] = inspect_json(paths[0])
    assert alone["warnings"] == [
        "sync and merge stop here: job fx-killed-rank: rank(s) 1, 2, 3 of 4 have no offline "
        "run (pass --allow-missing-ranks to merge the others, or sync --follow while the job "
        "still runs)"
    ]

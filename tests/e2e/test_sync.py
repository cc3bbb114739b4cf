"""`wbmerge sync` end to end: real fixtures -> merge -> real `wandb sync` -> sink, by value.

Expected ids and groups are the run-mode table (written out in test_plan.py); expected values
come from the source `.wandb` files, read with protobuf in sinktools, not with our merge.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.log import BLOCK_SIZE, LogWriter, read_payloads, read_records
from wbmerge.training import RankInfo
from wbmerge.wandbcore import read_staged

from ..conftest import MANIFEST, job_dir
from ..plan.test_plan import TABLE
from ..sink.test_sink_artifacts import CLIENT_ID_MAPPING
from ..support import synthetic
from ..support.ranklogs import console_record, exit_record, history_record, rank_log
from ..support.sinktools import (
    console_text,
    content_of,
    expected_from_log,
    system_metric_values,
)

pytestmark = pytest.mark.e2e
UNLABELLED = {"_step", "_runtime", "_timestamp"}


def sources_of(name):
    """rank -> (label, Expected) from the fixture's files and the launch manifest."""
    job = MANIFEST["jobs"][name]
    out = {}
    for log in sorted(job_dir(name).glob("wandb/*/run-*.wandb")):
        want = expected_from_log(log)
        block = want.config["wbmerge"]
        label = (
            f"worker-{block['rank'] // job['nproc']}-rank-{block['rank'] % job['nproc']}"
            if job["nodes"] > 1
            else f"rank-{block['rank']}"
        )
        out[block["rank"]] = (label, want, log)
    return out


def cli_sync(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    result = CliRunner().invoke(main, ["sync", "--json", *map(str, args)], env=env)
    return result


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def assert_shared(got, ranks, key_format="{key}/{label}"):
    """Every value of every rank at its step under its label, exactly once; one row per step."""
    steps = [row["_step"] for row in got["history"]]
    assert steps == sorted(set(steps)), "one row per step, strictly increasing"
    by_step = {row["_step"]: row for row in got["history"]}
    expected_keys = {}
    for label, want, _ in ranks:
        for source_row in want.history:
            row = by_step[source_row["_step"]]
            for key, value in source_row.items():
                if key in UNLABELLED:
                    continue
                labelled = key_format.format(key=key, label=label)
                assert row[labelled] == value, (labelled, source_row["_step"])
                expected_keys.setdefault(source_row["_step"], set()).add(labelled)
    for step, row in by_step.items():
        assert set(row) - UNLABELLED == expected_keys[step], step  # nothing extra, nothing lost
    # console: every line of every rank, labelled, once
    arrived = console_text(got["console"])
    want_lines = sorted(f"[{label}] {line}" for label, want, _ in ranks for line in want.console)
    assert sorted(arrived) == want_lines
    # system metrics: every sample of every rank, with its /l:label suffix
    arrived_stats = system_metric_values(got["system_metrics"])
    for label, want, _ in ranks:
        for sample in want.stats:
            labelled = {k if "/l:" in k else f"{k}/l:{label}": v for k, v in sample.items()}
            assert labelled in arrived_stats
    assert len(arrived_stats) == sum(len(want.stats) for _, want, _ in ranks)
    # summary: every rank's final values under labelled keys, summary-only keys included
    for label, want, _ in ranks:
        for key, value in want.summary.items():
            if key not in UNLABELLED:
                assert got["summary"][key_format.format(key=key, label=label)] == value


CASES = [
    (name, mode, scope)
    for name in ("one_node_4", "two_nodes_2x2")
    for mode in ("auto", "shared", "new")
    for scope in ("global", "worker")
]


@pytest.mark.parametrize("name, mode, scope", CASES)
def test_every_mode_and_scope_arrives_as_the_table_says(sink, tmp_path, name, mode, scope):
    job = MANIFEST["jobs"][name]
    before = tree_digest(job_dir(name))
    result = cli_sync(
        sink,
        tmp_path,
        job_dir(name),
        "--run-mode",
        mode,
        "--rank-scope",
        scope,
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "B",
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert tree_digest(job_dir(name)) == before, "source directories must never change"

    expected = TABLE[(job["nodes"], job["nproc"], mode, scope)]
    runs = {r["id"]: r for r in sink.client.runs(project="e2e")}
    assert sorted(runs) == sorted(t[0] for t in expected)
    ranks = sources_of(name)
    for run_id, group, primary, source_ranks in expected:
        got = sink.client.run("local", "e2e", run_id)
        assert got["group"] == group
        assert got["config"]["wbmerge"]["primary_rank"] == primary
        assert got["state"] == "finished" and got["exit_code"] == 0
        if mode == "shared":
            assert_shared(got, [ranks[r] for r in source_ranks])
        else:
            [rank] = source_ranks
            want = ranks[rank][1]
            assert got["history"] == want.history  # passed through untouched
            assert {k: v for k, v in got["summary"].items() if k != "_wandb"} == want.summary
            assert console_text(got["console"]) == want.console
            assert system_metric_values(got["system_metrics"]) == want.stats
        config = {k: v for k, v in got["config"].items() if k != "wbmerge"}
        assert config == {k: v for k, v in ranks[primary][1].config.items() if k != "wbmerge"}

    links = json.loads(result.stdout)["links"]
    if mode == "new":
        groups = sorted({t[1] for t in expected})
        assert [link["url"] for link in links] == [
            f"{sink.url}/local/e2e/groups/{g}" for g in groups
        ]
    else:
        assert [link["url"] for link in links] == [
            f"{sink.url}/local/e2e/runs/{t[0]}" for t in expected
        ]


def test_second_sync_uploads_nothing_and_force_sends_no_duplicates(sink, tmp_path):
    args = [job_dir("one_node_4"), "--run-mode", "new", "-p", "again", "-e", "local"]
    first = json.loads(cli_sync(sink, tmp_path, *args).stdout)
    assert {r["status"] for r in first["runs"]} == {"uploaded"}
    second = cli_sync(sink, tmp_path, *args)
    assert {r["status"] for r in json.loads(second.stdout)["runs"]} == {"already synced"}
    for run in sink.client.runs(project="again"):
        assert len(sink.client.run("local", "again", run["id"])["history"]) == 30  # no duplicates
    forced = cli_sync(sink, tmp_path, *args, "--force")
    assert {r["status"] for r in json.loads(forced.stdout)["runs"]} == {"already complete"}
    # --force skips the ledger, not the server: it sends only what the server lacks (here
    # nothing), where `wandb sync` of the same run again would append every row a second time.
    for run in sink.client.runs(project="again"):
        assert len(sink.client.run("local", "again", run["id"])["history"]) == 30


def test_shared_media_from_a_non_zero_rank(sink, tmp_path):
    result = cli_sync(
        sink, tmp_path, job_dir("media"), "--run-mode", "shared", "-p", "media", "-e", "local"
    )
    assert result.exit_code == 0, result.stderr
    got = sink.client.run("local", "media", "fx-media")
    image = next(
        row["samples/image/rank-1"] for row in got["history"] if "samples/image/rank-1" in row
    )
    table = got["summary"]["samples/table/rank-1"]
    assert image["path"] in got["files"] and table["path"] in got["files"]
    assert got["summary"]["eval/notes/rank-1"] == "summary-only keys from rank 1"
    assert_shared(got, list(sources_of("media").values()))
    # The Table's run_table artifact, which rank 1 logged under its own offline id, is
    # the merged run's: committed, its files the ones rank 1's manifest names, and the
    # Table's value refers to it.
    name, files, client_id = table_artifact_of(job_dir("media"))
    (logged,) = got["artifacts"]["logged"]
    assert (logged["name"], logged["type"], logged["state"]) == (
        f"run-fx-media-{name.split('-', 2)[2]}",
        "run_table",
        "COMMITTED",
    )
    committed = sink.client.committed_files("local", "media", f"{logged['name']}:v0")
    assert committed["files"] == files
    assert table["artifact_path"].startswith(f"wandb-client-artifact://{client_id}/")
    mapping = sink.client.graphql(CLIENT_ID_MAPPING, {"clientID": client_id})
    assert mapping["data"]["clientIDMapping"]["serverID"] == logged["id"]


def table_artifact_of(job: Path) -> tuple[str, dict, str]:
    """(name, {path: (size, MD5)}, client id) of the one artifact the job's ranks logged,
    read from their logs with protobuf."""
    (artifact,) = [
        record.artifact
        for log in job.glob("wandb/*/run-*.wandb")
        for record in read_records(log)
        if record.WhichOneof("record_type") == "artifact"
    ]
    files = {e.path: (e.size, e.digest) for e in artifact.manifest.contents}
    return artifact.name, files, artifact.client_id


def test_killed_non_primary_rank_warns_and_keeps_its_data(sink, tmp_path):
    result = cli_sync(
        sink, tmp_path, job_dir("killed_rank"), "--run-mode", "shared", "-p", "k", "-e", "local"
    )
    assert result.exit_code == 0, result.stderr
    assert (
        "rank 2 (rank-2, restart 0) is a non-primary rank and ended without an exit record"
        in result.stderr
    )
    got = sink.client.run("local", "k", "fx-killed-rank")
    assert got["exit_code"] == 1 and got["state"] == "failed"  # the primary failed on the lost peer
    assert_shared(got, list(sources_of("killed_rank").values()))


def test_elastic_restarts_are_concatenated(sink, tmp_path):
    result = cli_sync(
        sink,
        tmp_path,
        job_dir("elastic_restart"),
        "--run-mode",
        "shared",
        "-p",
        "el",
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    got = sink.client.run("local", "el", "fx-elastic-restart")
    steps = [row["_step"] for row in got["history"]]
    assert steps == list(range(20))
    logs = sorted(job_dir("elastic_restart").glob("wandb/*/run-*.wandb"))
    for log in logs:
        want = expected_from_log(log)
        label = want.config["wbmerge"]["label"]
        for row in want.history:
            assert got["history"][row["_step"]][f"train/loss/{label}"] == row["train/loss"]
    assert got["exit_code"] == 0  # the last restart's exit


def test_cadence_rows_align(sink, tmp_path):
    result = cli_sync(
        sink, tmp_path, job_dir("cadence"), "--run-mode", "shared", "-p", "cad", "-e", "local"
    )
    assert result.exit_code == 0, result.stderr
    got = sink.client.run("local", "cad", "fx-cadence")
    assert [r["_step"] for r in got["history"]] == list(range(30))
    for row in got["history"]:
        assert ("train/loss/rank-1" in row) == (row["_step"] % 5 == 0)
    assert_shared(got, list(sources_of("cadence").values()))


def test_auto_with_every_ranks_system_metrics(sink, tmp_path):
    result = cli_sync(
        sink, tmp_path, job_dir("one_node_4"), "--system-metrics", "all", "-p", "sm", "-e", "local"
    )
    assert result.exit_code == 0, result.stderr
    got = sink.client.run("local", "sm", "fx-one-node-4")
    ranks = sources_of("one_node_4")
    assert got["history"] == ranks[0][1].history
    labels = {k.rsplit("/l:", 1)[1] for row in got["system_metrics"] for k in row if "/l:" in k}
    assert labels == {"rank-0", "rank-1", "rank-2", "rank-3"}
    assert len(got["system_metrics"]) == sum(len(w.stats) for _, w, _ in ranks.values())


def test_a_run_holding_every_ranks_system_metrics_is_not_sent_the_primarys_alone(sink, tmp_path):
    """Synced with every rank's system metrics, then again without: the second upload would
    rewrite the primary's rows and leave the other ranks' behind, a run of neither. It is
    refused, nothing is sent, and the run stays as the first sync left it."""
    first = cli_sync(
        sink, tmp_path, job_dir("slow_rank"), "--system-metrics", "all", "-p", "smx", "-e", "local"
    )
    assert first.exit_code == 0, first.stderr
    before = sink.client.run("local", "smx", "fx-slow-rank")
    ranks = sources_of("slow_rank")
    assert len(before["system_metrics"]) == sum(len(w.stats) for _, w, _ in ranks.values())
    primary_only = len(ranks[0][1].stats)
    again = cli_sync(sink, tmp_path, job_dir("slow_rank"), "-p", "smx", "-e", "local")
    assert again.exit_code == 1
    assert (
        f"wbmerge: error: run fx-slow-rank: the server holds {len(before['system_metrics'])} "
        f"system-metric rows, more than the {primary_only} staged: the server's run is not a "
        "beginning of this one (this machine verified it from other files or settings before: "
        "its sources or options changed since)" in again.stderr
    )
    assert json.loads(again.stdout)["runs"] == []
    assert content_of(sink.client.run("local", "smx", "fx-slow-rank")) == content_of(before)


def test_skew_metrics(sink, tmp_path):
    result = cli_sync(
        sink,
        tmp_path,
        job_dir("slow_rank"),
        "--run-mode",
        "shared",
        "--skew-metrics",
        "-p",
        "skew",
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    row = sink.client.run("local", "skew", "fx-slow-rank")["history"][5]
    values = sorted(row[f"train/step_time/rank-{r}"] for r in range(3))
    assert row["wbmerge/spread/train/step_time"] == pytest.approx(
        (values[2] - values[0]) / values[1]
    )


def test_merge_writes_runs_that_wandb_sync_accepts(sink, tmp_path):
    from ..support.sinktools import wandb_sync

    out = tmp_path / "merged"
    result = CliRunner().invoke(
        main,
        [
            "merge",
            str(job_dir("two_nodes_2x2")),
            "--run-mode",
            "shared",
            "--rank-scope",
            "worker",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.stderr
    dirs = sorted(out.glob("offline-run-*"))
    assert [d.name.rsplit("-", 2)[-2:] for d in dirs] == [["worker", "0"], ["worker", "1"]]
    assert wandb_sync(sink, dirs, "-p", "later", "-e", "local").returncode == 0
    assert sorted(r["id"] for r in sink.client.runs(project="later")) == [
        "fx-two-nodes-2x2-worker-0",
        "fx-two-nodes-2x2-worker-1",
    ]


def test_new_mode_copies_the_blocks_after_the_run_record_and_they_arrive(sink, tmp_path):
    """Logs longer than their head are not re-framed: the blocks after the run record are
    the source's bytes (after a block ended early by empty chunks or zeros), and wandb-core
    reads every record of them."""
    job = tmp_path / "job"
    logs = synthetic.write_job(job, 1, 2, 400, metrics=6, job_id="splice")
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["merge", str(job), "--run-mode", "new", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    for rank, log in enumerate(sorted(logs)):
        [staged] = out.glob(f"offline-run-*-splice-rank-{rank}/run-*.wandb")
        source = log.read_bytes()
        assert len(source) > 8 * BLOCK_SIZE
        assert staged.read_bytes().endswith(source[BLOCK_SIZE:])

    result = cli_sync(sink, tmp_path, job, "--run-mode", "new", "-p", "splice", "-e", "local")
    assert result.exit_code == 0, result.output + result.stderr
    for rank, log in enumerate(sorted(logs)):
        want = expected_from_log(log)
        got = sink.client.run("local", "splice", f"splice-rank-{rank}")
        assert got["state"] == "finished" and got["exit_code"] == 0
        assert len(got["history"]) == 400
        assert got["history"] == want.history
        assert {k: v for k, v in got["summary"].items() if k != "_wandb"} == want.summary
        assert system_metric_values(got["system_metrics"]) == want.stats


def test_wandb_core_skips_blocks_ended_early_with_zeros(sink, tmp_path):
    """What `end_block()` writes when the head ends on a record boundary: zeros to the end of
    the block. wandb-core must read on from the next block, losing nothing."""
    from ..support.sinktools import wandb_sync

    log = sorted(job_dir("one_node_4").glob("wandb/*/run-*.wandb"))[0]
    run_dir = tmp_path / log.parent.name
    shutil.copytree(log.parent, run_dir)
    with open(run_dir / log.name, "wb") as stream, LogWriter(stream) as writer:
        for index, payload in enumerate(read_payloads(log)):
            writer.write(payload)
            if index % 5 == 1:  # after the run record, and every fifth record on
                writer.end_block()
    assert (run_dir / log.name).stat().st_size > 4 * BLOCK_SIZE
    assert wandb_sync(sink, [run_dir], "-p", "zeros", "-e", "local").returncode == 0
    want = expected_from_log(log)
    got = sink.client.run("local", "zeros", want.run_id)
    assert got["history"] == want.history and len(want.history) > 5
    assert {k: v for k, v in got["summary"].items() if k != "_wandb"} == want.summary
    assert console_text(got["console"]) == want.console
    assert system_metric_values(got["system_metrics"]) == want.stats
    assert got["exit_code"] == want.exit_code == 0


@pytest.fixture(scope="module")
def typed_restart_job(tmp_path_factory) -> Path:
    """Two ranks, each started twice, written by real wandb with
    `x_history_value_encoding="json,typed"`: each value written twice, as JSON text and
    typed (wandb-core sends the typed one). A restart repeats steps 0, 10, 20. Written once
    for the run modes (four wandb processes), which only read it."""
    from ..training.test_training import run_rank

    code = """
    import os, wbmerge
    run = wbmerge.init(project="p")
    for step in (0, 10, 20):
        run.log({"loss": step / 10 + int(os.environ["RANK"])}, step=step)
    run.finish()
    """
    job = tmp_path_factory.mktemp("typed-restart") / "job"
    job.mkdir()
    for restart in ("0", "1"):
        for rank in ("0", "1"):
            result = run_rank(
                job,
                code,
                RANK=rank,
                WORLD_SIZE="2",
                TORCHELASTIC_RUN_ID="typed",
                TORCHELASTIC_RESTART_COUNT=restart,
                WANDB_X_HISTORY_VALUE_ENCODING="json,typed",
            )
            assert result.returncode == 0, result.stderr
    return job


@pytest.mark.parametrize("run_mode", ["new", "auto", "shared"])
def test_a_restart_written_with_typed_values_is_moved_in_both_forms(
    sink, tmp_path, typed_restart_job, run_mode
):
    # The restart goes on at 21, 31, 41 only if both forms of its `_step` are moved. (A
    # shared merge writes rows of its own, from the values of both ranks.)
    before = tree_digest(typed_restart_job)
    logs = sorted((typed_restart_job / "wandb").glob("offline-run-*/run-*.wandb"))
    first_row = next(r for r in read_records(logs[0]) if r.WhichOneof("record_type") == "history")
    assert first_row.history.item[0].WhichOneof("value") is not None  # written typed
    result = cli_sync(sink, tmp_path, typed_restart_job, "--run-mode", run_mode, "-p", "typed")
    assert result.exit_code == 0, result.stderr
    runs = {run["id"]: run for run in sink.client.runs(project="typed")}
    ids = ["typed-rank-0", "typed-rank-1"] if run_mode == "new" else ["typed"]
    assert sorted(runs) == ids
    for rank, run_id in enumerate(ids):
        history = sink.client.run("local", "typed", run_id)["history"]
        assert [row["_step"] for row in history] == [0, 10, 20, 21, 31, 41]
        if run_mode == "shared":
            for label in (0, 1):
                values = [row[f"loss/rank-{label}"] for row in history]
                assert values == [label, label + 1, label + 2] * 2
        else:
            assert [row["loss"] for row in history] == [rank, rank + 1, rank + 2] * 2
    assert tree_digest(typed_restart_job) == before  # (read only: the run modes share it)


def arrived(sink, project, run_id):
    """What a run holds on the sink, without the parts that differ by upload time."""
    got = sink.client.run("local", project, run_id)
    summary = {k: v for k, v in got["summary"].items() if k not in ("_wandb", "_runtime")}
    # Files wandb-core writes as it uploads (config.yaml, output.log, ...) differ by upload;
    # the rest are the run's own files, byte for byte.
    made_by_upload = {"wandb-metadata.json", "output.log", "config.yaml", "wandb-summary.json"}
    files = {
        name: sink.client.file("local", project, run_id, name)
        for name in got["files"]
        if name not in made_by_upload
    }
    return {
        "group": got["group"],
        "display_name": got.get("display_name"),
        "history": got["history"],
        "summary": summary,
        "config": got["config"],
        "console": console_text(got["console"]),
        "system": system_metric_values(got["system_metrics"]),
        "files": files,
        "exit_code": got["exit_code"],
    }


@pytest.mark.parametrize(
    "name, mode, scope",
    [
        ("two_nodes_2x2", "shared", "worker"),
        ("one_node_4", "new", "global"),
        ("media", "shared", "global"),
        ("killed_rank", "auto", "global"),
    ],
)
def test_a_merge_directory_syncs_as_its_runs_were_merged(
    sink, make_sink, tmp_path, name, mode, scope
):
    """`merge --out DIR` then `sync DIR` gives the runs a direct sync gives, verified, once.
    (The direct sync goes to a server of its own: an artifact's client id, the same in
    both, names one version on a server, which the sink keeps in the first project.)"""
    options = ["--run-mode", mode, "--rank-scope", scope, "-e", "local"]
    out = tmp_path / "merged"
    merged = CliRunner().invoke(main, ["merge", str(job_dir(name)), *options, "--out", str(out)])
    assert merged.exit_code == 0, merged.stderr
    before = tree_digest(out)
    later = cli_sync(sink, tmp_path, out, "-p", f"later-{mode}", "-e", "local")
    assert later.exit_code == 0, later.output + later.stderr
    assert tree_digest(out) == before, "a merge directory is a source: never written"
    other = make_sink()
    direct = cli_sync(other, tmp_path / "direct", job_dir(name), *options, "-p", f"direct-{mode}")
    assert direct.exit_code == 0, direct.output + direct.stderr
    ids = sorted(r["id"] for r in json.loads(direct.stdout)["runs"])
    assert sorted(r["id"] for r in json.loads(later.stdout)["runs"]) == ids
    assert {r["status"] for r in json.loads(later.stdout)["runs"]} == {"uploaded"}
    assert sorted(r["id"] for r in sink.client.runs(project=f"later-{mode}")) == ids
    for run_id in ids:
        want = arrived(other, f"direct-{mode}", run_id)
        assert want["history"] and want["console"] and "requirements.txt" in want["files"]
        assert arrived(sink, f"later-{mode}", run_id) == want, run_id
    if name == "media":
        assert any(n.startswith("media/") for n in want["files"])
    # The ledger knows them now, and the server: nothing is sent twice.
    again = cli_sync(sink, tmp_path, out, "-p", f"later-{mode}", "-e", "local", "--force")
    assert again.exit_code == 0, again.output + again.stderr
    for run_id in ids:
        got = sink.client.run("local", f"later-{mode}", run_id)["history"]
        assert got == arrived(other, f"direct-{mode}", run_id)["history"]


def test_a_merge_directory_refuses_merge_options_and_runs_of_ranks(tmp_path):
    out = tmp_path / "merged"
    CliRunner().invoke(
        main, ["merge", str(job_dir("one_node_4")), "--run-mode", "new", "--out", str(out)]
    )
    plan = CliRunner().invoke(main, ["sync", "--dry-run", "--json", str(out)])
    assert plan.exit_code == 0, plan.stderr
    assert {t["kind"] for t in json.loads(plan.stdout)} == {"merged"}
    for args, message in [
        (["--run-mode", "shared"], "--run-mode does not apply to runs that wbmerge merged"),
        (["--base-id", "X"], "--base-id does not apply"),
        ([str(job_dir("two_nodes_2x2"))], "sync merged runs and the runs of ranks apart"),
    ]:
        result = CliRunner().invoke(main, ["sync", "--dry-run", str(out), *args])
        assert result.exit_code == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    export = CliRunner().invoke(main, ["export", str(out), "-o", str(tmp_path / "x.parquet")])
    assert export.exit_code == 2 and "is a run that wbmerge merged" in export.stderr


def test_progress_bars_that_move_the_cursor_are_counted_and_verified(sink, tmp_path):
    """Two progress bars redrawn in place (tqdm's nested bars: ESC [ A moves the cursor up)
    make two lines, whatever the times they are drawn; the sync counts the lines wandb-core
    makes (2 bars and a line after them) and verifies the server holds them, the last
    drawing of each bar."""
    with rank_log(tmp_path / "job", RankInfo(0, 0, 1, 1, 0, job_id="bars"), "bars-0", "p") as log:
        log.write(console_record("epoch   0%\nbatch   0%\n", stderr=True))
        for done in range(10, 101, 10):
            log.write(history_record([("loss", str(1 / done))], done))
            log.write(console_record(f"\x1b[A\x1b[Aepoch {done:3d}%\nbatch {done:3d}%\n", True))
        log.write(console_record("done\n"))
        log.write(exit_record(0))
    [staged] = (tmp_path / "job").glob("wandb/*/run-*.wandb")
    assert read_staged(staged).console_lines == 3
    result = cli_sync(sink, tmp_path, tmp_path / "job", "--run-mode", "new", "-e", "local")
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in json.loads(result.stdout)["runs"]] == ["uploaded"]
    run = sink.client.run("local", "p", "bars-rank-0")
    assert console_text(run["console"]) == ["epoch 100%", "batch 100%", "done"]

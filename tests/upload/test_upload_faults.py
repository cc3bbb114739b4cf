"""Exactly once whatever happened before: faults, kills and reruns through the real uploader.

Every test ends by comparing what the sink holds with the source `.wandb` records (read
with protobuf in sinktools): every history row by value and `_step`, every console line and
system-metric row, once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.upload.serverclient import RUN_RESUME_STATUS
from wbmerge.upload.settle import last_stop

from ..conftest import interruptible, job_dir
from ..e2e.test_sync import tree_digest
from ..support import synthetic
from ..support.sinktools import (
    console_text,
    content_of,
    expected_from_log,
    like_wandb_by_default,
    system_metric_values,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def sink_like():
    """Faults and reruns on a server like W&B (tests/conftest.py): they must hold there."""
    return like_wandb_by_default()


PRIMARY = sorted(job_dir("one_node_4").glob("wandb/*/run-*.wandb"))
SOURCE_FILES = {"config.yaml", "requirements.txt", "wandb-metadata.json", "wandb-summary.json"}


def sync_args(project, *more, source=None):
    source = source or job_dir("one_node_4")
    return ["sync", "--json", str(source), "-p", project, "-e", "local", *map(str, more)]


def cli(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(main, list(args), env=env)


def primary_expected():
    for log in PRIMARY:
        want = expected_from_log(log)
        if want.config["wbmerge"]["rank"] == 0:
            return want
    raise AssertionError("no rank 0")


def assert_exactly_once(got, want):
    """Rows by value and `_step`, console lines and system-metric rows: each exactly once."""
    assert [row["_step"] for row in got["history"]] == [row["_step"] for row in want.history]
    assert got["history"] == want.history
    assert console_text(got["console"]) == want.console
    assert system_metric_values(got["system_metrics"]) == want.stats
    assert got["state"] == "finished" and got["exit_code"] == want.exit_code


def assert_every_rank_exactly_once(sink, project):
    """`assert_exactly_once` for the run of each rank of `one_node_4` in `--run-mode new`."""
    for log in PRIMARY:
        want = expected_from_log(log)
        rank = want.config["wbmerge"]["rank"]
        assert_exactly_once(sink.client.run("local", project, f"fx-one-node-4-rank-{rank}"), want)


# Each fault loses data on the first sync: refused at once (4xx), or refused or cut off
# for good (5xx, dropped connections), which wandb retries until `--timeout` ends it.
FAULTS = [
    "file_stream=400@2",
    "file_stream=500",
    "file_stream=drop",
    "storage=400",
    "storage=403@1",
    "graphql:CreateRunFiles=400",
    "graphql:UpsertBucket=500@2+",  # (the first is wbmerge's claim on the run, below)
]


@pytest.mark.parametrize("fault", FAULTS)
def test_rerun_after_a_fault_delivers_exactly_once(make_sink, tmp_path, fault):
    sink = make_sink([fault])
    first = cli(sink, tmp_path, *sync_args("f", "--timeout", "8"))
    assert first.exit_code == 1, first.output + first.stderr  # said, not claimed
    assert "wbmerge: error: run fx-one-node-4:" in first.stderr or "no progress" in first.stderr
    sink.client.set_faults([])
    second = cli(sink, tmp_path, *sync_args("f"))
    assert second.exit_code == 0, second.output + second.stderr
    [run] = json.loads(second.stdout)["runs"]
    assert run["status"] == "uploaded"  # the first sync recorded nothing
    got = sink.client.run("local", "f", "fx-one-node-4")
    assert_exactly_once(got, primary_expected())
    assert SOURCE_FILES <= set(got["files"])


def test_a_claim_the_server_refuses_stops_the_sync_in_one_line_and_a_rerun_sends_it(
    make_sink, tmp_path
):
    """The first UpsertBucket of a sync is its claim on the run (`upload.claims`): refused,
    nothing of the run is sent, the sync says so in one line, and a rerun sends it whole."""
    sink = make_sink(["graphql:UpsertBucket=500@1"])
    first = cli(sink, tmp_path, *sync_args("claim"))
    assert first.exit_code == 1
    assert first.stderr == f"wbmerge: error: {sink.url}/graphql answered HTTP 500 to UpsertBucket\n"
    assert sink.client.runs(project="claim") == []
    second = cli(sink, tmp_path, *sync_args("claim"))
    assert second.exit_code == 0, second.stderr
    [run] = json.loads(second.stdout)["runs"]
    assert run["status"] == "uploaded"
    assert_exactly_once(sink.client.run("local", "claim", "fx-one-node-4"), primary_expected())


def test_lost_files_are_exit_1_and_a_later_sync_delivers_them(make_sink, tmp_path):
    sink = make_sink(["storage=400"])
    first = cli(sink, tmp_path, *sync_args("files", "--run-mode", "new"))
    assert first.exit_code == 1
    lines = first.stderr.strip().splitlines()
    for rank in range(4):
        assert any(
            f"run fx-one-node-4-rank-{rank}:" in line and "not uploaded" in line for line in lines
        ), first.stderr
    assert not any(
        run["files"]
        for run in map(
            lambda r: sink.client.run("local", "files", r["id"]), sink.client.runs(project="files")
        )
    )
    assert "file config.yaml not uploaded" in first.stderr  # from the uploader's debug log
    sink.client.set_faults([])
    second = cli(sink, tmp_path, *sync_args("files", "--run-mode", "new"))
    assert second.exit_code == 0, second.stderr
    for rank in range(4):  # not a terminal: a line per verified run
        assert f"verified fx-one-node-4-rank-{rank}: 30 rows (" in second.stderr
    assert {r["status"] for r in json.loads(second.stdout)["runs"]} == {"uploaded"}
    for log in PRIMARY:
        want = expected_from_log(log)
        got = sink.client.run(
            "local", "files", f"fx-one-node-4-rank-{want.config['wbmerge']['rank']}"
        )
        assert SOURCE_FILES <= set(got["files"])
        assert_exactly_once(got, want)


def test_a_server_lost_after_some_runs_were_verified_still_lists_them(make_sink, tmp_path):
    """Two jobs in one sync; the server refuses every question once the first run is
    verified: exit 1, the error in a line, and --json lists the runs that were verified
    (and recorded: a rerun finds them "already synced"), none of the others."""
    for name in ("one_node_4", "two_nodes_2x2", "cadence"):
        shutil.copytree(job_dir(name), tmp_path / "jobs" / name)
    sink = make_sink(allow_faults=True)
    args = sync_args("lost", "--run-mode", "new", "-n", "1", source=tmp_path / "jobs")
    first = spawn(sink, tmp_path, args)
    assert first.stderr is not None
    lines = [first.stderr.readline()]
    while lines[-1] and not lines[-1].startswith("verified"):
        lines.append(first.stderr.readline())
    sink.client.set_faults(["graphql=401"])
    out, rest = first.communicate(timeout=120)
    assert first.returncode == 1, "".join(lines) + rest
    assert f"wbmerge: error: {sink.url}/graphql refused the API key (HTTP 401)" in rest
    listed = {r["id"]: r["status"] for r in json.loads(out)["runs"]}
    assert listed and set(listed.values()) == {"uploaded"} and len(listed) < 12
    sink.client.set_faults([])
    again = cli(sink, tmp_path, *args)
    assert again.exit_code == 0, again.stderr
    statuses = {r["id"]: r["status"] for r in json.loads(again.stdout)["runs"]}
    assert len(statuses) == 12
    assert {i for i, status in statuses.items() if status == "already synced"} == set(listed)


def test_new_mode_with_one_run_failed_resends_nothing_twice(make_sink, tmp_path):
    sink = make_sink(["file_stream=400@3"])
    first = cli(sink, tmp_path, *sync_args("one", "--run-mode", "new", "-n", "1"))
    assert first.exit_code == 1
    # --json still says which runs were verified (each recorded), and only those
    verified = {r["id"]: r["status"] for r in json.loads(first.stdout)["runs"]}
    sink.client.set_faults([])
    second = cli(sink, tmp_path, *sync_args("one", "--run-mode", "new"))
    assert second.exit_code == 0, second.stderr
    statuses = {r["id"]: r["status"] for r in json.loads(second.stdout)["runs"]}
    assert "already synced" in statuses.values() and "uploaded" in statuses.values()
    assert verified == {
        i: "uploaded" for i, status in statuses.items() if status == "already synced"
    }
    assert_every_rank_exactly_once(sink, "one")


@pytest.mark.parametrize("asked", ["1", "2", "4"])
def test_a_server_that_fails_a_question_before_upload_stops_the_sync(make_sink, tmp_path, asked):
    """The server is asked what it holds of each run as the run is staged (several at once);
    when one of those questions fails, the sync stops in one line, claims nothing, and a
    rerun delivers every rank exactly once."""
    sink = make_sink([f"graphql:RunResumeStatus=500@{asked}"])
    env = {**local_env(tmp_path), **sink.env}
    code, out, err = run_bounded(env, sync_args("q", "--run-mode", "new"), timeout=120)
    assert code == 1, err
    [line] = err.strip().splitlines()
    assert line == f"wbmerge: error: {sink.url}/graphql answered HTTP 500 to RunResumeStatus"
    assert out == ""  # no report of runs: nothing is claimed
    sink.client.set_faults([])
    second = cli(sink, tmp_path, *sync_args("q", "--run-mode", "new"))
    assert second.exit_code == 0, second.stderr
    assert {r["status"] for r in json.loads(second.stdout)["runs"]} == {"uploaded"}
    assert_every_rank_exactly_once(sink, "q")


def test_a_rate_limited_question_before_upload_is_asked_again(make_sink, tmp_path):
    sink = make_sink(["graphql:RunResumeStatus=429x3"])
    result = cli(sink, tmp_path, *sync_args("rl", "--run-mode", "new"))
    assert result.exit_code == 0, result.stderr
    assert sink.client.faults()["faults"][0]["fired"] == 3
    assert_every_rank_exactly_once(sink, "rl")


def run_bounded(env, args, timeout):
    """`wbmerge` in its own process group, killed with the group when it overstays."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wbmerge.cli", *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"wbmerge sync still running after {timeout} s") from None
    return proc.returncode, out, err


def local_env(tmp_path, **more):
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        **more,
    }


def test_unreachable_server_fails_within_seconds_naming_the_url(tmp_path):
    env = local_env(
        tmp_path, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="local-" + "0" * 40
    )
    code, _, err = run_bounded(env, sync_args("x"), timeout=30)
    assert code == 1
    [line] = err.strip().splitlines()
    assert line.startswith("wbmerge: error: cannot reach W&B at http://127.0.0.1:9/graphql")


@pytest.mark.parametrize("key", ["short-key", "f" * 40], ids=["short", "not the sink's"])
def test_refused_key_fails_within_seconds(make_sink, tmp_path, key):
    sink = make_sink()
    env = local_env(tmp_path, WANDB_BASE_URL=sink.url, WANDB_API_KEY=key)
    code, _, err = run_bounded(env, sync_args("x"), timeout=30)
    assert code == 1
    assert f"{sink.url}/graphql refused the API key (HTTP 401)" in err


def test_a_fault_that_never_clears_ends_at_the_timeout(make_sink, tmp_path):
    sink = make_sink(["graphql:UpsertBucket=500@2+"])  # (wandb-core's: after the claim)
    env = {**local_env(tmp_path), **sink.env}
    code, _, err = run_bounded(env, sync_args("never", "--timeout", "8"), timeout=60)
    assert code == 1
    assert "no progress for 8 s, upload stopped; complete: none" in err


def test_already_synced_shows_the_real_link(sink, tmp_path):
    args = ["sync", "--json", str(job_dir("one_node_4")), "-p", "link"]  # no entity given
    assert cli(sink, tmp_path, *args).exit_code == 0
    again = cli(sink, tmp_path, *args)
    [run] = json.loads(again.stdout)["runs"]
    assert run == {
        "id": "fx-one-node-4",
        "group": None,
        "status": "already synced",
        "url": f"{sink.url}/local/link/runs/fx-one-node-4",
    }


def test_another_merge_under_the_same_id_is_refused_not_mixed_in(sink, tmp_path):
    args = sync_args("mix", "--run-mode", "shared")
    assert cli(sink, tmp_path, *args).exit_code == 0
    before = sink.client.run("local", "mix", "fx-one-node-4")
    other = cli(sink, tmp_path, *args, "--key-format", "{label}/{key}")
    assert other.exit_code == 1
    assert "run fx-one-node-4: the server's row 30 differs from the staged row 30" in other.stderr
    assert sink.client.run("local", "mix", "fx-one-node-4")["history"] == before["history"]
    # A rerun would refuse the run again: the way out is another id, not a rerun.
    assert "rerun" not in other.stderr and "--base-id ID" in other.stderr
    again = cli(sink, tmp_path, *args, "--key-format", "{label}/{key}", "--base-id", "mix-2")
    assert again.exit_code == 0, again.stderr
    assert sink.client.run("local", "mix", "mix-2")["history"] != before["history"]


def test_a_refused_merged_run_points_at_merging_again(sink, tmp_path):
    # Merged runs keep the id their merge gave them: --base-id belongs to `merge`.
    assert cli(sink, tmp_path, *sync_args("merged", "--run-mode", "shared")).exit_code == 0
    out = tmp_path / "auto"
    merged = cli(
        sink, tmp_path, "merge", str(job_dir("one_node_4")), "--run-mode", "auto", "--out", str(out)
    )
    assert merged.exit_code == 0, merged.stderr
    refused = cli(sink, tmp_path, *sync_args("merged", source=out))
    assert refused.exit_code == 1
    assert "(merge them again with --base-id ID)" in refused.stderr


def test_force_checks_with_the_server_and_sends_no_duplicates(sink, tmp_path):
    assert cli(sink, tmp_path, *sync_args("force")).exit_code == 0
    forced = cli(sink, tmp_path, *sync_args("force", "--force"))
    assert forced.exit_code == 0, forced.stderr
    assert_exactly_once(sink.client.run("local", "force", "fx-one-node-4"), primary_expected())


def test_force_sends_nothing_to_runs_the_server_still_holds_whole(make_sink, tmp_path):
    """`--force` of runs this ledger verified: the server still holds them whole, so they are
    verified again without a request that changes them, and their summaries keep `_step`
    (an upload that sent no row would lose it: wandb-core takes the summary's `_step` only
    from the rows it sends). A server that cannot list the run's files gets them sent
    again, no row twice."""
    sink = make_sink(allow_faults=True)
    args = sync_args("whole", "--run-mode", "new")
    assert cli(sink, tmp_path, *args).exit_code == 0
    ids = [f"fx-one-node-4-rank-{rank}" for rank in range(4)]
    before = {run_id: sink.client.run("local", "whole", run_id) for run_id in ids}
    assert all(run["summary"]["_step"] == run["history"][-1]["_step"] for run in before.values())
    forced = cli(sink, tmp_path, *args, "--force")
    assert forced.exit_code == 0, forced.stderr
    assert {r["status"] for r in json.loads(forced.stdout)["runs"]} == {"already complete"}
    for run_id in ids:
        assert f"verified {run_id}: 30 rows, all on the server already (" in forced.stderr
        assert content_of(sink.client.run("local", "whole", run_id)) == content_of(before[run_id])
    sink.client.set_faults(["graphql:RunFiles=500"])
    unlisted = cli(sink, tmp_path, *args, "--force")
    assert unlisted.exit_code == 0, unlisted.stderr
    sink.client.set_faults([])
    assert {r["status"] for r in json.loads(unlisted.stdout)["runs"]} == {"uploaded"}
    assert_every_rank_exactly_once(sink, "whole")


@pytest.mark.parametrize(
    "made, older",
    [
        (None, None),
        ("wandb-summary.json", lambda text: json.dumps({**json.loads(text), "_step": 19})),
        ("config.yaml", lambda text: text.replace("value: 0.05", "value: 0.01")),
        ("output.log", lambda text: "".join(text.splitlines(keepends=True)[:-1])),
        ("output.log", lambda text: text.replace("loss", "LOSS")),  # (as many lines, bytes)
        ("requirements.txt", lambda text: ("#" if text[0] != "#" else "!") + text[1:]),
    ],
)
def test_a_sync_without_the_ledger_reads_back_the_files_wandb_made(sink, tmp_path, made, older):
    """A sync whose ledger never verified the runs (a Flyte retry in a fresh container, a
    kill before the check) finds them whole from the server alone, the files wandb-core
    made read back, and sends nothing: their summaries keep `_step`. A run whose made file
    is another upload's, or one of its own files another version of the same size (here:
    edited on the server as that upload would leave it), is sent again, no row twice."""
    args = sync_args("readback", "--run-mode", "new")
    assert cli(sink, tmp_path, *args).exit_code == 0
    ids = [f"fx-one-node-4-rank-{rank}" for rank in range(4)]
    before = {run_id: sink.client.run("local", "readback", run_id) for run_id in ids}
    if made is not None:
        stored = sink.data_dir / "files" / "local" / "readback" / ids[1] / made
        stored.write_text(older(stored.read_text()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fresh = cli(sink, elsewhere, *args)
    assert fresh.exit_code == 0, fresh.stderr
    statuses = {r["id"]: r["status"] for r in json.loads(fresh.stdout)["runs"]}
    sent = [ids[1]] if made is not None else []
    assert statuses == {i: "uploaded" if i in sent else "already complete" for i in ids}
    for run_id in ids:
        if run_id not in sent:
            assert content_of(sink.client.run("local", "readback", run_id)) == content_of(
                before[run_id]
            )
            assert before[run_id]["summary"]["_step"] == 29
    assert_every_rank_exactly_once(sink, "readback")


# (edits the sink's database directly: the W&B-like sink's late summary never sees that)
@pytest.mark.ideal_sink
def test_force_sends_runs_whose_summary_or_config_changed_on_the_server(sink, tmp_path):
    """Someone edited runs on the server after a verified sync (here: the sink's own
    database, as an edit in W&B's UI would): `--force` finds them no longer whole and sends
    them, which puts the summary keys and the config back, no row twice; the others are
    left as they are."""
    args = sync_args("edited", "--run-mode", "new")
    assert cli(sink, tmp_path, *args).exit_code == 0
    before = {
        r["id"]: sink.client.run("local", "edited", r["id"])
        for r in sink.client.runs(project="edited")
    }
    edits = {"summary": "{}", "config": "{}"}
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        for (column, value), run_id in zip(edits.items(), sorted(before), strict=False):
            db.execute(
                f"UPDATE runs SET {column} = ? WHERE project = 'edited' AND name = ?",
                (value, run_id),
            )
    forced = cli(sink, tmp_path, *args, "--force")
    assert forced.exit_code == 0, forced.stderr
    statuses = {r["id"]: r["status"] for r in json.loads(forced.stdout)["runs"]}
    edited = sorted(before)[: len(edits)]
    assert statuses == {
        run_id: "uploaded" if run_id in edited else "already complete" for run_id in before
    }
    for run_id, run in before.items():
        now = sink.client.run("local", "edited", run_id)
        assert {k: v for k, v in now["summary"].items() if not k.startswith("_")} == {
            k: v for k, v in run["summary"].items() if not k.startswith("_")
        }
        assert (now["config"], now["history"]) == (run["config"], run["history"])


def test_a_rerun_that_gives_the_runs_another_job_type_sends_them(sink, tmp_path):
    """A sync with another --job-type is another upload (not "already synced"), and the
    server holds every row but not that job type (not "already complete"): the run is sent
    again, so its job type changes, and no row arrives twice. That upload sends the last
    row again, over itself, so that the summary keeps its `_step` (wandb-core sets it only
    from rows it sends): no warning, as after the first."""
    first = cli(sink, tmp_path, *sync_args("retyped"))
    assert first.exit_code == 0 and "warning" not in first.stderr, first.stderr
    assert sink.client.run("local", "retyped", "fx-one-node-4")["summary"]["_step"] == 29
    again = cli(sink, tmp_path, *sync_args("retyped", "--job-type", "evaluation"))
    assert again.exit_code == 0, again.stderr
    assert [r["status"] for r in json.loads(again.stdout)["runs"]] == ["uploaded"]
    got = sink.client.run("local", "retyped", "fx-one-node-4")
    assert got["job_type"] == "evaluation"
    assert_exactly_once(got, primary_expected())
    assert got["summary"]["_step"] == 29
    assert "warning" not in again.stderr, again.stderr


# -- processes: signals, kills, concurrency, cwd -------------------------------------------


def spawn(sink, tmp_path, args, cwd=None):
    """`wbmerge sync` in a process of its own, its staging under the test's own TMPDIR, with
    a HOME of the test's own (where wandb would put its logs)."""
    env = {
        **sink.env,
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "TMPDIR": str(tmp_path / "tmp"),
        "HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    env.pop("XDG_CACHE_HOME", None)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "wbmerge.cli", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is under `directory` (the uploader's is staging)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if str(proc.joinpath("cwd").readlink()).startswith(str(directory)):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def long_job(tmp_path_factory):
    """One rank with 6000 rows of 100 metrics (~50 MB): wandb-core sends history in requests
    of up to 10 MiB, so this run takes three, and a kill can land between them."""
    root = tmp_path_factory.mktemp("long")
    [log] = synthetic.write_job(root, 1, 1, 6000, metrics=100, job_id="long")
    return root, expected_from_log(log)


def history_count(sink, project, run_id):
    """The history rows the sink counts for a run, asked as wandb-core asks it: reading the
    rows themselves took up to 5.6 s for 6,000 rows of 100 metrics on a loaded machine, and
    the rerun after an interruption must start within the 5 s it waits for the stopped
    upload's last requests (`settle`), or it has nothing left to wait for."""
    answer = sink.client.graphql(
        RUN_RESUME_STATUS, {"project": project, "entity": "local", "name": run_id}
    )
    bucket = (answer.get("data") or {}).get("model", {}) or {}
    return (bucket.get("bucket") or {}).get("historyLineCount") or 0


def wait_for_rows(sink, project, run_id, deadline=60):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            if history_count(sink, project, run_id):
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise AssertionError("no rows arrived")


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)]
)
def test_interrupted_upload_then_rerun_is_exactly_once(
    make_sink, tmp_path, long_job, sig, code, monkeypatch
):
    source, want = long_job
    sink = make_sink(["file_stream=delay:1"])  # a second per request: time to be caught
    before = tree_digest(source)
    proc = spawn(sink, tmp_path, sync_args("sig", source=source))
    try:
        wait_for_rows(sink, "sig", "long")
        signalled = time.time()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, proc.stderr.read()
    if sig != signal.SIGKILL:  # (staging removed, and with it wandb's temp directories)
        assert list((tmp_path / "tmp").rglob("*")) == [
            tmp_path / "tmp" / f"wbmerge-{os.getuid()}"
        ], "nothing left in the temp dir"
        assert processes_in(tmp_path / "tmp") == [], "the uploader and wandb-core are stopped"
        # The stop is noted, so that a rerun reads no counts while its last requests land
        # (whether the rerun still has to wait depends on how long it takes to start).
        monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state"))
        assert last_stop() >= signalled
    assert 0 < history_count(sink, "sig", "long") < 6000 or sig == signal.SIGKILL  # halfway
    sink.client.set_faults([])
    rerun = spawn(sink, tmp_path, sync_args("sig", source=source))
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    assert err.count("for the last requests of a stopped upload to land") <= 1  # (said once)
    assert list((tmp_path / "tmp").rglob("*")) == [tmp_path / "tmp" / f"wbmerge-{os.getuid()}"], (
        "stale staging removed, nothing else left"
    )
    assert list((tmp_path / "home").iterdir()) == [], "wandb's logs stayed in staging"
    assert processes_in(tmp_path / "tmp") == []
    assert_exactly_once(sink.client.run("local", "sig", "long"), want)
    assert tree_digest(source) == before


def test_a_sync_that_waited_for_a_killed_sync_stops_its_uploader_first(
    make_sink, tmp_path, long_job
):
    """A second sync of the same run waits for the first one's lock. SIGKILL frees the lock
    while the first sync's uploader goes on sending: the second stops it (and removes its
    staging) before it reads any count, although the first was alive when it started."""
    source, want = long_job
    sink = make_sink(["file_stream=delay:1"])
    first = spawn(sink, tmp_path, sync_args("wait", source=source))
    second = None
    try:
        wait_for_rows(sink, "wait", "long")
        second = spawn(sink, tmp_path, sync_args("wait", source=source))
        said = second.stderr.readline()  # (it says so before anything else)
        assert "another sync is uploading run long; waiting for it" in said, said
        first.kill()
        first.wait(timeout=30)
        out, err = second.communicate(timeout=180)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*")), (
        "the killed sync's staging"
    )
    assert processes_in(tmp_path / "tmp") == []
    assert second.returncode == 0, err
    assert_exactly_once(sink.client.run("local", "wait", "long"), want)


def test_concurrent_syncs_deliver_exactly_once(make_sink, tmp_path, long_job):
    source, want = long_job
    sink = make_sink()
    procs = [spawn(sink, tmp_path, sync_args("both", source=source)) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    statuses = sorted(json.loads(out)["runs"][0]["status"] for out, _ in results)
    assert statuses == ["already synced", "uploaded"]
    assert_exactly_once(sink.client.run("local", "both", "long"), want)


def test_the_users_cwd_and_the_sources_stay_untouched(sink, tmp_path):
    import shutil

    job = tmp_path / "job"
    shutil.copytree(job_dir("one_node_4") / "wandb", job / "wandb")
    before = tree_digest(job)
    proc = spawn(sink, tmp_path, sync_args("cwd", source="./wandb"), cwd=job)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert tree_digest(job) == before

"""`wbmerge verify` end to end: real fixtures synced into the sink by wbmerge and by plain
`wandb sync`, then checked read-only; the sink then loses a row, a file or an artifact
file inside its own store, as a server incident does, and verify names what is missing."""

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
from wbmerge.sink import LikeWandb
from wbmerge.training import RankInfo

from ..conftest import interruptible, job_dir
from ..support.ranklogs import config_record, exit_record, history_record, rank_log
from ..support.sinktools import copy_runs, wandb_sync
from ..verify.test_row_verification import drop_history_lines

pytestmark = pytest.mark.e2e


def cli(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(main, [*map(str, args)], env=env)


def verify(sink, tmp_path, *args):
    """`wbmerge verify --json`: its exit code, its report and its stderr lines but the one
    that says it waits for counts that lag (`LATE`)."""
    result = cli(sink, tmp_path, "verify", "--json", *args)
    report = json.loads(result.stdout) if result.stdout.strip() else None
    lines = [line for line in result.stderr.strip().splitlines() if line != LATE]
    return result.exit_code, report, lines


LATE = (
    "wbmerge: the server's line counts or last row fall short of what was sent; W&B fills "
    "them in some seconds after the rows: asking again for up to 10 s"
)


def server_state(sink) -> list:
    """Everything the sink holds of runs and lines: verify must leave it as it was."""
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        runs = db.execute("SELECT * FROM runs ORDER BY pk").fetchall()
        files = db.execute("SELECT * FROM files ORDER BY run, name").fetchall()
        counts = db.execute(
            "SELECT run, stream, count(*) FROM lines GROUP BY run, stream"
        ).fetchall()
    db.close()
    return [runs, files, counts]


def problems_by_run(report) -> dict[str, list[str]]:
    return {run["run_id"]: run["problems"] for run in report["runs"]}


@pytest.mark.parametrize("mode", ["shared", "new"])
def test_runs_wbmerge_synced_are_whole_until_the_server_loses_a_row(sink, tmp_path, mode):
    source = job_dir("one_node_4")
    base = f"audit-{mode}"
    synced = cli(sink, tmp_path, "sync", source, "--run-mode", mode, "--base-id", base)
    assert synced.exit_code == 0, synced.output

    before = server_state(sink)
    code, report, errors = verify(sink, tmp_path, source, "--run-mode", mode, "--base-id", base)
    assert (code, errors) == (0, []), errors
    expected_ids = {base} if mode == "shared" else {f"{base}-rank-{r}" for r in range(4)}
    assert {run["run_id"] for run in report["runs"]} == expected_ids
    assert report["whole"] and all(run["whole"] for run in report["runs"])
    assert server_state(sink) == before, "verify wrote to the server"

    victim = sorted(expected_ids)[-1]
    drop_history_lines(sink, victim, range(3, 5))
    code, report, errors = verify(sink, tmp_path, source, "--run-mode", mode, "--base-id", base)
    assert code == 1
    assert errors == [
        f"wbmerge: error: 1 of {len(expected_ids)} runs are not whole on the server as these "
        "options make them (give the options the runs were synced with, such as "
        "--skew-metrics); `wbmerge sync --resend` with them sends the runs whole again over "
        f"what the server holds, which mends {victim}"
    ]
    problems = problems_by_run(report)
    assert [run_id for run_id, lines in problems.items() if lines] == [victim]
    assert "lacks 2 of" in problems[victim][0], problems[victim]


def test_runs_plain_wandb_synced_are_checked_under_their_own_ids(sink, tmp_path):
    source = copy_runs(job_dir("plain_labels"), tmp_path / "plain")
    runs = sorted((source / "wandb").glob("offline-run-*"))
    uploaded = wandb_sync(sink, runs, "--project", "plain-audit", cwd=tmp_path)
    assert uploaded.returncode == 0, uploaded.stderr
    ids = {run.name.rsplit("-", 1)[-1] for run in runs}

    code, report, errors = verify(
        sink, tmp_path, source, "--uploaded-by", "wandb", "-p", "plain-audit"
    )
    assert (code, errors) == (0, []), (errors, report)
    assert {run["run_id"] for run in report["runs"]} == ids
    assert all(run["whole"] for run in report["runs"])

    # The same runs are not what a wbmerge sync would have made: no such runs.
    code, report, _ = verify(sink, tmp_path, source, "--run-mode", "new", "-p", "plain-audit")
    assert code == 1
    assert all(run["problems"] == ["the server holds no such run"] for run in report["runs"])

    victim = sorted(ids)[0]
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        [pk] = db.execute("SELECT pk FROM runs WHERE name = ?", (victim,)).fetchone()
        gone = db.execute("DELETE FROM files WHERE run = ? AND name = 'output.log'", (pk,))
        assert gone.rowcount == 1
    db.close()
    code, report, errors = verify(
        sink, tmp_path, source, "--uploaded-by", "wandb", "-p", "plain-audit"
    )
    assert code == 1
    # (not "`wbmerge sync` with the same options": sync takes no --uploaded-by)
    assert errors == [
        f"wbmerge: error: 1 of {len(ids)} runs are not whole on the server (uploaded by "
        "plain `wandb sync`; each run's line says what it lacks)"
    ]
    problems = problems_by_run(report)
    assert [run_id for run_id, lines in problems.items() if lines] == [victim]
    assert "output.log" in "; ".join(problems[victim])


def test_options_that_plain_wandb_sync_has_no_use_for_are_refused(sink, tmp_path):
    for extra in (["--run-mode", "shared"], ["--base-id", "x"], ["--rank-scope", "worker"]):
        result = cli(
            sink, tmp_path, "verify", job_dir("plain_labels"), "--uploaded-by", "wandb", *extra
        )
        assert result.exit_code == 2
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"wbmerge: error: {extra[0]} does not apply to --uploaded-by wandb")


def test_merged_runs_plain_wandb_synced_are_checked_as_they_were_merged(sink, tmp_path):
    # docs/sync.md: a `merge --out` directory is ordinary offline runs, plain `wandb sync`
    # takes them too; verify must check them, not refuse an option the user never gave.
    out = tmp_path / "merged"
    merged = cli(
        sink,
        tmp_path,
        "merge",
        job_dir("two_nodes_2x2"),
        "--run-mode",
        "new",
        "--base-id",
        "mw",
        "--out",
        out,
    )
    assert merged.exit_code == 0, merged.output
    runs = sorted(out.glob("offline-run-*"))
    uploaded = wandb_sync(sink, runs, "--project", "merged-audit", cwd=tmp_path)
    assert uploaded.returncode == 0, uploaded.stderr
    expected_ids = {f"mw-rank-{r}" for r in range(4)}

    code, report, errors = verify(
        sink, tmp_path, out, "--uploaded-by", "wandb", "-p", "merged-audit"
    )
    assert (code, errors) == (0, []), (errors, report)
    assert {run["run_id"] for run in report["runs"]} == expected_ids
    assert all(run["whole"] for run in report["runs"])

    drop_history_lines(sink, "mw-rank-2", range(0, 1))
    code, report, _ = verify(sink, tmp_path, out, "--uploaded-by", "wandb", "-p", "merged-audit")
    assert code == 1
    problems = problems_by_run(report)
    assert [run_id for run_id, lines in problems.items() if lines] == ["mw-rank-2"]
    assert "lacks 1 of" in problems["mw-rank-2"][0], problems["mw-rank-2"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_verify_stopped_while_it_checks_leaves_no_staging(make_sink, tmp_path, sig, code):
    # Each question to the server takes a second: verify is caught with a run staged.
    sink = make_sink(["graphql=delay:1"])
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        **sink.env,
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "TMPDIR": str(temp),
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    args = ["verify", str(job_dir("one_node_4")), "--run-mode", "new", "-p", "stopped"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "wbmerge.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(temp.glob("*/wbmerge-staging-*/job-0/offline-run-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no run was staged"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, stderr
    assert list(temp.rglob("*")) == [temp / f"wbmerge-{os.getuid()}"], "staging was left"


def test_runs_plain_wandb_synced_are_checked_without_every_rank(sink, tmp_path):
    # Plain `wandb sync` uploads each offline run alone: a rank whose run is not under the
    # paths (synced from elsewhere, or never written) is no reason to refuse the others.
    source = copy_runs(job_dir("plain_labels"), tmp_path / "plain")
    runs = sorted((source / "wandb").glob("offline-run-*"))
    uploaded = wandb_sync(sink, runs, "--project", "some-ranks", cwd=tmp_path)
    assert uploaded.returncode == 0, uploaded.stderr
    gone = max(runs, key=lambda run: run.name)
    shutil.rmtree(gone)
    kept = {run.name.rsplit("-", 1)[-1] for run in runs if run != gone}

    code, report, errors = verify(
        sink, tmp_path, source, "--uploaded-by", "wandb", "-p", "some-ranks"
    )
    assert (code, errors) == (0, []), (errors, report)
    assert {run["run_id"] for run in report["runs"]} == kept
    assert all(run["whole"] for run in report["runs"])


def test_counts_that_lag_are_waited_for_and_said(make_sink, tmp_path):
    # W&B counts a run's lines seconds after they arrive: a verify right after plain
    # `wandb sync` (which waits for nothing) first sees no rows, and must not call the runs
    # broken for it. Before the wait, every run failed with "history rows 0 of 15".
    sink = make_sink(like=LikeWandb(lag=3.0))
    source = copy_runs(job_dir("plain_labels"), tmp_path / "plain")
    runs = sorted((source / "wandb").glob("offline-run-*"))
    uploaded = wandb_sync(sink, runs, "--project", "lagging", cwd=tmp_path)
    assert uploaded.returncode == 0, uploaded.stderr

    args = ("verify", "--json", source, "--uploaded-by", "wandb", "-p", "lagging")
    result = cli(sink, tmp_path, *args)
    assert (result.exit_code, result.stderr.splitlines()) == (0, [LATE]), result.stdout
    report = json.loads(result.stdout)
    assert len(report["runs"]) == len(runs) and report["whole"]

    # Runs the server never held are named at once: no counts are waited for.
    result = cli(sink, tmp_path, "verify", "--json", source, "--run-mode", "new", "-p", "lagging")
    assert result.exit_code == 1
    assert LATE not in result.stderr
    report = json.loads(result.stdout)
    assert all(run["problems"] == ["the server holds no such run"] for run in report["runs"])


def two_ranks_of_lr(root: Path, rank_1_lr: float) -> None:
    """A finished job of two ranks that log the same rows; rank 0 sets `lr` 0.1, rank 1
    sets `rank_1_lr` (written anew over any earlier version of the job)."""
    shutil.rmtree(root / "wandb", ignore_errors=True)
    for rank, lr in ((0, 0.1), (1, rank_1_lr)):
        info = RankInfo(rank, rank, 2, 2, 0, job_id="relabelled")
        with rank_log(root, info, f"relabelled-{rank}", "p") as writer:
            writer.write(config_record({"lr": lr}))
            for step in range(4):
                writer.write(history_record([("loss", str(step + rank))], step))
            writer.write(exit_record(0))


def test_a_shared_run_whose_server_config_holds_a_labelled_key_the_files_dropped_is_whole(
    sink, tmp_path
):
    """A shared run's labelled config keys come and go as the ranks log: a sync sent
    rank 1's own `lr`, and a later merge finds it the primary's, so it labels none. The
    server keeps the key once sent, and the check after each upload does not count it
    against the run; neither may `verify` or `sync --force`, or they would call the run
    not whole, and send it again, every time; nor may `sync --resend` refuse the run."""
    job = tmp_path / "job"
    args = [job, "--run-mode", "shared", "-p", "p", "-e", "local"]
    two_ranks_of_lr(job, 0.2)
    assert cli(sink, tmp_path, "sync", *args).exit_code == 0
    [run] = sink.client.runs(project="p")
    held = sink.client.run("local", "p", run["id"])["config"]
    labelled = [key for key in held if key.startswith("lr/")]
    assert labelled and held["lr"] == 0.1, held  # (rank 1's own value, under its label)

    two_ranks_of_lr(job, 0.1)
    again = cli(sink, tmp_path, "sync", *args)
    assert again.exit_code == 0, again.output
    assert set(labelled) <= set(sink.client.run("local", "p", run["id"])["config"])

    code, report, errors = verify(sink, tmp_path, *args)
    assert (code, errors, problems_by_run(report)) == (0, [], {run["id"]: []})
    forced = cli(sink, tmp_path, "sync", *args, "--force", "--json")
    assert forced.exit_code == 0, forced.output
    assert [r["status"] for r in json.loads(forced.stdout)["runs"]] == ["already complete"]
    # nor is the key a reason to refuse sending the run again whole: it would pass after
    resent = cli(sink, tmp_path, "sync", *args, "--resend", "--json")
    assert resent.exit_code == 0, resent.output
    assert [r["status"] for r in json.loads(resent.stdout)["runs"]] == ["uploaded"]
    assert verify(sink, tmp_path, *args)[:2] == (0, report)

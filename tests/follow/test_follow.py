"""`sync --follow` on runs that grow between rounds: every run_mode x rank_scope.

Real runs (the fixtures, written by wandb 0.31) are copied into a live directory a slice at
a time, cut at arbitrary bytes (mid-record), as a rank's file grows while it trains. After
each round the sink must hold runs that are still running and whose rows are the first rows
of what a one-shot sync of the whole runs gives; at the end, the same runs as that sync:
rows, summary, config, console, system metrics, files, state and exit code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from wbmerge.follow import Follower, follow, round_lines
from wbmerge.follow.cut import LiveCut, cut_live
from wbmerge.identify import discover
from wbmerge.log import read_records
from wbmerge.sync import MergeRequest, UploadFailed, sync
from wbmerge.training import RankInfo
from wbmerge.upload import ServerClient

from ..conftest import interruptible, job_dir
from ..merge.test_rank_stats_merge import over_the_bound
from ..support.ranklogs import console_record, exit_record, history_record, rank_log, summary_record
from ..support.sinktools import console_text
from ..verify.test_row_verification import drop_history_lines

UPLOAD_TIMEOUT = 120.0


class GrowingJob:
    """A fixture job's runs appearing in `live` a slice at a time, as they would in training."""

    def __init__(self, fixture: Path, live: Path) -> None:
        self.logs = sorted(fixture.glob("wandb/offline-run-*/run-*.wandb"))
        self.live = live

    def grow(self, fraction: float, only: set[str] | None = None) -> None:
        for log in self.logs:
            if only is not None and log.parent.name not in only:
                continue
            dest = self.live / log.parent.name / log.name
            if not dest.parent.exists():
                shutil.copytree(log.parent, dest.parent, ignore=shutil.ignore_patterns("*.wandb"))
            data = log.read_bytes()
            have = dest.stat().st_size if dest.exists() else 0
            want = max(have, int(len(data) * fraction))
            if want > have or not dest.exists():
                with open(dest, "ab") as out:
                    out.write(data[have:want])


def sink_runs(sink) -> dict[str, dict]:
    client = sink.client
    return {r["id"]: client.run(r["entity"], r["project"], r["id"]) for r in client.runs()}


def use_sink(monkeypatch, sink) -> None:
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    for key, value in sink.env.items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)


def one_shot(monkeypatch, make_sink, fixture: Path, request: MergeRequest, tmp_path) -> dict:
    """What `wbmerge sync` of the whole runs, with the options of `request`, puts on a fresh
    sink."""
    sink = make_sink()
    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "one-shot-state"))
    whole = dataclasses.replace(request, paths=[fixture])  # (the same options)
    sync(whole, timeout=UPLOAD_TIMEOUT)
    return sink_runs(sink)


def follow_sink(make_sink, monkeypatch, state: Path):
    """A fresh sink that wandb and wbmerge (with the ledger in `state`) now point at."""
    sink = make_sink()
    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))
    return sink


def assert_same_runs(sink, want: dict) -> None:
    """The sink holds the runs of `want` (a one-shot sync's), each the same."""
    got = sink_runs(sink)
    assert sorted(got) == sorted(want)
    for run_id, run in got.items():
        assert_same_run(run, want[run_id])


def assert_same_run(got: dict, want: dict) -> None:
    assert got["history"] == want["history"]
    assert got["summary"] == want["summary"]
    assert got["config"] == want["config"]
    assert console_text(got["console"]) == console_text(want["console"])
    assert [_no_time(r) for r in got["system_metrics"]] == [
        _no_time(r) for r in want["system_metrics"]
    ]
    assert got["files"] == want["files"]
    assert (got["state"], got["exit_code"]) == (want["state"], want["exit_code"])
    assert (got["group"], got["display_name"]) == (want["group"], want["display_name"])


def _no_time(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("_runtime", "_wandb")}


MODES = [(m, s) for m in ("auto", "shared", "new") for s in ("global", "worker")]


@pytest.mark.parametrize(("run_mode", "rank_scope"), MODES)
def test_follow_rounds_end_as_one_sync(
    run_mode, rank_scope, make_sink, monkeypatch, tmp_path, state
):
    fixture = job_dir("two_nodes_2x2")
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode, rank_scope=rank_scope)
    want = one_shot(monkeypatch, make_sink, fixture, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    job = GrowingJob(fixture, tmp_path / "live")
    (tmp_path / "live").mkdir()
    seen: list[dict] = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        assert round_lines(follower.round())[0] == "round 1: no runs yet"
        for fraction in (0.0003, 0.35, 0.7):  # a header alone, then cut mid-record
            job.grow(fraction)
            report = follower.round()
            assert not report.done
            assert all(t.status != "failed" for t in report.targets), round_lines(report)
            seen.append(sink_runs(sink))
        job.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
        assert follower.round().done  # nothing changed: nothing sent again
    assert_same_runs(sink, want)
    grew = [len(snapshot[run_id]["history"]) for snapshot in seen for run_id in snapshot]
    assert max(grew) > 0
    for snapshot in seen:  # while training: running, and the first rows of the final run
        for run_id, run in snapshot.items():
            assert (run["state"], run["exit_code"]) == ("running", None)
            rows = run["history"]
            assert rows == want[run_id]["history"][: len(rows)]
    # A one-shot sync afterwards finds every run synced by the follow.
    again = sync(request, timeout=UPLOAD_TIMEOUT)
    assert {t.status for t in again.targets} == {"already synced"}


def test_follow_waits_for_a_late_rank_and_ends_idle_on_a_killed_one(
    make_sink, monkeypatch, tmp_path, state
):
    """Rank 2 of `killed_rank` was killed mid-run (no exit record, the others failed); the
    follow holds the shared rows back while rank 1 has not started, and ends after the idle
    timeout with the one-shot sync's result, naming the rank that never finished."""
    fixture = job_dir("killed_rank")
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    want = one_shot(monkeypatch, make_sink, fixture, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    job = GrowingJob(fixture, tmp_path / "live")
    late = next(r.run_dir.name for r in discover([fixture]) if r.rank.rank == 1)
    early = {log.parent.name for log in job.logs} - {late}
    job.grow(0.5, only=early)
    with Follower(request, timeout=UPLOAD_TIMEOUT) as follower:
        report = follower.round()
        (target,) = report.targets
        assert (target.status, target.rows) == ("sent", 0)  # rank 2 holds every row back
        job.grow(0.5)
        report = follower.round()
        assert report.targets[0].rows > 0
    job.grow(1.0)
    lines: list[str] = []
    result = follow(
        request,
        interval=0.2,
        idle_timeout=1.0,
        timeout=UPLOAD_TIMEOUT,
        on_round=lambda r: lines.extend(round_lines(r)),
    )
    assert result.unfinished == ["job fx-killed-rank: rank(s) 2"]
    assert_same_runs(sink, want)
    # (the run is synced whole: the merge the rounds saved is removed with it)
    assert list(state.glob("follow/*/*")) == []


def test_ctrl_c_leaves_the_runs_running_and_a_later_sync_completes_them(
    make_sink, monkeypatch, tmp_path, state
):
    """SIGINT between rounds: exit 130 with one line, no staging or uploader left behind,
    the run still running with the rows sent so far; `wbmerge sync` of the finished files
    then gives the one-shot result."""
    fixture = job_dir("one_node_4")
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    want = one_shot(monkeypatch, make_sink, fixture, request, tmp_path)
    sink = make_sink()
    job = GrowingJob(fixture, tmp_path / "live")
    job.grow(0.6)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state), "TMPDIR": str(scratch)}
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        "sync",
        str(tmp_path / "live"),
        "--run-mode",
        "shared",
        "--follow",
        "--interval",
        "60",
    ]
    follower = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # the first round's line: then it sleeps
        assert "running" in first, first
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=30)
    assert follower.returncode == 130
    assert err.strip().splitlines()[-1].startswith("wbmerge: interrupted; the runs keep")
    assert list(scratch.glob("wbmerge-*/wbmerge-staging-*")) == []  # its staging is gone
    (run,) = sink_runs(sink).values()
    assert run["state"] == "running" and 0 < len(run["history"]) < len(want[run["id"]]["history"])
    job.grow(1.0)
    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))
    sync(request, timeout=UPLOAD_TIMEOUT)
    (run,) = sink_runs(sink).values()
    assert_same_run(run, want[run["id"]])


def test_a_run_over_the_metric_bound_is_named_once_while_it_grows(
    make_sink, monkeypatch, tmp_path, state
):
    """The line a one-shot sync gives a run past W&B's 10,000 metrics, said by the follower
    in the first round that stages it so (once, though the run is staged again)."""
    fixture = over_the_bound(tmp_path / "wide")
    sink = follow_sink(make_sink, monkeypatch, state)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    job = GrowingJob(fixture, tmp_path / "live")
    notices = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        for fraction in (0.8, 1.0):
            job.grow(fraction)
            report = follower.round()
            notices.append([w for w in report.warnings if "distinct metrics" in w])
        assert report.done, round_lines(report)
    assert sum(map(len, notices)) == 1, notices
    [notice] = [line for lines in notices for line in lines]
    assert notice.startswith("run wide has 10,") and "--per-rank none" in notice
    [run] = sink_runs(sink).values()
    assert run["id"] == "wide" and len(run["history"][0]) > 10_000


def test_a_run_synced_before_the_follow_is_final_with_its_exit_code(
    make_sink, monkeypatch, tmp_path, state
):
    """A run the ledger holds already is reported as the one-shot sync left it: final, with
    the exit code of its exit record (3), not without one."""
    root = tmp_path / "job"
    with rank_log(root, RankInfo(0, 0, 1, 1, 0, job_id="three"), "three-0", "p") as writer:
        for step in range(3):
            writer.write(history_record([("loss", str(step))], step))
        writer.write(exit_record(3))
    sink = make_sink()
    use_sink(monkeypatch, sink)
    request = MergeRequest(paths=[root], run_mode="new")
    sync(request, timeout=UPLOAD_TIMEOUT)
    assert sink.client.run("local", "p", "three-rank-0")["exit_code"] == 3
    with Follower(request, parallel=1, timeout=UPLOAD_TIMEOUT) as follower:
        report = follower.round()
    assert report.done
    [target] = report.targets
    assert (target.status, target.final, target.exit_code) == ("unchanged", True, 3)


@pytest.mark.parametrize("run_mode", ["shared", "new"])
def test_a_last_round_without_new_rows_keeps_the_summary_step(
    run_mode, make_sink, monkeypatch, tmp_path, state
):
    """The ranks log their last rows in one round and finish in the next (a long save at the
    end): the last round has no new row to send, yet the runs end as a one-shot sync leaves
    them, the summary's `_step` included (wandb-core takes it only from rows it sends)."""
    for root, whole in ((tmp_path / "full", True), (tmp_path / "live", False)):
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, job_id="slowsave")
            with rank_log(root, info, f"slowsave-{rank}", "p") as writer:
                for step in range(4):
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                if whole:
                    writer.write(summary_record({"loss": 10 * rank + 3, "best": rank}))
                    writer.write(exit_record(0))
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    want = one_shot(monkeypatch, make_sink, tmp_path / "full", request, tmp_path)
    assert all(run["summary"]["_step"] == 3 for run in want.values())
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        assert not follower.round().done
        for log in (tmp_path / "full").glob("wandb/*/run-*.wandb"):
            live = tmp_path / "live" / log.relative_to(tmp_path / "full")
            whole = log.read_bytes()
            assert whole.startswith(live.read_bytes())  # the rows were written already
            live.write_bytes(whole)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)


@pytest.mark.parametrize(
    "last_step, server_rows, steps",
    [
        (None, 0, [0, 1, 2, 3, 4, 5, 6, 7, 8]),  # every rank past every row: the last one waits
        (9, 0, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        (20, 5, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        (None, 9, [0, 1, 2, 3, 4, 5, 6, 7, 8]),  # the server lacks the last row: it waits
        (None, 10, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # another upload sent it: kept, to check
        (7, 0, [0, 1, 2, 3, 4, 5, 6, 7]),  # rows 8 and 9 left out: they go with the final round
        (7, 10, [0, 1, 2, 3, 4, 5, 6, 7]),  # (the server's rows past 7 wait for the ranks)
        (-1, 0, []),  # a rank not started yet
    ],
)
def test_a_live_round_keeps_a_row_for_the_final_round(tmp_path, last_step, server_rows, steps):
    with rank_log(tmp_path, RankInfo(0, 0, 1, 1, 0, job_id="cut"), "cut-0", "p") as writer:
        for step in range(10):
            writer.write(history_record([("loss", str(step))], step))
        writer.write(exit_record(0))
    [log] = tmp_path.glob("wandb/*/run-*.wandb")
    cut = cut_live(log, tmp_path / "cut.wandb", last_step, server_rows)
    kept = list(read_records(tmp_path / "cut.wandb"))
    assert [r.history.step.num for r in kept if r.HasField("history")] == steps
    assert (cut.rows_sent, cut.rows_staged) == (len(steps), 10)
    assert [r.exit.not_complete for r in kept if r.HasField("exit")] == [True]


@pytest.mark.parametrize(
    "rows_sent, rows_staged, server_rows, sent_early",
    [
        (7, 10, 9, True),  # rows past the watermark (a shared run's rows, sent too early)
        (7, 10, 10, True),
        (10, 10, 10, False),  # the server holds what the cut sends: it goes, and is checked
        (9, 10, 5, False),  # the usual round: rows to send
        (9, 10, 11, False),  # more than staged: not this run's rows, refused on upload
        (0, 0, 0, False),  # nothing yet
    ],
)
def test_a_round_waits_when_the_server_holds_rows_past_the_watermark(
    rows_sent, rows_staged, server_rows, sent_early
):
    assert LiveCut(rows_sent, rows_staged).sent_early(server_rows) is sent_early


@pytest.mark.parametrize("run_mode", ["shared", "new"])
def test_a_failed_rank_holds_the_rows_back_until_its_restart_joins(
    run_mode, make_sink, monkeypatch, tmp_path, state
):
    """Rank 1 fails at step 3 while rank 0 goes on logging; torch elastic then restarts it.
    The rows after step 3 wait for the restart's values (its rows join after the failed
    run's), and the runs end as a one-shot sync leaves them."""
    runs = {
        "r0": (0, 0, range(8), 0),
        "r1a": (1, 0, range(4), 1),
        "r1b": (1, 1, range(2, 6), 0),
    }
    for root, counts in ((tmp_path / "full", None), (tmp_path / "live", {"r1b": -1})):
        for run_id, (rank, restart, steps, code) in runs.items():
            if counts and counts.get(run_id) == -1:
                continue
            info = RankInfo(rank, rank, 2, 2, 0, restart=restart, job_id="restarted")
            with rank_log(root, info, run_id, "p") as writer:
                for step in steps:
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                writer.write(exit_record(code))
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    want = one_shot(monkeypatch, make_sink, tmp_path / "full", request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        report = follower.round()  # rank 1 failed, its restart not started yet
        assert not report.done and all(t.status != "failed" for t in report.targets)
        restart = next((tmp_path / "full").glob("wandb/*-r1b"))
        shutil.copytree(restart, tmp_path / "live" / "wandb" / restart.name)
        for _ in range(3):
            report = follower.round()
            assert all(t.status != "failed" for t in report.targets), round_lines(report)
            if report.done:
                break
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)


def test_a_job_whose_ranks_all_failed_waits_for_its_elastic_restart(
    make_sink, monkeypatch, tmp_path, state
):
    """Both ranks fail at step 3; torch elastic starts them again some seconds later. The
    follow keeps the run running through quiet rounds until the restart appears (within
    `restart_grace`), so the final run holds the restart's rows, as a one-shot sync's."""
    for root, restarts in ((tmp_path / "full", (0, 1)), (tmp_path / "live", (0,))):
        for rank in (0, 1):
            for restart in restarts:
                info = RankInfo(rank, rank, 2, 2, 0, restart=restart, job_id="elastic")
                steps, code = (range(4), 1) if restart == 0 else (range(2, 8), 0)
                with rank_log(root, info, f"r{rank}-{restart}", "p") as writer:
                    for step in steps:
                        writer.write(history_record([("loss", str(10 * rank + step))], step))
                    writer.write(exit_record(code))
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    want = one_shot(monkeypatch, make_sink, tmp_path / "full", request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT, restart_grace=3600) as follower:
        for _ in range(3):  # every rank ended, failed: quiet rounds, the run still running
            assert not follower.round().done
        assert all(run["state"] == "running" for run in sink_runs(sink).values())
        for restart in (tmp_path / "full").glob("wandb/*-1"):
            shutil.copytree(restart, tmp_path / "live" / "wandb" / restart.name)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)
    for run in sink_runs(sink).values():
        assert (run["state"], len(run["history"])) == ("finished", 10)


def lost_rows_job(tmp_path: Path, *stages: int) -> None:
    """Two ranks of job `lostrows` as they grow: at each stage's number of steps under
    `at-{steps}` (the last finished), and at the first stage's under `live`."""
    for steps in stages:
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, job_id="lostrows")
            with rank_log(tmp_path / f"at-{steps}", info, f"lostrows-{rank}", "p") as writer:
                for step in range(steps):
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                if steps == stages[-1]:
                    writer.write(exit_record(0))
    shutil.copytree(tmp_path / f"at-{stages[0]}", tmp_path / "live")


def grow_lost_rows_job(tmp_path: Path, steps: int) -> None:
    """The ranks of `lost_rows_job` go on to its stage of `steps` steps."""
    for log in (tmp_path / f"at-{steps}").glob("wandb/*/run-*.wandb"):
        live = tmp_path / "live" / log.relative_to(tmp_path / f"at-{steps}")
        whole = log.read_bytes()
        assert whole.startswith(live.read_bytes())
        live.write_bytes(whole)


def test_rows_the_server_lost_after_a_round_are_found_by_a_follower_started_again(
    make_sink, monkeypatch, tmp_path, state
):
    """A round sends and verifies rows 0-4 of two ranks; then the server loses rows 1 and 2
    (its line count still covers them). A follower started again goes on from the saved
    state: its live round reads back only its own rows, but it proved no row before, so its
    last round, after which the run is recorded synced, reads every row back: it names the
    rows lost and the run is not verified."""
    lost_rows_job(tmp_path, 6, 7, 8)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        [target] = follower.round().targets
        assert (target.status, target.rows) == ("sent", 5), target.problems
    drop_history_lines(sink, "lostrows", range(1, 3))
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        grow_lost_rows_job(tmp_path, 7)
        [target] = follower.round().targets
        assert (target.status, target.rows, target.continued) == ("sent", 6, True)
        grow_lost_rows_job(tmp_path, 8)
        report = follower.round()
    assert not report.done
    [target] = report.targets
    assert target.status == "failed"
    assert "the server lacks 2 of 8 rows sent (steps 1-2)" in target.problems[0]


def spoil_history_line(sink, run_id: str, offset: int, fault: str) -> bool:
    """Once the sink holds line `offset + 1` of a run's history: lose line `offset` (its line
    count still covers it), or change a value of it. Whether it did."""
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        [pk] = db.execute("SELECT pk FROM runs WHERE name = ?", (run_id,)).fetchone()
        where = "run = ? AND stream = 'history' AND offset = ?"
        if db.execute(f"SELECT 1 FROM lines WHERE {where}", (pk, offset + 1)).fetchone() is None:
            spoiled = False
        elif fault == "lost":
            spoiled = db.execute(f"DELETE FROM lines WHERE {where}", (pk, offset)).rowcount == 1
        else:
            [line] = db.execute(f"SELECT line FROM lines WHERE {where}", (pk, offset)).fetchone()
            row = json.loads(line)
            row["loss/rank-1"] = 99.5
            args = (json.dumps(row), pk, offset)
            spoiled = db.execute(f"UPDATE lines SET line = ? WHERE {where}", args).rowcount == 1
    db.close()
    return spoiled


@pytest.mark.parametrize("fault", ["lost", "changed"])
def test_the_last_round_reads_back_only_the_rows_it_added_and_fails_on_a_fault_in_them(
    fault, make_sink, monkeypatch, tmp_path, state
):
    """A round sends and verifies rows 0-4 of two ranks. The last round adds rows 5-7, and
    the server, once it holds them, loses row 6 (its line count still covers it) or holds
    another value in it. The last round reads back only the rows after those this follower
    read back before, yet fails naming the row, and the run is not recorded synced."""
    lost_rows_job(tmp_path, 6, 8)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    sink = follow_sink(make_sink, monkeypatch, state)
    asked: list[tuple[int, int]] = []
    spoiled: list[bool] = []
    read_page = ServerClient.history_page

    def history_page(client, entity, project, run_id, steps, most):
        if spoiled and not spoiled[-1]:
            spoiled.append(spoil_history_line(sink, "lostrows", 6, fault))
        asked.append(steps)
        return read_page(client, entity, project, run_id, steps, most)

    monkeypatch.setattr(ServerClient, "history_page", history_page)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        [target] = follower.round().targets
        assert (target.status, target.rows) == ("sent", 5), target.problems
        asked.clear()
        spoiled.append(False)
        grow_lost_rows_job(tmp_path, 8)
        report = follower.round()
    assert spoiled[-1]
    assert not report.done
    [target] = report.targets
    assert target.status == "failed"
    want = {
        "lost": "the server lacks 1 of 8 rows sent (steps 6)",
        "changed": "the row at step 6 holds 'loss/rank-1' = 99.5, sent 16",
    }
    assert target.problems[0] == want[fault]
    assert min(start for start, _ in asked) == 5  # (rows 0-4 were not asked for again)


@pytest.mark.parametrize("command", [["sync", "--follow"], ["follow"]], ids=" ".join)
def test_a_follow_of_a_path_not_there_yet_says_so_and_waits_for_it(
    command, make_sink, tmp_path, state
):
    """A follow may start before the job makes its directory (or the path is a typo): it
    says so at once, in one line, and syncs the runs once they appear there. `wbmerge
    follow` is `wbmerge sync --follow`."""
    sink = make_sink()
    live = tmp_path / "later" / "wandb"
    env = {**sink.env, "WBMERGE_STATE_DIR": str(state)}
    cmd = [
        sys.executable,
        "-m",
        "wbmerge.cli",
        command[0],
        str(live),
        "--run-mode",
        "shared",
        *command[1:],
        "--interval",
        "1",
        "--quiet",
    ]
    follower = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert follower.stderr is not None
        ready, _, _ = select.select([follower.stderr], [], [], 30)
        first = follower.stderr.readline() if ready else "(nothing said in 30 s)"
        assert first == (
            f"wbmerge: warning: {live} does not exist yet; waiting for runs to "
            "appear there (Ctrl-C stops)\n"
        )
        shutil.copytree(job_dir("one_node_4") / "wandb", live)
        out, err = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=30)
    assert follower.returncode == 0, err
    (run,) = sink_runs(sink).values()
    assert (run["state"], len(run["history"])) == ("finished", 30)


@pytest.mark.parametrize("run_mode", ["shared", "new"])
def test_a_sync_between_two_follows_leaves_the_next_one_sending_what_is_new(
    run_mode, make_sink, monkeypatch, tmp_path, state
):
    """A follow is stopped, a one-shot sync then sends every row written so far (the row a
    live round holds back too), and the follow is started again. Its rounds must go on
    sending what the ranks write (here console lines, no row) and not refuse the run for
    holding more rows than a round would stage; the runs then end as a one-shot sync of
    the whole runs leaves them."""
    for name in ("full", "more", "live"):  # (each a beginning of the next)
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, job_id="between")
            with rank_log(tmp_path / name, info, f"between-{rank}", "p") as writer:
                for step in range(4):
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                if name != "live":
                    writer.write(console_record(f"rank {rank} saving\n"))
                if name == "full":
                    for step in (4, 5):
                        writer.write(history_record([("loss", str(10 * rank + step))], step))
                    writer.write(exit_record(0))
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    want = one_shot(monkeypatch, make_sink, tmp_path / "full", request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        assert all(t.status == "sent" and t.rows == 3 for t in follower.round().targets)
    sync(request, timeout=UPLOAD_TIMEOUT)  # (the ranks have not finished: every row goes)
    assert all(len(run["history"]) == 4 for run in sink_runs(sink).values())
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        for version in ("more", "full"):
            for log in (tmp_path / version).glob("wandb/*/run-*.wandb"):
                live = tmp_path / "live" / log.relative_to(tmp_path / version)
                assert log.read_bytes().startswith(live.read_bytes())
                live.write_bytes(log.read_bytes())
            report = follower.round()
            assert all(t.status == "sent" for t in report.targets), round_lines(report)
            if version == "more":
                assert [(t.rows, t.added) for t in report.targets] == [(4, 0)] * len(want)
                got = sink_runs(sink)
                for rank in (0, 1):
                    run = got["between" if run_mode == "shared" else f"between-rank-{rank}"]
                    assert len(run["history"]) == 4  # (its state: as the one-shot sync left it)
                    assert any(f"rank {rank} saving" in line for line in run["console"])
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)


def test_rows_a_sync_sent_before_every_rank_logged_them_are_named(
    make_sink, monkeypatch, tmp_path, state
):
    """Rank 1 is two steps behind rank 0 when a one-shot sync sends the shared run: its
    rows 4 and 5 hold rank 0's values only, and the server keeps a row as first sent. The
    follow says so in its first round, and refuses the run once rank 1's values differ
    from what the server holds (rather than sending them to other rows)."""
    for name, steps in (("live", (range(6), range(4))), ("full", (range(6), range(6)))):
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, job_id="early")
            with rank_log(tmp_path / name, info, f"early-{rank}", "p") as writer:
                for step in steps[rank]:
                    writer.write(history_record([("loss", str(10 * rank + step))], step))
                if name == "full":
                    writer.write(exit_record(0))
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    sink = follow_sink(make_sink, monkeypatch, state)
    sync(request, timeout=UPLOAD_TIMEOUT)
    assert len(sink.client.run("local", "p", "early")["history"]) == 6
    with Follower(request, parallel=2, timeout=UPLOAD_TIMEOUT) as follower:
        [target] = follower.round().targets
        assert target.status == "failed"
        assert target.problems == [
            "the server holds 6 history rows, past the 4 that every rank has logged (another "
            "sync sent them during training?); they are checked once every rank has logged them"
        ]
        for log in (tmp_path / "full").glob("wandb/*/run-*.wandb"):
            shutil.copy(log, tmp_path / "live" / log.relative_to(tmp_path / "full"))
        report = follower.round()
    [target] = report.targets
    assert not report.done and target.status == "failed"
    assert target.problems[0].startswith("the server's row 6 differs from the staged row 6")
    run = sink.client.run("local", "p", "early")
    assert [row.get("loss/rank-1") for row in run["history"]][4:] == [None, None]


def last_syncs_under_fault(
    make_sink, monkeypatch, tmp_path, run_mode: str, fault: str, parallel: int = 4
) -> tuple:
    """Jobs fj-a and fj-b (`two_rank_job`: rank 1 never finishes) followed with a job prefix
    to their idle end, the sink given `fault` just before their last syncs: the sink, and
    the `UploadFailed` the follow raised."""
    for job in ("fj-a", "fj-b"):
        two_rank_job(tmp_path / "live", job)
    sink = make_sink(allow_faults=True)
    use_sink(monkeypatch, sink)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    with pytest.raises(UploadFailed) as failed:
        follow(
            request,
            interval=0.2,
            idle_timeout=1.0,
            parallel=parallel,
            timeout=UPLOAD_TIMEOUT,
            on_idle=lambda _: sink.client.set_faults([fault]),
            job_prefix="fj-",
        )
    return sink, failed.value


def test_a_failed_last_sync_still_syncs_every_job_and_says_what_it_verified(
    make_sink, monkeypatch, tmp_path, state
):
    """Two jobs end idle (rank 1 of each never finishes), and the server refuses the first
    run the last sync creates (its second UpsertBucket: the first is the sync's claim on
    it): that run fails, yet the other job's last sync runs too, and `UploadFailed` reports
    the three runs verified, each final on the server."""
    sink, failed = last_syncs_under_fault(
        make_sink, monkeypatch, tmp_path, "new", "graphql:UpsertBucket=400@2", parallel=1
    )
    statuses = {t.target.id: t.status for t in failed.report.targets}
    assert statuses == {  # (the finished ranks' runs were final after a round already)
        "fj-a-rank-0": "already synced",
        "fj-b-rank-0": "already synced",
        "fj-b-rank-1": "uploaded",
    }
    assert failed.lines[0].startswith("run fj-a-rank-1: ")
    want = {  # state, exit code, losses: the refused run as the rounds left it
        "fj-a-rank-0": ("finished", 0, [0, 1, 2]),
        "fj-b-rank-0": ("finished", 0, [0, 1, 2]),
        "fj-b-rank-1": ("failed", 1, [10, 11, 12]),
        "fj-a-rank-1": ("running", None, [10, 11]),
    }
    for run_id, (state_, exit_code, losses) in want.items():
        run = sink.client.run("local", "p", run_id)
        assert (run["state"], run["exit_code"]) == (state_, exit_code), run_id
        assert [row["loss"] for row in run["history"]] == losses, run_id


def two_rank_job(root: Path, job: str, rank_1_offset: int = 0, rank_1_finishes=False) -> None:
    """Two ranks of three rows (rank r logs loss 10 r + step, rank 1 `rank_1_offset` more);
    rank 0 finishes, rank 1 only if told."""
    for rank in (0, 1):
        with rank_log(
            root, RankInfo(rank, rank, 2, 2, 0, job_id=job), f"{job}-{rank}", "p"
        ) as writer:
            for step in range(3):
                loss = 10 * rank + step + rank * rank_1_offset
                writer.write(history_record([("loss", str(loss))], step))
            if rank == 0 or rank_1_finishes:
                writer.write(exit_record(0))


def test_a_failed_last_sync_prints_the_runs_it_verified(make_sink, tmp_path):
    """`sync --follow --json` whose last sync refuses a run (the server holds other rows
    for it, from an earlier upload) prints, as a failed one-shot sync does, the runs that
    are verified and their links, then the refusal, exit 1."""
    two_rank_job(tmp_path / "earlier", "fj", rank_1_finishes=True)
    two_rank_job(tmp_path / "live", "fj", 100)  # rank 1: other values, and never finished
    sink = make_sink()
    cli = [sys.executable, "-m", "wbmerge.cli", "sync", "--run-mode", "new"]
    earlier = subprocess.run(
        [*cli, str(tmp_path / "earlier")],
        capture_output=True,
        text=True,
        env={**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "s1")},
    )
    assert earlier.returncode == 0, earlier.stderr
    done = subprocess.run(
        [
            *cli,
            str(tmp_path / "live"),
            "--follow",
            "--interval",
            "0.3",
            "--idle-timeout",
            "1",
            "--json",
        ],
        env={**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "s2")},
        capture_output=True,
        text=True,
        timeout=UPLOAD_TIMEOUT,
    )
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert [(r["id"], r["status"]) for r in printed["runs"]] == [("fj-rank-0", "already synced")]
    assert [link["url"] for link in printed["links"]] == [f"{sink.url}/local/p/groups/fj"]
    errors = [line for line in done.stderr.splitlines() if line.startswith("wbmerge: error:")]
    assert errors[0].startswith("wbmerge: error: run fj-rank-1: the server's row 3 differs")
    assert [row["loss"] for row in sink.client.run("local", "p", "fj-rank-1")["history"]] == [
        10,
        11,
        12,
    ]


def test_a_server_error_in_one_jobs_last_sync_leaves_the_next_jobs_to_run(
    make_sink, monkeypatch, tmp_path, state
):
    """Two shared jobs end idle (rank 1 of each never finishes); the server fails the first
    question of the first job's last sync (HTTP 500, not retried). That job's run stays as
    the rounds left it, the next job's last sync still runs, and `UploadFailed` says both:
    the server's answer, the rerun line last, and the one run it verified."""
    sink, failed = last_syncs_under_fault(
        make_sink, monkeypatch, tmp_path, "shared", "graphql:RunResumeStatus=500@1"
    )
    assert failed.lines == [
        f"{sink.url}/graphql answered HTTP 500 to RunResumeStatus",
        "nothing missing was recorded as synced; rerun `wbmerge sync` to send it",
    ]
    assert [(t.target.id, t.status) for t in failed.report.targets] == [("fj-b", "uploaded")]
    rows = [{"_step": s, "loss/rank-0": s, "loss/rank-1": 10 + s} for s in range(3)]
    fj_a, fj_b = (sink.client.run("local", "p", run_id) for run_id in ("fj-a", "fj-b"))
    assert (fj_a["state"], fj_a["history"]) == ("running", rows[:2])  # (the rounds' rows)
    assert (fj_b["state"], fj_b["exit_code"], fj_b["history"]) == ("finished", 0, rows)


def test_the_flyte_follow_task_says_what_a_failed_last_sync_verified(make_sink, tmp_path):
    """The follow task's process (`python -m wbmerge.flyte follow`) whose last sync refuses
    one run (other rows on the server) still syncs the other job, and says in its log the
    ranks that never finished and the runs verified, before the task fails."""
    sink = make_sink()
    two_rank_job(tmp_path / "earlier", "fj-a", rank_1_finishes=True)
    earlier = subprocess.run(
        [
            sys.executable,
            "-m",
            "wbmerge.cli",
            "sync",
            "--run-mode",
            "new",
            str(tmp_path / "earlier"),
        ],
        env={**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "s1")},
        capture_output=True,
        text=True,
    )
    assert earlier.returncode == 0, earlier.stderr
    two_rank_job(tmp_path / "live", "fj-a", 100)
    two_rank_job(tmp_path / "live", "fj-b")
    request = {
        "path": str(tmp_path / "live"),
        "job_prefix": "fj-",
        "interval": 0.3,
        "idle_timeout": 1,
        "run_mode": "new",
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "wbmerge.flyte",
            "follow",
            str(tmp_path / "request.json"),
            str(tmp_path / "result.json"),
        ],
        env={**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "s2")},
        capture_output=True,
        text=True,
        timeout=UPLOAD_TIMEOUT,
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exit_code"] == 1
    assert result["error"].startswith("run fj-a-rank-1: the server's row 3 differs"), result
    assert "Never finished: job fj-a: rank(s) 1; job fj-b: rank(s) 1" in child.stderr
    runs = f"{sink.url}/local/p/runs"
    verified = [
        line.strip()
        for line in child.stderr.splitlines()
        if line.strip().startswith(("uploaded:", "already synced:", "already complete:"))
    ]
    assert verified == [
        f"already synced: fj-a-rank-0 {runs}/fj-a-rank-0",
        f"already synced: fj-b-rank-0 {runs}/fj-b-rank-0",
        f"uploaded: fj-b-rank-1 {runs}/fj-b-rank-1",
    ]
    assert sink.client.run("local", "p", "fj-b-rank-1")["state"] == "failed"


def test_a_job_whose_last_sync_refuses_its_input_leaves_the_next_jobs_to_run(
    make_sink, monkeypatch, tmp_path, state
):
    """fj-a's rank 1 never wrote a run (it died at start), so its last sync refuses the job
    (bad input); fj-b, which ended idle, still gets its last sync: final, every row."""
    with rank_log(
        tmp_path / "live", RankInfo(0, 0, 2, 2, 0, job_id="fj-a"), "fj-a-0", "p"
    ) as writer:
        writer.write(history_record([("loss", "0")], 0))
        writer.write(exit_record(0))
    two_rank_job(tmp_path / "live", "fj-b")
    sink = make_sink()
    use_sink(monkeypatch, sink)
    request = MergeRequest(paths=[tmp_path / "live"], run_mode="shared")
    with pytest.raises(UploadFailed) as failed:
        follow(request, interval=0.2, idle_timeout=1.0, timeout=UPLOAD_TIMEOUT, job_prefix="fj-")
    [line] = failed.value.lines
    assert line.startswith("job fj-a: rank(s) 1 of 2 have no offline run")
    assert [(t.target.id, t.status) for t in failed.value.report.targets] == [("fj-b", "uploaded")]
    fj_b = sink.client.run("local", "p", "fj-b")
    rows = [{"_step": s, "loss/rank-0": s, "loss/rank-1": 10 + s} for s in range(3)]
    assert (fj_b["state"], fj_b["exit_code"], fj_b["history"]) == ("finished", 0, rows)

"""Pass-through targets (`new`, `auto`) followed a round at a time (`follow.passlive`): each
round reads only what the rank wrote since, its restarts joining as the one-shot joins them,
and the runs end byte for byte as a one-shot sync of the final files makes them; a follower
started again goes on from the state saved, and a state that does not fit is said in one
line and merged from scratch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from wbmerge.follow import Follower, round_lines, saved
from wbmerge.log import BLOCK_SIZE
from wbmerge.sync import MergeRequest
from wbmerge.training import RankInfo

from ..support import synthetic
from .test_follow import UPLOAD_TIMEOUT, assert_same_runs, follow_sink, one_shot
from .test_follow_incremental import Growing, follow_rounds

JOB_ID = "passing"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """Two nodes of one rank each, in the shapes wandb 0.31 writes (console lines, system
    metrics, a summary per step): rank 0 fails at its 150th step and torch elastic starts
    it again, its steps from 0 (moved after the failed run's); rank 1 runs through."""
    root = tmp_path_factory.mktemp("job")
    for rank, restart, steps, code in ((0, 0, 150, 1), (0, 1, 200, 0), (1, 0, 300, 0)):
        info = RankInfo(rank, 0, 2, 1, rank, restart=restart, job_id=JOB_ID)
        synthetic.write_rank(root, info, steps, metrics=12, exit_code=code)
    return root


def restart_log(growing: Growing) -> Path:
    """Rank 0's restart, taken out of the logs that grow (it starts later)."""
    [log] = [log for log in growing.logs if "syn0000r1" in log.name]
    growing.logs.remove(log)
    return log


def end_the_failed_run(job: Path, live: Path) -> None:
    """Rank 0's first run writes the rest of its log, its exit record (code 1) included."""
    ended = Growing(job, live)
    ended.logs = [log for log in ended.logs if "syn0000r0" in log.name]
    ended.grow(1.0)


def follow_setup(job, make_sink, monkeypatch, tmp_path, state, run_mode, rank_scope="global"):
    live = tmp_path / "live"
    request = MergeRequest(paths=[live], run_mode=run_mode, rank_scope=rank_scope)
    want = one_shot(monkeypatch, make_sink, job, request, tmp_path)
    sink = follow_sink(make_sink, monkeypatch, state)
    growing = Growing(job, live)
    live.mkdir()
    return live, request, want, sink, growing


@pytest.mark.parametrize(
    ("run_mode", "rank_scope"),
    # (each mode and each scope once: every pair follows without a restart in
    # `test_follow_incremental.test_incremental_rounds_end_as_one_sync`)
    [("new", "global"), ("auto", "worker")],
)
def test_pass_through_rounds_with_a_restart_end_as_one_sync(
    run_mode, rank_scope, job, make_sink, monkeypatch, tmp_path, state
):
    """Logs cut mid-record and at record and block boundaries (`Growing`); rank 0's restart
    starts mid-follow: its run merges from scratch once, said in one line, then goes on."""
    live, request, want, sink, growing = follow_setup(
        job, make_sink, monkeypatch, tmp_path, state, run_mode, rank_scope
    )
    restart = restart_log(growing)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.2, 0.35, 0.5, 0.7), sink, want, seen)
        end_the_failed_run(job, live)
        growing.logs.append(restart)  # (and torch elastic starts rank 0 again)
        follow_rounds(follower, growing, (0.8, 0.9, 0.95), sink, want, seen)
        growing.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)
    # (the last round goes on from the merge kept since the restart joined, and reads
    # only what the ranks wrote since the round before)
    assert all(t.continued and t.final for t in report.targets), round_lines(report)
    assert (
        0
        < sum(t.bytes_read for t in report.targets)
        < sum(log.stat().st_size for log in live.rglob("run-*.wandb")) // 4
    )
    for report in seen:
        assert [t.status for t in report.targets] == ["sent"] * len(want), round_lines(report)
    # rank 0's run (the first target), before and after its restart joined: merged from
    # scratch once, then going on; rank 1's run (if it has one) went on through all of it
    runs = [[t.continued for t in r.targets] for r in seen]
    assert [continued[0] for continued in runs] == [False, True, True, True, False, True, True]
    assert [continued[1:] for continued in runs[1:]] == [[True] * (len(want) - 1)] * 6
    said = [w for r in seen for w in r.warnings if "merged from scratch" in w]
    assert said == [f"{seen[0].targets[0].run_id}: a rank or restart started: merged from scratch"]


def state_of(state: Path, log_name: str) -> Path:
    """The saved state of the run whose first log is `log_name` (its spool names it)."""
    [path] = [p for p in state.glob(f"follow/*/{saved.STATE_FILE}") if log_name in p.read_text()]
    return path


def test_a_pass_through_follower_started_again_reads_only_what_is_new(
    job, make_sink, monkeypatch, tmp_path, state
):
    """A follower stops (as a killed one: nothing is saved at its end) and another goes on
    from the states the first saved after each verified round, reading only the bytes
    written since (and the block where each log was left)."""
    live, request, want, sink, growing = follow_setup(
        job, make_sink, monkeypatch, tmp_path, state, "new"
    )
    restart = restart_log(growing)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.1, 0.4), sink, want, seen)
    assert len(list(state.glob(f"follow/*/{saved.STATE_FILE}"))) == 2
    sizes = {log.name: log.stat().st_size for log in live.rglob("run-*.wandb")}
    seen.clear()
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        follow_rounds(again, growing, (0.6, 0.8), sink, want, seen)
        grown = {log.name: log.stat().st_size for log in live.rglob("run-*.wandb")}
        growing.logs.append(restart)
        growing.grow(1.0)
        assert again.round().done
    first = seen[0]
    assert first.warnings == []
    assert all(t.continued and t.status == "sent" and t.added > 0 for t in first.targets)
    assert all(t.continued for r in seen for t in r.targets)
    assert 0 < sum(t.bytes_read for t in first.targets) < sum(sizes.values())
    new_bytes = sum(grown.values()) - sum(sizes.values())
    assert sum(t.bytes_read for t in seen[1].targets) <= new_bytes + 2 * BLOCK_SIZE
    assert_same_runs(sink, want)
    assert list(state.glob("follow/*/*")) == []  # (final: nothing goes on from it)


def flip_a_state_byte(live: Path, state: Path) -> None:
    path = state_of(state, "syn0001r0")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def lose_the_state(live: Path, state: Path) -> None:
    state_of(state, "syn0001r0").unlink()


def truncate_rank_1(live: Path, state: Path) -> None:
    [log] = live.rglob("run-syn0001r0*.wandb")
    log.write_bytes(log.read_bytes()[: BLOCK_SIZE + 100])


FALLBACKS = {
    # case: (what changes while no follower runs, what the next round says of rank 1's run)
    "damaged state": (flip_a_state_byte, "is damaged"),
    "lost state": (lose_the_state, "no state saved by a follower before this one"),
    "truncated rank": (truncate_rank_1, "does not fit"),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_a_pass_through_state_that_does_not_fit_merges_from_scratch(
    case, job, make_sink, monkeypatch, tmp_path, state
):
    live, request, want, sink, growing = follow_setup(
        job, make_sink, monkeypatch, tmp_path, state, "new"
    )
    restart = restart_log(growing)
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        follow_rounds(follower, growing, (0.2, 0.4), sink, want, [])
    change, said = FALLBACKS[case]
    change(live, state)
    seen: list = []
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as again:
        if case != "truncated rank":
            growing.grow(0.6)
        report = again.round()
        rank0, rank1 = report.targets
        assert not rank1.continued and rank0.continued
        [line] = [w for w in report.warnings if "merged from scratch" in w]
        assert line.startswith(f"{rank1.run_id}: ") and said in line and "\n" not in line
        if case == "truncated rank":  # (the server holds rows the files lack now: refused)
            assert rank1.status == "failed"
            growing.grow(0.6)  # (the rank writes its tail again)
            follow_rounds(again, growing, (0.6,), sink, want, [])
        else:
            assert rank1.status == "sent"
            [log] = live.rglob("run-syn0001r0*.wandb")
            assert rank1.bytes_read == log.stat().st_size  # (read whole)
        follow_rounds(again, growing, (0.8,), sink, want, seen)
        assert all(t.continued for t in seen[-1].targets)  # (the new merge goes on)
        growing.logs.append(restart)
        growing.grow(1.0)
        assert again.round().done
    assert_same_runs(sink, want)

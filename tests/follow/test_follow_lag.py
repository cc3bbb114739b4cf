"""A follow's rounds against a sink whose line counts lag the rows it holds, as W&B's do
(wandb PR #12421): each round's counts, asked right after the round before, are waited for
instead of taken for a server that lost rows."""

from __future__ import annotations

import pytest

from wbmerge.follow import Follower, follow, round_lines
from wbmerge.sink import LikeWandb
from wbmerge.sync import MergeRequest

from ..conftest import job_dir
from .test_follow import UPLOAD_TIMEOUT, GrowingJob, assert_same_runs, one_shot, use_sink


def lagging(fixture: str, run_mode: str, make_sink, monkeypatch, tmp_path, state) -> tuple:
    """A follow's request over `tmp_path/live`, the one-shot sync it must equal, a sink whose
    counts are 2 s late (made the one wandb talks to), and the job that grows there."""
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    want = one_shot(monkeypatch, make_sink, job_dir(fixture), request, tmp_path)
    sink = make_sink(like=LikeWandb(lag=2.0))
    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))
    job = GrowingJob(job_dir(fixture), tmp_path / "live")
    (tmp_path / "live").mkdir()
    return request, want, sink, job


@pytest.mark.parametrize("run_mode", ["shared", "new"])
def test_follow_rounds_wait_for_late_counts_and_end_as_one_sync(
    run_mode, make_sink, monkeypatch, tmp_path, state
):
    request, want, sink, job = lagging(
        "two_nodes_2x2", run_mode, make_sink, monkeypatch, tmp_path, state
    )
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        for fraction in (0.35, 0.7):
            job.grow(fraction)
            report = follower.round()
            assert all(t.status != "failed" for t in report.targets), round_lines(report)
        job.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)


def test_a_round_longer_than_the_idle_timeout_does_not_end_a_job_still_writing(
    make_sink, monkeypatch, tmp_path, state
):
    """A round on a server whose counts lag lasts longer than the idle timeout (the counts
    are waited for); the ranks wrote meanwhile, so the follow goes on until they finish,
    and ends done, not idle with every rank named unfinished."""
    request, want, sink, job = lagging(
        "one_node_4", "shared", make_sink, monkeypatch, tmp_path, state
    )
    job.grow(0.3)
    grown = iter((0.6, 1.0))
    lines: list[str] = []

    def write_more(report) -> None:
        # (the ranks wrote while the round ran, as they do: seen by the next round)
        lines.extend(round_lines(report))
        job.grow(next(grown, 1.0))

    result = follow(
        request, interval=0.2, idle_timeout=1.0, timeout=UPLOAD_TIMEOUT, on_round=write_more
    )
    assert (result.unfinished, result.final_sync) == ([], None), lines
    assert_same_runs(sink, want)

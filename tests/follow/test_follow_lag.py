"""A follow's rounds against a sink whose line counts lag the rows it holds, as W&B's do
(wandb PR #12421): each round's counts, asked right after the round before, are waited for
instead of taken for a server that lost rows."""

from __future__ import annotations

import pytest

from wbmerge.follow import Follower, round_lines
from wbmerge.sink import LikeWandb
from wbmerge.sync import MergeRequest

from ..conftest import job_dir
from .test_follow import UPLOAD_TIMEOUT, GrowingJob, assert_same_runs, one_shot, use_sink


@pytest.mark.parametrize("run_mode", ["shared", "new"])
def test_follow_rounds_wait_for_late_counts_and_end_as_one_sync(
    run_mode, make_sink, monkeypatch, tmp_path, state
):
    fixture = job_dir("two_nodes_2x2")
    request = MergeRequest(paths=[tmp_path / "live"], run_mode=run_mode)
    want = one_shot(monkeypatch, make_sink, fixture, request, tmp_path)
    sink = make_sink(like=LikeWandb(lag=2.0))
    use_sink(monkeypatch, sink)
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(state))
    job = GrowingJob(fixture, tmp_path / "live")
    (tmp_path / "live").mkdir()
    with Follower(request, parallel=4, timeout=UPLOAD_TIMEOUT) as follower:
        for fraction in (0.35, 0.7):
            job.grow(fraction)
            report = follower.round()
            assert all(t.status != "failed" for t in report.targets), round_lines(report)
        job.grow(1.0)
        report = follower.round()
        assert report.done, round_lines(report)
    assert_same_runs(sink, want)

"""The sink's model of W&B (`sink serve --like-wandb`): each behaviour on its own, against
what the public wandb issues and PRs report (docs/sink.md), and the ideal server beside it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from wbmerge.sink import LikeWandb, Limits, Store, wandblike

RUN = ("local", "p", "r")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(wandblike, "time", fake)
    return fake


def history(steps, offset):
    """A file_stream body of history lines at `steps`, sent at line `offset`."""
    lines = [json.dumps({"_step": s, "loss": s / 10}) for s in steps]
    return {"files": {"wandb-history.jsonl": {"offset": offset, "content": lines}}}


def held_steps(store):
    return [row["_step"] for row in store.run(*RUN, full=True)["history"]]


def resume_status(store):
    """What RunResumeStatus answers of the run (its line counts, tails and summary)."""
    run = store.reported_run(*RUN)
    return {
        "historyLineCount": run["history_line_count"],
        "historyTail": json.dumps([run["history_tail"]] if run["history_tail"] else []),
        "summaryMetrics": run["raw_summary"],
    }


def make_store(tmp_path, like=None):
    store = Store(tmp_path / "data", like)
    store.upsert_run(*RUN, {})
    return store


# -- write cursor (wandb#12269) ---------------------------------------------------------------


def test_the_ideal_sink_puts_a_batch_where_it_was_sent(tmp_path):
    store = make_store(tmp_path)
    store.file_stream(*RUN, history(range(10), 0))
    store.file_stream(*RUN, history(range(10, 20), 20))
    assert held_steps(store) == [*range(10), *range(10, 20)]
    assert store.run(*RUN)["history_line_count"] == 30  # (lines 10-19 never arrived)


def test_a_batch_past_the_write_cursor_lands_at_it(tmp_path):
    store = make_store(tmp_path, LikeWandb(write_cursor=True))
    store.file_stream(*RUN, history(range(10), 0))
    store.file_stream(*RUN, history(range(10, 20), 20))  # past the end: lands at 10
    assert held_steps(store) == list(range(20))
    assert store.run(*RUN)["history_line_count"] == 20


def test_a_writer_at_offset_0_moves_the_cursor_back_and_the_next_batch_lands_on_its_rows(
    tmp_path,
):
    """wandb#12269 as W&B reproduced it: one writer wrote lines 0-19, another wrote at
    offset 0 (moving the cursor back to 10), and the first writer's next batch, sent at
    offset 20, landed on lines 10-19: ten rows lost, none where they were sent."""
    store = make_store(tmp_path, LikeWandb(write_cursor=True))
    store.file_stream(*RUN, history(range(20), 0))
    store.file_stream(*RUN, history(range(100, 110), 0))  # the second writer
    store.file_stream(*RUN, history(range(20, 30), 20))  # the first writer goes on
    assert held_steps(store) == [*range(100, 110), *range(20, 30)]
    assert store.run(*RUN)["history_line_count"] == 20


def test_the_cursor_of_a_run_the_sink_held_before_it_started_is_its_line_count(tmp_path):
    store = make_store(tmp_path)
    store.file_stream(*RUN, history(range(5), 0))
    store.close()
    again = Store(tmp_path / "data", LikeWandb(write_cursor=True))
    again.file_stream(*RUN, history(range(5, 8), 9))
    assert held_steps(again) == list(range(8))


# -- lag (wandb PR #12421, #12668) ------------------------------------------------------------


def test_counts_tail_and_summary_are_those_of_lag_seconds_ago(tmp_path, clock):
    store = make_store(tmp_path, LikeWandb(lag=3.0))
    store.file_stream(*RUN, history(range(17), 0))
    clock.now += 3.5
    body = history(range(17, 40), 17)
    body["files"]["wandb-summary.json"] = {"offset": 0, "content": ['{"_step": 39}']}
    store.file_stream(*RUN, body)
    clock.now += 1.0  # the second write is 1 s old: not yet seen
    bucket = resume_status(store)
    assert bucket["historyLineCount"] == 17
    assert json.loads(json.loads(bucket["historyTail"])[0])["_step"] == 16
    assert json.loads(bucket["summaryMetrics"]) == {}
    # the rows themselves, as the read API and HistoryPage give them, are all there
    assert held_steps(store) == list(range(40))
    clock.now += 2.5
    bucket = resume_status(store)
    assert bucket["historyLineCount"] == 40
    assert json.loads(json.loads(bucket["historyTail"])[0])["_step"] == 39
    assert json.loads(bucket["summaryMetrics"]) == {"_step": 39}


def test_a_run_written_within_the_lag_reports_no_lines_yet(tmp_path, clock):
    store = make_store(tmp_path, LikeWandb(lag=3.0))
    store.file_stream(*RUN, history(range(5), 0))
    bucket = resume_status(store)
    assert bucket is not None and bucket["historyLineCount"] == 0
    assert bucket["historyTail"] == "[]"
    assert store.upsert_run(*RUN, {})["history_line_count"] == 0  # UpsertBucket's count too


def test_the_tail_and_summary_can_lag_longer_than_the_counts(tmp_path, clock):
    """wandb PR #12668: the row count is up to date while the tail and the summary's
    `_step` come from a cache that can be stale."""
    store = make_store(tmp_path, LikeWandb(tail_lag=5.0))
    store.file_stream(*RUN, history(range(10), 0))
    clock.now += 6
    body = history(range(10, 20), 10)
    body["files"]["wandb-summary.json"] = {"offset": 0, "content": ['{"_step": 19}']}
    store.file_stream(*RUN, body)
    bucket = resume_status(store)
    assert bucket["historyLineCount"] == 20
    assert json.loads(json.loads(bucket["historyTail"])[0])["_step"] == 9
    assert json.loads(bucket["summaryMetrics"]) == {}
    clock.now += 5
    assert json.loads(json.loads(resume_status(store)["historyTail"])[0])["_step"] == 19


def test_a_run_held_before_the_sink_started_is_cached_from_the_first_question(tmp_path, clock):
    store = make_store(tmp_path)
    store.file_stream(*RUN, history(range(10), 0))
    store.close()
    again = Store(tmp_path / "data", LikeWandb(lag=2.0, tail_lag=3.0))
    assert resume_status(again)["historyLineCount"] == 0
    clock.now += 2
    bucket = resume_status(again)
    assert bucket["historyLineCount"] == 10 and bucket["historyTail"] == "[]"
    clock.now += 1
    assert json.loads(json.loads(resume_status(again)["historyTail"])[0])["_step"] == 9


def test_without_lag_the_counts_are_exact_at_once(tmp_path, clock):
    store = make_store(tmp_path)
    store.file_stream(*RUN, history(range(5), 0))
    assert resume_status(store)["historyLineCount"] == 5


# -- sampling ---------------------------------------------------------------------------------


def test_a_full_range_answers_its_first_rows_on_the_ideal_sink(tmp_path):
    store = make_store(tmp_path)
    store.file_stream(*RUN, history(range(100), 0))
    page = store.history_page(*RUN, 0, 100, 10)
    assert [json.loads(line)["_step"] for line in page] == list(range(10))


def test_a_range_of_more_rows_than_samples_answers_a_sample_over_the_range(tmp_path):
    store = make_store(tmp_path, LikeWandb(sampling=True))
    store.file_stream(*RUN, history(range(100), 0))
    page = [json.loads(line)["_step"] for line in store.history_page(*RUN, 0, 100, 10)]
    assert page == [0, 11, 22, 33, 44, 55, 66, 77, 88, 99]
    small = [json.loads(line)["_step"] for line in store.history_page(*RUN, 40, 50, 10)]
    assert small == list(range(40, 50))  # no more rows than asked for: every one


# -- limits -----------------------------------------------------------------------------------


def test_a_history_line_longer_than_wandbs_limit_is_refused(tmp_path):
    store = make_store(tmp_path, LikeWandb(limits=Limits()))
    longest = "x" * (wandblike.MAX_LINE_BYTES - len('{"_step": 0, "v": ""}'))
    fits = json.dumps({"_step": 0, "v": longest})
    assert len(fits.encode()) == wandblike.MAX_LINE_BYTES
    body = {"files": {"wandb-history.jsonl": {"offset": 0, "content": [fits]}}}
    store.file_stream(*RUN, body)
    over = {"files": {"wandb-history.jsonl": {"offset": 1, "content": [fits[:-2] + 'y"}']}}}
    with pytest.raises(ValueError, match="past the 10383360 bytes"):
        store.file_stream(*RUN, over)
    assert store.run(*RUN)["history_line_count"] == 1


def test_the_throttle_counts_requests_per_run_and_per_project(clock):
    throttle = wandblike.Throttle(Limits(run_requests=2, project_requests=3, project_bytes=100))
    assert throttle.admit("e", "p", "a", 10) is None
    assert throttle.admit("e", "p", "a", 10) is None
    assert throttle.admit("e", "p", "a", 10) == pytest.approx(1.0)  # a third of run a
    assert throttle.admit("e", "p", "b", 10) is None  # another run: the project's third
    assert throttle.admit("e", "p", None, 10) == pytest.approx(1.0)  # the project's fourth
    assert throttle.admit("e", "other", None, 10) is None
    clock.now += 0.4
    assert throttle.admit("e", "other", None, 95) == pytest.approx(0.6)  # 105 bytes in 1 s
    clock.now += 0.7
    assert throttle.admit("e", "p", "a", 10) is None  # a second later: all may go again
    assert throttle.admit("e", "other", None, 95) is None


def test_a_rate_below_one_a_second_admits_one_request_in_its_period(clock):
    """`run_requests=0.1`: one file_stream request of a run in any 10 s, so a test can make
    the limit bite however slowly a loaded machine sends."""
    throttle = wandblike.Throttle(Limits(run_requests=0.1))
    assert throttle.admit("e", "p", "a", 10) is None
    clock.now += 3.0
    assert throttle.admit("e", "p", "a", 10) == pytest.approx(7.0)
    assert throttle.admit("e", "p", "b", 10) is None  # (another run has its own)
    clock.now += 7.0
    assert throttle.admit("e", "p", "a", 10) is None
    assert throttle.admit("e", "p", "a", 10) == pytest.approx(10.0)


def post_file_stream(sink, body):
    token = base64.b64encode(f"api:{sink.api_key}".encode()).decode()
    request = urllib.request.Request(
        f"{sink.url}/files/local/p/r/file_stream",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After")


def test_file_stream_requests_past_the_run_rate_are_answered_429_and_kept_out(make_sink):
    sink = make_sink(like=LikeWandb(limits=Limits(run_requests=1)))
    answers = [post_file_stream(sink, history([step], step)) for step in range(5)]
    refused = [step for step, (status, _) in enumerate(answers) if status == 429]
    assert refused and all(answers[s][1] == "1" for s in refused)
    assert all(status == 200 for step, (status, _) in enumerate(answers) if step not in refused)
    kept = [row["_step"] for row in sink.client.run("local", "p", "r")["history"]]
    assert kept == [step for step in range(5) if step not in refused]
    like = sink.client.like_wandb()
    assert like["throttled"] == {"file_stream": len(refused)}
    assert like["behaviours"].startswith("limits 1 file_stream/s per run")


def test_a_throttled_sink_answers_an_unknown_file_stream_path_404(make_sink):
    sink = make_sink(like=LikeWandb(limits=Limits()))
    token = base64.b64encode(f"api:{sink.api_key}".encode()).decode()
    request = urllib.request.Request(
        f"{sink.url}/files/local/p/file_stream",
        data=b"{}",
        headers={"Authorization": f"Basic {token}"},
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request)
    assert answer.value.code == 404


def test_the_ideal_sink_takes_every_request(sink):
    answers = [post_file_stream(sink, history([step], step)) for step in range(5)]
    assert answers == [(200, None)] * 5
    assert sink.client.like_wandb() == {"behaviours": "", "throttled": {}}


# -- the switches -----------------------------------------------------------------------------


def test_like_wandb_turns_every_behaviour_on_and_each_switch_sets_its_own():
    assert LikeWandb.from_switches(like_wandb=True) == LikeWandb(True, 3.0, True, Limits())
    assert LikeWandb.from_switches() == LikeWandb()
    only = LikeWandb.from_switches(like_wandb=True, lag=0.5, sampling=False, limits=False)
    assert only == LikeWandb(write_cursor=True, lag=0.5)
    assert LikeWandb.from_switches(run_rate=4).limits == Limits(run_requests=4)
    assert LikeWandb.from_switches(like_wandb=True, tail_lag=9).tail_seconds == 9
    assert LikeWandb.from_switches(lag=2).tail_seconds == 2
    for like in (LikeWandb(), LikeWandb.all_on(0.25), LikeWandb(limits=Limits(7, 8, 9))):
        assert like.cli_args()  # as `LocalSink` starts the sink


def test_sink_serve_says_what_it_models(tmp_path):
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wbmerge.sink",
            "--port",
            "0",
            "--data",
            str(tmp_path / "d"),
            "--like-wandb",
            "--lag",
            "1.5",
            "--no-sampling",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [server.stdout.readline() for _ in range(4)]
    finally:
        server.terminate()
        server.wait(30)
    assert lines[3].strip() == (
        "like W&B: write cursor, counts 1.5 s late, limits 2 file_stream/s per run, "
        "500 requests/s and 120 MB/s per project"
    )


# -- config merged key by key (wandb#11055, wandb#9844), in both modes ------------------------


@pytest.mark.parametrize("like", [None, LikeWandb.all_on()], ids=["ideal", "like-wandb"])
def test_config_keeps_every_key_once_sent_and_replaces_a_value_whole(tmp_path, like):
    # A key deleted from a run's config stays on the server (#11055: `b`); a nested
    # object sent again through wandb's uploader is replaced whole (#9844: `data` lost
    # `key1`).
    store = make_store(tmp_path, like)
    first = {"b": {"value": 1}, "data": {"value": {"key1": 1}}}
    store.upsert_run(*RUN, {"config": json.dumps(first)})
    store.upsert_run(*RUN, {"config": json.dumps({"data": {"value": {"new": 42}}})})
    assert json.loads(store.reported_run(*RUN)["raw_config"]) == {
        "b": {"value": 1},
        "data": {"value": {"new": 42}},
    }

"""Verification reads every row back: a server that acknowledged rows and lost them, holds a
step twice or another value is never "verified", and a rerun says why it cannot help.

The expected rows are read from the source `.wandb` file with protobuf (sinktools), and what
the server holds is read from the sink's own API, not through wbmerge.
"""

from __future__ import annotations

import base64
import json
import sqlite3
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.training import RankInfo
from wbmerge.verify import halves, room, sampled, spans, windows
from wbmerge.verify.rowcheck import compare_steps, value_problem

from ..support import synthetic
from ..support.sinktools import expected_from_log

# ---- the pure rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "sent, held, missing, lacking, twice, extra, unstepped",
    [
        ([0, 1, 2], [0, 1, 2], [], 0, [], [], 0),
        ([0, 1, 2], [2, 0, 1], [], 0, [], [], 0),  # (any order)
        ([0, 1, 2, 3], [0, 3], [1, 2], 2, [], [], 0),
        ([0, 1, 2], [0, 1, 1, 2, 2, 2], [], 0, [1, 2], [], 0),
        ([5, 10], [5, 7, 10, 12], [], 0, [], [7, 12], 0),
        ([0, 1], [0, None, 1], [], 0, [], [], 1),
        ([], [3], [], 0, [], [3], 0),
        # wandb-core wraps past int64 and sends steps 0 and 1 twice: held twice is right
        ([0, 1, -(2**63), 0, 1], [0, 0, 1, 1, -(2**63)], [], 0, [], [], 0),
        ([0, 1, 0, 1], [0, 1, 1], [0], 1, [], [], 0),
    ],
)
def test_compare_steps(sent, held, missing, lacking, twice, extra, unstepped):
    check = compare_steps(sent, held)
    assert (check.missing, check.lacking, check.twice, check.extra, check.unstepped) == (
        missing,
        lacking,
        twice,
        extra,
        unstepped,
    )
    assert bool(check.problems(len(sent))) == bool(missing or twice or extra or unstepped)


def test_the_problems_name_the_steps():
    check = compare_steps(list(range(20000)), [*range(1000), *range(6694, 20000), 3, 3, 30001])
    [lacks, twice, extra] = check.problems(20000)
    assert lacks == "the server lacks 5,694 of 20,000 rows sent (steps 1000-6693)"
    assert twice == "the server holds 1 steps more often than they were sent (steps 3)"
    assert extra == "the server holds rows at 1 steps that were not sent (steps 30001)"


@pytest.mark.parametrize(
    "steps, text",
    [
        ([4], "4"),
        ([1, 2, 3, 7], "1-3, 7"),
        ([1, 3, 5, 7, 9, 11], "1, 3, 5, 7 and 2 more ranges"),
        ([1, 3, 5, 7, 9], "1, 3, 5, 7 and 1 more range"),
    ],
)
def test_spans(steps, text):
    assert spans(steps) == text


@pytest.mark.parametrize(
    "sent, last_held",
    [
        (list(range(5000)), 4999),
        (list(range(5000)), 7000),  # the server holds rows past the last one sent
        (list(range(0, 1_000_000, 100)), None),  # every 100th step
        (list(range(300, 1300)), 1299),  # a run that starts late
        ([7], 7),
        ([], None),
        ([], 12),
        ([-5, -4, 0, 7], 7),  # (steps wrapped past int64 are negative)
    ],
)
def test_windows_cover_every_step_and_hold_a_page_of_sent_steps_each(sent, last_held):
    found = windows(sent, last_held, page=1000)
    end = max([*sent, -1, -1 if last_held is None else last_held]) + 1
    assert found[0][0] == -(2**63) and found[-1][1] >= end
    for (_, hi), (lo, _) in zip(found, found[1:], strict=False):
        assert hi == lo, "windows meet without a gap"
    for lo, hi in found:
        assert hi > lo
        assert sum(lo <= s < hi for s in sent) <= 1000
    if sent:
        assert len(found) <= len(sent) // 1000 + 2


def test_windows_end_at_the_largest_int64_step():
    """A step range's end is exclusive and an int64: the largest step cannot be named, so the
    last window ends just before it (its row is left to the line count)."""
    top = 2**63 - 1
    assert windows([0, 5], top)[-1][1] == top
    assert all(lo < hi <= top for lo, hi in windows([0, 5, top - 1], top))


def test_a_full_window_is_asked_again_in_halves():
    sent = list(range(100))
    assert room((0, 100), sent) == 400 and room((200, 300), sent) == 16
    assert halves((0, 100)) == [(0, 50), (50, 100)]
    assert halves((7, 8)) == [(7, 8)]


@pytest.mark.parametrize("count", [0, 1, 2, 63, 64, 65, 20000])
def test_sampled_rows_include_the_first_and_last(count):
    rows = sampled(count, most=64)
    assert rows == sorted(set(rows)) and len(rows) == min(count, 64)
    if count:
        assert rows[0] == 0 and rows[-1] == count - 1


# ---- against the sink, through the real uploader -------------------------------------------

pytestmark_e2e = pytest.mark.e2e


def synthetic_job(tmp_path, steps=3000) -> Path:
    root = tmp_path / "job"
    synthetic.write_rank(root, RankInfo(0, 0, 1, 1, 0, 0, "rowjob"), steps, metrics=5)
    return root


def sync(sink, tmp_path, source, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(
        main,
        ["sync", "--run-mode", "auto", "-p", "rows", "-e", "local", str(source), *args],
        env=env,
    )


def errors(result) -> list[str]:
    assert "Traceback" not in result.output
    return [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error:")]


def sent_steps(source: Path) -> list[int]:
    [log] = source.glob("wandb/*/run-*.wandb")
    return [row["_step"] for row in expected_from_log(log).history]


def held_steps(sink, run_id) -> list[int]:
    return [row["_step"] for row in sink.client.run("local", "rows", run_id)["history"]]


def post_lines(sink, run_id: str, offset: int, lines: list[dict]) -> None:
    """A file_stream request of history lines at `offset`, as another writer sends it."""
    body = json.dumps(
        {
            "files": {
                "wandb-history.jsonl": {"offset": offset, "content": list(map(json.dumps, lines))}
            }
        }
    ).encode()
    key = sink.env["WANDB_API_KEY"]
    request = urllib.request.Request(
        f"{sink.url}/files/local/rows/{run_id}/file_stream",
        data=body,
        method="POST",
        headers={"Authorization": "Basic " + base64.b64encode(f"api:{key}".encode()).decode()},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200


@pytestmark_e2e
def test_rows_a_server_acknowledged_and_lost_are_never_verified(make_sink, tmp_path):
    """The sink answers the first file_stream request of history lines and keeps none of
    it. Whether those rows lie inside the run (its line count still covers them) or at its
    end depends on how wandb-core batched them; either way the sync must not say verified,
    and its error must name the rows the server lacks."""
    sink = make_sink(faults=["file_stream:history=lose@1"])
    source = synthetic_job(tmp_path)
    first = sync(sink, tmp_path, source, "--base-id", "lossy")
    assert first.exit_code == 1, first.output
    sent, held = sent_steps(source), held_steps(sink, "lossy")
    lost = sorted(set(sent) - set(held))
    assert lost, "the fault lost rows"
    line = errors(first)[0]
    inside = f"the server lacks {len(lost):,} of {len(sent):,} rows sent (steps {spans(lost)})"
    at_the_end = f"history rows {len(held)} of {len(sent)}"
    assert inside in line or at_the_end in line
    assert "verified" not in first.stdout and "uploaded" not in first.stdout


def drop_history_lines(sink, run_id: str, offsets: range) -> None:
    """Lose lines of a run inside the sink's own store, as a server that loses rows does:
    its line count (the highest line held, plus one) still covers them."""
    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        [pk] = db.execute("SELECT pk FROM runs WHERE name = ?", (run_id,)).fetchone()
        db.execute(
            "DELETE FROM lines WHERE run = ? AND stream = 'history' AND offset >= ? AND offset < ?",
            (pk, offsets.start, offsets.stop),
        )
    db.close()


@pytestmark_e2e
def test_rows_lost_inside_a_run_are_named_and_a_rerun_says_why_it_cannot_send_them(sink, tmp_path):
    source = synthetic_job(tmp_path)
    assert sync(sink, tmp_path, source, "--base-id", "holes").exit_code == 0
    history = sink.client.run("local", "rows", "holes")["history"]
    drop_history_lines(sink, "holes", range(1000, 1700))
    assert sink.client.run("local", "rows", "holes")["history_line_count"] == len(history)
    lost = [row["_step"] for row in history[1000:1700]]

    for args in (["--force"], ["--force", "--verify", "full"]):
        result = sync(sink, tmp_path, source, "--base-id", "holes", *args)
        assert result.exit_code == 1, result.output
        [line, advice] = errors(result)
        assert f"the server lacks 700 of 3,000 rows sent (steps {spans(lost)})" in line
        assert "a rerun cannot send them again" in line
        assert "upload under other run ids (with --base-id ID)" in advice
    assert held_steps(sink, "holes") == [r["_step"] for r in history[:1000] + history[1700:]]

    elsewhere = sync(sink, tmp_path, source, "--base-id", "whole")
    assert elsewhere.exit_code == 0, elsewhere.output
    assert held_steps(sink, "whole") == sent_steps(source)


@pytestmark_e2e
def test_steps_another_writer_sent_at_a_stale_offset_fail_the_check(sink, tmp_path):
    """A second writer that started from a stale line count writes the first rows again over
    later ones: the line count is unchanged, a step is there twice and another is gone.
    (Rows appended past the count are refused by the count already.)"""
    source = synthetic_job(tmp_path, steps=1500)
    assert sync(sink, tmp_path, source, "--base-id", "twice").exit_code == 0
    history = sink.client.run("local", "rows", "twice")["history"]
    post_lines(sink, "twice", 10, history[:10])  # rows of steps 0-9 at lines 10-19
    assert sink.client.run("local", "rows", "twice")["history_line_count"] == len(history)
    result = sync(sink, tmp_path, source, "--base-id", "twice", "--force")
    assert result.exit_code == 1, result.output
    [line, _] = errors(result)
    twice = spans([row["_step"] for row in history[:10]])
    gone = spans([row["_step"] for row in history[10:20]])
    assert f"the server lacks 10 of 1,500 rows sent (steps {gone})" in line
    assert f"the server holds 10 steps more often than they were sent (steps {twice})" in line


@pytestmark_e2e
def test_a_value_changed_on_the_server_fails_the_full_check(sink, tmp_path):
    """A row outside the sample passes the default check; `--verify full` compares every
    row. A row in the sample (the first) fails the default check too."""
    source = synthetic_job(tmp_path, steps=1500)
    assert sync(sink, tmp_path, source, "--base-id", "values").exit_code == 0
    history = sink.client.run("local", "rows", "values")["history"]
    unsampled = next(i for i in range(len(history)) if i not in sampled(len(history)))
    key = next(k for k in history[unsampled] if not k.startswith("_"))
    post_lines(sink, "values", unsampled, [{**history[unsampled], key: -12345.5}])

    sampled_only = sync(sink, tmp_path, source, "--base-id", "values", "--force")
    assert sampled_only.exit_code == 0, sampled_only.output
    full = sync(sink, tmp_path, source, "--base-id", "values", "--force", "--verify", "full")
    assert full.exit_code == 1, full.output
    step = history[unsampled]["_step"]
    assert f"the row at step {step} holds {key!r} = -12345.5" in errors(full)[0]

    post_lines(sink, "values", 0, [{**history[0], key: 7.25}])
    first_row = sync(sink, tmp_path, source, "--base-id", "values", "--force")
    assert first_row.exit_code == 1
    assert f"the row at step {history[0]['_step']} holds {key!r} = 7.25" in errors(first_row)[0]


class FullPages:
    """A server that answers every page with as many rows as asked, all at its first step."""

    def __init__(self) -> None:
        self.asked = 0

    def history_page(self, entity, project, run_id, steps, most):
        self.asked += 1
        return [{"_step": steps[0]}] * most


def test_a_server_that_fills_every_page_is_asked_a_bounded_number_of_times(tmp_path):
    """Halving a full window could go on for every step of the range (2 * 10**9 questions
    for steps 0 and 10**9); the check gives up after a bound and says why."""
    from wbmerge.upload import Delivery, Held, ServerError
    from wbmerge.verify import rows_not_held
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=50)
    [log] = source.glob("wandb/*/run-*.wandb")
    server = FullPages()
    delivery = Delivery("full-pages", log.parent, log, "key", "fingerprint")
    with pytest.raises(ServerError, match="came back full"):
        rows_not_held(server, "e", "p", delivery, Held(True, 50, last_step=10**9), read_staged(log))
    assert server.asked < 200


class RowsAsSent:
    """A server holding a staged log's rows as wandb-core sends them; it records the
    windows of steps it is asked for."""

    def __init__(self, log: Path) -> None:
        from wbmerge.verify import history_row

        self.rows = []
        while True:
            try:
                self.rows.append(history_row(log, len(self.rows)))
            except IndexError:
                break
        self.asked: list[tuple[int, int]] = []

    def history_page(self, entity, project, run_id, steps, most):
        self.asked.append(steps)
        return [row for row in self.rows if steps[0] <= row["_step"] < steps[1]][:most]


@pytest.mark.parametrize(
    "checked, rows_cut, first_asked",
    [
        ((), 0, 0),  # nothing read back before: every row
        (range(30), 30, 30),  # a follow's round before read back 30 rows, held since: the rest
        # the 30 rows read back before were sent again by this upload (the server had lost
        # the run since): this upload's rows are read back, every one
        (range(30), 0, 0),
        (range(30), 20, 0),
        (range(1, 31), 30, 0),  # steps the staged run does not begin with: every row again
        (range(60), 30, 0),  # more rows than staged: every row again
    ],
)
def test_rows_read_back_before_are_not_read_again_if_the_server_held_them_before(
    tmp_path, checked, rows_cut, first_asked
):
    from wbmerge.upload import Delivery, Held
    from wbmerge.verify import rows_not_held, write_remainder
    from wbmerge.verify.remainder import Remainder
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=50)
    [log] = source.glob("wandb/*/run-*.wandb")
    server = RowsAsSent(log)
    sent = log.with_name("sent.wandb")  # (the log this upload sent: its first rows cut)
    write_remainder(log, sent, Remainder(rows_cut))
    delivery = Delivery("again", log.parent, sent, "key", "fingerprint")
    delivery.rows_cut, delivery.steps_checked = rows_cut, list(checked)
    held = Held(True, 50, last_step=49)
    assert rows_not_held(server, "e", "p", delivery, held, read_staged(log)) == []
    lowest = min(lo for lo, _ in server.asked)  # (the first window begins at int64's least)
    assert lowest == first_asked if first_asked else lowest <= 0


@pytest.mark.parametrize("tail", [49, None])  # a stale tail: the last row sent, or none yet
def test_rows_past_a_stale_tail_are_read_and_fail_the_run(tmp_path, tail):
    """W&B's history tail can be stale (wandb PR #12668): a server whose tail still says
    the last row sent while it holds rows past it (another writer's) is not whole, and the
    rows past the tail are read back to find it so."""
    from wbmerge.upload import Delivery, Held
    from wbmerge.verify import rows_not_held
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=50)
    [log] = source.glob("wandb/*/run-*.wandb")
    server = RowsAsSent(log)
    server.rows += [{"_step": 70, "loss": 1.0}, {"_step": 10**12, "loss": 2.0}]
    delivery = Delivery("stale-tail", log.parent, log, "key", "fingerprint")
    problems = rows_not_held(
        server, "e", "p", delivery, Held(True, 50, last_step=tail), read_staged(log)
    )
    assert problems == [
        "the server holds rows at 2 steps that were not sent (steps 70, 1000000000000)"
    ]


def test_a_run_of_one_page_is_read_back_in_one_request(tmp_path):
    """The last window is asked for together with the steps past it: a run of fewer rows
    than a page costs one request."""
    from wbmerge.upload import Delivery, Held
    from wbmerge.verify import rows_not_held
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=50)
    [log] = source.glob("wandb/*/run-*.wandb")
    server = RowsAsSent(log)
    delivery = Delivery("one-page", log.parent, log, "key", "fingerprint")
    held = Held(True, 50, last_step=49)
    assert rows_not_held(server, "e", "p", delivery, held, read_staged(log)) == []
    assert server.asked == [(-(2**63), 2**63 - 1)]


def test_rows_past_the_last_step_that_fill_the_joined_window_are_read_as_before(tmp_path):
    """A server holding more rows past the last step sent than the joined last window has
    room for: the window is asked again as the last window and the steps past it, and the
    run fails naming the rows that were not sent (not as a server whose pages all came
    back full)."""
    from wbmerge.upload import Delivery, Held
    from wbmerge.verify import rows_not_held
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=50)
    [log] = source.glob("wandb/*/run-*.wandb")
    server = RowsAsSent(log)
    server.rows += [{"_step": 100 + i, "loss": 1.0} for i in range(300)]
    delivery = Delivery("past-the-end", log.parent, log, "key", "fingerprint")
    problems = rows_not_held(
        server, "e", "p", delivery, Held(True, 350, last_step=49), read_staged(log)
    )
    assert problems == ["the server holds rows at 16 steps that were not sent (steps 100-115)"]
    assert server.asked == [(-(2**63), 2**63 - 1), (-(2**63), 50), (50, 2**63 - 1)]


class RowsRead:
    """A server holding `rows`, as read from a log with protobuf and `json` (sinktools),
    not by wbmerge's reading of them."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def history_page(self, entity, project, run_id, steps, most):
        return [row for row in self.rows if steps[0] <= row["_step"] < steps[1]][:most]


@pytest.mark.parametrize("fault", [None, "lost", "changed on the server", "staged otherwise"])
def test_the_staged_rows_are_compared_as_read_independently(tmp_path, fault):
    """The staged rows the read-back compares (read the fast way for the rows wandb
    writes, `sentrows.flat_row`) are the ones a reading by protobuf and `json` gives:
    a row the server lost, a value changed on the server and a staged row that differs
    from what the server holds each fail the check, and nothing else does."""
    from wbmerge.log import pb, read_payloads, write_payloads
    from wbmerge.upload import Delivery, Held
    from wbmerge.verify import rows_not_held
    from wbmerge.wandbcore import read_staged

    source = synthetic_job(tmp_path, steps=200)
    [log] = source.glob("wandb/*/run-*.wandb")
    rows = expected_from_log(log).history
    index = sampled(len(rows))[7]  # (a row whose values are compared)
    step, key = rows[index]["_step"], next(k for k in rows[index] if not k.startswith("_"))
    value = rows[index][key]
    if fault == "lost":
        del rows[index]
    elif fault == "changed on the server":
        rows[index] = {**rows[index], key: -1.5}
    elif fault == "staged otherwise":  # the staged log holds another value in that row
        payloads = list(read_payloads(log))
        at = [i for i, p in enumerate(payloads) if pb.Record.FromString(p).HasField("history")]
        record = pb.Record.FromString(payloads[at[index]])
        item = next(i for i in record.history.item if list(i.nested_key) == [key])
        item.value_json = "2.25"
        payloads[at[index]] = record.SerializeToString()
        write_payloads(log, payloads)
    delivery = Delivery("flat", log.parent, log, "key", "fingerprint")
    held = Held(True, len(rows), last_step=rows[-1]["_step"])
    problems = rows_not_held(RowsRead(rows), "e", "p", delivery, held, read_staged(log))
    assert (
        problems
        == {
            None: [],
            "lost": [f"the server lacks 1 of 200 rows sent (steps {step})"],
            "changed on the server": [
                f"the row at step {step} holds {key!r} = -1.5, sent {value!r}"
            ],
            "staged otherwise": [f"the row at step {step} holds {key!r} = {value!r}, sent 2.25"],
        }[fault]
    )


NAN = float("nan")


@pytest.mark.parametrize(
    "held, sent, same",
    [
        (1, 1, True),
        (1.0, 1, True),  # (wandb-core writes the float 5.0 as `5`)
        (NAN, NAN, True),
        (0.0, -0.0, True),
        ("a", "a", True),
        (None, None, True),
        (True, True, True),
        (True, 1, False),  # (equal to `==`, not to W&B)
        (1, True, False),
        (False, 0, False),
        (0.0, False, False),
        (2, 1, False),
        (1.5, NAN, False),
        ("a", "b", False),
        ("1", 1, False),
        (None, 0, False),
        ({"a": True}, {"a": 1}, False),
        ({"a": 1.0}, {"a": 1}, True),
        ([NAN], [NAN], True),
    ],
)
def test_a_value_is_the_same_as_w_and_b_sees_it(held, sent, same):
    """Each value of a sampled row is compared as W&B sees it: numbers by value, NaN equal
    to NaN, a boolean never equal to a number, whichever way the comparison goes."""
    problem = value_problem(7, {"_step": 7, "x": sent}, {"_step": 7, "_runtime": 1.0, "x": held})
    assert (problem is None) is same, problem
    if not same:
        assert problem.startswith("the row at step 7 holds 'x' = "), problem

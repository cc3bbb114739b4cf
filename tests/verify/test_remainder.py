"""What is left to send and what is missing, as pure functions of the staged run and the
server's counts (the base of exactly-once uploads and of a later live mode)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.errors import NotATransactionLog
from wbmerge.log import pb, read_records, txlog
from wbmerge.upload import Held
from wbmerge.verify import (
    Mismatch,
    history_row,
    remainder,
    same_value,
    sends_no_row,
    shortfall,
    with_last_row,
    write_remainder,
)
from wbmerge.verify.remainder import Remainder, config_left_behind
from wbmerge.wandbcore import (
    Console,
    StagedContent,
    logged_config_keys,
    read_logged_run,
    read_staged,
)

from ..conftest import fixture_logs, job_dir
from ..support.emulator_reference import reference_output_log
from ..support.ranklogs import history_record
from ..support.sinktools import expected_from_log
from ..support.steprows import ODD_ROWS

STAGED = StagedContent(step_items=(0, 1, 2, 5, 9), events=3, console_lines=4)
# what a server holding 4 system-metric rows of the 3 staged is told
EVENTS_BEYOND = "the server holds 4 system-metric rows, more than the 3 staged"


@pytest.mark.parametrize(
    "held, skip",
    [
        (Held(), 0),  # no such run: everything
        (Held(exists=True), 0),  # the run exists without rows (an upload cut short early)
        (Held(True, 1, 0, 0, 0), 1),
        (Held(True, 3, 1, 2, 2), 3),
        (Held(True, 4, 3, 4, 5), 4),
        (Held(True, 5, 3, 4, 9), 5),  # all rows there: only files, summary, exit to send
    ],
)
def test_remainder_skips_the_rows_the_server_holds(held, skip):
    assert remainder(STAGED, held).skip_history == skip


@pytest.mark.parametrize(
    "held, fragment",
    [
        (Held(True, 6, 0, 0, 9), "more than the 5 staged"),  # e.g. doubled by an older tool
        (Held(True, 3, 0, 0, 7), "has _step 7, the staged row 2"),  # rows of another merge
        (Held(True, 2, 0, 0, None), "_step None"),
        # system-metric rows past the staged run's (every rank's, synced before)
        (Held(True, 5, 7, 4, 9), "holds 7 system-metric rows, more than the 3 staged"),
        (Held(True, 0, 4, 0, None), "holds 4 system-metric rows, more than the 3 staged"),
    ],
)
def test_remainder_refuses_what_is_not_a_prefix(held, fragment):
    with pytest.raises(Mismatch, match=fragment.replace("(", r"\(")):
        remainder(STAGED, held)


def test_a_merged_console_may_make_fewer_lines_as_a_lagging_rank_catches_up():
    """Why console lines on the server past the staged ones are not refused: a shared run's
    console is every rank's lines by time, and a rank that lagged adds lines among those
    sent already, with its progress bars' cursor moves; the console then makes fewer lines
    than it made a round before (6, then 5), and the next round must still go out."""

    def lines(records: list[str]) -> int:
        console = Console(keep_text=False)
        for text in records:
            console.write("stdout", text)
        return console.lines

    sent = [f"[rank-0] a{i}\n" for i in range(6)]  # rank 1's bar was not written yet
    caught_up = [*sent[:5], "\x1b[A\x1b[A\x1b[A[rank-1] bar\n", sent[5]]
    assert (lines(sent), lines(caught_up)) == (6, 5)
    staged = StagedContent(step_items=(0, 1), events=0, console_lines=lines(caught_up))
    assert remainder(staged, Held(True, 1, 0, 6, 0)).skip_history == 1
    assert shortfall(staged, Held(True, 2, 0, 6, 1)) == []


@pytest.mark.parametrize(
    "a, b, same",
    [
        (5.0, 5, True),
        (float("nan"), float("nan"), True),
        ({"a": [1, {"b": 2.0}]}, {"a": [1.0, {"b": 2}]}, True),
        (True, 1, False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ([1, 2], [1], False),
        ("1", 1, False),
        (0.1, 0.1000001, False),
    ],
)
def test_same_value(a, b, same):
    assert same_value(a, b) is same


def test_the_servers_last_row_must_equal_the_staged_row_at_its_place():
    rows = [{"_step": s, "loss/rank-0": 0.5 * s, "nan": float("nan")} for s in (0, 1, 2, 5, 9)]
    same = Held(True, 3, 0, 0, 2, {**rows[2], "loss/rank-0": 1})  # wandb-core writes 1.0 as 1
    assert remainder(STAGED, same, rows.__getitem__).skip_history == 3
    relabelled = {"_step": 2, "loss/worker-0-rank-0": 1.0, "nan": float("nan")}
    with pytest.raises(Mismatch, match="row 3 differs from the staged row 3"):
        remainder(STAGED, Held(True, 3, 0, 0, 2, relabelled), rows.__getitem__)


@pytest.mark.parametrize(
    "held, problems",
    [
        (Held(True, 5, 3, 4, 9), []),
        # system-metric rows past the staged run's are another run's; console lines may be
        # fewer as a follow goes on (a lagging rank's cursor moves)
        (Held(True, 5, 4, 6, 9), [EVENTS_BEYOND]),
        (Held(), ["the run is not on the server"]),
        (Held(True, 4, 3, 4, 5), ["history rows 4 of 5"]),
        (Held(True, 10, 3, 4, 9), ["history rows 10 of 5"]),
        (Held(True, 5, 3, 4, 8), ["last _step 8, staged 9"]),
        (Held(True, 5, 1, 0, 9), ["system-metric rows 1 of 3", "console lines 0 of 4"]),
    ],
)
def test_shortfall_names_what_is_missing(held, problems):
    assert shortfall(STAGED, held) == problems


@pytest.mark.parametrize(
    "texts, lines",
    [
        ([], 0),
        (["a\n"], 1),
        (["a\nb"], 2),
        (["a", "b\n", "c\n"], 2),
        (["10%\r", "50%\r", "100%\n"], 1),
        (["a\n\nb\n"], 3),
        # cursor moves, as progress bars of tqdm make them: the lines they redraw count once
        (["bar\x1b[A\n"], 1),
        (["bar1 10%\nbar2 10%\n", "\x1b[A\x1b[Abar1 90%\nbar2 90%\n"], 2),
        (["a\n", "\x1b[A\x1b[Bb\n"], 2),
        (["x\x1b", "[Ab\n"], 1),  # (a move split between two records)
        (["a\x1b[B\x1b[Bb"], 3),
        # line feeds after the last character make no line; a lone \r writes nothing
        (["a\n", "\n"], 1),
        (["\n\n\n"], 0),
        (["\r\r\r"], 0),
        (["\n\na"], 3),
        # more blank lines in a row than wandb-core's view of 32 lines holds
        (["a" + "\n" * 40 + "b"], 33),
        (["\n" * 40 + "b"], 32),
    ],
)
def test_console_line_count(texts, lines):
    assert line_count(texts) == lines


@pytest.mark.parametrize(
    "steps, skip, warned",
    [
        ((0, 1, 2), 3, True),  # every row on the server: the upload sends none
        ((0, 1, 2), 2, False),  # the last row goes, and gives the summary its `_step`
        ((0, 1, 2), 0, False),
        ((), 0, False),  # no rows at all: no `_step` to lose
    ],
)
def test_a_run_sent_again_with_no_row_is_warned_of(steps, skip, warned):
    warning = sends_no_row(StagedContent(steps, 0, 0), Remainder(skip))
    assert (warning is not None) is warned
    if warned:
        assert warning.startswith(f"sent again with no row (the server holds all {skip})")


@pytest.mark.parametrize(
    "steps, skip, sent_from",
    [
        ((0, 1, 2), 3, 2),  # every row held: the last goes again, over itself
        ((0, 1, 5, 9), 4, 3),
        ((0, 1, 2), 2, 2),  # the last row goes already
        ((0, 1, 2), 0, 0),
        ((), 0, 0),  # no rows: none to send
        # a row without `_step` follows the row before (3) in a whole upload, but one sent on
        # its own is numbered from the starting step (0): not sent again at another step
        ((0, 1, 2, None), 4, 4),
    ],
)
def test_a_run_held_row_for_row_sends_its_last_row_again(steps, skip, sent_from):
    staged = StagedContent(steps, 0, 0)
    plan = with_last_row(staged, Remainder(skip))
    assert plan == Remainder(sent_from)
    assert (sends_no_row(staged, plan) is not None) is (sent_from == len(steps) > 0)


def test_read_staged_and_write_remainder_on_a_real_log(tmp_path):
    log = sorted(job_dir("one_node_4").glob("wandb/*/run-*.wandb"))[0]
    want = expected_from_log(log)
    staged = read_staged(log)
    assert list(staged.history_steps) == [row["_step"] for row in want.history]
    assert staged.events == len(want.stats)
    assert staged.console_lines == len(want.console)
    assert history_row(log, 11) == want.history[11]
    cut = tmp_path / "cut.wandb"
    write_remainder(log, cut, remainder(staged, Held(True, 12, 0, 0, want.history[11]["_step"])))
    rest = expected_from_log(cut)
    assert rest.history == want.history[12:]
    assert rest.stats == want.stats and rest.console == want.console
    assert rest.summary == want.summary and rest.exit_code == want.exit_code


def test_remainder_moves_the_rows_a_continued_upload_would_number_otherwise():
    # Rows without a `_step` item follow the row before in a whole upload (3, 4), but an
    # upload that continues the run numbers them from the starting step again (0, 1).
    staged = StagedContent((0, 1, 2, None, None), 0, 0)
    assert remainder(staged, Held(True, 3, 0, 0, 2)).resteps == {3: 3, 4: 4}
    assert remainder(staged, Held(True, 4, 0, 0, 3)).resteps == {4: 4}
    assert remainder(staged, Held(True, 5, 0, 0, 4)).resteps == {}
    assert remainder(STAGED, Held(True, 2, 0, 0, 1)).resteps == {}  # as wandb writes rows


def test_rising_steps_are_told_without_a_difference_that_wraps():
    # 2**63 - 10 then -20: -20 is behind, though their difference wraps to a positive int64
    big = 2**63 - 10
    assert StagedContent((big, -20), 0, 0).history_steps == (big, big + 1)
    assert StagedContent((3, 5, 9), 0, 0).history_steps == (3, 5, 9)
    assert StagedContent((3, 5, 9), 0, 0, 4).history_steps == (4, 5, 9)


def test_remainder_refuses_rows_a_continued_upload_cannot_send_where_they_belong():
    # From a starting step of 2**63 - 2, a whole upload wraps around to 12, 13; continued
    # from row 3, the starting step is above anything the row could say.
    start = 2**63 - 2
    staged = StagedContent((-(2**63), None, 12, 2), 0, 0, start)
    assert staged.history_steps == (start, start + 1, 12, 13)
    with pytest.raises(Mismatch, match="cannot be sent at their steps again"):
        remainder(staged, Held(True, 3, 0, 0, 12))


def test_a_cut_log_is_sent_at_the_steps_of_the_whole_log(tmp_path):
    from wbmerge.log import write_payloads

    log = tmp_path / "odd.wandb"
    write_payloads(log, [history_record(items, field) for items, field, _, _ in ODD_ROWS])
    whole = read_staged(log)
    sent = [sent for *_, sent in ODD_ROWS]
    assert list(whole.history_steps) == sent
    cuts = [have for have in range(1, len(ODD_ROWS)) if sent[have] >= 0]
    # (A continued upload numbers from the starting step, 0: it cannot send a row below it,
    # as the rows after int64's largest step wrapped around are sent in a whole upload.)
    assert len(cuts) == len(ODD_ROWS) - 1 - 5
    for have in cuts:
        plan = remainder(whole, Held(True, have, 0, 0, sent[have - 1]))
        cut = tmp_path / f"cut-{have}.wandb"
        write_remainder(log, cut, plan)
        assert list(read_staged(cut).history_steps) == sent[have:], have


@pytest.mark.parametrize("padding", [0, 2000])  # 2,000 more items: rows over 2 MiB of reads
def test_read_staged_counts_each_row_at_the_step_wandb_core_sends(tmp_path, padding):
    from wbmerge.log import write_payloads

    log = tmp_path / "odd.wandb"
    pad = [([f"pad/{i}/rank-{i % 8}"], "0.25") for i in range(padding)]
    write_payloads(log, [history_record(items + pad, field) for items, field, _, _ in ODD_ROWS])
    staged = read_staged(log)
    assert list(staged.step_items) == [item for _, _, item, _ in ODD_ROWS]
    assert list(staged.history_steps) == [sent for *_, sent in ODD_ROWS]
    assert staged.events == 0 and staged.console_lines == 0


def test_steps_that_are_all_plain_integers_are_read_as_protobuf_reads_them(tmp_path):
    """Rows whose `_step` texts are all plain integers are read at once, not one by one:
    the same values, negative and 18-digit ones included; each row is then sent one above
    the row before where its own step is behind it."""
    from wbmerge.log import write_payloads

    steps = [0, 1, -7, 10**17 + 3, 999_999_999_999_999_999, 42] * 50
    log = tmp_path / "plain.wandb"
    write_payloads(
        log, [history_record([(["_step"], str(s)), (["loss"], "0.5")], None) for s in steps]
    )
    staged = read_staged(log)
    assert list(staged.step_items) == steps
    after = 999_999_999_999_999_999 + 1  # every later step is behind this one
    assert list(staged.history_steps) == [0, 1, 2, 10**17 + 3, after - 1] + [
        after + i for i in range(len(steps) - 5)
    ]
    assert _sent_by_protobuf(log) == staged.history_steps


def test_a_run_records_starting_step_moves_the_rows_behind_it(tmp_path):
    from wbmerge.log import write_payloads

    run = pb.Record()
    run.run.run_id, run.run.starting_step = "started", 10
    rows = [history_record([(["_step"], str(s))], s) for s in (0, 1, 12, 13)]
    write_payloads(tmp_path / "started.wandb", [run.SerializeToString(), *rows])
    assert read_staged(tmp_path / "started.wandb").history_steps == (10, 11, 12, 13)


def _sent_by_protobuf(log) -> tuple[int, ...]:
    """The `_step` each history row of `log` arrives at, read with protobuf alone: its last
    `_step` item when that is a JSON integer at least one above the row before (from the run
    record's starting step), else one above the row before. (Enough for the logs these tests
    give it, whose `_step` items are plain JSON.)"""
    steps: list[int] = []
    next_step = None
    for record in read_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run" and next_step is None:
            next_step = record.run.starting_step
        if kind != "history":
            continue
        next_step = next_step or 0
        value = None
        for item in record.history.item:
            if (list(item.nested_key) or [item.key]) == ["_step"]:
                value = json.loads(item.value_json)
        own = isinstance(value, int) and not isinstance(value, bool) and value >= next_step
        steps.append(value if own else next_step)
        next_step = steps[-1] + 1
    return tuple(steps)


def test_read_staged_steps_are_protobufs_on_every_fixture_and_a_merged_log(tmp_path):
    """The steps are read for all rows of a read at once; they must be what protobuf says,
    on every real log (wandb 0.16, 0.19, 0.31, damaged copies) and on a shared merge."""
    from wbmerge.merge import stage
    from wbmerge.sync import MergeRequest, plan_jobs

    from ..support import synthetic

    synthetic.write_job(tmp_path / "job", 1, 3, 300, job_id="steps")
    request = MergeRequest([tmp_path / "job"], run_mode="shared", project="p")
    (planned,) = plan_jobs(request)
    merged = stage(planned.targets[0], tmp_path / "out", planned.options(request)).log_path
    logs = [*fixture_logs(include_damaged=True), merged]
    checked = 0
    for log in logs:
        try:
            want = _sent_by_protobuf(log)
        except NotATransactionLog:
            continue
        assert read_staged(log).history_steps == want, log
        checked += bool(want)
    assert checked > 40


def test_what_a_splice_counts_is_what_the_staged_log_holds(tmp_path):
    """A `new` merge counts a spliced log while it checks the source, and the upload checks
    the server against that count without reading the staged log: the count must be what
    reading the staged log gives. (Logs of less than a block are framed again, not spliced:
    the synthetic ranks are long enough to be spliced.)"""
    from wbmerge.merge import stage
    from wbmerge.sync import MergeRequest, plan_jobs

    from ..support import synthetic

    synthetic.write_job(tmp_path / "job", 1, 3, 2000, job_id="spliced")
    request = MergeRequest([tmp_path / "job"], run_mode="new", project="p")
    (planned,) = plan_jobs(request)
    options = planned.options(request)
    staged = [stage(t, tmp_path / "out", options, count_content=True) for t in planned.targets]
    assert len(staged) == 3
    for one in staged:
        assert one.content is not None, one.log_path
        assert one.content == read_staged(one.log_path), one.log_path
        # (the config keys as the staged log sets them: its rewritten run record's too)
        assert one.content.config_keys == logged_config_keys(one.log_path)
        assert {"wbmerge", "lr"} <= one.content.config_keys
        assert len(one.content.history_steps) == 2000
        assert one.content.events > 0 and one.content.console_lines


def line_count(texts: list[str]) -> int:
    """The lines `terminal.Console` counts of one stream's texts, without keeping them."""
    console = Console(keep_text=False)
    for text in texts:
        console.write("stdout", text)
    return console.lines


def _emulated_line_count(texts: list[str]) -> int:
    """The lines wandb-core's emulator makes of one stream's texts, character by character
    (the tests' reference, tests/support/emulator_reference.py)."""
    return reference_output_log([("stdout", text) for text in texts])[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="ab\n\r\x1b[12ABK", max_size=6), max_size=12))
def test_console_lines_counted_piece_by_piece_are_those_of_the_emulator(texts):
    # pieces are short, so that a cursor movement is often split between two of them
    assert line_count(texts) == _emulated_line_count(texts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b\n", "\n", "\n" * 20, "\r", "\n\r\n"]), max_size=40))
def test_long_runs_of_blank_lines_are_counted_as_the_emulator_scrolls(texts):
    """Runs of more line feeds than the view holds lines (32), before, between and after
    the characters written."""
    assert line_count(texts) == _emulated_line_count(texts)


def test_counting_a_console_does_not_hold_its_text(tmp_path):
    """A log's console may be larger than memory: its lines are counted as they are read,
    not gathered first (20 MB of console text here)."""
    import tracemalloc

    from wbmerge.log import pb, write_payloads

    def line(i: int) -> bytes:
        record = pb.Record()
        record.output_raw.line = f"line {i:08d} " + "x" * 86 + "\n"
        return record.SerializeToString()

    log = tmp_path / "console.wandb"
    write_payloads(log, map(line, range(200_000)))
    tracemalloc.start()
    try:
        staged = read_staged(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert staged.console_lines == 200_000
    assert peak < 15_000_000, peak  # the reads' buffers, not the 20 MB of text


def test_read_staged_says_which_logs_put_metadata():
    """wandb 0.31 writes an environment record (uploaded as wandb-metadata.json); wandb
    0.16 wrote the file into `files/` itself."""
    new = read_staged(next(job_dir("one_node_4").glob("wandb/*/run-*.wandb")))
    old = read_staged(next(job_dir("wandb_0_16_6").glob("wandb/*/run-*.wandb")))
    assert (new.metadata, old.metadata) == (True, False)


def test_read_logged_run_folds_config_and_summary_as_protobuf_reads_them():
    """On every fixture log, what `read_logged_run` folds equals what the tests' own reading
    of the records with protobuf gives (sinktools), wandb's own keys apart."""
    checked = 0
    for log in fixture_logs():
        try:
            want = expected_from_log(log)
        except NotATransactionLog:
            continue
        logged = read_logged_run(log)
        assert {k: v for k, v in logged.summary.items() if not k.startswith("_")} == {
            k: v for k, v in want.summary.items() if not k.startswith("_")
        }, log
        assert {k: v for k, v in logged.config.items() if k != "_wandb"} == want.config, log
        assert logged.names[1:] == (want.group, want.job_type), log
        checked += bool(want.summary)
    assert checked > 40


def test_the_config_keys_of_a_log_are_every_key_its_records_set(tmp_path):
    """`logged_config_keys` reads only run and config records, to skip a summary record a
    step. A key set and then removed counts: wandb's uploader sent it with the whole
    config before the removal, and the server keeps it. On every fixture log it gives what
    the whole read gives (`LoggedRun.config_keys`), and holds every key of its config."""
    changed = tmp_path / "run-c.wandb"
    txlog.write_payloads(
        changed,
        [
            pb.Record(
                run=pb.RunRecord(run_id="c", config=config_record(a=1, opt={"lr": 1}))
            ).SerializeToString(),
            pb.Record(summary=pb.SummaryRecord()).SerializeToString(),
            pb.Record(config=config_record(a=2, b=3)).SerializeToString(),
            pb.Record(config=pb.ConfigRecord(remove=[pb.ConfigItem(key="b")])).SerializeToString(),
        ],
    )
    assert logged_config_keys(changed) == {"a", "b", "opt"}
    logged = read_logged_run(changed)
    assert (logged.config, logged.config_keys) == ({"a": 2, "opt": {"lr": 1}}, {"a", "b", "opt"})
    checked = 0
    for log in [*fixture_logs(), changed]:
        try:
            logged = read_logged_run(log, console_limit=0)
        except (NotATransactionLog, ValueError):
            continue
        assert logged_config_keys(log) == logged.config_keys >= logged.config.keys(), log
        checked += bool(logged.config)
    assert checked > 40


@pytest.mark.parametrize(
    "held, left",
    [
        ({"a": {"value": 2}, "b": {"value": 3}, "_wandb": {"value": {}}}, []),  # (b: removed)
        ({"a": {"value": 2}, "old": {"value": 1}}, ["old"]),
        ({"a": {"value": {"x": 1, "gone": 2}}}, []),  # (a value is replaced whole)
        ({}, []),
    ],
)
def test_a_config_key_is_left_behind_only_if_no_record_set_it(held, left):
    assert config_left_behind(json.dumps(held), {"a", "b"}) == left
    assert config_left_behind("not json", {"a"}) == []


def config_record(**values) -> pb.ConfigRecord:
    return pb.ConfigRecord(
        update=[pb.ConfigItem(key=k, value_json=json.dumps(v)) for k, v in values.items()]
    )


def console_log(tmp_path, texts: list[str], logger: bool = False):
    """A log of a run record and console records: `texts` on stdout (the last on stderr),
    and a line of wandb's logger when `logger`."""
    records = [pb.Record(run=pb.RunRecord(run_id="r"))]
    for i, text in enumerate(texts):
        kind = pb.OutputRawRecord.STDERR if i == len(texts) - 1 else pb.OutputRawRecord.STDOUT
        records.append(pb.Record(output_raw=pb.OutputRawRecord(output_type=kind, line=text)))
    if logger:
        records.append(pb.Record(output_logger=pb.OutputLoggerRecord(line="wandb: hi\n")))
    path = tmp_path / "run-r.wandb"
    txlog.write_payloads(path, [record.SerializeToString() for record in records])
    return path


@pytest.mark.parametrize(
    "texts, logger, limit, console",
    [
        # stdout, then the last text on stderr: two terminals, one list of lines
        (["epoch 0\n", "épоch 1\n", "done"], False, 100, "epoch 0\népоch 1\ndone\n".encode()),
        ([], False, 100, b""),
        (["epoch 0\n", "50%\r", "100%\n"], False, 100, b"epoch 0\n50%\n100%\n"),
        (["epoch 0\n"], True, 100, b"epoch 0\nwandb: hi\n"),  # (wandb's logger: a line each)
        (["epoch 0\n", "epoch 1\n"], False, 15, None),  # (over the limit: not kept)
        (["epoch 0\n", "epoch 1\n"], False, 16, b"epoch 0\nepoch 1\n"),
    ],
)
def test_read_logged_run_gives_the_console_as_output_log_holds_it(
    tmp_path, texts, logger, limit, console
):
    """The console of a log's records, in order, by stream, as wandb-core writes it to
    `output.log` (the emulator itself: test_terminal.py); None over the limit."""
    logged = read_logged_run(console_log(tmp_path, texts, logger), console_limit=limit)
    assert logged.console == console

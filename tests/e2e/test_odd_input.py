"""Odd things where runs are expected: a warning and exit 0, or one error line and exit 2;
never a traceback, exit 70 or a hang (every command runs as a subprocess with a timeout).

"Unreadable" is made real for root too: the command runs under `setpriv` without the
capabilities that let root read any file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a
mode of 000 stops it as it stops any user.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError

from wbmerge.log import pb, read_payloads, read_records

from ..support.hostile import (
    copy_job,
    insert_after_run_record,
    one_error_line,
    rewrite_log,
    run_cli,
    run_logs,
)
from ..support.ranklogs import history_record

_NO_DAC = "-dac_override,-dac_read_search"


def as_plain_user() -> tuple[str, ...]:
    """The prefix that runs a command without root's power to read unreadable files."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to test unreadable files as root"
    return (setpriv, f"--inh-caps={_NO_DAC}", f"--bounding-set={_NO_DAC}", "--")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return copy_job("one_node_4", tmp_path / "job")


def odd_entry(job: Path, kind: str) -> Path:
    run_dir = job / "wandb" / f"offline-run-20261121_182745-{kind}"
    run_dir.mkdir()
    path = run_dir / f"run-{kind}.wandb"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "dangling":
        path.symlink_to(job / "gone.wandb")
    elif kind == "socketlike":
        os.mknod(path, 0o600 | 0o140000)  # a socket node: no one listens
    return path


@pytest.mark.parametrize("kind", ["fifo", "loop", "dangling", "socketlike"])
@pytest.mark.parametrize("command", ["inspect", "merge"])
def test_non_files_named_like_runs_are_left_out_with_a_warning(job, tmp_path, kind, command):
    odd = odd_entry(job, kind)
    extra = ("--out", tmp_path / "out") if command == "merge" else ()
    result = run_cli(command, job / "wandb", *extra)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("wbmerge: warning:")]
    assert [line for line in warnings if str(odd) in line], result.stderr
    if command == "inspect":  # the real runs are all there
        assert sorted(line.split()[1] for line in result.stdout.splitlines()[2:]) == [
            "0",
            "1",
            "2",
            "3",
        ]


@pytest.mark.parametrize("kind", ["fifo", "loop"])
def test_a_non_file_named_on_the_command_line_is_one_error_line(job, kind):
    line = one_error_line(run_cli("inspect", odd_entry(job, kind)))
    assert str(job) in line


@pytest.mark.parametrize("command", ["inspect", "report", "merge", "export"])
# (not yet: a record in wandb's shape whose record field claims more bytes than it has,
# e.g. b"\x08\x01\x7a\x09\x0a", passes the vectorised readers without an error)
@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xff\xff\xff", b"\x08\xff\xff", b"\x12\t\n\x07\n\x01x\x82"],
    ids=["garbage", "cut-varint", "cut-history"],
)
def test_a_record_with_a_valid_crc_but_invalid_protobuf_is_one_line(
    job, tmp_path, command, garbage
):
    log = run_logs(job)[1]
    insert_after_run_record(log, [garbage])
    out = tmp_path / "out"
    extra = {
        "merge": ("--run-mode", "shared", "--out", out),
        "export": ("--out", tmp_path / "values.parquet"),
    }.get(command, ())
    line = one_error_line(run_cli(command, job / "wandb", *extra))
    assert str(log) in line and "invalid protobuf" in line
    assert not list(out.glob("offline-run-*"))  # no half-written run left behind


@pytest.mark.parametrize("shape", ["long", "wide"])
def test_a_value_that_is_not_utf8_is_one_line_not_a_broken_parquet_file(job, tmp_path, shape):
    # protobuf refuses such a record; the export's batch reader cuts texts out of the bytes
    # unchecked and once wrote them into the Parquet file, which readers then failed on
    log = run_logs(job)[1]
    hostile = history_record([("note", '"AA"')] * 3, 10**6).replace(b"AA", b"\xff\xfe")
    insert_after_run_record(log, [hostile] * 40)
    out = tmp_path / "values.parquet"
    wide = ("--wide",) if shape == "wide" else ()
    line = one_error_line(run_cli("export", job / "wandb", "--out", out, *wide))
    assert str(log) in line and "invalid protobuf" in line
    assert not out.exists()


def test_an_unreadable_run_directory_is_named_not_a_missing_rank(job):
    run_dir = run_logs(job)[2].parent
    run_dir.chmod(0)
    try:
        for command in ("inspect", "report"):
            line = one_error_line(run_cli(command, job / "wandb", prefix=as_plain_user()))
            assert str(run_dir) in line and "cannot read" in line
    finally:
        run_dir.chmod(0o755)


def test_an_unreadable_files_entry_is_named(job, tmp_path):
    entry = run_logs(job)[0].parent / "files" / "requirements.txt"
    entry.chmod(0)
    out = tmp_path / "out"
    try:
        result = run_cli(
            "merge", job / "wandb", "--run-mode", "new", "--out", out, prefix=as_plain_user()
        )
        line = one_error_line(result)
        assert str(entry) in line and "cannot read" in line
    finally:
        entry.chmod(0o644)


@pytest.mark.parametrize("mode", ["new", "auto", "shared"])
def test_an_invalid_record_of_no_known_kind_is_not_handed_to_the_uploader(job, tmp_path, mode):
    # wandb's shape (`num`, then one field), but field 15 is no record kind and its length
    # runs past the record: the readers skip it, so it is only caught before it is copied
    for log in run_logs(job):
        insert_after_run_record(log, [b"\x08\x01\x7a\x09\x0a"])
    out = tmp_path / "out"
    result = run_cli("merge", job / "wandb", "--run-mode", mode, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "not valid protobuf; left out" in result.stderr
    staged = sorted(out.glob("offline-run-*/run-*.wandb"))
    assert staged
    for log in staged:
        for payload in read_payloads(log):
            pb.Record.FromString(payload)  # raises on the hostile record


def _history_bytes(items: list[tuple[bytes, bytes]], step: int) -> bytes:
    """A history record in wandb's shape, written byte by byte: `num`, then the items (each a
    `nested_key` and a `value_json`, as given, valid UTF-8 or not) and the step field last."""

    def field(tag: bytes, value: bytes) -> bytes:
        return tag + bytes([len(value)]) + value

    body = b"".join(
        field(b"\x0a", field(b"\x12", key) + field(b"\x82\x01", value)) for key, value in items
    )
    body += field(b"\x12", b"\x08" + bytes([step]))
    return b"\x08\x01" + field(b"\x12", body)


# History records protobuf (and so wandb-core) refuses, which a spliced copy must not pass on
INVALID_HISTORY = {
    "cut": b"\x12\t\n\x07\n\x01x\x82",
    "key not UTF-8": _history_bytes([(b"\xff\xfe", b"1")], 5),
    "value overlong, beside a good _step": _history_bytes(
        [(b"_step", b"5"), (b"loss", b'"\xc0\xaf"')], 5
    ),
    "key a surrogate": _history_bytes([(b"_step", b"5"), (b"\xed\xa0\x80", b"1")], 5),
}


@pytest.mark.parametrize("record", INVALID_HISTORY.values(), ids=INVALID_HISTORY.keys())
def test_a_history_record_of_invalid_protobuf_in_a_spliced_rank_is_one_line(
    tmp_path, sink, monkeypatch, record
):
    # A clean rank log of `new` mode is copied block by block, not record by record; a sync
    # still reads its history rows (to count what the server must end with) and refuses an
    # invalid one instead of handing it to the uploader, which would leave a run cut short.
    from ..support import synthetic

    with pytest.raises(DecodeError):
        pb.Record.FromString(record)
    synthetic.write_job(tmp_path / "job", 1, 2, 2000, job_id="cut")
    log = run_logs(tmp_path / "job")[1]  # staged after rank 0's
    insert_after_run_record(log, [record])
    for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    result = run_cli("sync", tmp_path / "job", "--run-mode", "new", "-p", "cut")
    line = one_error_line(result)
    assert str(log) in line and "invalid protobuf" in line
    assert "cut-rank-1" not in {run["id"] for run in sink.client.runs(project="cut")}


def test_a_step_nested_past_the_recursion_limit_in_a_spliced_rank_is_merged(tmp_path):
    # Counting a spliced log (as a sync does) reads the `_step` item of a row without a step
    # field as JSON; a hostile value nested deeper than Python's recursion limit is no
    # step, not an internal error.
    from wbmerge.merge import stage
    from wbmerge.sync import MergeRequest, plan_jobs

    from ..support import synthetic

    synthetic.write_job(tmp_path / "job", 1, 1, 2000, job_id="deep")
    (log,) = run_logs(tmp_path / "job")
    insert_after_run_record(log, [history_record([(["_step"], "[" * 5000)], None)])
    out = tmp_path / "out"
    result = run_cli("merge", tmp_path / "job", "--run-mode", "new", "--out", out)
    assert result.returncode == 0, result.stderr
    (staged,) = out.glob("offline-run-*-deep-rank-0/run-deep-rank-0.wandb")
    assert list(read_payloads(staged))[-1] == list(read_payloads(log))[-1]
    assert len(list(read_payloads(staged))) == len(list(read_payloads(log)))

    request = MergeRequest([tmp_path / "job"], run_mode="new", project="p")
    (planned,) = plan_jobs(request)
    (target,) = planned.targets
    counted = stage(target, tmp_path / "counted", planned.options(request), count_content=True)
    assert counted.content is not None
    assert counted.content.step_items[0] is None  # the hostile row, first after the run
    assert counted.content.step_items[1:4] == (0, 1, 2)
    # sent one above the row before: the hostile row at 0, then each row one after its own
    assert counted.content.history_steps[:4] == (0, 1, 2, 3)
    assert counted.content.history_steps[-1] == 2000
    assert len(counted.content.history_steps) == 2001


def _set_last_step_item(log: Path, value_json: str) -> None:
    """Make the `_step` item of the last history row of `log` say `value_json`, leaving the
    row's step field as it is."""
    payloads = list(read_payloads(log))
    last = max(i for i, p in enumerate(payloads) if pb.Record.FromString(p).HasField("history"))
    record = pb.Record.FromString(payloads[last])
    (item,) = [i for i in record.history.item if list(i.nested_key) == ["_step"]]
    item.value_json = value_json
    payloads[last] = record.SerializeToString()
    from wbmerge.log import write_payloads

    write_payloads(log, payloads)


@pytest.mark.parametrize("value_json", ["true", "5"])
def test_a_step_item_that_contradicts_its_step_field_is_verified_as_sent(
    job, tmp_path, sink, monkeypatch, value_json
):
    # wandb-core sends a row's last `_step` item when that is an integer above the previous
    # row's `_step`, else the previous + 1: here, the step field's 29, whatever the item
    # says (`true`; `5`). The check after the upload must expect that, not report the run
    # incomplete.
    log = run_logs(job)[0]
    _set_last_step_item(log, value_json)
    for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    result = run_cli("sync", job, "--run-mode", "new", "-p", "steps")
    assert result.returncode == 0, result.stderr
    runs = sink.client.runs(project="steps")
    assert len(runs) == 4
    last_rows = []
    for run in runs:
        history = sink.client.run("local", "steps", run["id"])["history"]
        assert [row["_step"] for row in history] == list(range(30)), run["id"]
        last_rows.append(history[-1])
    # A rerun after a cut upload compares the server's last row with the staged one: the
    # staged row, at the `_step` it was sent at, must read as the one the server holds.
    from wbmerge.upload import Held
    from wbmerge.verify import Mismatch, history_row, remainder
    from wbmerge.wandbcore import read_staged

    staged = read_staged(log)
    assert staged.history_steps[-1] == 29

    def taken_as_sent(row: dict) -> bool:
        try:
            held = Held(True, 30, 0, 0, 29, row)
            return remainder(staged, held, lambda i: history_row(log, i)).skip_history == 30
        except Mismatch:  # (the last row of another rank)
            return False

    assert sum(map(taken_as_sent, last_rows)) == 1


def odd_steps_job(root: Path, rows: list[tuple[list, int | None]], job_id: str) -> Path:
    """A one-rank job whose history rows are `rows` (items, step field), then an exit."""
    from wbmerge.training import RankInfo

    from ..support.ranklogs import exit_record, rank_log

    with rank_log(root, RankInfo(0, 0, 1, 1, 0, job_id=job_id), f"{job_id}-0", "p") as writer:
        for items, field in rows:
            writer.write(history_record(items, field))
        writer.write(exit_record(0))
    return root


def server_steps(sink, project: str) -> list[int]:
    (run,) = sink.client.runs(project=project)
    return [row["_step"] for row in sink.client.run("local", project, run["id"])["history"]]


def test_odd_steps_arrive_where_the_count_expects_them(sink, tmp_path, monkeypatch):
    # The rows of tests/support/steprows.py: plain `wandb sync` shows that the table is the real
    # uploader's, and `wbmerge sync` verifies each run at the steps it arrives at.
    from ..support.sinktools import wandb_sync
    from ..support.steprows import ODD_ROWS

    job = odd_steps_job(tmp_path / "job", [(i, f) for i, f, _, _ in ODD_ROWS], "odd")
    plain = shutil.copytree(job / "wandb", tmp_path / "plain")
    assert wandb_sync(sink, list(plain.glob("offline-run-*")), "-p", "plain").returncode == 0
    sent = [sent for *_, sent in ODD_ROWS]
    assert server_steps(sink, "plain") == sent
    # and each row arrives as `history_row` builds it from the items, at its `_step`
    from wbmerge.verify import history_row, same_value

    (log,) = plain.glob("offline-run-*/run-*.wandb")
    rows = sink.client.run("local", "plain", "odd-0")["history"]
    built = [{**history_row(log, i), "_step": step} for i, step in enumerate(sent)]
    assert [same_value(a, b) for a, b in zip(built, rows, strict=True)] == [True] * len(sent)
    for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    result = run_cli("sync", job, "--run-mode", "new", "-p", "steps")
    assert result.returncode == 0, result.stderr
    assert "verified" in result.stderr
    assert server_steps(sink, "steps") == sent


def test_a_continued_upload_of_rows_without_steps_ends_as_a_whole_one(sink, tmp_path, monkeypatch):
    # The server holds the first 10 rows of a run; the 5 rows after them have no `_step`
    # item. Continuing the run, wandb-core would number them from 0 again (0-4, and the
    # check after the upload would fail); wbmerge sends them at 10-14, as a whole upload.
    rows = [([(["_step"], str(s)), (["loss"], str(s / 2))], s) for s in range(10)]
    rows += [([(["loss"], str(s / 2))], None) for s in range(10, 15)]
    for name, value in sink.env.items():
        monkeypatch.setenv(name, value)
    head = odd_steps_job(tmp_path / "head", rows[:10], "cont")
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state-1"))
    first = run_cli("sync", head, "--run-mode", "new", "-p", "cont")
    assert first.returncode == 0, first.stderr
    assert server_steps(sink, "cont") == list(range(10))
    whole = odd_steps_job(tmp_path / "whole", rows, "cont")
    monkeypatch.setenv("WBMERGE_STATE_DIR", str(tmp_path / "state-2"))  # (another machine)
    second = run_cli("sync", whole, "--run-mode", "new", "-p", "cont")
    assert second.returncode == 0, second.stderr
    (run,) = sink.client.runs(project="cont")
    history = sink.client.run("local", "cont", run["id"])["history"]
    assert [row["_step"] for row in history] == list(range(15))
    assert [row["loss"] for row in history] == [s / 2 for s in range(15)]


def test_config_values_nested_past_the_recursion_limit_are_no_values(job, tmp_path):
    # Discovery reads config items as JSON for rank claims and wbmerge's own block; a
    # value nested deeper than Python's recursion limit is no value, not an internal error.
    log = run_logs(job)[0]
    payloads = list(read_payloads(log))
    first = next(i for i, p in enumerate(payloads) if pb.Record.FromString(p).HasField("run"))
    record = pb.Record.FromString(payloads[first])
    for key in ("rank", "wbmerge", "local_rank"):
        record.run.config.update.add(key=key, value_json="[" * 5000)
    payloads[first] = record.SerializeToString()
    from wbmerge.log import write_payloads

    write_payloads(log, payloads)
    for args in (
        ["inspect", job],
        ["report", job],
        ["merge", job, "--run-mode", "shared", "--out", tmp_path / "out"],
    ):
        result = run_cli(*args)
        assert result.returncode == 0, (args, result.stderr)
        if args[0] == "inspect":  # the ranks still come from wbmerge's block, intact
            assert result.stdout.count(" wbmerge ") == 4, result.stdout


def _run_record(run_id: str, starting_step: int = 0, fork: tuple | None = None) -> bytes:
    record = pb.Record()
    record.run.run_id, record.run.project, record.run.starting_step = run_id, "p", starting_step
    if fork:
        point = record.run.branch_point
        point.run, point.value, point.metric = fork
    return record.SerializeToString()


# Run records and rows without a `_step` item (None), and the steps wandb-core sends them at
# (measured): it numbers from the last run record before the first row that sets a step.
RUN_RECORDS = {
    "two": ([(0,), (100,), None, None], [100, 101]),
    "one": ([(50,), None, None], [50, 51]),
    "after": ([(0,), None, (100,), None], [0, 1]),  # a run record after the first row
    "fork": ([(0, ("other", 40.0, "_step")), None, None], [41, 42]),  # one after the fork
    "unset": ([(50,), (0,), None, None], [50, 51]),
    "fraction": ([(0, ("other", 40.9, "_step")), None, None], [41, 42]),  # cut toward 0
    "negative": ([(0, ("other", -7.9, "_step")), None, None], [-6, -5]),
}
if platform.machine() in ("x86_64", "AMD64"):  # (measured there; other CPUs convert otherwise)
    # Go's int64 of NaN or of a float past its range is int64's least, on x86-64
    RUN_RECORDS["nan"] = ([(0, ("other", float("nan"), "_step")), None], [-(2**63) + 1])
    RUN_RECORDS["far"] = ([(0, ("other", 1e30, "_step")), None], [-(2**63) + 1])


def test_the_run_records_before_the_first_row_say_where_steps_start(sink, tmp_path):
    from wbmerge.log import LogWriter
    from wbmerge.wandbcore import read_staged

    from ..support.ranklogs import exit_record
    from ..support.sinktools import wandb_sync

    logs = {}
    for name, (records, _) in RUN_RECORDS.items():
        run_dir = tmp_path / f"offline-run-20260101_000000-{name}"
        run_dir.mkdir()
        logs[name] = run_dir / f"run-{name}.wandb"
        with open(logs[name], "wb") as stream, LogWriter(stream) as writer:
            for record in records:
                row = history_record([(["loss"], "1")], None)
                writer.write(row if record is None else _run_record(name, *record))
            writer.write(exit_record(0))
    assert wandb_sync(sink, [log.parent for log in logs.values()], "-p", "runs").returncode == 0
    for name, (_, sent) in RUN_RECORDS.items():
        history = sink.client.run("local", "runs", name)["history"]
        assert [row["_step"] for row in history] == sent, name
        assert list(read_staged(logs[name]).history_steps) == sent, name


def test_rows_before_the_run_record_are_moved_after_it_and_arrive(sink, tmp_path):
    """wandb-core drops history rows and system metrics that come before a log's run record
    (measured); a pass-through moves them after it, so every row arrives, verified."""
    import json

    from click.testing import CliRunner

    from wbmerge.cli import main
    from wbmerge.log import LogWriter

    from ..support.ranklogs import exit_record

    def stats(cpu):
        record = pb.Record()
        record.stats.item.add(key="cpu", value_json=str(cpu))
        record.stats.timestamp.seconds = 1767225600 + cpu
        return record.SerializeToString()

    def row(step, loss):
        return history_record([(["_step"], str(step)), (["loss"], str(loss))], None)

    run_dir = tmp_path / "wandb" / "offline-run-20260101_000000-early"
    (run_dir / "files").mkdir(parents=True)
    with open(run_dir / "run-early.wandb", "wb") as stream, LogWriter(stream) as writer:
        for payload in [
            row(0, 5),
            stats(1),
            row(1, 4),
            _run_record("early"),
            row(2, 3),
            stats(2),
            row(3, 2),
            exit_record(0),
        ]:
            writer.write(payload)
    before = (run_dir / "run-early.wandb").read_bytes()
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    args = ["sync", "--json", str(tmp_path), "--run-mode", "new", "-p", "early", "-e", "local"]
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.output + result.stderr
    [run] = json.loads(result.stdout)["runs"]
    assert run["status"] == "uploaded"
    got = sink.client.run("local", "early", run["id"])
    assert [(r["_step"], r["loss"]) for r in got["history"]] == [(0, 5), (1, 4), (2, 3), (3, 2)]
    assert [r["system.cpu"] for r in got["system_metrics"]] == [1, 2]
    assert (run_dir / "run-early.wandb").read_bytes() == before


NOT_UTF8 = b"\xffjob"  # a directory's name that is no UTF-8: bytes, as Linux allows


def rank_rows(log: Path) -> list[dict]:
    """The history rows of `log`, read with protobuf: {key: value} of each."""
    return [
        {
            "/".join(item.nested_key) or item.key: json.loads(item.value_json)
            for item in record.history.item
        }
        for record in read_records(log)
        if record.WhichOneof("record_type") == "history"
    ]


def test_a_job_under_a_directory_named_not_in_utf8_syncs_and_prints_it_escaped(
    sink, tmp_path, monkeypatch
):
    """Python hands such a name out with lone surrogates, which no UTF-8 text can hold:
    the JSON of `inspect` and `sync --dry-run` and an error line give the path with the
    byte escaped, and `sync` uploads the run and verifies it."""
    job = copy_job("one_node_4", tmp_path / os.fsdecode(NOT_UTF8))
    escaped = f"{tmp_path}/\\xffjob/wandb/offline-run-"
    shared = ["--run-mode", "shared"]
    for command in (["inspect", "--json"], ["sync", "--dry-run", "--json", *shared]):
        result = run_cli(*command, job / "wandb")
        assert result.returncode == 0, result.stderr
        assert result.stdout.encode("ascii")  # (JSON escapes any other character)
        printed = json.loads(result.stdout)
        if command[0] == "inspect":
            (primary,) = [entry["run_id"] for entry in printed if entry["rank"] == 0]
        found = printed if command[0] == "inspect" else printed[0]["sources"]
        paths = sorted(entry["path"] for entry in found)
        assert [path.encode("utf-8") for path in paths]  # no lone surrogate in them
        assert [path.startswith(escaped) for path in paths] == [True] * 4
    line = one_error_line(run_cli("inspect", job / "nothing-here"))
    assert f"{tmp_path}/\\xffjob/nothing-here" in line, line

    for name, value in {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}.items():
        monkeypatch.setenv(name, value)
    result = run_cli("sync", job / "wandb", "--run-mode", "auto", "-p", "odd-names")
    assert result.returncode == 0, result.stderr
    assert "verified" in result.stderr
    (run,) = sink.client.runs(project="odd-names")
    held = sink.client.run("local", "odd-names", run["id"])["history"]
    (log,) = job.glob(f"wandb/offline-run-*-{primary}/run-{primary}.wandb")
    rank0 = rank_rows(log)
    assert [row["_step"] for row in held] == [row["_step"] for row in rank0]
    assert [row["train/loss"] for row in held] == [row["train/loss"] for row in rank0]


def test_a_label_holding_a_lone_surrogate_is_printed_escaped(job, tmp_path):
    """JSON text may spell a lone surrogate (`"\\ud800"`), which no UTF-8 output holds: a
    rank's label of one is printed escaped in text as in JSON, never an internal error."""

    def hostile_label(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") != "run":
            return None
        for item in record.run.config.update:
            if item.key == "wbmerge":
                block = json.loads(item.value_json)
                item.value_json = json.dumps({**block, "label": "rank\ud800x"})
                changed.append(block["rank"])
        return record

    changed: list[int] = []

    rewrite_log(run_logs(job)[1], hostile_label)
    shared = ["--run-mode", "shared"]
    for command in (["inspect"], ["inspect", "--json"], ["sync", "--dry-run", *shared]):
        result = run_cli(*command, job)
        assert result.returncode == 0, result.stderr
        if "--json" in command:
            labels = [run["label"] for run in json.loads(result.stdout)]
            assert sorted(labels) == sorted(
                "rank\\ud800x" if rank in changed else f"rank-{rank}" for rank in range(4)
            )
        else:
            assert "rank\\ud800x" in result.stdout, result.stdout

"""`new`/`auto` staging: a clean log's blocks after its head are copied as they are; any other
log is framed again record by record. Either way the staged log holds the source's readable
records, only the run record rewritten (checked with protobuf, not with our reader alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.cli import main
from wbmerge.log import BLOCK_SIZE, LogWriter, ReadReport, read_payloads
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo

from ..support import synthetic
from ..support.ranklogs import exit_record, history_record, rank_log


def one_rank_job(root: Path) -> Path:
    return synthetic.write_rank(root, RankInfo(0, 0, 1, 1, 0, job_id="pt"), 300, metrics=8)


def stage_new(root: Path, out: Path):
    [staged] = merge_jobs(MergeRequest([root], run_mode="new"), out)
    return staged


def staged_records(staged) -> tuple[list[pb.Record], ReadReport]:
    report = ReadReport()
    records = [pb.Record.FromString(p) for p in read_payloads(staged.log_path, report)]
    return records, report


def without_run(records: list[pb.Record]) -> list[pb.Record]:
    return [r for r in records if not r.HasField("run")]


def test_a_clean_log_is_copied_after_its_head(tmp_path):
    log = one_rank_job(tmp_path / "job")
    staged = stage_new(tmp_path / "job", tmp_path / "out")
    assert staged.log_path.read_bytes().endswith(log.read_bytes()[BLOCK_SIZE:])
    got, report = staged_records(staged)
    source = [pb.Record.FromString(p) for p in read_payloads(log)]
    assert not report.damaged and staged.records == len(got) == len(source)
    assert without_run(got) == without_run(source)
    [run] = [r.run for r in got if r.HasField("run")]
    assert (run.run_id, run.run_group) == ("pt-rank-0", "pt")
    assert staged.exit_code == 0 and not staged.warnings


def damage(log: Path, how: str) -> None:
    data = bytearray(log.read_bytes())
    if how == "truncated":  # killed mid-write: no exit record, a cut record
        data = data[: len(data) - 3000]
    elif how == "corrupt":  # a flipped byte in the 5th block
        data[5 * BLOCK_SIZE + 999] ^= 0xFF
    log.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_a_damaged_log_is_framed_again_without_its_damage(tmp_path, how):
    log = one_rank_job(tmp_path / "job")
    damage(log, how)
    readable = [pb.Record.FromString(p) for p in read_payloads(log)]
    staged = stage_new(tmp_path / "job", tmp_path / "out")
    got, report = staged_records(staged)
    assert not report.damaged
    if how == "truncated":
        assert got[-1].exit.exit_code == 1 and staged.exit_code == 1  # a failed run
        got = got[:-1]
        assert any("without an exit record" in w for w in staged.warnings)
    else:
        assert any("corrupt" in w for w in staged.warnings)
    assert without_run(got) == without_run(readable)


def test_a_run_record_after_the_head_frames_the_whole_log_again(tmp_path):
    log = one_rank_job(tmp_path / "job")
    payloads = list(read_payloads(log))
    run = next(p for p in payloads if pb.Record.FromString(p).HasField("run"))
    with open(log, "wb") as stream, LogWriter(stream) as writer:  # a second run record
        for index, payload in enumerate(payloads):
            writer.write(payload)
            if index == len(payloads) // 2:
                writer.write(run)
    staged = stage_new(tmp_path / "job", tmp_path / "out")
    got, report = staged_records(staged)
    assert not staged.log_path.read_bytes().endswith(log.read_bytes()[BLOCK_SIZE:])
    assert without_run(got) == without_run([pb.Record.FromString(p) for p in payloads])
    runs = [r.run for r in got if r.HasField("run")]
    assert [run.run_id for run in runs] == ["pt-rank-0", "pt-rank-0"]  # both rewritten


def history_of(records: list[pb.Record]) -> list[tuple[int, dict[str, str]]]:
    """(step field, items by key) of each history record, as protobuf reads them."""
    return [
        (
            r.history.step.num,
            {"/".join(i.nested_key) or i.key: i.value_json for i in r.history.item},
        )
        for r in records
        if r.HasField("history")
    ]


def test_a_restart_that_repeats_steps_is_moved_after_them(tmp_path):
    """Restart 1 logs steps 0-19 again after restart 0's 0-29: it goes on at 30-49, its
    `_step` items too, every other value as written."""
    root = tmp_path / "job"
    logs = [
        synthetic.write_rank(root, RankInfo(0, 0, 1, 1, 0, restart=r, job_id="rs"), steps, 3)
        for r, steps in ((0, 30), (1, 20))
    ]
    staged = stage_new(root, tmp_path / "out")
    got = history_of(staged_records(staged)[0])
    sources = [history_of([pb.Record.FromString(p) for p in read_payloads(log)]) for log in logs]
    assert [step for step, _ in got] == list(range(50))
    assert [row["_step"] for _, row in got] == [str(s) for s in range(50)]
    written = [row for _, row in sources[0] + sources[1]]
    for (_, row), source_row in zip(got, written, strict=True):
        assert {**row, "_step": None} == {**source_row, "_step": None}


def test_old_wandb_rows_without_a_step_field_take_their_step_from_step_items(tmp_path):
    """wandb 0.16 writes no step field, only a `_step` item: a restart that repeats steps
    is moved by those, each row to its own step."""
    root = tmp_path / "job"
    for restart, steps in ((0, 5), (1, 3)):
        info = RankInfo(0, 0, 1, 1, 0, restart=restart, job_id="old")
        with rank_log(root, info, f"old{restart}", "p") as writer:
            for step in range(steps):
                items = [("loss", f"{restart}.{step}"), ("_step", str(step))]
                writer.write(history_record(items, step=None))
            writer.write(exit_record(0))
    got = history_of(staged_records(stage_new(root, tmp_path / "out"))[0])
    assert [row["_step"] for _, row in got] == ["0", "1", "2", "3", "4", "5", "6", "7"]
    written = ["0.0", "0.1", "0.2", "0.3", "0.4", "1.0", "1.1", "1.2"]  # restart.step
    assert [row["loss"] for _, row in got] == written


@pytest.mark.parametrize("run_mode", ["new", "shared"])
def test_a_restart_moved_past_the_largest_step_is_one_line_and_exit_2(tmp_path, run_mode):
    """Restart 1 logs steps 0 and 2**63 - 1 after restart 0's step 5: moved by 6, the last
    would pass the largest step a record holds. It used to wrap to a negative step, staged
    in silence; it is bad input, and nothing is left staged."""
    root = tmp_path / "job"
    for restart, steps in ((0, [5]), (1, [0, 2**63 - 1])):
        info = RankInfo(0, 0, 1, 1, 0, restart=restart, job_id="far")
        with rank_log(root, info, f"far{restart}", "p") as writer:
            for step in steps:
                writer.write(history_record([("loss", "1.5")], step))
            writer.write(exit_record(0))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["merge", str(root), "--run-mode", run_mode, "--out", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("wbmerge: error: a restart's step 9223372036854775807")
    assert not list(out.glob("*/*.wandb"))


def test_records_before_a_run_record_are_held_within_a_bound(tmp_path):
    import io

    from wbmerge.errors import WbmergeError
    from wbmerge.log import LogWriter, read_payloads
    from wbmerge.merge import HeldUntilTheRunRecord

    log = tmp_path / "run-x.wandb"
    with open(log, "wb") as stream, LogWriter(stream) as writer:
        held = HeldUntilTheRunRecord(writer, limit=10)
        held.write(b"early")
        held.write_many(b"..late", [2], [6])
        writer.write(b"run")
        held.release()
        held.write(b"after")
    assert list(read_payloads(log)) == [b"run", b"early", b"late", b"after"]
    with LogWriter(io.BytesIO()) as writer:
        bounded = HeldUntilTheRunRecord(writer, limit=10)
        bounded.write(b"12345")
        with pytest.raises(WbmergeError, match="before its run record"):
            bounded.write(b"123456")

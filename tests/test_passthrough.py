"""`new`/`auto` staging: a clean log's blocks after its head are copied as they are; any other
log is framed again record by record. Either way the staged log holds the source's readable
records, only the run record rewritten (checked with protobuf, not with our reader alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import synthetic
from wbmerge.pipeline import MergeRequest, merge_jobs
from wbmerge.topology import RankInfo
from wbmerge.txlog import BLOCK_SIZE, LogWriter, ReadReport, read_payloads


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

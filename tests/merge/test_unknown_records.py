"""A record of a kind this wbmerge does not know (a newer wandb's `Record` member) is refused
in one line by default, in every run mode that reads the rank that holds it, rather than
copied to an uploader that may not know it either (pass-through) or dropped (a shared run's
other ranks); `--unknown-records copy` hands it to the uploader as it is, from every rank.

The job is a real fixture (one node, 4 ranks); the record is written into a copy of a
rank's log with protobuf's own wire format, its kind a field number wandb's Record lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wbmerge.log import pb, read_payloads, read_records

from ..support.hostile import copy_job, insert_after_run_record, one_error_line, run_cli, run_logs

FUTURE_FIELD = 900  # a Record field number wandb 0.31 does not have


def future_record() -> bytes:
    """A Record with `num` and a length-delimited member numbered FUTURE_FIELD."""
    assert FUTURE_FIELD not in pb.Record.DESCRIPTOR.fields_by_number
    body = b"\x0a\x05hello"  # (a message of its own: field 1, "hello")
    tag = (FUTURE_FIELD << 3) | 2
    varint = bytes([(tag & 0x7F) | 0x80, tag >> 7])  # (two bytes: tag < 2**14)
    return b"\x08\x07" + varint + bytes([len(body)]) + body


def log_of_rank(job: Path, rank: int) -> Path:
    """The log of rank `rank`, by the `wbmerge` block of its run record (read with protobuf)."""
    for log in run_logs(job):
        for record in read_records(log):
            if record.WhichOneof("record_type") == "run":
                for item in record.run.config.update:
                    if item.key == "wbmerge" and json.loads(item.value_json)["rank"] == rank:
                        return log
                break
    raise AssertionError(f"no rank {rank}")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return copy_job("one_node_4", tmp_path / "job")


CASES = [("auto", 0), ("new", 0), ("new", 2), ("shared", 0), ("shared", 2)]


@pytest.mark.parametrize(("mode", "rank"), CASES)
def test_a_record_of_an_unknown_kind_is_refused_in_one_line(job, tmp_path, mode, rank):
    log = log_of_rank(job, rank)
    insert_after_run_record(log, [future_record()])
    out = tmp_path / "out"
    result = run_cli("merge", job / "wandb", "--run-mode", mode, "--out", out)
    line = one_error_line(result)
    assert str(log) in line and f"field {FUTURE_FIELD}" in line
    assert "--unknown-records copy" in line
    # The run that holds it is not left half-written (in `new` mode the runs of other
    # ranks, merged before it, stay whole).
    failed = f"-rank-{rank}" if mode == "new" else ""
    assert not [d for d in out.glob("offline-run-*") if d.name.endswith(failed)]


@pytest.mark.parametrize(("mode", "rank"), CASES)
def test_unknown_records_copy_hands_it_to_the_uploader_as_it_is(job, tmp_path, mode, rank):
    insert_after_run_record(log_of_rank(job, rank), [future_record()])
    out = tmp_path / "out"
    result = run_cli(
        "merge", job / "wandb", "--run-mode", mode, "--out", out, "--unknown-records", "copy"
    )
    assert result.returncode == 0, result.stderr
    holding = [
        log
        for log in out.glob("offline-run-*/run-*.wandb")
        if future_record() in list(read_payloads(log))
    ]
    assert len(holding) == 1


def test_a_rank_auto_mode_does_not_upload_is_not_read_for_unknown_records(job, tmp_path):
    insert_after_run_record(log_of_rank(job, 2), [future_record()])
    result = run_cli("merge", job / "wandb", "--run-mode", "auto", "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr

"""A shared merge of logs read in many small batches: ranks of different lengths and sizes,
so every read of every rank ends at a different step, and records between the rows (metric
definitions) that must follow the row they were written after. Checked against the source
records, parsed with protobuf."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import BLOCK_SIZE, LogWriter, read_records
from wbmerge.merge import rows, shared
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo

from ..conftest import job_dir
from ..support.ranklogs import rank_log

# rank -> (steps, first step, metrics, steps after whose row a metric is defined)
RANKS = {0: (1500, 0, 12, (3, 700)), 1: (900, 40, 4, (41, 899)), 2: (1700, 0, 25, ())}


def write_rank(root: Path, rank: int) -> dict[int, dict[str, str]]:
    """One rank's log; returns its rows: step -> {key: value_json}."""
    steps, first, metrics, defines = RANKS[rank]
    info = RankInfo(rank, rank, len(RANKS), len(RANKS), 0, job_id="batches")
    rows: dict[int, dict[str, str]] = {}
    with rank_log(root, info, f"bat{rank}", "batches") as writer:
        for step in range(first, first + steps):
            values = {f"m{m}": repr((rank + 1) * step + m / 7) for m in range(metrics)}
            rows[step] = values
            record = pb.Record()
            for key, value in {**values, "_step": str(step), "_runtime": str(step)}.items():
                item = record.history.item.add()
                item.key, item.value_json = key, value
            record.history.step.num = step
            writer.write(record.SerializeToString())
            if step in defines:
                record = pb.Record()
                record.metric.name = f"defined_after_{step}"
                writer.write(record.SerializeToString())
        record = pb.Record()
        record.exit.exit_code = 0
        writer.write(record.SerializeToString())
    return rows


def test_rows_and_records_between_them_across_many_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(shared, "READ_BUDGET", BLOCK_SIZE)  # the smallest: a block a turn
    sources = {rank: write_rank(tmp_path / "job", rank) for rank in RANKS}
    staged = merge_jobs(MergeRequest([tmp_path / "job"], run_mode="shared"), tmp_path / "out")
    [target] = staged
    assert target.source_rows == sum(len(rows) for rows in sources.values())

    merged: list[tuple[int, dict[str, str]]] = []
    defined: dict[str, int] = {}  # metric -> the step of the row before it
    for record in read_records(target.log_path):
        if record.HasField("history"):
            row = {item.key or item.nested_key[0]: item.value_json for item in record.history.item}
            merged.append((record.history.step.num, row))
        elif record.HasField("metric"):
            defined[record.metric.name] = merged[-1][0]
    steps = [step for step, _ in merged]
    assert steps == sorted(set().union(*sources.values()))  # one row per step, in order
    for step, row in merged:
        want = {
            f"{key}/rank-{rank}": value
            for rank, rows in sources.items()
            for key, value in rows.get(step, {}).items()
        }
        assert {k: v for k, v in row.items() if not k.startswith("_")} == want, step
        assert row["_step"] == str(step)
    assert defined == {
        f"defined_after_{step}/rank-{rank}": step
        for rank, (_, _, _, defines) in RANKS.items()
        for step in defines
    }


@pytest.mark.parametrize(
    "job", ["elastic_restart", "killed_rank", "two_nodes_2x2", "media", "cadence"]
)
def test_the_merged_run_does_not_depend_on_how_much_is_read_at_a_time(tmp_path, monkeypatch, job):
    """A turn of a block of one rank, or every rank's whole log at once: the same bytes, the
    same counts and warnings (restarts, a killed rank, media, ranks at other cadences)."""
    request = MergeRequest([job_dir(job)], run_mode="shared", skew_metrics=True)
    # Both in one place in turn: a staged artifact record names its copies by their path.
    [whole] = merge_jobs(request, tmp_path / "out")
    whole_log = whole.log_path.read_bytes()
    shutil.rmtree(tmp_path / "out")
    monkeypatch.setattr(shared, "READ_BUDGET", BLOCK_SIZE)
    [small] = merge_jobs(request, tmp_path / "out")
    assert small.log_path.read_bytes() == whole_log
    assert (small.history_rows, small.source_rows, small.warnings) == (
        whole.history_rows,
        whole.source_rows,
        whole.warnings,
    )
    assert whole.history_rows > 0


def test_the_rows_of_a_turn_are_written_in_bounded_batches(tmp_path, monkeypatch):
    """Memory that does not grow with ranks: a turn that makes many merged rows at once
    (every rank's first block, at a thousand ranks) hands them to the writer a batch at a
    time, never all joined in one buffer; the log is the same as one written whole."""
    for rank in RANKS:
        write_rank(tmp_path / "job", rank)
    request = MergeRequest([tmp_path / "job"], run_mode="shared")
    [whole] = merge_jobs(request, tmp_path / "whole")
    batches: list[int] = []
    write_many = LogWriter.write_many

    def counted(writer, data, starts, ends):
        batches.append(len(data))
        return write_many(writer, data, starts, ends)

    monkeypatch.setattr(LogWriter, "write_many", counted)
    monkeypatch.setattr(rows, "WRITE_BATCH", 4096)
    [small] = merge_jobs(request, tmp_path / "small")
    assert small.log_path.read_bytes() == whole.log_path.read_bytes()
    largest_row = max(len(r.SerializeToString()) for r in read_records(whole.log_path))
    assert len(batches) > 10
    assert max(batches) < 4096 + largest_row

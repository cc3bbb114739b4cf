"""`wbmerge export`: the Parquet file read back equals the source values, for every fixture."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.analyse import export, per_value
from wbmerge.cli import main
from wbmerge.errors import WbmergeError
from wbmerge.identify import discover
from wbmerge.log import read_records

from ..conftest import JOBS, job_dir

EXPORTABLE = [j for j in JOBS if j != "no_metadata"]
RESERVED = ("_step", "_runtime", "_timestamp", "_wandb")


def _value(text: str) -> tuple[float | None, str | None]:
    """What the export should hold for a JSON text, decided with the json module."""
    number = json.loads(text) if text else None
    if isinstance(number, bool) or not isinstance(number, int | float):
        return None, text
    return float(number), None


def expected_values(job: str) -> list[tuple]:
    """(rank, restart, kind, step, key, value, value_json) of every source value, parsed with
    protobuf; the steps of a restart continue after its rank's last step, as the merge does."""
    out = []
    last: dict[int, int] = {}
    runs = sorted(discover([job_dir(job)]), key=lambda r: (r.rank.rank, r.rank.restart))
    for run in runs:
        rank = run.rank.rank
        shift = None
        for record in read_records(run.path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                step = record.history.step.num
                if shift is None:
                    shift = max(0, last.get(rank, -1) + 1 - step)
                step += shift
                last[rank] = step
                for item in record.history.item:
                    path = list(item.nested_key) or [item.key]
                    if path[0] in RESERVED:
                        continue
                    out.append(
                        (
                            rank,
                            run.rank.restart,
                            "history",
                            step,
                            ".".join(path),
                            *_value(item.value_json),
                        )
                    )
            elif kind == "stats":
                for item in record.stats.item:
                    key = item.key.split("/l:")[0]
                    out.append(
                        (rank, run.rank.restart, "system", None, key, *_value(item.value_json))
                    )
    return out


def _comparable(rows: list[tuple]) -> list[tuple]:
    """NaN != NaN: compare it as a marker."""
    return sorted(
        (
            tuple("nan" if isinstance(v, float) and math.isnan(v) else v for v in row)
            for row in rows
        ),
        key=repr,
    )


@pytest.mark.parametrize("job", EXPORTABLE)
def test_every_value_step_and_rank_reads_back_exactly(job, tmp_path):
    out = tmp_path / "values.parquet"
    result = export([job_dir(job)], out)
    table = pq.read_table(out)
    got = [
        (r["rank"], r["restart"], r["kind"], r["step"], r["key"], r["value"], r["value_json"])
        for r in table.to_pylist()
    ]
    expected = expected_values(job)
    assert len(got) == result.rows == len(expected)
    assert _comparable(got) == _comparable(expected)
    assert set(table.column("job_id").to_pylist()) == {r.job_id for r in discover([job_dir(job)])}
    assert _identities(table.to_pylist()) == _identities_of_runs(job)


def _identities(rows: list[dict]) -> set[tuple]:
    return {
        (
            r["job_id"],
            r["rank"],
            r["restart"],
            r["run_id"],
            r["local_rank"],
            r["worker"],
            r["label"],
        )
        for r in rows
    }


def _identities_of_runs(job: str) -> set[tuple]:
    """What each run's rows should say of it, from discovery."""
    return {
        (
            r.job_id,
            r.rank.rank,
            r.rank.restart,
            r.path.name.removeprefix("run-").removesuffix(".wandb"),
            r.rank.local_rank,
            r.rank.worker,
            r.label or r.rank.label,
        )
        for r in discover([job_dir(job)])
    }


def test_row_groups_cut_across_ranks_keep_each_rows_identity(tmp_path):
    """Row groups smaller than a rank's values: the identity columns are made once a row
    group, for parts of several ranks and kinds; every row must still say whose it is."""
    out = tmp_path / "values.parquet"
    export([job_dir("two_nodes_2x2")], out, row_group=150)
    with pytest.raises(WbmergeError, match="row_group must be at least 1"):
        export([job_dir("two_nodes_2x2")], out, row_group=0)
    parquet = pq.ParquetFile(out)
    groups = [parquet.read_row_group(i).to_pylist() for i in range(parquet.num_row_groups)]
    mixed = [g for g in groups if len({(r["rank"], r["kind"]) for r in g}) > 1]
    assert len(groups) > 2 and mixed
    table = parquet.read()
    assert _identities(table.to_pylist()) == _identities_of_runs("two_nodes_2x2")
    assert _comparable(
        [
            (r["rank"], r["restart"], r["kind"], r["step"], r["key"], r["value"], r["value_json"])
            for r in table.to_pylist()
        ]
    ) == _comparable(expected_values("two_nodes_2x2"))


def test_identity_kind_and_key_are_declared_never_null(tmp_path):
    out = tmp_path / "values.parquet"
    export([job_dir("one_node_4")], out)
    schema = pq.read_schema(out)
    required = {
        "job_id",
        "run_id",
        "rank",
        "local_rank",
        "worker",
        "label",
        "restart",
        "kind",
        "key",
    }
    assert {f.name for f in schema if not f.nullable} == required


def test_string_columns_are_dictionary_encoded(tmp_path):
    out = tmp_path / "values.parquet"
    export([job_dir("one_node_4")], out)
    schema = pq.read_schema(out)
    for name in ("job_id", "run_id", "label", "kind", "key"):
        assert str(schema.field(name).type).startswith("dictionary<values=string")
    metadata = pq.ParquetFile(out).metadata.row_group(0)
    key_column = metadata.column(schema.get_field_index("key"))
    assert "RLE_DICTIONARY" in str(key_column.encodings)


def test_history_timestamp_and_runtime_are_the_rows(tmp_path):
    out = tmp_path / "values.parquet"
    export([job_dir("one_node_4")], out)
    rows = [r for r in pq.read_table(out).to_pylist() if r["kind"] == "history"]
    run = next(r for r in discover([job_dir("one_node_4")]) if r.rank.rank == 1)
    times = {}
    for record in read_records(run.path):
        if record.WhichOneof("record_type") == "history":
            items = {(list(i.nested_key) or [i.key])[0]: i.value_json for i in record.history.item}
            times[record.history.step.num] = (float(items["_timestamp"]), float(items["_runtime"]))
    for row in rows:
        if row["rank"] == 1:
            assert (row["timestamp"], row["runtime"]) == times[row["step"]]


def test_wide_has_a_column_per_key_and_the_same_values(tmp_path):
    long_out, wide_out = tmp_path / "long.parquet", tmp_path / "wide.parquet"
    export([job_dir("media")], long_out)
    export([job_dir("media")], wide_out, wide=True)
    long_rows = [r for r in pq.read_table(long_out).to_pylist() if r["kind"] == "history"]
    wide = pq.read_table(wide_out)
    assert {"_rank", "_step", "rank", "train/loss", "samples/image.path"} <= set(wide.column_names)
    by_row = {(r["_rank"], r["_step"]): r for r in wide.to_pylist()}
    for row in long_rows:
        cell = by_row[row["rank"], row["step"]][row["key"]]
        if row["value_json"] is not None:
            assert cell == row["value_json"]
        elif isinstance(cell, str):  # a key that is not always a number
            assert float(cell) == row["value"]
        else:
            assert cell == row["value"]
    logged = {(r["rank"], r["step"]) for r in long_rows}
    assert set(by_row) == logged


def test_cli_writes_the_file_and_says_what_it_wrote(tmp_path):
    out = tmp_path / "runs.parquet"
    result = CliRunner().invoke(main, ["export", str(job_dir("two_nodes_2x2")), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "of 4 ranks" in result.output and str(out) in result.output
    assert pq.read_table(out).num_rows == len(expected_values("two_nodes_2x2"))


def test_cli_bad_input_is_one_line_and_leaves_no_file(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(tmp_path), "--out", str(tmp_path / "x.parquet")])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("wbmerge: error:")
    assert not list(tmp_path.iterdir())
    result = runner.invoke(main, ["export", str(job_dir("one_node_4")), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in result.output


def test_export_never_writes_to_the_sources(tmp_path):
    before = {p: p.stat().st_mtime_ns for p in job_dir("killed_rank").rglob("*")}
    export([job_dir("killed_rank")], tmp_path / "k.parquet")
    assert {p: p.stat().st_mtime_ns for p in job_dir("killed_rank").rglob("*")} == before


def test_record_kinds_used_by_the_reference_exist():
    assert {"history", "stats"} <= set(pb.Record.DESCRIPTOR.fields_by_name)


def test_damaged_log_exports_its_readable_records_and_says_what_was_lost(tmp_path):
    damaged = job_dir("damaged") / "corrupt_block"
    out = tmp_path / "d.parquet"
    result = CliRunner().invoke(main, ["export", str(damaged), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (
        "records /" in result.output and "dropped; the readable records are used" in result.output
    )
    assert (  # one rank of the killed job: the others are named, as report names them
        "wbmerge: warning: job fx-killed-rank: rank(s) 1, 2, 3 have no offline run; the "
        "export covers the others" in result.stderr
    )
    (run,) = discover([damaged])
    expected = 0
    for record in read_records(run.path):  # the same tolerant reader: every readable value
        kind = record.WhichOneof("record_type")
        if kind == "history":
            expected += sum(
                (list(i.nested_key) or [i.key])[0] not in RESERVED for i in record.history.item
            )
        elif kind == "stats":
            expected += len(record.stats.item)
    assert pq.read_table(out).num_rows == expected > 0


def test_a_rows_time_is_each_of_its_values_and_null_where_the_row_has_none():
    rows = np.array([1.5, 2.5, 3.5])
    assert per_value(rows, np.array([0, 0, 2, 1])).to_pylist() == [1.5, 1.5, 3.5, 2.5]
    rows[2] = np.nan  # a row without `_timestamp`
    assert per_value(rows, np.array([0, 2, 2, 1])).to_pylist() == [1.5, None, None, 2.5]

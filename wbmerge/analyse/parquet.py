"""`wbmerge export`: the values of every rank of a job in one Parquet file, from the offline
runs alone, for pandas, polars and DuckDB.

Long format (one row per logged value, history and system metrics) or, with `wide`, one
row per rank and step with a column per history key. Written row group by row group while
reading, so memory does not grow with the number of steps; written to a scratch name and
renamed at the end, so a file at `out` is always whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import safepaths
from ..errors import WbmergeError
from ..identify import Hints, Job, discover, group_jobs
from ..plan import Source
from ..runtime import streaming
from .columns import HISTORY, Columns, rank_columns, rank_sources

_TEXT = pa.dictionary(pa.int32(), pa.string())
# Who each value is from, the same for a whole read of a rank: made once a row group
# (`_identity_columns`). Never null, so declared so: the writer then stores no levels.
IDENTITY = [
    pa.field("job_id", _TEXT, False),
    pa.field("run_id", _TEXT, False),
    pa.field("rank", pa.int32(), False),
    pa.field("local_rank", pa.int32(), False),
    pa.field("worker", pa.int32(), False),
    pa.field("label", _TEXT, False),
    pa.field("restart", pa.int32(), False),
]
LONG_SCHEMA = pa.schema(
    [
        *IDENTITY,
        pa.field("kind", _TEXT, False),
        ("step", pa.int64()),
        ("timestamp", pa.float64()),
        ("runtime", pa.float64()),
        pa.field("key", _TEXT, False),
        ("value", pa.float64()),
        ("value_json", pa.string()),
    ]
)
# Wide: the rank's and row's columns are named as W&B names its own keys (`_step`), so
# that no metric key (a job may well log "rank") can take their place.
WIDE_FIXED = [
    f.with_name(f"_{f.name}")
    for f in LONG_SCHEMA
    if f.name not in ("kind", "key", "value", "value_json")
]
# Values per row group of the long table: about 40 MB in memory while a group is gathered.
ROW_GROUP = 1 << 20


@dataclass
class ExportResult:
    path: Path
    rows: int = 0
    jobs: list[str] = field(default_factory=list)
    ranks: int = 0
    missing: dict[str, list[int]] = field(default_factory=dict)  # job id -> missing ranks
    damage: list[str] = field(default_factory=list)  # what damaged logs lost
    warnings: list[str] = field(default_factory=list)  # what was assumed about ranks


def export(
    paths: Sequence[str | Path],
    out: str | Path,
    job: str | None = None,
    wide: bool = False,
    hints: Hints | None = None,
    row_group: int = ROW_GROUP,
) -> ExportResult:
    """Write the values of the jobs found under `paths` (or of `job`) to `out`; `hints` say
    how to read the ranks of runs written without wbmerge. The long table is written in row
    groups of `row_group` values (readers load a row group at a time)."""
    if row_group < 1:
        raise WbmergeError(f"row_group must be at least 1, not {row_group}")
    out = Path(out)
    if out.is_dir():
        raise WbmergeError(f"{out} is a directory; give a file name such as {out}/runs.parquet")
    runs = discover(paths, hints=hints)
    run_dir = _run_directory_holding(out)
    if run_dir is not None:  # it could replace a run's log or one of its files
        raise WbmergeError(
            f"-o {out} is inside the run directory {run_dir}; write the export outside "
            "the runs (sources are never written)"
        )
    safepaths.check_out_file(out, "-o")  # (after: a link loop is said as one)
    jobs = group_jobs(runs, job, allow_missing_ranks=True)
    result = ExportResult(out, jobs=[j.job_id for j in jobs])
    result.warnings = [w for j in jobs for w in j.warnings]
    result.missing = {j.job_id: j.missing_ranks for j in jobs if j.missing_ranks}
    scratch = out.with_name(f".{out.name}.partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    _create_scratch(scratch)
    try:
        with streaming():
            if wide:
                _write_wide(jobs, scratch, result)
            else:
                _write_long(jobs, scratch, result, row_group)
        os.replace(scratch, out)
    finally:
        scratch.unlink(missing_ok=True)
    return result


def _create_scratch(scratch: Path) -> None:
    """Make the scratch file anew, never through a link planted at its name (the writer
    opens it by name): one left by a killed export is removed first (a link itself, not
    what it names)."""
    try:
        scratch.unlink(missing_ok=True)
        os.close(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError as exc:
        raise WbmergeError(f"-o: cannot write {scratch} ({exc.strerror or exc})") from None


def _run_directory_holding(out: Path, option: str = "-o") -> Path | None:
    """The offline run directory `out` would be written in, if any: the nearest directory
    above it (links resolved) that holds a `run-*.wandb` log, whether or not the export
    reads that run (a neighbour's log can be replaced as easily as a source's)."""
    try:
        where = out.resolve().parent
    except (OSError, RuntimeError) as exc:  # a link loop
        raise WbmergeError(f"{option} {out}: cannot be resolved ({exc})") from None
    for directory in (where, *where.parents):
        try:
            if any(directory.glob("run-*.wandb")):
                return directory
        except OSError:
            continue  # (a directory we may not list holds nothing we would replace)
    return None


def _write_long(jobs: list[Job], scratch: Path, result: ExportResult, row_group: int) -> None:
    with _writer(scratch, LONG_SCHEMA) as writer:
        group: list[tuple[str, Columns]] = []  # (job id, values) of the next row group
        size = 0
        for job in jobs:
            for sources in rank_sources(job):
                result.ranks += 1
                for columns in rank_columns(sources, result.damage):
                    group.append((job.job_id, columns))
                    size += len(columns)
                    result.rows += len(columns)
                    if size >= row_group:
                        _write_group(writer, group)
                        group, size = [], 0
        if group:
            _write_group(writer, group)


_PER_VALUE = [f.name for f in LONG_SCHEMA][len(IDENTITY) + 1 :]  # after the identity, kind


def _write_group(writer: pq.ParquetWriter, group: list[tuple[str, Columns]]) -> None:
    """One row group. Its text columns share one dictionary: a dictionary per part would
    make the writer re-encode every value."""
    fixed = _identity_columns(
        [(*_identity(job_id, c.source), c.kind) for job_id, c in group],
        [len(c) for _, c in group],
        LONG_SCHEMA,
    )
    values = [pa.chunked_array([getattr(c, name) for _, c in group]) for name in _PER_VALUE]
    table = pa.table(fixed + values, schema=LONG_SCHEMA).unify_dictionaries()
    writer.write_table(table, row_group_size=len(table))


def _writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """Dictionary pages for the text columns only: floats rarely repeat, and encoding them
    cost half the write time for nothing. Min/max statistics (what readers skip row groups
    by) for the identity, step and time columns only: on the text columns they cost a third
    of the write, and on `value`, whose row groups mix every key, a quarter of its. Values
    are taken 64k at a time, not 1k: a tenth less write time, for pages that may outgrow
    the 1 MB page size by one batch."""
    text = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    numbers = [f.name for f in schema if not pa.types.is_dictionary(f.type)]
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=1,
        use_dictionary=text,
        write_statistics=[name for name in numbers if name not in ("value", "value_json")],
        write_batch_size=1 << 16,
    )


def _identity(job_id: str, source: Source) -> tuple:
    """The values of the `IDENTITY` columns for `source`."""
    rank = source.rank
    return (
        job_id,
        source.run_id,
        rank.rank,
        rank.local_rank,
        rank.worker,
        source.label,
        rank.restart,
    )


def _identity_columns(
    identities: list[tuple], lengths: list[int], schema: pa.Schema
) -> list[pa.Array]:
    """The first columns of `schema` for runs of rows: `lengths[i]` rows hold `identities[i]`,
    run after run. Text as a dictionary of the distinct values."""
    columns = []
    for i in range(len(identities[0])):
        field = schema.field(i)
        values = [identity[i] for identity in identities]
        if pa.types.is_dictionary(field.type):
            distinct = list(dict.fromkeys(values))
            codes = _runs([distinct.index(v) for v in values], lengths)
            columns.append(pa.DictionaryArray.from_arrays(codes, pa.array(distinct, pa.string())))
        else:
            columns.append(pa.array(_runs(values, lengths), field.type))
    return columns


def _runs(numbers: list[int], lengths: list[int]) -> np.ndarray:
    """`numbers[i]` `lengths[i]` times, run after run, as int32."""
    out = np.empty(sum(lengths), np.int32)
    at = 0
    for number, length in zip(numbers, lengths, strict=True):
        out[at : at + length] = number
        at += length
    return out


def _write_wide(jobs: list[Job], scratch: Path, result: ExportResult) -> None:
    """Two passes: the keys (and whether each is always a number), then the rows."""
    numeric: dict[str, bool] = {}
    for job in jobs:
        for sources in rank_sources(job):
            for columns in rank_columns(sources):
                if columns.kind != HISTORY:
                    continue
                texts = columns.value_json.is_valid().to_numpy(zero_copy_only=False)
                for key, text in zip(columns.key.to_pylist(), texts, strict=True):
                    numeric[key] = numeric.get(key, True) and not text
    keys = sorted(numeric)
    schema = pa.schema(
        WIDE_FIXED + [(k, pa.float64() if numeric[k] else pa.string()) for k in keys]
    )
    with _writer(scratch, schema) as writer:
        for job in jobs:
            for sources in rank_sources(job):
                result.ranks += 1
                for columns in rank_columns(sources, result.damage):
                    if columns.kind != HISTORY or not len(columns):
                        continue
                    table = _wide_table(job.job_id, columns, schema, keys)
                    result.rows += len(table)
                    writer.write_table(table)


def _wide_table(job_id: str, columns: Columns, schema: pa.Schema, keys: list[str]) -> pa.Table:
    source = columns.source
    steps = columns.step.to_numpy()
    row_steps, row = np.unique(steps, return_inverse=True)
    count = len(row_steps)
    first = np.zeros(count, np.int64)
    first[row[::-1]] = np.arange(len(row))[::-1]  # each row's first value: its times
    identity = _identity_columns([_identity(job_id, source)], [count], schema)
    data = {
        **dict(zip(schema.names[: len(identity)], identity, strict=True)),
        "_step": pa.array(row_steps, pa.int64()),
        "_timestamp": columns.timestamp.take(pa.array(first)),
        "_runtime": columns.runtime.take(pa.array(first)),
    }
    encoded = columns.key
    index = encoded.indices.to_numpy()
    present = {name: i for i, name in enumerate(encoded.dictionary.to_pylist())}
    values = columns.value.to_numpy(zero_copy_only=False)
    texts = columns.value_json
    for key in keys:
        field_type = schema.field(key).type
        if key not in present:
            data[key] = pa.nulls(count, field_type)
            continue
        where = np.flatnonzero(index == present[key])
        if pa.types.is_floating(field_type):
            column = np.full(count, np.nan)
            column[row[where]] = values[where]
            missing = np.ones(count, bool)
            missing[row[where]] = False
            data[key] = pa.array(column, mask=missing)
        else:
            cells: list = [None] * count
            chosen = texts.take(pa.array(where)).to_pylist()
            numbers = values[where]
            for r, text, number in zip(row[where].tolist(), chosen, numbers, strict=True):
                cells[r] = text if text is not None else repr(float(number))
            data[key] = pa.array(cells, pa.string())
    return pa.table(data, schema=schema)

"""One rank's history and system metrics as columns, a window of records at a time.

What `export` writes to Parquet and `report` summarises: one entry per logged value, with
the step (continued across elastic restarts, as the merge does), the row's `_timestamp` and
`_runtime`, the key (a nested key joined with "."), and the value as a float64 when it is a
JSON number (NaN and infinities included) or else as its JSON text. A dict that older wandb
(0.16) wrote as one value, a JSON object, is split into its leaves, named as wandb-core names
the keys it splits a dict into, so that runs of every version export alike. History items are split
as columns (`items`); system-metric records are few and parsed one by one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..identify import Job
from ..log import RESERVED, ReadReport, Steps, items, pb, records, wire
from ..plan import Source

HISTORY = "history"
SYSTEM = "system"
_READ_SIZE = 4 << 20  # a few thousand rows a read: array work pays per read, not per row
_STATS_WINDOW = 4096


@dataclass
class Columns:
    """Values of one rank, one entry each (numpy / arrow arrays of equal length)."""

    source: Source  # the run (rank, restart) the values are from
    kind: str  # HISTORY or SYSTEM
    step: pa.Array  # int64; null for system metrics
    timestamp: pa.Array  # float64 seconds
    runtime: pa.Array  # float64 seconds; null for system metrics
    key: pa.DictionaryArray  # strings
    value: pa.Array  # float64; null when the value is not a number
    value_json: pa.Array  # string; null when the value is a number

    def __len__(self) -> int:
        return len(self.key)


def rank_sources(job: Job) -> Iterator[list[Source]]:
    """Each rank's sources, restarts in order."""
    by_rank: dict[int, list] = {}
    for run in job.runs:
        by_rank.setdefault(run.rank.rank, []).append(run)
    for rank in sorted(by_rank):
        runs = sorted(by_rank[rank], key=lambda r: r.rank.restart)
        yield [r.source() for r in runs]


def rank_columns(sources: list[Source], damage: list[str] | None = None) -> Iterator[Columns]:
    """The values of one rank's runs (its restarts, in order), a read of its log at a time.
    What a damaged log lost (a corrupt block, a truncated tail) is appended to `damage`, as
    is the end of a rank whose last log has no exit record (killed, or still writing): the
    values a report gives then stop short of the others'."""
    steps = Steps()
    for number, source in enumerate(sources, start=1):
        steps.restart()
        stats: list[bytes] = []
        report = ReadReport()
        exits, last_step = 0, None
        for index in records.read_indexed(source.path, report, read_size=_READ_SIZE):
            rows = index.rows
            placed = steps.place_rows(rows.steps)  # as the merge does
            exits += len(index.of("exit"))
            if len(rows):
                if placed.max() >= 0:  # (a read whose rows a restart all dropped: -1)
                    last_step = int(placed.max())
                yield _history(rows, placed, source)
            stats += map(index.frames.payload, index.of("stats").tolist())
            if len(stats) >= _STATS_WINDOW:
                yield _system(stats, source)
                stats = []
        if stats:
            yield _system(stats, source)
        if damage is None:
            continue
        last = number == len(sources)  # (an earlier restart is continued by the next)
        until = "; the next restart continues" if not last else ""
        if last and last_step is not None:
            until = f"; its values end at step {last_step}"
        if report.describe():
            damage.append(
                f"{source.path}: {report.describe()}; the readable records are used{until}"
            )
        elif not exits:  # (a rank killed between records, or one still writing)
            still = " (killed, or still writing)" if last else ""
            damage.append(f"{source.path}: no exit record{still}{until}")


def _history(rows: records.HistoryRows, placed: np.ndarray, source: Source) -> Columns:
    kept = placed >= 0
    starts, ends = rows.starts[kept], rows.ends[kept]
    batch = items.split_spans(rows.data, starts, ends)
    if batch is not None:
        try:
            return _history_of(placed[kept], batch, source)
        except ValueError:
            pass  # a key part that is not one: the split does not hold
    regions = [rows.data[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    return _history_of(placed[kept], items.split_exact(regions), source)


def _history_of(step: np.ndarray, batch: items.Items, source: Source) -> Columns:
    index, raw_keys = batch.key_codes()
    paths = [wire.key_path(raw) for raw in raw_keys]
    names = [".".join(path) for path in paths]
    distinct = list(dict.fromkeys(names))
    if len(distinct) < len(names):  # one key written as `key` and as `nested_key`: one name
        position = {name: at for at, name in enumerate(distinct)}
        index = np.array([position[name] for name in names], np.int64)[index]
        paths = [paths[names.index(name)] for name in distinct]
        names = distinct
    user = np.flatnonzero(np.array([path[0] not in RESERVED for path in paths], bool)[index])
    stamps, runtimes = _where(index, names, "_timestamp"), _where(index, names, "_runtime")
    # the values and the rows' times cut out and cast together, the values first
    numbers, texts = items.json_numbers(batch.json(np.concatenate([user, stamps, runtimes])))
    times = numbers.slice(len(user))
    timestamp = _per_row(len(step), batch.row[stamps], times.slice(0, len(stamps)))
    runtime = _per_row(len(step), batch.row[runtimes], times.slice(len(stamps)))
    row, codes = batch.row[user], index[user]
    value, value_json = numbers.slice(0, len(user)), texts.slice(0, len(user))
    if value_json.null_count < len(value_json):  # values that are not numbers: dicts?
        row, codes, value, value_json = _leaves_of_dicts(row, codes, value, value_json, names)
    keys = pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(names, pa.string()))
    return Columns(
        source=source,
        kind=HISTORY,
        step=pa.array(step[row]),
        timestamp=per_value(timestamp, row),
        runtime=per_value(runtime, row),
        key=keys,
        value=value,
        value_json=value_json,
    )


def _leaves_of_dicts(
    row: np.ndarray, codes: np.ndarray, value: pa.Array, value_json: pa.Array, names: list[str]
) -> tuple[np.ndarray, np.ndarray, pa.Array, pa.Array]:
    """A logged dict that is one value, a JSON object (wandb 0.16 writes `{"eval": {"loss":
    1}}` so), as one value per leaf named as wandb-core names them (`eval.loss`), in its
    row's place; a media value (an object with `_type`) or an empty one stays whole. New
    names are added to `names`."""
    objects = pc.fill_null(pc.starts_with(value_json, "{"), False)
    candidates = np.flatnonzero(objects.to_numpy(zero_copy_only=False))
    if not len(candidates):
        return row, codes, value, value_json
    position = {name: at for at, name in enumerate(names)}
    whole: list[int] = []
    added_rows: list[int] = []
    added_codes: list[int] = []
    added_numbers: list[float | None] = []
    added_texts: list[str | None] = []
    texts = value_json.take(pa.array(candidates)).to_pylist()
    for at, text in zip(candidates.tolist(), texts, strict=True):
        try:
            leaves = _leaves(json.loads(text), names[codes[at]])
        except (ValueError, RecursionError):
            continue
        if not leaves:
            continue
        whole.append(at)
        for name, leaf in leaves:
            if name not in position:
                position[name] = len(names)
                names.append(name)
            number = _number(leaf)
            added_rows.append(int(row[at]))
            added_codes.append(position[name])
            added_numbers.append(number)
            added_texts.append(None if number is not None else json.dumps(leaf))
    if not whole:
        return row, codes, value, value_json
    keep = np.setdiff1d(np.arange(len(row)), np.array(whole, np.int64))
    rows = np.concatenate([row[keep], np.array(added_rows, np.int64)])
    order = np.argsort(rows, kind="stable")  # each leaf in its row's place
    taken, kept = pa.array(order), pa.array(keep)
    return (
        rows[order],
        np.concatenate([codes[keep], np.array(added_codes, codes.dtype)])[order],
        pa.concat_arrays([value.take(kept), pa.array(added_numbers, pa.float64())]).take(taken),
        pa.concat_arrays([value_json.take(kept), pa.array(added_texts, value_json.type)]).take(
            taken
        ),
    )


def _leaves(value: object, name: str) -> list[tuple[str, object]]:
    """(name, leaf) of every leaf of a dict that wandb-core would have split into keys;
    empty for anything else."""
    if not isinstance(value, dict) or not value or "_type" in value:
        return []
    found = []
    for key, inner in value.items():
        found.extend(_leaves(inner, f"{name}.{key}") or [(f"{name}.{key}", inner)])
    return found


def _number(leaf: object) -> float | None:
    """A JSON number's float64 (NaN and infinities included), else None."""
    if isinstance(leaf, bool) or not isinstance(leaf, int | float):
        return None
    try:
        return float(leaf)
    except OverflowError:  # an integer beyond float64: kept as its text
        return None


def _where(index: np.ndarray, names: list[str], name: str) -> np.ndarray:
    """The items logged under `name`."""
    if name not in names:
        return np.empty(0, np.int64)
    return np.flatnonzero(index == names.index(name))


def _per_row(count: int, rows: np.ndarray, numbers: pa.Array) -> np.ndarray:
    """`numbers[i]` at row `rows[i]`, NaN in the rows that have none."""
    out = np.full(count, np.nan)
    out[rows] = numbers.to_numpy(zero_copy_only=False)
    return out


def per_value(per_row: np.ndarray, row: np.ndarray) -> pa.Array:
    """Each value's row's number, null where the row has none (NaN); the mask is made
    only when some row has none, as rows usually all do."""
    missing = np.isnan(per_row)
    if not missing.any():
        return pa.array(per_row[row])
    return pa.array(per_row[row], mask=missing[row])


def _system(payloads: list[bytes], source: Source) -> Columns:
    """System metrics: keys without the `/l:{label}` suffix (the label has its own column)."""
    timestamps, keys, texts = [], [], []
    for payload in payloads:
        record = pb.Record.FromString(payload).stats
        when = record.timestamp.seconds + record.timestamp.nanos / 1e9
        for item in record.item:
            key = item.key
            if "/l:" in key:
                key = key[: key.rindex("/l:")]
            timestamps.append(when)
            keys.append(key)
            texts.append(item.value_json)
    value, value_json = items.json_numbers(pa.array(texts, pa.string()))
    count = len(keys)
    return Columns(
        source=source,
        kind=SYSTEM,
        step=pa.nulls(count, pa.int64()),
        timestamp=pa.array(timestamps, pa.float64()),
        runtime=pa.nulls(count, pa.float64()),
        key=pa.array(keys, pa.string()).dictionary_encode(),
        value=value,
        value_json=value_json,
    )

"""Merged history rows: the rows of every rank at one step become one record, and every
rank's final summary one summary record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..log import LogWriter, wire
from .labels import Labelled, RankKeys, Row, names_of
from .rowstats import MergedRankStats

STEP_KEY = wire.key_part(["_step"])


@dataclass
class Rows:
    """History rows on their way to merged rows, as columns: row i is of rank `ranks[i]` at
    `steps[i]`, its `Row` the i-th of the other columns (object arrays, so that taking rows
    is an array operation)."""

    steps: np.ndarray  # int64
    ranks: np.ndarray  # int64
    labelled: np.ndarray  # bytes
    names: np.ndarray  # int64 ids of the reserved names (`labels.names_of`)
    reserved: np.ndarray  # bytes

    @classmethod
    def empty(cls) -> Rows:
        empty = np.empty(0, np.int64)
        return cls(empty, empty, np.empty(0, object), empty, np.empty(0, object))

    @classmethod
    def of(cls, steps: np.ndarray, ranks: np.ndarray, labelled: Labelled) -> Rows:
        return cls(
            steps, ranks, _objects(labelled.labelled), labelled.names, _objects(labelled.reserved)
        )

    def __len__(self) -> int:
        return len(self.steps)

    def row(self, index: int) -> Row:
        return self.labelled[index], self.names[index], self.reserved[index]

    def take(self, which: slice | np.ndarray) -> Rows:
        return Rows(*(column[which] for column in _columns(self)))

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        parts = [part for part in parts if len(part)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return Rows.empty()
        return Rows(
            *(np.concatenate(columns) for columns in zip(*map(_columns, parts), strict=True))
        )

    def sorted(self) -> Rows:
        """By step, then rank."""
        steps, ranks = self.steps, self.ranks
        if len(steps) < 2:
            return self
        ordered = (steps[1:] > steps[:-1]) | ((steps[1:] == steps[:-1]) & (ranks[1:] > ranks[:-1]))
        return self if ordered.all() else self.take(np.lexsort((ranks, steps)))


def _columns(rows: Rows) -> tuple[np.ndarray, ...]:
    return rows.steps, rows.ranks, rows.labelled, rows.names, rows.reserved


def _objects(values: list) -> np.ndarray:
    array = np.empty(len(values), object)
    array[:] = values
    return array


def merged_row(step: int, rows: list[tuple[int, Row]], primary: int, extra: bytes = b"") -> bytes:
    """One history record of the rows of every rank at `step`; W&B's own keys (`_runtime`,
    `_timestamp`) are the primary's, or of the lowest rank when the primary has no row.
    `extra`: item fields to add last (the statistics across ranks)."""
    if rows[0][0] != primary:  # (rows come in rank order)
        rows.sort(key=lambda r: (r[0] != primary, r[0]))
    parts = [row[0] for _, row in rows]
    parts.append(wire.item_field(STEP_KEY, wire.value_part(str(step))))
    _, (_, names, blob) = rows[0]
    parts.append(blob)
    if len(rows) > 1:
        have = set(names_of(names))
        for _, (_, more_id, blob) in rows[1:]:
            more = names_of(more_id)
            if not have.issuperset(more):  # a reserved key the first row lacks: the next's
                for name, field in zip(more, wire.region_items(blob), strict=True):
                    if name not in have:
                        have.add(name)
                        parts.append(wire.item_field(*wire.split_item(field)))
    if extra:
        parts.append(extra)
    return wire.history_record(parts, step)


def write_merged(
    rows: Rows, writer: LogWriter, primary: int, across: Sequence[MergedRankStats] = ()
) -> int:
    """One merged history record per step of `rows` (sorted by step, then rank), joined
    into one buffer and written at once; returns how many were written. Each record ends
    with its step's statistics across ranks of each of `across` (`--skew-metrics`,
    `--rank-stats`), in that order."""
    count = len(rows)
    if not count:
        return 0
    steps = rows.steps
    firsts = np.flatnonzero(np.concatenate([[True], steps[1:] != steps[:-1]]))
    labelled, reserved = rows.labelled, rows.reserved
    # the steps whose rows do not all have the first row's reserved names
    names = rows.names
    differs = names != np.repeat(names[firsts], np.diff(np.append(firsts, count)))
    odd = np.zeros(len(firsts), bool)
    odd[np.searchsorted(firsts, np.flatnonzero(differs), "right") - 1] = True
    odd |= rows.ranks[firsts] != primary
    # each step's statistic items, after the ranks' items
    extras = None
    if across:
        extras = [
            b"".join(fields)
            for fields in zip(*(a.row_fields(steps[firsts]) for a in across), strict=True)
        ]
    pieces: list[bytes] = []
    ends: list[int] = []
    end = written = 0
    for index, (a, b, step, slow) in enumerate(
        zip(
            firsts.tolist(),
            [*firsts[1:].tolist(), count],
            steps[firsts].tolist(),
            odd.tolist(),
            strict=True,
        )
    ):
        if slow:
            ranks = rows.ranks[a:b].tolist()
            group = [(rank, rows.row(i)) for i, rank in zip(range(a, b), ranks, strict=True)]
            extra = extras[index] if extras is not None else b""
            record = merged_row(step, group, primary, extra)
            pieces.append(record)
            end += len(record)
        else:  # the common case: the primary's row first, every row with the same own keys
            parts = labelled[a:b].tolist()
            parts.append(wire.item_field(STEP_KEY, wire.value_part(str(step))))
            parts.append(reserved[a])
            if extras is not None and extras[index]:
                parts.append(extras[index])
            record_pieces, length = wire.history_pieces(parts, step)
            pieces.extend(record_pieces)
            end += length
        ends.append(end)
        if end >= WRITE_BATCH:
            written += _write_batch(writer, pieces, ends)
            pieces, ends, end = [], [], 0
    return written + _write_batch(writer, pieces, ends)


# The merged rows joined for one `write_many`: the rows of a turn can be every rank's
# first block at once (32 MiB at 1024 ranks), which joined and framed whole would double.
WRITE_BATCH = 1 << 20


def _write_batch(writer: LogWriter, pieces: list[bytes], ends: list[int]) -> int:
    if ends:
        writer.write_many(b"".join(pieces), [0, *ends[:-1]], ends)
    return len(ends)


def final_summary(
    summaries: dict[int, tuple[RankKeys, dict[bytes | None, bytes]]],
    primary: int,
    across: Sequence[MergedRankStats] = (),
) -> bytes:
    """Every rank's final values under its labelled keys (none for keys not kept per rank);
    W&B's own keys are the primary's; then each statistic's last value (of those of
    `across` that the summary holds).
    `summaries`: rank -> (its keys, its folded summary)."""
    parts = []
    for rank, (keys, summary) in sorted(summaries.items()):
        reserved = {out for out, name in keys.known.values() if name is not None}
        for out, value in summary.items():
            if out is None or (out in reserved and rank != primary):
                continue
            parts.append(wire.item_field(out, value))
    parts += [statistics.summary_fields() for statistics in across]
    return wire.summary_record(b"".join(parts))

"""Shared targets: every rank's history merged by step into one run, in two streaming
passes over the ranks' logs, so memory does not grow with the number of steps.

1. history, merged by step across ranks (rows with the same `_step` become one row, keys
   labelled per rank), with the records that travel with it (metric definitions, files,
   the primary's config, telemetry and environment); summaries are folded per rank and
   written once at the end, as every rank's final values under labelled keys;
2. console lines and system metrics of all ranks, merged by timestamp and labelled
   (`console`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import numpy as np

from .. import items, records
from ..plan import Source, Target
from ..proto import pb
from ..records import KIND_NAMES, record_kind
from ..stagefiles import files_record
from ..steps import Steps
from ..txlog import BLOCK_SIZE, LogWriter, ReadReport, read_frames, read_payloads
from .console import PASS_TWO, Spools, SpoolWriter, write_console_and_stats
from .labels import RankKeys, fold_summaries, label_rows
from .options import MergeOptions
from .outcome import Outcome, damage_warnings, is_record, not_a_record
from .rows import Rows, final_summary, write_merged
from .runrecord import exit_code, exit_record, rewrite_run

READ_BLOCKS = 64  # the most a rank's stream reads at once: 2 MiB
_HISTORY = records.code("history")
_SUMMARY = records.code("summary")

# The records other than rows that pass 1 writes, keyed (step of the row before, 1, rank, n)
Events = list[tuple[tuple, bytes]]
Batch = tuple[Rows, Events]  # what a rank's stream gives per read


@dataclass
class RankState:
    """What one rank's pass-1 stream accumulates besides its rows: O(keys), not O(steps)."""

    source: Source  # first restart (label, rank)
    keys: RankKeys
    summary: dict[bytes, bytes] = field(default_factory=dict)  # output key part -> value part
    exit_payload: bytes | None = None
    complete: bool = False


def write_shared(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    scratch: Path,
) -> Outcome:
    """Write the shared run `target`; `scratch`: where pass 1 may set records aside."""
    return SharedMerge(target, writer, options, file_map).run(scratch)


class SharedMerge:
    """One shared target being merged: what its passes share, and what they found."""

    def __init__(
        self,
        target: Target,
        writer: LogWriter,
        options: MergeOptions,
        file_map: dict[tuple[Path, str], str],
    ) -> None:
        self.target = target
        self.writer = writer
        self.options = options
        self.file_map = file_map
        self.primary = target.primary_rank
        self.skew = options.skew_metrics
        self.by_rank: dict[int, list[Source]] = {}
        for source in target.sources:
            self.by_rank.setdefault(source.rank.rank, []).append(source)
        self.states = {
            rank: RankState(sources[0], RankKeys(sources[0].label, options.key_format))
            for rank, sources in self.by_rank.items()
        }
        self.outcome = Outcome()

    def run(self, scratch: Path) -> Outcome:
        writer = self.writer
        for payload in read_payloads(self.by_rank[self.primary][0].path):
            kind = record_kind(payload)
            if kind == "header":
                writer.write(payload)
            elif kind == "run":
                writer.write(rewrite_run(payload, self.target, self.options))
                break
        with Spools(scratch) as spools:
            self._write_rows(spools)
            write_console_and_stats(self.by_rank, writer, spools)
        # The end: every rank's final summary, one exit record (the primary's).
        summaries = {rank: (state.keys, state.summary) for rank, state in self.states.items()}
        writer.write(final_summary(summaries, self.primary))
        self.outcome.exit_code = exit_code(self.states[self.primary].exit_payload)
        writer.write(exit_record(self.outcome.exit_code))
        return self.outcome

    def _write_rows(self, spools: Spools) -> None:
        """Pass 1: rows by step, with what travels with them. Each rank's log is read a few
        MiB at a time, whose rows are labelled as columns: together a few tens of MB held."""
        read_size = BLOCK_SIZE * max(8, min(READ_BLOCKS, 1024 // len(self.by_rank)))
        streams = [
            self._rank_batches(sources, self.states[rank], read_size, spools)
            for rank, sources in self.by_rank.items()
        ]
        seen: set[bytes] = set()  # the same definition or file list from several ranks
        held = Rows.empty()  # the last step's rows: more ranks' rows of it may come next
        for ready, others in merge_batches(streams):
            rows = Rows.concat([held, ready]).sorted()
            done = 0
            for key, event in others:  # each after the rows up to its step
                at = int(np.searchsorted(rows.steps, key[0], side="right"))
                self._write_merged(rows.take(slice(done, at)))
                done = max(done, at)
                if event not in seen:
                    seen.add(event)
                    self.writer.write(event)
            keep = int(np.searchsorted(rows.steps, rows.steps[-1])) if len(rows) else done
            keep = max(keep, done)
            self._write_merged(rows.take(slice(done, keep)))
            held = rows.take(slice(keep, None))
        self._write_merged(held)

    def _write_merged(self, rows: Rows) -> None:
        self.outcome.history_rows += write_merged(rows, self.writer, self.primary, self.skew)
        self.outcome.source_rows += len(rows)

    def _rank_batches(
        self, sources: list[Source], state: RankState, read_size: int, spools: Spools
    ) -> Iterator[Batch]:
        """One rank's pass-1 rows and other events, in batches (a read of its log each),
        keyed so that a merge of the ranks' streams aligns them by step.

        History rows have key (step, 0, rank); other records (step of the last row, 1, rank,
        n) so they follow the row they were written after. Restarts are concatenated.
        """
        rank = state.source.rank.rank
        steps = Steps()
        seq = 0
        for index, source in enumerate(sources):
            report = ReadReport()
            steps.restart()
            state.exit_payload = None
            spool = spools.writer(source)
            for frames in read_frames(source.path, report, read_size):
                codes = records.kinds(frames)
                history = np.flatnonzero(codes == _HISTORY)
                rows = records.history_rows(frames, history)
                before = steps.last
                placed = steps.place_rows(rows.steps)
                kept = placed >= 0
                starts, ends = rows.starts[kept], rows.ends[kept]
                summaries = np.flatnonzero(codes == _SUMMARY)
                summary_starts, summary_ends = records.body_spans(frames, summaries, 0x1A)
                row_items = summary_items = None
                if rows.data is frames.data and (summary_starts >= 0).all():
                    # the rows' items and the summaries' in one split: one dictionary of keys
                    both = items.split_spans(
                        frames.data,
                        np.concatenate([starts, summary_starts]),
                        np.concatenate([ends, summary_ends]),
                    )
                    if both is not None:
                        both.key_codes()  # once, for both parts
                        row_items = both.rows(0, len(starts))
                        summary_items = both.rows(len(starts), len(starts) + len(summaries))
                fold_summaries(frames, summaries, state.keys, state.summary, summary_items)
                labelled = label_rows(rows.data, starts, ends, state.keys, self.skew, row_items)
                placed_rows = Rows(placed[kept], np.full(len(starts), rank, np.int64), *labelled)
                others_events: Events = []
                others = np.flatnonzero((codes != _HISTORY) & (codes != _SUMMARY))
                if len(others):
                    # the last step placed before each other record: it follows that row
                    last = np.maximum.accumulate(np.concatenate([[before], placed]))
                    at_row = np.searchsorted(history, others)
                    for record, after in zip(others.tolist(), last[at_row].tolist(), strict=True):
                        event = self._other_event(
                            frames.payload(record), KIND_NAMES[codes[record]], state, index,
                            source, spool,
                        )  # fmt: skip
                        if event is not None:
                            seq += 1
                            others_events.append(((after, 1, rank, seq), event))
                if len(placed_rows) or others_events:
                    yield placed_rows, others_events
            state.complete = state.exit_payload is not None
            self.outcome.warnings += damage_warnings(
                source, report, state.complete or index < len(sources) - 1, self.primary
            )

    def _other_event(
        self,
        payload: bytes,
        kind: str | None,
        state: RankState,
        restart: int,
        source: Source,
        spool: SpoolWriter,
    ) -> bytes | None:
        """What a record other than a history row or summary becomes in pass 1, if anything:
        an event for the merged log, or set aside (console, system metrics, the exit)."""
        if kind == "exit":
            state.exit_payload = payload
        elif kind == "metric":
            return _labelled_metric(payload, state.source.label, self.options.key_format)
        elif kind == "files":
            return files_record(payload, source, self.outcome.warnings, staged=self.file_map)
        elif kind in PASS_TWO:
            spool.write(payload)
        elif kind in ("header", "run"):
            pass  # written once by the caller
        elif state.source.rank.rank == self.primary:
            if restart == 0 or kind not in ("environment", "telemetry"):
                return self._checked(payload, source)  # (a restart: the same machine again)
        elif kind in ("artifact", "use_artifact", "alert"):
            return self._checked(payload, source)
        return None

    def _checked(self, payload: bytes, source: Source) -> bytes | None:
        if is_record(payload):
            return payload
        self.outcome.warnings.append(not_a_record(source))
        return None


def _labelled_metric(payload: bytes, label: str, key_format: str) -> bytes:
    record = pb.Record.FromString(payload)
    metric = record.metric
    if metric.name and not metric.name.startswith("_"):
        metric.name = key_format.format(key=metric.name, label=label)
    if metric.step_metric and not metric.step_metric.startswith("_"):
        metric.step_metric = key_format.format(key=metric.step_metric, label=label)
    return record.SerializeToString()


def merge_batches(streams: list[Iterator[Batch]]) -> Iterator[Batch]:
    """The rows and other events of every stream in key order, in batches. Each stream
    gives batches of rows (in step order, keys (step, 0, rank)) and of other events (sorted
    by key), keys unique across streams, each batch after the stream's last.

    What every stream has up to the smallest of their batches' last keys is final: those
    rows and those events are given out, and emptied streams read their next batch.
    """
    pending: list[Batch] = []
    live: list[Iterator[Batch]] = []
    for stream in streams:
        batch = next(stream, None)
        if batch is not None:
            pending.append(batch)
            live.append(stream)
    first_key = itemgetter(0)
    while live:
        bound = min(map(_last_key, pending))
        ready_rows: list[Rows] = []
        ready_others: Events = []
        for index, (rows, others) in enumerate(pending):
            through = _rows_through(rows, bound)
            cut = bisect_right(others, bound, key=first_key)
            ready_rows.append(rows.take(slice(0, through)))
            ready_others += others[:cut]
            pending[index] = rows.take(slice(through, None)), others[cut:]
        ready_others.sort(key=first_key)
        yield Rows.concat(ready_rows).sorted(), ready_others
        for index in reversed(range(len(live))):
            if not len(pending[index][0]) and not pending[index][1]:
                batch = next(live[index], None)
                if batch is None:
                    del live[index], pending[index]
                else:
                    pending[index] = batch


def _last_key(batch: Batch) -> tuple:
    rows, others = batch
    keys = [others[-1][0]] if others else []
    if len(rows):
        keys.append((int(rows.steps[-1]), 0, int(rows.ranks[-1])))
    return max(keys)


def _rows_through(rows: Rows, bound: tuple) -> int:
    """How many of a rank's rows (in step order) have keys (step, 0, rank) up to `bound`."""
    through = int(np.searchsorted(rows.steps, bound[0]))
    if (
        through < len(rows)
        and rows.steps[through] == bound[0]
        and (bound[1] > 0 or rows.ranks[through] <= bound[2])
    ):
        through += 1
    return through

"""Shared targets: every rank's history merged by step into one run, in two streaming
passes over the ranks' logs, so memory does not grow with the number of steps.

1. history, merged by step across ranks (rows with the same `_step` become one row, keys
   labelled per rank), with the records that travel with it (metric definitions, files,
   the primary's config, telemetry and environment); summaries are folded per rank and
   written once at the end, as every rank's final values under labelled keys, and so is
   the config of the other ranks, where it is not the primary's (`rankconfig`);
2. console lines and system metrics of all ranks, merged by timestamp and labelled
   (`console`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Protocol

import numpy as np
from google.protobuf.message import DecodeError

from ..analyse import PerRank, bound_notice
from ..log import (
    BLOCK_SIZE,
    RESERVED,
    Frames,
    LogWriter,
    Steps,
    items,
    pb,
    place_reads,
    read_payloads,
    record_kind,
    records,
    shared_kept,
)
from ..plan import Source, Target
from ..runtime import allow_open_files
from ..wandbcore import fold_logged_entries
from .artifacts import ArtifactRecords
from .console import PASS_TWO, Spools, SpoolWriter, write_console_and_stats
from .files import files_record
from .labels import KeyTable, Labelled, RankKeys, fold_summaries, label_rows
from .loggedconfig import (
    Entries,
    labelled_entries,
    logged_entries_record,
    without_logged_entries,
)
from .metricglobs import glob_definitions, label_prefixes
from .options import MergeOptions
from .outcome import (
    Outcome,
    check_known,
    damage_warnings,
    is_record,
    not_a_record,
    unknown_field,
)
from .rankconfig import ConfigPath, fold_config, other_ranks_config
from .readers import RankReaders, SourceRead
from .rows import Rows, final_summary, write_merged
from .rowstats import MergedRankStats, MergedSpreads
from .runrecord import exit_code, exit_record, restart_config, rewrite_run

# What all ranks' reads may hold at once: each rank reads this divided by the number of
# ranks (at least a block, at most 64: 2 MiB). A turn reads at most TURN_BUDGET (or one
# rank's read): its arrays stay small enough for the processor's caches.
READ_BUDGET = 16 << 20
TURN_BUDGET = 4 << 20
_MAX_BLOCKS = 64
_HISTORY = records.code("history")
_SUMMARY = records.code("summary")
_BEFORE_ALL = (-2, 0)  # a key before every row and record: a rank that has read nothing yet


class Readers(Protocol):
    """The ranks' logs read in turns (`RankReaders`, or a follow's reads of what is new)."""

    def live(self) -> list[int]: ...

    def read(self, ranks: list[int], blocks: int) -> tuple[Frames, list[SourceRead]]: ...


# The records other than rows that pass 1 writes, keyed (step of the row before, 1, rank, n)
Events = list[tuple[tuple, bytes]]


@dataclass
class RankState:
    """What one rank's pass-1 reads accumulate besides its rows: O(keys), not O(steps)."""

    source: Source  # first restart (label, rank)
    keys: RankKeys
    slot: int  # its place in the key table
    summary: dict[bytes, bytes] = field(default_factory=dict)  # output key part -> value part
    exit_payload: bytes | None = None
    steps: Steps = field(default_factory=Steps)
    seq: int = 0  # records other than rows so far
    spool: SpoolWriter | None = None
    last_key: tuple = _BEFORE_ALL  # the key of the last row or record read
    last_rows: int = 0  # rows in its last read
    globs: list[bytes] = field(default_factory=list)  # its glob definitions, as read
    named: set[str] = field(default_factory=set)  # the keys it defined by name
    config: dict[ConfigPath, str] = field(default_factory=dict)  # folded so far (`rankconfig`)
    logged: Entries = field(default_factory=dict)  # its keyed `_wandb` entries (`loggedconfig`)


def write_shared(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    scratch: Path,
    artifacts: ArtifactRecords,
) -> Outcome:
    """Write the shared run `target`; `scratch`: where pass 1 may set records aside;
    `artifacts`: how each rank's artifact records become the merged run's."""
    allow_open_files(len(target.sources) + 1)  # each source's log, and the console spool
    return SharedMerge(target, writer, options, file_map, artifacts).run(scratch)


class SharedMerge:
    """One shared target being merged: what its passes share, and what they found.

    Pass 1 reads the ranks in turns (`RankReaders`): each turn, the ranks whose rows are
    nearly all written read their next blocks, all together, and their rows are labelled
    together (`labels`); then everything every rank has read up to the least key any rank
    has reached is final and written (`_write_ready`). Rows are keyed (step, 0, rank), other
    records (step of the rank's row before, 1, rank, n), so that each follows its row.
    """

    def __init__(
        self,
        target: Target,
        writer: LogWriter,
        options: MergeOptions,
        file_map: dict[tuple[Path, str], str],
        artifacts: ArtifactRecords,
    ) -> None:
        self.target = target
        self.writer = writer
        self.options = options
        self.file_map = file_map
        self.artifacts = artifacts
        self.primary = target.primary_rank
        self.by_rank: dict[int, list[Source]] = {}
        for source in target.sources:
            self.by_rank.setdefault(source.rank.rank, []).append(source)
        self.states = {
            rank: RankState(
                sources[0], RankKeys(sources[0].label, options.key_format, options.per_rank), slot
            )
            for slot, (rank, sources) in enumerate(self.by_rank.items())
        }
        # --skew-metrics, --rank-stats: fed each turn's rows, asked for each written step's
        # statistics across ranks
        self.across = [
            kind(options.key_format, RESERVED)
            for kind, chosen in (
                (MergedSpreads, options.skew_metrics),
                (MergedRankStats, options.rank_stats),
            )
            if chosen
        ]
        self.table = KeyTable([state.keys for state in self.states.values()])
        self.summaries = [state.summary for state in self.states.values()]
        self.slot_rank = np.array(list(self.by_rank), np.int64)
        self.outcome = Outcome()
        self.warnings: dict[tuple[int, int], list[str]] = {}  # by (rank, restart index)
        self.pending = Rows.empty()  # rows read, not yet written
        self.events: Events = []  # other records read, not yet written
        # the metric definitions and file lists written, so that one is not written again
        # when it changes nothing (`is_news`): the same from several ranks, or every round
        self.seen: set[bytes] = set()
        self._definition_of: dict[tuple[str, str], bytes] = {}  # (name, glob) -> the last

    def run(self, scratch: Path) -> Outcome:
        writer = self.writer
        self.write_head()
        with Spools(scratch) as spools:
            self._write_rows(spools)
            for payload in self.glob_definitions():
                self.wrote(payload)
                writer.write(payload)
            write_console_and_stats(self.by_rank, writer, spools)
        config = None if self.options.live else self.config_record()
        if config is not None:
            writer.write(config)
        for rank, sources in self.by_rank.items():  # in the order of the sources
            for index in range(len(sources)):
                self.outcome.warnings += self.warnings.get((rank, index), [])
        # The end: every rank's final summary, one exit record (the primary's).
        writer.write(self.summary_record())
        self._count_metrics()
        self.outcome.exit_code = exit_code(self.states[self.primary].exit_payload)
        writer.write(exit_record(self.outcome.exit_code))
        return self.outcome

    def summary_record(self) -> bytes:
        """Every rank's summary as folded so far, as the merged run's one summary record."""
        summaries = {rank: (state.keys, state.summary) for rank, state in self.states.items()}
        return final_summary(summaries, self.primary, self.across)

    def config_record(self) -> bytes | None:
        """The other ranks' config as folded so far, where it is not the primary's
        (`rankconfig`), and every rank's entries that describe what it logged, relabelled
        (`loggedconfig`), as one config record; None when there is neither."""
        others = [
            (state.source.label, state.config)
            for rank, state in self.states.items()
            if rank != self.primary
        ]
        options = self.options
        payload = other_ranks_config(self.states[self.primary].config, others, options.key_format)
        record = pb.Record.FromString(payload) if payload is not None else pb.Record()
        for _, state in sorted(self.states.items()):
            entries = labelled_entries(
                state.logged,
                state.source.label,
                options.key_format,
                state.keys.user_keys,
                options.per_rank.keeps,
            )
            logged_entries_record(entries, record)
        return record.SerializeToString() if record.config.update else None

    def write_head(self) -> None:
        """The primary's file header and its run record, rewritten for the merged run."""
        for payload in read_payloads(self.by_rank[self.primary][0].path):
            kind = record_kind(payload)
            if kind == "header":
                self.writer.write(payload)
            elif kind == "run":
                self.writer.write(rewrite_run(payload, self.target, self.options))
                break

    def glob_definitions(self) -> list[bytes]:
        """Every rank's metric globs, bound to its own labelled keys (`metricglobs`), that
        are not written yet: written once every row is, and so every key each rank logged
        is known. (A follow asks at every round, for the keys known so far: nothing here
        changes the merge.)"""
        if self.options.per_rank.patterns == ():
            return []  # (no key is kept per rank: a glob binds nothing)
        labels = [state.source.label for state in self.states.values()]
        prefixes = label_prefixes(self.options.key_format, labels) or {}
        found: dict[bytes, None] = {}
        for state in self.states.values():
            for payload in glob_definitions(
                state.globs,
                state.named,
                state.keys.user_keys,
                state.source.label,
                self.options.key_format,
                self.options.per_rank,
                prefixes.get(state.source.label),
            ):
                if self.is_news(payload):
                    found[payload] = None
        return list(found)

    def is_news(self, payload: bytes) -> bool:
        """Whether writing `payload` would change what the merged log says. Every record
        would but two kinds: a file list already written (file lists only add), and a
        metric definition that is the last one written for its name or glob. wandb-core
        folds each definition, in order, into the one before it, or puts it in its place
        when the definition says so (`define_metric(..., overwrite=True)`): `loss` with
        min, then max, then min again with overwrite ends as min only if all three are
        written; a definition the same as the last one changes nothing."""
        kind = record_kind(payload)
        if kind == "metric":
            return self._definition_of.get(_defines(payload)) != payload
        return kind != "files" or payload not in self.seen

    def wrote(self, payload: bytes) -> None:
        """Note that `payload` was written (see `is_news`)."""
        kind = record_kind(payload)
        if kind == "metric":
            before = self._definition_of.get(key := _defines(payload))
            self.seen.discard(before)  # type: ignore[arg-type]
            self._definition_of[key] = payload
            self.seen.add(payload)
        elif kind == "files":
            self.seen.add(payload)

    def remember(self, written: list[bytes]) -> None:
        """Go on from another merge's `seen`: these definitions and file lists written."""
        for payload in written:
            self.wrote(payload)

    def _write_rows(self, spools: Spools) -> None:
        """Pass 1: rows by step, with what travels with them, a turn at a time."""
        readers = RankReaders(
            {rank: [s.path for s in sources] for rank, sources in self.by_rank.items()}
        )
        try:
            self.take_turns(readers, spools)
        finally:
            readers.close()
        self._write_ready(None)

    def take_turns(
        self,
        readers: Readers,
        spools: Spools,
        open_ranks: Callable[[], list[int]] | None = None,
        cap: tuple | None = None,
    ) -> None:
        """Read `readers` in turns until they have nothing more, writing after each turn
        everything every rank in `open_ranks()` (ranks that may still give records: by
        default those with records left) has reached, and no further than `cap`.

        A follow reads each rank's log as far as it is written and goes on from there in its
        next round: a rank at the end of what is written is open, and holds the rows back
        at its place as a rank still to read does; `cap` holds them back at the watermark."""
        ranks = len(self.by_rank)
        blocks = max(1, min(_MAX_BLOCKS, READ_BUDGET // (BLOCK_SIZE * ranks)))
        per_turn = max(1, min(READ_BUDGET, TURN_BUDGET) // (BLOCK_SIZE * blocks))
        open_ranks = open_ranks or readers.live
        while live := readers.live():
            # (a follow's ranks may all be held back by an open rank that has nothing more
            # to read yet: then those furthest behind read on)
            due = self._due(live, per_turn) or sorted(live, key=self._last_key)[:per_turn]
            frames, reads = readers.read(due, blocks)
            self._take_in(frames, reads, spools)
            self.write_ready(open_ranks(), cap)
        self.write_ready(open_ranks(), cap)

    def _last_key(self, rank: int) -> tuple:
        return self.states[rank].last_key

    def write_ready(self, open_ranks: list[int], cap: tuple | None = None) -> None:
        """Write what every rank of `open_ranks` has reached (all when none), up to `cap`."""
        bound = min((self.states[r].last_key for r in open_ranks), default=None)
        if cap is not None:
            bound = cap if bound is None else min(bound, cap)
        self._write_ready(bound)

    def _due(self, live: list[int], most: int) -> list[int]:
        """The ranks to read next: those whose rows read are written but for half a read,
        the furthest behind first, at most `most`. (The one furthest behind has none left.)"""
        counts: dict[int, int] = {}
        if len(self.pending):
            found, number = np.unique(self.pending.ranks, return_counts=True)
            counts = dict(zip(found.tolist(), number.tolist(), strict=True))
        due = [rank for rank in live if counts.get(rank, 0) <= self.states[rank].last_rows // 2]
        due.sort(key=lambda rank: self.states[rank].last_key)
        return due[:most]

    def _take_in(self, frames: Frames, reads: list[SourceRead], spools: Spools) -> None:
        """Label the rows of a turn's reads, fold their summaries, and set aside the rest."""
        read_index = records.RecordIndex(frames)
        codes, history, rows = read_index.codes, read_index.history, read_index.rows
        ranges = np.cumsum([0, *(read.records for read in reads)])
        history_ranges = np.searchsorted(history, ranges)
        states = [self.states[read.rank] for read in reads]
        for read, state in zip(reads, states, strict=True):
            if read.starts:
                state.steps.restart()
                state.exit_payload = None
                state.spool = spools.writer(self.by_rank[read.rank][read.source])
        befores = [state.steps.last for state in states]
        # every read's rows placed at once (a read at a time where they do not simply rise)
        placed = place_reads([state.steps for state in states], rows.steps, history_ranges)
        counts = np.diff(history_ranges).tolist()
        for read, state, count in zip(reads, states, counts, strict=True):
            state.last_rows = count
            if count and state.steps.last >= 0:
                state.last_key = max(state.last_key, (state.steps.last, 0, read.rank))
        others = np.flatnonzero((codes != _HISTORY) & (codes != _SUMMARY))
        if len(others):
            # the step each other record follows: the last row placed before it in its read
            # (a kept row is above every row before it), else its rank's last step before
            read_of = np.searchsorted(ranges, others, "right") - 1
            row_at = np.searchsorted(history, others)
            kept_at = np.maximum.accumulate(np.where(placed >= 0, np.arange(len(placed)), -1))
            before_row = kept_at[np.maximum(row_at - 1, 0)] if len(placed) else row_at - 1
            in_read = (row_at > history_ranges[read_of]) & (before_row >= history_ranges[read_of])
            after = np.where(
                in_read,
                placed[before_row] if len(placed) else 0,
                np.array(befores, np.int64)[read_of],
            )
            for record, at, step in zip(
                others.tolist(), read_of.tolist(), after.tolist(), strict=True
            ):
                read, state = reads[at], states[at]
                event = self._other_event(
                    frames.payload(record),
                    read_index.kind(record),
                    state,
                    read.source,
                    self.by_rank[read.rank][read.source],
                    state.spool,
                )
                if event is not None:
                    state.seq += 1
                    key = (step, 1, read.rank, state.seq)
                    self.events.append((key, event))
                    state.last_key = max(state.last_key, key)
        for read, state in zip(reads, states, strict=True):
            if read.ended:
                complete = state.exit_payload is not None
                more = read.source < len(self.by_rank[read.rank]) - 1
                self._warn(
                    read.rank,
                    read.source,
                    damage_warnings(
                        self.by_rank[read.rank][read.source],
                        read.report,
                        complete or more,
                        self.primary,
                    ),
                )
        kept = placed >= 0
        slot_of_record = np.repeat(
            np.array([self.states[read.rank].slot for read in reads], np.int64),
            [read.records for read in reads],
        )
        row_slots = slot_of_record[history[kept]]
        starts, ends = rows.starts[kept], rows.ends[kept]
        summaries = read_index.summaries
        summary_slots = slot_of_record[summaries]
        summary_starts, summary_ends = read_index.summary_spans
        row_items = summary_items = None
        if rows.in_place and (summary_starts >= 0).all():
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
        row_ranks = self.slot_rank[row_slots]
        steps = placed[kept]
        if row_items is not None:
            fold_summaries(
                frames, summaries, summary_slots, self.table, self.summaries, summary_items
            )
            labelled = label_rows(rows.data, starts, ends, row_slots, self.table, row_items)
            for statistics in self.across:  # the turn's numbers
                statistics.add_rows(row_ranks, steps, rows.data, starts, ends, row_items)
        else:  # an odd row or summary: the other ranks' still as columns
            labelled = self._by_rank(rows.data, starts, ends, row_slots, row_ranks, steps)
            self._fold_by_rank(frames, summaries, summary_slots)
        self.pending = Rows.concat([self.pending, Rows.of(steps, row_ranks, labelled)])

    def _by_rank(
        self,
        data: bytes,
        starts: np.ndarray,
        ends: np.ndarray,
        slots: np.ndarray,
        ranks: np.ndarray,
        steps: np.ndarray,
    ) -> Labelled:
        """Label (and feed the statistics across ranks) each rank's rows on their own, its
        items split once for both (rows of a rank are together): one rank's long value
        costs the exact item-by-item path of that rank's rows only."""
        bounds = [0, *(np.flatnonzero(np.diff(slots)) + 1).tolist(), len(slots)]
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            own = slice(lo, hi)
            batch = items.split_spans(data, starts[own], ends[own])
            parts.append(label_rows(data, starts[own], ends[own], slots[own], self.table, batch))
            for statistics in self.across:
                statistics.add_rows(ranks[own], steps[own], data, starts[own], ends[own], batch)
        return Labelled(
            [x for part in parts for x in part.labelled],
            np.concatenate([part.names for part in parts]),
            [x for part in parts for x in part.reserved],
        )

    def _fold_by_rank(self, frames: Frames, summaries: np.ndarray, slots: np.ndarray) -> None:
        bounds = np.flatnonzero(np.diff(slots)) + 1
        for which, own in zip(np.split(summaries, bounds), np.split(slots, bounds), strict=True):
            fold_summaries(frames, which, own, self.table, self.summaries)

    def _write_ready(self, bound: tuple | None) -> None:
        """Write every row and record up to `bound`, the least key any live rank has reached
        (None: all), in key order. Every row at the bound's step is here already: a rank
        reads in key order, and each has reached the bound."""
        pending = self.pending
        ready = np.ones(len(pending), bool) if bound is None else pending.steps <= bound[0]
        rows = pending.take(np.flatnonzero(ready)).sorted()
        self.pending = pending.take(np.flatnonzero(~ready))
        events = self.events
        if bound is not None:
            events = [event for event in events if event[0] <= bound]
            self.events = [event for event in self.events if event[0] > bound]
        else:
            self.events = []
        events.sort(key=itemgetter(0))
        done = 0
        for key, event in events:  # each after the rows up to its step
            at = int(np.searchsorted(rows.steps, key[0], side="right"))
            self._write_merged(rows.take(slice(done, at)))
            done = max(done, at)
            if self.is_news(event):
                self.wrote(event)
                self.writer.write(event)
        self._write_merged(rows.take(slice(done, None)))

    def _write_merged(self, rows: Rows) -> None:
        self.outcome.history_rows += write_merged(rows, self.writer, self.primary, self.across)
        self.outcome.source_rows += len(rows)

    def _count_metrics(self) -> None:
        """The distinct metric keys of the merged run (labelled keys of history and summary,
        statistics, spreads; not W&B's own), the one line past W&B's bound, and the
        `--per-rank` patterns that matched no key."""
        per_rank: PerRank = self.options.per_rank
        self.outcome.metrics, self.outcome.bound_notice = self.metrics()
        user_keys = set().union(*(state.keys.user_keys for state in self.states.values()))
        for pattern in per_rank.unmatched(user_keys):
            self.outcome.warnings.append(f"--per-rank {pattern!r} matches no key of the runs")

    def metrics(self) -> tuple[int, str | None]:
        """The distinct metric keys merged so far, and the line to say when they pass W&B's
        bound (None while they do not)."""
        entries = [entry for state in self.states.values() for entry in state.keys.known.values()]
        labelled = {out for out, name in entries if name is None and out is not None}
        metrics = len(labelled) + sum(statistics.metrics for statistics in self.across)
        notice = bound_notice(self.target.id, metrics, len(self.states), self.options.per_rank)
        return metrics, notice

    def _warn(self, rank: int, restart: int, warnings: list[str]) -> None:
        self.warnings.setdefault((rank, restart), []).extend(warnings)

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
        elif kind in ("config", "run"):
            return self._config(payload, kind, state, restart, source)
        elif kind == "output_logger":  # wandb's own lines, labelled as the console's are
            return self._labelled_logger_line(payload, state.source.label, source, restart)
        elif kind == "metric":
            return _labelled_metric(payload, state, self.options)
        elif kind == "files":
            warnings: list[str] = []
            record = files_record(payload, source, warnings, staged=self.file_map)
            self._warn(state.source.rank.rank, restart, warnings)
            return record
        elif kind in PASS_TWO:
            spool.write(payload)
        elif kind == "header":
            pass  # written once by the caller
        elif kind == "artifact":  # every rank's, filed under the merged run
            return self.artifacts.rewrite(payload, source)
        elif kind is None and is_record(payload) and unknown_field(payload) is not None:
            check_known(payload, source, self.options.copy_unknown)
            return payload  # (copied as it is, from every rank: --unknown-records copy)
        elif kind in shared_kept(is_primary := state.source.rank.rank == self.primary, restart):
            return self._checked(payload, source, restart)  # (the table in `log.kinds`)
        elif kind is None and is_primary:
            return self._checked(payload, source, restart)  # (named if it is not a record)
        return None

    def _config(
        self, payload: bytes, kind: str, state: RankState, restart: int, source: Source
    ) -> bytes | None:
        """Fold a rank's config record, or its run record's config (a restart's as an
        update: `restart_config`); the primary's config records, and the config of its
        restarts' run records, are written in place, the other ranks' config at the end
        (`config_record`)."""
        try:
            record = pb.Record.FromString(payload)
        except DecodeError:
            self._warn(source.rank.rank, restart, [not_a_record(source)])
            return None
        if kind == "run":
            fold_config(state.config, record.run.config)
            fold_logged_entries(state.logged, record.run.config)
            if restart == 0 or state.source.rank.rank != self.primary:
                return None  # (the primary's first is written once by the caller)
            return restart_config(payload)
        fold_config(state.config, record.config)
        fold_logged_entries(state.logged, record.config)
        if state.source.rank.rank != self.primary:
            return None
        if not without_logged_entries(record.config):  # (written at the end, relabelled)
            return payload
        return record.SerializeToString() if record.config.update or record.config.remove else None

    def _labelled_logger_line(
        self, payload: bytes, label: str, source: Source, restart: int
    ) -> bytes | None:
        """A line of wandb's own logger, `[label] ` prefixed as each console line is."""
        try:
            record = pb.Record.FromString(payload)
        except DecodeError:
            self._warn(source.rank.rank, restart, [not_a_record(source)])
            return None
        record.output_logger.line = f"[{label}] {record.output_logger.line}"
        return record.SerializeToString()

    def _checked(self, payload: bytes, source: Source, restart: int) -> bytes | None:
        if is_record(payload):
            return payload
        self._warn(source.rank.rank, restart, [not_a_record(source)])
        return None


def _defines(payload: bytes) -> tuple[str, str]:
    """What a metric definition defines: (its name, its glob)."""
    metric = pb.Record.FromString(payload).metric
    return metric.name, metric.glob_name


def _labelled_metric(payload: bytes, state: RankState, options: MergeOptions) -> bytes | None:
    """The metric definition of a rank for its labelled keys, so that no rank's definition
    replaces another's: a name (`loss` -> `loss/rank-3`), its step metric the rank's own
    labelled key (`epoch` -> `epoch/rank-3`); summary, goal and hidden as they are. W&B's
    own keys (`_step`) stay. None for a name not kept per rank, and for a glob, kept aside
    (`state.globs`) until every key is known: `metricglobs`.
    """
    key_format = options.key_format
    record = pb.Record.FromString(payload)
    metric = record.metric
    if metric.glob_name:
        state.globs.append(payload)
        return None
    if metric.name and not metric.name.startswith("_"):
        if not options.per_rank.keeps(metric.name):
            return None
        state.named.add(metric.name)
        metric.name = key_format.format(key=metric.name, label=state.source.label)
    if metric.step_metric and not metric.step_metric.startswith("_"):
        metric.step_metric = key_format.format(key=metric.step_metric, label=state.source.label)
    return record.SerializeToString()

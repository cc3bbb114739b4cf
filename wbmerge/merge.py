"""Merge: write each planned target as a new offline run directory that `wandb sync` accepts.

Pass-through targets (`new`, `auto`) copy a rank's records as raw bytes and rewrite only
the run record. Shared targets are built in two streaming passes over the ranks' logs, so
memory does not grow with the number of steps:

1. history, merged by step across ranks (rows with the same `_step` become one row, keys
   labelled per rank), with the records that travel with it (metric definitions, files,
   the primary's config, telemetry and environment); summaries are folded per rank and
   written once at the end, as every rank's final values under labelled keys;
2. console lines and system metrics of all ranks, merged by timestamp and labelled.
"""

from __future__ import annotations

import heapq
import json
import shutil
import struct
import tempfile
import time
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO, NamedTuple

import numpy as np
import pyarrow as pa
from google.protobuf.message import DecodeError

from . import items, records, safepaths, wire
from .errors import WbmergeError
from .plan import Source, Target
from .proto import pb
from .records import KIND_NAMES
from .spread import spread
from .stagefiles import files_record, stage_files
from .streaming import streaming
from .topology import METADATA_KEY
from .txlog import (
    BLOCK_SIZE,
    Frames,
    LogWriter,
    ReadReport,
    read_frames,
    read_head,
    read_payloads,
    record_kind,
)

# W&B's own keys: never labelled; in a merged row and summary they are the primary's
RESERVED = ("_step", "_runtime", "_timestamp", "_wandb")
PASS_TWO = ("output_raw", "output", "stats")
DEFAULT_KEY_FORMAT = "{key}/{label}"


@dataclass
class MergeOptions:
    project: str | None = None
    entity: str | None = None
    key_format: str = DEFAULT_KEY_FORMAT
    run_mode: str = "auto"
    rank_scope: str = "global"
    job_id: str = ""
    skew_metrics: bool = False


@dataclass
class Staged:
    """One merged offline run, ready for `wandb sync`."""

    target: Target
    run_dir: Path
    history_rows: int = 0  # shared targets: merged rows written
    source_rows: int = 0  # shared targets: source rows read
    records: int = 0
    exit_code: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"run-{self.target.id}.wandb"


def stage(target: Target, out_dir: Path, options: MergeOptions) -> Staged:
    """Write `target` under `out_dir` as `offline-run-<time>-<id>/`; returns what was written.

    The run directory is created exclusively: one that exists already is an error naming
    it, never replaced (it may be a source, or another merge's output). On any failure the
    directory this call created is removed again, and nothing else.
    """
    start = target.sources[0].start_time
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(start or time.time()))
    name = f"offline-run-{stamp}-{safepaths.check_component(target.id, 'run id')}"
    run_dir = out_dir / name
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir()
    except FileExistsError:
        raise WbmergeError(
            f"{run_dir} exists already; merged runs are never written over an existing "
            "directory (choose an empty --out, or remove it)"
        ) from None
    except OSError as exc:
        raise WbmergeError(f"{run_dir}: cannot create ({exc.strerror or exc})") from None
    try:
        (run_dir / "files").mkdir()
        staged = Staged(target, run_dir)
        file_map, refused = stage_files(target, run_dir / "files", staged.warnings)
        with streaming(), open(staged.log_path, "xb") as stream, LogWriter(stream) as writer:
            if target.kind == "shared":
                _write_shared(target, writer, options, file_map, staged)
            else:
                _write_passthrough(target, writer, options, staged, refused)
            staged.records = writer.records
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return staged


# -- run record ----------------------------------------------------------------------------


def _wbmerge_block(target: Target, options: MergeOptions, rank_block: dict | None) -> dict:
    first = target.sources[0].rank
    block = dict(rank_block or {}) if target.kind != "shared" else {}
    block.update(
        job_id=options.job_id or first.job_id,
        run_mode=options.run_mode,
        rank_scope=options.rank_scope,
        world_size=first.world_size,
        local_world_size=first.local_world_size,
        num_workers=first.num_workers,
        primary_rank=target.primary_rank,
        labels={str(rank): label for rank, label in sorted(target.labels.items())},
        sources=[
            {"rank": s.rank.rank, "label": s.label, "restart": s.restart, "run_id": _run_id(s)}
            for s in (*target.sources, *target.extra_system_sources)
        ],
    )
    if target.worker is not None:
        block["worker"] = target.worker
    return block


def _run_id(source: Source) -> str:
    return source.path.name[len("run-") : -len(".wandb")]


def _rewrite_run(payload: bytes, target: Target, options: MergeOptions) -> bytes:
    record = pb.Record.FromString(payload)
    run = record.run
    rank_block = None
    kept = []
    for item in run.config.update:
        key = item.key or (item.nested_key[0] if len(item.nested_key) == 1 else "")
        if key == METADATA_KEY:
            try:
                rank_block = json.loads(item.value_json)
            except ValueError:
                rank_block = None
            continue
        kept.append(item)
    del run.config.update[:]
    run.config.update.extend(kept)
    block = run.config.update.add()
    block.key = METADATA_KEY
    block.value_json = json.dumps(_wbmerge_block(target, options, rank_block))
    run.run_id = target.id
    run.display_name = target.display_name
    if target.group is not None:
        run.run_group = target.group
    if target.job_type:
        run.job_type = target.job_type
    if options.project:
        run.project = options.project
    if options.entity:
        run.entity = options.entity
    return record.SerializeToString()


def _exit_record(code: int) -> bytes:
    record = pb.Record()
    record.exit.exit_code = code
    return record.SerializeToString()


# -- pass-through (new, auto) --------------------------------------------------------------


_PASSTHROUGH_READ = 128 * BLOCK_SIZE
# records a pass-through does not copy as they are (a history record only when restarts
# continue each other's steps)
_RUN, _HEADER, _EXIT, _FILES = (records.code(k) for k in ("run", "header", "exit", "files"))
_UNKNOWN = 0  # the kind code of a record of no known kind (checked before it is copied)
_SPECIAL = [_RUN, _HEADER, _EXIT, _FILES, _UNKNOWN]
_SPECIAL_SEVERAL = [*_SPECIAL, records.code("history")]


def _write_passthrough(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    staged: Staged,
    refused: set[tuple[Path, str]],
) -> None:
    """A rank's records as they are (restarts concatenated), the run record rewritten and
    `files` records without the paths that would lead the uploader out of the run's files
    (`stagefiles.files_record`): one clean log by copying its blocks (`_write_spliced`), anything else
    record by record."""
    if len(target.sources) == 1 and not target.extra_system_sources:
        if _write_spliced(target.sources[0], target, writer, options, staged, refused):
            return
    exit_payload = None
    steps = Steps()
    several = len(target.sources) > 1
    for index, source in enumerate(target.sources):
        report = ReadReport()
        steps.restart()
        exit_payload = None
        for frames in read_frames(source.path, report, _PASSTHROUGH_READ):
            codes = records.kinds(frames)
            special = np.isin(codes, _SPECIAL_SEVERAL if several else _SPECIAL)
            starts, ends = frames.starts.tolist(), frames.ends.tolist()
            done = 0
            for at in np.flatnonzero(special).tolist():
                writer.write_many(frames.data, starts[done:at], ends[done:at])
                done = at + 1
                payload = frames.payload(at)
                kind = KIND_NAMES[codes[at]]
                if kind == "run":
                    if index == 0:
                        writer.write(_rewrite_run(payload, target, options))
                elif kind == "exit":
                    exit_payload = payload
                elif kind == "files":
                    writer.write(files_record(payload, source, staged.warnings, refused=refused))
                elif kind is None:
                    if _valid(payload, source, staged.warnings):
                        writer.write(payload)
                elif kind == "history":
                    writer.write(_continue_steps(payload, steps))
                elif index == 0:  # the header: once
                    writer.write(payload)
            writer.write_many(frames.data, starts[done:], ends[done:])
        _note_damage(staged, source, report, exit_payload is not None, target.primary_rank)
    for extra in target.extra_system_sources:
        stats = _console_and_stats(read_payloads(extra.path), extra, stats_only=True)
        for record in stats:
            writer.write(record[3])
    code = _exit_code(exit_payload)
    staged.exit_code = code
    writer.write(exit_payload if exit_payload is not None else _exit_record(code))


_HEAD_BLOCKS = 64  # how far a log's head may reach: its run record and the records beside it


def _write_spliced(
    source: Source,
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    staged: Staged,
    refused: set[tuple[Path, str]],
) -> bool:
    """One clean log without re-framing it: its head (the blocks up to the end of the run
    record) re-framed with the run record rewritten, then every later block copied as it
    is, in the kernel. The common case of `new` and `auto`: copying costs a fraction of
    framing every record again.

    Returns False, having written nothing, for any other log: damaged or truncated, without
    exactly one exit record, with a run or header record after the head, with a `files`
    record that must be changed or a record of no known kind that is not valid protobuf,
    or too short.
    """
    report = ReadReport()
    counts = np.zeros(256, np.int64)
    exit_payload = b""
    copyable = True
    for frames in read_frames(source.path, report, _PASSTHROUGH_READ):
        codes = records.kinds(frames)
        counts += np.bincount(codes, minlength=256)
        exits = np.flatnonzero(codes == _EXIT)
        if len(exits):
            exit_payload = frames.payload(int(exits[-1]))
        for index in np.flatnonzero(codes == _FILES).tolist():
            payload = frames.payload(index)
            copyable = copyable and files_record(payload, source, [], refused=refused) == payload
        for index in np.flatnonzero(codes == _UNKNOWN).tolist():
            copyable = copyable and _valid(frames.payload(index), source, []) is not None
    if report.damaged or counts[_EXIT] != 1 or not copyable:
        return False
    with open(source.path, "rb") as stream:
        for blocks in range(1, _HEAD_BLOCKS + 1):  # the head: up to the end of the run record
            head = read_head(stream, blocks)
            if head is None:
                return False
            payloads, open_record = head
            kinds = [record_kind(payload) for payload in payloads]
            if "run" in kinds:
                break
        else:
            return False
        if kinds.count("run") != counts[_RUN] or kinds.count("header") != counts[_HEADER]:
            return False  # a run or header record after the head: re-frame the whole log
        for payload, kind in zip(payloads, kinds, strict=True):
            writer.write(_rewrite_run(payload, target, options) if kind == "run" else payload)
        writer.end_block(open_record)
        copied = report.records - len(payloads)  # (the bytes read, should the log grow)
        writer.copy_blocks(stream, blocks * BLOCK_SIZE, report.bytes_read, copied)
    staged.exit_code = _exit_code(exit_payload)
    return True


class Steps:
    """Elastic restarts continue the steps: a restart that repeats steps is moved after them.

    Call `restart()` before each restart's records and `place(step)` for each of its rows
    (or `place_rows` for a read's rows at once, which also drops a row at or before the
    last one: never two rows at one step).
    """

    def __init__(self) -> None:
        self.last = -1
        self._shift: int | None = None

    def restart(self) -> None:
        self._shift = None

    def place(self, step: int) -> int:
        if self._shift is None:
            self._shift = max(0, self.last + 1 - step)
        step += self._shift
        self.last = max(self.last, step)
        return step

    def place_rows(self, steps: np.ndarray) -> np.ndarray:
        """`place` of each step in turn: the placed steps, -1 where a row is dropped (placed
        at or before the last row placed)."""
        if not len(steps):
            return steps
        if self._shift is None:
            self._shift = max(0, self.last + 1 - int(steps[0]))
        placed = steps + self._shift
        before = np.maximum.accumulate(np.concatenate([[self.last], placed[:-1]]))
        self.last = max(self.last, int(placed.max()))
        return np.where(placed > before, placed, -1)


def _continue_steps(payload: bytes, steps: Steps) -> bytes:
    """A pass-through history record, re-stepped when its restart repeated earlier steps."""
    record = pb.Record.FromString(payload)
    step = record.history.step.num
    placed = steps.place(step)
    if placed == step:
        return payload
    record.history.step.num = placed
    for item in record.history.item:
        if (list(item.nested_key) or [item.key]) == ["_step"]:
            item.value_json = str(placed)
    return record.SerializeToString()


def _exit_code(exit_payload: bytes | None) -> int:
    if exit_payload is None:
        return 1  # crashed without an exit record: a failed run
    return pb.Record.FromString(exit_payload).exit.exit_code


def _note_damage(
    staged: Staged, source: Source, report: ReadReport, complete: bool, primary: int
) -> None:
    where = f"rank {source.rank.rank} ({source.label}, restart {source.restart})"
    if report.dropped_bytes:
        staged.warnings.append(f"{where}: {report.describe()}; the readable records are kept")
    if not complete:
        role = "the primary" if source.rank.rank == primary else "a non-primary rank"
        staged.warnings.append(
            f"{where} is {role} and ended without an exit record (killed?); "
            "its data up to the crash is kept"
        )


# -- shared --------------------------------------------------------------------------------


@dataclass
class _RankState:
    """What one rank's pass-1 stream accumulates besides its rows: O(keys), not O(steps)."""

    source: Source  # first restart (label, rank)
    keys: _RankKeys
    summary: dict[bytes, bytes] = field(default_factory=dict)  # output key part -> value part
    exit_payload: bytes | None = None
    complete: bool = False


class _RankKeys:
    """One rank's item keys as they leave the merge, worked out once per distinct key.

    Maps an item's raw key part to (output key part, reserved name, skew key): user keys
    are labelled (only the top-level key, so a nested value such as an image stays whole)
    and have no reserved name; `_step`, `_runtime`, `_timestamp` and `_wandb` keep their key,
    written in the canonical `nested_key` form, and are named; the skew key is the top-level
    key of a one-level user key, whose numbers the spread is computed from.
    """

    def __init__(self, label: str, key_format: str) -> None:
        self.label = label
        self.key_format = key_format
        self.known: dict[bytes, tuple[bytes, str | None, str | None]] = {}

    def learn(self, raw: bytes) -> tuple[bytes, str | None, str | None]:
        path = wire.key_path(raw)
        top = path[0]
        if top in RESERVED:
            entry = (wire.key_part(path), top, None)
        else:
            labelled = [self.key_format.format(key=top, label=self.label), *path[1:]]
            entry = (wire.key_part(labelled), None, top if len(path) == 1 else None)
        self.known[raw] = entry
        return entry


_STEP_KEY = wire.key_part(["_step"])


def _write_shared(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    staged: Staged,
) -> None:
    by_rank: dict[int, list[Source]] = {}
    for source in target.sources:
        by_rank.setdefault(source.rank.rank, []).append(source)
    states = {
        rank: _RankState(sources[0], _RankKeys(sources[0].label, options.key_format))
        for rank, sources in by_rank.items()
    }
    primary = target.primary_rank
    for payload in read_payloads(by_rank[primary][0].path):
        kind = record_kind(payload)
        if kind == "header":
            writer.write(payload)
        elif kind == "run":
            writer.write(_rewrite_run(payload, target, options))
            break

    with _Spools(staged.run_dir.parent) as spools:
        _write_rows(by_rank, states, target, writer, options, file_map, staged, spools)
        _write_console_and_stats(by_rank, writer, spools)

    # The end: every rank's final summary, one exit record (the primary's).
    writer.write(_final_summary(states, primary))
    code = _exit_code(states[primary].exit_payload)
    staged.exit_code = code
    writer.write(_exit_record(code))


def _write_rows(
    by_rank: dict[int, list[Source]],
    states: dict[int, _RankState],
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    staged: Staged,
    spools: _Spools,
) -> None:
    primary, skew = target.primary_rank, options.skew_metrics
    # Pass 1: rows by step, with what travels with them. Each rank's log is read a few
    # MiB at a time, whose rows are labelled as columns: together a few tens of MB held.
    read_size = BLOCK_SIZE * max(8, min(_READ_BLOCKS, 1024 // len(by_rank)))
    streams = [
        _rank_events(
            sources,
            states[rank],
            rank == primary,
            target,
            options,
            file_map,
            staged,
            read_size,
            spools,
        )
        for rank, sources in by_rank.items()
    ]
    seen: set[bytes] = set()  # the same definition or file list from several ranks
    held = _Rows.empty()  # the last step's rows: more ranks' rows of it may come next
    for ready, others in _merge_batches(streams):
        rows = _Rows.concat([held, ready]).sorted()
        done = 0
        for key, event in others:  # each after the rows up to its step
            at = int(np.searchsorted(rows.steps, key[0], side="right"))
            _write_merged(rows.take(slice(done, at)), writer, primary, skew, staged)
            done = max(done, at)
            if event not in seen:
                seen.add(event)
                writer.write(event)
        keep = int(np.searchsorted(rows.steps, rows.steps[-1])) if len(rows) else done
        keep = max(keep, done)
        _write_merged(rows.take(slice(done, keep)), writer, primary, skew, staged)
        held = rows.take(slice(keep, None))
    _write_merged(held, writer, primary, skew, staged)


def _write_merged(rows: _Rows, writer: LogWriter, primary: int, skew: bool, staged: Staged) -> None:
    """One merged history record per step of `rows` (sorted by step, then rank), joined
    into one buffer and written at once."""
    count = len(rows)
    if not count:
        return
    steps = rows.steps
    firsts = np.flatnonzero(np.concatenate([[True], steps[1:] != steps[:-1]]))
    labelled, names, reserved = rows.labelled, rows.names, rows.reserved
    one_names = len({id(n) for n in names}) == 1  # (names are interned)
    pieces: list[bytes] = []
    ends: list[int] = []
    end = 0
    for a, b, step, first_rank in zip(
        firsts.tolist(),
        [*firsts[1:].tolist(), count],
        steps[firsts].tolist(),
        rows.ranks[firsts].tolist(),
        strict=True,
    ):
        if (
            skew
            or first_rank != primary
            or (not one_names and any(n != names[a] for n in names[a + 1 : b]))
        ):
            ranks = rows.ranks[a:b].tolist()
            group = [(rank, rows.row(i)) for i, rank in zip(range(a, b), ranks, strict=True)]
            record = _merged_row(step, group, primary, skew)
            pieces.append(record)
            end += len(record)
        else:  # the common case: the primary's row first, every row with the same own keys
            parts = labelled[a:b]
            parts.append(wire.item_field(_STEP_KEY, wire.value_part(str(step))))
            parts.append(reserved[a])
            record_pieces, length = wire.history_pieces(parts, step)
            pieces.extend(record_pieces)
            end += length
        ends.append(end)
    writer.write_many(b"".join(pieces), [0, *ends[:-1]], ends)
    staged.history_rows += len(ends)
    staged.source_rows += count


def _write_console_and_stats(
    by_rank: dict[int, list[Source]], writer: LogWriter, spools: _Spools
) -> None:
    # Pass 2: console and system metrics of every rank, by time, from what pass 1 set aside.
    for record in heapq.merge(
        *(
            _chain(_console_and_stats(spools.read(s), s) for s in sources)
            for sources in by_rank.values()
        ),
        key=lambda r: (r[0], r[1], r[2]),
    ):
        writer.write(record[3])


class _Spools:
    """Console and system-metric records of each source, set aside by pass 1 in a scratch
    file (length-prefixed payloads) so that pass 2 need not read the logs again."""

    def __init__(self, scratch: Path) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=".wbmerge-spool-", dir=scratch))
        self._files: dict[Path, BinaryIO] = {}

    def __enter__(self) -> _Spools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def writer(self, source: Source) -> _SpoolWriter:
        stream = self._files[source.path] = open(self._dir / f"{len(self._files)}.spool", "w+b")
        return _SpoolWriter(stream)

    def read(self, source: Source) -> Iterator[bytes]:
        stream = self._files[source.path]
        stream.flush()
        stream.seek(0)
        header = _SPOOL_LENGTH
        while chunk := stream.read(header.size):
            (length,) = header.unpack(chunk)
            yield stream.read(length)

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_SPOOL_LENGTH = struct.Struct("<I")


class _SpoolWriter:
    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream

    def write(self, payload: bytes) -> None:
        self._stream.write(_SPOOL_LENGTH.pack(len(payload)) + payload)


def _chain(iterators: Iterator[Iterator]) -> Iterator:
    for iterator in iterators:
        yield from iterator


def _merge_batches(
    streams: list[Iterator[_Batch]],
) -> Iterator[_Batch]:
    """The rows and other events of every stream in key order, in batches. Each stream
    gives batches of rows (in step order, keys (step, 0, rank)) and of other events (sorted
    by key), keys unique across streams, each batch after the stream's last.

    What every stream has up to the smallest of their batches' last keys is final: those
    rows and those events are given out, and emptied streams read their next batch.
    """
    pending: list[_Batch] = []
    live: list[Iterator[_Batch]] = []
    for stream in streams:
        batch = next(stream, None)
        if batch is not None:
            pending.append(batch)
            live.append(stream)
    first_key = itemgetter(0)
    while live:
        bound = min(map(_last_key, pending))
        ready_rows: list[_Rows] = []
        ready_others: _Events = []
        for index, (rows, others) in enumerate(pending):
            through = _rows_through(rows, bound)
            cut = bisect_right(others, bound, key=first_key)
            ready_rows.append(rows.take(slice(0, through)))
            ready_others += others[:cut]
            pending[index] = rows.take(slice(through, None)), others[cut:]
        ready_others.sort(key=first_key)
        yield _Rows.concat(ready_rows).sorted(), ready_others
        for index in reversed(range(len(live))):
            if not len(pending[index][0]) and not pending[index][1]:
                batch = next(live[index], None)
                if batch is None:
                    del live[index], pending[index]
                else:
                    pending[index] = batch


def _last_key(batch: _Batch) -> tuple:
    rows, others = batch
    keys = [others[-1][0]] if others else []
    if len(rows):
        keys.append((int(rows.steps[-1]), 0, int(rows.ranks[-1])))
    return max(keys)


def _rows_through(rows: _Rows, bound: tuple) -> int:
    """How many of a rank's rows (in step order) have keys (step, 0, rank) up to `bound`."""
    through = int(np.searchsorted(rows.steps, bound[0]))
    if (
        through < len(rows)
        and rows.steps[through] == bound[0]
        and (bound[1] > 0 or rows.ranks[through] <= bound[2])
    ):
        through += 1
    return through


def _rank_events(
    sources: list[Source],
    state: _RankState,
    is_primary: bool,
    target: Target,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    staged: Staged,
    read_size: int,
    spools: _Spools,
) -> Iterator[_Batch]:
    """One rank's pass-1 rows and other events, in batches (a read of its log each), keyed
    so that a merge of the ranks' streams aligns them by step.

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
            _fold_summaries(frames, summaries, state, summary_items)
            labelled = _label_rows(
                rows.data, starts, ends, state.keys, options.skew_metrics, row_items
            )
            placed_rows = _Rows(placed[kept], np.full(len(starts), rank, np.int64), *labelled)
            others_events: _Events = []
            others = np.flatnonzero((codes != _HISTORY) & (codes != _SUMMARY))
            if len(others):
                # the last step placed before each other record: it follows that row
                last = np.maximum.accumulate(np.concatenate([[before], placed]))
                at_row = np.searchsorted(history, others)
                for record, after in zip(others.tolist(), last[at_row].tolist(), strict=True):
                    payload = frames.payload(record)
                    event = _other_event(
                        payload, KIND_NAMES[codes[record]], state, is_primary, index, source,
                        file_map, spool, options, staged.warnings,
                    )  # fmt: skip
                    if event is not None:
                        seq += 1
                        others_events.append(((after, 1, rank, seq), event))
            if len(placed_rows) or others_events:
                yield placed_rows, others_events
        state.complete = state.exit_payload is not None
        _note_damage(
            staged, source, report, state.complete or index < len(sources) - 1, target.primary_rank
        )


_READ_BLOCKS = 64  # the most a rank's stream reads at once: 2 MiB
_HISTORY = records.code("history")
_SUMMARY = records.code("summary")


def _other_event(
    payload: bytes,
    kind: str,
    state: _RankState,
    is_primary: bool,
    restart: int,
    source: Source,
    file_map: dict[tuple[Path, str], str],
    spool: _SpoolWriter,
    options: MergeOptions,
    warnings: list[str],
) -> bytes | None:
    """What a record other than a history row or summary becomes in pass 1, if anything:
    an event for the merged log, or set aside (console, system metrics, the exit)."""
    if kind == "exit":
        state.exit_payload = payload
    elif kind == "metric":
        return _labelled_metric(payload, state.source.label, options.key_format)
    elif kind == "files":
        return files_record(payload, source, warnings, staged=file_map)
    elif kind in PASS_TWO:
        spool.write(payload)
    elif kind in ("header", "run"):
        pass  # written once by the caller
    elif is_primary:
        if restart == 0 or kind not in ("environment", "telemetry"):
            return _valid(payload, source, warnings)  # (a restart: the same machine again)
    elif kind in ("artifact", "use_artifact", "alert"):
        return _valid(payload, source, warnings)
    return None


def _valid(payload: bytes, source: Source, warnings: list[str]) -> bytes | None:
    """`payload` when it is a valid Record, else None with a warning. Records copied into
    the merged log without being parsed pass here, so that one with a valid checksum but
    invalid protobuf is dropped as damage, not handed to the uploader."""
    try:
        pb.Record.FromString(payload)
    except DecodeError:
        warnings.append(
            f"{source.label}: a record with a valid checksum is not valid protobuf; left out"
        )
        return None
    return payload


def _labelled_metric(payload: bytes, label: str, key_format: str) -> bytes:
    record = pb.Record.FromString(payload)
    metric = record.metric
    if metric.name and not metric.name.startswith("_"):
        metric.name = key_format.format(key=metric.name, label=label)
    if metric.step_metric and not metric.step_metric.startswith("_"):
        metric.step_metric = key_format.format(key=metric.step_metric, label=label)
    return record.SerializeToString()


# A rank's row on its way to the merged row: its labelled items (concatenated item
# fields), its reserved items (their names, and their fields concatenated), and (with
# --skew-metrics) its numbers by key.
_Row = tuple[bytes, tuple[str, ...], bytes, Mapping[str, float]]
_NO_NUMBERS: Mapping[str, float] = MappingProxyType({})  # a row's numbers without skew


class _Labelled(NamedTuple):
    """`_Row`s as columns: one list per field."""

    labelled: list[bytes]
    names: list[tuple[str, ...]]
    reserved: list[bytes]
    numbers: list[Mapping[str, float]]


# The records other than rows that pass 1 writes, keyed (step of the row before, 1, rank, n)
_Events = list[tuple[tuple, bytes]]


@dataclass
class _Rows:
    """History rows on their way to merged rows, as columns: row i is of rank `ranks[i]` at
    `steps[i]`, its `_Row` the i-th of the other columns."""

    steps: np.ndarray  # int64
    ranks: np.ndarray  # int64
    labelled: list[bytes]
    names: list[tuple[str, ...]]
    reserved: list[bytes]
    numbers: list[Mapping[str, float]]

    @classmethod
    def empty(cls) -> _Rows:
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), [], [], [], [])

    def __len__(self) -> int:
        return len(self.steps)

    def row(self, index: int) -> _Row:
        return self.labelled[index], self.names[index], self.reserved[index], self.numbers[index]

    def take(self, which: slice | np.ndarray) -> _Rows:
        if isinstance(which, slice):
            pick = itemgetter(which)
        else:
            indices = which.tolist()
            pick = lambda column: [column[i] for i in indices]  # noqa: E731
        return _Rows(
            self.steps[which],
            self.ranks[which],
            pick(self.labelled),
            pick(self.names),
            pick(self.reserved),
            pick(self.numbers),
        )

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        parts = [part for part in parts if len(part)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return _Rows.empty()
        return _Rows(
            np.concatenate([part.steps for part in parts]),
            np.concatenate([part.ranks for part in parts]),
            [x for part in parts for x in part.labelled],
            [x for part in parts for x in part.names],
            [x for part in parts for x in part.reserved],
            [x for part in parts for x in part.numbers],
        )

    def sorted(self) -> _Rows:
        """By step, then rank."""
        steps, ranks = self.steps, self.ranks
        if len(steps) < 2:
            return self
        ordered = (steps[1:] > steps[:-1]) | ((steps[1:] == steps[:-1]) & (ranks[1:] > ranks[:-1]))
        return self if ordered.all() else self.take(np.lexsort((ranks, steps)))


_Batch = tuple[_Rows, _Events]  # what a rank's stream gives per read


def _row(items: list[bytes], keys: _RankKeys, skew: bool) -> _Row:
    known, learn = keys.known, keys.learn
    split, item_field = wire.split_item, wire.item_field
    labelled = []
    reserved = {}
    numbers = {}
    for item in items:
        raw, value = split(item)
        out, name, skew_key = known.get(raw) or learn(raw)
        if name is None:
            labelled.append(item_field(out, value))
            if skew and skew_key is not None:
                try:
                    numbers[skew_key] = float(wire.value_json(value))
                except ValueError:
                    pass
        elif name != "_step":
            reserved[name] = item_field(out, value)
    return (
        b"".join(labelled),
        _interned(tuple(reserved)),
        b"".join(reserved.values()),
        numbers if skew else _NO_NUMBERS,
    )


def _label_rows(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    keys: _RankKeys,
    skew: bool,
    batch: items.Items | None = None,
) -> _Labelled:
    """The `_Row` of each history row (its item fields: `data[starts[i]:ends[i]]`), labelled
    as columns when the batch path applies, else item by item. `batch`: the rows' items,
    when the caller split them."""
    if not len(starts):
        return _Labelled([], [], [], [])
    if batch is None:
        batch = items.split_spans(data, starts, ends)
    if batch is not None:
        try:
            return _label_batch(batch, len(starts), keys, skew)
        except ValueError:
            pass  # a key part that is not one: the split does not hold
    rows = [
        _row(wire.region_items(data[start:end]), keys, skew)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    return _Labelled(*map(list, zip(*rows, strict=True)))


def _label_batch(batch: items.Items, count: int, keys: _RankKeys, skew: bool) -> _Labelled:
    index, raw_keys = batch.key_codes()
    entries = [keys.known.get(raw) or keys.learn(raw) for raw in raw_keys]
    outs = [out for out, _, _ in entries]
    names = [name for _, name, _ in entries]
    mine = np.flatnonzero(np.array([name is None for name in names], bool)[index])
    # W&B's own items (`_runtime`, `_timestamp`; not `_step`, which the merged row sets)
    kept = {
        name: i
        for i, name in enumerate(dict.fromkeys(n for n in names if n not in (None, "_step")))
    }
    entry_id = np.array([kept.get(name, -1) for name in names], np.int64)
    item_id = entry_id[index]
    own = np.flatnonzero(item_id >= 0)
    both = np.concatenate([mine, own])
    pieces = batch.rekeyed(both, index[both], outs)  # (one pass for both kinds of item)
    labelled = items.join_rows(
        pieces[: 2 * len(mine)], 2 * np.bincount(batch.row[mine], minlength=count)
    )
    names_of, blobs = _reserved(
        batch.row[own], item_id[own], list(kept), pieces[2 * len(mine) :], count
    )
    if not skew:
        return _Labelled(labelled, names_of, blobs, [_NO_NUMBERS] * count)
    numbers: list[dict[str, float]] = [{} for _ in range(count)]
    skew_keys = [skew_key for _, _, skew_key in entries]
    where = np.flatnonzero(np.array([k is not None for k in skew_keys], bool)[index])
    texts = batch.json(where).to_pylist()
    for row, entry, text in zip(
        batch.row[where].tolist(), index[where].tolist(), texts, strict=True
    ):
        try:
            numbers[row][skew_keys[entry]] = float(text)
        except ValueError:
            pass
    return _Labelled(labelled, names_of, blobs, numbers)


def _reserved(
    rows: np.ndarray, item_id: np.ndarray, by_id: list[str], pieces: pa.Array, count: int
) -> tuple[list[tuple[str, ...]], list[bytes]]:
    """Each row's reserved items (`_runtime`, `_timestamp`, ...): their names, and their
    fields concatenated in row order, as `_row` gives them. Item i is in row `rows[i]`,
    named `by_id[item_id[i]]`, its field the two `pieces` from 2 i."""
    if not len(rows):
        return [()] * count, [b""] * count
    per_row = np.bincount(rows, minlength=count)
    width = int(per_row[0])
    if width and (per_row == width).all():  # the usual: every row the same names in order
        grid = item_id.reshape(count, width)
        if len(set(grid[0].tolist())) == width and (grid == grid[0]).all():
            names_tuple = _interned(tuple(by_id[i] for i in grid[0].tolist()))
            return [names_tuple] * count, items.join_rows(pieces, 2 * per_row)
    per_name = np.bincount(rows * len(by_id) + item_id, minlength=count * len(by_id))
    if (per_name > 1).any():  # a name twice in a row: the last one counts, as in `_row`
        dicts: list[dict[str, bytes]] = [{} for _ in range(count)]
        fields = items.join_rows(pieces, np.full(len(rows), 2))
        for row, name_id, field in zip(rows.tolist(), item_id.tolist(), fields, strict=True):
            dicts[row][by_id[name_id]] = field
        return [tuple(d) for d in dicts], [b"".join(d.values()) for d in dicts]
    blobs = items.join_rows(pieces, 2 * per_row)
    # a row's names in its order, as one number: its items' ids + 1 as digits, in base n + 1
    first = np.ones(len(rows), bool)
    first[1:] = rows[1:] != rows[:-1]
    starts = np.flatnonzero(first)
    position = np.arange(len(rows)) - np.repeat(starts, np.diff(np.append(starts, len(rows))))
    digits = item_id + 1
    base = len(by_id) + 1
    order_key = np.zeros(count, np.int64)
    for nth in range(int(position.max()) + 1):
        at = position == nth
        order_key[rows[at]] = order_key[rows[at]] * base + digits[at]
    spelled = {
        key: _interned(_names_of_key(key, base, by_id)) for key in np.unique(order_key).tolist()
    }
    return [spelled[key] for key in order_key.tolist()], blobs


_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}


def _interned(names: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple object for equal names, so rows can be compared by identity."""
    return _NAMES.setdefault(names, names)


def _names_of_key(key: int, base: int, by_id: list[str]) -> tuple[str, ...]:
    spelled = []
    while key:
        key, digit = divmod(key, base)
        spelled.append(by_id[digit - 1])
    return tuple(reversed(spelled))


def _fold_summaries(
    frames: Frames,
    which: np.ndarray,
    state: _RankState,
    batch: items.Items | None = None,
) -> None:
    """Fold the summary records `which`, in order, into the rank's summary (the last value
    of a key wins). `batch`: their items, when the caller split them."""
    if not len(which):
        return
    if batch is None:
        starts, ends = records.body_spans(frames, which, 0x1A)
        if (starts >= 0).all():
            batch = items.split_spans(frames.data, starts, ends)
    if batch is not None:
        try:
            index, raw_keys = batch.key_codes()
            known, learn = state.keys.known, state.keys.learn
            entries = [known.get(raw) or learn(raw) for raw in raw_keys]
        except ValueError:
            batch = None
    if batch is None:  # (a removed key, say)
        for record in which.tolist():
            _fold_summary(frames.payload(record), state)
        return
    last = np.full(len(entries), -1, np.int64)
    np.maximum.at(last, index, np.arange(len(index)))
    order = np.argsort(last)  # keys that share an output key: the later one wins
    values = batch.values(last[order]).to_pylist()
    folded = state.summary
    for entry, value in zip(order.tolist(), values, strict=True):
        folded[entries[entry][0]] = value


def _fold_summary(payload: bytes, state: _RankState) -> None:
    known, learn = state.keys.known, state.keys.learn
    split = wire.split_item
    folded = state.summary
    updates, removes = wire.summary_items(payload)
    for item in updates:
        raw, value = split(item)
        folded[(known.get(raw) or learn(raw))[0]] = value
    for item in removes:
        raw = split(item)[0]
        folded.pop((known.get(raw) or learn(raw))[0], None)


def _merged_row(step: int, rows: list[tuple[int, _Row]], primary: int, skew: bool) -> bytes:
    """One history record of the rows of every rank at `step`; W&B's own keys (`_runtime`,
    `_timestamp`) are the primary's, or of the lowest rank when the primary has no row."""
    if rows[0][0] != primary:  # (rows come in rank order)
        rows.sort(key=lambda r: (r[0] != primary, r[0]))
    parts = [row[0] for _, row in rows]
    parts.append(wire.item_field(_STEP_KEY, wire.value_part(str(step))))
    _, (_, names, blob, _) = rows[0]
    parts.append(blob)
    if len(rows) > 1:
        have = set(names)
        for _, (_, more, blob, _) in rows[1:]:
            if not have.issuperset(more):  # a reserved key the first row lacks: the next's
                for name, field in zip(more, wire.region_items(blob), strict=True):
                    if name not in have:
                        have.add(name)
                        parts.append(wire.item_field(*wire.split_item(field)))
    if skew:
        by_key: dict[str, list[float]] = {}
        for _, (_, _, _, numbers) in rows:
            for key, number in numbers.items():
                by_key.setdefault(key, []).append(number)
        for key, numbers in by_key.items():
            value = spread(numbers)
            if value is not None:
                parts.append(
                    wire.item_field(
                        wire.key_part([f"wbmerge/spread/{key}"]),
                        wire.value_part(json.dumps(value)),
                    )
                )
    return wire.history_record(parts, step)


def _final_summary(states: dict[int, _RankState], primary: int) -> bytes:
    """Every rank's final values under its labelled keys; W&B's own keys are the primary's."""
    parts = []
    for rank, state in sorted(states.items()):
        reserved = {out for out, name, _ in state.keys.known.values() if name is not None}
        for out, value in state.summary.items():
            if out in reserved and rank != primary:
                continue
            parts.append(wire.item_field(out, value))
    return wire.summary_record(b"".join(parts))


def _console_and_stats(
    payloads: Iterable[bytes], source: Source, stats_only: bool = False
) -> Iterator[tuple[float, int, int, bytes]]:
    """One source's console lines (whole lines, `[label] ` prefixed) and system metrics
    (`/l:{label}` suffixed), as (timestamp, rank, n, payload), in file order."""
    label = source.label
    rank = source.rank.rank
    suffix = f"/l:{label}"
    pending: dict[int, tuple[float, list[str]]] = {}  # output type -> (time, text so far)
    n = 0
    for payload in payloads:
        kind = record_kind(payload)
        if kind == "stats":
            record = pb.Record.FromString(payload)
            for item in record.stats.item:
                if not item.key.endswith(suffix) and "/l:" not in item.key:
                    item.key += suffix
            t = record.stats.timestamp
            n += 1
            yield (t.seconds + t.nanos / 1e9, rank, n, record.SerializeToString())
        elif kind in ("output_raw", "output") and not stats_only:
            record = pb.Record.FromString(payload)
            out = record.output_raw if kind == "output_raw" else record.output
            when = out.timestamp.seconds + out.timestamp.nanos / 1e9
            started, parts = pending.get(out.output_type) or (when, [])
            parts.append(out.line)
            text = "".join(parts)
            if "\n" not in text:
                pending[out.output_type] = (started, [text])
                continue
            *lines, rest = text.split("\n")
            for line in lines:
                n += 1
                yield (started, rank, n, _console_record(out.output_type, started, label, line))
            if rest:
                pending[out.output_type] = (when, [rest])
            else:
                pending.pop(out.output_type, None)
    for output_type, (started, parts) in pending.items():
        text = "".join(parts)
        if text:
            n += 1
            yield (started, rank, n, _console_record(output_type, started, label, text))


def _console_record(output_type: int, when: float, label: str, line: str) -> bytes:
    record = pb.Record()
    out = record.output_raw
    out.output_type = output_type
    out.timestamp.FromNanoseconds(int(when * 1e9))
    prefix = f"[{label}] "
    out.line = prefix + line.replace("\r", "\r" + prefix) + "\n"
    return record.SerializeToString()

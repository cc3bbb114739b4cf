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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

from .plan import Source, Target
from .topology import METADATA_KEY
from .txlog import LogWriter, ReadReport, read_payloads, record_kind

UNLABELLED = ("_step", "_runtime", "_timestamp")
PASS_TWO = ("output_raw", "output", "stats")
WANDB_FILES = {
    "requirements.txt",
    "wandb-metadata.json",
    "config.yaml",
    "wandb-summary.json",
    "diff.patch",
    "conda-environment.yaml",
    "wandb-job.json",
}
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
    """Write `target` under `out_dir` as `offline-run-<time>-<id>/`; returns what was written."""
    start = target.sources[0].start_time
    stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime(start or time.time()))
    run_dir = out_dir / f"offline-run-{stamp}-{target.id}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "files").mkdir(parents=True)
    staged = Staged(target, run_dir)
    file_map = _stage_files(target, run_dir / "files", staged.warnings)
    with open(staged.log_path, "wb") as stream, LogWriter(stream) as writer:
        if target.kind == "shared":
            _write_shared(target, writer, options, file_map, staged)
        else:
            _write_passthrough(target, writer, options, staged)
        staged.records = writer.records
    return staged


# -- files ---------------------------------------------------------------------------------


def _stage_files(target: Target, dest: Path, warnings: list[str]) -> dict[tuple[Path, str], str]:
    """Copy every source's `files/` into `dest`; returns (source, name) -> staged name.

    The primary's files are kept as they are. Of other ranks (shared mode), wandb's own
    files are the primary's business and skipped; their media and user files are kept, and
    one whose name is taken by different content moves to `{label}/{name}`.
    """
    mapping: dict[tuple[Path, str], str] = {}
    for source in target.sources:
        files = source.path.parent / "files"
        if not files.is_dir():
            continue
        primary = source.rank.rank == target.primary_rank
        for path in sorted(files.rglob("*")):
            if not path.is_file():
                continue
            name = path.relative_to(files).as_posix()
            if name.startswith("output") and name.endswith(".log"):
                continue  # rebuilt by the uploader from the console records
            if (
                not primary
                and target.kind == "shared"
                and (name in WANDB_FILES or name.startswith("code/"))
            ):
                continue
            staged_name = name
            existing = dest / name
            if existing.exists() and not _same_file(existing, path):
                staged_name = f"{source.label}/{name}"
                warnings.append(
                    f"{source.label}: file {name} also written by another rank; kept as {staged_name}"
                )
            mapping[(source.path, name)] = staged_name
            target_path = dest / staged_name
            if not target_path.exists():
                target_path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target_path)
    return mapping


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


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


def _write_passthrough(
    target: Target, writer: LogWriter, options: MergeOptions, staged: Staged
) -> None:
    """A rank's records as they are (restarts concatenated), the run record rewritten."""
    exit_payload = None
    steps = _Steps()
    several = len(target.sources) > 1
    for index, source in enumerate(target.sources):
        report = ReadReport()
        steps.restart()
        exit_payload = None
        for payload in read_payloads(source.path, report):
            kind = record_kind(payload)
            if kind == "run":
                if index == 0:
                    writer.write(_rewrite_run(payload, target, options))
                continue
            if kind == "header" and index > 0:
                continue
            if kind == "exit":
                exit_payload = payload
                continue
            if kind == "history" and several:
                payload = _continue_steps(payload, steps)
            writer.write(payload)
        _note_damage(staged, source, report, exit_payload is not None, target.primary_rank)
    for extra in target.extra_system_sources:
        for record in _console_and_stats(extra, options, stats_only=True):
            writer.write(record[3])
    code = _exit_code(exit_payload)
    staged.exit_code = code
    writer.write(exit_payload if exit_payload is not None else _exit_record(code))


def _copy_one(target: Target, writer: LogWriter, options: MergeOptions, staged: Staged) -> None:
    """The hot path of `new` and `auto`: bytes in, bytes out; only the run record is parsed.

    The exit record is the last one wandb writes, so only the last payload is looked at.
    """
    source = target.sources[0]
    report = ReadReport()
    payloads = read_payloads(source.path, report)
    last = None
    for payload in payloads:
        kind = record_kind(payload)
        if kind == "run":
            writer.write(_rewrite_run(payload, target, options))
            break
        writer.write(payload)
    write = writer.write
    for payload in payloads:
        if last is not None:
            write(last)
        last = payload
    complete = last is not None and record_kind(last) == "exit"
    if last is not None:
        write(last)
    staged.exit_code = _exit_code(last if complete else None)
    if not complete:
        write(_exit_record(staged.exit_code))
    _note_damage(staged, source, report, complete, target.primary_rank)


class _Steps:
    """Elastic restarts continue the steps: a restart that repeats steps is moved after them.

    Call `restart()` before each restart's records and `place(step)` for each of its rows.
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


def _continue_steps(payload: bytes, steps: _Steps) -> bytes:
    """A pass-through history record, re-stepped when its restart repeated earlier steps."""
    record = pb.Record.FromString(payload)
    step = record.history.step.num
    placed = steps.place(step)
    if placed == step:
        return payload
    record.history.step.num = placed
    for item in record.history.item:
        if _item_path(item) == ["_step"]:
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
    summary: dict[tuple[str, ...], str] = field(default_factory=dict)
    exit_payload: bytes | None = None
    complete: bool = False


class _Labeller:
    """`{key}/{label}` with a cache: the same few keys are labelled millions of times."""

    def __init__(self, key_format: str) -> None:
        self.key_format = key_format
        self._cache: dict[tuple[str, str], str] = {}

    def __call__(self, key: str, label: str) -> str:
        try:
            return self._cache[key, label]
        except KeyError:
            labelled = self._cache[key, label] = self.key_format.format(key=key, label=label)
            return labelled


def _item_path(item: pb.HistoryItem | pb.SummaryItem) -> list[str]:
    """A value's key path: media and dicts are nested (`["samples/image", "path"]`)."""
    return list(item.nested_key) if item.nested_key else [item.key]


def _write_shared(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    staged: Staged,
) -> None:
    label_key = _Labeller(options.key_format)
    by_rank: dict[int, list[Source]] = {}
    for source in target.sources:
        by_rank.setdefault(source.rank.rank, []).append(source)
    states = {rank: _RankState(sources[0]) for rank, sources in by_rank.items()}
    primary = target.primary_rank
    for payload in read_payloads(by_rank[primary][0].path):
        kind = record_kind(payload)
        if kind == "header":
            writer.write(payload)
        elif kind == "run":
            writer.write(_rewrite_run(payload, target, options))
            break

    # Pass 1: rows by step, with what travels with them.
    streams = [
        _rank_events(sources, states[rank], rank == primary, target, options, file_map, staged)
        for rank, sources in by_rank.items()
    ]
    current_step = None
    row: list[tuple[int, pb.HistoryRecord]] = []
    seen: set[bytes] = set()  # the same definition or file list from several ranks

    def flush_row() -> None:
        if row:
            writer.write(_merged_row(current_step, row, primary, by_rank, label_key, options))
            staged.history_rows += 1

    for key, event in heapq.merge(*streams, key=lambda e: e[0]):
        step, order, rank = key[0], key[1], key[2]
        if order == 0:  # a history row of `rank` at `step`
            if step != current_step:
                flush_row()
                current_step, row = step, []
            row.append((rank, event))
            staged.source_rows += 1
            continue
        flush_row()
        row = []
        current_step = None
        if event not in seen:
            seen.add(event)
            writer.write(event)
    flush_row()

    # Pass 2: console and system metrics of every rank, by time.
    for record in heapq.merge(
        *(_chain(_console_and_stats(s, options) for s in sources) for sources in by_rank.values()),
        key=lambda r: (r[0], r[1], r[2]),
    ):
        writer.write(record[3])

    # The end: every rank's final summary, one exit record (the primary's).
    writer.write(_final_summary(states, primary, label_key))
    code = _exit_code(states[primary].exit_payload)
    staged.exit_code = code
    writer.write(_exit_record(code))


def _chain(iterators: Iterator[Iterator]) -> Iterator:
    for iterator in iterators:
        yield from iterator


def _rank_events(
    sources: list[Source],
    state: _RankState,
    is_primary: bool,
    target: Target,
    options: MergeOptions,
    file_map: dict[tuple[Path, str], str],
    staged: Staged,
) -> Iterator[tuple[tuple, object]]:
    """One rank's pass-1 events, keyed so that a heap merge aligns ranks by step.

    History rows have key (step, 0, rank); other records (step of the last row, 1, rank,
    n) so they follow the row they were written after. Restarts are concatenated.
    """
    rank = state.source.rank.rank
    label = state.source.label
    steps = _Steps()
    last_step = -1  # of the rows yielded: other records follow the row before them
    seq = 0
    for index, source in enumerate(sources):
        report = ReadReport()
        steps.restart()
        state.exit_payload = None
        for payload in read_payloads(source.path, report):
            kind = record_kind(payload)
            if kind == "history":
                history = pb.Record.FromString(payload).history
                step = steps.place(history.step.num)
                if step <= last_step:
                    continue  # never two rows of one rank at one step
                last_step = step
                yield (step, 0, rank), history
            elif kind == "summary":
                summary = pb.Record.FromString(payload).summary
                folded = state.summary
                for item in summary.update:
                    folded[tuple(item.nested_key) or (item.key,)] = item.value_json
                for item in summary.remove:
                    folded.pop(tuple(item.nested_key) or (item.key,), None)
            elif kind == "exit":
                state.exit_payload = payload
            elif kind == "metric":
                seq += 1
                yield (
                    (last_step, 1, rank, seq),
                    _labelled_metric(payload, label, options.key_format),
                )
            elif kind == "files":
                seq += 1
                yield (last_step, 1, rank, seq), _mapped_files(payload, source.path, file_map)
            elif kind in PASS_TWO or kind in ("header", "run"):
                continue  # pass 2, or written once by the caller
            elif is_primary:
                if index > 0 and kind in ("environment", "telemetry"):
                    continue  # a restart describes the same machine again
                seq += 1
                yield (last_step, 1, rank, seq), payload
            elif kind in ("artifact", "use_artifact", "alert"):
                seq += 1
                yield (last_step, 1, rank, seq), payload
        state.complete = state.exit_payload is not None
        _note_damage(
            staged, source, report, state.complete or index < len(sources) - 1, target.primary_rank
        )


def _labelled_metric(payload: bytes, label: str, key_format: str) -> bytes:
    record = pb.Record.FromString(payload)
    metric = record.metric
    if metric.name and not metric.name.startswith("_"):
        metric.name = key_format.format(key=metric.name, label=label)
    if metric.step_metric and not metric.step_metric.startswith("_"):
        metric.step_metric = key_format.format(key=metric.step_metric, label=label)
    return record.SerializeToString()


def _mapped_files(
    payload: bytes, source_path: Path, file_map: dict[tuple[Path, str], str]
) -> bytes:
    record = pb.Record.FromString(payload)
    kept = []
    for item in record.files.files:
        staged_name = file_map.get((source_path, item.path))
        if staged_name is not None:
            item.path = staged_name
            kept.append(item)
    del record.files.files[:]
    record.files.files.extend(kept)
    return record.SerializeToString()


def _merged_row(
    step: int,
    rows: list[tuple[int, pb.HistoryRecord]],
    primary: int,
    by_rank: dict[int, list[Source]],
    label_key: Callable[[str, str], str],
    options: MergeOptions,
) -> bytes:
    record = pb.Record()
    merged = record.history
    merged.step.num = step
    times: dict[str, str] = {}
    time_owner = None
    values: dict[str, list[float]] = {}
    for rank, history in sorted(rows, key=lambda r: (r[0] != primary, r[0])):
        label = by_rank[rank][0].label
        add = merged.item.add
        for item in history.item:
            nested = item.nested_key
            key = nested[0] if nested else item.key
            if key in UNLABELLED:
                if key != "_step" and (time_owner is None or time_owner == rank):
                    times[key] = item.value_json
                    time_owner = rank
                continue
            out = add()
            # only the top-level key is labelled, so a nested value (an image) stays whole
            if len(nested) > 1:
                out.nested_key.extend([label_key(key, label), *nested[1:]])
            else:
                out.nested_key.append(label_key(key, label))
            out.value_json = item.value_json
            if options.skew_metrics and len(nested) <= 1:
                try:
                    values.setdefault(key, []).append(float(item.value_json))
                except ValueError:
                    pass
    for key, value in (("_step", str(step)), *times.items()):
        out = merged.item.add()
        out.nested_key.append(key)
        out.value_json = value
    if options.skew_metrics:
        for key, numbers in values.items():
            if len(numbers) > 1:
                numbers.sort()
                median = numbers[len(numbers) // 2]
                spread = (numbers[-1] - numbers[0]) / median if median else 0.0
                out = merged.item.add()
                out.nested_key.append(f"wbmerge/spread/{key}")
                out.value_json = json.dumps(spread)
    return record.SerializeToString()


def _final_summary(
    states: dict[int, _RankState], primary: int, label_key: Callable[[str, str], str]
) -> bytes:
    record = pb.Record()
    for rank, state in sorted(states.items()):
        label = state.source.label
        for path, value in state.summary.items():
            if path[0] in (*UNLABELLED, "_wandb"):
                if rank != primary:
                    continue
                item = record.summary.update.add()
                item.nested_key.extend(path)
            else:
                item = record.summary.update.add()
                item.nested_key.append(label_key(path[0], label))
                item.nested_key.extend(path[1:])
            item.value_json = value
    return record.SerializeToString()


def _console_and_stats(
    source: Source, options: MergeOptions, stats_only: bool = False
) -> Iterator[tuple[float, int, int, bytes]]:
    """One source's console lines (whole lines, `[label] ` prefixed) and system metrics
    (`/l:{label}` suffixed), as (timestamp, rank, n, payload), in file order."""
    label = source.label
    rank = source.rank.rank
    suffix = f"/l:{label}"
    pending: dict[int, tuple[float, list[str]]] = {}  # output type -> (time, text so far)
    n = 0
    for payload in read_payloads(source.path):
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

"""One offline run, and what it says about itself.

`read_identity` reads just a run's head and last block: its ids, project, group, job type,
display name, config (the `wbmerge` block of `wbmerge.init`, and the keys people use for
ranks), its `x_label` (the `/l:<label>` suffix of system-metric keys, or
`files/output_<label>.log`), how its process was started (host, command line, SLURM
variables, the GPU it used) and when it started and last wrote. `scan` is a full pass that
counts rows and steps and finds damage. What these facts make of ranks and jobs is decided
elsewhere (`jobs`, pure).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from ..errors import NotATransactionLog, WbmergeError
from ..log import (
    BLOCK_SIZE,
    FILE_HEADER,
    Frames,
    ReadReport,
    pb,
    read_frames,
    read_tail,
    record_kind,
    records,
)
from ..plan import Source, Target, run_id_from_file
from ..training import METADATA_KEY, RankInfo
from . import rankclaims
from .merged import MergedBy, is_merge_block, merged_by, merged_target

_STATS_LABEL = re.compile(r"/l:(.+)$")
_OUTPUT_LABEL = re.compile(r"^output_(.+)\.log$")
_HEADER_SCAN_LIMIT = 2000  # records read for identity before giving up on a long run

_CLAIM_KEYS = {key for keys in rankclaims.CONFIG_KEYS.values() for key in keys}


@dataclass
class RunStats:
    """What a full pass over a run's records found."""

    records: int = 0
    history_rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    complete: bool = False  # an exit record was seen
    exit_code: int | None = None
    report: ReadReport = field(default_factory=ReadReport)

    def count(self, frames: Frames) -> records.RecordIndex:
        """Count one read's records (rows, steps, the exit record); its index, for more."""
        index = records.RecordIndex(frames)
        self.records += len(index)
        steps = index.rows.steps
        if len(steps):
            self.history_rows += len(steps)
            if self.first_step is None:
                self.first_step = int(steps[0])
            self.last_step = int(steps[-1])
        for record in index.of("exit").tolist():
            self.complete = True
            self.exit_code = pb.Record.FromString(frames.payload(record)).exit.exit_code
        return index


@dataclass
class OfflineRun:
    """One offline run directory and what it says about itself."""

    path: Path  # the run-<id>.wandb file
    run_id: str
    project: str = ""
    entity: str = ""
    group: str = ""
    job_type: str = ""
    display_name: str = ""
    host: str = ""
    start_time: float = 0.0
    end_time: float = 0.0  # the latest time its last records show
    label: str | None = None  # x_label as recorded or found; after `identify`, the label used
    config: dict = field(default_factory=dict)  # the config keys that may say a rank
    settings: dict = field(default_factory=dict)  # the rest of the config, key -> JSON
    has_run_record: bool = False  # a run killed at once may have written nothing
    metadata: RankInfo | None = None  # the `wbmerge` block, if any
    merged: MergedBy | None = None  # a merge wrote this run (its block says how)
    metadata_label: str | None = None
    args: tuple[str, ...] = ()  # the command line (wandb's environment record)
    slurm: dict = field(default_factory=dict)  # its SLURM_* variables, as wandb recorded them
    process_gpus: set[int] = field(default_factory=set)  # GPUs its process used (stats)
    rank: RankInfo | None = None
    rank_source: str | None = None  # one of rankclaims.SOURCES, None when unknown
    rank_guessed: bool = False  # its job's rank 0 is only the run that started first
    problem: str | None = None  # why the rank is unknown
    unreadable: str | None = None  # why the file could not be read (discover's keep_unreadable)
    warnings: list[str] = field(default_factory=list)  # about its job, shown once per job
    defaults: dict = field(default_factory=dict)  # run_mode etc. recorded at training time
    stats: RunStats | None = None

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    @property
    def job_id(self) -> str | None:
        """The job of a rank's run, or the job a merged run was merged from."""
        if self.rank is not None:
            return self.rank.job_id
        return self.merged.job_id if self.merged is not None else None

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def merged_target(self) -> Target:
        """This run, which a merge wrote, as the target that uploads it unchanged."""
        assert self.merged is not None, "only a merge's output is a merged target"
        return merged_target(
            self.path,
            self.run_id,
            self.merged,
            self.group,
            self.display_name,
            self.job_type,
            self.start_time,
        )

    def source(self) -> Source:
        """This run as a source of the runs a merge makes (after `identify` gave its rank)."""
        assert self.rank is not None, "a run is a source only once its rank is known"
        return Source(
            self.path, self.rank, self.label or self.rank.label, start_time=self.start_time
        )


def read_identity(path: Path) -> OfflineRun:
    """Read just enough of a run to know its ids and rank (the run and first config records)."""
    run = OfflineRun(path=path, run_id=run_id_from_file(path))
    for count, payload in enumerate(_payloads(path, read_size=_IDENTITY_READ)):
        kind = record_kind(payload)
        if kind == "run":
            _apply_run_record(run, pb.Record.FromString(payload).run)
        elif kind == "config" and run.rank is None:
            _apply_config(run, pb.Record.FromString(payload).config.update)
        elif kind == "environment":
            _apply_environment(run, pb.Record.FromString(payload).environment)
        elif kind == "stats":
            stats = pb.Record.FromString(payload).stats
            run.label = run.label if run.label is not None else _label_from_stats(stats)
            run.process_gpus |= _process_gpus(stats)
        elif kind == "history" and run.label is not None:
            break  # identity comes before the first logged step
        if count > _HEADER_SCAN_LIMIT:
            break
    if run.label is None:
        run.label = _label_from_files(path.parent / "files")
    run.end_time = _end_time(path, run.start_time)
    return run


def _end_time(path: Path, start: float) -> float:
    """The latest time the records at the end of a run show (its start when none do)."""
    try:
        with open(path, "rb") as stream:
            tail = read_tail(stream)
    except OSError:
        return start
    latest = start
    # Records of one kind are written in time order, so the last of each kind that carries
    # a time says all: at most five records are parsed, not the whole block (at 1024 ranks
    # parsing every record of every last block was most of discovery's time).
    last_of_kind: dict[str, bytes] = {}
    for payload in reversed(tail):
        kind = record_kind(payload)
        if kind in _TIMED_KINDS and kind not in last_of_kind:
            last_of_kind[kind] = payload
    for payload in last_of_kind.values():
        try:
            record = pb.Record.FromString(payload)
        except DecodeError:  # a damaged tail says nothing about time
            continue
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            latest = max(latest, start + record.exit.runtime)
        elif kind in ("stats", "output_raw", "output"):
            stamp = getattr(record, kind).timestamp
            latest = max(latest, stamp.seconds + stamp.nanos / 1e9)
        elif kind == "history":
            for item in record.history.item:
                if (item.key or "/".join(item.nested_key)) == "_timestamp":
                    latest = max(latest, _seconds(item.value_json, latest))
    return latest


_TIMED_KINDS = frozenset({"exit", "stats", "output_raw", "output", "history"})


def _seconds(value_json: str, default: float) -> float:
    """A `_timestamp` value: JSON seconds since the epoch (`default` if it is not one)."""
    try:
        value = float(value_json)
    except ValueError:
        return default
    return value if math.isfinite(value) else default


# The run and config records are in the first block; a read costs per block walked, so
# reading one block at a time (more only when identity is not in it) keeps discovery cheap.
_IDENTITY_READ = BLOCK_SIZE


def _payloads(
    path: Path, report: ReadReport | None = None, read_size: int = 32 * BLOCK_SIZE
) -> Iterator[bytes]:
    """`read_payloads` with the user-facing errors of a bad or unreadable file."""
    for frames in _frames(path, report, read_size):
        yield from frames.payloads()


def _frames(
    path: Path, report: ReadReport | None = None, read_size: int = 32 * BLOCK_SIZE
) -> Iterator[Frames]:
    """`read_frames` with the user-facing errors of a bad or unreadable file."""
    try:
        yield from read_frames(path, report, read_size)
    except NotATransactionLog as exc:
        raise WbmergeError(f"{path}: {exc}") from None
    except OSError as exc:
        raise WbmergeError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _apply_run_record(run: OfflineRun, record: pb.RunRecord) -> None:
    run.has_run_record = True
    run.run_id = record.run_id or run.run_id
    run.project, run.entity = record.project, record.entity
    run.group, run.job_type = record.run_group, record.job_type
    run.display_name, run.host = record.display_name, record.host
    run.start_time = record.start_time.seconds + record.start_time.nanos / 1e9
    _apply_config(run, record.config.update)


def _apply_config(run: OfflineRun, updates: Iterable[pb.ConfigItem]) -> None:
    for item in updates:
        key = item.key or (item.nested_key[0] if len(item.nested_key) == 1 else "")
        top = item.key or (item.nested_key[0] if item.nested_key else "")
        if key.lower() in _CLAIM_KEYS:
            run.config[key] = rankclaims.config_value(item.value_json)
        elif top not in (METADATA_KEY, "_wandb"):  # (`_wandb.visualize.KEY` is wandb's too)
            path = item.key or "/".join(item.nested_key)
            run.settings[path] = item.value_json
        if key != METADATA_KEY or run.metadata is not None or run.merged is not None:
            continue
        block = rankclaims.config_value(item.value_json)
        if is_merge_block(block):  # a merge's output: no rank of a job, a run to upload
            run.merged = merged_by(block)
            if run.merged is None:
                run.unreadable = (
                    f"{run.path}: its wbmerge block lists the sources of a merge but not how "
                    "they were merged; it is neither a merged run nor a rank's"
                )
            continue
        try:
            run.metadata = RankInfo.from_metadata(block)  # type: ignore[arg-type]
        except (ValueError, TypeError, AttributeError):
            continue  # a block that is not ours: the run is read like any other
        label = block.get("label")  # type: ignore[union-attr]
        run.metadata_label = label if isinstance(label, str) and label else None
        run.defaults = {k: block[k] for k in ("run_mode", "rank_scope") if block.get(k)}  # type: ignore[union-attr]


def _apply_environment(run: OfflineRun, env: pb.EnvironmentRecord) -> None:
    """How the run's process was started: its host, command line and SLURM variables.
    wandb writes the record more than once, later ones with only some fields set, so a
    field is taken from the first record that has it."""
    run.host = run.host or env.host
    run.args = run.args or tuple(env.args)
    run.slurm = run.slurm or dict(env.slurm)


# wandb-core names the metrics of a GPU the process itself uses `gpu.process.N.*` (beside
# `gpu.N.*` for every GPU of the machine); a label adds `/l:<label>`.
_PROCESS_GPU = re.compile(r"^gpu\.process\.([0-9]{1,7})\.")


def _process_gpus(stats: pb.StatsRecord) -> set[int]:
    return {int(m[1]) for item in stats.item if (m := _PROCESS_GPU.match(item.key))}


def _label_from_stats(stats: pb.StatsRecord) -> str | None:
    for item in stats.item:
        match = _STATS_LABEL.search(item.key)
        if match:
            return match[1]
    return None


def _label_from_files(files: Path) -> str | None:
    try:
        entries = sorted(files.iterdir()) if files.is_dir() else []
    except OSError:
        return None  # an unreadable files/ is named when the merge copies it
    for entry in entries:
        match = _OUTPUT_LABEL.match(entry.name)
        if match:
            return match[1]
    return None


def scan(run: OfflineRun) -> RunStats:
    """One full pass: history rows, steps, exit record, damage. Parses only what it counts."""
    stats = RunStats()
    for frames in _frames(run.path, stats.report):
        index = stats.count(frames)
        if run.label is None:
            for record in index.of("stats")[:1].tolist():
                run.label = _label_from_stats(pb.Record.FromString(frames.payload(record)).stats)
    report = stats.report
    if not stats.complete and not report.truncated:
        # wandb-core writes whole 32 KiB blocks until it closes the log, so a log without
        # an exit record that ends on a block boundary (or after the header) was cut off.
        size = report.bytes_read
        report.truncated = size % BLOCK_SIZE == 0 or size == len(FILE_HEADER)
    run.stats = stats
    return stats

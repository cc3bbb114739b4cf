"""Discover: find offline runs under the user's paths and say which rank of which job wrote each.

This module reads what each run says about itself: the `wbmerge` block in its config
(written by `wbmerge.init` / `rank_config`), the config keys people use for ranks, its
`x_label` (the `/l:<label>` suffix of system-metric keys, or `files/output_<label>.log`),
display name, group, project, job type, host, and when it started and last wrote. The
rules that turn those facts into ranks and jobs are pure and live in `jobs.py`.
"""

from __future__ import annotations

import math
import os
import re
import stat
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from . import jobs, rankclaims, records
from .errors import InputWarning, NotATransactionLog, WbmergeError
from .jobs import Hints, RunFacts, few
from .merged import MergedBy, is_merge_block, merged_by, merged_runs, merged_target
from .plan import Source, Target, run_id_from_file
from .proto import pb
from .records import record_kind
from .topology import METADATA_KEY, RankInfo
from .txlog import BLOCK_SIZE, FILE_HEADER, Frames, ReadReport, read_frames, read_tail

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
    rank: RankInfo | None = None
    rank_source: str | None = None  # one of rankclaims.SOURCES, None when unknown
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
            self.path, self.run_id, self.merged, self.group, self.display_name, self.job_type,
            self.start_time,
        )  # fmt: skip

    def source(self) -> Source:
        """This run as a source of the runs a merge makes (after `identify` gave its rank)."""
        assert self.rank is not None, "a run is a source only once its rank is known"
        return Source(
            self.path, self.rank, self.label or self.rank.label, start_time=self.start_time
        )


def find_run_files(paths: Iterable[str | Path]) -> list[Path]:
    """The `.wandb` files under each path: a file, a run directory, or any tree of them.

    Raises WbmergeError for a path that does not exist, cannot be read or holds no offline
    run. Only regular files are taken; a FIFO, socket, device, dangling link or link loop
    named `run-*.wandb` inside a directory is left out with an InputWarning (never opened),
    as is a link (wandb's `latest-run` would list a run twice, and a link may lead out of
    the directories named).
    """
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise WbmergeError(f"{path}: no such file or directory") from None
        except OSError as exc:
            raise WbmergeError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if stat.S_ISREG(mode):
            files = [path]
        elif stat.S_ISDIR(mode):
            files = sorted(_walk_wandb_files(path))
        else:
            raise WbmergeError(f"{path}: not a regular file or directory")
        if not files:
            raise WbmergeError(f"{path}: no offline W&B run (no run-*.wandb file) found")
        for file in files:
            found.setdefault(file.resolve(), None)
    return list(found)


def _walk_wandb_files(root: Path) -> Iterator[Path]:
    def unreadable(exc: OSError) -> None:
        raise WbmergeError(f"{exc.filename}: cannot read ({exc.strerror or exc})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not Path(dirpath, d).is_symlink())
        for name in sorted(filenames):
            if name.endswith(".wandb") and name.startswith("run-"):
                path = Path(dirpath, name)
                try:
                    mode = path.lstat().st_mode
                except OSError:
                    continue  # removed while we walked
                if stat.S_ISREG(mode):
                    yield path
                else:
                    kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                    warnings.warn(f"{path}: {kind}; left out", InputWarning, stacklevel=2)


def find_invalid_records(paths: Iterable[str | Path]) -> str | None:
    """One line naming the first run under `paths` that holds a record with a valid
    checksum but invalid protobuf, or None. A full parse of every record: the readers
    trust the framing for speed, so this is how a failure is traced to a hostile file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InputWarning)
        files = find_run_files(paths)
    for path in files:
        try:
            index = records.find_invalid_record(path)
        except (OSError, WbmergeError):
            continue
        if index is not None:
            return (
                f"{path}: record {index} has a valid checksum but is not a W&B record "
                "(invalid protobuf); this run cannot be read"
            )
    return None


def read_identity(path: Path) -> OfflineRun:
    """Read just enough of a run to know its ids and rank (the run and first config records)."""
    run = OfflineRun(path=path, run_id=run_id_from_file(path))
    for count, payload in enumerate(_payloads(path, read_size=_IDENTITY_READ)):
        kind = record_kind(payload)
        if kind == "run":
            _apply_run_record(run, pb.Record.FromString(payload).run)
        elif kind == "config" and run.rank is None:
            _apply_config(run, pb.Record.FromString(payload).config.update)
        elif kind == "environment" and not run.host:
            run.host = pb.Record.FromString(payload).environment.host
        elif kind == "stats" and run.label is None:
            run.label = _label_from_stats(pb.Record.FromString(payload).stats)
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
        if key.lower() in _CLAIM_KEYS:
            run.config[key] = rankclaims.config_value(item.value_json)
        elif key not in (METADATA_KEY, "_wandb"):
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
        index = records.RecordIndex(frames)
        stats.records += len(index)
        steps = index.rows.steps
        if len(steps):
            stats.history_rows += len(steps)
            if stats.first_step is None:
                stats.first_step = int(steps[0])
            stats.last_step = int(steps[-1])
        for record in index.of("exit").tolist():
            stats.complete = True
            stats.exit_code = pb.Record.FromString(frames.payload(record)).exit.exit_code
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


def identify(runs: list[OfflineRun], hints: Hints | None = None) -> None:
    """Give every run its rank, job, label and rank source (`jobs.identify`'s rules).

    A run that cannot be identified keeps `rank` None and says why in `problem`. A run
    without a run record (its rank killed before wandb wrote one) holds nothing to merge:
    it is left out of every job, with a warning. A run that a merge wrote is no rank: it
    keeps `rank` None, with `rank_source` "merged".
    """
    found_ids = {r.run_id for r in runs}
    for run in runs:
        if run.merged is not None:
            run.rank_source, run.label = "merged", run.display_name or run.run_id
        if run.unreadable:
            run.problem = run.unreadable
        elif not run.has_run_record:
            run.problem = "no run record (killed before wandb wrote one): nothing to merge"
            warnings.warn(f"{run.run_dir}: {run.problem}; left out", InputWarning, stacklevel=2)
    runs = [r for r in runs if r.has_run_record and r.merged is None and not r.unreadable]
    facts = [
        RunFacts(
            run_id=r.run_id,
            project=r.project,
            group=r.group,
            job_type=r.job_type,
            start=r.start_time,
            end=r.end_time,
            host=r.host,
            label=r.label,
            name=r.display_name,
            config=r.config,
            settings=r.settings,
            metadata=r.metadata,
            metadata_label=r.metadata_label,
            where=str(r.run_dir),
        )
        for r in runs
    ]
    found = jobs.identify(facts, hints)
    for note in found.notes:
        warnings.warn(note, InputWarning, stacklevel=2)
    for index, identity in found.identities.items():
        run = runs[index]
        run.rank, run.rank_source, run.label = identity.rank, identity.source, identity.label
    for problem in found.problems:
        for index in problem.runs:
            runs[index].problem = runs[index].problem or problem.message
    for warning in found.warnings:
        for index in warning.runs:
            runs[index].warnings.append(warning.message)
    unknown = set(hints.given) - found_ids if hints else set()
    if unknown:
        raise WbmergeError(
            f"--ranks names run(s) not found under the paths given: {', '.join(sorted(unknown))}"
        )


def discover(
    paths: Iterable[str | Path],
    full_scan: bool = False,
    hints: Hints | None = None,
    keep_unreadable: bool = False,
) -> list[OfflineRun]:
    """Every offline run under `paths`, identified, in a stable order (job, rank, restart).

    A file that is not a transaction log, or cannot be read, raises WbmergeError (one
    line), unless `keep_unreadable`: then it is a run of unknown rank whose `unreadable`
    says why, so that a diagnosis can list it beside the others.
    """
    runs = [_read_identity_or_why(p, keep_unreadable) for p in find_run_files(paths)]
    identify(runs, hints)
    if full_scan:
        for run in runs:
            if run.unreadable is None:
                _scan_or_why(run, keep_unreadable)
    return sorted(runs, key=_order)


def _read_identity_or_why(path: Path, keep_unreadable: bool) -> OfflineRun:
    try:
        return read_identity(path)
    except WbmergeError as exc:
        if not keep_unreadable:
            raise
        return OfflineRun(path=path, run_id=run_id_from_file(path), unreadable=str(exc))


def _scan_or_why(run: OfflineRun, keep_unreadable: bool) -> None:
    try:
        scan(run)
    except WbmergeError as exc:
        if not keep_unreadable:
            raise
        run.unreadable = str(exc)


def _order(run: OfflineRun) -> tuple:
    if run.merged is not None:  # after the ranks' runs, by job and id
        return (1, run.job_id, 0, 0, run.run_id, str(run.path))
    if run.rank is None:
        return (2, "", 0, 0, run.start_time, str(run.path))
    return (0, run.job_id or "", run.rank.rank, run.rank.restart, run.start_time, str(run.path))


@dataclass
class Job:
    """All offline runs of one job id."""

    job_id: str
    runs: list[OfflineRun]

    @property
    def warnings(self) -> list[str]:
        """What wbmerge assumed about this job, once each."""
        return list(dict.fromkeys(w for run in self.runs for w in run.warnings))

    @property
    def world_size(self) -> int:
        return self.runs[0].rank.world_size if self.runs[0].rank else 0

    @property
    def missing_ranks(self) -> list[int]:
        present = {r.rank.rank for r in self.runs if r.rank}
        return [rank for rank in range(self.world_size) if rank not in present]


def job_problem(
    job_id: str,
    members: list[OfflineRun],
    allow_missing_ranks: bool = False,
    without_run_record: Sequence[OfflineRun] = (),
) -> str | None:
    """Why the identified runs of one job cannot be merged, as one line, or None: two runs
    claiming one rank and restart, a world size that changes, or ranks missing (unless
    allowed; `without_run_record`, the run files found with nothing in them, may be those
    ranks). `members` are in `_order`."""
    seen: dict[tuple[int, int], OfflineRun] = {}
    for run in members:
        assert run.rank is not None
        key = (run.rank.rank, run.rank.restart)
        if key in seen:
            return (
                f"job {job_id}: rank {key[0]} (restart {key[1]}) claimed twice: "
                f"{seen[key].run_dir} and {run.run_dir}"
            )
        seen[key] = run
    sizes = {(r.rank.world_size, r.rank.local_world_size) for r in members if r.rank}
    if len(sizes) > 1:  # (the restarts share the job id: --job cannot pick one of them)
        return (
            f"job {job_id}: world size changes between its runs {sorted(sizes)}; merge the "
            "runs of each size apart (name their directories, or give them a job each in "
            "a --ranks file's job column)"
        )
    job = Job(job_id, members)
    if not job.missing_ranks or allow_missing_ranks:
        return None
    problem = (
        f"job {job_id}: rank(s) {few_ranks(job.missing_ranks)} of {job.world_size} have "
        "no offline run (pass --allow-missing-ranks to merge the others, or sync "
        "--follow while the job still runs)"
    )
    if without_run_record:  # (killed before wandb wrote their run record)
        empty = without_run_record
        problem += (
            f"; {len(empty)} run file(s) found hold no run record, e.g. {empty[0].path} "
            "(a rank killed before wandb flushed its file: see wbmerge.init's flush_every)"
        )
    return problem


def few_ranks(ranks: list[int]) -> str:
    """`1, 3, 5, ... and 504 more`: missing ranks, listed as every command lists them."""
    return few(ranks, shown=8)


def group_jobs(
    runs: list[OfflineRun], job: str | None = None, allow_missing_ranks: bool = False
) -> list[Job]:
    """Group identified runs by job id and check each job can be merged.

    Errors (WbmergeError, one line): a run that a merge wrote (it is no rank's), runs of
    unknown rank among the inputs (unless `job`
    selects another job), `job` not found, two runs claiming the same rank and restart,
    a world size that changes within a job, and ranks missing (unless allowed).
    """
    merged = merged_runs(runs, job)
    if merged:
        raise WbmergeError(
            f"{merged[0].run_dir} is a run that wbmerge merged, not a rank's run; only "
            "`wbmerge sync` (without --follow) and `inspect` take merged runs"
        )
    unknown = [r for r in runs if r.rank is None and r.has_run_record and r.merged is None]
    empty = [r for r in runs if not r.has_run_record and not r.unreadable]
    by_id: dict[str, list[OfflineRun]] = defaultdict(list)
    for run in runs:
        if run.rank is not None:
            by_id[run.job_id or ""].append(run)
    if job is not None:
        if job not in by_id:
            known = ", ".join(sorted(by_id)) or "none"
            raise WbmergeError(f"no job {job!r} among the runs found (jobs: {known})")
        by_id = {job: by_id[job]}
    elif unknown:
        problems = list(dict.fromkeys(r.problem for r in unknown if r.problem))
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        first = problems[0] if problems else f"{len(unknown)} run(s) of unknown rank"
        raise WbmergeError(f"{first}{more}")
    jobs = []
    for job_id, members in sorted(by_id.items()):
        members.sort(key=_order)
        problem = job_problem(job_id, members, allow_missing_ranks, empty)
        if problem:
            raise WbmergeError(problem)
        jobs.append(Job(job_id, members))
    return jobs

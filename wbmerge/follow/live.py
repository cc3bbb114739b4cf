"""Reading a job while its ranks still write: which runs are there yet, how far each rank
has logged, and which merged rows are final.

A rank's `.wandb` file grows while it trains: wandb-core writes it in 32 KiB blocks and,
in wandb 0.31, also every `x_transaction_log_flush_interval` seconds (15 by default). Its
tail can end inside a record; the reader stops before such a record, which is not damage
but the part the next round reads. A file that holds only its header, or no run record yet,
is a rank that has started and not yet reached the disk: it is waited for, without the
warning a finished job would give for it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputWarning, WbmergeError
from ..identify import (
    Hints,
    Job,
    OfflineRun,
    RunStats,
    find_run_files,
    group_jobs,
    identify_runs,
    merged_runs,
    read_identity,
    scan,
)
from ..plan import Source, Target
from .tails import NotIncremental, ScannedLog

NO_ROWS = -1  # the watermark of a target that may show no merged row yet


@dataclass(frozen=True)
class Progress:
    """How far one rank (all its restarts) has written."""

    rank: int
    last_step: int  # the step of its last row as the merge places it; NO_ROWS for none
    finished: bool  # its latest restart has an exit record
    exit_code: int | None  # that exit record's code


@dataclass
class LiveRuns:
    """One look at the paths: the jobs whose runs can be read, and the files still waited for."""

    jobs: list[Job]
    waiting: list[Path] = field(default_factory=list)  # no run record yet, or rank unknown
    sizes: dict[Path, tuple[int, int]] = field(default_factory=dict)  # size, mtime_ns
    notes: list[str] = field(default_factory=list)  # input left out (a FIFO named like a run)


def find_live_runs(
    paths: Sequence[str | Path],
    hints: Hints | None,
    job: str | None = None,
    job_prefix: str | None = None,
) -> LiveRuns:
    """The offline runs under `paths` as they are now, grouped into jobs (missing ranks
    allowed: they may start later): all, the job `job`, or the jobs whose id starts with
    `job_prefix`. A path that holds no run yet is not an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InputWarning)
        files = _run_files(paths)
        runs = [read_identity(path) for path in files]
    notes = [str(w.message) for w in caught if issubclass(w.category, InputWarning)]
    sizes = {path: _size(path) for path in files}
    merged = merged_runs(runs, job)
    if merged:  # (no rank of a job in progress: a merge's output, to upload as it is)
        raise WbmergeError(
            f"{merged[0].run_dir} is a run that wbmerge merged; --follow keeps the runs of "
            "ranks in training up to date: sync merged runs without --follow"
        )
    started = [r for r in runs if r.has_run_record and r.merged is None]
    waiting = [r.path for r in runs if not r.has_run_record]
    if hints is not None and hints.given:  # --ranks may name runs that have not started
        present = {r.run_id for r in started}
        given = {k: v for k, v in hints.given.items() if k in present}
        hints = dataclasses.replace(hints, given=given)
    identify_runs(started, hints)
    known = [r for r in started if r.rank is not None]
    waiting += [r.path for r in started if r.rank is None]
    if job is not None:
        known = [r for r in known if r.job_id == job]
    if job_prefix is not None:
        known = [r for r in known if (r.job_id or "").startswith(job_prefix)]
    return LiveRuns(group_jobs(known, None, allow_missing_ranks=True), waiting, sizes, notes)


def _run_files(paths: Iterable[str | Path]) -> list[Path]:
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw)
        try:
            files = find_run_files([path])
        except WbmergeError:
            if not (path.is_dir() and os.access(path, os.R_OK | os.X_OK)):
                raise  # missing or unreadable: the same error as a one-shot sync
            continue  # a directory the job has not written a run into yet
        found.update(dict.fromkeys(files))
    return list(found)


def _size(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (-1, -1)
    return (stat.st_size, stat.st_mtime_ns)


def progress(
    job: Job, sizes: dict[Path, tuple[int, int]], seen: dict[Path, tuple] | None = None
) -> dict[int, Progress]:
    """Every rank's progress, from a read of each of its files that changed since it was
    last read: of what it gained when it goes on from that read, else of all of it (`seen`
    remembers the reads: path -> (size and mtime, RunStats, its ScannedLog or None)).

    Restarts continue each other's steps as the merge places them: a restart's rows go
    after the last row of the restarts before it. So a restart's rows are final only when
    every restart before it has stopped growing: a restart followed by another that has
    changed since the last look (or is seen for the first time) ends the rows counted.
    """
    seen = {} if seen is None else seen
    by_rank: dict[int, list[OfflineRun]] = {}
    for run in job.runs:
        assert run.rank is not None
        by_rank.setdefault(run.rank.rank, []).append(run)
    result = {}
    for rank, runs in by_rank.items():
        runs.sort(key=lambda r: r.rank.restart if r.rank else 0)
        last, settled = NO_ROWS, True
        stats = None
        for run in runs:
            now = sizes.get(run.path) or _size(run.path)
            if run.path in seen and seen[run.path][0] == now:
                stats = seen[run.path][1]
                still = True
            else:
                stats, scanned = _rescan(run, seen.get(run.path))
                seen[run.path] = (now, stats, scanned)
                still = stats.complete
            if settled and stats.first_step is not None and stats.last_step is not None:
                shift = max(0, last + 1 - stats.first_step)
                last = max(last, stats.last_step + shift)
            settled = settled and still
        assert stats is not None
        result[rank] = Progress(rank, last, stats.complete, stats.exit_code)
    return result


def _rescan(run: OfflineRun, last: tuple | None) -> tuple[RunStats, ScannedLog | None]:
    """A changed log's stats, and how far it was read: only its new records read when it
    goes on from the last look (`tails.ScannedLog`), else all of it (`scan`)."""
    scanned = last[2] if last is not None else ScannedLog(run.path)
    if scanned is not None:
        try:
            return scanned.update(), scanned
        except NotIncremental:
            pass
    return scan(run), None


def expected_ranks(target: Target) -> set[int]:
    """The ranks a target is made of: its sources', and for a target of several ranks
    (shared, or auto with every rank's system metrics) all ranks of its scope, known from
    the world size the runs record, so that ranks not started yet count too."""
    ranks = {s.rank.rank for s in (*target.sources, *target.extra_system_sources)}
    if target.kind == "passthrough":
        return ranks
    first = target.sources[0].rank
    world = range(first.world_size)
    if target.worker is None:
        return ranks | set(world)
    per_node = max(1, first.local_world_size)
    return ranks | {r for r in world if r // per_node == target.worker}


def watermark(target: Target, ranks: dict[int, Progress]) -> int | None:
    """The last step whose merged row is final: every rank whose rows the target holds and
    that has not finished well has passed it, and a rank not started yet holds it back.
    None: every row is final (every such rank finished with exit code 0).

    A rank that failed holds the rows back at its last step too: torch elastic may restart
    it, and its restart's rows join the rows after that step (`progress`), which must not
    have gone out without them."""
    merged = (
        expected_ranks(target) if target.kind == "shared" else {s.rank.rank for s in target.sources}
    )
    bounds = []
    for rank in merged:
        found = ranks.get(rank)
        if found is None:
            bounds.append(NO_ROWS)
        elif not found.finished or found.exit_code:
            bounds.append(found.last_step)
    return min(bounds) if bounds else None


def finished(target: Target, ranks: dict[int, Progress]) -> bool:
    """Every rank of the target (expected or present) has its exit record."""
    return all(
        ranks.get(rank) is not None and ranks[rank].finished for rank in expected_ranks(target)
    )


def signature(target: Target, sizes: dict[Path, tuple[int, int]]) -> tuple:
    """What a target is made of now: its files' sizes and modification times."""
    sources: list[Source] = [*target.sources, *target.extra_system_sources]
    return tuple(sorted((str(s.path), sizes.get(s.path) or _size(s.path)) for s in sources))

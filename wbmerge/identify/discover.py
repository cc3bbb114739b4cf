"""Discover: find offline runs under the user's paths and say which rank of which job wrote each.

Each run's own account of itself is read by `offlinerun` (its head and last block, or a
full scan); the pure rules of `jobs` turn the accounts of all runs found into ranks and
jobs; `group_jobs` hands the jobs on, with what a merge of each would refuse.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputWarning, WbmergeError
from ..log import records
from ..plan import run_id_from_file
from ..safepaths import Resolver
from . import jobs
from .jobs import Hints, RunFacts, few
from .offlinerun import OfflineRun, read_identity, scan


def find_run_files(paths: Iterable[str | Path]) -> list[Path]:
    """The `.wandb` files under each path: a file, a run directory, or any tree of them.

    Raises WbmergeError for a path that does not exist, cannot be read or holds no offline
    run. Only regular files are taken; a FIFO, socket, device, dangling link or link loop
    named `run-*.wandb` inside a directory is left out with an InputWarning (never opened),
    as is a link (wandb's `latest-run` would list a run twice, and a link may lead out of
    the directories named).
    """
    found: dict[Path, None] = {}
    resolve = Resolver()
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
            found.setdefault(resolve(file), None)
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


def identify_runs(runs: list[OfflineRun], hints: Hints | None = None) -> None:
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
            args=r.args,
            slurm=r.slurm,
            process_gpus=tuple(sorted(r.process_gpus)),
        )
        for r in runs
    ]
    found = jobs.identify(facts, hints)
    for note in found.notes:
        warnings.warn(note, InputWarning, stacklevel=2)
    for index, identity in found.identities.items():
        run = runs[index]
        run.rank, run.rank_source, run.label = identity.rank, identity.source, identity.label
        run.rank_guessed = identity.guessed
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
    if hints and hints.primary:
        _check_primary(runs, hints.primary, found_ids)


def _check_primary(runs: list[OfflineRun], primary: frozenset[str], found_ids: set[str]) -> None:
    """`--primary` names rank 0 of a job numbered by start order; a run its job's evidence
    makes another rank is a contradiction the user must settle (with `--ranks`)."""
    unknown = primary - found_ids
    if unknown:
        raise WbmergeError(
            f"--primary names run(s) not found under the paths given: {', '.join(sorted(unknown))}"
        )
    for run in runs:
        if run.run_id in primary and run.rank is not None and run.rank.rank != 0:
            raise WbmergeError(
                f"--primary {run.run_id}: its job's runs say their ranks, and this one is rank "
                f"{run.rank.rank} by its {run.rank_source}; --primary only names rank 0 of a "
                "job numbered by start order (say every rank with --ranks FILE to override)"
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
    identify_runs(runs, hints)
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
    def primary_guessed(self) -> bool:
        """No run says its rank and nothing names rank 0: the primary is the first to start."""
        return any(run.rank_guessed for run in self.runs)

    def guessed_primary_line(self, run_mode: str) -> str:
        """Why this job, whose rank 0 is a guess (its first run to start, or the local rank 0
        of the host first by name), is not uploaded in `run_mode` (auto uploads rank 0 alone;
        shared takes its config, summary and exit code), and the ways out, in one line."""
        if all(run.rank_source == "gpu" for run in self.runs):
            return (
                f"job {self.job_id}: its ranks are read from the order of the GPUs its runs "
                "used, which holds only if no rank's run is missing, so its rank 0 is a "
                f"guess; --run-mode {run_mode} takes rank 0's run as the job's. Say every rank "
                "with --ranks FILE, accept the GPUs' order with --rank-order start, or upload "
                "a run per rank with --run-mode new"
            )
        if any(run.rank_source != "order" for run in self.runs):
            hosts = sorted({run.host for run in self.runs})
            return (
                f"job {self.job_id}: its runs give local ranks only, so which host is worker "
                f"0, and so its rank 0, is a guess (hosts in name order: {few(hosts)}); "
                f"--run-mode {run_mode} takes rank 0's run as the job's. Say every rank with "
                "--ranks FILE, accept the hosts' name order with --rank-order start, or upload "
                "a run per rank with --run-mode new"
            )
        by_start = sorted(self.runs, key=lambda run: (run.start_time, run.run_id))
        order = few([run.run_id for run in by_start], shown=8)
        return (
            f"job {self.job_id}: no run says its rank, so its rank 0 would be a guess (started "
            f"first: {order}); --run-mode {run_mode} takes rank 0's run as the job's. Name it "
            "with --primary RUN_ID (`wbmerge inspect` shows what each run logged), say every "
            "rank with --ranks FILE, accept the start order with --rank-order start, or "
            "upload a run per rank with --run-mode new"
        )

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


def merged_runs(runs: Sequence[OfflineRun], job: str | None = None) -> list[OfflineRun]:
    """The runs among `runs` that a merge wrote (of `job`, if given)."""
    return [r for r in runs if r.merged is not None and job in (None, r.merged.job_id)]


def selects_merged(runs: Sequence[OfflineRun], job: str | None) -> bool:
    """Whether the runs to upload are merged ones: any is, and `job` (if given) is theirs."""
    return bool(merged_runs(runs, job))


def merged_jobs(runs: Sequence[OfflineRun], job: str | None = None) -> list[list[OfflineRun]]:
    """The merged runs among `runs` (of `job`, if given), one list per merge that wrote them
    (job id, run mode and rank scope), each ordered by run id.

    WbmergeError (one line) for runs of ranks beside merged ones when no `job` picks one
    of them, for a run id found twice, and for a `job` no merged run belongs to.
    """
    merged = merged_runs(runs, job)
    ranks = [r for r in runs if r.merged is None and r.has_run_record]
    if job is None and merged and ranks:
        raise WbmergeError(
            f"{merged[0].run_dir} is a run that wbmerge merged, but {ranks[0].run_dir} is "
            "a rank's run; sync merged runs and the runs of ranks apart (or pick one job "
            "with --job)"
        )
    if not merged:
        raise WbmergeError(f"no run that wbmerge merged belongs to job {job!r}")
    seen: dict[str, OfflineRun] = {}
    by_merge: dict[tuple[str, str, str], list[OfflineRun]] = defaultdict(list)
    for run in merged:
        if run.run_id in seen:
            raise WbmergeError(
                f"run {run.run_id} found twice: {seen[run.run_id].run_dir} and {run.run_dir}"
            )
        seen[run.run_id] = run
        how = run.merged
        assert how is not None
        by_merge[(how.job_id, how.run_mode, how.rank_scope)].append(run)
    return [sorted(members, key=lambda r: r.run_id) for _, members in sorted(by_merge.items())]

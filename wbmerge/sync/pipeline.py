"""discover -> plan -> merge -> upload, as one library call per CLI command.

`plan_jobs` is what `--dry-run` shows, `merge_jobs` is `wbmerge merge`, `sync` is
`wbmerge sync`. Each stage is also usable on its own (see the modules named above).
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .. import merge  # (stage is called as merge.stage: the seam a test stands a broken merge in)
from ..analyse import PerRank
from ..errors import REFUSED, RERUN, InputWarning, Terminated, WbmergeError
from ..identify import (
    Job,
    OfflineRun,
    discover,
    group_jobs,
    make_hints,
    merged_jobs,
    selects_merged,
)
from ..merge import MergeOptions, Staged, check_files, check_key_format, files_from_dirs
from ..plan import Target, app_url, check_destination, links, plan, run_url
from ..safepaths import check_out_dir, source_trees
from ..upload import (
    DEFAULT_PARALLEL,
    DEFAULT_TIMEOUT,
    Delivery,
    Ledger,
    Progress,
    ServerError,
    find_credentials,
)
from .exactlyonce import Deliverer
from .request import MergeRequest, ignored_options, merge_options_given
from .session import UploadSession, delivery_of


@dataclass
class PlannedJob:
    job: Job
    targets: list[Target]
    run_mode: str
    rank_scope: str
    project: str | None
    entity: str | None

    @property
    def warnings(self) -> list[str]:
        """What was assumed about the job's ranks (say once, before merging)."""
        return self.job.warnings

    def ledger_settings(self, request: MergeRequest) -> dict:
        """What a run's ledger fingerprint covers besides its files: a run synced with other
        settings is not the same upload (`sync` and `sync --follow` must agree)."""
        options = dict(self.options(request).__dict__)
        del options["files_from"]  # (where files are found, not what is merged)
        if options["unknown_records"] == "refuse":
            del options["unknown_records"]  # (the default: the fingerprint it always had)
        if not options["rank_stats"] and options["per_rank"] == PerRank():
            # (the defaults: the same fingerprint as before these options existed)
            del options["rank_stats"], options["per_rank"]
        settings = {"options": options, "system_metrics": request.system_metrics}
        if request.job_type is not None:  # (None: the fingerprint it always had)
            settings["job_type"] = request.job_type
        return settings

    def options(self, request: MergeRequest) -> MergeOptions:
        return MergeOptions(
            project=self.project,
            entity=self.entity,
            key_format=request.key_format,
            run_mode=self.run_mode,
            rank_scope=self.rank_scope,
            job_id=self.job.job_id,
            skew_metrics=request.skew_metrics,
            rank_stats=request.rank_stats,
            per_rank=PerRank.parse(request.per_rank),
            files_from=files_from_dirs(request.files_from),
            unknown_records=request.unknown_records,
        )


def plan_jobs(request: MergeRequest) -> list[PlannedJob]:
    """Discover the runs under the paths, group them into jobs, and plan each job's targets."""
    check_key_format(request.key_format)
    PerRank.parse(request.per_rank)  # (bad values: an error before any work)
    files_from_dirs(request.files_from)
    hints = make_hints(request.label_pattern, request.ranks_file, request.primary)
    runs = discover(request.paths, hints=hints)
    if selects_merged(runs, request.job):
        return plan_merged(request, runs)
    planned = plan_found(request, group_jobs(runs, request.job, request.allow_missing_ranks))
    for line in ignored_options(request, {job.run_mode for job in planned}):
        warnings.warn(line, InputWarning, stacklevel=2)
    return planned


def plan_found(request: MergeRequest, jobs: list[Job]) -> list[PlannedJob]:
    """Plan the targets of jobs already found (`plan_jobs` after discovery; `follow` plans
    the jobs of a run in progress each round)."""
    if request.base_id and len(jobs) > 1:
        names = ", ".join(j.job_id for j in jobs)
        raise WbmergeError(
            f"--base-id names one job, but there are {len(jobs)} ({names}); add --job"
        )
    planned = []
    for job in jobs:
        recorded = _recorded_defaults(job)
        run_mode = request.run_mode or recorded.get("run_mode") or "auto"
        rank_scope = request.rank_scope or recorded.get("rank_scope") or "global"
        if run_mode != "new" and job.primary_guessed and request.rank_order != "start":
            raise WbmergeError(job.guessed_primary_line(run_mode))
        sources = [r.source() for r in job.runs]
        targets = plan(
            sources,
            run_mode,
            rank_scope,
            base_id=request.base_id,
            system_metrics=request.system_metrics,
            job_type=request.job_type,
        )
        planned.append(PlannedJob(job, targets, run_mode, rank_scope, *_where(request, job)))
    return planned


def plan_merged(request: MergeRequest, runs: list[OfflineRun]) -> list[PlannedJob]:
    """Plan runs that a merge wrote already (`merge --out`): each is uploaded as it is.
    The options that shape a merge are refused (one line), as are runs of ranks beside them."""
    found = merged_jobs(runs, request.job)  # (runs of ranks beside them: refused first)
    given = merge_options_given(request)
    if given:
        raise WbmergeError(
            f"{given[0]} does not apply to runs that wbmerge merged already: they are "
            "uploaded as they were merged"
        )
    planned = []
    for members in found:
        merged = members[0].merged
        assert merged is not None
        job = Job(merged.job_id, members)
        targets = [run.merged_target() for run in members]
        where = _where(request, job)
        planned.append(PlannedJob(job, targets, merged.run_mode, merged.rank_scope, *where))
    return planned


def _where(request: MergeRequest, job: Job) -> tuple[str | None, str | None]:
    """The project and entity a job's runs go to."""
    project = (
        request.project or _common(r.project for r in job.runs) or os.environ.get("WANDB_PROJECT")
    )
    entity = request.entity or os.environ.get("WANDB_ENTITY") or _common(r.entity for r in job.runs)
    return project, entity


def _recorded_defaults(job: Job) -> dict:
    for run in job.runs:
        if run.defaults:
            return run.defaults
    return {}


def _common(values: object) -> str | None:
    distinct = {v for v in values if v}  # type: ignore[attr-defined]
    return distinct.pop() if len(distinct) == 1 else None


def merge_jobs(
    request: MergeRequest,
    out_dir: Path,
    planned: list[PlannedJob] | None = None,
    progress: Callable[[Staged], None] | None = None,
) -> list[Staged]:
    """Write every target of every job as an offline run directory under `out_dir`.

    Refuses (WbmergeError) an `out_dir` that is, or lies inside, a directory the merge
    reads; a run directory that exists already in `out_dir` is an error, never replaced.
    """
    planned = plan_jobs(request) if planned is None else planned
    merged = [t for job in planned for t in job.targets if t.kind == "merged"]
    if merged:
        raise WbmergeError(
            f"{merged[0].sources[0].path.parent} is a run that wbmerge merged already: there "
            "is nothing to merge (upload it as it is with `wbmerge sync`)"
        )
    check_out_dir(out_dir, source_trees(request.paths, _run_files(planned)))
    check_files([t for job in planned for t in job.targets], files_from_dirs(request.files_from))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WbmergeError(f"--out {out_dir}: cannot create ({exc.strerror or exc})") from None
    staged = []
    for job in planned:
        options = job.options(request)
        for target in job.targets:
            result = merge.stage(target, out_dir, options)
            staged.append(result)
            if progress:
                progress(result)
    return staged


def _run_files(planned: list[PlannedJob]) -> list[Path]:
    targets = [target for job in planned for target in job.targets]
    return [s.path for t in targets for s in (*t.sources, *t.extra_system_sources)]


@dataclass
class SyncedTarget:
    target: Target
    # "uploaded" (sent, then verified on the server) | "already complete" (the server held
    # it whole: verified, nothing sent) | "already synced" (the ledger says so; not asked)
    status: str
    url: str


@dataclass
class SyncReport:
    jobs: list[PlannedJob]
    targets: list[SyncedTarget] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class UploadFailed(WbmergeError):
    """Some runs are not (all) on the server: a line per run, exit 1, none of them recorded;
    `report` holds the runs that were verified. The advice that ends the lines of each job
    (to rerun, or to upload under other run ids) is said once, after every job's runs."""

    def __init__(self, lines: list[str], report: SyncReport) -> None:
        advice = (RERUN, REFUSED)
        lines = [
            *(s for s in lines if not s.startswith(advice)),
            *dict.fromkeys(s for s in lines if s.startswith(advice)),
        ]
        super().__init__("; ".join(lines), exit_code=1)
        self.lines = lines
        self.report = report


def sync(
    request: MergeRequest,
    parallel: int = DEFAULT_PARALLEL,
    force: bool = False,
    staging_dir: Path | None = None,
    keep_staging: bool = False,
    progress: Callable[[Staged], None] | None = None,
    planned: list[PlannedJob] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    upload_progress: Callable[[Progress], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> SyncReport:
    """Merge and upload each run exactly once, verified on the server.

    Each run is uploaded as soon as it is staged, at most `parallel` at once (see
    `sync.exactlyonce`); the next job is merged while the last one uploads. Fails
    (WbmergeError) before any work without credentials or when the server does not answer;
    raises UploadFailed naming each run that is not whole on the server. Runs are recorded
    in the ledger as each is verified, so an interrupted sync keeps what completed.
    `progress` is called in this thread as each run is staged, `upload_progress` from the
    upload threads (one call at a time).
    """
    with sigterm_raises():
        return _sync(
            request,
            parallel,
            force,
            staging_dir,
            keep_staging,
            progress,
            planned,
            timeout,
            upload_progress,
            on_wait,
        )


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread (when nothing else handles
    it), so that the uploader is stopped and staging removed as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class _SyncRun:
    """One sync over its upload session: the report it fills and how it was asked."""

    uploads: UploadSession
    report: SyncReport
    force: bool
    progress: Callable[[Staged], None] | None


def _sync(
    request: MergeRequest,
    parallel: int,
    force: bool,
    staging_dir: Path | None,
    keep_staging: bool,
    progress: Callable[[Staged], None] | None,
    planned: list[PlannedJob] | None,
    timeout: float,
    upload_progress: Callable[[Progress], None] | None,
    on_wait: Callable[[str], None] | None,
) -> SyncReport:
    force = force or request.resend  # (a run to send again whole is asked about, not skipped)
    credentials = find_credentials()
    planned = plan_jobs(request) if planned is None else planned
    for job in planned:  # (bad input first: exit 2 whether the server answers or not)
        check_destination(job.project, job.entity)
    files_from = files_from_dirs(request.files_from)
    if staging_dir is not None:
        check_out_dir(
            staging_dir, source_trees(request.paths, _run_files(planned)), "--keep-staging"
        )
    uploads = UploadSession(
        parallel,
        timeout,
        credentials=credentials,
        staging_dir=staging_dir,
        keep_staging=keep_staging,
        upload_progress=upload_progress,
        every_value=request.verify == "full",
        resend=request.resend,
    )
    report = SyncReport(planned)
    run = _SyncRun(uploads, report, force, progress)
    keys = [
        uploads.key(uploads.entity(job.entity), job.project or "", target)
        for job in planned
        for target in job.targets
    ]
    try:
        for job in planned:  # (every run to send is checked before any is sent: exit 2)
            check_files(
                job.targets
                if force
                else uploads.ledger.unsynced(
                    credentials.base_url,
                    uploads.entity(job.entity),
                    job.project or "",
                    job.targets,
                    job.ledger_settings(request),
                ),
                files_from,
            )
        # Every run's lock at once (in one sorted order, so two syncs cannot deadlock): the
        # next job is staged while the last one uploads.
        with uploads.locks(keys, on_wait):
            failures = _sync_jobs(request, planned, run)
    except ServerError as exc:
        if not report.targets:
            raise  # (nothing verified: nothing to report but the error)
        raise UploadFailed([str(exc), RERUN], report) from None  # (with the runs it verified)
    finally:
        uploads.close()
    if failures:
        raise UploadFailed(failures, report)
    return report


@dataclass
class _JobUpload:
    """One job's runs on their way: staged and handed to its deliverer as each was staged."""

    job: PlannedJob
    entity: str | None
    url: str
    deliverer: Deliverer | None = None  # None: nothing to send
    todo: list[tuple[Target, Delivery]] = field(default_factory=list)
    verified: set[str] = field(default_factory=set)  # run ids, by this sync or before it


def _sync_jobs(request: MergeRequest, planned: list[PlannedJob], run: _SyncRun) -> list[str]:
    """Stage and upload job after job; the failure lines. A job uploads while the next one is
    staged, and is finished before the one after is staged: one job ahead at most."""
    failures: list[str] = []
    uploading: list[_JobUpload] = []
    try:
        for index, job in enumerate(planned):
            ahead = [u.deliverer for u in uploading if u.deliverer is not None]
            workdir = run.uploads.staging / f"job-{index}"
            uploading.append(_start_job(request, job, run, workdir, ahead))
            if len(uploading) == 2:
                failures += _finish_job(uploading[0], run)
                uploading.pop(0)
        while uploading:
            failures += _finish_job(uploading[0], run)
            uploading.pop(0)
    except BaseException:  # Ctrl-C, SIGTERM, bad input in the next job: stop every upload
        for upload in uploading:
            if upload.deliverer is not None:
                upload.deliverer.stop()
        raise
    return failures


def _start_job(
    request: MergeRequest,
    job: PlannedJob,
    run: _SyncRun,
    workdir: Path,
    ahead: Sequence[Deliverer] = (),
) -> _JobUpload:
    """Skip the job's verified runs; stage the others, each uploading as soon as it is staged.
    A failure of this job's upload or of one `ahead` (a job still uploading) stops the staging."""
    assert job.project
    uploads = run.uploads
    options = job.options(request)
    settings = job.ledger_settings(request)
    upload = _JobUpload(job, uploads.entity(job.entity), app_url(uploads.credentials.base_url))
    pending = []
    for target in job.targets:
        key = uploads.key(upload.entity, job.project, target)
        fingerprint = Ledger.fingerprint(target, settings)
        entry = uploads.ledger.synced(key, fingerprint)
        if entry is None or run.force:
            pending.append((target, key, fingerprint, entry is not None))
            continue
        known = entry["entity"] or upload.entity
        link = run_url(upload.url, known, job.project, target.id) if known else ""
        run.report.targets.append(SyncedTarget(target, "already synced", link))
        upload.verified.add(target.id)
    if not pending:
        return upload
    deliverer = uploads.deliverer(
        job.project, upload.entity, workdir / "uploader", expected=len(pending)
    )
    upload.deliverer = deliverer
    try:
        for target, key, fingerprint, verified_before in pending:
            for failed in (d.failure for d in (deliverer, *ahead)):
                if failed is not None:
                    raise failed  # the server could not be asked: stop staging
            if deliverer.given_up:
                break  # no progress for --timeout: the rest is not staged either
            staged = merge.stage(target, workdir / "runs", options, count_content=True)
            run.report.warnings.extend(f"{target.id}: {w}" for w in staged.warnings)
            if run.progress:
                run.progress(staged)
            made = delivery_of(
                target, staged, key, fingerprint, options, verified_before=verified_before
            )
            upload.todo.append((target, made))
            deliverer.submit(made)
    except BaseException:
        deliverer.stop()
        raise
    return upload


def _finish_job(upload: _JobUpload, run: _SyncRun) -> list[str]:
    """Wait for the job's uploads; report its runs and links; the failure lines."""
    job, url = upload.job, upload.url
    if upload.deliverer is None:
        _add_links(run.report, job, url, upload.entity, upload.verified)
        return []
    result = upload.deliverer.finish()
    entity = upload.entity or result.entity
    for target, delivery in upload.todo:
        if delivery.verified:
            link = run_url(url, entity, job.project, target.id) if entity else ""
            status = "already complete" if delivery.held_already else "uploaded"
            run.report.targets.append(SyncedTarget(target, status, link))
            upload.verified.add(target.id)
        run.report.warnings += [f"{target.id}: {w}" for w in delivery.warnings]
    _add_links(run.report, job, url, entity, upload.verified)
    lines = [f"run {d.run_id}: {'; '.join(d.problems)}" for d in result.failed]
    if result.timed_out:
        complete = [d.run_id for _, d in upload.todo if d.verified]
        lines.append(
            f"no progress for {run.uploads.timeout:.0f} s, upload stopped; complete: "
            f"{', '.join(complete) or 'none'} (rerun to send the rest)"
        )
    # (see `Delivery.merge_fault` and `.unrecorded`: their lines say what mends them)
    advised = [d for d in result.failed if not (d.merge_fault or d.unrecorded)]
    if any(not d.refused for d in advised) or result.timed_out:
        lines.append(RERUN)
    elif advised:  # (every run refused: a rerun would refuse them again)
        # A merged run's id was chosen by its merge: --base-id goes to `merge`, not `sync`.
        merged = any(target.kind == "merged" for target, _ in upload.todo)
        how = "merge them again with --base-id ID" if merged else "with --base-id ID"
        # (`--resend` only where it mends: it never removes what the server holds beyond)
        mended = [d.run_id for d in advised if d.resend_mends]
        if len(mended) == len(advised):
            lines.append(
                f"{REFUSED} ({how}), delete the runs on the server first, or send "
                "them whole again over what the server holds (`wbmerge sync "
                "--resend`)"
            )
        else:
            resend = (
                (
                    f"; `wbmerge sync --resend` sends {', '.join(mended)} whole again over "
                    "what the server holds"
                )
                if mended
                else ""
            )
            lines.append(f"{REFUSED} ({how}), or delete the runs on the server first{resend}")
    return lines


def _add_links(
    report: SyncReport, job: PlannedJob, url: str, entity: str | None, verified: Collection[str]
) -> None:
    """The links of the job's runs that are `verified` (of a failed sync, not all are)."""
    targets = [t for t in job.targets if t.id in verified]
    if entity and targets:
        report.links.extend(links(targets, url, entity, job.project or "", job.run_mode))

"""discover -> plan -> merge -> upload, as one library call per CLI command.

`plan_jobs` is what `--dry-run` shows, `merge_jobs` is `wbmerge merge`, `sync` is
`wbmerge sync`. Each stage is also usable on its own (see the modules named above).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .discover import Job, discover, group_jobs
from .errors import WbmergeError
from .hints import make_hints
from .merge import DEFAULT_KEY_FORMAT, MergeOptions, Staged, stage
from .plan import Source, Target, app_url, links, plan
from .safepaths import check_out_dir, source_trees
from .upload import DEFAULT_PARALLEL, Ledger, find_credentials, run_wandb_sync, state_dir


@dataclass
class MergeRequest:
    """What the user asked for; None means "as recorded by the job, else the default"."""

    paths: Sequence[str | Path]
    run_mode: str | None = None
    rank_scope: str | None = None
    base_id: str | None = None
    job: str | None = None
    allow_missing_ranks: bool = False
    system_metrics: str = "primary"
    key_format: str = DEFAULT_KEY_FORMAT
    project: str | None = None
    entity: str | None = None
    job_type: str | None = None
    skew_metrics: bool = False
    label_pattern: str | None = None  # how the runs spell their rank, e.g. "rank_{rank}"
    ranks_file: str | Path | None = None  # run id -> rank, JSON or CSV


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

    def options(self, request: MergeRequest) -> MergeOptions:
        return MergeOptions(
            project=self.project,
            entity=self.entity,
            key_format=request.key_format,
            run_mode=self.run_mode,
            rank_scope=self.rank_scope,
            job_id=self.job.job_id,
            skew_metrics=request.skew_metrics,
        )


def check_key_format(key_format: str) -> str:
    try:
        sample = key_format.format(key="train/loss", label="rank-3")
    except (KeyError, IndexError, ValueError) as exc:
        raise WbmergeError(f"bad --key-format {key_format!r}: {exc}") from None
    if "train/loss" not in sample or "rank-3" not in sample:
        raise WbmergeError(f"--key-format {key_format!r} must contain {{key}} and {{label}}")
    return key_format


def plan_jobs(request: MergeRequest) -> list[PlannedJob]:
    """Discover the runs under the paths, group them into jobs, and plan each job's targets."""
    check_key_format(request.key_format)
    hints = make_hints(request.label_pattern, request.ranks_file)
    runs = discover(request.paths, hints=hints)
    jobs = group_jobs(runs, request.job, request.allow_missing_ranks)
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
        sources = [
            Source(r.path, r.rank, r.label or r.rank.label, start_time=r.start_time)
            for r in job.runs
        ]
        targets = plan(
            sources,
            run_mode,
            rank_scope,
            base_id=request.base_id,
            system_metrics=request.system_metrics,
            job_type=request.job_type,
        )
        project = (
            request.project
            or _common(r.project for r in job.runs)
            or os.environ.get("WANDB_PROJECT")
        )
        entity = (
            request.entity or os.environ.get("WANDB_ENTITY") or _common(r.entity for r in job.runs)
        )
        planned.append(PlannedJob(job, targets, run_mode, rank_scope, project, entity))
    return planned


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
    check_out_dir(out_dir, source_trees(request.paths, _run_files(planned)))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WbmergeError(f"--out {out_dir}: cannot create ({exc.strerror or exc})") from None
    staged = []
    for job in planned:
        options = job.options(request)
        for target in job.targets:
            result = stage(target, out_dir, options)
            staged.append(result)
            if progress:
                progress(result)
    return staged


def _run_files(planned: list[PlannedJob]) -> list[Path]:
    return [
        source.path
        for job in planned
        for target in job.targets
        for source in (*target.sources, *target.extra_system_sources)
    ]


@dataclass
class SyncedTarget:
    target: Target
    status: str  # "uploaded" | "already synced"
    url: str


@dataclass
class SyncReport:
    jobs: list[PlannedJob]
    targets: list[SyncedTarget] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def sync(
    request: MergeRequest,
    parallel: int = DEFAULT_PARALLEL,
    force: bool = False,
    staging_dir: Path | None = None,
    keep_staging: bool = False,
    progress: Callable[[Staged], None] | None = None,
    planned: list[PlannedJob] | None = None,
) -> SyncReport:
    """Merge and upload. Fails (WbmergeError) before any work without credentials, and
    reports failure, never success, when the uploader did not finish."""
    credentials = find_credentials()
    planned = plan_jobs(request) if planned is None else planned
    for job in planned:
        if not job.project:
            raise WbmergeError("no project: pass --project or set WANDB_PROJECT")
    report = SyncReport(planned)
    ledger = Ledger(state_dir() / "synced.json")
    own_staging = staging_dir is None
    if staging_dir is not None:
        check_out_dir(
            staging_dir, source_trees(request.paths, _run_files(planned)), "--keep-staging"
        )
    staging = Path(tempfile.mkdtemp(prefix="wbmerge-staging-")) if own_staging else staging_dir
    try:
        for job in planned:
            options = job.options(request)
            settings = {"options": options.__dict__, "system_metrics": request.system_metrics}
            todo: list[tuple[Target, str, str]] = []
            for target in job.targets:
                key = Ledger.key(credentials.base_url, job.entity, job.project, target)
                fingerprint = Ledger.fingerprint(target, settings)
                if not force and ledger.synced(key, fingerprint):
                    report.targets.append(SyncedTarget(target, "already synced", ""))
                else:
                    todo.append((target, key, fingerprint))
            staged = []
            for target, _, _ in todo:
                result = stage(target, staging, options)
                staged.append(result)
                report.warnings.extend(f"{target.id}: {w}" for w in result.warnings)
                if progress:
                    progress(result)
            entity = job.entity
            if staged:
                upload = run_wandb_sync(
                    [s.run_dir for s in staged], job.project, entity, parallel, credentials
                )
                if not upload.ok:
                    tail = " | ".join(upload.output.strip().splitlines()[-3:])
                    raise WbmergeError(
                        f"wandb sync failed for job {job.job.job_id}; nothing recorded as synced. "
                        f"Uploader said: {tail}",
                        exit_code=1,
                    )
                entity = entity or upload.entity
                for target, key, fingerprint in todo:
                    ledger.record(key, fingerprint)
                    report.targets.append(SyncedTarget(target, "uploaded", ""))
                ledger.save()
            url = app_url(credentials.base_url)
            for synced in report.targets:
                if synced.target in job.targets:
                    synced.url = (
                        f"{url}/{entity or '<entity>'}/{job.project}/runs/{synced.target.id}"
                    )
            report.links.extend(
                links(job.targets, url, entity or "<entity>", job.project, job.run_mode)
            )
    finally:
        if own_staging and not keep_staging:
            shutil.rmtree(staging, ignore_errors=True)
    return report

"""The Python API: one function per `wbmerge` command, the CLI is a thin layer over these.

    from wbmerge import api

    runs = api.discover(["./wandb"])                      # the offline runs, ranks identified
    jobs = api.plan(["./wandb"], run_mode="shared")       # what a sync would create
    staged = api.merge(["./wandb"], "./merged", run_mode="new")  # offline runs, no upload
    result = api.sync(["./wandb"], run_mode="shared")     # upload, verified on the server
    api.follow(["./wandb"], run_mode="shared")            # live runs while the job trains
    api.export(["./wandb"], "runs.parquet")               # every rank's values as Parquet
    reports = api.report(["./wandb"], metrics=["train/loss"])  # which rank is slow

The merge options (`plan`, `merge`, `sync`) are the fields of `MergeRequest`, given by
keyword: `run_mode`, `rank_scope`, `base_id`, `job`, `allow_missing_ranks`,
`system_metrics`, `key_format`, `skew_metrics`, `rank_stats`, `per_rank`, `project`,
`entity`, `job_type`, `label_pattern`, `ranks_file`. Every function raises `WbmergeError` (one line, with the
exit code the CLI uses) for bad input, and warns with `InputWarning` for input it leaves out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .discover import OfflineRun
from .discover import discover as _discover_runs
from .hints import make_hints
from .pipeline import MergeRequest, PlannedJob, SyncReport, merge_jobs, plan_jobs
from .pipeline import sync as _sync

if TYPE_CHECKING:  # (imported where used: `sync` starts faster without them)
    from .export import ExportResult
    from .report import JobReport

Paths = Sequence[str | Path]

__all__ = [
    "MergeRequest",
    "discover",
    "export",
    "follow",
    "inspect",
    "merge",
    "plan",
    "report",
    "request",
    "sync",
]


def request(paths: Paths, **options: Any) -> MergeRequest:
    """The request a merge or sync of `paths` with these options makes (checked by name)."""
    try:
        return MergeRequest(paths=list(paths), **options)
    except TypeError as exc:  # an unknown option name: say which
        raise TypeError(f"unknown merge option: {exc}") from None


def discover(
    paths: Paths,
    *,
    full_scan: bool = False,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
) -> list[OfflineRun]:
    """Every offline run under `paths` with its rank, in job, rank, restart order.

    `full_scan` also reads every record (row counts, last step, damage); without it only
    each run's head and last block are read. `label_pattern` and `ranks_file` say how to
    read the ranks of runs written without wbmerge (as `--label-pattern` and `--ranks`).
    """
    return _discover_runs(paths, full_scan, make_hints(label_pattern, ranks_file))


def inspect(
    paths: Paths, *, label_pattern: str | None = None, ranks_file: str | Path | None = None
) -> list[dict[str, Any]]:
    """What `wbmerge inspect --json` prints: a dict per run, after a full read of each."""
    from .inspect import inspect_runs

    return inspect_runs(paths, make_hints(label_pattern, ranks_file))


def plan(paths: Paths, **options: Any) -> list[PlannedJob]:
    """The jobs found under `paths` and the runs a merge would create for each (pure: no
    file is written). Options are the fields of `MergeRequest`."""
    return plan_jobs(request(paths, **options))


def merge(
    paths: Paths,
    out: str | Path,
    *,
    progress: Callable[[Any], None] | None = None,
    planned: list[PlannedJob] | None = None,
    **options: Any,
) -> list[Any]:
    """Write the merged offline runs of `paths` under `out` (no upload); a `Staged` per run.

    `out` must not be, or lie inside, a directory the merge reads. `progress` is called
    with each `Staged` as it is written; `planned` is the result of `plan` with the same
    arguments, when the caller has it already."""
    made = request(paths, **options)
    return merge_jobs(made, Path(out), planned or plan_jobs(made), progress)


def sync(
    paths: Paths,
    *,
    parallel: int = 4,
    force: bool = False,
    timeout: float = 300.0,
    keep_staging: str | Path | None = None,
    progress: Callable[[Any], None] | None = None,
    upload_progress: Callable[[Any], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    planned: list[PlannedJob] | None = None,
    **options: Any,
) -> SyncReport:
    """Merge `paths` and upload each run exactly once with `wandb sync`, verified.

    The server and key come from wandb's own settings (`WANDB_BASE_URL`, `WANDB_API_KEY`
    or `~/.netrc`). Runs already verified (the ledger) are skipped unless `force`.
    Raises `UploadFailed` (exit 1) naming each run that is not whole on the server.
    `keep_staging` stages the merged runs there and keeps them. `progress` is called with
    each run staged, `upload_progress` with the uploader's progress, `on_wait` with the key
    of a run another sync holds."""
    made = request(paths, **options)
    return _sync(
        made,
        parallel=parallel,
        force=force,
        staging_dir=Path(keep_staging) if keep_staging else None,
        keep_staging=bool(keep_staging),
        progress=progress,
        timeout=timeout,
        upload_progress=upload_progress,
        on_wait=on_wait,
        planned=planned,
    )


def follow(
    paths: Paths,
    *,
    interval: float = 60.0,
    idle_timeout: float = 600.0,
    parallel: int = 4,
    timeout: float = 300.0,
    on_round: Callable[[Any], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    on_idle: Callable[[list[str]], None] | None = None,
    restart_grace: float = 60.0,
    **options: Any,
) -> Any:
    """`sync --follow`: keep the merged runs of a job that is still training up to date,
    a round every `interval` seconds, until every rank has finished (or nothing changed
    for `idle_timeout` seconds; then a one-shot sync finishes the runs). A run whose ranks
    all ended, some failed, waits `restart_grace` seconds without a change for an elastic
    restart first. Returns a `follow.FollowReport`; `on_round` is called with each round's
    report."""
    from .follow import follow as follow_job

    return follow_job(
        request(paths, **options),
        interval,
        idle_timeout,
        parallel,
        timeout,
        on_round=on_round,
        on_wait=on_wait,
        on_idle=on_idle,
        restart_grace=restart_grace,
    )


def export(
    paths: Paths,
    out: str | Path,
    *,
    job: str | None = None,
    wide: bool = False,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
) -> ExportResult:
    """Write every rank's history and system metrics under `paths` to the Parquet file `out`:
    a value per row (long), or with `wide` a row per rank and step."""
    from .export import export as _export

    return _export(paths, out, job=job, wide=wide, hints=make_hints(label_pattern, ranks_file))


def report(
    paths: Paths,
    *,
    metrics: Sequence[str] = (),
    job: str | None = None,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
    rank_stats: bool = False,
) -> list[JobReport]:
    """Per job under `paths`: each metric's skew across ranks, which rank is slow and by
    how much; `metrics` narrows the keys (default: the ones that tell most). `rank_stats`
    adds each history metric's statistics across ranks at its last step."""
    hints = make_hints(label_pattern, ranks_file)
    from .report import report as _report

    return _report(paths, metrics, job, hints=hints, rank_stats=rank_stats)

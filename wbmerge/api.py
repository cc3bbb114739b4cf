"""The Python API: one function per `wbmerge` command, the CLI is a thin layer over these.

    from wbmerge import api

    runs = api.discover(["./wandb"])                      # the offline runs, ranks identified
    jobs = api.plan(["./wandb"], run_mode="shared")       # what a sync would create
    staged = api.merge(["./wandb"], "./merged", run_mode="new")  # offline runs, no upload
    result = api.sync(["./wandb"], run_mode="shared")     # upload, verified on the server
    api.follow(["./wandb"], run_mode="shared")            # live runs while the job trains
    api.export(["./wandb"], "runs.parquet")               # every rank's values as Parquet
    reports = api.report(["./wandb"], metrics=["train/loss"])  # which rank is slow

The merge options (`plan`, `merge`, `sync`, `follow`) are the fields of `MergeRequest`,
given by keyword and typed by `RequestOptions` (a run mode is a `RunMode`, `"auto"`,
`"shared"` or `"new"`, a rank scope a `RankScope`): `run_mode`, `rank_scope`, `base_id`, `job`, `allow_missing_ranks`,
`system_metrics`, `key_format`, `skew_metrics`, `rank_stats`, `per_rank`, `project`,
`entity`, `job_type`, `label_pattern`, `ranks_file`, `primary`, `rank_order`,
`files_from` (the CLI's repeatable `--files-from`: one directory or a list),
`unknown_records` ("refuse", the default, or "copy"). `paths` is one
path or a list of them.

Every function raises `WbmergeError` (one line, with the exit code the CLI uses) for bad
input; `sync` raises `UploadFailed` (exit 1, its `report` says what was verified) when a
run is not whole on the server, and `ServerError` (exit 1) when the server cannot be
asked. Input left out, and ranks assumed rather than read (also in `PlannedJob.warnings`),
are said as `InputWarning`s.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import InputWarning, WbmergeError
from .identify import OfflineRun, make_hints
from .identify import discover as _discover_runs
from .plan import RankScope, RunMode
from .sync import (
    MergeRequest,
    PlannedJob,
    RequestOptions,
    SyncReport,
    UploadedBy,
    UploadFailed,
    VerifyReport,
    merge_jobs,
    plan_jobs,
    verify_jobs,
)
from .sync import sync as _sync
from .upload import ServerError

if TYPE_CHECKING:  # (imported where used: `sync` starts faster without them)
    from typing_extensions import Unpack

    from .analyse import ExportResult, JobReport
    from .follow import FollowReport, RoundReport
    from .merge import Staged
    from .sink import LocalSink
    from .upload import Progress

Paths = Sequence[str | Path] | str | Path  # one path, or several

__all__ = [
    "InputWarning",
    "RequestOptions",
    "MergeRequest",
    "RankScope",
    "RunMode",
    "ServerError",
    "SyncReport",
    "UploadFailed",
    "VerifyReport",
    "WbmergeError",
    "discover",
    "export",
    "follow",
    "inspect",
    "merge",
    "plan",
    "report",
    "request",
    "start_sink",
    "sync",
    "verify",
]


def path_list(paths: Paths) -> list[str | Path]:
    """`paths` as a list: one path (`"./wandb"`, a `Path`) is a list of one, not of its
    characters."""
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    return list(paths)


def request(paths: Paths, **options: Unpack[RequestOptions]) -> MergeRequest:
    """The request a merge or sync of `paths` with these options makes (checked by name)."""
    try:
        return MergeRequest(paths=path_list(paths), **options)
    except TypeError as exc:  # an unknown option name: say which
        raise TypeError(f"unknown merge option: {exc}") from None


def check_upload_options(parallel: object, timeout: object) -> None:
    """Raise WbmergeError (exit 2) unless `parallel` is a whole number of uploads, 1 or
    more, and `timeout` a number of seconds above 0 (as the CLI's `-n` and `--timeout`)."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise WbmergeError(f"parallel must be a whole number, 1 or more, not {parallel!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise WbmergeError(f"timeout must be a number of seconds above 0, not {timeout!r}")
    if not math.isfinite(timeout):
        raise WbmergeError(f"timeout must be a finite number of seconds, not {timeout!r}")


def discover(
    paths: Paths,
    *,
    full_scan: bool = False,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
    primary: Sequence[str] | str = (),
) -> list[OfflineRun]:
    """Every offline run under `paths` with its rank, in job, rank, restart order.

    `full_scan` also reads every record (row counts, last step, damage); without it only
    each run's head and last block are read. `label_pattern`, `ranks_file` and `primary`
    say how to read the ranks of runs written without wbmerge (as `--label-pattern`,
    `--ranks` and `--primary`).
    """
    hints = make_hints(label_pattern, ranks_file, primary)
    return _discover_runs(path_list(paths), full_scan, hints)


def inspect(
    paths: Paths,
    *,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
    primary: Sequence[str] | str = (),
) -> list[dict[str, Any]]:
    """What `wbmerge inspect --json` prints: a dict per run, after a full read of each."""
    from .identify import inspect_runs

    return inspect_runs(path_list(paths), make_hints(label_pattern, ranks_file, primary))


def plan(paths: Paths, **options: Unpack[RequestOptions]) -> list[PlannedJob]:
    """The jobs found under `paths` and the runs a merge would create for each (pure: no
    file is written). Options are the fields of `MergeRequest`."""
    return plan_jobs(request(paths, **options))


def merge(
    paths: Paths,
    out: str | Path,
    *,
    progress: Callable[[Staged], None] | None = None,
    planned: list[PlannedJob] | None = None,
    **options: Unpack[RequestOptions],
) -> list[Staged]:
    """Write the merged offline runs of `paths` under `out` (no upload); a `Staged` per run.

    `out` must not be, or lie inside, a directory the merge reads. `progress` is called
    with each `Staged` as it is written; `planned` is the result of `plan` with the same
    arguments, when the caller has it already."""
    made = request(paths, **options)
    return merge_jobs(made, Path(out), _planned(made, planned), progress)


def _planned(made: MergeRequest, planned: list[PlannedJob] | None) -> list[PlannedJob]:
    """The plan the caller has, else one made now, what it assumed of the jobs' ranks said
    as `InputWarning`s (as the CLI says them; a caller with a plan has its warnings)."""
    if planned is not None:
        return planned
    jobs = plan_jobs(made)
    for line in (line for job in jobs for line in job.warnings):
        warnings.warn(line, InputWarning, stacklevel=3)
    return jobs


def sync(
    paths: Paths,
    *,
    parallel: int = 4,
    force: bool = False,
    timeout: float = 300.0,
    keep_staging: str | Path | None = None,
    progress: Callable[[Staged], None] | None = None,
    upload_progress: Callable[[Progress], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    planned: list[PlannedJob] | None = None,
    **options: Unpack[RequestOptions],
) -> SyncReport:
    """Merge `paths` and upload each run exactly once with `wandb sync`, verified.

    The server and key come from wandb's own settings (`WANDB_BASE_URL`, `WANDB_API_KEY`
    or `~/.netrc`). Runs already verified (the ledger) are skipped unless `force`.
    Raises `UploadFailed` (exit 1) naming each run that is not whole on the server.
    `keep_staging` stages the merged runs there and keeps them. `progress` is called with
    each run staged, `upload_progress` with the uploader's progress, `on_wait` with the key
    of a run another sync holds."""
    made = request(paths, **options)
    check_upload_options(parallel, timeout)
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
        planned=_planned(made, planned),
    )


def verify(
    paths: Paths,
    *,
    uploaded_by: UploadedBy = "wbmerge",
    on_note: Callable[[str], None] | None = None,
    **options: Unpack[RequestOptions],
) -> VerifyReport:
    """Whether the server holds every run the files under `paths` make, whole: read-only,
    nothing is written on the server or in the ledger.

    Give the options the runs were synced with (`run_mode`, `rank_scope`, `base_id`,
    `project`, `entity`, ...). `uploaded_by="wandb"`: the runs were uploaded by plain
    `wandb sync`, each offline run under its own id. Each run of the report says what
    keeps it from being whole, with the lines `sync` gives; `ServerError` when the server
    cannot be asked at all. Counts that lag are asked again for up to 10 s, and `on_note`
    is given a line saying so."""
    return verify_jobs(request(paths, **options), uploaded_by, on_note)


def follow(
    paths: Paths,
    *,
    interval: float = 60.0,
    idle_timeout: float = 600.0,
    parallel: int = 4,
    timeout: float = 300.0,
    on_round: Callable[[RoundReport], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    on_idle: Callable[[list[str]], None] | None = None,
    restart_grace: float = 60.0,
    job_prefix: str | None = None,
    **options: Unpack[RequestOptions],
) -> FollowReport:
    """`sync --follow`: keep the merged runs of a job that is still training up to date,
    a round every `interval` seconds, until every rank has finished (or nothing changed
    for `idle_timeout` seconds; then a one-shot sync finishes the runs). A run whose ranks
    all ended, some failed, waits `restart_grace` seconds without a change for an elastic
    restart first. `job_prefix` follows only the jobs whose id starts with it (the Flyte
    follow task passes its run's name). Returns a `follow.FollowReport`; `on_round` is
    called with each round's report."""
    from .follow import follow as follow_job

    check_upload_options(parallel, timeout)
    return follow_job(
        request(paths, **options),
        interval,
        idle_timeout,
        parallel,
        timeout,
        on_round=on_round,
        on_wait=on_wait,
        on_idle=on_idle,
        job_prefix=job_prefix,
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
    primary: Sequence[str] | str = (),
) -> ExportResult:
    """Write every rank's history and system metrics under `paths` to the Parquet file `out`:
    a value per row (long), or with `wide` a row per rank and step."""
    from .analyse import export as _export

    hints = make_hints(label_pattern, ranks_file, primary)
    return _export(path_list(paths), out, job=job, wide=wide, hints=hints)


def report(
    paths: Paths,
    *,
    metrics: Sequence[str] = (),
    job: str | None = None,
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
    primary: Sequence[str] | str = (),
    rank_stats: bool = False,
    html: str | Path | None = None,
) -> list[JobReport]:
    """Per job under `paths`: each metric's skew across ranks, which rank is slow and by
    how much; `metrics` narrows the keys (default: the ones that tell most). `rank_stats`
    adds each history metric's statistics across ranks at its last step. `html` writes the
    report as one self-contained page there too: a line per rank over steps for each
    metric, the outlier ranks marked, the spread across ranks, the ranks and nodes."""
    hints = make_hints(label_pattern, ranks_file, primary)
    from .analyse import report as _report
    from .analyse import write_html

    named = [metrics] if isinstance(metrics, str) else list(metrics)
    series = html is not None
    reports = _report(
        path_list(paths), named, job, hints=hints, rank_stats=rank_stats, series=series
    )
    if html is not None:
        write_html(reports, html)
    return reports


def start_sink(
    data_dir: str | Path = "./wbmerge-sink",
    *,
    port: int = 8765,
    faults: Sequence[str] = (),
    allow_faults: bool = False,
) -> LocalSink:
    """Start the local W&B-compatible sink (`wbmerge sink serve`) in a process of its own
    and return once it serves on 127.0.0.1:`port` (0: any free port).

    The result's `url` and `api_key` are what wandb needs (`env` holds them as
    `WANDB_BASE_URL` and `WANDB_API_KEY`); `stop()` ends the sink, as does leaving a `with`
    block:

        with api.start_sink("./sink", port=0) as sink:
            os.environ.update(WANDB_BASE_URL=sink.url, WANDB_API_KEY=sink.api_key)
            api.sync("./wandb", run_mode="shared")

    `faults` are `--fault` specs for reliability tests. A sink that does not start (the
    port is taken, the data directory is unsafe) raises `WbmergeError` with its last line.
    """
    from .sink import LocalSink

    return LocalSink(data_dir, port=port, faults=faults, allow_faults=allow_faults).start()

"""Runs that wbmerge merged already (a `merge --out` directory), ready to upload as they are.

`wbmerge merge --out DIR` writes offline runs that plain `wandb sync` can send; `wbmerge
sync DIR` sends them too, verified and recorded like any other sync. Such a run is told
apart by its `wbmerge` config block, which lists the `sources` it was merged from (a rank's
own block never does). It is no rank of a job: it is uploaded under its own id, group and
name, so the options that shape a merge do not apply to it, and runs of ranks beside it
are refused (the two would be uploaded by different rules).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .discover import Job, OfflineRun
from .errors import WbmergeError
from .merge import DEFAULT_KEY_FORMAT


def merge_options_given(request: object) -> list[str]:
    """The options of `request` (a `MergeRequest`) that shape a merge, as the CLI spells
    them; none of them applies to runs merged already."""
    given = [
        ("--run-mode", getattr(request, "run_mode", None)),
        ("--rank-scope", getattr(request, "rank_scope", None)),
        ("--base-id", getattr(request, "base_id", None)),
        ("--allow-missing-ranks", getattr(request, "allow_missing_ranks", False)),
        ("--system-metrics", getattr(request, "system_metrics", "primary") != "primary"),
        ("--key-format", getattr(request, "key_format", DEFAULT_KEY_FORMAT) != DEFAULT_KEY_FORMAT),
        ("--skew-metrics", getattr(request, "skew_metrics", False)),
        ("--rank-stats", getattr(request, "rank_stats", False)),
        ("--per-rank", bool(getattr(request, "per_rank", None))),
        ("--job-type", getattr(request, "job_type", None)),
        ("--label-pattern", getattr(request, "label_pattern", None)),
        ("--ranks", getattr(request, "ranks_file", None)),
    ]
    return [name for name, value in given if value]


def merged_jobs(runs: Sequence[OfflineRun], job: str | None = None) -> list[Job]:
    """The merged runs among `runs` as jobs (by the job id their blocks name), each run
    once; WbmergeError (one line) for runs of ranks among them, a run id found twice, or
    a `job` that is not there."""
    ranks = [r for r in runs if r.merged is None and r.has_run_record]
    merged = [r for r in runs if r.merged is not None]
    if ranks:
        raise WbmergeError(
            f"{merged[0].run_dir} is a run that wbmerge merged, but {ranks[0].run_dir} is "
            "a rank's run; sync merged runs and the runs of ranks apart"
        )
    by_job: dict[str, list[OfflineRun]] = defaultdict(list)
    seen: dict[str, OfflineRun] = {}
    for run in merged:
        if run.run_id in seen:
            raise WbmergeError(
                f"run {run.run_id} found twice: {seen[run.run_id].run_dir} and {run.run_dir}"
            )
        seen[run.run_id] = run
        by_job[run.merged.job_id].append(run)  # type: ignore[union-attr]
    if job is not None:
        if job not in by_job:
            known = ", ".join(sorted(by_job))
            raise WbmergeError(f"no job {job!r} among the runs found (jobs: {known})")
        by_job = {job: by_job[job]}
    return [
        Job(job_id, sorted(members, key=lambda r: r.run_id))
        for job_id, members in sorted(by_job.items())
    ]

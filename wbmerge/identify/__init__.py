"""Discovery and identification: offline runs -> ranks -> jobs.

`discover` finds the offline runs under the paths a user names and groups them into jobs;
`offlinerun` reads what one run says about itself; `rankclaims` (pure) turns a label,
name, config, command line, SLURM task or GPU into a claim of a rank, `jobs` (pure)
decides which runs make a job and which claims to believe, and `placement` (pure) turns a
job's claims into ranks, local ranks and workers. `hints` is the user's own word
(`--label-pattern`, `--ranks`, `--primary`), `merged` knows the runs a merge wrote, and
`inspection` is the `inspect` command's report.
"""

from .discover import (
    Job,
    discover,
    few_ranks,
    find_invalid_records,
    find_run_files,
    group_jobs,
    identify_runs,
    merged_jobs,
    merged_runs,
    selects_merged,
)
from .hints import make_hints
from .inspection import format_inspection, inspect_runs, unreadable_summary
from .jobs import Hints, few, identify
from .merged import MergedBy, merged_by
from .offlinerun import OfflineRun, RunStats, read_identity, scan

__all__ = [
    "Hints",
    "Job",
    "MergedBy",
    "OfflineRun",
    "RunStats",
    "discover",
    "few",
    "few_ranks",
    "find_invalid_records",
    "find_run_files",
    "format_inspection",
    "group_jobs",
    "identify",
    "identify_runs",
    "inspect_runs",
    "make_hints",
    "merged_by",
    "merged_jobs",
    "merged_runs",
    "read_identity",
    "scan",
    "selects_merged",
    "unreadable_summary",
]

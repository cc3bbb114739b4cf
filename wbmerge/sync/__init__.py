"""Sync: the conductor of discover -> plan -> merge -> upload -> verify, as one library call
per command (`plan_jobs` is `--dry-run`, `merge_jobs` is `wbmerge merge`, `sync` is `wbmerge
sync`; a follow runs the same flow a round at a time). The modules, one job each:

| module | job |
| --- | --- |
| `request` | what the user asked for (`MergeRequest`), and the option checks that need no run |
| `pipeline` | the flow of one command over every job found |
| `session` | one upload session (server, ledger, staging, locks) that a sync and a follow open |
| `audit` | `wbmerge verify`: whether a server holds what the files hold, read-only |
| `exactlyonce` | the exactly-once flow over one project's staged runs: ask, send the remainder, verify |
"""

from __future__ import annotations

from .audit import UploadedBy, VerifyReport, verify_jobs
from .exactlyonce import Deliverer
from .pipeline import (
    PlannedJob,
    SyncReport,
    UploadFailed,
    merge_jobs,
    plan_found,
    plan_jobs,
    sigterm_raises,
    sync,
)
from .request import (
    MergeRequest,
    RequestOptions,
    Spelling,
    ignored_options,
    option_names,
    request_fields,
)
from .session import UploadSession, delivery_of

__all__ = [
    "UploadedBy",
    "VerifyReport",
    "verify_jobs",
    "Deliverer",
    "ignored_options",
    "merge_jobs",
    "MergeRequest",
    "Spelling",
    "request_fields",
    "option_names",
    "plan_found",
    "plan_jobs",
    "PlannedJob",
    "RequestOptions",
    "sigterm_raises",
    "sync",
    "SyncReport",
    "UploadFailed",
    "UploadSession",
    "delivery_of",
]

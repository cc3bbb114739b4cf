"""Upload: staged offline runs go to W&B through wandb's own uploader, `wandb sync`, once.

We never speak W&B's upload protocol ourselves. The modules, one job each:

| module | job |
| --- | --- |
| `credentials` | the server URL and API key |
| `server` | what the server holds (the read-only queries wandb itself makes) |
| `remainder` | pure: staged run x what the server holds -> what is left to send, what is missing |
| `whole` | pure: whether the server holds a staged run whole already, its made files read back |
| `uploader` | `wandb sync` under supervision, started ahead of its runs: progress, timeout, stopping its process tree |
| `ledger` | runs verified complete (SQLite) and per-run locks |
| `staging` | staging directories that name their owner, in a directory private to the user; leftovers of killed syncs removed |
| `standby` | what the uploader's process runs, and how a later sync knows it (and its wandb-core) again |
| `settle` | stopped uploads noted, so that no sync reads counts while their last requests land |
| `batches` | pure: how many ready runs a new `wandb sync` takes, its lanes, and which runs to ask about |
| `sourcecheck` | what a staged run must hold, counted from its ranks' own logs, and what it lacks of it |
| `deliver` | the exactly-once flow over one project's staged runs |
"""

from __future__ import annotations

from ..wandbcore import StagedContent, read_staged
from .artifactcheck import artifacts_missing
from .batches import PATIENCE, START_COST, UploadSlots, batch_lanes, batch_size, runs_to_ask
from .credentials import Credentials, find_credentials
from .deliver import Deliverer
from .delivery import Delivery, DeliveryReport, Progress
from .ledger import Ledger, run_locks, server_key, state_dir
from .onserver import rows_not_held
from .pipeline import (
    PlannedJob,
    SyncReport,
    UploadFailed,
    check_key_format,
    merge_jobs,
    plan_found,
    plan_jobs,
    sigterm_raises,
    sync,
)
from .processes import command_line
from .relay import Relay
from .relayserver import Offsets
from .remainder import (
    Mismatch,
    Remainder,
    history_row,
    remainder,
    same_value,
    sends_no_row,
    shortfall,
    write_remainder,
)
from .request import MergeRequest, RequestOptions, ignored_options, option_names
from .rowcheck import compare_steps, halves, room, sampled, spans, windows
from .server import RUN_RESUME_STATUS, Held, RunListing, ServerClient, ServerError
from .settle import SETTLE, last_stop, note_stopped, wait_settled
from .sourcecheck import expected_of, source_shortfall
from .staging import (
    OwnerRecord,
    clean_stale,
    make_staging,
    staged_files,
    staged_md5s,
    staging_root,
)
from .standby import STANDBY
from .uploader import DEFAULT_PARALLEL, DEFAULT_TIMEOUT, Uploader
from .whole import (
    READ_BACK,
    files_changed,
    files_expected,
    files_missing,
    made_files_stale,
    not_held_whole,
)

__all__ = [
    "Credentials",
    "DEFAULT_PARALLEL",
    "DEFAULT_TIMEOUT",
    "Deliverer",
    "Delivery",
    "DeliveryReport",
    "Held",
    "Ledger",
    "MergeRequest",
    "Mismatch",
    "Offsets",
    "OwnerRecord",
    "PATIENCE",
    "PlannedJob",
    "Progress",
    "READ_BACK",
    "RUN_RESUME_STATUS",
    "Relay",
    "Remainder",
    "RequestOptions",
    "RunListing",
    "SETTLE",
    "STANDBY",
    "START_COST",
    "ServerClient",
    "ServerError",
    "StagedContent",
    "SyncReport",
    "UploadFailed",
    "UploadSlots",
    "Uploader",
    "artifactcheck",
    "artifacts_missing",
    "batch_lanes",
    "batch_size",
    "check_key_format",
    "clean_stale",
    "command_line",
    "compare_steps",
    "expected_of",
    "files_changed",
    "files_expected",
    "files_missing",
    "find_credentials",
    "halves",
    "history_row",
    "ignored_options",
    "last_stop",
    "made_files_stale",
    "make_staging",
    "merge_jobs",
    "not_held_whole",
    "note_stopped",
    "option_names",
    "plan_found",
    "plan_jobs",
    "read_staged",
    "remainder",
    "room",
    "rows_not_held",
    "run_locks",
    "runs_to_ask",
    "same_value",
    "sampled",
    "sends_no_row",
    "server",
    "server_key",
    "shortfall",
    "sigterm_raises",
    "source_shortfall",
    "spans",
    "staged_files",
    "staged_md5s",
    "staging_root",
    "state_dir",
    "sync",
    "wait_settled",
    "windows",
    "write_remainder",
]

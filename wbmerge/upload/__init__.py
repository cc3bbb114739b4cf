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
| `deliver` | the exactly-once flow over one project's staged runs |
"""

from __future__ import annotations

from ..wandbcore.content import StagedContent, read_staged
from .batches import PATIENCE, START_COST, UploadSlots, batch_lanes, batch_size, runs_to_ask
from .credentials import Credentials, find_credentials
from .deliver import Deliverer
from .delivery import Delivery, DeliveryReport, Progress
from .ledger import Ledger, run_locks, server_key, state_dir
from .remainder import Remainder, history_row, remainder, same_value, shortfall
from .server import Held, RunListing, ServerClient, ServerError
from .settle import SETTLE, last_stop, note_stopped, wait_settled
from .staging import (
    OwnerRecord,
    clean_stale,
    make_staging,
    staged_files,
    staged_md5s,
    staging_root,
)
from .standby import STANDBY
from .uploader import DEFAULT_TIMEOUT
from .whole import (
    READ_BACK,
    files_changed,
    files_expected,
    files_missing,
    made_files_stale,
    not_held_whole,
)

DEFAULT_PARALLEL = 4  # below wandb sync's own default of 5: one job may be many runs

__all__ = [
    "DEFAULT_PARALLEL",
    "DEFAULT_TIMEOUT",
    "PATIENCE",
    "READ_BACK",
    "SETTLE",
    "STANDBY",
    "START_COST",
    "Credentials",
    "Deliverer",
    "Delivery",
    "DeliveryReport",
    "Held",
    "Ledger",
    "OwnerRecord",
    "Progress",
    "Remainder",
    "RunListing",
    "ServerClient",
    "ServerError",
    "StagedContent",
    "UploadSlots",
    "batch_lanes",
    "batch_size",
    "clean_stale",
    "files_changed",
    "files_expected",
    "files_missing",
    "find_credentials",
    "history_row",
    "last_stop",
    "made_files_stale",
    "make_staging",
    "not_held_whole",
    "note_stopped",
    "read_staged",
    "remainder",
    "run_locks",
    "runs_to_ask",
    "same_value",
    "server_key",
    "shortfall",
    "staged_files",
    "staged_md5s",
    "staging_root",
    "state_dir",
    "wait_settled",
]

"""Upload: the transport and the exactly-once bookkeeping. Staged runs go to W&B through
wandb's own uploader, `wandb sync`; the runs verified are kept in a ledger.

We never speak W&B's upload protocol ourselves. The modules, one job each:

| module | job |
| --- | --- |
| `credentials` | the server URL and API key |
| `serverclient` | what the server holds (the read-only queries wandb itself makes) |
| `serverjson` | the server's answers and rows read by orjson, meaning what `json` reads |
| `uploader` | `wandb sync` under supervision, started ahead of its runs: progress, timeout, stopping its process tree |
| `ledger` | runs verified complete (SQLite) and per-run locks |
| `stagingdirs` | staging directories that name their owner, in a directory private to the user; leftovers of killed syncs removed |
| `standby` | what the uploader's process runs, and how a later sync knows it (and its wandb-core) again |
| `settle` | stopped uploads noted, so that no sync reads counts while their last requests land |
| `batches` | pure: how many ready runs a new `wandb sync` takes, its lanes, and which runs to ask about |
"""

from __future__ import annotations

from . import serverclient
from .batches import PATIENCE, START_COST, UploadSlots, batch_lanes, batch_size, runs_to_ask
from .credentials import Credentials, find_credentials
from .delivery import Delivery, DeliveryReport, Progress
from .ledger import Ledger, run_locks, server_key, state_dir
from .processes import command_line
from .relay import Relay
from .relayprocess import Offsets
from .serverclient import RUN_RESUME_STATUS, Held, RunListing, ServerClient, ServerError
from .settle import SETTLE, last_stop, note_stopped, wait_settled
from .stagingdirs import (
    OwnerRecord,
    clean_stale,
    make_staging,
    staged_files,
    staged_md5s,
    staging_root,
)
from .standby import STANDBY
from .uploader import DEFAULT_PARALLEL, DEFAULT_TIMEOUT, Uploader

__all__ = [
    "batch_lanes",
    "batch_size",
    "clean_stale",
    "command_line",
    "Credentials",
    "DEFAULT_PARALLEL",
    "DEFAULT_TIMEOUT",
    "Delivery",
    "DeliveryReport",
    "find_credentials",
    "Held",
    "last_stop",
    "Ledger",
    "make_staging",
    "note_stopped",
    "Offsets",
    "OwnerRecord",
    "PATIENCE",
    "Progress",
    "Relay",
    "run_locks",
    "RUN_RESUME_STATUS",
    "RunListing",
    "runs_to_ask",
    "server_key",
    "serverclient",
    "ServerClient",
    "ServerError",
    "SETTLE",
    "staged_files",
    "staged_md5s",
    "staging_root",
    "STANDBY",
    "START_COST",
    "state_dir",
    "Uploader",
    "UploadSlots",
    "wait_settled",
]

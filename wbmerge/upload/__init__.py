"""Upload: the transport and the exactly-once bookkeeping. Staged runs go to W&B through
wandb's own uploader, `wandb sync`; the runs verified are kept in a ledger.

We never speak W&B's upload protocol ourselves. The modules, one job each:

| module | job |
| --- | --- |
| `credentials` | the server URL and API key |
| `serverclient` | what the server holds (the read-only queries wandb itself makes) |
| `claims` | one writer per run: a claim in the run's config on the server, read back before anything is sent |
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
from .batches import UploadSlots, batch_lanes, batch_size, runs_to_ask
from .claims import Claims, OtherWriter, writer_id
from .claims import Kind as ClaimsKind
from .credentials import Credentials, find_credentials
from .delivery import Delivery, DeliveryReport, Progress
from .ledger import Ledger, run_locks, state_dir
from .relay import Relay
from .serverclient import Held, RunListing, ServerClient, ServerError
from .serverjson import loads as read_json
from .settle import wait_settled
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
    "Claims",
    "ClaimsKind",
    "clean_stale",
    "Credentials",
    "DEFAULT_PARALLEL",
    "DEFAULT_TIMEOUT",
    "Delivery",
    "DeliveryReport",
    "find_credentials",
    "Held",
    "Ledger",
    "make_staging",
    "OtherWriter",
    "OwnerRecord",
    "Progress",
    "read_json",
    "Relay",
    "run_locks",
    "RunListing",
    "runs_to_ask",
    "serverclient",
    "ServerClient",
    "ServerError",
    "staged_files",
    "staged_md5s",
    "staging_root",
    "STANDBY",
    "state_dir",
    "Uploader",
    "UploadSlots",
    "wait_settled",
    "writer_id",
]

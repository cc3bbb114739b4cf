"""Verify: what proves a run. Before an upload, the staged run against its ranks' own logs;
after it, the server's run against the staged one. The modules, one job each:

| module | job |
| --- | --- |
| `sourcecheck` | what a staged run must hold, counted from its ranks' own logs, and what it lacks |
| `copyproof` | whether a staged log is its one source log copied, proved by their bytes |
| `remainder` | pure: staged run x what the server holds -> what is left to send, what is missing |
| `whole` | pure: whether the server holds a staged run whole already, its made files read back |
| `rowcheck` | pure: every history row read back once, with the values sent |
| `readback` | asks the server for what the checks above compare: files, rows, made files |
| `proof` | the one list of checks that proves a run on the server, run in one place |
| `artifactcheck` | whether the server holds a run's artifacts, each file at its size and digest |
"""

from __future__ import annotations

from . import artifactcheck
from .proof import AFTER_UPLOAD, WHOLE, RunOnServer, checked_config_keys, counts, prove
from .readback import (
    COUNTS_LAG,
    COUNTS_LATE,
    RowsLost,
    counts_behind,
    counts_caught_up,
    rows_not_held,
)
from .remainder import (
    Mismatch,
    history_row,
    keeps_no_config,
    not_a_beginning,
    remainder,
    resend_whole,
    same_value,
    sends_no_row,
    shortfall,
    with_last_row,
    write_remainder,
)
from .rowcheck import halves, room, sampled, spans, windows
from .sourcecheck import (
    ExpectedFold,
    ValueHashes,
    add_tallies,
    continued_shortfall,
    expected_of,
    fast_hashes,
    lacking_line,
    rows_tally,
    source_shortfall,
)
from .whole import (
    made_files_stale,
    not_held_whole,
)

__all__ = [
    "COUNTS_LAG",
    "COUNTS_LATE",
    "counts_behind",
    "counts_caught_up",
    "AFTER_UPLOAD",
    "WHOLE",
    "RunOnServer",
    "checked_config_keys",
    "counts",
    "prove",
    "artifactcheck",
    "add_tallies",
    "continued_shortfall",
    "expected_of",
    "ExpectedFold",
    "fast_hashes",
    "rows_tally",
    "ValueHashes",
    "halves",
    "history_row",
    "lacking_line",
    "made_files_stale",
    "Mismatch",
    "not_a_beginning",
    "not_held_whole",
    "remainder",
    "keeps_no_config",
    "resend_whole",
    "room",
    "rows_not_held",
    "RowsLost",
    "same_value",
    "sampled",
    "sends_no_row",
    "shortfall",
    "source_shortfall",
    "spans",
    "windows",
    "with_last_row",
    "write_remainder",
]

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
from .artifactcheck import artifacts_missing
from .proof import AFTER_UPLOAD, WHOLE, RunOnServer, counts, prove
from .readback import (
    COUNTS_LAG,
    COUNTS_LATE,
    RowsLost,
    counts_behind,
    counts_caught_up,
    not_whole_on_server,
    rows_held,
    rows_not_held,
    saved_files_missing,
)
from .remainder import (
    Mismatch,
    Remainder,
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
from .rowcheck import compare_steps, halves, room, sampled, spans, windows
from .sourcecheck import expected_of, lacking_line, source_shortfall
from .whole import (
    READ_BACK,
    files_changed,
    files_expected,
    files_missing,
    made_files_stale,
    metric_definitions_missing,
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
    "counts",
    "prove",
    "artifactcheck",
    "artifacts_missing",
    "compare_steps",
    "expected_of",
    "files_changed",
    "files_expected",
    "files_missing",
    "halves",
    "history_row",
    "lacking_line",
    "made_files_stale",
    "metric_definitions_missing",
    "Mismatch",
    "not_a_beginning",
    "not_held_whole",
    "not_whole_on_server",
    "READ_BACK",
    "Remainder",
    "remainder",
    "keeps_no_config",
    "resend_whole",
    "room",
    "rows_held",
    "rows_not_held",
    "RowsLost",
    "same_value",
    "sampled",
    "saved_files_missing",
    "sends_no_row",
    "shortfall",
    "source_shortfall",
    "spans",
    "windows",
    "with_last_row",
    "write_remainder",
]

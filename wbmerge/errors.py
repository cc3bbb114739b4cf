"""One error type for everything a user can cause: the CLI prints its message as one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import SyncReport

RERUN = "nothing missing was recorded as synced; rerun `wbmerge sync` to send it"
REFUSED = "syncing again cannot complete these runs: upload under other run ids"


class WbmergeError(Exception):
    """A problem with the user's input or environment, explained in one line.

    `exit_code` is 2 for bad input (the default) and 1 for work that failed (an upload).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UploadFailed(WbmergeError):
    """Some runs are not (all) on the server: a line per run, exit 1, none of them recorded;
    `report` holds the runs that were verified. The advice that ends the lines of each job
    (to rerun, or to upload under other run ids) is said once, after every job's runs."""

    def __init__(self, lines: list[str], report: SyncReport) -> None:
        advice = (RERUN, REFUSED)
        lines = [*(s for s in lines if not s.startswith(advice)),
                 *dict.fromkeys(s for s in lines if s.startswith(advice))]  # fmt: skip
        super().__init__("; ".join(lines), exit_code=1)
        self.lines = lines
        self.report = report


class NotATransactionLog(WbmergeError):
    """The file does not start with the W&B transaction-log header."""


class InputWarning(UserWarning):
    """Input that was left out, and why (a FIFO named like a run, a link loop): the CLI
    prints each as one `wbmerge: warning:` line and goes on."""


class Terminated(BaseException):
    """SIGTERM (how Flyte and Kubernetes stop a task), raised where the process is, so that
    cleanup (`finally`) runs as it does for Ctrl-C."""

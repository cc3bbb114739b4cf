"""One error type for everything a user can cause: the CLI prints its message as one line.

Every stage raises these, down to the reader of a `.wandb` file, so this module imports
nothing of the package: an error type never drags a later stage into an earlier one.
`UploadFailed`, which carries a sync's report, lives with the sync in `sync.pipeline`.
"""

from __future__ import annotations

RERUN = "nothing missing was recorded as synced; rerun `wbmerge sync` to send it"
REFUSED = "syncing again cannot complete these runs: upload under other run ids"


class WbmergeError(Exception):
    """A problem with the user's input or environment, explained in one line.

    `exit_code` is 2 for bad input (the default) and 1 for work that failed (an upload).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class NotATransactionLog(WbmergeError):
    """The file does not start with the W&B transaction-log header."""


class InputWarning(UserWarning):
    """Input that was left out, and why (a FIFO named like a run, a link loop): the CLI
    prints each as one `wbmerge: warning:` line and goes on."""


class Terminated(BaseException):
    """SIGTERM (how Flyte and Kubernetes stop a task), raised where the process is, so that
    cleanup (`finally`) runs as it does for Ctrl-C."""

"""One error type for everything a user can cause: the CLI prints its message as one line."""


class WbmergeError(Exception):
    """A problem with the user's input or environment, explained in one line."""

    exit_code = 2


class NotATransactionLog(WbmergeError):
    """The file does not start with the W&B transaction-log header."""

"""Stopped uploads, and the wait before the next sync asks the server what it holds.

A request that an uploader sent just before it was stopped (Ctrl-C, a timeout, a sync
killed with SIGKILL) is still applied by the server after the uploader is gone. The next
sync cuts each run down to what the server lacks from the line counts it reads, and
wandb's uploader then continues the run at the counts it reads itself, a second or two
later. A request that lands between those two readings is sent twice: once by the stopped
uploader, and again at the offsets after it. In a test with a sink that applies each
request one second after it arrives, 2,758 history rows landed 0.08 s after a rerun had
read the count of 2,760 and before its uploader started, and the run ended with 8,758
rows of 6,000.

So every stop is noted in wbmerge's state directory, and no sync reads counts until
`SETTLE` seconds after the last one. Whatever lands later still cannot be claimed: the
check after each upload compares every count with the staged run.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
import time
from collections.abc import Callable

from ..errors import WbmergeError
from .ledger import check_state_dir, state_dir

# Seconds a server may take to apply a request it received before its sender stopped.
SETTLE = 5.0
_MARK = "uploads-stopped-at"


def note_stopped(at: float | None = None) -> None:
    """Say that an upload stopped before its end at `at` (a wall-clock time; now if None).

    Threads of one sync and other syncs note at once (an upload's thread sees its uploader
    killed while the main thread stops the next one), so the mark is read and replaced
    under a lock, and a later stop is never replaced by an earlier one (a mark in the future
    is no later stop: it is replaced). It is called while uploads are being stopped, so it
    never raises: a state directory that cannot be written (or that other users may
    write) loses the note, and the check
    after each upload still catches rows sent twice."""
    at = time.time() if at is None else at
    path = state_dir() / _MARK
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_state_dir(path.parent)  # (refused in one line when the ledger is opened)
        with open(path.with_name(_MARK + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # also between threads: each opens its own
            if at <= last_stop() <= time.time():
                return
            tmp = path.with_name(f"{_MARK}.{os.getpid()}.tmp")
            tmp.write_text(repr(at))
            tmp.replace(path)
    except (OSError, WbmergeError):
        return


def last_stop() -> float:
    """When the last upload stopped before its end (0 if none did, or it is unreadable)."""
    try:
        at = float((state_dir() / _MARK).read_text())
    except (OSError, ValueError):
        return 0.0
    return at if math.isfinite(at) else 0.0


def wait_settled(
    stop: threading.Event | None = None,
    on_wait: Callable[[float], None] | None = None,
    settle: float = SETTLE,
) -> float:
    """Wait until `settle` seconds (`SETTLE` unless a test wants less) have passed since
    the last stop, or `stop` is set; the seconds waited. `on_wait(seconds)` is told before
    a wait.

    A stop noted in the future (the clock was set back since, or a dead sync's files carry
    a time ahead of this clock) is taken as a stop now: it is waited for once, not before
    every run until the clock has caught up with it."""
    now = time.time()
    last = last_stop()
    if last > now:
        note_stopped(now)
    wait = settle if last > now else last + settle - now
    if wait <= 0:
        return 0.0
    if on_wait is not None:
        on_wait(wait)
    if stop is None:
        time.sleep(wait)
    else:
        stop.wait(wait)
    return wait

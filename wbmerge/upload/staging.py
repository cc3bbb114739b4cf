"""Staging directories that say who owns them, so that a killed sync's leftovers are removed.

A sync stages merged runs under `wbmerge-staging-*` in the temp dir, with an `owner.json`
naming its process (pid and start time, so that a reused pid is not taken for the owner)
and the uploader processes it runs. A later sync removes the staging of owners
that are gone (SIGKILL, reboot) and stops their uploader first, so that no orphaned
`wandb sync` keeps sending while a new one starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

PREFIX = "wbmerge-staging-"
OWNER = "owner.json"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    if started is not None and Path("/proc").is_dir():
        return _start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_staging(parent: Path | None = None) -> Path:
    """A new staging directory owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    write_owner(path)
    return path


def write_owner(path: Path, uploader: list[int] | None = None) -> None:
    """Say that this process owns `path`, and which uploader processes it runs."""
    tree = [[pid, _start_time(pid)] for pid in uploader or []]
    owner = {"pid": os.getpid(), "started": _start_time(os.getpid()), "uploader": tree}
    tmp = path / (OWNER + ".tmp")
    tmp.write_text(json.dumps(owner))
    tmp.replace(path / OWNER)


class OwnerRecord:
    """This process's owner record of one staging directory, naming the processes of every
    uploader it runs there at the moment (several upload side by side)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._trees: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def uploader(self, key: int, pids: list[int]) -> None:
        """Say which processes the uploader `key` runs now (none: it ended)."""
        with self._lock:
            if pids:
                self._trees[key] = pids
            else:
                self._trees.pop(key, None)
            write_owner(self.path, [pid for tree in self._trees.values() for pid in tree])


def clean_stale(parent: Path | None = None) -> list[Path]:
    """Remove the staging directories of dead owners (stopping their uploaders first)."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for path in parent.glob(PREFIX + "*"):
        try:
            owner = json.loads((path / OWNER).read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge: no owner file we wrote
        if _alive(pid, owner.get("started")):
            continue
        for entry in owner.get("uploader") or []:
            pid, started = entry if isinstance(entry, list) and len(entry) == 2 else (0, None)
            if isinstance(pid, int) and pid > 1 and started and _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)  # an orphan of the dead owner, still sending
                except (ProcessLookupError, PermissionError):
                    pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed

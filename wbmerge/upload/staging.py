"""Staging directories that say who owns them, so that a killed sync's leftovers are removed.

A sync stages merged runs under `wbmerge-staging-*` in the temp dir, with an `owner.json`
naming its process (pid and start time, so that a reused pid is not taken for the owner)
and the uploader processes it runs. A later sync removes the staging of owners
that are gone (SIGKILL, reboot) and stops their uploader first, so that no orphaned
`wandb sync` keeps sending while a new one starts, and notes the stop (see `settle`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from .processes import alive, start_time, wait_gone, working_in
from .settle import note_stopped

PREFIX = "wbmerge-staging-"
OWNER = "owner.json"


def make_staging(parent: Path | None = None) -> Path:
    """A new staging directory owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    write_owner(path)
    return path


def write_owner(path: Path, uploader: list[int] | None = None) -> None:
    """Say that this process owns `path`, and which uploader processes it runs."""
    tree = [[pid, start_time(pid)] for pid in uploader or []]
    owner = {"pid": os.getpid(), "started": start_time(os.getpid()), "uploader": tree}
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
        if alive(pid, owner.get("started")):
            continue
        orphans = set(working_in(path))  # wandb-core too, if it started after the record
        for entry in owner.get("uploader") or []:
            pid, started = entry if isinstance(entry, list) and len(entry) == 2 else (0, None)
            if isinstance(pid, int) and pid > 1 and started and start_time(pid) == started:
                orphans.add(pid)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)  # an orphan of the dead owner, still sending
            except (ProcessLookupError, PermissionError):
                pass
        wait_gone(orphans)
        # What the dead sync's uploader sent last may still be landing on the server.
        note_stopped(None if orphans else _last_written(path))
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _last_written(path: Path) -> float:
    """When anything under `path` was last written: the uploader's logs there are written
    as it sends, so this is about when a dead sync's uploader stopped."""
    latest = 0.0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                latest = max(latest, os.lstat(os.path.join(dirpath, name)).st_mtime)
            except OSError:
                continue
    return latest


def staged_files(files_dir: Path) -> dict[str, int]:
    """The regular files below a staged run's `files/`, by their name there, with sizes.
    A directory below it that cannot be read raises OSError: its files are not known, so
    they cannot be said to be on the server."""
    found: dict[str, int] = {}
    if not files_dir.exists():
        return found

    def refuse(error: OSError) -> None:
        raise error

    for here, _, names in os.walk(files_dir, onerror=refuse):
        for name in names:
            path = Path(here, name)
            status = path.lstat()
            if stat.S_ISREG(status.st_mode):
                found[path.relative_to(files_dir).as_posix()] = status.st_size
    return found


def staged_md5s(files_dir: Path, names: Iterable[str]) -> dict[str, str]:
    """The MD5 of each of the files `names` below a staged run's `files/`, in base64 as W&B
    gives a file's `md5` (OSError if one cannot be read). Hashing costs about 2 s a GB, so
    only files already found on the server at their size are hashed."""
    found: dict[str, str] = {}
    for name in names:
        digest = hashlib.md5(usedforsecurity=False)
        with open(files_dir / name, "rb") as file:
            while piece := file.read(1 << 20):
                digest.update(piece)
        found[name] = base64.b64encode(digest.digest()).decode()
    return found

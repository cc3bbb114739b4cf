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
import time
from collections.abc import Iterable
from pathlib import Path

from .settle import note_stopped

PREFIX = "wbmerge-staging-"
OWNER = "owner.json"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (Linux): the state first, the
    kernel's flags at 6, the start time at 19; None if the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None if it is gone."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _alive(pid: int, started: str | None) -> bool:
    """Whether the owner still runs. A killed owner that is exiting, or not yet reaped by
    its parent, is not: it stops nothing any more, and its locks are freed (or about to
    be: a sync that waited for them can get them before the owner has become a zombie)."""
    if started is not None and Path("/proc").is_dir():
        fields = _stat(pid)  # (one read: the start time and the state of the same process)
        return fields is not None and fields[19] == started and not _exiting(fields)
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
        orphans = set(_working_in(path))  # wandb-core too, if it started after the record
        for entry in owner.get("uploader") or []:
            pid, started = entry if isinstance(entry, list) and len(entry) == 2 else (0, None)
            if isinstance(pid, int) and pid > 1 and started and _start_time(pid) == started:
                orphans.add(pid)
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)  # an orphan of the dead owner, still sending
            except (ProcessLookupError, PermissionError):
                pass
        _wait_gone(orphans)
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


def _working_in(path: Path) -> list[int]:
    """Processes (other than this one) whose working directory lies in `path`: a dead
    owner's uploaders, which run there, with the wandb-core each started."""
    found = []
    root = path.resolve()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = proc.joinpath("cwd").readlink()
        except OSError:
            continue  # gone, or not ours to look at
        if int(proc.name) != os.getpid() and cwd.is_relative_to(root):
            found.append(int(proc.name))
    return found


def _wait_gone(pids: set[int], patience: float = 5.0) -> None:
    """Wait (at most `patience` seconds) until killed processes are gone, so that nothing
    they were sending can arrive after the next sync asked the server what it holds."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if (_start_time(pid) or "").isdigit()]
        if not alive or all(_state(pid) == "Z" for pid in alive):
            return
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    """The process's state letter (Linux), None if it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


_PF_EXITING = 0x4  # the kernel's flag of a task in its exit (`flags` in /proc/PID/stat)


def _exiting(fields: list[str]) -> bool:
    """Whether a process (its `_stat` fields) is a zombie, or on its way out."""
    if fields[0] in ("Z", "X"):
        return True
    return not fields[6].isdigit() or bool(int(fields[6]) & _PF_EXITING)


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

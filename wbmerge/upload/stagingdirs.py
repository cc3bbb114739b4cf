"""Staging directories that say who owns them, so that a killed sync's leftovers are removed.

A sync stages merged runs under `wbmerge-staging-*` in a directory of its user's own,
`wbmerge-{uid}` in the temp dir (`staging_root`: made 0700, and refused when it is a link,
another user's, or open to others), with an `owner.json` naming its process (pid and start
time, so that a reused pid is not taken for the owner) and the uploader processes it runs.
A later sync removes the staging of owners that are gone (SIGKILL, reboot) and stops their
uploader first, so that no orphaned `wandb sync` keeps sending while a new one starts, and
notes the stop (see `settle`).

A later sync may run as root, so nothing in the temp dir is taken on trust: before, any
user could plant an owner record there naming a process of theirs choosing (pid and start
time are public), or a link to a directory of theirs, and a sync killed those processes.
Now only this user's directory is read, nothing in it is reached through a link, and a
process is stopped only when its start time, its user and its command line (the uploader
wbmerge starts, see `standby`) all agree with the record.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path

from ..errors import InputWarning, WbmergeError
from .processes import alive, command_line, start_time, user_ids, wait_gone, working_in
from .settle import note_stopped
from .standby import is_uploader

PREFIX = "wbmerge-staging-"
OWNER = "owner.json"


def staging_root(temp: Path | None = None) -> Path:
    """This user's directory of staging in the temp dir (`temp`, else TMPDIR's), made if it
    is missing; WbmergeError if it cannot be made or is not private (see `check_private`)."""
    root = Path(temp or tempfile.gettempdir()) / f"wbmerge-{os.geteuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise WbmergeError(
            f"cannot make the staging directory {root} ({exc.strerror or exc}); set TMPDIR "
            "to a directory wbmerge may write"
        ) from None
    return check_private(root)


def check_private(path: Path) -> Path:
    """`path`, when it is a directory (not a link to one) of this user that no one else may
    read or write; else WbmergeError in one line saying why."""
    try:
        status = os.lstat(path)
    except OSError as exc:
        raise WbmergeError(f"cannot read the staging directory {path} ({exc.strerror})") from None
    if stat.S_ISLNK(status.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(status.st_mode):
        why = "is not a directory"
    elif status.st_uid != os.geteuid():
        why = f"belongs to uid {status.st_uid}, not to this user (uid {os.geteuid()})"
    elif status.st_mode & 0o077:
        why = f"is open to other users (mode {stat.S_IMODE(status.st_mode):o}, want 700)"
    else:
        return path
    raise WbmergeError(
        f"staging directory {path} {why}; refusing to stage there: remove it, or set TMPDIR "
        "to a directory of your own"
    )


def make_staging(parent: Path | None = None) -> Path:
    """A new staging directory owned by this process, in `parent` (else `staging_root()`)."""
    parent = staging_root() if parent is None else check_private(Path(parent))
    try:
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
    except OSError as exc:
        raise WbmergeError(
            f"cannot make a staging directory in {parent} ({exc.strerror or exc}); set "
            "TMPDIR to a directory with room for the merged runs"
        ) from None
    write_owner(path)
    return path


def write_owner(path: Path, uploader: list[int] | None = None) -> None:
    """Say that this process owns `path`, and which uploader processes it runs."""
    tree = [[pid, start_time(pid)] for pid in uploader or []]
    owner = {
        "pid": os.getpid(),
        "started": start_time(os.getpid()),
        "uid": os.geteuid(),
        "uploader": tree,
    }
    tmp = path / (OWNER + ".tmp")
    try:
        tmp.write_text(json.dumps(owner))
        tmp.replace(path / OWNER)
    except OSError as exc:  # (said: a killed sync's uploader could not be found again)
        raise WbmergeError(
            f"cannot write the staging directory {path} ({exc.strerror or exc}); set "
            "TMPDIR to a directory with room for the merged runs"
        ) from None


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
    """Remove the staging directories of dead owners (stopping their uploaders first), in
    `parent` (else `staging_root()`). An entry that is a link, another user's, or has no
    owner record of this user is left alone."""
    parent = staging_root() if parent is None else check_private(Path(parent))
    removed = []
    for path in sorted(parent.glob(PREFIX + "*")):
        owner = _owner_record(path)
        if owner is None or alive(owner["pid"], owner.get("started")):
            continue
        handles = _orphans(path, owner)
        for pid, handle in handles.items():
            try:  # an orphan of the dead owner, still sending
                if handle is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    signal.pidfd_send_signal(handle, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            finally:
                if handle is not None:
                    os.close(handle)
        orphans = set(handles)
        wait_gone(orphans)
        # What the dead sync's uploader sent last may still be landing on the server.
        note_stopped(None if orphans else _last_written(path))
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _owner_record(path: Path) -> dict | None:
    """The owner record in the staging directory `path` when this user wrote it, read
    without following a link; None (warned about when something is amiss) otherwise."""
    try:
        status = os.lstat(path)
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid():
            warnings.warn(
                f"{path} is not a staging directory of this user; left alone",
                InputWarning,
                stacklevel=3,
            )
            return None
        descriptor = os.open(path / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # gone, or no owner file yet (a sync that is starting)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.geteuid():
            return None
        with os.fdopen(os.dup(descriptor), "rb") as file:
            owner = json.loads(file.read(1 << 20))
        if owner["uid"] != os.geteuid() or not isinstance(owner["pid"], int):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not an owner record we wrote
    finally:
        os.close(descriptor)
    return owner


def _orphans(path: Path, owner: dict) -> dict[int, int | None]:
    """The processes of the dead owner's uploaders that still run, each with a pidfd to
    signal it by: each recorded one whose start time, user and command line still agree,
    and each wandb-core (it may have started after the last record) that works in `path`
    and was started by a recorded uploader. The pidfd is opened before the checks, so that
    a pid taken by another process after them cannot be signalled (a kernel before 5.3
    has no pidfds: None, and the pid is signalled)."""
    recorded = {}
    for entry in owner.get("uploader") or []:
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int):
            if entry[0] > 1 and isinstance(entry[1], str) and entry[1].isdigit():
                recorded[entry[0]] = entry[1]
    first = min((int(started) for started in recorded.values()), default=None)
    found = {}
    for pid in {*recorded, *working_in(path)}:
        try:
            handle: int | None = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                continue  # gone
            handle = None
        started = start_time(pid)
        if (
            started is not None
            and recorded.get(pid, started) == started  # (not a pid taken by a later process)
            and (pid in recorded or (first is not None and int(started) >= first))
            and user_ids(pid) == {os.geteuid()}
            and is_uploader(command_line(pid) or [], recorded)
        ):
            found[pid] = handle
        elif handle is not None:
            os.close(handle)
    return found


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

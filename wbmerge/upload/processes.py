"""What Linux says of a process, read from `/proc` in one place.

A sync names the uploader processes it runs by pid and start time (a pid alone may be
reused), and a later sync asks whether they still run, to stop the uploaders of a sync that
was killed. Each answer comes from `/proc/PID/stat`, whose fields after the command's name
(which may hold spaces and parentheses, hence the split at the last ")") are the state,
the parent's pid at 1, the kernel's flags at 6 and the start time at 19.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

_PF_EXITING = 0x4  # the kernel's flag of a task in its exit (`flags` in /proc/PID/stat)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name; None if the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, None if it is gone."""
    fields = stat_fields(pid)
    return fields[19] if fields else None


def command_line(pid: int) -> list[str] | None:
    """The process's arguments (/proc/PID/cmdline), None if it is gone or has none (a
    zombie, a kernel thread)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [arg.decode(errors="surrogateescape") for arg in raw.split(b"\0")[:-1]] or None


def user_ids(pid: int) -> set[int] | None:
    """The process's real, effective, saved and file-system user ids (the `Uid:` line of
    /proc/PID/status), None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return {int(uid) for uid in line.split()[1:]}
    return None


def alive(pid: int, started: str | None) -> bool:
    """Whether the process `pid` that started at `started` still runs. One that is exiting,
    or not yet reaped by its parent, does not: it stops nothing any more, and the locks of
    a killed sync are freed (or about to be: a sync that waited for them can get them
    before the killed one has become a zombie). Without /proc, a live pid is taken as it."""
    if started is not None and Path("/proc").is_dir():
        fields = stat_fields(pid)  # (one read: the start time and the state of one process)
        return fields is not None and fields[19] == started and not _exiting(fields)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exiting(fields: list[str]) -> bool:
    """Whether a process (its `stat_fields`) is a zombie, or on its way out."""
    if fields[0] in ("Z", "X"):
        return True
    return not fields[6].isdigit() or bool(int(fields[6]) & _PF_EXITING)


def descendants(root: int) -> list[int]:
    """Every process below `root`, before anything is killed: read from each process's
    lists of children, from `root` down (`/proc/PID/task/TID/children`, one a thread: a
    child is listed under the thread that started it), which costs the tree's size, not
    the machine's; where the kernel keeps no such lists, found in one walk of /proc
    (`walked_descendants`)."""
    if not Path(f"/proc/{root}/task/{root}/children").exists():
        return walked_descendants(root)  # (or `root` is gone: then none are found)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:  # (gone since its parent listed it)
            continue
        for thread in threads:
            try:
                children = Path(f"/proc/{pid}/task/{thread}/children").read_text().split()
            except OSError:
                continue
            found += map(int, children)
            todo += map(int, children)
    return found


def walked_descendants(root: int) -> list[int]:
    """Every process below `root`, found in one walk of /proc (the reference of
    `descendants`, and its way where the kernel keeps no lists of children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if fields := stat_fields(int(entry.name)):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def working_in(path: Path) -> list[int]:
    """Processes (other than this one) whose working directory lies in `path`: a dead
    sync's uploaders, which run in its staging, with the wandb-core each started."""
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


def lock_holders(path: Path) -> list[int]:
    """The processes (other than this one) that hold a lock on the file `path`, as
    /proc/locks names them (an open-file-description lock names no process)."""
    try:
        status = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return []
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    holders = []
    for line in locks.splitlines():
        fields = line.split()  # (`1: POSIX ADVISORY WRITE PID MAJ:MIN:INODE START END`)
        if len(fields) >= 6 and fields[5] == device and fields[4].isdigit():
            if int(fields[4]) != os.getpid() and int(fields[4]) not in holders:
                holders.append(int(fields[4]))
    return holders


def wait_gone(pids: Iterable[int], patience: float = 5.0) -> None:
    """Wait (at most `patience` seconds) until killed processes are gone or zombies, so that
    nothing they were sending can arrive after the next sync asked the server what it holds."""
    pids, deadline = list(pids), time.monotonic() + patience
    while time.monotonic() < deadline:
        states = [fields[0] for pid in pids if (fields := stat_fields(pid))]  # (the living)
        if all(state == "Z" for state in states):
            return
        time.sleep(0.02)

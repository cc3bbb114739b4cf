"""Saved files: what `wandb.save` (policies now, live and end) and `sync_tensorboard` put in
a run's `files/`, a symbolic link to the user's file, followed as plain `wandb sync` follows
it, but only where the user allows.

A link is followed only to a regular file under the directory the rank ran in (the `root`
of its environment record, which is wandb's `dir=` or the working directory) or under a
directory given with `--files-from`. The recorded root is untrusted like every byte of the
run, so it is taken only where the run was found in it: wandb writes a run to
`<root>/wandb/` (or `<root>/.wandb/`), so the root must be the run directory's
grandparent (real paths). A run that names another root (`/etc`, an ancestor such as the
home directory) allows nothing by it, and neither does a root whose real path is `/` (by
any spelling: `//`, `/..`, `/etc/..`), even for a run found at `/wandb/<run>`: it would
allow every file. A link whose file moved (a job's directory copied to
another machine, a fixture cloned elsewhere) is found again under a `--files-from`
directory at its path relative to the recorded root. Anything else is refused in one line
that names the file and the option, before anything is uploaded: a saved file either
arrives or the command fails.

Links are resolved (every link of a chain) before containment is checked, so a chain or a
`..` that leaves the allowed directories is refused, and the file is opened without
following a link again (`O_NOFOLLOW`), its type checked on the open file. Nothing under
/proc, /sys or /dev is read (`safepaths.in_system_tree`), not even under a `--files-from`
directory: `/proc/self/environ` is a regular file holding the sync's own credentials.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log import BLOCK_SIZE, pb, read_frames, record_kind
from ..safepaths import SYSTEM_TREES_TEXT, in_system_tree, is_within, on_system_device

_ROOT_SCAN_RECORDS = 2000  # wandb writes the environment record among a run's first records
_OPTION = "--files-from"


def recorded_root(log: Path) -> str | None:
    """The `root` of the first environment record of `log` that has one, else None. It is
    untrusted like everything in the file: `trusted_root` says whether it is taken."""
    try:
        count = 0
        for frames in read_frames(log, read_size=BLOCK_SIZE):
            for payload in frames.payloads():
                if record_kind(payload) == "environment":
                    root = pb.Record.FromString(payload).environment.root
                    if root:
                        return root if os.path.isabs(root) and "\x00" not in root else None
                count += 1
                if count > _ROOT_SCAN_RECORDS:
                    return None
    except (OSError, WbmergeError, ValueError, DecodeError):
        return None  # (a run that cannot say where it ran: only --files-from allows a link)
    return None


def trusted_root(root: str | None, run_dir: Path) -> Path | None:
    """The real path of the recorded `root` when the run directory `run_dir` lies where
    wandb writes a run that ran there (`<root>/wandb/<run>` or `<root>/.wandb/<run>`) and
    it is not `/`, else None: only then does the recorded root say where the rank ran
    rather than what a hostile file wants read. A root of `/` would allow every file."""
    if not root:
        return None
    real = os.path.realpath(root)
    if is_slash(real) or os.path.realpath(run_dir.parent.parent) != real:
        return None
    return Path(real)


def is_slash(root: str) -> bool:
    """Whether the recorded `root` is `/` by its real path or its text (`//`, `/..`)."""
    return os.path.normpath(root) in ("/", "//") or os.path.realpath(root) == "/"


def follow_link(
    entry: Path,
    name: str,
    label: str,
    root: str | None,
    files_from: Sequence[Path],
    run_dir: Path,
) -> Path:
    """The regular file the link `entry` (a run's `files/{name}`, of the run directory
    `run_dir` whose log recorded `root`) leads to, resolved; a WbmergeError naming the file
    and `--files-from` when it leads anywhere else."""
    try:
        raw = os.readlink(entry)
    except OSError as exc:
        raise WbmergeError(f"{entry}: cannot read ({exc.strerror or exc})") from None
    trusted = trusted_root(root, run_dir)
    allowed = ([trusted] if trusted else []) + [
        Path(os.path.realpath(directory)) for directory in files_from
    ]
    target = resolved_file(entry)
    if target is not None and in_system_tree(target):
        raise WbmergeError(
            f"{label}: saved file {name!r} links to {raw!r}, under {SYSTEM_TREES_TEXT}, "
            "whose files are never read"
        )
    if target is not None and any(is_within(target, base) for base in allowed):
        if is_regular_file(target):
            return target
        return _refuse(label, name, raw, "which is not a regular file", root, trusted is not None)
    moved = moved_file(raw, root, files_from)
    if moved is not None:
        return moved
    why = "which does not exist" if target is None else "outside the allowed directories"
    return _refuse(label, name, raw, why, root, trusted is not None)


def moved_file(raw: str, root: str | None, files_from: Sequence[Path]) -> Path | None:
    """The file a link to `raw` (an absolute path under the recorded `root`) names, found
    under a `--files-from` directory at the same path relative to the root; None if none."""
    if not root or not os.path.isabs(raw) or is_slash(root):
        return None
    lexical, base = os.path.normpath(raw), os.path.normpath(root)
    if not is_within(Path(lexical), Path(base)) or lexical == base:
        return None
    relative = os.path.relpath(lexical, base)
    for directory in files_from:
        candidate = resolved_file(Path(directory, relative))
        if (
            candidate is not None
            and is_within(candidate, Path(os.path.realpath(directory)))
            and not in_system_tree(candidate)
            and is_regular_file(candidate)
        ):
            return candidate
    return None


def resolved_file(path: Path) -> Path | None:
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, a loop, or no permission on the way
        return None


def is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _refuse(label: str, name: str, raw: str, why: str, root: str | None, trusted: bool) -> Path:
    places = f"the directory the rank ran in ({root}) or a {_OPTION} directory"
    if not root:
        places = f"a {_OPTION} directory (the run records no directory it ran in)"
    elif not trusted and is_slash(root):
        places = f"a {_OPTION} directory (the run says it ran in {root}, which is /: never taken)"
    elif not trusted:
        places = (
            f"a {_OPTION} directory (the run says it ran in {root}, which does not hold "
            "the run's directory)"
        )
    raise WbmergeError(
        f"{label}: saved file {name!r} links to {raw!r}, {why}; a link is followed only to a "
        f"regular file under {places}: add {_OPTION} DIR where the file is"
    )


@contextmanager
def open_regular(path: Path, name: str) -> Iterator[BinaryIO]:
    """The regular file `path`, open for reading: a link at `path` is not followed, and a
    FIFO put in its place since it was checked does not block the open (the type is
    checked on the open file). Anything else is a WbmergeError naming `name`."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise WbmergeError(f"{name}: cannot read {path} ({exc.strerror or exc})") from None
    with open(fd, "rb") as reader:
        status = os.fstat(reader.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise WbmergeError(f"{name}: {path} is no longer a regular file; not read")
        if on_system_device(status.st_dev):
            raise WbmergeError(f"{name}: {path} is a file of {SYSTEM_TREES_TEXT}; not read")
        yield reader


def copy_regular(source: Path, dest: Path, name: str) -> int:
    """Copy the regular file `source` (`open_regular`) to `dest` (created exclusively);
    returns the bytes copied."""
    with open_regular(source, name) as reader, open(dest, "xb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 20)
        return writer.tell()

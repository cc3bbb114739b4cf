"""Path safety: which names from a run may become paths, and where wbmerge may write.

Everything in a `.wandb` file is untrusted: a label, a run id or a `files` record's path can
be `../../x`, absolute, or hold a NUL or a newline. Such names become path components only
through these functions, so that nothing is written outside the output directory and
nothing is read outside the run directories the user named.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from .errors import WbmergeError

_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\x7f/\\]")
_MAX_COMPONENT_BYTES = 200  # below the 255 bytes most file systems allow per name


def component(text: str) -> str:
    """`text` made safe as one path component: separators, control characters and a
    leading dot become `_`, and it is cut to a length every file system accepts.

    Labels may be anything printable (W&B shows them as they are); only the directory
    name made from one is changed, and two different labels may meet in one name.
    """
    safe = _UNSAFE_CHARS.sub("_", text)
    if safe.startswith("."):
        safe = "_" + safe[1:]
    encoded = safe.encode("utf-8", "replace")[:_MAX_COMPONENT_BYTES]
    return encoded.decode("utf-8", "ignore") or "_"


def check_component(name: str, what: str) -> str:
    """Raise WbmergeError unless `name` can be used as one path component as it is."""
    if (
        not name
        or name in (".", "..")
        or _UNSAFE_CHARS.search(name)
        or len(name.encode("utf-8", "replace")) > _MAX_COMPONENT_BYTES
    ):
        raise WbmergeError(
            f"{what} {name!r} cannot name a directory (empty, '.' or '..', a separator or "
            f"control character, or over {_MAX_COMPONENT_BYTES} bytes)"
        )
    return name


def relative_file_name(name: str) -> bool:
    """Whether a `files` record's path stays inside the run's `files/` directory by its
    text alone: relative, without `..`, `.` or empty parts, separators or NULs."""
    if not name or "\x00" in name or "\\" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def is_within(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or lies below it (both already resolved)."""
    return path == root or root in path.parents


SYSTEM_TREES = ("/proc", "/sys", "/dev")
SYSTEM_TREES_TEXT = "/proc, /sys or /dev"


def in_system_tree(path: Path) -> bool:
    """Whether the resolved `path` lies under /proc, /sys or /dev. Their files are the
    kernel's (a process's environment, its memory, devices), never a run's, and are never
    read for one, whatever directory the user allows."""
    return any(is_within(path, Path(tree)) for tree in SYSTEM_TREES)


def on_system_device(device: int) -> bool:
    """Whether a file of the device number `device` (`st_dev` of an open file) lies on the
    file system mounted at /proc, /sys or /dev (where one is mounted there): a check on
    the open file, after its path was checked, that no link swapped since can pass."""
    try:
        top = os.stat("/").st_dev
    except OSError:
        top = None
    for tree in SYSTEM_TREES:
        try:
            mounted = os.stat(tree).st_dev
        except OSError:
            continue
        if mounted == device and mounted != top:
            return True
    return False


class Resolver:
    """`Path.resolve()` of many paths that share directories, each directory resolved once:
    a path is its directory's resolved path joined with its name, followed (by `resolve`)
    when that name is a symbolic link. A thousand runs of one job cost a thousand `lstat`s,
    not one per component of each path."""

    def __init__(self) -> None:
        self._dirs: dict[str, str] = {"/": "/"}

    def __call__(self, path: str | Path) -> Path:
        text = os.fspath(path)
        if not text.startswith("/"):  # (the working directory has no links: `getcwd`)
            text = os.path.join(os.getcwd(), text)
        return Path(self._resolved(text))

    def _resolved(self, path: str) -> str:
        found = self._dirs.get(path)
        if found is not None:
            return found
        head, name = os.path.split(path)
        if head == path:  # ("//", say)
            return str(Path(path).resolve())
        if name in ("", "."):  # (a trailing or doubled slash, `.`)
            found = self._resolved(head)
        elif name == "..":  # the parent of where the links before it lead
            found = os.path.dirname(self._resolved(head))
        else:
            joined = os.path.join(self._resolved(head), name)
            try:
                link = stat.S_ISLNK(os.lstat(joined).st_mode)
            except OSError:
                link = False  # (missing: taken as it is, as `resolve` takes it)
            found = str(Path(joined).resolve()) if link else joined
        self._dirs[path] = found
        return found


def source_trees(paths: Iterable[str | Path], run_files: Iterable[Path]) -> list[Path]:
    """The directories a merge reads: every named directory (a named file's directory)
    and every run directory, with symbolic links resolved."""
    resolve = Resolver()
    trees = []
    for raw in paths:
        path = resolve(raw)
        trees.append(path if path.is_dir() else path.parent)
    trees.extend(resolve(file).parent for file in run_files)
    return list(dict.fromkeys(trees))


def check_out_dir(out_dir: Path, trees: Iterable[Path], option: str = "--out") -> None:
    """Refuse an output directory that is, or lies inside, a directory the merge reads.

    Writing there would change the sources, and the merged runs would be found as sources
    by the next command. A source inside the output directory is fine: staged run
    directories are created exclusively, so none of them can replace a source.
    """
    out = out_dir.resolve()
    within = {out, *out.parents}  # (`is_within` of each of a thousand run directories)
    for tree in trees:
        if tree in within:
            raise WbmergeError(
                f"{option} {out_dir} is inside the source directory {tree}; "
                "choose a directory outside the runs being merged (sources are never written)"
            )


_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def check_out_file(out: Path, option: str) -> None:
    """Refuse an output file that exists and is not a regular file (a link, a FIFO, a
    device, a socket): the file written is renamed over it, and as root an export to
    /dev/full replaced the device with a regular file. A regular file is replaced whole."""
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise WbmergeError(f"{option} {out}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise WbmergeError(
            f"{option} {out} is {kind}; give the name of a new file or of a regular file to replace"
        )


def regular_file_inside(path: Path, root: Path) -> tuple[Path | None, str | None]:
    """`(file, None)` when `path` is a regular file, or a symbolic link to one, that
    resolves inside `root` (resolved); else `(None, why)`. Never opens the file."""
    try:
        target = path.resolve(strict=True)
        mode = os.stat(target).st_mode
    except (OSError, RuntimeError) as exc:  # dangling link, loop, or no permission
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return None, f"cannot be followed ({why})"
    if not is_within(target, root):
        return None, "points outside the run's files directory"
    if not stat.S_ISREG(mode):
        return None, "is not a regular file"
    return target, None

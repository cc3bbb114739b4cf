"""Staging a merged run's files: each source's `files/` copied into the staged run, and its
`files` records rewritten to name only what was staged.

Everything here treats the source as untrusted: only regular files inside a source's
`files/`, and the files its links lead to under the rules of `savedfiles`, are read, and a
`files` record path that would lead the uploader (which reads each path under the staged
run's `files/`) out of the run is left out with a warning.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import safepaths
from ..errors import WbmergeError
from ..log import pb
from ..plan import Source, Target
from .artifactfiles import check_artifact_files
from .savedfiles import copy_regular, follow_link, recorded_root

# wandb's own files of a run: in a shared run, the primary's alone are kept.
WANDB_FILES = {
    "requirements.txt",
    "wandb-metadata.json",
    "config.yaml",
    "wandb-summary.json",
    "diff.patch",
    "conda-environment.yaml",
    "wandb-job.json",
}


@dataclass
class StagedFiles:
    """What `stage_files` copied: (source, name) -> staged name of every entry, and the size
    of each saved file (a link `wandb.save` made, followed) by its staged name, as read from
    the source: the files the upload must leave on the server."""

    names: dict[tuple[Path, str], str] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)


def stage_files(
    target: Target, dest: Path, warnings: list[str], files_from: Sequence[Path] = ()
) -> StagedFiles:
    """Copy every source's `files/` into `dest`.

    The primary's files are kept as they are. Of other ranks (shared mode), wandb's own
    files are the primary's business and skipped; their media and user files are kept, and
    one whose name is taken by different content moves to `{label}/{name}` (the label made
    safe as a directory name). A regular file inside the source's `files/` is copied, and
    so is the file a link leads to under the rules of `savedfiles` (the directory the rank
    ran in, or `files_from`); any other entry (a link elsewhere, dangling or to a
    directory, a FIFO, a device) is a WbmergeError naming it, as is one that cannot be read.
    """
    staged = StagedFiles()
    moved: list[str] = []
    for source, name, readable, linked in _entries(target, files_from):
        staged_name = name
        existing = dest / name
        if existing.exists() and not _same_file(existing, readable):
            staged_name = f"{safepaths.component(source.label)}/{name}"
            moved.append(staged_name)
        staged.names[(source.path, name)] = staged_name
        target_path = dest / staged_name
        if target_path.exists():
            size = target_path.stat().st_size  # (the same bytes, from another rank)
        else:
            target_path.parent.mkdir(parents=True, exist_ok=True)
            size = copy_regular(readable, target_path, f"{source.label}: file {name!r}")
        if linked and name not in WANDB_FILES:
            staged.saved[staged_name] = size
    if moved:
        warnings.append(moved_files_notice(moved))
    return staged


def moved_files_notice(moved: Sequence[str]) -> str:
    """One line for every file of a shared run kept under its rank's label because another
    rank wrote different content under its name (`moved`: the staged names). Shared mode
    always does this (two ranks that each save `model.pt`), so it is said once, however
    many files and ranks, not once a file. Example: ["rank-1/model.pt", "rank-2/model.pt"]
    gives "2 files also written by another rank kept under their rank's label:
    rank-1/model.pt, rank-2/model.pt"."""
    shown = ", ".join(moved[:MOVED_SHOWN])
    more = f" and {len(moved) - MOVED_SHOWN} more" if len(moved) > MOVED_SHOWN else ""
    files = "1 file" if len(moved) == 1 else f"{len(moved)} files"
    return f"{files} also written by another rank kept under their rank's label: {shown}{more}"


MOVED_SHOWN = 4  # staged names a notice of moved files lists (a line at 1024 ranks too)


def files_from_dirs(paths: Sequence[str | Path] | str | Path) -> tuple[Path, ...]:
    """The `--files-from` directories (one path, or several), each checked to be one (a
    mistyped directory would otherwise show only as a saved file not found)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    for path in paths:
        if not Path(path).is_dir():
            raise WbmergeError(f"--files-from {path}: not a directory")
    return tuple(Path(path) for path in paths)


def check_files(targets: Iterable[Target], files_from: Sequence[Path] = ()) -> None:
    """Raise the WbmergeError `stage_files` would raise for an entry of the targets'
    sources (a link out of the allowed directories: `savedfiles`), and the merge for a
    file of their artifacts (`artifactfiles`), without copying anything: a merge or sync
    says it before any run is written or uploaded. The saved files of runs merged already
    (`merged` targets) are copies, and are not looked at."""
    targets = list(targets)
    for target in targets:
        if target.kind != "merged":
            for _ in _entries(target, files_from):
                pass
    check_artifact_files(targets, files_from)


def _entries(
    target: Target, files_from: Sequence[Path]
) -> Iterator[tuple[Source, str, Path, bool]]:
    """(source, name, the regular file to read, whether it was a link) of every entry of
    the sources' `files/` that the staged run takes."""
    resolve = safepaths.Resolver()  # (the sources share their job's directories)
    for source in target.sources:
        files = source.path.parent / "files"
        if not files.is_dir() or files.is_symlink():
            continue
        root = resolve(files)
        primary = source.rank.rank == target.primary_rank
        recorded: list[str | None] = []  # the run's root, read when a link needs it
        for path, name in _file_entries(files):
            if name.startswith("output") and name.endswith(".log"):
                continue  # rebuilt by the uploader from the console records
            if (
                not primary
                and target.kind == "shared"
                and (name in WANDB_FILES or name.startswith("code/"))
            ):
                continue
            yield source, name, *_readable(path, name, source, root, files_from, recorded)


def _readable(
    path: Path,
    name: str,
    source: Source,
    root: Path,
    files_from: Sequence[Path],
    recorded: list[str | None],
) -> tuple[Path, bool]:
    """The regular file to copy for the entry `path` of a source's `files/` (resolved root
    `root`), and whether it was a link; a WbmergeError for an entry that may not be read."""
    try:
        mode = path.lstat().st_mode
    except OSError as exc:
        raise WbmergeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISREG(mode):
        return path, False
    if not stat.S_ISLNK(mode):
        raise WbmergeError(
            f"{source.label}: file {name!r} of {source.path.parent} is not a regular file "
            "(a FIFO, socket or device); it is never read"
        )
    inside, _ = safepaths.regular_file_inside(path, root)
    if inside is not None:  # (a link to another file of the run)
        return inside, True
    if not recorded:
        recorded.append(recorded_root(source.path))
    return follow_link(path, name, source.label, recorded[0], files_from, source.path.parent), True


def _file_entries(files: Path) -> Iterator[tuple[Path, str]]:
    """Every entry below `files` that is not a directory, as (path, name relative to
    `files`), in a stable order; a link to a directory is an entry, never walked into."""

    def unreadable(exc: OSError) -> None:
        raise WbmergeError(f"{exc.filename}: cannot read ({exc.strerror or exc})")

    for dirpath, dirnames, filenames in os.walk(files, onerror=unreadable):
        here = Path(dirpath)
        links = [d for d in dirnames if (here / d).is_symlink()]
        dirnames[:] = sorted(d for d in dirnames if d not in links)
        for name in sorted([*filenames, *links]):
            path = here / name
            yield path, path.relative_to(files).as_posix()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except OSError as exc:
        raise WbmergeError(f"{exc.filename}: cannot read ({exc.strerror or exc})") from None


def files_record(
    payload: bytes,
    source: Source,
    warnings: list[str],
    staged: Mapping[tuple[Path, str], str] | None = None,
) -> bytes:
    """A source's `files` record as the staged run may carry it.

    Shared mode passes `staged` ((source, name) -> staged name): each path becomes its
    staged name and a path not staged is left out (warned about when it leads out of the
    run). Pass-through passes none: names stay, and a path that leads out of the run by its
    text (absolute, `..`) is left out with a warning. (Every entry of a run's `files/` is
    staged or refused before: `stage_files`.) The bytes come back unchanged when nothing
    changes.
    """
    record = pb.Record.FromString(payload)
    kept, changed = [], False
    for item in record.files.files:
        safe = safepaths.relative_file_name(item.path)
        if staged is not None:
            name = staged.get((source.path, item.path))
        else:
            name = item.path if safe else None
        if name is None:
            changed = True
            if staged is None or not safe:
                warnings.append(f"{source.label}: files record path {item.path!r} left out")
            continue
        changed = changed or name != item.path
        item.path = name
        kept.append(item)
    if not changed:
        return payload
    del record.files.files[:]
    record.files.files.extend(kept)
    return record.SerializeToString()

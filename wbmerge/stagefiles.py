"""Staging a merged run's files: each source's `files/` copied into the staged run, and its
`files` records rewritten to name only what was staged.

Everything here treats the source as untrusted: only regular files inside a source's
`files/` are read, and a `files` record path that would lead the uploader (which reads each
path under the staged run's `files/`) out of the run is left out with a warning.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from . import safepaths
from .errors import WbmergeError
from .plan import Source, Target
from .proto import pb

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


def stage_files(
    target: Target, dest: Path, warnings: list[str]
) -> tuple[dict[tuple[Path, str], str], set[tuple[Path, str]]]:
    """Copy every source's `files/` into `dest`; returns (source, name) -> staged name, and
    the (source, name) entries refused.

    The primary's files are kept as they are. Of other ranks (shared mode), wandb's own
    files are the primary's business and skipped; their media and user files are kept, and
    one whose name is taken by different content moves to `{label}/{name}` (the label made
    safe as a directory name). Only regular files inside the source's `files/` directory are
    read: a symbolic link that leads out of it, a dangling link or a link loop, a FIFO or a
    device is refused with a warning; an entry that cannot be read is an error naming it.
    """
    mapping: dict[tuple[Path, str], str] = {}
    refused: set[tuple[Path, str]] = set()
    for source in target.sources:
        files = source.path.parent / "files"
        if not files.is_dir() or files.is_symlink():
            continue
        root = files.resolve()
        primary = source.rank.rank == target.primary_rank
        for path, name in _file_entries(files, source.label, warnings):
            if name.startswith("output") and name.endswith(".log"):
                continue  # rebuilt by the uploader from the console records
            if (
                not primary
                and target.kind == "shared"
                and (name in WANDB_FILES or name.startswith("code/"))
            ):
                continue
            readable, why = safepaths.regular_file_inside(path, root)
            if readable is None:
                refused.add((source.path, name))
                warnings.append(f"{source.label}: file {name!r} {why}; not copied")
                continue
            staged_name = name
            existing = dest / name
            if existing.exists() and not _same_file(existing, readable):
                staged_name = f"{safepaths.component(source.label)}/{name}"
                warnings.append(
                    f"{source.label}: file {name} also written by another rank; kept as {staged_name}"
                )
            mapping[(source.path, name)] = staged_name
            target_path = dest / staged_name
            if not target_path.exists():
                target_path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    shutil.copyfile(readable, target_path)
                except OSError as exc:
                    raise WbmergeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return mapping, refused


def _file_entries(files: Path, label: str, warnings: list[str]) -> Iterator[tuple[Path, str]]:
    """Every entry below `files` that is not a directory, as (path, name relative to
    `files`), in a stable order; links to directories are not followed (warned about)."""

    def unreadable(exc: OSError) -> None:
        raise WbmergeError(f"{exc.filename}: cannot read ({exc.strerror or exc})")

    for dirpath, dirnames, filenames in os.walk(files, onerror=unreadable):
        here = Path(dirpath)
        for name in sorted(dirnames):
            if (here / name).is_symlink():
                relative = (here / name).relative_to(files).as_posix()
                warnings.append(f"{label}: {relative!r} is a link to a directory; not followed")
        dirnames[:] = sorted(d for d in dirnames if not (here / d).is_symlink())
        for name in sorted(filenames):
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
    refused: frozenset | set = frozenset(),
) -> bytes:
    """A source's `files` record as the staged run may carry it.

    Shared mode passes `staged` ((source, name) -> staged name): each path becomes its
    staged name and a path not staged is left out (warned about when it leads out of the
    run; a refused file was warned about when staging). Pass-through passes the `refused`
    entries instead: names stay, and unsafe or refused paths are left out with a warning.
    The bytes come back unchanged when nothing changes.
    """
    record = pb.Record.FromString(payload)
    kept, changed = [], False
    for item in record.files.files:
        safe = safepaths.relative_file_name(item.path)
        if staged is not None:
            name = staged.get((source.path, item.path))
        else:
            name = item.path if safe and (source.path, item.path) not in refused else None
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

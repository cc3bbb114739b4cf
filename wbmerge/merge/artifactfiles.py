"""The files of a rank's artifacts: found where the rank left them, only where the user
allows, and copied into the staged run, so that the upload reads copies.

An artifact's manifest names each file by an absolute `local_path`: a copy wandb made in
its artifact staging directory (`$WANDB_DATA_DIR/artifacts/staging/`, by default under
the home directory) or, with the `immutable` policy, the user's own file. wandb's uploader
reads whatever path a record names, so a hostile `.wandb` file could make it upload any
file the user can read; and a path names the machine the rank ran on, not the one the run
was copied to. A file is therefore read only from these directories (real paths):

- the rank's own run directory (where `wbmerge.init` keeps the rank's artifact staging);
- the directory the rank ran in (its environment record's `root`, taken only where the
  run was found in it and it is not `/`, as for saved files: `savedfiles.trusted_root`);
- a directory given with `--files-from` (for wandb's default data directory, e.g.
  `--files-from ~/.local/share/wandb`).

A run directory that was copied elsewhere (a Flyte hand-off, rsync, a `merge --out`
directory moved) is followed: a path inside a directory of the run directory's name is read
at the same place inside the run directory as it is now, and a path under the recorded root is found again under a `--files-from` directory at
the same relative path (`savedfiles.moved_file`). Nothing under /proc, /sys or /dev
is read, whatever directory allows it. A file that is gone, outside these directories,
not a regular file, or whose bytes are no longer those the manifest's digest
names, is a WbmergeError naming the artifact and the path: the sync fails before the run
is uploaded, never with a warning. An entry's digest is checked with the algorithm wandb
made it with (its `alg` tag: MD5, or XXH128 for `digest_algorithm="XXH128"`).

Beyond 100000 entries wandb writes an artifact's manifest to a file of its own in its
artifact staging directory (`artifact_manifests/*.manifest_contents.jl.gz`, named by the
record's `manifest_file_path`), which wandb-core deletes once it has read it. That file is
found under the same rules, and read as untrusted input (`manifest_file_entries`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log import ReadReport, pb, records
from ..plan import Source, Target
from ..safepaths import SYSTEM_TREES_TEXT, in_system_tree, is_within
from .savedfiles import (
    is_regular_file,
    moved_file,
    open_regular,
    recorded_root,
    resolved_file,
    trusted_root,
)

_OPTION = "--files-from"
MANIFEST_FILE = "(its manifest file)"  # how a manifest file of its own is named in errors


@dataclass(frozen=True)
class LoggedArtifact:
    """An artifact a staged run must leave committed on the server, as the rank logged it:
    its name (as the merge files it), its digest (None where the manifest's digests are
    not MD5s: wandb's uploader may then hash it again), and each file's path, size and MD5
    (base64), read from where the rank left the file."""

    name: str
    digest: str | None
    files: tuple[tuple[str, int, str], ...]
    # Every entry of its manifest, references too: as many files as the server lists of it
    # (beyond 100000 in a manifest that wandb wrote to a file of its own). How far to read
    # the server's listing, not what the artifact is: not compared.
    entries: int = field(default=0, compare=False)


_PLACES = (
    f"an artifact's files are read only under the rank's run directory, the directory it "
    f"ran in, or a {_OPTION} directory"
)


class ArtifactFileFinder:
    """Where the files of one source's artifacts may be read (see the module's rules)."""

    def __init__(self, source: Source, files_from: Sequence[Path]) -> None:
        self.source = source
        self.run_dir = source.path.parent
        self.root = recorded_root(source.path)
        self.files_from = tuple(files_from)
        allowed = [Path(os.path.realpath(place)) for place in [self.run_dir, *self.files_from]]
        trusted = trusted_root(self.root, self.run_dir)
        self.allowed = allowed + ([trusted] if trusted else [])

    def find(self, raw: str, artifact: str, name: str) -> Path:
        """The regular file that the manifest entry `name` of `artifact` reads from `raw`
        (its `local_path`); a WbmergeError naming them when it may not be read."""
        where = f"{self.source.label}: artifact {artifact!r} file {name!r} ({raw!r})"
        if not raw or "\x00" in raw or not os.path.isabs(raw):
            raise WbmergeError(f"{where}: not an absolute path; it cannot be read")
        found = resolved_file(Path(raw))
        if found is not None and in_system_tree(found):
            raise WbmergeError(f"{where}: under {SYSTEM_TREES_TEXT}, whose files are never read")
        if found is not None and any(is_within(found, base) for base in self.allowed):
            if is_regular_file(found):
                return found
            raise WbmergeError(f"{where}: not a regular file; it is not read")
        for candidate in (self._in_moved_run(raw), moved_file(raw, self.root, self.files_from)):
            if candidate is not None:
                return candidate
        why = "does not exist" if found is None else "lies outside the allowed directories"
        raise WbmergeError(f"{where}: {why}; {_PLACES}: add {_OPTION} DIR where the file is")

    def _in_moved_run(self, raw: str) -> Path | None:
        """The file `raw` names inside the run directory where it was written (a path
        holding the run directory's name), read at the same place inside the run
        directory as it is now: a rank's run, or a merged one, copied elsewhere. Only a
        regular file inside the run directory is taken."""
        parts = Path(os.path.normpath(raw)).parts
        folders = parts[:-1]
        if self.run_dir.name not in folders:
            return None
        at = len(folders) - 1 - folders[::-1].index(self.run_dir.name)  # (the last one)
        candidate = resolved_file(self.run_dir.joinpath(*parts[at + 1 :]))
        base = Path(os.path.realpath(self.run_dir))
        if (
            candidate
            and is_within(candidate, base)
            and not in_system_tree(candidate)
            and is_regular_file(candidate)
        ):
            return candidate
        return None


# The longest line of one entry read from a manifest file (a path, a digest, a local path
# and a few small fields: some KB at most); a longer one is not a manifest wandb wrote.
MAX_MANIFEST_LINE = 1 << 20
_MANIFEST_ERRORS = (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError, RecursionError)


def manifest_file_entries(path: Path, what: str) -> Iterator[dict]:
    """The entries of a manifest that wandb wrote to a file of its own (beyond 100000
    entries: `manifest_file_path`, read by wandb-core's `ManifestContentsFromFile`): a
    gzip file of one JSON object a line, each with a string `path` and `digest`, and
    maybe `size`, `local_path`, `ref`, `extra`. The regular file `path` is opened without
    following a link at it, and read a line at a time (memory bounded by the longest
    line, however many entries); anything else is a WbmergeError naming `what`."""
    with open_regular(path, what) as raw:
        number = 0
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as lines:
                while line := lines.readline(MAX_MANIFEST_LINE + 1):
                    number += 1
                    if len(line) > MAX_MANIFEST_LINE:
                        raise ValueError(f"line {number} is longer than {MAX_MANIFEST_LINE}")
                    if line.strip():
                        yield _manifest_entry(json.loads(line), number)
        except _MANIFEST_ERRORS as exc:
            raise WbmergeError(
                f"{what}: {path} is not a manifest file as wandb writes one ({exc})"
            ) from None


def _manifest_entry(entry: object, number: int) -> dict:
    """One line of a manifest file, checked for the fields wandb-core reads."""
    if not isinstance(entry, dict):
        raise ValueError(f"line {number} is not a JSON object")
    if not isinstance(entry.get("path"), str) or not isinstance(entry.get("digest"), str):
        raise ValueError(f"line {number} lacks a string path or digest")
    size = entry.get("size", 0)
    if isinstance(size, bool) or not isinstance(size, int | float) or size < 0:
        raise ValueError(f"line {number}: the size is not a count of bytes")
    if not isinstance(entry.get("local_path", ""), str):
        raise ValueError(f"line {number}: the local path is not a string")
    return entry


def check_artifact_files(targets: Iterable[Target], files_from: Sequence[Path] = ()) -> None:
    """Raise the WbmergeError the merge would raise for a file of an artifact of the
    targets' sources (gone, or where it may not be read), without copying anything: a
    merge or sync says it before any run is written or uploaded. Reads only the kinds of
    the sources' records, and parses their artifact records."""
    for target in targets:
        for source in target.sources:
            finder: ArtifactFileFinder | None = None
            for read in records.read_indexed(source.path, ReadReport()):
                for index in read.of("artifact").tolist():
                    try:
                        artifact = pb.Record.FromString(read.frames.payload(index)).artifact
                    except (DecodeError, RecursionError):
                        continue  # (said where the merge reads it)
                    finder = finder or ArtifactFileFinder(source, files_from)
                    for path, local_path in manifest_local_paths(artifact, finder, source):
                        finder.find(local_path, artifact.name, path)


def manifest_local_paths(
    artifact: pb.ArtifactRecord, finder: ArtifactFileFinder, source: Source
) -> Iterator[tuple[str, str]]:
    """(path, local path) of each entry of an artifact's manifest that names a file to
    upload, whether the record holds the manifest or names a file of its own."""
    for entry in artifact.manifest.contents:
        if entry.local_path:
            yield entry.path, entry.local_path
    if artifact.manifest.manifest_file_path:
        found = finder.find(artifact.manifest.manifest_file_path, artifact.name, MANIFEST_FILE)
        what = f"{source.label}: artifact {artifact.name!r} manifest file"
        for entry in manifest_file_entries(found, what):
            if entry.get("local_path"):
                yield entry["path"], entry["local_path"]


def changed_since_logged(what: str, found: Path, why: str = "its size") -> WbmergeError:
    return WbmergeError(
        f"{what}: {found} is no longer the file the rank logged ({why} differs from the manifest's)"
    )


# The digest algorithms of a manifest entry, by the name its `alg` tag gives (wandb's
# `DIGEST_ALGORITHM_EXTRA_KEY`; an entry without the tag is MD5, as wandb reads it).
MD5 = "MD5"
XXH128 = "XXH128"


def entry_digest_algorithm(tag: object, what: str) -> str:
    """The algorithm of an entry's digest from its `alg` tag (None: untagged, MD5), as
    wandb's `ArtifactManifestEntry.digest_algorithm` reads it, except that a tag naming
    another algorithm is a WbmergeError: its digest could not be checked."""
    if tag is None or tag == MD5:
        return MD5
    if tag == XXH128:
        return XXH128
    raise WbmergeError(f"{what}: its digest algorithm {tag!r} is not one wbmerge can check")


def copy_and_hash(source: Path, dest: Path, what: str, size: int = 0) -> tuple[int, dict[str, str]]:
    """Copy the regular file `source` (`savedfiles.open_regular`) to `dest` (created
    exclusively); returns its size and its digests by algorithm (base64, as a manifest
    writes them): MD5, and XXH128 (as wandb's `xxh128_file_b64`). With the `size` a
    manifest gives (0: none), a file of another size is refused before a byte is copied
    (a sparse file of gigabytes named by an entry of ten bytes), and one that grows while
    it is copied is refused one byte past it."""
    md5 = hashlib.md5()
    xxh128 = xxhash.xxh128()
    with open_regular(source, what) as reader:
        if size and os.fstat(reader.fileno()).st_size != size:
            raise changed_since_logged(what, source)
        left = size + 1 if size else -1  # (-1: to the end)
        with open(dest, "xb") as writer:
            while left and (chunk := reader.read(1 << 20 if left < 0 else min(left, 1 << 20))):
                md5.update(chunk)
                xxh128.update(chunk)
                writer.write(chunk)
                left -= len(chunk) if left > 0 else 0
            copied = writer.tell()
    if size and copied != size:
        raise changed_since_logged(what, source)
    digests = {MD5: md5.digest(), XXH128: xxh128.digest()}
    return copied, {name: base64.b64encode(value).decode() for name, value in digests.items()}

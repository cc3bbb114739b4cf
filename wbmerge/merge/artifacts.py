"""The artifact records of a staged run, filed under the run the merge uploads.

wandb's uploader creates an artifact under the run id, project and entity written in its
`ArtifactRecord` (wandb-core's `ArtifactSaver`, not the run it is syncing: `wandb sync -p`
and `--id` do not reach artifacts). A rank's records name the rank's offline run, so
copied as they are they would make a run under that id beside the uploaded one. Each
record is rewritten here to name the target run, the project the merge uploads to (when
one is chosen) and its entity (none: the server's default, as the run's own upload).

A `run_table` artifact (the files of a logged `wandb.Table`) is named by wandb after the
run that logged it, `run-{run id}-{key}`; it is renamed after the target run, as a
one-rank online run would name it. In shared mode every rank's artifacts go to the merged
run, as W&B's online shared mode files them: the same name from two ranks makes two
versions of one artifact. A `use_artifact` record names no run (only the artifact), and
is copied as it is.

Every file a manifest names is copied into the staged run (`artifacts/{n}/{m}`, names of
wbmerge's own making) from where the rank left it, under the rules of `artifactfiles`, and
the manifest points at the copy: the uploader reads and may delete only copies, never the
user's files, and a later sync copies them again. Its size and digest (MD5 or XXH128, as
the entry's `alg` tag says) are checked against the manifest as it is copied (its size
before a byte is copied): wandb's uploader hashes an XXH128 entry's file again with MD5
before it sends it (measured with wandb-core 0.31), so nothing after the merge would
notice bytes changed since logging. A manifest that wandb wrote to a file of its own (beyond
100000 entries) is copied the same way, a line at a time, to `artifacts/{n}/manifest.jl.gz`,
and the record names the copy: wandb-core deletes the manifest file once it has read it.
"""

from __future__ import annotations

import gzip
import json
from json import JSONDecodeError
from pathlib import Path

from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log import pb
from ..plan import Source, Target
from .artifactfiles import (
    MANIFEST_FILE,
    MD5,
    ArtifactFileFinder,
    LoggedArtifact,
    changed_since_logged,
    copy_and_hash,
    entry_digest_algorithm,
    manifest_file_entries,
)
from .options import MergeOptions

MAX_ARTIFACT_NAME = 128  # W&B's limit on an artifact's name
_MD5_DIGESTS = ("", "MANIFEST_MD5")  # manifests whose digest is an MD5 of MD5 entries
_ALGORITHM_TAG = "alg"  # the key of an entry's extra field naming its digest algorithm


class ArtifactRecords:
    """Rewrites the artifact records of one target's sources (`rewrite`), their files
    copied under `dest` (inside the staged run)."""

    def __init__(self, target: Target, options: MergeOptions, dest: Path) -> None:
        self.target = target
        self.options = options
        self.dest = dest
        self.finders: dict[Path, ArtifactFileFinder] = {}
        self.copies: dict[Path, tuple[Path, int, dict[str, str]]] = {}  # read -> (copy,
        # size, digests by algorithm)
        self.count = 0  # artifact records rewritten
        self.whole: list[LoggedArtifact] = []  # committed each by its own record
        self.parts: dict[tuple[str, str], list[tuple[str, int, str]]] = {}  # distributed
        self.part_entries: dict[tuple[str, str], int] = {}  # their manifests' entries
        self.finished: list[tuple[str, str]] = []  # distributed artifacts committed

    def rewrite(self, payload: bytes, source: Source) -> bytes:
        """The artifact record `payload` of `source` as the target run's."""
        try:
            record = pb.Record.FromString(payload)
        except (DecodeError, RecursionError):
            raise WbmergeError(
                f"{source.label}: an artifact record of {source.path} cannot be read"
            ) from None
        artifact = record.artifact
        artifact.run_id = self.target.id
        if self.options.project:
            artifact.project = self.options.project
        artifact.entity = self.options.entity or ""
        own_prefix = f"run-{source.run_id}-"
        if artifact.type == "run_table" and artifact.name.startswith(own_prefix):
            renamed = f"run-{self.target.id}-{artifact.name[len(own_prefix) :]}"
            if len(renamed) <= MAX_ARTIFACT_NAME:
                artifact.name = renamed
        self._copy_files(artifact, source)
        return record.SerializeToString()

    def _copy_files(self, artifact: pb.ArtifactRecord, source: Source) -> None:
        """Copy every file the manifest of `artifact` names, and point it at the copy."""
        label = source.label
        finder = self.finders.get(source.path)
        if finder is None:
            finder = self.finders[source.path] = ArtifactFileFinder(source, self.options.files_from)
        self.count += 1
        files = []
        for index, entry in enumerate(artifact.manifest.contents):
            if not entry.local_path:
                continue  # a reference: the uploader reads nothing
            tags = [extra.value_json for extra in entry.extra if extra.key == _ALGORITHM_TAG]
            copy, size, md5 = self._take(
                finder,
                artifact.name,
                label,
                entry.path,
                entry.local_path,
                index,
                entry.size,
                entry.digest,
                _tagged(tags),
            )
            entry.local_path = str(copy)
            files.append((entry.path, size, md5))
        entries = len(artifact.manifest.contents)
        if artifact.manifest.manifest_file_path:
            in_file = self._copy_manifest_file(artifact, finder, label)
            files += in_file.files
            entries += in_file.entries
        if artifact.distributed_id:
            # A part of a distributed artifact (`upsert_artifact`, from any rank); the one
            # `finish_artifact` record commits them all, under a digest no record holds.
            key = (artifact.name, artifact.distributed_id)
            self.parts.setdefault(key, []).extend(files)
            self.part_entries[key] = self.part_entries.get(key, 0) + entries
            if artifact.finalize:
                self.finished.append(key)
        elif artifact.finalize:
            whole = artifact.digest_algorithm in _MD5_DIGESTS and not artifact.incremental_beta1
            digest = artifact.digest if whole else None
            self.whole.append(LoggedArtifact(artifact.name, digest, tuple(files), entries))

    @property
    def logged(self) -> list[LoggedArtifact]:
        """The artifacts the records commit, as the sources logged them: what the upload
        must leave on the server. A distributed artifact is one, holding every part's
        files, once the merge has read its `finish_artifact` record."""
        distributed = [
            LoggedArtifact(
                name,
                None,
                tuple(dict.fromkeys(self.parts[(name, key)])),
                self.part_entries[(name, key)],
            )
            for name, key in dict.fromkeys(self.finished)
        ]
        return self.whole + distributed

    def _take(
        self,
        finder: ArtifactFileFinder,
        artifact: str,
        label: str,
        path: str,
        local_path: str,
        index: int,
        size: int,
        digest: str,
        tag: object,
    ) -> tuple[Path, int, str]:
        """The copy of the file a manifest entry names (`local_path`), made once, checked
        against the entry's `size` (0: not given) and `digest`, made with the algorithm its
        `alg` tag names (None: untagged, MD5). Returns the copy, its size and MD5."""
        found = finder.find(local_path, artifact, path)
        what = f"{label}: artifact {artifact!r} file {path!r}"
        algorithm = entry_digest_algorithm(tag, what)
        copied = self.copies.get(found) or self._copy(found, index, what, size)
        copy, copied_size, digests = copied
        if size and copied_size != size:
            raise changed_since_logged(what, found)
        if digests[algorithm] != digest:
            raise changed_since_logged(what, found, f"its {algorithm} digest")
        return copy, copied_size, digests[MD5]

    def _copy_manifest_file(
        self, artifact: pb.ArtifactRecord, finder: ArtifactFileFinder, label: str
    ) -> LoggedArtifact:
        """Copy a manifest that wandb wrote to a file of its own (beyond 100000 entries)
        into the staged run, each entry's file copied and the entry pointing at the copy,
        and point the record at the copied manifest: wandb-core deletes the manifest file
        it reads, which must never be the rank's. Returns its entries: (path, size, MD5) of
        each file, and how many entries it holds, references too."""
        found = finder.find(artifact.manifest.manifest_file_path, artifact.name, MANIFEST_FILE)
        what = f"{label}: artifact {artifact.name!r} manifest file"
        directory = self.dest / str(self.count)
        directory.mkdir(parents=True, exist_ok=True)
        staged = directory / "manifest.jl.gz"
        files = []
        with (
            open(staged, "xb") as out,
            gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as zipped,
        ):
            for index, entry in enumerate(manifest_file_entries(found, what)):
                if entry.get("local_path"):
                    at = len(artifact.manifest.contents) + index
                    extra = entry.get("extra")
                    tag = extra.get(_ALGORITHM_TAG) if isinstance(extra, dict) else None
                    copy, size, md5 = self._take(
                        finder,
                        artifact.name,
                        label,
                        entry["path"],
                        entry["local_path"],
                        at,
                        int(entry.get("size") or 0),
                        entry["digest"],
                        tag,
                    )
                    entry["local_path"] = str(copy)
                    files.append((entry["path"], size, md5))
                zipped.write(json.dumps(entry).encode() + b"\n")
        artifact.manifest.manifest_file_path = str(staged.resolve())
        return LoggedArtifact(artifact.name, None, tuple(files), index + 1)

    def _copy(
        self, found: Path, index: int, what: str, size: int
    ) -> tuple[Path, int, dict[str, str]]:
        """The copy of `found`, refused unless it has the entry's `size` (0: not given)."""
        directory = self.dest / str(self.count)
        directory.mkdir(parents=True, exist_ok=True)
        copy = directory / str(index)
        copied, digests = copy_and_hash(found, copy, what, size)
        self.copies[found] = (copy.resolve(), copied, digests)
        return self.copies[found]


def _tagged(tags: list[str]) -> object:
    """The algorithm an entry's `alg` tags name (their JSON value); None when untagged.
    Tags that disagree, or one that is not JSON, are returned as they are, so that they
    are refused by name."""
    if not tags:
        return None
    if len(set(tags)) > 1:
        return tags
    try:
        return json.loads(tags[0])
    except (JSONDecodeError, RecursionError):
        return tags[0]

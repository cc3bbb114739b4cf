"""Artifacts in the sink: versions of a (name, type) in a project, their manifests, files,
aliases and which runs logged and used them, in SQLite beside the runs.

wandb-core 0.31 saves an artifact so (measured): `CreateArtifact` (a pending version, or
the existing one when a version of the same name has the same digest), `CreateArtifactManifest`
without an upload, `CreateArtifactFiles` (an upload URL per file, each named with the MD5
the manifest gives it), a PUT of every file, `CreateArtifactManifest` again with the
manifest's upload URL, a PUT of the manifest, `CommitArtifact`, and `UseArtifact` for a
run that used one. What the sink checks on the way, so that a committed version is one
whose every byte arrived as the manifest says:

- a file PUT is refused (nothing stored) unless its MD5 is the one declared for its path;
- the manifest must have W&B's form, and its digest (MD5 over `path:digest` lines, as
  wandb computes it) must be the digest the version was created with;
- a version is COMMITTED only when its manifest arrived and every file of it (all but
  references to other artifacts) arrived with the manifest's digest and size.

Files are kept by their MD5 (hex) under `artifacts/` in the data directory: no name from a
request becomes a path, and a file that several versions share is kept once. Version
numbers are given at commit, one after the highest of the name; `latest` is never stored,
it is always the highest committed version.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import hashlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import values
from .access import write_replacing
from .artifact_values import (
    VERSION,
    ArtifactError,
    check_aliases,
    check_client_id,
    manifest_digest,
    manifest_entries,
    md5_base64,
)
from .names import check_artifact_name, check_artifact_type

SCHEMA = """
CREATE TABLE IF NOT EXISTS artifact_sequences (
    pk INTEGER PRIMARY KEY,
    entity TEXT NOT NULL, project TEXT NOT NULL, name TEXT NOT NULL, type TEXT NOT NULL,
    UNIQUE (entity, project, name)
);
CREATE TABLE IF NOT EXISTS artifacts (
    pk INTEGER PRIMARY KEY,
    sequence INTEGER NOT NULL REFERENCES artifact_sequences(pk),
    version INTEGER,  -- the N of vN, given at commit
    digest TEXT NOT NULL,
    state TEXT NOT NULL,  -- PENDING | COMMITTED
    metadata TEXT NOT NULL DEFAULT '{}', description TEXT,
    aliases TEXT NOT NULL DEFAULT '[]',  -- asked for before the commit, set by it
    manifest_md5 TEXT,  -- the MD5 (base64) the manifest file must arrive with
    manifest TEXT,  -- the MD5 (hex) of the manifest file received
    created REAL NOT NULL, committed REAL,
    UNIQUE (sequence, version)
);
CREATE TABLE IF NOT EXISTS artifact_aliases (
    sequence INTEGER NOT NULL, alias TEXT NOT NULL, artifact INTEGER NOT NULL,
    PRIMARY KEY (sequence, alias)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS artifact_entries (  -- the manifest's contents
    artifact INTEGER NOT NULL, path TEXT NOT NULL, digest TEXT NOT NULL,
    size INTEGER, ref TEXT,
    PRIMARY KEY (artifact, path)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS artifact_files (  -- declared by CreateArtifactFiles
    artifact INTEGER NOT NULL, path TEXT NOT NULL,
    md5 TEXT NOT NULL,  -- base64, as the manifest gives it
    size INTEGER,  -- NULL until the file arrived with that MD5
    PRIMARY KEY (artifact, path)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS artifact_client_ids (
    client_id TEXT PRIMARY KEY, server_id TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS artifact_runs (
    artifact INTEGER NOT NULL, run INTEGER NOT NULL,
    role TEXT NOT NULL,  -- output (logged it) | input (used it)
    PRIMARY KEY (artifact, run, role)
) WITHOUT ROWID;
"""

MAX_DESCRIPTION = 65536


def server_id(kind: str, pk: int) -> str:
    """An id as W&B gives them (base64 of `Kind:number`); wandb-core decodes them."""
    return base64.b64encode(f"{kind}:{pk}".encode()).decode()


def _iso(seconds: float) -> str:
    """A time as W&B's API gives it (ISO 8601, UTC, no zone suffix)."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).replace(tzinfo=None).isoformat()


def parse_id(kind: str, value: object) -> int:
    """The number of an id of `kind` from a request; ArtifactError for anything else."""
    if isinstance(value, str) and len(value) <= 64:
        try:
            prefix, _, number = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            prefix, number = "", ""
        if prefix == kind and number.isdigit() and len(number) <= 18:
            return int(number)
    raise ArtifactError(f"{str(value)[:80]!r} is not the id of an {kind}")


class ArtifactStore:
    """The artifact tables of a `Store`'s database, and the files of its versions."""

    def __init__(
        self,
        db: sqlite3.Connection,
        lock: threading.Lock,
        data_dir: Path,
        run_pk: Callable[..., int],
        refuse_symlinks: Callable[[Path], None],
    ) -> None:
        self._db, self._lock, self._run_pk = db, lock, run_pk
        self._refuse_symlinks = refuse_symlinks
        self.blobs_dir = data_dir / "artifacts"
        refuse_symlinks(self.blobs_dir)
        self.blobs_dir.mkdir(mode=0o700, exist_ok=True)
        db.executescript(SCHEMA)

    # -- uploads --------------------------------------------------------------------------

    def create(self, entity: str, project: str, run: str, spec: dict[str, Any]) -> dict:
        """A version for CreateArtifact's input: the existing one with the same client id,
        or (with dedup, as wandb asks) with the same digest in the sequence, else a new
        pending one. Returns its id, state and the sequence's latest committed id."""
        name = check_artifact_name(spec.get("artifactCollectionName"))
        kind = check_artifact_type(spec.get("artifactTypeName"))
        digest = spec.get("digest")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise ArtifactError("digest must be the manifest's MD5 in hex")
        metadata = spec.get("metadata")
        metadata = "{}" if metadata is None else values.json_object_text(metadata, "metadata")
        description = spec.get("description")
        if (
            description is not None
            and len(values.text(description, "description")) > MAX_DESCRIPTION
        ):
            raise ArtifactError("description is too long")
        aliases = check_aliases(spec.get("aliases"), name)
        client_ids = [check_client_id(spec.get(k), k) for k in ("clientID", "sequenceClientID")]
        dedup = spec.get("enableDigestDeduplication") is not False
        now = time.time()
        with self._transaction():
            run_pk = self._run_pk(entity, project, run, create=True, now=now)
            sequence = self._sequence(entity, project, name, kind)
            artifact = self._by_client_id(client_ids[0], sequence, digest)
            if artifact is None and dedup:
                artifact = self._by_digest(sequence, digest)
            if artifact is None:
                artifact = self._db.execute(
                    "INSERT INTO artifacts (sequence, digest, state, metadata, description, "
                    "aliases, created) VALUES (?, ?, 'PENDING', ?, ?, '[]', ?)",
                    (sequence, digest, metadata, description, now),
                ).lastrowid
            self._ask_aliases(artifact, aliases)
            self._db.execute(
                "INSERT OR IGNORE INTO artifact_runs VALUES (?, ?, 'output')", (artifact, run_pk)
            )
            for client_id, target in zip(
                client_ids,
                (server_id("Artifact", artifact), server_id("ArtifactSequence", sequence)),
                strict=True,
            ):
                if client_id:
                    self._db.execute(
                        "INSERT OR IGNORE INTO artifact_client_ids VALUES (?, ?)",
                        (client_id, target),
                    )
            state = self._one("SELECT state FROM artifacts WHERE pk = ?", artifact)
            latest = self._latest(sequence)
        return {"id": artifact, "state": state, "latest": latest}

    def declare_files(self, specs: list[tuple[int, str, str]]) -> None:
        """Record the MD5 each file of a pending version must arrive with (CreateArtifactFiles)."""
        with self._transaction():
            for artifact, path, md5 in specs:
                self._pending(artifact)
                self._db.execute(
                    "INSERT INTO artifact_files (artifact, path, md5) VALUES (?, ?, ?) "
                    "ON CONFLICT (artifact, path) DO UPDATE SET md5 = excluded.md5, "
                    "size = CASE WHEN md5 = excluded.md5 THEN size END",
                    (artifact, path, md5),
                )

    def declare_manifest(self, artifact: int, md5: str) -> None:
        """Record the MD5 a pending version's manifest file must arrive with."""
        with self._transaction():
            self._pending(artifact)
            self._db.execute("UPDATE artifacts SET manifest_md5 = ? WHERE pk = ?", (md5, artifact))

    def receive_file(self, artifact: int, path: str, data: bytes) -> None:
        """Keep a file PUT to its upload URL, only if its MD5 is the one declared for it."""
        with self._lock:
            row = self._db.execute(
                "SELECT md5 FROM artifact_files WHERE artifact = ? AND path = ?", (artifact, path)
            ).fetchone()
        if row is None:
            raise ArtifactError(f"no upload of {path!r} was asked for in this artifact", 404)
        got = md5_base64(data)
        if got != row[0]:
            raise ArtifactError(f"{path!r} has MD5 {got}, not the manifest's {row[0]}; not stored")
        self._write_blob(data)
        with self._transaction():
            self._db.execute(
                "UPDATE artifact_files SET size = ? WHERE artifact = ? AND path = ? AND md5 = ?",
                (len(data), artifact, path, got),
            )

    def receive_manifest(self, artifact: int, data: bytes) -> None:
        """Keep and read a version's manifest; ArtifactError unless it has W&B's form, its
        digest is the version's, and its files are the ones declared for upload."""
        with self._lock:
            row = self._db.execute(
                "SELECT digest, manifest_md5 FROM artifacts WHERE pk = ?", (artifact,)
            ).fetchone()
            declared = dict(
                self._db.execute(
                    "SELECT path, md5 FROM artifact_files WHERE artifact = ?", (artifact,)
                ).fetchall()
            )
        if row is None:
            raise ArtifactError("no such artifact", 404)
        expected, manifest_md5 = row
        if manifest_md5 is None:
            raise ArtifactError("no upload of the manifest was asked for", 409)
        if md5_base64(data) != manifest_md5:
            raise ArtifactError(
                f"the manifest's MD5 is not the {manifest_md5} declared; not stored"
            )
        entries = manifest_entries(data)
        digest = manifest_digest({path: entry[0] for path, entry in entries.items()})
        if digest != expected:
            raise ArtifactError(f"the manifest's digest is {digest}, not the artifact's {expected}")
        for path, (entry_digest, _, _) in entries.items():
            if path in declared and declared[path] != entry_digest:
                raise ArtifactError(f"the manifest's digest of {path!r} is not the one uploaded")
        blob = self._write_blob(data)
        with self._transaction():
            self._pending(artifact)
            self._db.execute("DELETE FROM artifact_entries WHERE artifact = ?", (artifact,))
            self._db.executemany(
                "INSERT INTO artifact_entries VALUES (?, ?, ?, ?, ?)",
                [(artifact, path, *entry) for path, entry in entries.items()],
            )
            self._db.execute("UPDATE artifacts SET manifest = ? WHERE pk = ?", (blob, artifact))

    def commit(self, artifact: int) -> None:
        """Make a version COMMITTED (with the next version number and its aliases) once its
        manifest and every file of it arrived as the manifest says; ArtifactError before."""
        with self._transaction():
            row = self._db.execute(
                "SELECT sequence, state, manifest, aliases FROM artifacts WHERE pk = ?",
                (artifact,),
            ).fetchone()
            if row is None:
                raise ArtifactError("no such artifact", 404)
            sequence, state, manifest, aliases = row
            if state == "COMMITTED":
                return
            if manifest is None:
                raise ArtifactError("the artifact's manifest has not arrived", 409)
            missing = self._db.execute(
                "SELECT e.path FROM artifact_entries e LEFT JOIN artifact_files f "
                "ON f.artifact = e.artifact AND f.path = e.path WHERE e.artifact = ? "
                "AND e.ref IS NULL AND (f.size IS NULL OR f.md5 != e.digest "
                "OR (e.size IS NOT NULL AND f.size != e.size)) ORDER BY e.path LIMIT 1",
                (artifact,),
            ).fetchone()
            if missing:
                raise ArtifactError(f"{missing[0]!r} has not arrived with its digest", 409)
            version = self._one(
                "SELECT COALESCE(MAX(version) + 1, 0) FROM artifacts WHERE sequence = ?", sequence
            )
            self._db.execute(
                "UPDATE artifacts SET state = 'COMMITTED', version = ?, committed = ?, "
                "aliases = '[]' WHERE pk = ?",
                (version, time.time(), artifact),
            )
            self._set_aliases(sequence, artifact, json.loads(aliases))

    def use(self, entity: str, project: str, run: str, artifact: int) -> None:
        """Record that a run used a version (its input lineage)."""
        with self._transaction():
            if self._one("SELECT pk FROM artifacts WHERE pk = ?", artifact) is None:
                raise ArtifactError("no such artifact", 404)
            run_pk = self._run_pk(entity, project, run, create=True, now=time.time())
            self._db.execute(
                "INSERT OR IGNORE INTO artifact_runs VALUES (?, ?, 'input')", (artifact, run_pk)
            )

    # -- reads ----------------------------------------------------------------------------

    def server_id_of(self, client_id: str) -> str | None:
        with self._lock:
            return self._one(
                "SELECT server_id FROM artifact_client_ids WHERE client_id = ?", client_id
            )

    def of_run(self, entity: str, project: str, run: str) -> dict[str, list[dict]]:
        """The versions a run logged and used, each with its files (their MD5s not read
        again: a run's page lists them without reading every byte of them)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT a.artifact, a.role FROM artifact_runs a JOIN runs r ON r.pk = a.run "
                "WHERE r.entity = ? AND r.project = ? AND r.name = ? ORDER BY a.artifact",
                (entity, project, run),
            ).fetchall()
        found: dict[str, list[dict]] = {"logged": [], "used": []}
        for artifact, role in rows:
            facts = self.version(artifact, files=True, reread=False)
            found["logged" if role == "output" else "used"].append(facts)
        return found

    def runs_of(self, artifact: int, role: str) -> list[tuple[str, str, str]]:
        """(entity, project, run) of each run that logged (role "output") or used
        ("input") a version."""
        with self._lock:
            return self._db.execute(
                "SELECT r.entity, r.project, r.name FROM artifact_runs a JOIN runs r "
                "ON r.pk = a.run WHERE a.artifact = ? AND a.role = ? ORDER BY r.pk",
                (artifact, role),
            ).fetchall()

    def find(self, entity: str, project: str, spec: str) -> int | None:
        """The version `name:alias`, `name:vN` or `name` (its latest) names in a project."""
        name, _, tag = spec.partition(":")
        tag = tag or "latest"
        with self._lock:
            sequence = self._one(
                "SELECT pk FROM artifact_sequences WHERE entity = ? AND project = ? AND name = ?",
                entity,
                project,
                name,
            )
            if sequence is None:
                return None
            if tag == "latest":
                return self._latest(sequence)
            if VERSION.fullmatch(tag):
                return self._one(
                    "SELECT pk FROM artifacts WHERE sequence = ? AND version = ?",
                    sequence,
                    int(tag[1:]),
                )
            return self._one(
                "SELECT artifact FROM artifact_aliases WHERE sequence = ? AND alias = ?",
                sequence,
                tag,
            )

    def version(
        self,
        artifact: int,
        files: bool = False,
        reread: bool = True,
        window: tuple[int, int] | None = None,
    ) -> dict:
        """What a version is: names, version, digest, state, aliases, metadata and its file
        count; with `files` every manifest entry (only `window`'s, (first, how many) by
        path, when given: a page of a version of 100,000 files reads one page, not all)
        with the size of the stored file and (if `reread`) the MD5 of the stored bytes,
        read again from the disk."""
        with self._lock:
            row = self._db.execute(
                "SELECT s.entity, s.project, s.name, s.type, a.version, a.digest, a.state, "
                "a.metadata, a.description, a.sequence, a.created, a.committed "
                "FROM artifacts a JOIN artifact_sequences s "
                "ON s.pk = a.sequence WHERE a.pk = ?",
                (artifact,),
            ).fetchone()
            if row is None:
                raise ArtifactError("no such artifact", 404)
            entity, project, name, kind, number, digest, state, metadata, description = row[:9]
            seq, created, committed = row[9:]
            aliases = [
                r[0]
                for r in self._db.execute(
                    "SELECT alias FROM artifact_aliases WHERE artifact = ? ORDER BY alias",
                    (artifact,),
                )
            ]
            if self._latest(seq) == artifact:
                aliases.append("latest")
            count, total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM artifact_entries WHERE artifact = ?",
                (artifact,),
            ).fetchone()
            start, most = window if window is not None else (0, -1)
            entries = (
                self._db.execute(
                    "SELECT e.path, e.digest, e.size, e.ref, f.size FROM artifact_entries e "
                    "LEFT JOIN artifact_files f ON f.artifact = e.artifact AND f.path = e.path "
                    "WHERE e.artifact = ? ORDER BY e.path LIMIT ? OFFSET ?",
                    (artifact, most, start),
                ).fetchall()
                if files
                else []
            )
        facts: dict[str, Any] = {
            "id": server_id("Artifact", artifact),
            "entity": entity,
            "project": project,
            "name": name,
            "type": kind,
            "version": None if number is None else f"v{number}",
            "digest": digest,
            "state": state,
            "aliases": sorted(aliases),
            "metadata": json.loads(metadata),
            "description": description,
            "file_count": count,
            "size": total,  # as the manifest gives them
            "collection_id": server_id("ArtifactSequence", seq),
            "created": _iso(created),
            "committed": None if committed is None else _iso(committed),
        }
        if files:
            facts["files"] = [
                {"name": path, "size": stored, "digest": entry_digest, "ref": ref}
                for path, entry_digest, _, ref, stored in entries
            ]
            for file in facts["files"] if reread else []:
                file["md5"] = None if file["size"] is None else self._blob_md5(file["digest"])
        return facts

    def file_path(self, artifact: int, path: str) -> Path | None:
        """Where a file of a version that arrived is kept, None if it did not."""
        with self._lock:
            md5 = self._one(
                "SELECT md5 FROM artifact_files WHERE artifact = ? AND path = ? "
                "AND size IS NOT NULL",
                artifact,
                path,
            )
        return None if md5 is None else self._blob_path(md5)

    def manifest_path(self, artifact: int) -> Path | None:
        with self._lock:
            md5 = self._one("SELECT manifest FROM artifacts WHERE pk = ?", artifact)
        return None if md5 is None else self._blob_path(bytes.fromhex(md5))

    # -- helpers --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The lock and one transaction: all of a request's writes, or none of them. (The
        connection is in autocommit mode, where `with connection:` opens no transaction.)"""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _sequence(self, entity: str, project: str, name: str, kind: str) -> int:
        row = self._db.execute(
            "SELECT pk, type FROM artifact_sequences WHERE entity = ? AND project = ? AND name = ?",
            (entity, project, name),
        ).fetchone()
        if row is None:
            return int(
                self._db.execute(
                    "INSERT INTO artifact_sequences (entity, project, name, type) VALUES (?, ?, ?, ?)",
                    (entity, project, name, kind),
                ).lastrowid
            )
        if row[1] != kind:
            raise ArtifactError(f"artifact {name!r} is of type {row[1]!r}, not {kind!r}", 409)
        return int(row[0])

    def _by_client_id(self, client_id: str | None, sequence: int, digest: str) -> int | None:
        """The version a client id was given to (a CreateArtifact sent again), which must be
        one of this name with this digest: a client id never reaches another artifact."""
        found = client_id and self._one(
            "SELECT server_id FROM artifact_client_ids WHERE client_id = ?", client_id
        )
        if not found:
            return None
        artifact = parse_id("Artifact", found)
        if (sequence, digest) != tuple(
            self._db.execute(
                "SELECT sequence, digest FROM artifacts WHERE pk = ?", (artifact,)
            ).fetchone()
        ):
            raise ArtifactError("this clientID belongs to another artifact version", 409)
        return artifact

    def _by_digest(self, sequence: int, digest: str) -> int | None:
        return self._one(
            "SELECT pk FROM artifacts WHERE sequence = ? AND digest = ? "
            "ORDER BY state = 'COMMITTED' DESC, pk LIMIT 1",
            sequence,
            digest,
        )

    def _latest(self, sequence: int) -> int | None:
        return self._one(
            "SELECT pk FROM artifacts WHERE sequence = ? AND state = 'COMMITTED' "
            "ORDER BY version DESC LIMIT 1",
            sequence,
        )

    def _pending(self, artifact: int) -> None:
        state = self._one("SELECT state FROM artifacts WHERE pk = ?", artifact)
        if state is None:
            raise ArtifactError("no such artifact", 404)
        if state != "PENDING":
            raise ArtifactError("the artifact is committed already; it does not change", 409)

    def _ask_aliases(self, artifact: int, aliases: list[str]) -> None:
        """Set the aliases of a committed version now, a pending one's at its commit."""
        sequence, state, asked = self._db.execute(
            "SELECT sequence, state, aliases FROM artifacts WHERE pk = ?", (artifact,)
        ).fetchone()
        if state == "COMMITTED":
            self._set_aliases(sequence, artifact, aliases)
        else:
            merged = sorted(set(json.loads(asked)) | set(aliases))
            self._db.execute(
                "UPDATE artifacts SET aliases = ? WHERE pk = ?", (json.dumps(merged), artifact)
            )

    def _set_aliases(self, sequence: int, artifact: int, aliases: list[str]) -> None:
        """An alias names one version of a sequence: setting it moves it here."""
        self._db.executemany(
            "INSERT OR REPLACE INTO artifact_aliases VALUES (?, ?, ?)",
            [(sequence, alias, artifact) for alias in aliases],
        )

    def _write_blob(self, data: bytes) -> str:
        """Keep `data` under its MD5 (hex), atomically and never through a symlink."""
        digest = hashlib.md5(data, usedforsecurity=False).digest()
        path = self._blob_path(digest)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self._refuse_symlinks(path)
        write_replacing(path, data)
        return digest.hex()

    def _blob_path(self, digest: str | bytes) -> Path:
        raw = base64.b64decode(digest) if isinstance(digest, str) else digest
        path = self.blobs_dir / raw.hex()[:2] / raw.hex()
        self._refuse_symlinks(path)
        return path

    def _blob_md5(self, digest: str) -> str | None:
        """The MD5 (base64) of the bytes kept for `digest`, read again from the disk."""
        hasher = hashlib.md5(usedforsecurity=False)
        try:
            with open(self._blob_path(digest), "rb") as file:
                while piece := file.read(1 << 20):
                    hasher.update(piece)
        except OSError:
            return None
        return base64.b64encode(hasher.digest()).decode()

    def _one(self, query: str, *args: Any) -> Any:
        row = self._db.execute(query, args).fetchone()
        return None if row is None else row[0]

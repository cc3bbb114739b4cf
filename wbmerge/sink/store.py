"""SQLite storage of the sink: runs, their history, system metrics, console lines and files,
and (in `artifacts`) the artifact versions runs logged and used.

Lines are stored by the offset the uploader gives them, so a retried or resumed request
overwrites instead of duplicating; all writes of one request happen in one transaction.

Every value is checked (`values`) before any of its request is written, so that nothing
stored can break the pages or the read API of the other runs. The data directory is made
private (0700, its files 0600): other users of the machine read nothing of it.

Every path the store opens lies inside the data directory: names are checked (`names`),
and a path is used only if resolving it changes nothing, so that a symlink planted
anywhere under the data directory (pointing out of it or not) is never followed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from . import values
from .access import (
    API_KEY_FILE,
    SECRET_FILE,
    ApiKey,
    UploadTokens,
    make_private_dir,
    make_private_file,
    refuse_foreign,
    write_replacing,
)
from .artifactstore import ArtifactStore
from .names import check_file_name, check_run_path
from .wandblike import LaggingViews, LikeWandb

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    pk INTEGER PRIMARY KEY,
    entity TEXT NOT NULL, project TEXT NOT NULL, name TEXT NOT NULL,
    group_name TEXT, job_type TEXT, display_name TEXT, notes TEXT, host TEXT, program TEXT,
    tags TEXT NOT NULL DEFAULT '[]', config TEXT NOT NULL DEFAULT '{}',
    summary TEXT NOT NULL DEFAULT '{}',
    state TEXT NOT NULL DEFAULT 'running', exit_code INTEGER,
    created REAL NOT NULL, updated REAL NOT NULL,
    UNIQUE (entity, project, name)
);
CREATE TABLE IF NOT EXISTS lines (
    run INTEGER NOT NULL REFERENCES runs(pk),
    stream TEXT NOT NULL,  -- history | events | console
    offset INTEGER NOT NULL,
    line TEXT NOT NULL,
    step INTEGER,  -- a history line's `_step`, for reading history by step as W&B does
    PRIMARY KEY (run, stream, offset)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS files (
    run INTEGER NOT NULL REFERENCES runs(pk),
    name TEXT NOT NULL, size INTEGER NOT NULL, updated REAL NOT NULL,
    PRIMARY KEY (run, name)
) WITHOUT ROWID;
"""

# The fields of a run that W&B answers from a cache that lags (`wandblike`).
LAGGING_FIELDS = (
    "history_line_count",
    "events_line_count",
    "console_line_count",
    "history_tail",
    "events_tail",
    "raw_summary",
)
NOTHING_YET = dict.fromkeys(LAGGING_FIELDS[:3], 0) | {
    "history_tail": None,
    "events_tail": None,
    "raw_summary": "{}",
}

# file_stream file names -> our stream names
STREAMS = {
    "wandb-history.jsonl": "history",
    "wandb-events.jsonl": "events",
    "output.log": "console",
}

DB_SUFFIXES = ("-wal", "-shm", "-journal")  # SQLite's files beside the database

_RUN_FIELDS = {
    "groupName": "group_name",
    "jobType": "job_type",
    "displayName": "display_name",
    "notes": "notes",
    "host": "host",
    "program": "program",
}


class Store:
    """One SQLite database and a file tree under `data_dir`; safe to share between threads.

    `like` says which of W&B's behaviours it models (`wandblike`; none by default)."""

    def __init__(self, data_dir: str | Path, like: LikeWandb | None = None) -> None:
        self.like = like or LikeWandb()
        # Where each stream of each run is written next, when the write cursor is modelled:
        # kept in memory, as it lives in a W&B server's process, from the count at first use.
        self._cursors: dict[tuple[int, str], int] = {}
        longest = max(self.like.lag, self.like.tail_seconds)
        self._lagging = LaggingViews(longest) if longest > 0 else None
        self.data_dir = Path(data_dir).resolve()
        make_private_dir(self.data_dir)
        self.files_dir = self.data_dir / "files"
        self.files_dir.mkdir(mode=0o700, exist_ok=True)
        database = self.data_dir / "sink.sqlite3"
        beside = [Path(f"{database}{suffix}") for suffix in DB_SUFFIXES]
        for path in (self.files_dir, database, *beside):
            _refuse_symlinks(path)
            refuse_foreign(path)
        for path in (database, *beside, self.data_dir / SECRET_FILE, self.data_dir / API_KEY_FILE):
            make_private_file(path)  # made by an older sink, with the umask of its day
        _create_private(database)  # (SQLite gives its -wal and -shm files the same mode)
        self.upload_tokens = UploadTokens.for_data_dir(self.data_dir)
        self.api_key = ApiKey.for_data_dir(self.data_dir)
        self._db = sqlite3.connect(database, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._add_steps()
        self._db.execute("CREATE INDEX IF NOT EXISTS history_steps ON lines (run, stream, step)")
        self._lock = threading.Lock()
        self.artifacts = ArtifactStore(
            self._db, self._lock, self.data_dir, self._run_pk, _refuse_symlinks
        )

    def _add_steps(self) -> None:
        """Give a database of an older sink, whose lines have no step column, the column and
        the steps of the history lines it holds."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(lines)")}
        if "step" in columns:
            return
        with self._db:
            self._db.execute("ALTER TABLE lines ADD COLUMN step INTEGER")
            rows = self._db.execute("SELECT run, offset, line FROM lines WHERE stream = 'history'")
            self._db.executemany(
                "UPDATE lines SET step = ? WHERE run = ? AND stream = 'history' AND offset = ?",
                [(history_step(line), run, offset) for run, offset, line in rows.fetchall()],
            )

    def close(self) -> None:
        self._db.close()

    # -- writes ---------------------------------------------------------------------------

    def upsert_run(self, entity: str, project: str, name: str, fields: dict[str, Any]) -> dict:
        """Create or update a run from UpsertBucket variables; returns the stored run."""
        now = time.time()
        # Everything is checked first: bad input writes nothing, not even the run.
        config = _config_update(fields.get("config"))
        sets, args = ["updated = ?"], [now]
        for var, column in _RUN_FIELDS.items():
            if fields.get(var) is not None:
                sets.append(f"{column} = ?")
                args.append(values.text(fields[var], var))
        if fields.get("tags") is not None:
            sets.append("tags = ?")
            args.append(json.dumps(values.tags(fields["tags"])))
        if fields.get("summaryMetrics"):
            sets.append("summary = ?")
            args.append(values.json_object_text(fields["summaryMetrics"], "summaryMetrics"))
        if fields.get("state") in ("running", "finished", "failed", "crashed"):
            sets.append("state = ?")
            args.append(fields["state"])
        with self._lock, self._db:
            pk = self._run_pk(entity, project, name, create=True, now=now)
            if config:
                merged = json.loads(self._one("SELECT config FROM runs WHERE pk = ?", pk))
                merged.update(config)  # (a key once sent stays; a key's value is replaced)
                sets.append("config = ?")
                args.append(json.dumps(merged))
            self._db.execute(f"UPDATE runs SET {', '.join(sets)} WHERE pk = ?", [*args, pk])
            self._record_view(entity, project, name, pk)
        return self.reported_run(entity, project, name) or {}

    def file_stream(self, entity: str, project: str, name: str, body: dict[str, Any]) -> None:
        """Apply one file_stream request: lines by offset, summary, completion."""
        now = time.time()
        chunks = values.chunks(body.get("files"))  # all checked before anything is written
        for file_name, _, content in chunks:
            if file_name == "wandb-summary.json" and content:
                values.json_object(content[-1], "the summary")
            elif file_name in ("wandb-history.jsonl", "wandb-events.jsonl"):
                for line in content:
                    values.json_object(line, f"a line of {file_name}")
        code = values.exit_code(body.get("exitcode")) if body.get("complete") else None
        limits = self.like.limits
        for file_name, _, content in chunks if limits else ():
            too_long = [n for n in map(len, map(str.encode, content)) if n > limits.line_bytes]
            if file_name == "wandb-history.jsonl" and too_long:
                raise ValueError(
                    f"a history line of {too_long[0]} bytes, past the {limits.line_bytes} "
                    "bytes a line may hold"
                )
        with self._lock, self._db:
            pk = self._run_pk(entity, project, name, create=True, now=now)
            for file_name, offset, content in chunks:
                if file_name == "wandb-summary.json":
                    if content:
                        self._db.execute(
                            "UPDATE runs SET summary = ? WHERE pk = ?", (content[-1], pk)
                        )
                    continue
                stream = STREAMS.get(file_name)
                if stream is None:
                    continue
                step = history_step if stream == "history" else lambda line: None
                if self.like.write_cursor and content:
                    offset = self._at_cursor(pk, stream, offset, len(content))
                self._db.executemany(
                    "INSERT OR REPLACE INTO lines (run, stream, offset, line, step) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(pk, stream, offset + i, line, step(line)) for i, line in enumerate(content)],
                )
            if body.get("complete"):
                state = "finished" if code in (0, None) else "failed"
                self._db.execute(
                    "UPDATE runs SET state = ?, exit_code = ?, updated = ? WHERE pk = ?",
                    (state, code, now, pk),
                )
            else:
                self._db.execute("UPDATE runs SET updated = ? WHERE pk = ?", (now, pk))
            self._record_view(entity, project, name, pk)

    def _at_cursor(self, pk: int, stream: str, offset: int, lines: int) -> int:
        """Where W&B puts a batch of `lines` sent at `offset` (wandb#12269): there if that
        is at or before the stream's write cursor, else at the cursor; the cursor then
        moves to the batch's end, back as well as on (called holding the lock)."""
        cursor = self._cursors.get((pk, stream))
        if cursor is None:
            cursor = self._one(
                "SELECT COALESCE(MAX(offset) + 1, 0) FROM lines WHERE run = ? AND stream = ?",
                pk,
                stream,
            )
        placed = min(offset, cursor)
        self._cursors[(pk, stream)] = placed + lines
        return placed

    def _record_view(self, entity: str, project: str, name: str, pk: int) -> None:
        """Keep what the run reports now, to be answered `lag` seconds later (called
        holding the lock)."""
        if self._lagging is None:
            return
        view = self._counts_and_tails(pk)
        view["raw_summary"] = self._one("SELECT summary FROM runs WHERE pk = ?", pk)
        self._lagging.record((entity, project, name), view)

    def save_file(self, entity: str, project: str, name: str, file_name: str, data: bytes) -> None:
        """Store a run file atomically; ValueError for unsafe names, OSError if it cannot be.

        The data goes to a fresh temporary file (created exclusively, so a planted symlink
        is never written through) that then replaces the file's path.
        """
        path = self.file_path(entity, project, name, file_name)
        path.parent.mkdir(parents=True, exist_ok=True)
        _refuse_symlinks(path)  # again: nothing was swapped in while the folders were made
        write_replacing(path, data)
        now = time.time()
        with self._lock, self._db:
            pk = self._run_pk(entity, project, name, create=True, now=now)
            self._db.execute(
                "INSERT OR REPLACE INTO files (run, name, size, updated) VALUES (?, ?, ?, ?)",
                (pk, file_name, len(data), now),
            )

    def file_path(self, entity: str, project: str, name: str, file_name: str) -> Path:
        """Where a run file lives on disk; ValueError for any name or path that is not safe.

        The names must pass `names`' checks and the path must resolve to itself: no
        component of it may be a symlink, wherever that symlink points.
        """
        check_run_path(entity, project, name)
        check_file_name(file_name)
        path = self.files_dir / entity / project / name / file_name
        _refuse_symlinks(path)
        return path

    # -- reads ----------------------------------------------------------------------------

    def runs(self, entity: str | None = None, project: str | None = None) -> list[dict]:
        query = "SELECT * FROM runs"
        where, args = [], []
        for column, value in (("entity", entity), ("project", project)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        if where:
            query += " WHERE " + " AND ".join(where)
        with self._lock:
            cursor = self._db.execute(query + " ORDER BY entity, project, name", args)
            rows = [self._row(cursor, r) for r in cursor.fetchall()]
        return [self._brief(r) for r in rows]

    def run(self, entity: str, project: str, name: str, full: bool = False) -> dict | None:
        with self._lock:
            cursor = self._db.execute(
                "SELECT * FROM runs WHERE entity = ? AND project = ? AND name = ?",
                (entity, project, name),
            )
            row = cursor.fetchone()
            if row is None:
                return None
            run = self._row(cursor, row)
            reported = self._counts_and_tails(run["pk"])
            lines: dict[str, list[str]] = {}
            files: list[str] = []
            if full:
                for stream in ("history", "events", "console"):
                    lines[stream] = [
                        r[0]
                        for r in self._db.execute(
                            "SELECT line FROM lines WHERE run = ? AND stream = ? ORDER BY offset",
                            (run["pk"], stream),
                        )
                    ]
                files = [
                    r[0]
                    for r in self._db.execute(
                        "SELECT name FROM files WHERE run = ? ORDER BY name", (run["pk"],)
                    )
                ]
        result = self._brief(run)
        result.update(reported, raw_config=run["config"], raw_summary=run["summary"])
        if full:
            result.update(
                history=[json.loads(line) for line in lines["history"]],
                system_metrics=[json.loads(line) for line in lines["events"]],
                console=lines["console"],
                files=files,
                artifacts=self.artifacts.of_run(entity, project, name),
            )
        return result

    def reported_run(self, entity: str, project: str, name: str) -> dict | None:
        """`run` as W&B answers a client's question about it: with the line counts, tails
        and summary of `like.lag` seconds ago when the lag is modelled (the read API and
        the pages, like W&B's own reads of the rows, are not late)."""
        run = self.run(entity, project, name)
        if run is None or self._lagging is None:
            return run
        key = (entity, project, name)
        if not self._lagging.known(key):  # (held from before this start: cached from now on)
            with self._lock:
                pk = self._run_pk(entity, project, name, create=False, now=time.time())
                self._record_view(entity, project, name, pk)
        counts = self._lagging.view(key, self.like.lag) or NOTHING_YET
        tail = self._lagging.view(key, self.like.tail_seconds) or NOTHING_YET
        return {
            **run,
            **{field: counts[field] for field in LAGGING_FIELDS[:3]},
            **{field: tail[field] for field in LAGGING_FIELDS[3:]},
        }

    def _counts_and_tails(self, pk: int) -> dict[str, Any]:
        """A run's line counts (the highest offset held plus one) and its last history and
        system-metric lines (called holding the lock)."""
        counts = dict(
            self._db.execute(
                "SELECT stream, COALESCE(MAX(offset) + 1, 0) FROM lines WHERE run = ? "
                "GROUP BY stream",
                (pk,),
            ).fetchall()
        )
        tails = {}
        for stream in ("history", "events"):
            tail = self._db.execute(
                "SELECT line FROM lines WHERE run = ? AND stream = ? ORDER BY offset DESC LIMIT 1",
                (pk, stream),
            ).fetchone()
            tails[stream] = tail[0] if tail else None
        return {
            "history_line_count": counts.get("history", 0),
            "events_line_count": counts.get("events", 0),
            "console_line_count": counts.get("console", 0),
            "history_tail": tails["history"],
            "events_tail": tails["events"],
        }

    def history_page(
        self, entity: str, project: str, name: str, min_step: int, max_step: int, samples: int
    ) -> list[str] | None:
        """The history lines of a run whose `_step` lies in [min_step, max_step), in step
        order, as W&B's `history(minStep, maxStep, samples)` gives them: all of them when
        there are at most `samples`; else the first `samples` of them, or, when W&B's
        sampling is modelled, `samples` of them spread evenly over the range (W&B samples
        a range it would return too much of). None when the run is unknown."""
        with self._lock:
            pk = self._existing_pk(entity, project, name)
            if pk is None:
                return None
            lines = [
                row[0]
                for row in self._db.execute(
                    "SELECT line FROM lines WHERE run = ? AND stream = 'history' AND step >= ? "
                    "AND step < ? ORDER BY step, offset",
                    (pk, min_step, max_step),
                )
            ]
        if len(lines) <= samples:
            return lines
        if not self.like.sampling:
            return lines[:samples]
        last = len(lines) - 1
        return [lines[round(i * last / max(samples - 1, 1))] for i in range(max(samples, 0))]

    def stream_lines(self, entity: str, project: str, name: str, stream: str) -> list[str] | None:
        """Every line of one stream of a run (history, events or console) in line order; None
        when the run is unknown."""
        with self._lock:
            pk = self._existing_pk(entity, project, name)
            if pk is None:
                return None
            cursor = self._db.execute(
                "SELECT line FROM lines WHERE run = ? AND stream = ? ORDER BY offset",
                (pk, stream),
            )
            return [row[0] for row in cursor]

    def file_times(self, entity: str, project: str, name: str) -> dict[str, float]:
        """When each file of a run was last stored (seconds since the epoch), by name."""
        with self._lock:
            return dict(
                self._db.execute(
                    "SELECT f.name, f.updated FROM files f JOIN runs r ON f.run = r.pk "
                    "WHERE r.entity = ? AND r.project = ? AND r.name = ?",
                    (entity, project, name),
                ).fetchall()
            )

    def file_md5(self, entity: str, project: str, name: str, file_name: str) -> str | None:
        """The MD5 of a stored file in base64, as W&B gives a file's `md5`; None if it is
        gone from the disk."""
        digest = hashlib.md5(usedforsecurity=False)
        try:
            with open(self.file_path(entity, project, name, file_name), "rb") as file:
                while piece := file.read(1 << 20):
                    digest.update(piece)
        except OSError:
            return None
        return base64.b64encode(digest.digest()).decode()

    def file_sizes(self, entity: str, project: str, name: str) -> list[tuple[str, int]] | None:
        """(name, size) of each file of a run, by name; None when there is no such run."""
        with self._lock:
            pk = self._existing_pk(entity, project, name)
            if pk is None:
                return None
            return self._db.execute(
                "SELECT name, size FROM files WHERE run = ? ORDER BY name", (pk,)
            ).fetchall()

    # -- helpers --------------------------------------------------------------------------

    def _existing_pk(self, entity: str, project: str, name: str) -> int | None:
        """The key of a run, None when there is no such run (the caller holds the lock)."""
        row = self._db.execute(
            "SELECT pk FROM runs WHERE entity = ? AND project = ? AND name = ?",
            (entity, project, name),
        ).fetchone()
        return None if row is None else row[0]

    def _run_pk(self, entity: str, project: str, name: str, create: bool, now: float) -> int:
        found = self._existing_pk(entity, project, name)
        if found is not None:
            return found
        cursor = self._db.execute(
            "INSERT INTO runs (entity, project, name, created, updated) VALUES (?, ?, ?, ?, ?)",
            (entity, project, name, now, now),
        )
        return int(cursor.lastrowid)

    def _one(self, query: str, *args: Any) -> Any:
        return self._db.execute(query, args).fetchone()[0]

    @staticmethod
    def _row(cursor: sqlite3.Cursor, row: tuple) -> dict:
        return {d[0]: v for d, v in zip(cursor.description, row, strict=True)}

    @staticmethod
    def _brief(run: dict) -> dict:
        config = json.loads(run["config"] or "{}")
        return {
            "id": run["name"],
            "entity": run["entity"],
            "project": run["project"],
            "group": run["group_name"] or None,
            "job_type": run["job_type"] or None,
            "display_name": run["display_name"] or None,
            "tags": json.loads(run["tags"] or "[]"),
            "notes": run["notes"] or None,
            "config": plain_config(config),
            "summary": json.loads(run["summary"] or "{}"),
            "state": run["state"],
            "exit_code": run["exit_code"],
            "created": run["created"],
            "updated": run["updated"],
        }


class UnsafePath(ValueError):
    """A path under the data directory that is or passes through a symlink."""


def history_step(line: str) -> int | None:
    """A history line's `_step` (the key wandb-core writes at the top of every row), None
    when the line holds no whole-number `_step` or is not a JSON object."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    step = row.get("_step") if isinstance(row, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    return step if -(2**63) <= step < 2**63 else None  # (W&B's steps are int64)


def _refuse_symlinks(path: Path) -> None:
    """UnsafePath unless `path` (absolute) resolves to itself: no symlink on the way to it."""
    if path.resolve() != path:
        raise UnsafePath(f"{path} is or passes through a symlink; the sink does not follow it")


def _create_private(path: Path) -> None:
    """Create `path` empty, mode 0600, unless it exists (never through a symlink)."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
    except FileExistsError:
        return
    os.close(fd)


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """W&B stores config as {key: {"value": v, "desc": ...}}: return {key: v} as wandb's
    public API shows it (`Run.config`), without the keys that start with `_` (`_wandb`,
    wbmerge's writer claims)."""
    plain = {}
    for key, entry in config.items():
        if key.startswith("_"):
            continue
        plain[key] = entry["value"] if isinstance(entry, dict) and "value" in entry else entry
    return plain


def _config_update(text: str | None) -> dict[str, Any]:
    """The config keys an UpsertBucket sets. It is read before the run is touched, so that a
    config that is not a JSON object (or is nested too deeply) refuses the whole
    request instead of leaving a run created without it."""
    if not text:
        return {}
    return values.json_object(text, "the config")

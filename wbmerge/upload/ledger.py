"""The ledger of runs verified on a server, and the locks that keep two syncs of one run apart.

Both live in wbmerge's state directory, never in the user's directories. The ledger is a
SQLite database (each run is recorded in its own transaction the moment it is verified, so
concurrent syncs and a kill at any point leave it whole); the locks are `flock`s, which the
kernel releases when their holder dies, so a killed sync never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ..errors import WbmergeError
from ..plan import Target
from .processes import command_line, lock_holders

_SCHEMA = """
CREATE TABLE IF NOT EXISTS synced (
    key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, entity TEXT, time REAL NOT NULL
)
"""
_COLUMNS = ["key", "fingerprint", "entity", "time"]
# Seconds to wait for a ledger another process is writing. A sync holds it for the moment
# it records one run (milliseconds); one that waited 60 s for a ledger held open by another
# process said nothing meanwhile, and then blamed the state directory.
BUSY_TIMEOUT = 5.0


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """WBMERGE_STATE_DIR, else $XDG_STATE_HOME/wbmerge, else ~/.local/state/wbmerge."""
    env = os.environ if env is None else env
    if env.get("WBMERGE_STATE_DIR"):
        return Path(env["WBMERGE_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "wbmerge"


def check_state_dir(path: Path) -> Path:
    """`path` (a directory, or a link to one) when no other user may write in it; else
    WbmergeError. Another user who may write there could plant a ledger that says runs are
    synced, or a link at a name wbmerge writes (a sync as root would write through it)."""
    status = path.stat()
    if status.st_uid != os.geteuid():
        why = f"belongs to uid {status.st_uid}, not to this user (uid {os.geteuid()})"
    elif status.st_mode & 0o022:
        why = f"may be written by other users (mode {stat.S_IMODE(status.st_mode):o})"
    else:
        return path
    raise WbmergeError(
        f"state directory {path} {why}; set WBMERGE_STATE_DIR to a directory of your own"
    )


class Ledger:
    """Which run (server, entity, project, id) was verified complete from which source files."""

    def __init__(self, path: Path) -> None:
        """Open (or make) the ledger at `path`; WbmergeError if its directory cannot hold
        it, another process holds it locked, or another wbmerge wrote it differently."""
        self.path = path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_state_dir(path.parent)
            # used by one thread at a time, but may be closed by another (a batch closes the
            # connections of its checking threads when they are done)
            self._db = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
            self._db.execute(_SCHEMA)
            columns = [row[1] for row in self._db.execute("PRAGMA table_info(synced)")]
        except sqlite3.OperationalError as exc:
            raise self._problem(exc) from None
        except sqlite3.DatabaseError as exc:  # (not an SQLite database at all)
            raise self._other_schema(str(exc)) from None
        except (OSError, sqlite3.Error) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise WbmergeError(
                f"cannot keep the ledger of synced runs in {path.parent} ({why}); set "
                "WBMERGE_STATE_DIR to a directory wbmerge may write"
            ) from None
        if columns != _COLUMNS:
            self._db.close()
            raise self._other_schema(f"its runs have the columns {', '.join(columns)}")

    def _other_schema(self, why: str) -> WbmergeError:
        return WbmergeError(
            f"the ledger at {self.path} was not written by this version of wbmerge ({why}); "
            "set WBMERGE_STATE_DIR to another directory (or move the file aside: runs it "
            "recorded are then checked on the server again)"
        )

    def _problem(self, exc: sqlite3.OperationalError) -> WbmergeError:
        """The one line of an SQLite failure: a ledger locked by another process names it."""
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code != sqlite3.SQLITE_BUSY:
            why = f"no space left on device: {exc}" if code == sqlite3.SQLITE_FULL else exc
            return WbmergeError(
                f"cannot keep the ledger of synced runs in {self.path.parent} ({why}); set "
                "WBMERGE_STATE_DIR to a directory wbmerge may write"
            )
        holders = [_holder(pid) for pid in lock_holders(self.path)] or ["another process"]
        return WbmergeError(
            f"the ledger at {self.path} is locked by {' and '.join(holders)}, still after "
            f"{BUSY_TIMEOUT:g} s; rerun when it is done, or set WBMERGE_STATE_DIR to another "
            "directory"
        )

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def key(base_url: str, entity: str | None, project: str, target: Target) -> str:
        """The run's key: the server (`server_key`), entity, project and run id."""
        return f"{server_key(base_url)}|{entity or ''}|{project}|{target.id}"

    @staticmethod
    def fingerprint(target: Target, settings: Mapping[str, object]) -> str:
        """The merge settings and every source file's path, size and mtime."""
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        for source in (*target.sources, *target.extra_system_sources):
            stat = source.path.stat()
            # (the path's own bytes: a name that is not UTF-8 has no UTF-8 text)
            digest.update(os.fsencode(source.path.resolve()))
            digest.update(f"|{stat.st_size}|{stat.st_mtime_ns}".encode())
        return digest.hexdigest()

    def synced(self, key: str, fingerprint: str) -> dict | None:
        """The entry of a run verified from these very files, else None."""
        try:
            row = self._db.execute(
                "SELECT entity, time FROM synced WHERE key = ? AND fingerprint = ?",
                (key, fingerprint),
            ).fetchone()
        except sqlite3.OperationalError as exc:
            raise self._problem(exc) from None
        return {"entity": row[0], "time": row[1]} if row else None

    def recorded_otherwise(self, key: str, fingerprint: str) -> bool:
        """True when this ledger verified the run `key` from other files or settings than
        `fingerprint` says: its sources (or the options of its merge) changed since."""
        try:
            row = self._db.execute(
                "SELECT 1 FROM synced WHERE key = ? AND fingerprint != ?", (key, fingerprint)
            ).fetchone()
        except sqlite3.OperationalError as exc:
            raise self._problem(exc) from None
        return row is not None

    def unsynced(
        self,
        base_url: str,
        entity: str | None,
        project: str,
        targets: list[Target],
        settings: Mapping[str, object],
    ) -> list[Target]:
        """The `targets` this ledger has not verified from their present files."""
        return [
            target
            for target in targets
            if self.synced(
                self.key(base_url, entity, project, target), self.fingerprint(target, settings)
            )
            is None
        ]

    def record(self, key: str, fingerprint: str, entity: str | None) -> None:
        """Record one verified run, durably, at once."""
        try:
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO synced (key, fingerprint, entity, time) "
                    "VALUES (?, ?, ?, ?)",
                    (key, fingerprint, entity, time.time()),
                )
        except sqlite3.OperationalError as exc:
            raise self._problem(exc) from None


def _holder(pid: int) -> str:
    """A process that holds the ledger locked, as a user would know it."""
    command = command_line(pid) or []
    if any("wbmerge" in argument for argument in command):
        return f"another wbmerge (pid {pid})"
    return f"another process (pid {pid}{', ' + command[0] if command else ''})"


@contextmanager
def run_locks(
    lock_dir: Path, keys: list[str], on_wait: Callable[[str], None] | None = None
) -> Iterator[bool]:
    """Hold an exclusive lock per run key (taken in sorted order, so two syncs cannot deadlock).

    A lock held by another sync is waited for; `on_wait(key)` is told once per such lock.
    It yields whether it waited: the sync waited for may have been killed (which frees its
    locks), and its uploader may still be sending (see `staging.clean_stale`).
    """
    handles = []
    waited = False
    try:
        for key in sorted(set(keys)):
            name = hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock"
            try:
                lock_dir.mkdir(parents=True, exist_ok=True)
                handle = open(lock_dir / name, "a+")
            except OSError as exc:
                raise WbmergeError(
                    f"cannot keep the locks of runs being synced in {lock_dir} "
                    f"({exc.strerror or exc}); set WBMERGE_STATE_DIR to a directory wbmerge "
                    "may write"
                ) from None
            handles.append(handle)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = True
                if on_wait:
                    on_wait(key)
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield waited
    finally:
        for handle in handles:
            handle.close()  # closing releases the flock


def server_key(base_url: str) -> str:
    """The server of a base URL, spelled one way: scheme and host in lower case, no default
    port, no trailing slash, and every name of this machine's loopback (`localhost`,
    `*.localhost`, 127.0.0.0/8, `::1`) as `127.0.0.1`. `HTTPS://API.wandb.ai:443/` gives
    `https://api.wandb.ai`, `http://localhost:8765` gives `http://127.0.0.1:8765`.

    The key is what the ledger and the run locks know a server by, so a sync to the sink
    named `localhost` finds the runs a sync to `127.0.0.1` recorded, and waits for it.
    Limits: other names are not resolved (an address behind a load balancer changes, and
    resolving needs the network), so two DNS names or an address of one remote server stay
    two keys (the relay still keeps their rows once, see `relay`); and two servers on one
    port of the loopback, one on `::1` and one on 127.0.0.1, would be taken for one."""
    try:
        parts = urllib.parse.urlsplit(base_url.strip())
        port = parts.port
    except ValueError:  # (refused with a clear line before any run is synced)
        return base_url
    default = {"http": 80, "https": 443}.get(parts.scheme.lower())
    host = parts.hostname or ""
    if _is_loopback(host):
        host = "127.0.0.1"
    elif ":" in host:  # (an IPv6 address is written in brackets)
        host = f"[{host}]"
    netloc = host if port in (None, default) else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def _is_loopback(host: str) -> bool:
    """True for a name of this machine's loopback that needs no lookup (RFC 6761 reserves
    `localhost` and the names below it for the loopback; a final dot names the root)."""
    name = host.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""One writer per run: a claim kept in the run's config on the server.

Two uploads of one run at once move each other's rows on W&B. The server keeps a write
position per run, and a batch sent past it lands at it (wandb#12269). A follow and a sync
of one job, a Flyte task retried while its first attempt still runs, or two machines that
sync one shared directory are such pairs. Uploads from one machine and one state
directory are kept apart by the run locks there (`ledger.run_locks`). Claims keep apart
the rest.

Every writer has its own config key in each run it sends: `_wbmerge_writer/<id>`, where
`<id>` names its machine and state directory. It sets its entry with `UpsertBucket`, the
mutation wandb-core sets a run's config with. The server keeps a key once set, so
writers do not replace each other's entries. Then the writer reads the run's config back
and goes on only if no other writer's entry is live. Of two writers, the one that set its
entry second reads the first one's, so at most one goes on. When both read each other's,
both step back (they release their entries) and try again after a random pause.

A worked example: sync A sets its entry at 10:00:00, sync B at 10:00:01.

- A reads the config at 10:00:00.5 and finds only its own entry. A sends.
- B reads at 10:00:01.5 and finds A's entry, live until 10:01:00. B releases its own
  and waits.
- A renews its entry every `RENEW` seconds while it sends. It ends at 10:03:00 and
  releases the entry then.
- B asks every few seconds. At 10:03:02 it finds A's entry released at 10:03:00. It
  waits until 10:03:05, since A's last requests may still land and W&B's counts are late.
  Then it reads the run again and goes on. The run is whole, so it sends nothing.

An entry lives `TTL` seconds past its last renewal. A writer that died without releasing
holds its runs that long at most. The clocks of two machines meet here: a skew of more
than `TTL - RENEW` seconds could let a second writer in while the first still sends.

Keys that start with `_` are hidden by wandb's public API, and every config check of
wbmerge ignores them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from ..errors import WbmergeError
from .serverclient import Held, ServerClient, ServerError

PREFIX = "_wbmerge_writer/"
TTL = 60.0  # seconds an entry lives past its last renewal
RENEW = 15.0  # seconds between renewals while a writer holds runs
# Seconds after a writer released a run (or its entry ran out) before another reads the
# run's counts: its last requests may still land, and W&B's counts come ~2-4 s late.
SETTLE = 5.0
POLL = 3.0  # seconds between two looks at a run another writer holds (plus up to half more)
RELEASERS = 8  # runs released at once when a session ends

Kind = Literal["sync", "follow"]


class OtherWriter(WbmergeError):
    """A run another writer holds, which this one does not wait for: exit 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


@dataclass(frozen=True)
class Entry:
    """One writer's entry in a run's config."""

    kind: str  # "sync" or "follow"
    host: str
    pid: int
    until: float  # wall-clock seconds: live until then, unless released
    released: bool = False

    def live(self, now: float) -> bool:
        return not self.released and self.until > now

    def names(self) -> str:
        return f"wbmerge {self.kind} on {self.host} (pid {self.pid})"

    def value(self) -> dict:
        return {
            "kind": self.kind,
            "host": self.host,
            "pid": self.pid,
            "until": self.until,
            "released": self.released,
        }


@dataclass(frozen=True)
class Verdict:
    """What a writer does after reading a run's entries.

    `go`: it holds the run, after waiting `wait` seconds for writers that left it lately.
    Otherwise `holder` holds it: wait for it and look again, unless `stop` (a follow
    holds it: it sends until its job ends, so waiting would take as long).
    """

    go: bool
    wait: float = 0.0
    holder: Entry | None = None
    stop: bool = False


def writer_id(host: str, state_dir: str) -> str:
    """The config key's id of a writer on `host` keeping its state in `state_dir`."""
    return hashlib.sha256(f"{host}\0{state_dir}".encode()).hexdigest()[:16]


def entries_of(config_json: str) -> dict[str, Entry]:
    """The writers' entries in a run's config as the server gives it, by writer id.

    The text is untrusted: an entry of the wrong shape is not an entry."""
    try:
        config = json.loads(config_json or "{}")
    except (ValueError, RecursionError):
        return {}
    entries = {}
    for key, item in config.items() if isinstance(config, dict) else ():
        if not (isinstance(key, str) and key.startswith(PREFIX)):
            continue
        value = item.get("value") if isinstance(item, dict) else None
        entry = _entry(value) if isinstance(value, dict) else None
        if entry is not None:
            entries[key[len(PREFIX) :]] = entry
    return entries


def _entry(value: dict) -> Entry | None:
    kind, host, pid = value.get("kind"), value.get("host"), value.get("pid")
    until, released = value.get("until"), value.get("released", False)
    if not (
        isinstance(kind, str)
        and isinstance(host, str)
        and type(pid) is int
        and type(until) in (int, float)
        and math.isfinite(until)
        and type(released) is bool
    ):
        return None
    return Entry(kind[:40], host[:200], pid, float(until), released)


def verdict(entries: dict[str, Entry], me: str, now: float, settle: float = SETTLE) -> Verdict:
    """Whether writer `me` may send a run with these entries, at wall-clock `now`.

    | other entries | verdict |
    | --- | --- |
    | none | go |
    | a sync's, live | wait for it |
    | a follow's, live | stop |
    | released (or run out) less than `settle` s ago | go, after the rest of `settle` |
    | released (or run out) longer ago | go |
    """
    others = {writer: entry for writer, entry in entries.items() if writer != me}
    live = [entry for entry in others.values() if entry.live(now)]
    if live:
        holder = max(live, key=lambda entry: (entry.kind == "follow", entry.until))
        return Verdict(go=False, holder=holder, stop=holder.kind == "follow")
    last = max((entry.until for entry in others.values()), default=-math.inf)
    return Verdict(go=True, wait=max(0.0, min(last + settle - now, settle)))


class Claims:
    """The runs one writer (a sync or a follow) holds on one server, kept while it runs.

    `take` a run before anything of it is read for sending; `close` releases them all.
    While any is held, a thread renews them every `RENEW` seconds.
    """

    def __init__(
        self,
        client: ServerClient,
        writer: str,
        kind: Kind,
        host: str,
        pid: int,
        *,
        ttl: float = TTL,
        renew: float = RENEW,
        settle: float = SETTLE,
        poll: float = POLL,
    ) -> None:
        self.client, self.writer, self.kind, self.host, self.pid = client, writer, kind, host, pid
        self.ttl, self.renew, self.settle, self.poll = ttl, renew, settle, poll
        self._held: set[tuple[str | None, str, str]] = set()
        self._said: set[tuple[str, str]] = set()  # (holder, run) lines said
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._renewer: threading.Thread | None = None

    def take(
        self,
        entity: str | None,
        project: str,
        run_id: str,
        stop: threading.Event | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Held | None:
        """Hold `run_id`, waiting while another sync holds it; what the server holds of
        it then. None if `stop` was set while waiting. OtherWriter if a follow holds it.
        `say` is told once per run and writer waited for."""
        run = (entity, project, run_id)
        with self._lock:
            if run in self._held:
                return self.client.held(entity, project, run_id)
        stop = stop or threading.Event()
        while True:
            self._set(run, released=False)
            self._hold(run)  # (from here on `close` releases it, whatever happens next)
            held = self.client.held(entity, project, run_id)
            found = verdict(entries_of(held.config_json), self.writer, time.time(), self.settle)
            if found.go:
                if found.wait <= 0:
                    return held
                if stop.wait(found.wait):
                    return None
                return self.client.held(entity, project, run_id)
            with self._lock:
                self._held.discard(run)
            self._set(run, released=True)
            holder = found.holder
            assert holder is not None
            if found.stop:
                raise OtherWriter(
                    f"{holder.names()} is sending it until its job ends; stop that follow "
                    "to send it from here"
                )
            if say is not None and self._first_wait(holder.names(), run_id):
                say(f"{run_id}: waiting for {holder.names()}, which is sending it")
            if stop.wait(self.poll * (1 + random.random() / 2)):
                return None

    def _first_wait(self, holder: str, run_id: str) -> bool:
        """True the first time this run is waited for behind `holder` (preparer threads
        ask at once)."""
        with self._lock:
            first = (holder, run_id) not in self._said
            self._said.add((holder, run_id))
            return first

    def release(self, entity: str | None, project: str, run_id: str) -> None:
        """Release one run this writer is done with (sent and verified) now rather than at
        `close`: it is renewed no more, and its release is not left to the end of the
        session, after the last upload, where a sync of 256 runs made 256 requests."""
        run = (entity, project, run_id)
        with self._lock:
            if run not in self._held:
                return
            self._held.discard(run)
        self._set(run, released=True, quiet=True)

    def close(self) -> None:
        """Release every run held (a writer that cannot is waited out by `TTL`)."""
        self._closed.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            runs, self._held = list(self._held), set()
        if runs:
            with ThreadPoolExecutor(min(RELEASERS, len(runs))) as pool:
                list(pool.map(lambda run: self._set(run, released=True, quiet=True), runs))

    def _hold(self, run: tuple[str | None, str, str]) -> None:
        with self._lock:
            self._held.add(run)
            if self._renewer is None:
                self._renewer = threading.Thread(
                    target=self._renew_each, name="wbmerge-claims", daemon=True
                )
                self._renewer.start()

    def _renew_each(self) -> None:
        while not self._closed.wait(self.renew):
            with self._lock:
                runs = list(self._held)
            for run in runs:
                self._set(run, released=False, quiet=True)

    def _set(
        self, run: tuple[str | None, str, str], *, released: bool, quiet: bool = False
    ) -> None:
        """Set this writer's entry in a run: live for `ttl` more seconds, or released now.
        `quiet`: a renewal or a release that fails is left to the next one, or to `TTL`."""
        now = time.time()
        entry = Entry(self.kind, self.host, self.pid, now if released else now + self.ttl, released)
        entity, project, run_id = run
        try:
            self.client.set_config(entity, project, run_id, {PREFIX + self.writer: entry.value()})
        except ServerError:
            if not quiet:
                raise

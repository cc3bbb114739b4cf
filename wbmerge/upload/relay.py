"""A loopback relay between wandb-core and the server that holds each run's lines to the
offsets wbmerge planned, so that two syncs of one run rewrite the same lines instead of
adding them twice.

Why it is needed: wbmerge plans what to send from the line counts the server answers
(`remainder`), but wandb-core picks its own file_stream offsets from the counts it is
answered when it starts (the first UpsertBucket's `historyLineCount`). When another writer
(a sync from another state directory, machine or spelling of the server; or the same sync
against W&B, whose counts lag 2-4 s behind what it ingested) added lines in between,
wandb-core appends after them: measured with two syncs of a 3,000-row run at once, two
rounds of three left rows twice (in one, all 3,000), and one sync said "verified".

What the relay does: wandb-core's base URL points at it (127.0.0.1, a random port, a
random path prefix), and it forwards every request as it came (method, path, headers,
body) to the real server, and the answer back. Only the body of a file_stream request
(`POST .../files/<entity>/<project>/<run>/file_stream`, JSON
`{"files": {"wandb-history.jsonl": {"offset": N, "content": [...]}, ...}}`) is changed:
the offset of each positional file (history, system metrics, console) is moved so that
the first line wandb-core sends of it lands where wbmerge planned (history: at the count
it planned from; the others are always sent whole, from line 0), and every later line
keeps its distance from that first one. A line written at an offset the server holds
replaces it (W&B's behaviour, and the sink's), and the lines are the same in every
writer (the merge is deterministic from the sources, `_runtime` and `_timestamp`
included), so two writers that planned from any counts the server really held write the
same lines at the same offsets. `wandb-summary.json` is rewritten whole each time.
wandb-core 0.31 sends these bodies plain; one gzipped (declared or not) is unzipped,
placed and forwarded plain, and one in an encoding the relay cannot read is not forwarded
and `on_conflict` is told, as its lines cannot be placed.

What it cannot keep: a writer whose wandb-core starts at a history count below the one
wbmerge planned from (the server lost rows meanwhile, or its count lags behind the one
read before) would leave a gap. That run's request is not forwarded, and `on_conflict` is
told, so that the sync stops it and says why. Rows a sync without the relay (an older
wbmerge, a plain `wandb sync`) appends cannot be kept apart either.

Redirects: an answer of 3xx (but 304) is not passed on: wandb-core follows one (wandb
0.31 measured), sending the file_stream body, and from its second try the `Authorization`
header (Go keeps it for the same host name), to whatever address it names, such as
another user's port on 127.0.0.1. wandb-core is answered 502 instead, and `on_conflict`
is told (run "" for a request of no run), so that the sync fails those runs saying so.

Who may use it: only requests under its random path prefix are forwarded (others get a
404), so another local user cannot steer the offsets of the runs it relays; the relay adds
nothing to a request (the API key travels in wandb-core's own headers, which the relay
neither reads nor logs), so it reaches the server with no more rights than its caller has.

The relay runs in a process of its own (`relayprocess`); this is the sync's handle on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from ..errors import WbmergeError

SERVER = Path(__file__).with_name("relayprocess.py")
ANSWER_WAIT = 30.0  # seconds to wait for the relay to start, or to take a plan


class Relay:
    """One relay for one sync's uploads; `url` is the base URL to give wandb-core."""

    def __init__(
        self, upstream: str, on_conflict: Callable[[str, str], None] | None = None
    ) -> None:
        """Start a relay to `upstream` (the server's base URL); `on_conflict(run_id, why)`
        is told, from a thread of its own, when a run's lines cannot be placed as planned
        or the server answered a redirect (run "": a request of no run)."""
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise WbmergeError(f"WANDB_BASE_URL {upstream} is not an http(s) URL")
        self.on_conflict = on_conflict
        self._lock = threading.Condition()
        self._answered: set[int] = set()  # the plans the relay took
        self._seq = 0
        self._ended = False
        try:
            # `-I`: the script needs only the standard library, and nothing of the
            # environment may change what it runs
            self._proc = subprocess.Popen(
                [sys.executable, "-I", str(SERVER), upstream],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except OSError as exc:
            raise WbmergeError(f"cannot start the upload relay ({exc.strerror or exc})") from None
        assert self._proc.stdout is not None
        hello = self._proc.stdout.readline()
        try:
            started = json.loads(hello)
            self.url = f"http://127.0.0.1:{int(started['port'])}/{started['token']}"
        except (ValueError, KeyError, TypeError):
            self.close()
            raise WbmergeError("the upload relay did not start") from None
        self._reader = threading.Thread(target=self._read, name="wbmerge-relay", daemon=True)
        self._reader.start()

    def plan(self, run_id: str, history_start: int) -> None:
        """The next upload of `run_id` starts its history at line `history_start` (the
        server's count when the remainder was planned); returns once the relay holds it."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(
                    json.dumps({"plan": run_id, "history": history_start, "seq": seq}) + "\n"
                )
                self._proc.stdin.flush()
            except (OSError, ValueError):
                pass  # (it ended: said below)
            if not self._lock.wait_for(lambda: seq in self._answered or self._ended, ANSWER_WAIT):
                raise WbmergeError("the upload relay did not answer")
            if seq not in self._answered:
                raise WbmergeError("the upload relay ended before the upload")
            self._answered.discard(seq)

    def _read(self) -> None:
        """Take the relay's answers and conflicts, until it ends."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "planned" in message:
                with self._lock:
                    self._answered.add(message["planned"])
                    self._lock.notify_all()
            elif "conflict" in message and self.on_conflict is not None:
                self.on_conflict(str(message["conflict"]), str(message.get("why", "")))
        with self._lock:
            self._ended = True
            self._lock.notify_all()

    def close(self, grace: float = 5.0) -> None:
        """End the relay (requests under way are cut) and wait for it."""
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()  # (the relay ends at the end of its input)
            except OSError:
                pass
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(grace)  # (it has read to the end of the relay's output)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

"""A loopback relay between wandb-core and the server that holds each run's lines to the
offsets wbmerge planned, so that two syncs of one run rewrite the same lines instead of
adding them twice.

Why it is needed: wbmerge plans what to send from the line counts the server answers
(`remainder`), but wandb-core picks its own file_stream offsets from the counts it is
answered when it starts (the first UpsertBucket's `historyLineCount`). When another writer
(a sync from another state directory, machine or spelling of the server; or the same sync
against W&B, whose counts lag 2-4 s behind what it ingested) added lines in between,
wandb-core appends after them: measured with two syncs of a 3,000-row run at once, one
round of three ended with every row twice, and one sync said "verified".

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

What it cannot keep: a writer whose wandb-core starts at a history count below the one
wbmerge planned from (the server lost rows meanwhile, or its count lags behind the one
read before) would leave a gap. That run's request is not forwarded, `conflicts` names it
and `on_conflict` is told, so that the sync stops it and says why.

Who may use it: only requests under its random path prefix are forwarded (others get a
404), so another local user cannot steer the offsets of the runs it relays; the relay adds
nothing to a request (the API key travels in wandb-core's own headers, which the relay
neither reads nor logs), so it reaches the server with no more rights than its caller has.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import ssl
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import WbmergeError

# The files whose lines file_stream places by offset, and where wbmerge plans each to start
# when the server holds `history` rows already: history continues there, system metrics and
# console lines are sent whole again (see `remainder`).
HISTORY = "wandb-history.jsonl"
POSITIONAL = (HISTORY, "wandb-events.jsonl", "output.log")
_FILE_STREAM = re.compile(r"^/files/[^/]+/[^/]+/(?P<run>[^/]+)/file_stream$")
# Headers that belong to one connection, not to the request (RFC 9110 7.6.1): not forwarded.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                  "trailer", "upgrade", "proxy-authorization", "proxy-authenticate"})  # fmt: skip
UPSTREAM_TIMEOUT = 300.0  # seconds the server may take to answer one request
_PIECE = 1 << 16  # bytes copied at a time between the two sides


class Relay:
    """One relay for one sync's uploads; `url` is the base URL to give wandb-core."""

    def __init__(
        self, upstream: str, on_conflict: Callable[[str, str], None] | None = None
    ) -> None:
        """Relay to `upstream` (the server's base URL); `on_conflict(run_id, why)` is told
        when a run's lines cannot be placed as planned (from a thread of the relay)."""
        parts = urllib.parse.urlsplit(upstream.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WbmergeError(f"WANDB_BASE_URL {upstream} is not an http(s) URL")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.netloc, self.prefix = parts.netloc, parts.path  # (a base URL may have a path)
        proxies = urllib.request.getproxies()
        proxy = proxies.get(self.scheme) if not urllib.request.proxy_bypass(self.host) else None
        self.proxy = urllib.parse.urlsplit(proxy) if proxy else None
        self.on_conflict = on_conflict
        self.token = secrets.token_urlsafe(24)
        self._lock = threading.Lock()
        self._plans: dict[str, int] = {}  # run id -> history rows the server held when planned
        self._first: dict[tuple[str, str], int] = {}  # (run id, file) -> wandb-core's first offset
        self.conflicts: dict[str, str] = {}  # run id -> why its lines were not forwarded
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="wbmerge-relay", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/{self.token}"

    def plan(self, run_id: str, history_start: int) -> None:
        """The next upload of `run_id` starts its history at line `history_start` (the
        server's count when the remainder was planned); what an earlier upload of it
        started at is forgotten."""
        with self._lock:
            self._plans[run_id] = history_start
            for key in [k for k in self._first if k[0] == run_id]:
                del self._first[key]
            self.conflicts.pop(run_id, None)

    def close(self) -> None:
        """Stop accepting requests (requests under way end on their own)."""
        self._server.shutdown()
        self._server.server_close()

    def placed(self, run_id: str, body: bytes) -> bytes | None:
        """The file_stream `body` of `run_id` with its offsets where wbmerge planned them;
        None when they cannot be (a conflict, said once to `on_conflict`). A run without a
        plan, or a body that is not a JSON object of files, is forwarded as it came."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return body  # (the server answers what it makes of it)
        files = request.get("files") if isinstance(request, dict) else None
        if not isinstance(files, dict):
            return body
        with self._lock:
            planned = self._plans.get(run_id)
            if planned is None:
                return body
            if run_id in self.conflicts:
                return None
            for name in POSITIONAL:
                chunk = files.get(name)
                offset = chunk.get("offset", 0) if isinstance(chunk, dict) else None
                if type(offset) is not int:
                    continue
                first = self._first.setdefault((run_id, name), offset)
                start = planned if name == HISTORY else 0
                if name == HISTORY and first < planned:
                    why = (
                        f"the server held {first} history rows when wandb-core began to send "
                        f"it, fewer than the {planned} wbmerge planned from (rows lost on the "
                        "server since, or its count not yet caught up): nothing was sent; "
                        "rerun `wbmerge sync`"
                    )
                    self.conflicts[run_id] = why
                    break
                chunk["offset"] = start + offset - first
            conflict = self.conflicts.get(run_id)
        if conflict is not None:
            if self.on_conflict is not None:
                self.on_conflict(run_id, conflict)
            return None
        return json.dumps(request, separators=(",", ":")).encode()

    def connect(self) -> http.client.HTTPConnection:
        """A new connection to the server (through its proxy, if one is set for it)."""
        target = (self.proxy.hostname or "", self.proxy.port or 80) if self.proxy else None
        if self.scheme == "https":
            context = ssl.create_default_context()
            if target is None:
                return http.client.HTTPSConnection(
                    self.host, self.port, timeout=UPSTREAM_TIMEOUT, context=context
                )
            connection = http.client.HTTPSConnection(*target, timeout=UPSTREAM_TIMEOUT,
                                                     context=context)  # fmt: skip
            connection.set_tunnel(self.host, self.port)
            return connection
        if target is not None:
            return http.client.HTTPConnection(*target, timeout=UPSTREAM_TIMEOUT)
        return http.client.HTTPConnection(self.host, self.port, timeout=UPSTREAM_TIMEOUT)

    def target(self, path: str) -> str:
        """The request target for `path` (below the base URL) on the server's connection."""
        target = self.prefix + path
        if self.proxy is not None and self.scheme == "http":  # (a plain proxy: the whole URL)
            return f"http://{self.netloc}{target}"
        return target


def _handler(relay: Relay) -> type[BaseHTTPRequestHandler]:
    """The request handler class of `relay`'s server."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # (wandb-core keeps its connections open)
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: object) -> None:
            pass  # (nothing is logged: a request's line and headers are the user's)

        def handle_one(self) -> None:
            prefix = f"/{relay.token}"
            if not (self.path == prefix or self.path.startswith(prefix + "/")):
                self.send_error(404)
                return
            path = self.path[len(prefix) :] or "/"
            body = self._body()
            if body is None:
                self.send_error(400, "unreadable body")
                return
            match = _FILE_STREAM.match(urllib.parse.urlsplit(path).path)
            if match and self.command == "POST":
                placed = relay.placed(urllib.parse.unquote(match["run"]), body)
                if placed is None:
                    self.send_error(409, "not forwarded: the run's lines cannot be placed")
                    return
                body = placed
            self._forward(path, body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_one

        def _body(self) -> bytes | None:
            """The request's body, whole (GraphQL and file_stream bodies: a few MiB at most;
            files go to the upload URLs the server hands out, not through the relay)."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                pieces = []
                while True:
                    size_line = self.rfile.readline(1024)
                    try:
                        size = int(size_line.split(b";")[0], 16)
                    except ValueError:
                        return None
                    if size == 0:
                        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                            pass  # (trailers)
                        return b"".join(pieces)
                    pieces.append(self.rfile.read(size))
                    self.rfile.readline(1024)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return None
            return self.rfile.read(length) if length > 0 else b""

        def _forward(self, path: str, body: bytes) -> None:
            headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP
                       and k.lower() not in ("host", "content-length")]  # fmt: skip
            headers += [("Host", relay.netloc), ("Content-Length", str(len(body)))]
            try:
                response = self._exchange(path, headers, body)
            except (OSError, http.client.HTTPException):
                self.send_error(502, "the server did not answer")  # (wandb-core retries)
                self.close_connection = True
                return
            self.send_response_only(response.status, response.reason)
            length = response.getheader("Content-Length")
            bodiless = self.command == "HEAD" or response.status in (204, 304)
            chunked = length is None and not bodiless
            for key, value in response.getheaders():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            if response.will_close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            try:
                while piece := b"" if bodiless else response.read1(_PIECE):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except (OSError, http.client.HTTPException):
                self.close_connection = True  # (a short answer: the client sees it cut)
            response.close()  # (read to its end, or cut: the connection takes the next)
            if response.will_close and self.upstream is not None:
                self.upstream.close()
                self.upstream = None

        def _exchange(
            self, path: str, headers: list[tuple[str, str]], body: bytes
        ) -> http.client.HTTPResponse:
            """Send the request on this client connection's server connection, opening it
            (again) when there is none or the kept one was closed by the server."""
            for attempt in range(2):
                fresh = self.upstream is None
                if fresh:
                    self.upstream = relay.connect()
                try:
                    self.upstream.putrequest(self.command, relay.target(path), skip_host=True,
                                             skip_accept_encoding=True)  # fmt: skip
                    for key, value in headers:
                        self.upstream.putheader(key, value)
                    self.upstream.endheaders(body)
                    return self.upstream.getresponse()
                except (ConnectionError, http.client.ImproperConnectionState):
                    self.upstream.close()
                    self.upstream = None
                    if fresh or attempt:
                        raise
            raise AssertionError("unreachable")

        def finish(self) -> None:
            super().finish()
            if self.upstream is not None:
                self.upstream.close()

    return Handler

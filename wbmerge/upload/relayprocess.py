"""The loopback relay between wandb-core and the server (see `relay`, which starts it): it
holds each run's lines to the offsets wbmerge planned, so that two syncs of one run
rewrite the same lines instead of adding them twice.

It runs in a process of its own, as a script that imports the standard library only: in
the sync's own process, its threads waited for the interpreter lock while wbmerge counted
the staged log, and a 50 MB upload took 7.1 s instead of 4.4 s. It reads its plans from
standard input, one JSON line each (`{"plan": run, "history": rows, "seq": n}`, answered
`{"planned": n}` once in force), says each conflict as a line on standard output
(`{"conflict": run, "why": ...}`; run "" for a request of no run), and ends when its input
ends. A redirect the server answers is never passed on (see `relay`).

How it places lines, who may use it, and what it cannot keep: see `relay`. It reads
nothing of a request but its path and a file_stream body (unzipped when gzipped, and
forwarded plain; a body in another encoding is refused: its lines cannot be placed), and
logs nothing.
"""

from __future__ import annotations

import email.parser
import http.client
import json
import re
import secrets
import ssl
import sys
import threading
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The files whose lines file_stream places by offset, and where wbmerge plans each to start
# when the server holds `history` rows already: history continues there, system metrics and
# console lines are sent whole again (see `remainder`).
HISTORY = "wandb-history.jsonl"
POSITIONAL = (HISTORY, "wandb-events.jsonl", "output.log")
_FILE_STREAM = re.compile(r"^/files/[^/]+/[^/]+/(?P<run>[^/]+)/file_stream$")
# Headers that belong to one connection, not to the request (RFC 9110 7.6.1): not forwarded.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
UPSTREAM_TIMEOUT = 300.0  # seconds the server may take to answer one request
_PIECE = 1 << 16  # bytes copied at a time between the two sides
# The most a gzipped file_stream body may unzip to (wandb-core caps a body near 10 MiB).
MAX_UNZIPPED = 64 << 20


# http.client's bounds on a header block (its `_MAXLINE` and `_MAXHEADERS`).
MAX_HEADER_LINE = 65536
MAX_HEADERS = 100
# A header line the email parser reads as one field, name and value (its `headerRE`, on one
# line ended by CRLF or LF): any other line (folded, without a colon, a bare CR) sends the
# block to the email parser itself.
_PLAIN_FIELD = re.compile(r"([\041-\071\073-\176]+):([^\r\n]*)\r?\n")


def parse_headers(
    fp: object, _class: type[http.client.HTTPMessage] = http.client.HTTPMessage
) -> http.client.HTTPMessage:
    """`http.client.parse_headers`, the same message, built without the email parser where
    every line is one plain field: the relay parses the headers of every request and of its
    answer, and the email parser took 62 us a block rather than 10 us (0.75 s of the relay
    in a sync of 64 runs). Raises as it does for a line too long or too many lines."""
    lines = []
    while True:
        line = fp.readline(MAX_HEADER_LINE + 1)  # type: ignore[attr-defined]
        if len(line) > MAX_HEADER_LINE:
            raise http.client.LineTooLong("header line")
        lines.append(line)
        if len(lines) > MAX_HEADERS:
            raise http.client.HTTPException(f"got more than {MAX_HEADERS} headers")
        if line in (b"\r\n", b"\n", b""):
            break
    text = b"".join(lines).decode("iso-8859-1")
    message = _class()
    for line in lines[:-1] if lines[-1] in (b"\r\n", b"\n") else lines:
        field = _PLAIN_FIELD.fullmatch(line.decode("iso-8859-1"))
        if field is None:
            return email.parser.Parser(_class=_class).parsestr(text)
        # (as the email parser's compat32 policy keeps a field: the value's leading blanks
        # and its line end dropped)
        message.set_raw(field[1], field[2].lstrip(" \t"))
    return message


class Offsets:
    """Where each run's lines go: its plan, and the first offset wandb-core sent of each file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, int] = {}  # run id -> history rows the server held when planned
        self._first: dict[tuple[str, str], int] = {}  # (run id, file) -> wandb-core's first offset
        self.conflicts: dict[str, str] = {}  # run id -> why its lines were not forwarded

    def plan(self, run_id: str, history_start: int) -> None:
        """The next upload of `run_id` starts its history at line `history_start` (the
        server's count when the remainder was planned); what an earlier upload of it
        started at is forgotten."""
        with self._lock:
            self._plans[run_id] = history_start
            for key in [k for k in self._first if k[0] == run_id]:
                del self._first[key]
            self.conflicts.pop(run_id, None)

    def placed(self, run_id: str, body: bytes) -> tuple[bytes | None, str | None]:
        """The file_stream `body` of `run_id` with its offsets where wbmerge planned them,
        and None; or None and why they cannot be (a conflict, said the first time only).
        A run without a plan, or a body that is not a JSON object of files, is forwarded
        as it came: the server answers what it makes of it."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return body, None
        files = request.get("files") if isinstance(request, dict) else None
        if not isinstance(files, dict):
            return body, None
        with self._lock:
            planned = self._plans.get(run_id)
            if planned is None:
                return body, None
            if run_id in self.conflicts:
                return None, None
            moved = False
            for name in POSITIONAL:
                chunk = files.get(name)
                offset = chunk.get("offset", 0) if isinstance(chunk, dict) else None
                if type(offset) is not int:
                    continue
                first = self._first.setdefault((run_id, name), offset)
                if name == HISTORY and first < planned:
                    why = (
                        f"the server held {first} history rows when wandb-core began to send "
                        f"it, fewer than the {planned} wbmerge planned from (rows lost on the "
                        "server since, or its count not yet caught up): nothing was sent; "
                        "rerun `wbmerge sync`"
                    )
                    self.conflicts[run_id] = why
                    return None, why
                placed = (planned if name == HISTORY else 0) + offset - first
                moved = moved or placed != offset
                chunk["offset"] = placed
        if not moved:  # (every offset where wandb-core put it: the body as it came)
            return body, None
        # (wandb-core's bodies hold strings, integers and booleans: written back the same)
        return json.dumps(request, separators=(",", ":")).encode(), None


def decoded(body: bytes, encoding: str) -> tuple[bytes | None, str]:
    """A file_stream `body` as plain bytes, to place its lines: unzipped when it is gzip
    (declared, or by its first bytes: servers read both), at most MAX_UNZIPPED bytes; else
    None and why it cannot be read. wandb-core 0.31 sends its bodies plain."""
    gzipped = encoding == "gzip" or (encoding in ("", "identity") and body[:2] == b"\x1f\x8b")
    if encoding not in ("", "identity", "gzip"):
        return None, f"a file_stream body encoded as {encoding!r}, which the relay cannot read"
    if not gzipped:
        return body, ""
    unzipper = zlib.decompressobj(wbits=31)
    try:
        plain = unzipper.decompress(body, MAX_UNZIPPED + 1)
    except zlib.error as exc:
        return None, f"a file_stream body encoded as 'gzip' that cannot be unzipped ({exc})"
    if len(plain) > MAX_UNZIPPED or not unzipper.eof:
        return None, (
            f"a file_stream body encoded as 'gzip' that is cut short or unzips past "
            f"{MAX_UNZIPPED} bytes"
        )
    return plain, ""


def is_redirect(status: int) -> bool:
    """Whether an answer of `status` sends its client elsewhere (3xx but 304, which
    answers a conditional request and names no place)."""
    return 300 <= status < 400 and status != 304


class Upstream:
    """The server the relay forwards to: its base URL, and the proxy that reaches it."""

    def __init__(self, base_url: str) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        self.scheme, self.host = parts.scheme, parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.netloc, self.prefix = parts.netloc, parts.path  # (a base URL may have a path)
        proxies = urllib.request.getproxies()
        proxy = proxies.get(self.scheme) if not urllib.request.proxy_bypass(self.host) else None
        self.proxy = urllib.parse.urlsplit(proxy) if proxy else None

    def connect(self) -> http.client.HTTPConnection:
        """A new connection to the server (through its proxy, if one is set for it)."""
        target = (self.proxy.hostname or "", self.proxy.port or 80) if self.proxy else None
        if self.scheme == "https":
            context = ssl.create_default_context()
            if target is None:
                return http.client.HTTPSConnection(
                    self.host, self.port, timeout=UPSTREAM_TIMEOUT, context=context
                )
            connection = http.client.HTTPSConnection(
                *target, timeout=UPSTREAM_TIMEOUT, context=context
            )
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


def handler(
    upstream: Upstream, offsets: Offsets, token: str, said: Callable[[str, str], None]
) -> type[BaseHTTPRequestHandler]:
    """The request handler class: requests under `/token` go to `upstream`, with their
    file_stream offsets placed by `offsets`; `said(run, why)` is told each conflict."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # (wandb-core keeps its connections open)
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: object) -> None:
            pass  # (nothing is logged: a request's line and headers are the user's)

        def handle_one(self) -> None:
            given, _, rest = self.path[1:].partition("/")
            if not secrets.compare_digest(given.encode(), token.encode()):
                self.send_error(404)  # (and the connection closed: its body is not read)
                return
            path = "/" + rest
            body = self._body()
            if body is None:
                self.send_error(400, "unreadable body")
                return
            match = _FILE_STREAM.match(urllib.parse.urlsplit(path).path)
            keep_encoding = True
            if match and self.command == "POST":
                run_id = urllib.parse.unquote(match["run"])
                encoding = self.headers.get("Content-Encoding", "").strip().lower()
                body, why = decoded(body, encoding)
                if body is None:
                    said(run_id, f"{why}: its lines cannot be placed; not forwarded")
                    self.send_error(415, "not forwarded: the body cannot be read")
                    return
                keep_encoding = False  # (forwarded plain: its Content-Encoding is dropped)
                placed, conflict = offsets.placed(run_id, body)
                if conflict is not None:
                    said(run_id, conflict)
                if placed is None:
                    self.send_error(409, "not forwarded: the run's lines cannot be placed")
                    return
                body = placed
            self._forward(path, body, keep_encoding)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_one

        def _body(self) -> bytes | None:
            """The request's body, whole: GraphQL and file_stream bodies (wandb-core caps a
            file_stream request near 10 MiB; 11 MB measured). Files go to the upload URLs
            the server hands out, not through the relay."""
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

        def _forward(self, path: str, body: bytes, keep_encoding: bool = True) -> None:
            dropped = ("host", "content-length") + (() if keep_encoding else ("content-encoding",))
            headers = [
                (k, v)
                for k, v in self.headers.items()
                if k.lower() not in _HOP and k.lower() not in dropped
            ]
            headers += [("Host", upstream.netloc), ("Content-Length", str(len(body)))]
            try:
                response = self._exchange(path, headers, body)
            except (OSError, http.client.HTTPException):
                self.send_error(502, "the server did not answer")  # (wandb-core retries)
                self.close_connection = True
                return
            if is_redirect(response.status):
                self._refuse_redirect(path, response)
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

        def _refuse_redirect(self, path: str, response: http.client.HTTPResponse) -> None:
            """Answer a redirect with 502 instead of passing it on: wandb-core would send
            the body, and from its second try the API key, wherever it points. The run
            (every run being sent, for a request of none) is told why."""
            location = (response.getheader("Location") or "")[:200]
            response.close()
            if self.upstream is not None:  # (its answer's body is not read: not kept)
                self.upstream.close()
                self.upstream = None
            match = _FILE_STREAM.match(urllib.parse.urlsplit(path).path)
            run_id = urllib.parse.unquote(match["run"]) if match else ""
            said(
                run_id,
                (
                    f"the server answered {response.status} {response.reason}, a redirect to "
                    f"{location!r}: not followed (wandb-core would send the run's lines and the "
                    "API key there); nothing was sent to it. Check WANDB_BASE_URL"
                ),
            )
            self.send_error(502, "the server answered a redirect: not followed")
            self.close_connection = True

        def _exchange(
            self, path: str, headers: list[tuple[str, str]], body: bytes
        ) -> http.client.HTTPResponse:
            """Send the request on this client connection's server connection, opening it
            (again) when there is none or the kept one was closed by the server."""
            for attempt in range(2):
                fresh = self.upstream is None
                if fresh:
                    self.upstream = upstream.connect()
                try:
                    self.upstream.putrequest(
                        self.command,
                        upstream.target(path),
                        skip_host=True,
                        skip_accept_encoding=True,
                    )
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


def main(base_url: str) -> None:
    """Serve until standard input ends; plans come in on it, conflicts go out (see above)."""
    # (both http.server and http.client read headers through this one function)
    http.client.parse_headers = parse_headers
    offsets, token = Offsets(), secrets.token_urlsafe(24)
    out_lock = threading.Lock()

    def say(message: dict) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def said(run_id: str, why: str) -> None:
        say({"conflict": run_id, "why": why})

    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), handler(Upstream(base_url), offsets, token, said)
    )
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say({"port": server.server_address[1], "token": token})
    for line in sys.stdin:
        try:
            message = json.loads(line)
            offsets.plan(str(message["plan"]), int(message["history"]))
        except (ValueError, KeyError, TypeError):
            continue  # (only wbmerge writes here)
        say({"planned": message.get("seq")})
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

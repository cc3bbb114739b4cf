"""What the server holds: the two read-only GraphQL queries wandb itself makes.

`Viewer` is what wandb asks to check a key (and it names the key's default entity);
`RunResumeStatus` is what wandb-core asks before it resumes a run: the run's history,
system-metric ("events") and console ("log") line counts and its last history line;
`RunFiles` is what wandb's public API asks for a run's files, with its state; a file is
read back as the public API's `File.download` reads it, from the file's `url`. These reads
are all wbmerge asks of the server, but for one write: a writer's claim on a run, a config
key set with `UpsertBucket` as wandb-core sets the config (see `claims`). Every upload goes
through `wandb sync`.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..errors import WbmergeError
from .credentials import Credentials
from .serverjson import loads

PREFLIGHT_TIMEOUT = 10.0  # seconds: an unreachable server fails within this, in one line
# Seconds a kept connection may idle and still be used. A connection a firewall dropped
# without closing it would only fail after PREFLIGHT_TIMEOUT; load balancers commonly close
# idle ones after 60 s, which the retry on a closed connection already covers.
KEEP_IDLE = 30.0
KEEP_OPEN = 16  # connections kept between questions, for threads asking at once
# Answers that say "ask again later": rate limited (429), or a gateway between us and the
# server busy or restarting (502, 503, 504). wandb retries these too. A sync asks about
# several runs at once, so it may meet W&B's rate limit; it waits as the answer's
# Retry-After says (else 1, 2, 4, ... s) for up to `RETRY_BUDGET` seconds in all per
# question, and only then fails.
RETRIED = frozenset({429, 502, 503, 504})
RETRY_BUDGET = 60.0
# A question not answered within the client's timeout is asked again in the same way,
# within the same budget (the time it waited counts): a loaded server (or machine) answers
# late, and these questions only read. Not the first question of a session
# (`viewer_entity`): a server that does not answer it fails in seconds, naming the URL.
# Nor after `LATE_IN_A_ROW` questions in a row went unanswered: a server that went away
# mid-sync fails each question at its first timeout, not after the budget.
LATE_IN_A_ROW = 3

VIEWER = "query Viewer { viewer { id entity username } }"

# The query of wandb-core's resume (core/api/graphql/query_run_resume_status.graphql).
RUN_RESUME_STATUS = """query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) {
    id name entity { id name }
    bucket(name: $name, missingOk: true) {
      id name summaryMetrics displayName logLineCount historyLineCount eventsLineCount
      historyTail eventsTail config tags wandbConfig(keys: ["t"])
    }
  }
}"""


# A run's state, names and files, as the public API reads them: `state`, `displayName`,
# `group` and `jobType` are fields of its run fragment (wandb/apis/public/runs.py), `files`
# is what `Run.files()` pages through (wandb/apis/public/files.py). Asked only of runs the
# server holds every row of already, to tell whether anything is left to send
# (`Deliverer.prepare`).
RUN_FILES = """query RunFiles($project: String!, $entity: String, $name: String!,
    $fileCursor: String, $fileLimit: Int = 50) {
  project(name: $project, entityName: $entity) {
    run(name: $name) {
      state displayName group jobType
      files(after: $fileCursor, first: $fileLimit) {
        edges { node { name sizeBytes md5 url } cursor }
        pageInfo { endCursor hasNextPage }
      }
    }
  }
}"""
# A page of a run's history rows by step, as the public API's `scan_history` asks for it
# (wandb/apis/public/history.py before wandb-core served it; wandb's internal API keeps it
# as `history_page`). `history` is a list of JSON lines; `samples` caps how many.
HISTORY_PAGE = """query HistoryPage($entity: String, $project: String!, $run: String!,
    $minStep: Int64!, $maxStep: Int64!, $pageSize: Int!) {
  project(name: $project, entityName: $entity) {
    run(name: $run) { history(minStep: $minStep, maxStep: $maxStep, samples: $pageSize) }
  }
}"""
# The mutation wandb-core creates and updates a run with, setting only config keys: the
# server keeps every key once set and replaces a key's value (`claims`).
SET_CONFIG = """mutation UpsertBucket($name: String, $project: String, $entity: String,
    $config: JSONString) {
  upsertBucket(input: {name: $name, modelName: $project, entityName: $entity, config: $config}) {
    bucket { id name }
    inserted
  }
}"""
FILES_PAGE = 500  # files asked for at a time
MAX_FILES = 100_000  # a run of more files is not listed (it is sent again)
LISTING_DEADLINE = 120.0  # seconds after which no next page of one run's files is asked
REDIRECTS = 5  # a file's URL may redirect to storage (W&B signs a bucket URL) this often
DOWNLOAD_DEADLINE = 120.0  # seconds in which the files of one run are read back, or given up


class ServerError(WbmergeError):
    """The server could not be asked, or refused: exit 1, as for a failed upload."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


@dataclass(frozen=True)
class Held:
    """What the server holds of one run (all zero when it has no such run)."""

    exists: bool = False
    history_lines: int = 0
    events_lines: int = 0
    log_lines: int = 0
    last_step: int | None = None  # `_step` of the last history line, when it has one
    last_row: dict | None = None  # the last history line itself
    # The run's summary and config as the server gives them: JSON text, read only when a
    # run is checked for being whole (`whole.not_held_whole`); and its tags.
    summary_json: str = ""
    config_json: str = ""
    tags: tuple[str, ...] = ()
    # The entity the server holds the run under, as it answered: asked with no entity, the
    # server's default for the key, which is where wandb-core put the run too.
    entity: str | None = None


@dataclass(frozen=True)
class RunListing:
    """A run's state on the server (such as "running" or "finished"), its names, and its
    files by name: their sizes in bytes, their MD5s (base64, where the server gives one),
    and the URLs of the files it was asked about."""

    state: str  # "" when the answer gives none
    names: tuple[str, str, str]  # display name, group, job type ("" where it has none)
    sizes: dict[str, int]
    md5s: dict[str, str] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)


class ServerClient:
    """Asks one W&B server (or the sink) what it holds, with a bounded wait per request.

    Connections are kept open between requests (any thread takes one): a sync asks about
    every run before and after its upload, and with a new connection (and, against W&B, a
    new TLS handshake) per request, 256 runs cost 512 handshakes. Against the sink, 256 queries
    took 0.31 s of CPU with a connection each and 0.17 s with one kept open. Behind a
    proxy (`HTTPS_PROXY`, ...), requests go through urllib, which honours it.
    """

    def __init__(
        self,
        credentials: Credentials,
        timeout: float = PREFLIGHT_TIMEOUT,
        retry_budget: float = RETRY_BUDGET,
    ) -> None:
        self.url = credentials.base_url.rstrip("/") + "/graphql"
        token = base64.b64encode(f"api:{credentials.api_key}".encode()).decode()
        self._headers = {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
        self.timeout, self.retry_budget = timeout, retry_budget
        self._late_in_a_row = 0  # questions in a row the server did not answer in time
        scheme, self._host, self._port, self._path = _http_url(credentials.base_url, self.url)
        self._https = scheme == "https"
        proxies = urllib.request.getproxies()
        self._proxied = scheme in proxies and not urllib.request.proxy_bypass(self._host)
        # Connections between two questions, with when each was last used: any thread takes
        # one (so that a thread that ends leaves its connection to the next), at most
        # `KEEP_OPEN` are kept, and `close()` closes them.
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close the connections kept between questions, and any a question still under
        way leaves (a stopped sync waits for those only briefly)."""
        with self._idle_lock:
            idle, self._idle, self._closed = self._idle, [], True
        for connection, _ in idle:
            connection.close()

    def _take(self) -> http.client.HTTPConnection | None:
        """A kept connection to ask on, None if none is kept (or only stale ones were)."""
        with self._idle_lock:
            while self._idle:
                connection, used = self._idle.pop()
                if time.monotonic() - used <= KEEP_IDLE:
                    return connection
                connection.close()  # idle so long that a NAT or proxy may have dropped it unsaid
        return None

    def _keep(self, connection: http.client.HTTPConnection) -> None:
        """Keep a connection for the next question; the stale ones go (a burst of questions
        at once leaves more kept than steady asking uses again)."""
        now = time.monotonic()
        with self._idle_lock:
            stale = [c for c, used in self._idle if now - used > KEEP_IDLE]
            self._idle = [(c, used) for c, used in self._idle if now - used <= KEEP_IDLE]
            if not self._closed and len(self._idle) < KEEP_OPEN:
                self._idle.append((connection, now))
            else:
                stale.append(connection)
        for old in stale:
            old.close()

    def query(self, query: str, variables: dict[str, Any], name: str) -> dict[str, Any]:
        """The `data` of the answer to the read-only query `query` (operation `name`), with
        this client's retries; a ServerError for anything but an answer."""
        return self._query(query, variables, name)

    def _query(
        self, query: str, variables: dict[str, Any], name: str, again_if_late: bool = True
    ) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables, "operationName": name})
        began, attempt = time.monotonic(), 0
        while True:
            try:
                status, data, retry_after = self._post(body.encode())
            except (OSError, http.client.HTTPException) as exc:
                reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
                late = isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)
                # (questions unanswered one after another: the server is gone, not busy)
                self._late_in_a_row = self._late_in_a_row + 1 if late else 0
                if not (late and again_if_late and self._late_in_a_row <= LATE_IN_A_ROW):
                    raise ServerError(f"cannot reach W&B at {self.url}: {reason}") from None
                status, data, retry_after = 0, b"", None
            else:
                self._late_in_a_row = 0
            if status and status not in RETRIED:
                break
            pause = min(2.0**attempt if retry_after is None else retry_after, 30.0)
            if time.monotonic() - began + pause > self.retry_budget:
                if not status:
                    raise ServerError(f"cannot reach W&B at {self.url}: timed out") from None
                break  # (said below, as any other answer that is not an answer)
            time.sleep(pause)
            attempt += 1
        if status in (401, 403):
            raise ServerError(f"{self.url} refused the API key (HTTP {status})")
        if status >= 300:
            raise ServerError(f"{self.url} answered HTTP {status} to {name}")
        try:
            answer = loads(data or b"{}")
        except (ValueError, RecursionError):  # (nested past json's limit: not JSON to us)
            raise ServerError(f"{self.url} answered {name} with something not JSON") from None
        if not isinstance(answer, dict) or answer.get("errors") or "data" not in answer:
            errors = answer.get("errors") if isinstance(answer, dict) else answer
            raise ServerError(f"{self.url} refused {name}: {str(errors)[:200]}")
        if not isinstance(answer["data"] or {}, dict):
            raise ServerError(f"{self.url} answered {name} with data that is not an object")
        return answer["data"] or {}

    def _post(self, body: bytes) -> tuple[int, bytes, float | None]:
        """POST `body` to the GraphQL endpoint: (HTTP status, answer, its Retry-After).

        A kept connection the server has closed meanwhile fails on its next request; the
        request is then sent once more on a new connection (these queries only read).
        """
        if self._proxied:
            request = urllib.request.Request(self.url, body, self._headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.status, response.read(), None
            except urllib.error.HTTPError as exc:
                return exc.code, b"", _seconds(exc.headers.get("Retry-After"))
        kept = self._take()  # (kept again only after a whole exchange)
        if kept is not None:
            try:
                answer = self._exchange(kept, body)
            except (ConnectionError, http.client.HTTPException):
                kept.close()  # closed by the server while kept: once more, on a new one
            except BaseException:
                kept.close()
                raise
            else:
                self._keep(kept)
                return answer
        connection = self._connect()
        try:
            answer = self._exchange(connection, body)
        except BaseException:
            connection.close()
            raise
        self._keep(connection)
        return answer

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(
                self._host,
                self._port,
                timeout=self.timeout,
                context=ssl.create_default_context(),
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)

    def _exchange(
        self, connection: http.client.HTTPConnection, body: bytes
    ) -> tuple[int, bytes, float | None]:
        connection.request("POST", self._path, body, self._headers)
        response = connection.getresponse()
        data = response.read()
        if response.will_close:
            connection.close()  # (the next request opens it again)
        return response.status, data, _seconds(response.getheader("Retry-After"))

    def viewer_entity(self) -> str | None:
        """Check that the server answers and takes the key; returns the key's default entity."""
        viewer = self._query(VIEWER, {}, "Viewer", again_if_late=False).get("viewer") or {}
        entity = viewer.get("entity")
        return entity if isinstance(entity, str) and entity else None

    def held(self, entity: str | None, project: str, run_id: str) -> Held:
        """RunResumeStatus of one run, as counts and the last step."""
        variables = {"project": project, "entity": entity, "name": run_id}
        data = self._query(RUN_RESUME_STATUS, variables, "RunResumeStatus")
        model = data.get("model")
        bucket = model.get("bucket") if isinstance(model, dict) else model
        if not bucket:
            return Held()
        if not isinstance(bucket, dict):
            raise ServerError(f"{self.url} answered RunResumeStatus of {run_id} with no run object")
        last_row = _last_row(bucket.get("historyTail"))
        return Held(
            exists=True,
            history_lines=self._line_count(bucket, "historyLineCount", run_id),
            events_lines=self._line_count(bucket, "eventsLineCount", run_id),
            log_lines=self._line_count(bucket, "logLineCount", run_id),
            last_step=_step(last_row),
            last_row=last_row,
            summary_json=_text(bucket.get("summaryMetrics")),
            config_json=_text(bucket.get("config")),
            tags=_tags(bucket.get("tags")),
            entity=_entity_name(model),
        )

    def set_config(
        self, entity: str | None, project: str, run_id: str, values: dict[str, Any]
    ) -> None:
        """Set config keys of a run (created if the server has none), each to its value.
        Asked again as the reads are: setting a key to the same value twice is harmless."""
        config = json.dumps({key: {"value": value} for key, value in values.items()})
        variables = {"name": run_id, "project": project, "entity": entity, "config": config}
        self._query(SET_CONFIG, variables, "UpsertBucket")

    def history_page(
        self, entity: str | None, project: str, run_id: str, steps: tuple[int, int], most: int
    ) -> list[dict]:
        """The history rows the server holds of a run at steps [start, end), in step order,
        at most `most` of them (a server may sample a range of more). The answer is
        untrusted: anything but a list of JSON objects is a ServerError."""
        variables = {
            "entity": entity,
            "project": project,
            "run": run_id,
            "minStep": steps[0],
            "maxStep": steps[1],
            "pageSize": most,
        }
        data = self._query(HISTORY_PAGE, variables, "HistoryPage")
        project_data = data.get("project")
        run = project_data.get("run") if isinstance(project_data, dict) else None
        lines = run.get("history") if isinstance(run, dict) else None
        if not isinstance(lines, list):
            raise ServerError(f"{self.url} answered HistoryPage of {run_id} with no history")
        rows = []
        for line in lines:
            try:
                row = loads(line) if isinstance(line, str) else line
            except (ValueError, RecursionError):
                row = None
            if not isinstance(row, dict):
                raise ServerError(
                    f"{self.url} answered HistoryPage of {run_id} with a row "
                    "that is not a JSON object"
                )
            rows.append(row)
        return rows

    def run_files(
        self, entity: str | None, project: str, run_id: str, urls_of: Collection[str] = ()
    ) -> RunListing | None:
        """The run's state, names and files (None: no such run), a page of `FILES_PAGE` at a
        time, with the URL of each file named in `urls_of`. The answers are untrusted: one
        that is not a file list, that lists more than `MAX_FILES` files, or gives a cursor
        it gave before is a ServerError, and so is a listing with more pages after
        `LISTING_DEADLINE` seconds (checked between pages: one page is bounded by the
        client's timeout and retries). The run is then sent."""
        sizes: dict[str, int] = {}
        md5s: dict[str, str] = {}
        urls: dict[str, str] = {}
        cursors: set[str] = set()
        cursor = None
        deadline = time.monotonic() + LISTING_DEADLINE
        while True:
            variables = {
                "project": project,
                "entity": entity,
                "name": run_id,
                "fileCursor": cursor,
                "fileLimit": FILES_PAGE,
            }
            project_data = self._query(RUN_FILES, variables, "RunFiles").get("project")
            run = project_data.get("run") if isinstance(project_data, dict) else None
            if not run:
                return None
            files = run.get("files") if isinstance(run, dict) else None
            page = files.get("pageInfo") if isinstance(files, dict) else None
            edges = files.get("edges") if isinstance(files, dict) else None
            if not isinstance(page, dict) or not isinstance(edges, list):
                raise ServerError(f"{self.url} answered RunFiles of {run_id} with no file list")
            for edge in edges:
                file = _file_of(edge)
                if file is None:
                    raise ServerError(
                        f"{self.url} answered RunFiles of {run_id} with a file "
                        "that has no name or size"
                    )
                sizes[file[0]] = file[1]
                if isinstance(md5 := edge["node"].get("md5"), str):
                    md5s[file[0]] = md5
                if file[0] in urls_of and isinstance(url := edge["node"].get("url"), str):
                    urls[file[0]] = url
            if len(sizes) > MAX_FILES:
                raise ServerError(f"{self.url} lists over {MAX_FILES} files of {run_id}")
            if not page.get("hasNextPage"):
                names = (
                    _text(run.get("displayName")),
                    _text(run.get("group")),
                    _text(run.get("jobType")),
                )
                return RunListing(_text(run.get("state")), names, sizes, md5s, urls)
            cursor = page.get("endCursor")
            if not (isinstance(cursor, str) and cursor) or cursor in cursors:
                raise ServerError(
                    f"{self.url} answered RunFiles of {run_id} with more pages but no new cursor"
                )
            cursors.add(cursor)
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.url} took over {LISTING_DEADLINE:.0f} s to list the files of {run_id}"
                )

    def download(self, url: str, limit: int, deadline: float | None = None) -> bytes | None:
        """The file at `url` (a `RunListing` URL), or None if it is larger than `limit` bytes.

        The API key goes only to the server's own host, and not on to where it redirects
        (W&B redirects a file to storage under a signed URL); only http(s) URLs are read,
        so a server's answer cannot make this read a local file. A download still going at
        `deadline` (a `time.monotonic()`; by default `DOWNLOAD_DEADLINE` seconds from now)
        is given up. Errors are ServerErrors."""
        deadline = time.monotonic() + DOWNLOAD_DEADLINE if deadline is None else deadline
        if time.monotonic() > deadline:  # (a connection is not even opened)
            raise ServerError(f"cannot read {url[:200]}: not read by the deadline")
        try:
            scheme, host, port, _ = _http_url(url, url)
        except WbmergeError:
            raise ServerError(
                f"{self.url} gave a file URL that is not http(s): {url[:200]}"
            ) from None
        request = urllib.request.Request(url)
        if (scheme == "https", host, port) == (self._https, self._host, self._port):
            request.add_unredirected_header("Authorization", self._headers["Authorization"])
        opener = urllib.request.build_opener(_HttpRedirectsOnly)
        try:
            with opener.open(request, timeout=self.timeout) as response:
                declared = response.headers.get("Content-Length", "")
                if declared.isdigit() and int(declared) > limit:
                    return None
                data = _read_within(response, limit + 1, deadline)
        except urllib.error.HTTPError as exc:
            raise ServerError(f"{url[:200]} answered HTTP {exc.code}") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            raise ServerError(f"cannot read {url[:200]}: {reason}") from None
        return data if len(data) <= limit else None

    def read_back(self, urls: dict[str, str], limits: dict[str, int]) -> dict[str, bytes | None]:
        """The files named in `limits` from their `urls` (`RunListing.urls`), each None where
        it has no URL, could not be read (`download`), or is larger than its limit. All of
        them are read within one `DOWNLOAD_DEADLINE`: what is not read by then is None."""
        deadline = time.monotonic() + DOWNLOAD_DEADLINE
        files: dict[str, bytes | None] = {}
        for name, limit in limits.items():
            try:
                files[name] = self.download(urls[name], limit, deadline) if name in urls else None
            except ServerError:
                files[name] = None
        return files

    def _line_count(self, bucket: dict, name: str, run_id: str) -> int:
        """A line count of the server's answer: a whole number of 0 or more (none: 0). What
        the counts say decides which rows are sent, so anything else is an error."""
        count = bucket.get(name)
        if count is None:
            return 0
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
        shown = json.dumps(count)[:40] if isinstance(count, int | float | str) else "an object"
        raise ServerError(
            f"{self.url} answered RunResumeStatus of {run_id} with {name} {shown}, "
            "not a count of lines"
        )


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Follows at most `REDIRECTS` redirects, to http(s) URLs only (urllib's own handler
    follows ftp too)."""

    max_redirections = REDIRECTS

    def redirect_request(
        self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise urllib.error.URLError(f"a redirect out of http(s), to {newurl[:200]}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_within(response: http.client.HTTPResponse, most: int, deadline: float) -> bytes:
    """Up to `most` bytes of `response`, a piece at a time, until `deadline` (TimeoutError
    after it). The socket's timeout bounds each piece only: a server that sends a byte now
    and then would otherwise hold one read of many bytes without end."""
    pieces, size = [], 0
    while size < most:
        if time.monotonic() > deadline:
            raise TimeoutError("not read by the deadline")
        piece = response.read1(min(1 << 20, most - size))
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def _http_url(base_url: str, url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of `url` (below `base_url`), if it is an http or https
    URL with a host and a valid port.

    Requests go out on a connection of our own, plain unless the scheme is https: a URL of
    another scheme (a typo such as `htps://`) would send the key in the clear, and one that
    does not parse would fail in each request with a ValueError.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        # (the port always given: http.client reads a bare IPv6 host `::1` as `::`, port 1)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        place = (parts.scheme, parts.hostname or "", port, parts.path)
    except ValueError:  # a port that is not a number of 0-65535, a bracket left open
        place = ("", "", None, "")
    if place[0] not in ("http", "https") or not place[1]:
        raise WbmergeError(
            f"WANDB_BASE_URL {base_url} is not an http(s) URL "
            "(such as https://api.wandb.ai or http://127.0.0.1:8765)"
        )
    return place


def _file_of(edge: object) -> tuple[str, int] | None:
    """(name, size) of one file edge of a RunFiles answer; None if it lacks either. W&B
    gives sizes as numbers; a string of digits is taken too."""
    node = edge.get("node") if isinstance(edge, dict) else None
    name = node.get("name") if isinstance(node, dict) else None
    size = node.get("sizeBytes") if isinstance(node, dict) else None
    if isinstance(size, str) and re.fullmatch(r"[0-9]{1,19}", size):
        size = int(size)
    if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
        return None
    return (name, size) if size >= 0 else None


def _tags(value: object) -> tuple[str, ...]:
    """The tags of the server's answer: the strings of a list (anything else: none)."""
    return tuple(t for t in value if isinstance(t, str)) if isinstance(value, list) else ()


def _entity_name(model: object) -> str | None:
    """The name of the entity a RunResumeStatus answer's project belongs to, if it says one."""
    entity = model.get("entity") if isinstance(model, dict) else None
    name = entity.get("name") if isinstance(entity, dict) else None
    return name if isinstance(name, str) and name else None


def _text(value: object) -> str:
    """A field of the server's answer that should be a string; "" for anything else."""
    return value if isinstance(value, str) else ""


def _last_row(history_tail: object) -> dict | None:
    """The last line of `historyTail` (a JSON list of JSON lines), as a dict."""
    try:
        lines = loads(history_tail) if isinstance(history_tail, str) else None
        if not (isinstance(lines, list) and lines and isinstance(lines[-1], str)):
            return None
        last = loads(lines[-1])
    except (ValueError, RecursionError):  # (nested past json's limit: not a row to us)
        return None
    return last if isinstance(last, dict) else None


def _step(row: dict | None) -> int | None:
    """The row's `_step` as a step: a number, made an int; None for anything else, NaN and
    the infinities included (as a staged row's is read, `content.read_staged`)."""
    step = (row or {}).get("_step")
    if isinstance(step, float) and not math.isfinite(step):
        return None
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else None


def _seconds(retry_after: str | None) -> float | None:
    """A Retry-After of whole seconds, as a number (None when absent or another form, such
    as an HTTP date: then the usual backoff applies)."""
    if retry_after is None or not re.fullmatch(r"[0-9]{1,9}", retry_after.strip()):
        return None
    return float(retry_after.strip())

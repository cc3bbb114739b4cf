"""How wbmerge asks a server what it holds: one kept connection for many questions, a
connection the server closed meanwhile replaced without an error, and a server that
cannot be reached or refuses the key said in one line."""

from __future__ import annotations

import gc
import json
import threading
import time
import urllib.parse
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from wbmerge.errors import WbmergeError
from wbmerge.upload import Credentials, RunListing, ServerClient, ServerError
from wbmerge.upload import serverclient as server_module
from wbmerge.upload.serverclient import LATE_IN_A_ROW


class GraphQLDouble(BaseHTTPRequestHandler):
    """Answers RunResumeStatus with 7 history lines; notes each connection's client port.
    With `close_after` set, it closes every connection after that many answers, without
    saying so first (as a server's idle timeout or a load balancer does)."""

    protocol_version = "HTTP/1.1"
    close_after: int | None = None
    status = 200
    last_step: object = 6  # `_step` of the last history line
    answer: bytes | None = None  # the whole answer instead, as it is

    busy: tuple[int, ...] = ()  # statuses answered (in turn) before the real answers
    retry_after: str | None = None  # the Retry-After header of those answers
    late: int = 0  # the first this many questions are answered only after `late_by` seconds
    late_by = 2.0

    def do_POST(self):  # (the name http.server calls)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.client_address[1], body["variables"].get("name")))
        if len(self.server.seen) <= self.late:
            time.sleep(self.late_by)  # (past the client's timeout: it has given up)
        if len(self.server.seen) <= len(self.busy):
            self.send_response(self.busy[len(self.server.seen) - 1])
            if self.retry_after is not None:
                self.send_header("Retry-After", self.retry_after)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        bucket = {
            "historyLineCount": 7,
            "eventsLineCount": 2,
            "logLineCount": 3,
            "historyTail": json.dumps([json.dumps({"_step": self.last_step})]),
        }
        data = self.answer or json.dumps({"data": {"model": {"bucket": bucket}}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.answered = getattr(self, "answered", 0) + 1
        if self.close_after is not None and self.answered >= self.close_after:
            self.close_connection = True

    def log_message(self, *args):
        pass

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):
            pass  # (a client that gave up on a late answer has closed the connection)


def serving(double: type, settings: dict):
    """A server on a free loopback port answering with `double`, its class attributes set
    as `settings` say; `.seen` holds what the double notes of each request."""
    handler = type("Handler", (double,), settings)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.seen = []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server(request):
    yield from serving(GraphQLDouble, dict(request.param))


def client_of(httpd, **options) -> ServerClient:
    port = httpd.server_address[1]
    return ServerClient(Credentials(f"http://127.0.0.1:{port}", "local-" + "0" * 40), **options)


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_questions_of_one_thread_share_one_connection(server):
    client = client_of(server)
    held = [client.held("me", "p", f"run-{i}") for i in range(5)]
    assert [h.history_lines for h in held] == [7] * 5
    assert held[0].last_step == 6
    assert [name for _, name in server.seen] == [f"run-{i}" for i in range(5)]
    assert len({port for port, _ in server.seen}) == 1


@pytest.mark.parametrize("server", [{"close_after": 2}], indirect=True)
def test_a_connection_the_server_closed_is_replaced_without_an_error(server):
    client = client_of(server)
    held = [client.held("me", "p", f"run-{i}") for i in range(6)]
    assert [h.history_lines for h in held] == [7] * 6
    # every question answered once, two on each connection
    assert [name for _, name in server.seen] == [f"run-{i}" for i in range(6)]
    ports = [port for port, _ in server.seen]
    assert len(set(ports)) == 3 and ports[0] == ports[1] != ports[2] == ports[3]


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_threads_do_not_share_a_connection(server):
    client = client_of(server)
    answers: list[int] = []

    def ask(thread: int) -> None:
        for i in range(20):
            answers.append(client.held("me", "p", f"run-{thread}-{i}").history_lines)

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [7] * 80
    assert sorted(name for _, name in server.seen) == sorted(
        f"run-{t}-{i}" for t in range(4) for i in range(20)
    )


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_a_thread_that_ended_leaves_its_connection_to_the_next_and_close_ends_it(server):
    """The threads of a sync come and go (one per run asked about): a connection outlives
    the thread that opened it, and `close()` closes it (no socket is left to the garbage
    collector, which a long-lived caller sees as ResourceWarnings)."""
    client = client_of(server)
    for n in range(3):
        thread = threading.Thread(target=client.held, args=("me", "p", f"run-{n}"))
        thread.start()
        thread.join()
    assert len({port for port, _ in server.seen}) == 1
    gc.collect()  # (what earlier tests left for the collector is theirs, not this client's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        client.close()
        del client
        gc.collect()
    assert [w for w in caught if w.category is ResourceWarning] == []


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_a_question_answered_after_close_does_not_keep_its_connection(server):
    """A stopped sync closes its client while a question may still be under way: the
    connection that question ends with is closed, not kept for no one."""
    client = client_of(server)
    client.held("me", "p", "before")
    client.close()
    gc.collect()  # (what earlier tests left for the collector is theirs, not this client's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        assert client.held("me", "p", "after").history_lines == 7  # (as if under way)
        del client
        gc.collect()
    assert [w for w in caught if w.category is ResourceWarning] == []


@pytest.mark.parametrize("server", [{"status": 403}], indirect=True)
def test_a_refused_key_is_one_error(server):
    with pytest.raises(ServerError, match=r"refused the API key \(HTTP 403\)"):
        client_of(server).held("me", "p", "run")


def test_an_unreachable_server_is_one_error():
    client = ServerClient(Credentials("http://127.0.0.1:9", "local-" + "0" * 40))
    with pytest.raises(ServerError, match=r"cannot reach W&B at http://127.0.0.1:9/graphql: "):
        client.held("me", "p", "run")


@pytest.mark.parametrize(
    "server",
    [{"last_step": v} for v in (float("nan"), float("inf"), -float("inf"))],
    indirect=True,
)
def test_a_last_row_whose_step_is_not_finite_has_no_step(server):
    # json writes and reads these as NaN, Infinity and -Infinity. wandb-core never sends
    # such a `_step` (it sends a row without an integer one after the row before:
    # `sentrows`), so a server's row that says one has no step, which no count equals
    held = client_of(server).held("me", "p", "run")
    assert held.exists and held.history_lines == 7
    assert held.last_step is None
    assert set(held.last_row) == {"_step"}


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_a_base_url_of_another_scheme_is_refused_before_the_key_is_sent(server):
    # A typo such as `htps://` must not send the key in the clear to the host named
    port = server.server_address[1]
    for url in (f"htps://127.0.0.1:{port}", f"ftp://127.0.0.1:{port}", f"127.0.0.1:{port}"):
        with pytest.raises(WbmergeError, match=r"WANDB_BASE_URL .* is not an http\(s\) URL"):
            ServerClient(Credentials(url, "local-" + "0" * 40)).held("me", "p", "run")
    assert server.seen == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:port", "http://[::1"])
def test_a_base_url_that_does_not_parse_is_one_error(url):
    with pytest.raises(WbmergeError, match=r"WANDB_BASE_URL .* is not an http\(s\) URL"):
        ServerClient(Credentials(url, "local-" + "0" * 40)).held("me", "p", "run")


@pytest.mark.parametrize("server", [{}], indirect=True)
def test_a_connection_idle_too_long_is_not_used_again(server, monkeypatch):
    # a connection dropped unsaid (a NAT's idle timeout) would hang a question until the
    # timeout: one idle longer than KEEP_IDLE is replaced before it is used
    from wbmerge.upload import serverclient as server_module

    monkeypatch.setattr(server_module, "KEEP_IDLE", 0.0)
    client = client_of(server)
    assert [client.held("me", "p", f"run-{i}").history_lines for i in range(3)] == [7] * 3
    assert len({port for port, _ in server.seen}) == 3


def bucket_answer(**fields) -> bytes:
    return json.dumps({"data": {"model": {"bucket": fields}}}).encode()


DEEP = "[" * 100_000 + "]" * 100_000  # past json's recursion limit
HOSTILE_ANSWERS = {
    "data-a-list": b'{"data": [1, 2]}',
    "model-a-string": b'{"data": {"model": "x"}}',
    "bucket-a-list": b'{"data": {"model": {"bucket": [1]}}}',
    "count-a-word": bucket_answer(historyLineCount="many"),
    "count-negative": bucket_answer(historyLineCount=-3),
    "count-a-fraction": bucket_answer(logLineCount=2.5),
    "count-infinite": b'{"data": {"model": {"bucket": {"eventsLineCount": 1e400}}}}',
    "count-true": bucket_answer(historyLineCount=True),
    "count-a-list": bucket_answer(historyLineCount=[7]),
    "answer-nested-deep": DEEP.encode(),
}


@pytest.mark.parametrize(
    "server",
    [{"answer": a} for a in HOSTILE_ANSWERS.values()],
    indirect=True,
    ids=HOSTILE_ANSWERS.keys(),
)
def test_an_answer_that_is_not_what_wandb_expects_is_one_error(server):
    # the server's answer is untrusted input: a line naming the server, never a traceback
    with pytest.raises(ServerError, match=r"^http://127\.0\.0\.1:\d+/graphql answered "):
        client_of(server).held("me", "p", "run")


UNREADABLE_TAILS = {
    "tail-nested-deep": DEEP,
    "tail-an-object": json.dumps({"_step": 6}),
    "tail-line-nested-deep": json.dumps([DEEP]),
    "tail-line-a-list": json.dumps([json.dumps([6])]),
}


@pytest.mark.parametrize(
    "server",
    [
        {"answer": bucket_answer(historyLineCount=7, historyTail=t)}
        for t in UNREADABLE_TAILS.values()
    ],
    indirect=True,
    ids=UNREADABLE_TAILS.keys(),
)
def test_a_history_tail_that_cannot_be_read_is_no_last_row(server):
    held = client_of(server).held("me", "p", "run")
    assert held.exists and held.history_lines == 7
    assert held.last_row is None and held.last_step is None


@pytest.mark.parametrize(
    "server",
    [{"busy": (429, 503, 502, 504), "retry_after": "0"}, {"busy": (429,), "retry_after": "1"}],
    indirect=True,
)
def test_a_busy_or_rate_limited_server_is_asked_again_as_it_says(server):
    client = client_of(server)
    began = time.monotonic()
    held = client.held("me", "p", "run-0")
    took = time.monotonic() - began
    assert held.history_lines == 7
    assert [name for _, name in server.seen] == ["run-0"] * (
        len(server.RequestHandlerClass.busy) + 1
    )
    if server.RequestHandlerClass.retry_after == "1":
        assert took >= 1.0  # it waited as asked


@pytest.mark.parametrize("server", [{"busy": (429,) * 100, "retry_after": "1"}], indirect=True)
def test_a_server_that_stays_rate_limited_fails_after_the_retry_budget(server):
    client = client_of(server, retry_budget=2.5)
    began = time.monotonic()
    with pytest.raises(ServerError, match=r"answered HTTP 429 to RunResumeStatus"):
        client.held("me", "p", "run-0")
    assert 2.0 <= time.monotonic() - began  # it waited as told (no upper bound: a busy machine)
    assert len(server.seen) == 3  # asked at 0, 1 and 2 s; a third wait would pass the budget


@pytest.mark.parametrize("server", [{"late": 2}], indirect=True)
def test_a_question_answered_too_late_is_asked_again(server):
    # A loaded server (or machine) answers after the client's timeout: read-only questions
    # are asked again, backing off, the time spent counted in the retry budget. Before,
    # the first late answer failed the run ("cannot reach W&B ...: timed out").
    held = client_of(server, timeout=0.5).held("me", "p", "run-0")
    assert held.history_lines == 7
    assert [name for _, name in server.seen] == ["run-0"] * 3


@pytest.mark.parametrize("server", [{"late": 100, "late_by": 1.0}], indirect=True)
def test_a_server_that_stays_late_fails_after_the_retry_budget(server):
    client = client_of(server, timeout=0.3, retry_budget=2.0)
    with pytest.raises(ServerError, match=r"cannot reach W&B at .*: timed out"):
        client.held("me", "p", "run-0")
    assert 1 <= len(server.seen) <= 2  # (at 0 and 1.3 s; a third try would pass 2 s)


@pytest.mark.parametrize("server", [{"late": 100, "late_by": 1.0}], indirect=True)
def test_a_server_gone_mid_sync_fails_each_later_question_at_once(server):
    # After LATE_IN_A_ROW unanswered questions in a row the server is taken for gone: a
    # sync of 256 runs would otherwise spend the whole budget on each of them.
    client = client_of(server, timeout=0.2)
    with pytest.raises(ServerError, match=r"timed out"):
        client.held("me", "p", "run-0")
    assert len(server.seen) == LATE_IN_A_ROW + 1
    with pytest.raises(ServerError, match=r"timed out"):
        client.held("me", "p", "run-1")
    assert len(server.seen) == LATE_IN_A_ROW + 2


@pytest.mark.parametrize("server", [{"late": 1}], indirect=True)
def test_the_first_question_of_a_session_is_not_asked_again(server):
    # A server that does not answer who the key belongs to fails the sync in seconds.
    with pytest.raises(ServerError, match=r"cannot reach W&B at .*: timed out"):
        client_of(server, timeout=0.5).viewer_entity()
    assert len(server.seen) == 1


@pytest.mark.parametrize("server", [{"busy": (500,)}], indirect=True)
def test_a_server_error_is_not_asked_again(server):
    with pytest.raises(ServerError, match=r"answered HTTP 500 to RunResumeStatus"):
        client_of(server).held("me", "p", "run-0")
    assert len(server.seen) == 1


@pytest.mark.parametrize(
    "server",
    [
        {"busy": (429,), "retry_after": value}
        for value in ("Wed, 21 Oct 2015 07:28:00 GMT", "²", "-5")
    ],
    indirect=True,
)
def test_a_retry_after_that_is_not_whole_seconds_falls_back_to_backing_off(server):
    began = time.monotonic()
    # A budget of 1.5 s holds the first backoff (1 s) and no wait read from the header.
    assert client_of(server, retry_budget=1.5).held("me", "p", "run-0").history_lines == 7
    assert 1.0 <= time.monotonic() - began  # it did back off


class RunFilesDouble(BaseHTTPRequestHandler):
    """Answers RunFiles: the state and names of a run and its `files` a page at a time, as
    W&B pages them (`fileLimit` after the cursor `fileCursor`). `broken` makes each answer's
    file list what it says instead."""

    protocol_version = "HTTP/1.1"
    files: tuple[tuple[str, object], ...] = ()
    broken: str = ""

    def do_POST(self):  # (the name http.server calls)
        variables = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["variables"]
        self.server.seen.append((variables["fileCursor"], variables["fileLimit"]))
        start = int(variables["fileCursor"] or -1) + 1
        limit = len(self.files) if self.broken == "one-page" else variables["fileLimit"]
        page = self.files[start : start + limit]
        edges = [
            {
                "node": {
                    "name": n,
                    "sizeBytes": s,
                    "md5": f"md5 of {n}",
                    "url": f"https://files.example/{n}",
                },
                "cursor": str(start + i),
            }
            for i, (n, s) in enumerate(page)
        ]
        info = {
            "endCursor": edges[-1]["cursor"] if edges else None,
            "hasNextPage": start + len(page) < len(self.files),
        }
        if self.broken == "endless":
            info = {"endCursor": "0", "hasNextPage": True}
        if self.broken == "more-without-cursor":
            info = {"endCursor": None, "hasNextPage": True}
        files = {"edges": edges, "pageInfo": info}
        if self.broken == "no-page-info":
            files = {"edges": edges}
        run = {
            "state": "finished",
            "displayName": "d",
            "group": "g",
            "jobType": None,
            "files": files,
        }
        data = json.dumps({"data": {"project": {"run": run}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def files_server(request):
    yield from serving(RunFilesDouble, dict(request.param))


FIVE_FILES = tuple((f"media/{i}.png", 10 * i) for i in range(4)) + (("output.log", "7"),)


@pytest.mark.parametrize("files_server", [{"files": FIVE_FILES}], indirect=True)
def test_run_files_reads_every_page(files_server, monkeypatch):
    monkeypatch.setattr(server_module, "FILES_PAGE", 2)
    found = client_of(files_server).run_files("me", "p", "run")
    names = [name for name, _ in FIVE_FILES]
    assert found == RunListing(
        "finished",
        ("d", "g", ""),
        {**dict(FIVE_FILES[:4]), "output.log": 7},
        {name: f"md5 of {name}" for name in names},
    )
    assert files_server.seen == [(None, 2), ("1", 2), ("3", 2)]


SEVEN_FILES = tuple((f"{i}.txt", i) for i in range(7))


@pytest.mark.parametrize(
    "files_server, message",
    [
        ({"files": FIVE_FILES, "broken": "endless"}, "more pages but no new cursor"),
        ({"files": FIVE_FILES, "broken": "more-without-cursor"}, "more pages but no new cursor"),
        ({"files": FIVE_FILES, "broken": "no-page-info"}, "with no file list"),
        ({"files": SEVEN_FILES, "broken": "one-page"}, "lists over 6 files"),
        ({"files": (("a.png", -1),)}, "a file that has no name or size"),
        ({"files": (("a.png", "１２"),)}, "a file that has no name or size"),  # (not ASCII)
        ({"files": ((None, 3),)}, "a file that has no name or size"),
    ],
    indirect=["files_server"],
)
def test_a_file_list_that_is_not_one_is_one_error(files_server, message, monkeypatch):
    monkeypatch.setattr(server_module, "FILES_PAGE", 2)
    monkeypatch.setattr(server_module, "MAX_FILES", 6)
    with pytest.raises(ServerError, match=message):
        client_of(files_server).run_files("me", "p", "run")


@pytest.mark.parametrize("files_server", [{"files": FIVE_FILES}], indirect=True)
def test_a_file_list_that_takes_too_long_is_one_error(files_server, monkeypatch):
    monkeypatch.setattr(server_module, "FILES_PAGE", 2)
    monkeypatch.setattr(server_module, "LISTING_DEADLINE", 0.0)
    with pytest.raises(ServerError, match=r"took over 0 s to list the files of run"):
        client_of(files_server).run_files("me", "p", "run")
    assert len(files_server.seen) == 1  # (no page asked after the deadline)


@pytest.mark.parametrize("files_server", [{"files": FIVE_FILES}], indirect=True)
def test_run_files_gives_the_urls_of_the_files_asked_about(files_server, monkeypatch):
    monkeypatch.setattr(server_module, "FILES_PAGE", 2)
    found = client_of(files_server).run_files("me", "p", "run", urls_of=("output.log", "x.txt"))
    assert found.urls == {"output.log": "https://files.example/output.log"}


class FileDouble(BaseHTTPRequestHandler):
    """Serves GET: `/own/NAME` answers NAME's bytes from `files`, `/to/URL` redirects to
    URL (quoted), anything else is 404; notes each request's path and Authorization."""

    protocol_version = "HTTP/1.1"
    files: dict[str, bytes] = {}

    def do_GET(self):  # (the name http.server calls)
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/drip":  # a byte every 0.1 s, of 100 said
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if self.path.startswith("/to/"):
            self.send_response(302)
            self.send_header("Location", urllib.parse.unquote(self.path.removeprefix("/to/")))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.files.get(self.path.removeprefix("/own/"))
        self.send_response(404 if data is None else 200)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def file_server():
    yield from serving(FileDouble, {"files": {"summary": b'{"_step": 29}', "big": b"x" * 100}})


def test_a_file_is_read_with_the_key_only_from_the_servers_own_host(file_server):
    """The key goes to the server's host and port, not to another host that the server
    names or redirects to (W&B redirects a file to storage under a signed URL)."""
    client, port = client_of(file_server), file_server.server_address[1]
    own, other = f"http://127.0.0.1:{port}", f"http://localhost:{port}"
    assert client.download(f"{own}/own/summary", 100) == b'{"_step": 29}'
    assert client.download(f"{other}/own/summary", 100) == b'{"_step": 29}'
    away = urllib.parse.quote(f"{other}/own/summary", safe="")
    assert client.download(f"{own}/to/{away}", 100) == b'{"_step": 29}'
    [with_key, *without] = [auth for _, auth in file_server.seen]
    assert with_key.startswith("Basic ") and without == [None, with_key, None]


def test_a_file_that_cannot_be_read_whole_is_said(file_server, tmp_path):
    client, own = client_of(file_server), f"http://127.0.0.1:{file_server.server_address[1]}"
    assert client.download(f"{own}/own/big", 100) == b"x" * 100
    assert client.download(f"{own}/own/big", 99) is None  # (larger than the limit: not read)
    secret = tmp_path / "secret"
    secret.write_text("local")
    for url, message in [
        (f"{own}/own/gone", "answered HTTP 404"),
        (f"file://{secret}", "not http"),
        (f"{own}/to/" + urllib.parse.quote(f"file://{secret}", safe=""), "HTTP 302"),  # (urllib)
        (f"{own}/to/" + urllib.parse.quote("ftp://127.0.0.1/x", safe=""), "a redirect out of"),
    ]:
        with pytest.raises(ServerError, match=message):
            client.download(url, 100)
    files = client.read_back(
        {"big": f"{own}/own/big", "gone": f"{own}/own/gone"},
        {"big": 100, "gone": 100, "unlisted": 100},
    )
    assert files == {"big": b"x" * 100, "gone": None, "unlisted": None}


def test_a_file_sent_a_byte_at_a_time_is_given_up_at_the_deadline(file_server, monkeypatch):
    """Each byte comes within the socket's timeout; the whole read is bounded even so."""
    monkeypatch.setattr(server_module, "DOWNLOAD_DEADLINE", 0.5)
    client, own = client_of(file_server), f"http://127.0.0.1:{file_server.server_address[1]}"
    with pytest.raises(ServerError, match=r"/drip: not read by the deadline"):
        client.download(
            f"{own}/drip", 1000
        )  # (the drip would take 10 s; the line says why it ended)

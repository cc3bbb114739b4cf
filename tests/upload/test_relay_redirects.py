"""A server that answers a redirect never gets wandb-core to follow it: the relay refuses
every 3xx answer, so the file_stream body and the API key reach no other address, and the
sync fails the runs in one line saying why.

The server is the real sink behind a front that answers each file_stream POST with
`307 Location: http://127.0.0.1:P/...`, where P is a catcher that records whatever
reaches it (wandb-core 0.31 follows such a redirect, and from its second try sends the
`Authorization` header too: Go keeps it for the same host name).
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.upload import Relay

from ..conftest import job_dir
from .test_relay import ask, body

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Catcher(BaseHTTPRequestHandler):
    """Records every request (method, path, headers, body) in `caught`, answers 200."""

    protocol_version = "HTTP/1.1"
    caught: list[tuple[str, str, dict[str, str], bytes]]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def handle_one(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        self.caught.append((self.command, self.path, dict(self.headers.items()), data))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = do_PUT = handle_one


def redirecting_front(
    sink_url: str, catcher_port: int, redirected: str = "/file_stream"
) -> type[BaseHTTPRequestHandler]:
    """A front for the sink: every request is forwarded as it came, except POSTs to a path
    ending in `redirected`, answered `307` to the same path on the catcher."""
    sink_host, sink_port = sink_url.split("//", 1)[1].split(":")

    class Front(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def handle_one(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else b""
            if self.command == "POST" and self.path.endswith(redirected):
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{catcher_port}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            upstream = http.client.HTTPConnection(sink_host, int(sink_port), timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            upstream.request(self.command, self.path, data, headers)
            answer = upstream.getresponse()
            payload = answer.read()
            self.send_response(answer.status, answer.reason)
            for key, value in answer.getheaders():
                if key.lower() not in _HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            upstream.close()

        do_GET = do_POST = do_PUT = handle_one

    return Front


def serving(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def redirecting(sink) -> Iterator:
    """`redirecting(path_end)`: the URL of a front redirecting POSTs to paths ending in
    `path_end`, and what reached the catcher."""
    servers = []

    def start(redirected: str = "/file_stream") -> tuple[str, list]:
        caught: list = []
        catcher = serving(type("Catching", (Catcher,), {"caught": caught}))
        front = serving(redirecting_front(sink.url, catcher.server_address[1], redirected))
        servers.extend((front, catcher))
        return f"http://127.0.0.1:{front.server_address[1]}", caught

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def redirected(redirecting) -> tuple[str, list]:
    return redirecting()


def test_the_relay_refuses_a_redirect_and_tells_why(sink, redirected):
    url, caught = redirected
    told: list[tuple[str, str]] = []
    came = threading.Event()

    def on_conflict(run_id: str, why: str) -> None:
        told.append((run_id, why))
        came.set()

    relay = Relay(url, on_conflict)
    try:
        relay.plan("led", 0)
        stream = f"{relay.url}/files/local/relayed/led/file_stream"
        status, _ = ask(stream, sink.api_key, body(history=(0, ['{"_step": 0}'])))
        assert status == 502
        assert came.wait(30)
        [(run_id, why)] = told
        assert run_id == "led"
        assert "307" in why and "redirect" in why and "not followed" in why
        status, answer = ask(relay.url + "/graphql", sink.api_key)  # (other answers pass)
        assert status == 200 and json.loads(answer)["data"]["viewer"]["entity"] == "local"
    finally:
        relay.close()
    assert caught == []


def test_a_sync_through_a_redirecting_server_sends_nothing_there(sink, redirected, tmp_path):
    url, caught = redirected
    env = {**sink.env, "WANDB_BASE_URL": url, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    args = ["sync", str(job_dir("one_node_4")), "-p", "redir", "-e", "local", "--timeout", "120"]
    result = CliRunner().invoke(main, args, env=env)
    assert [(method, path, "Authorization" in headers) for method, path, headers, _ in caught] == []
    assert result.exit_code == 1, (result.stderr, result.stdout)
    assert "Traceback" not in result.stderr
    assert "redirect" in result.stderr and "not followed" in result.stderr


def test_a_redirect_of_a_request_of_no_run_is_refused_for_every_run(sink, redirecting):
    url, caught = redirecting("/graphql")
    told: list[tuple[str, str]] = []
    came = threading.Event()
    relay = Relay(url, lambda run_id, why: (told.append((run_id, why)), came.set()))
    try:
        assert ask(relay.url + "/graphql", sink.api_key)[0] == 502
        assert came.wait(30)
    finally:
        relay.close()
    [(run_id, why)] = told
    assert run_id == "" and "307" in why and "not followed" in why
    assert caught == []

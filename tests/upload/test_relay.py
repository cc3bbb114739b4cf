"""The upload relay: where it places each run's lines, and who may use it.

The placing is checked on file_stream bodies shaped as wandb-core 0.31 posts them; the relay
itself is checked against a real sink: what it forwards arrives as sent (the key included),
what it refuses never reaches the sink.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import io
import json
import threading
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wbmerge.errors import WbmergeError
from wbmerge.upload import Relay
from wbmerge.upload.relayprocess import Offsets, parse_headers

HISTORY, EVENTS, CONSOLE = "wandb-history.jsonl", "wandb-events.jsonl", "output.log"


def body(**files: tuple[int, list[str]]) -> bytes:
    """A file_stream body: for each file (by keyword: history, events, console) its offset
    and lines, as wandb-core posts them."""
    names = {"history": HISTORY, "events": EVENTS, "console": CONSOLE}
    return json.dumps(
        {
            "files": {names[k]: {"offset": o, "content": lines} for k, (o, lines) in files.items()},
            "dropped": 0,
        }
    ).encode()


def offsets_of(placed: bytes | None) -> dict[str, int]:
    assert placed is not None
    return {name: chunk["offset"] for name, chunk in json.loads(placed)["files"].items()}


def test_lines_land_where_planned_whatever_offset_wandb_core_begins_at():
    offsets = Offsets()
    offsets.plan("run", 1000)  # the server held 1,000 rows when the remainder was planned
    # another writer added 500 more since: wandb-core begins at 1,500, and its console and
    # system metrics where the server's counts were
    first, _ = offsets.placed(
        "run", body(history=(1500, ["a"] * 200), events=(40, ["e"]), console=(12, ["c"]))
    )
    assert offsets_of(first) == {HISTORY: 1000, EVENTS: 0, CONSOLE: 0}
    later, _ = offsets.placed("run", body(history=(1700, ["b"]), console=(13, ["d"])))
    assert offsets_of(later) == {HISTORY: 1200, CONSOLE: 1}
    retried, _ = offsets.placed("run", body(history=(1500, ["a"] * 200)))  # the same again
    assert offsets_of(retried) == {HISTORY: 1000}
    assert json.loads(retried)["files"][HISTORY]["content"] == ["a"] * 200
    assert json.loads(retried)["dropped"] == 0


def test_a_body_goes_as_it_came_only_when_no_offset_moves():
    """A body whose every offset is where wbmerge planned it is forwarded as it came, not
    written again; one whose console alone moves is rewritten all the same."""
    offsets = Offsets()
    offsets.plan("run", 0)
    raw = body(history=(0, ["a"]), events=(0, ["e"]), console=(0, ["c"]))
    assert offsets.placed("run", raw) == (raw, None)
    later = body(history=(1, ["b"]), console=(1, ["d"]))
    assert offsets.placed("run", later) == (later, None)
    offsets.plan("other", 0)
    assert offsets_of(offsets.placed("other", body(history=(0, ["a"])))[0]) == {HISTORY: 0}
    moved, _ = offsets.placed("other", body(history=(1, ["b"]), console=(12, ["c"])))
    assert offsets_of(moved) == {HISTORY: 1, CONSOLE: 0}


def test_a_new_plan_forgets_where_the_last_upload_of_the_run_began():
    offsets = Offsets()
    offsets.plan("run", 0)
    offsets.placed("run", body(history=(7, ["a"])))
    offsets.plan("run", 30)  # a later round of a follow, from what the server then held
    placed, _ = offsets.placed("run", body(history=(31, ["b"])))
    assert offsets_of(placed) == {HISTORY: 30}


def test_a_server_holding_fewer_rows_than_planned_is_a_conflict_said_once():
    offsets = Offsets()
    offsets.plan("run", 1000)
    placed, why = offsets.placed("run", body(history=(990, ["a"])))
    assert placed is None
    assert why is not None and "held 990 history rows" in why and "the 1000 wbmerge planned" in why
    assert offsets.placed("run", body(history=(991, ["b"]), events=(0, ["e"]))) == (None, None)
    offsets.plan("run", 990)  # planned again, from what the server holds now: sent
    assert offsets_of(offsets.placed("run", body(history=(990, ["a"])))[0]) == {HISTORY: 990}


@pytest.mark.parametrize(
    "raw", [b"not json", b"[1, 2]", b'{"files": [1]}', b'{"complete": true, "exitcode": 0}']
)
def test_bodies_without_files_to_place_go_as_they_came(raw):
    offsets = Offsets()
    offsets.plan("run", 5)
    assert offsets.placed("run", raw) == (raw, None)


def test_runs_without_a_plan_go_as_they_came():
    offsets = Offsets()
    offsets.plan("other", 5)
    raw = body(history=(9, ["a"]))
    assert offsets.placed("run", raw) == (raw, None)


VIEWER = json.dumps({"query": "query Viewer { viewer { id entity username } }"}).encode()


def ask(url: str, key: str, data: bytes = VIEWER) -> tuple[int, bytes]:
    token = base64.b64encode(f"api:{key}".encode()).decode()
    request = urllib.request.Request(
        url, data, {"Authorization": f"Basic {token}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_relay_forwards_only_requests_under_its_own_prefix(sink):
    relay = Relay(sink.url)
    try:
        status, answer = ask(relay.url + "/graphql", sink.api_key)
        assert status == 200 and json.loads(answer)["data"]["viewer"]["entity"] == "local"
        assert ask(relay.url + "/graphql", "x" * 40)[0] in (401, 403)  # (the caller's key)
        unprefixed = relay.url.rsplit("/", 1)[0]
        assert ask(unprefixed + "/graphql", sink.api_key)[0] == 404
        assert ask(unprefixed + "/wrong-token/graphql", sink.api_key)[0] == 404
    finally:
        relay.close()


def test_a_conflict_is_not_forwarded_and_is_told(sink):
    told: list[tuple[str, str]] = []
    came = threading.Event()

    def on_conflict(run_id: str, why: str) -> None:
        told.append((run_id, why))
        came.set()

    relay = Relay(sink.url, on_conflict)
    try:
        relay.plan("gap", 3)
        url = f"{relay.url}/files/local/relayed/gap/file_stream"
        status, _ = ask(url, sink.api_key, body(history=(0, ['{"_step": 0}'])))
        assert status == 409
        assert came.wait(30)
        assert told[0][0] == "gap" and "fewer than the 3 wbmerge planned" in told[0][1]
        assert sink.client.runs("local", "relayed") == []  # nothing reached the sink
        relay.plan("kept", 0)
        url = f"{relay.url}/files/local/relayed/kept/file_stream"
        lines = ['{"_step": 0, "x": 1}', '{"_step": 1, "x": 2}']
        assert ask(url, sink.api_key, body(history=(5, lines)))[0] == 200
        held = sink.client.run("local", "relayed", "kept")["history"]
        assert held == [{"_step": 0, "x": 1}, {"_step": 1, "x": 2}]  # at 0 and 1, not 5 and 6
    finally:
        relay.close()


def test_a_base_url_that_is_not_http_is_refused():
    with pytest.raises(WbmergeError, match="not an http"):
        Relay("ftp://127.0.0.1:1")


def post(url: str, key: str, data: bytes, headers: dict[str, str]) -> int:
    token = base64.b64encode(f"api:{key}".encode()).decode()
    request = urllib.request.Request(
        url,
        data,
        {"Authorization": f"Basic {token}", "Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_gzip_file_stream_body_has_its_lines_placed_too(sink, declared):
    """wandb-core 0.31 sends file_stream bodies plain; one gzipped (declared or not, the
    server reads both) would pass the relay with its offsets unplaced."""
    relay = Relay(sink.url)
    try:
        url = f"{relay.url}/files/local/relayed/zipped/file_stream"
        relay.plan("zipped", 0)
        first = ['{"_step": 0, "x": 1}', '{"_step": 1, "x": 2}']
        assert post(url, sink.api_key, body(history=(0, first)), {}) == 200
        relay.plan("zipped", 0)  # sent again over the same lines, by a wandb-core that
        again = ['{"_step": 0, "x": 3}', '{"_step": 1, "x": 4}']  # begins at line 7
        zipped = gzip.compress(body(history=(7, again)))
        headers = {"Content-Encoding": "gzip"} if declared else {}
        assert post(url, sink.api_key, zipped, headers) == 200
        held = sink.client.run("local", "relayed", "zipped")["history"]
        assert held == [{"_step": 0, "x": 3}, {"_step": 1, "x": 4}]  # over lines 0 and 1
    finally:
        relay.close()


@pytest.mark.parametrize("encoding", ["br", "deflate", "gzip"])
def test_a_file_stream_body_the_relay_cannot_read_is_refused_and_told(sink, encoding):
    """A body in an encoding the relay cannot unpack (or a gzip one that is broken) cannot
    have its lines placed: it is not forwarded, and the sync is told why."""
    told: list[tuple[str, str]] = []
    came = threading.Event()
    relay = Relay(sink.url, lambda run_id, why: (told.append((run_id, why)), came.set()))
    try:
        relay.plan("packed", 0)
        url = f"{relay.url}/files/local/relayed/packed/file_stream"
        packed = b"\x1f\x8b not really gzip" if encoding == "gzip" else b"\x00\x01\x02"
        assert post(url, sink.api_key, packed, {"Content-Encoding": encoding}) == 415
        assert came.wait(30)
    finally:
        relay.close()
    [(run_id, why)] = told
    assert run_id == "packed"
    assert f"a file_stream body encoded as {encoding!r}" in why and "not forwarded" in why
    assert sink.client.runs("local", "relayed") == []


# -- the relay's reading of header blocks ------------------------------------------------------

HEADER_BLOCKS = [
    b"Host: a\r\nContent-Length: 5\r\n\r\n",
    b"Host: a\nX:  spaced  \n\n",
    b"Host: a\r\nX-Folded: one\r\n two\r\n\r\n",  # (a folded field: the email parser's)
    b"Host: a\r\nnot a header\r\nY: b\r\n\r\n",  # (a line without a colon ends the fields)
    b"From nobody\r\nHost: a\r\n\r\n",
    b"Host: a\r\nX: b\rc\r\n\r\n",  # (a bare CR ends a line to the email parser)
    b": empty\r\nHost: a\r\n\r\n",
    b"Host: a\r\nX: \xe9t\xe9\r\n\r\n",
    b"Host: a\r\nX:\r\n\r\n",
    b"Host: a\r\n",  # (cut short)
    b"",
    b"Host: a\r\nHost: b\r\n\r\n",
    b"H\xe9st: a\r\n\r\n",
    b"Host :a\r\n\r\n",
]


def same_message(block: bytes) -> None:
    want = http.client.parse_headers(io.BytesIO(block))
    got = parse_headers(io.BytesIO(block))
    assert type(got) is type(want)
    assert list(got.items()) == list(want.items()), block
    assert [type(d) for d in got.defects] == [type(d) for d in want.defects], block


@pytest.mark.parametrize("block", HEADER_BLOCKS)
def test_the_relay_reads_a_header_block_as_http_client_does(block):
    same_message(block)


@given(st.lists(st.text("ab:\t \r\né-", max_size=12), max_size=6))
def test_any_header_block_is_read_as_http_client_reads_it(lines):
    same_message("".join(line + "\r\n" for line in lines).encode("iso-8859-1") + b"\r\n")


def test_a_header_block_too_long_is_refused_as_http_client_refuses_it():
    for block in (b"X: " + b"a" * 70000 + b"\r\n\r\n", b"X: a\r\n" * 101 + b"\r\n"):
        for parse in (http.client.parse_headers, parse_headers):
            with pytest.raises(http.client.HTTPException):
                parse(io.BytesIO(block))

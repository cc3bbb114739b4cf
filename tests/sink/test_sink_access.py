"""The sink on a shared machine: its own key, a private data directory, escaped pages,
checked values and run files that never run as pages.

Every test talks to a real sink process (`wbmerge sink serve`) over HTTP, as another local
user or a browser would; the end-to-end ones drive the real uploader (`wandb sync`).
"""

from __future__ import annotations

import base64
import html
import http.client
import json
import os
import re
import stat
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.sink import index_html, run_html
from wbmerge.training import RankInfo

from ..conftest import job_dir
from ..support import synthetic
from ..support.sinktools import copy_runs, expected_from_log, wandb_sync

UPSERT = (
    "mutation UpsertBucket($id: String, $name: String, $project: String, $entity: String, "
    "$summaryMetrics: JSONString, $config: JSONString, $displayName: String, "
    "$groupName: String, $tags: [String!]) { x }"
)
CREATE_RUN_FILES = (
    "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, "
    "$files: [String!]!) { x }"
)
HOSTILE = "<script>alert('x')</script>\"'><img src=x onerror=alert(1)>"


def call(sink, method, path, body=None, headers=None):
    """One request as sent (no client-side normalising): status, headers, body."""
    port = int(sink.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def basic(key: str, user: str = "api") -> str:
    return "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()


def graphql(sink, query, variables, auth=None):
    body = json.dumps({"query": query, "variables": variables}).encode()
    headers = {"Authorization": auth or sink.auth, "Content-Type": "application/json"}
    status, _, answer = call(sink, "POST", "/graphql", body, headers)
    return status, answer


def file_stream(sink, run, body, auth=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = f"/files/local/p/{run}/file_stream"
    status, _, answer = call(sink, "POST", path, data, {"Authorization": auth or sink.auth})
    return status, answer


def put_file(sink, run, name, data):
    status, answer = graphql(
        sink, CREATE_RUN_FILES, {"entity": "local", "project": "p", "run": run, "files": [name]}
    )
    assert status == 200, answer
    url = urllib.parse.urlsplit(
        json.loads(answer)["data"]["createRunFiles"]["files"][0]["uploadUrl"]
    )
    status, _, answer = call(sink, "PUT", f"{url.path}?{url.query}", data)
    assert status == 200, answer


def make_run(sink, run="r", marker="kept-value"):
    """A run with a summary, a group, six history rows and a file, through the upload API."""
    variables = {
        "entity": "local",
        "project": "p",
        "name": run,
        "groupName": "g",
        "summaryMetrics": json.dumps({"loss": marker}),
    }
    status, answer = graphql(sink, UPSERT, variables)
    assert status == 200, answer
    rows = [json.dumps({"_step": i, "loss": i}) for i in range(6)]
    status, answer = file_stream(
        sink, run, {"files": {"wandb-history.jsonl": {"offset": 0, "content": rows}}}
    )
    assert status == 200, answer
    put_file(sink, run, "notes.txt", marker.encode())


def test_the_sink_makes_its_own_key_once_and_keeps_it_private(make_sink):
    sink = make_sink()
    key_file = sink.data_dir / "api-key"
    assert re.fullmatch(r"[0-9a-f]{40}", sink.api_key)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    log = (sink.data_dir.parent / "data.log").read_text()
    assert f"WANDB_API_KEY={sink.api_key}" in log
    assert f"http://api:{sink.api_key}@127.0.0.1:" in log
    first = sink.api_key
    sink.restart()
    assert sink.api_key == first  # kept: the key in a user's environment goes on working
    other = make_sink()
    assert other.api_key != first  # each data directory has its own


WRONG_KEYS = {
    "no key": None,
    "the old any-40-characters key": basic("local-" + "0" * 40),
    "40 hex characters, not the sink's": basic("0123456789abcdef" * 2 + "01234567"),
    "the key as the user name": "SINK_KEY_AS_USER",
    "not basic auth": "Bearer SINK_KEY",
    "malformed base64": "Basic !!!",
}


@pytest.mark.parametrize("auth", WRONG_KEYS.values(), ids=WRONG_KEYS.keys())
def test_a_key_that_is_not_the_sinks_reads_and_writes_nothing(sink, auth):
    make_run(sink)
    if auth == "SINK_KEY_AS_USER":
        auth = basic("x", user=sink.api_key)
    elif auth == "Bearer SINK_KEY":
        auth = f"Bearer {sink.api_key}"
    headers = {"Authorization": auth} if auth else {}
    hostile_row = {
        "files": {
            "wandb-history.jsonl": {"offset": 5, "content": ['{"loss": -1}']},
            "wandb-summary.json": {"offset": 0, "content": ['{"loss": 0}']},
        }
    }
    upsert = {"query": UPSERT, "variables": {"entity": "local", "project": "p", "name": "new"}}
    requests = [
        ("GET", "/", None),
        ("GET", "/api/runs", None),
        ("GET", "/api/runs/local/p/r", None),
        ("GET", "/local/p/runs/r", None),
        ("GET", "/local/p/groups/g", None),
        ("GET", "/storage/local/p/r/notes.txt", None),
        ("POST", "/graphql", json.dumps(upsert).encode()),
        ("POST", "/files/local/p/r/file_stream", json.dumps(hostile_row).encode()),
        ("POST", "/api/faults", b'{"faults": ["*=500"]}'),
        ("GET", "/api/faults", None),
        ("POST", "/sdk/telemetry", b"{}"),
    ]
    for method, path, body in requests:
        status, answer_headers, answer = call(sink, method, path, body, headers)
        assert status == 401, (method, path, status, answer)
        assert answer_headers["WWW-Authenticate"].startswith('Basic realm="wbmerge sink"')
        assert b"kept-value" not in answer and b"loss" not in answer
    run = sink.client.run("local", "p", "r")
    assert run["summary"] == {"loss": "kept-value"}
    assert [row["loss"] for row in run["history"]] == [0, 1, 2, 3, 4, 5]
    assert [r["id"] for r in sink.client.runs()] == ["r"]
    assert sink.client.file("local", "p", "r", "notes.txt") == b"kept-value"


def test_wandb_sync_with_a_key_not_the_sinks_fails_and_stores_nothing(sink, tmp_path):
    [log] = [synthetic.write_rank(tmp_path, RankInfo(0, 0, 1, 1, 0, job_id="wk"), 5, metrics=1)]
    env = {**sink.env, "WANDB_API_KEY": "f" * 40, "WANDB_SILENT": "false"}
    wandb_cli = Path(sys.executable).with_name("wandb")
    result = subprocess.run(
        [str(wandb_cli), "sync", "-p", "wrong", str(log.parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # wandb sync exits 0 whatever happened; it says ERROR and does not mark the run synced
    assert "ERROR" in result.stderr, result.stderr
    assert not log.with_name(log.name + ".synced").exists()
    assert sink.client.runs() == []
    assert list((sink.data_dir / "files").rglob("*")) == []
    assert wandb_sync(sink, [log.parent], "-p", "right").returncode == 0  # the sink's key works
    assert log.with_name(log.name + ".synced").exists()
    assert [r["id"] for r in sink.client.runs()] == [expected_from_log(log).run_id]


def modes(root: Path) -> dict[str, int]:
    found = {root.name: stat.S_IMODE(root.stat().st_mode)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            found[path.relative_to(root).as_posix()] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_everything_in_the_data_directory_is_private(make_sink, tmp_path):
    sink = make_sink()  # (its data directory was made 0755 by the test's umask 022)
    runs = copy_runs(job_dir("media") / "wandb", tmp_path / "media")
    assert wandb_sync(sink, sorted(runs.glob("offline-run-*")), "-p", "m").returncode == 0
    found = modes(sink.data_dir)
    assert len(found) > 10 and any(name.endswith(".png") for name in found)
    assert "sink.sqlite3" in found and "api-key" in found and "upload-secret" in found
    readable_by_others = {name: oct(mode) for name, mode in found.items() if mode & 0o077}
    assert readable_by_others == {}


def test_an_older_sinks_data_directory_is_made_private(make_sink, tmp_path):
    sink = make_sink()
    sink.stop()
    os.chmod(sink.data_dir, 0o755)
    for name in ("sink.sqlite3", "upload-secret", "api-key"):
        os.chmod(sink.data_dir / name, 0o644)
    sink.start()
    found = modes(sink.data_dir)
    assert found["data"] == 0o700
    assert {found[n] for n in ("sink.sqlite3", "upload-secret", "api-key")} == {0o600}


def hostile_run() -> dict:
    return {
        "id": "r1",
        "entity": "local",
        "project": "p",
        "display_name": HOSTILE,
        "group": HOSTILE,
        "job_type": HOSTILE,
        "state": "failed",
        "exit_code": HOSTILE,
        "summary": {HOSTILE: HOSTILE},
        "config": {HOSTILE: [HOSTILE]},
        "history": [{"_step": 0, HOSTILE: 1.0}, {"_step": 1, HOSTILE: 2.0}],
        "system_metrics": [],
        "console": [HOSTILE],
        "files": [HOSTILE + ".txt"],
    }


def test_the_pages_escape_every_value():
    run = hostile_run()
    for page in (run_html(run), index_html([run])):
        assert "<script" not in page.lower() and "<img" not in page.lower()
        assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&quot;&#x27;&gt;" in page
        assert "onerror=alert(1)&gt;" in page
        for attribute in re.findall(r"(\w+)='([^']*)'", page):
            assert "<" not in attribute[1] and '"' not in attribute[1], attribute
    assert f"exit code {html.escape(HOSTILE)}," in run_html(run)


# Bodies no run may store: each is a 400 for its own request, and the other runs stay readable.
DEEP = '{"a":' * 70 + "1" + "}" * 70
BAD_STREAMS = {
    "summary not JSON": {"wandb-summary.json": {"offset": 0, "content": ["{not json"]}},
    "summary a list": {"wandb-summary.json": {"offset": 0, "content": ["[1, 2]"]}},
    "summary nested 70 deep": {"wandb-summary.json": {"offset": 0, "content": [DEEP]}},
    "summary not a string": {"wandb-summary.json": {"offset": 0, "content": [{"a": 1}]}},
    "history line not JSON": {"wandb-history.jsonl": {"offset": 0, "content": ["oops"]}},
    "history line a number": {"wandb-history.jsonl": {"offset": 0, "content": ["1"]}},
    "events line not JSON": {"wandb-events.jsonl": {"offset": 0, "content": ["{"]}},
    "offset a string": {"wandb-history.jsonl": {"offset": "5", "content": ["{}"]}},
    "offset negative": {"wandb-history.jsonl": {"offset": -1, "content": ["{}"]}},
    "offset a fraction": {"wandb-history.jsonl": {"offset": 1.5, "content": ["{}"]}},
    "offset past SQLite": {"wandb-history.jsonl": {"offset": 1 << 70, "content": ["{}"]}},
    "content a string": {"output.log": {"offset": 0, "content": "abc"}},
    "chunk a string": {"output.log": "abc"},
    "files a list": ["wandb-history.jsonl"],
}
BAD_COMPLETIONS = {
    "exit code HTML": HOSTILE,
    "exit code a fraction": 1.5,
    "exit code past 32 bits": 1 << 40,
}


@pytest.fixture(scope="module")
def shared_sink(tmp_path_factory):
    from ..support.sinktools import SinkProcess

    process = SinkProcess(tmp_path_factory.mktemp("sink") / "data")
    process.data_dir.mkdir()
    process.start()
    make_run(process, "ok")
    yield process
    process.stop()


def assert_sink_still_serves(sink):
    runs = sink.client.runs()
    assert [r["id"] for r in runs] == ["ok"] and runs[0]["summary"] == {"loss": "kept-value"}
    assert len(sink.client.run("local", "p", "ok")["history"]) == 6
    assert call(sink, "GET", "/", headers={"Authorization": sink.auth})[0] == 200
    shown = CliRunner().invoke(
        main, ["sink", "show", "--url", sink.url, "--data", str(sink.data_dir)]
    )
    assert shown.exit_code == 0 and "local/p/ok" in shown.output, shown.output


@pytest.mark.parametrize("files", BAD_STREAMS.values(), ids=BAD_STREAMS.keys())
def test_a_bad_file_stream_body_is_a_400_and_stores_nothing(shared_sink, files):
    status, answer = file_stream(shared_sink, "bad", {"files": files})
    assert status == 400, answer
    assert_sink_still_serves(shared_sink)


@pytest.mark.parametrize("code", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_a_bad_exit_code_is_a_400_and_stores_nothing(shared_sink, code):
    status, answer = file_stream(shared_sink, "bad", {"complete": True, "exitcode": code})
    assert status == 400, answer
    assert_sink_still_serves(shared_sink)


BAD_UPSERTS = {
    "summary not JSON": {"summaryMetrics": "{not json"},
    "summary a list": {"summaryMetrics": "[]"},
    "summary nested 70 deep": {"summaryMetrics": DEEP},
    "config a list": {"config": "[]"},
    "display name an object": {"displayName": {"a": 1}},
    "tags a string": {"tags": "abc"},
}


@pytest.mark.parametrize("fields", BAD_UPSERTS.values(), ids=BAD_UPSERTS.keys())
def test_a_bad_upsert_is_a_400_and_stores_nothing(shared_sink, fields):
    variables = {"entity": "local", "project": "p", "name": "bad", **fields}
    status, answer = graphql(shared_sink, UPSERT, variables)
    assert status == 400, answer
    variables["name"] = "ok"  # an existing run keeps what it had
    assert graphql(shared_sink, UPSERT, variables)[0] == 400
    assert_sink_still_serves(shared_sink)


@pytest.mark.parametrize("body", [b"[]", b'{"query": "query Viewer { x }", "variables": [1]}'])
def test_a_graphql_body_of_the_wrong_shape_is_a_400(shared_sink, body):
    headers = {"Authorization": shared_sink.auth}
    assert call(shared_sink, "POST", "/graphql", body, headers)[0] == 400
    assert_sink_still_serves(shared_sink)


NO_SCRIPTS = re.compile(r"default-src 'none'")


def test_run_files_are_downloads_and_no_response_runs_scripts(sink):
    page = b"<html><script>alert(document.domain)</script></html>"
    put_file(sink, "r", "media/page.html", page)
    put_file(sink, "r", "x.svg", b"<svg xmlns='http://www.w3.org/2000/svg' onload='alert(1)'/>")
    auth = {"Authorization": sink.auth}
    for name, data in (("media/page.html", page), ("x.svg", None)):
        status, headers, body = call(sink, "GET", f"/storage/local/p/r/{name}", headers=auth)
        assert status == 200 and (data is None or body == data)
        assert headers["Content-Disposition"].startswith("attachment;")
        assert headers["Content-Type"] == "application/octet-stream"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert "sandbox" in headers["Content-Security-Policy"]
    assert (
        "filename*=UTF-8''page.html"
        in call(sink, "GET", "/storage/local/p/r/media/page.html", headers=auth)[1][
            "Content-Disposition"
        ]
    )
    for path, headers in [
        ("/", auth),
        ("/local/p/runs/r", auth),
        ("/api/runs", auth),
        ("/api/runs", {}),
        ("/nowhere", auth),
    ]:
        status, answer_headers, _ = call(sink, "GET", path, headers=headers)
        policy = answer_headers["Content-Security-Policy"]
        assert NO_SCRIPTS.search(policy) and "script-src" not in policy, (path, policy)
        assert "frame-ancestors 'none'" in policy
        assert answer_headers["X-Content-Type-Options"] == "nosniff", path


def test_requests_from_other_sites_pages_are_refused(sink):
    body = json.dumps({"query": UPSERT, "variables": {"project": "p", "name": "csrf"}}).encode()
    # (another port of 127.0.0.1 is another origin: another user's server, say)
    for headers in [
        {"Origin": "http://127.0.0.1:9999"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": "null"},
    ]:
        status, _, answer = call(
            sink, "POST", "/graphql", body, {**headers, "Authorization": sink.auth}
        )
        assert status == 403, (headers, answer)
    assert (
        call(
            sink,
            "GET",
            "/api/runs",
            None,
            {"Sec-Fetch-Site": "cross-site", "Authorization": sink.auth},
        )[0]
        == 403
    )
    assert sink.client.runs() == []
    same = {"Origin": sink.url, "Sec-Fetch-Site": "same-origin", "Authorization": sink.auth}
    assert call(sink, "POST", "/graphql", body, same)[0] == 200
    assert [r["id"] for r in sink.client.runs()] == ["csrf"]


def serve(data: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wbmerge.sink", "--port", "0", "--data", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_refuses_a_planted_key_symlink_in_one_line(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("0123456789abcdef" * 2 + "01234567")  # a key of the right form
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "api-key").symlink_to(outside)
    result = serve(tmp_path / "data")
    assert result.returncode == 2
    assert result.stderr.startswith("wbmerge: error: cannot serve from ")
    assert len(result.stderr.splitlines()) == 1 and "API key" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_serve_refuses_a_data_directory_of_another_user(tmp_path):
    data = tmp_path / "data"
    data.mkdir(mode=0o777)
    os.chown(data, 65534, 65534)  # nobody's
    result = serve(data)
    assert result.returncode == 2 and "belongs to another user" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert list(data.iterdir()) == []


PLANTED = {"api-key": "0123456789abcdef" * 2 + "01234567", "upload-secret": "ab" * 32}


def refusal(result) -> str:
    """The one line `sink serve` refused with (exit 2)."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    return line


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root to make")
@pytest.mark.parametrize("name", PLANTED)
def test_serve_refuses_a_key_file_another_user_planted(tmp_path, name):
    """A data directory others could write (0777) may hold a key file another user put
    there, and so knows: the sink refuses it rather than take it as its own."""
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    planted = data / name
    planted.write_text(PLANTED[name] + "\n")
    os.chmod(planted, 0o644)
    os.chown(planted, 65534, 65534)  # nobody's
    result = serve(data)
    line = refusal(result)
    assert line.startswith("wbmerge: error: cannot serve from ")
    assert "belongs to another user" in line and name in line
    assert PLANTED[name] not in result.stdout + result.stderr
    assert planted.read_text() == PLANTED[name] + "\n"  # (left for its owner to remove)


def test_serve_refuses_a_key_file_with_another_name(tmp_path):
    """A hard link makes the key's bytes reachable (and replaceable) by another name."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(PLANTED["api-key"] + "\n")
    os.chmod(elsewhere, 0o600)
    (tmp_path / "data").mkdir(mode=0o700)
    os.link(elsewhere, tmp_path / "data" / "api-key")
    result = serve(tmp_path / "data")
    line = refusal(result)
    assert "hard link" in line and "api-key" in line
    assert PLANTED["api-key"] not in result.stdout + result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user needs root to make")
@pytest.mark.parametrize("name", ["sink.sqlite3", "sink.sqlite3-wal", "files"])
def test_serve_refuses_a_database_or_files_folder_another_user_planted(tmp_path, name):
    """Another user's database (or files folder) in the data directory would keep every
    run stored there readable to them, through a name of theirs elsewhere."""
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    planted = data / name
    if name == "files":
        planted.mkdir()
    else:
        planted.write_bytes(b"")
    os.chown(planted, 65534, 65534)  # nobody's
    result = serve(data)
    line = refusal(result)
    assert line.startswith("wbmerge: error: cannot serve from ")
    assert "belongs to another user" in line and name in line

"""The sink is safe to leave running: hostile names, symlinks, missing keys, foreign Hosts.

Every traversal test plants a secret file beside the sink's data directory and checks, after
the hostile request, that no file outside the data directory was created or changed (by
hash) and that the secret's bytes never came back in a response.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import subprocess
import sys
import tracemalloc
import urllib.parse
import uuid
import zlib
from pathlib import Path

import pytest

from wbmerge.sink import (
    BadName,
    ProtocolError,
    Store,
    UploadTokens,
    check_file_name,
    check_run_id,
    check_run_path,
    decode_body,
    is_loopback_host,
)

from ..support.sinktools import SinkProcess


class Site:
    """A sink whose data directory has a sibling `outside/` holding a secret file."""

    def __init__(self, root: Path, allow_faults: bool = False) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir()
        self.outside = root / "outside"
        self.outside.mkdir()
        self.secret = f"TOP-SECRET-{uuid.uuid4().hex}".encode()
        (self.outside / "secret.txt").write_bytes(self.secret)
        self.sink = SinkProcess(self.data, allow_faults=allow_faults).start()
        self.before = self.outside_files()

    @property
    def auth(self) -> str:
        """The `Authorization` header with the sink's own key."""
        return self.sink.auth

    def outside_files(self) -> dict[str, str]:
        """Every file under the test's root but outside the data directory, by sha256."""
        found = {}
        for folder, dirs, files in os.walk(self.root):  # symlinks are listed, not followed
            dirs[:] = [d for d in dirs if Path(folder, d) != self.data]
            for name in files:
                path = Path(folder, name)
                if path.name == "data.log" or not path.is_file():
                    continue
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[path.relative_to(self.root).as_posix()] = digest
        return found

    def assert_outside_untouched(self, *bodies: bytes) -> None:
        assert self.outside_files() == self.before
        for body in bodies:
            assert self.secret not in body

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, bytes]:
        """One request with its path sent exactly as given (no client-side normalising)."""
        port = int(self.sink.url.rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def graphql(self, query: str, variables: dict) -> tuple[int, dict]:
        body = json.dumps({"query": query, "variables": variables}).encode()
        status, data = self.request(
            "POST",
            "/graphql",
            body,
            {"Authorization": self.auth, "Content-Type": "application/json"},
        )
        return status, json.loads(data)

    def upload_urls(self, entity: str, project: str, run: str, files: list[str]) -> list[str]:
        """The upload URLs the sink hands out in CreateRunFiles, as wandb-core asks for them."""
        status, answer = self.graphql(
            "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, "
            "$files: [String!]!) { x }",
            {"entity": entity, "project": project, "run": run, "files": files},
        )
        assert status == 200, answer
        return [f["uploadUrl"] for f in answer["data"]["createRunFiles"]["files"]]

    def put_url(self, url: str, data: bytes) -> tuple[int, bytes]:
        parts = urllib.parse.urlsplit(url)
        return self.request("PUT", f"{parts.path}?{parts.query}", data)


@pytest.fixture
def site(tmp_path):
    made = Site(tmp_path)
    yield made
    made.sink.stop()


@pytest.fixture
def fault_site(tmp_path):
    made = Site(tmp_path, allow_faults=True)
    yield made
    made.sink.stop()


def outside_quoted(site: Site, *tail: str) -> str:
    return urllib.parse.quote(str(site.outside.joinpath(*tail)), safe="")


# Storage paths (after /storage/) that try to leave the data directory or carry names W&B
# refuses. The data directory is <root>/data and its files live in data/files/E/P/R/NAME.
TRAVERSALS = {
    "encoded slash in entity": "%2E%2E%2F%2E%2E/outside/x%2F%2E%2E/secret.txt",
    "encoded slash, lower case": "%2e%2e%2f%2e%2e/outside/x%2f%2e%2e/secret.txt",
    "encoded slash in name": "local/p/r/..%2F..%2F..%2F..%2F..%2Foutside%2Fsecret.txt",
    "absolute project": "local/{abs_outside}/x%2F../secret.txt",
    "absolute file name": "local/p/r/{abs_secret}",
    "absolute file name, double slash": "local/p/r/{abs_secret_raw}",
    "dot-dot segments in name": "local/p/r/../../../../../outside/secret.txt",
    "dot-dot run id": "local/p/../secret.txt",
    "%2e%2e segments": "%2e%2e/%2e%2e/%2e%2e/outside/secret.txt",
    "encoded backslash": "local/p/r/..%5C..%5C..%5Csecret.txt",
    "encoded NUL": "local/p/r/secret.txt%00.png",
    "run id with ;": "local/p/r%3Bx/secret.txt",
    "run id with '": "local/p/r%27x/secret.txt",
    "run id with :": "local/p/r:x/secret.txt",
    "project with #": "local/p%23q/r/secret.txt",
}


def storage_path(site: Site, template: str) -> str:
    return "/storage/" + template.format(
        abs_outside=outside_quoted(site),
        abs_secret=outside_quoted(site, "secret.txt"),
        abs_secret_raw=str(site.outside / "secret.txt"),
    )


def forged_token(site: Site, path: str) -> str:
    """The token of the decoded names in `path`: the sink's own, as if the sink had signed it."""
    parts = [urllib.parse.unquote(p) for p in path.removeprefix("/storage/").split("/")]
    entity, project, run, name = parts[0], parts[1], parts[2], "/".join(parts[3:])
    tokens = UploadTokens.for_data_dir(site.data.resolve())
    return tokens.token(entity, project, run, name)


@pytest.mark.parametrize("template", TRAVERSALS.values(), ids=TRAVERSALS.keys())
def test_storage_traversal_is_refused_and_nothing_outside_is_read_or_written(site, template):
    path = storage_path(site, template)
    get_status, got = site.request("GET", path, headers={"Authorization": site.auth})
    put_status, put_answer = site.request("PUT", path, b"overwritten", {"Authorization": site.auth})
    signed = f"{path}?token={forged_token(site, path)}"
    signed_status, signed_answer = site.request("PUT", signed, b"overwritten")
    site.assert_outside_untouched(got, put_answer, signed_answer)
    assert (site.outside / "secret.txt").read_bytes() == site.secret
    assert 400 <= get_status < 500 and 400 <= put_status < 500 and 400 <= signed_status < 500


def plant(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


SYMLINKS = {  # where a symlink is planted under data/files, and the file name then used
    "run folder links out": ("local/p/r/link", "outside", "link/secret.txt"),
    "file links out": ("local/p/r/secret.txt", "outside/secret.txt", "secret.txt"),
    "entity folder links out": ("local", "outside", "secret.txt"),
    "run folder links in": ("local/p/r/link", "data/files", "link/secret.txt"),
}


@pytest.mark.parametrize("where", SYMLINKS.values(), ids=SYMLINKS.keys())
def test_symlinks_in_the_data_directory_are_not_followed(site, where):
    link, target, name = where
    plant(site.data / "files" / link, site.root / target)
    if link == "local":  # the entity folder is the link: the run's folder is outside/p/r
        (site.outside / "p" / "r").mkdir(parents=True)
        (site.outside / "p" / "r" / "secret.txt").write_bytes(site.secret)
        site.before = site.outside_files()
    [url] = site.upload_urls("local", "p", "r", [name])
    put_status, put_answer = site.put_url(url, b"overwritten")
    get_status, got = site.request(
        "GET", urllib.parse.urlsplit(url).path, headers={"Authorization": site.auth}
    )
    site.assert_outside_untouched(got, put_answer)
    assert 400 <= put_status < 500 and 400 <= get_status < 500
    written = [
        Path(folder, f)
        for folder, _, names in os.walk(site.data / "files")
        for f in names
        if Path(folder, f).is_file() and Path(folder, f).read_bytes() == b"overwritten"
    ]
    assert written == []


def test_a_planted_temporary_file_symlink_is_not_written_through(site):
    """The old store wrote `NAME.part` then renamed it: a symlink there was written through."""
    plant(site.data / "files/local/p/r/config.yaml.part", site.outside / "secret.txt")
    [url] = site.upload_urls("local", "p", "r", ["config.yaml"])
    status, answer = site.put_url(url, b"a: 1\n")
    assert status == 200, answer
    site.assert_outside_untouched(answer)
    assert site.sink.client.file("local", "p", "r", "config.yaml") == b"a: 1\n"


UPSERT = (
    "mutation UpsertBucket($id: String, $name: String, $project: String, $entity: String) { x }"
)
BAD_RUN_PATHS = {
    "dot-dot project": {"entity": "local", "project": "..", "name": "r"},
    "slash in project": {"entity": "local", "project": "../../outside", "name": "r"},
    "absolute entity": {"entity": "/tmp", "project": "p", "name": "r"},
    "dot-dot run": {"entity": "local", "project": "p", "name": ".."},
    "slash in run": {"entity": "local", "project": "p", "name": "x/../../.."},
    "run id with ;": {"entity": "local", "project": "p", "name": "r;x"},
    "run id with #": {"entity": "local", "project": "p", "name": "r#x"},
    "run id with space at the end": {"entity": "local", "project": "p", "name": "r "},
    "run id with NUL": {"entity": "local", "project": "p", "name": "r\x00"},
    "backslash in run": {"entity": "local", "project": "p", "name": "..\\..\\x"},
}


@pytest.mark.parametrize("variables", BAD_RUN_PATHS.values(), ids=BAD_RUN_PATHS.keys())
def test_upsert_bucket_and_create_run_files_refuse_unsafe_run_names(site, variables):
    status, answer = site.graphql(UPSERT, variables)
    assert status == 400 and "data" not in answer, answer
    create = {"entity": variables["entity"], "project": variables["project"]}
    status, answer = site.graphql(
        "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, "
        "$files: [String!]!) { x }",
        {**create, "run": variables["name"], "files": ["secret.txt"]},
    )
    assert status == 400 and "data" not in answer, answer
    assert site.sink.client.runs() == []
    site.assert_outside_untouched()


BAD_FILE_NAMES = {
    "dot-dot": "../../../../../outside/secret.txt",
    "dot-dot inside": "media/../../secret.txt",
    "absolute": "/etc/passwd",
    "backslash": "..\\..\\secret.txt",
    "NUL": "secret.txt\x00.png",
    "empty component": "media//secret.txt",
    "dot": "./secret.txt",
    "empty": "",
}


@pytest.mark.parametrize("name", BAD_FILE_NAMES.values(), ids=BAD_FILE_NAMES.keys())
def test_create_run_files_refuses_unsafe_file_names(site, name):
    status, answer = site.graphql(
        "mutation CreateRunFiles($entity: String!, $project: String!, $run: String!, "
        "$files: [String!]!) { x }",
        {"entity": "local", "project": "p", "run": "r", "files": ["ok.txt", name]},
    )
    assert status == 400 and "data" not in answer, answer
    site.assert_outside_untouched()


@pytest.mark.parametrize(
    "run_path",
    ["..%2F..%2Foutside/p/r", "local/p/r%3Bx", "local/%2E%2E/r", "local/p/r%5C..", "local/p/.."],
)
def test_file_stream_refuses_unsafe_run_names(site, run_path):
    body = json.dumps({"files": {"wandb-history.jsonl": {"offset": 0, "content": ["{}"]}}})
    status, answer = site.request(
        "POST", f"/files/{run_path}/file_stream", body.encode(), {"Authorization": site.auth}
    )
    assert 400 <= status < 500, answer
    assert site.sink.client.runs() == []
    site.assert_outside_untouched(answer)


def test_file_names_with_url_characters_round_trip(site):
    names = ["media/a b#1?.txt", "weird%2Fname.txt", "ünï/cödé.json"]
    urls = site.upload_urls("local", "p", "r", names)
    for name, url in zip(names, urls, strict=True):
        status, answer = site.put_url(url, name.encode())
        assert status == 200, answer
        assert site.sink.client.file("local", "p", "r", name) == name.encode()
    assert sorted(site.sink.client.run("local", "p", "r")["files"]) == sorted(names)


def test_storage_needs_the_key_or_the_upload_token(site):
    [url, other] = site.upload_urls("local", "p", "r", ["a.txt", "b.txt"])
    path = urllib.parse.urlsplit(url).path
    assert site.request("PUT", path, b"x")[0] == 401  # no token
    assert (
        site.request("PUT", path, b"x", {"Authorization": site.auth})[0] == 401
    )  # a key is not one
    assert site.request("PUT", path + "?token=" + "0" * 64, b"x")[0] == 403
    other_token = urllib.parse.urlsplit(other).query
    assert site.request("PUT", f"{path}?{other_token}", b"x")[0] == 403  # b.txt's token
    assert not (site.data / "files/local/p/r/a.txt").exists()
    assert site.put_url(url, b"stored")[0] == 200
    status, body = site.request("GET", path)
    assert status == 401 and b"stored" not in body
    assert site.request("GET", path, headers={"Authorization": "Basic " + "x" * 8})[0] == 401
    assert site.request("GET", path, headers={"Authorization": site.auth}) == (200, b"stored")


def test_upload_urls_survive_a_restart_of_the_sink(site):
    [url] = site.upload_urls("local", "p", "r", ["late.txt"])
    site.sink.restart()  # on another free port: the URL's path and token are what count
    status, answer = site.put_url(url, b"after restart")
    assert status == 200, answer
    assert site.sink.client.file("local", "p", "r", "late.txt") == b"after restart"


def test_faults_are_refused_without_allow_faults(site):
    spec = json.dumps({"faults": ["graphql:Viewer=500"]}).encode()
    assert site.request("POST", "/api/faults", spec)[0] == 401
    assert site.request("GET", "/api/faults")[0] == 401
    assert site.request("POST", "/api/faults", spec, {"Authorization": site.auth})[0] == 403
    assert site.request("GET", "/api/faults", headers={"Authorization": site.auth})[0] == 403
    status, answer = site.graphql("query Viewer { viewer { entity } }", {})
    assert status == 200 and answer["data"]["viewer"]["entity"] == "local"


def test_faults_need_the_key_when_allowed(fault_site):
    spec = json.dumps({"faults": ["graphql:Viewer=500@1"]}).encode()
    assert fault_site.request("POST", "/api/faults", spec)[0] == 401
    assert fault_site.graphql("query Viewer { viewer { entity } }", {})[0] == 200
    status, answer = fault_site.request(
        "POST", "/api/faults", spec, {"Authorization": fault_site.auth}
    )
    assert status == 200, answer
    assert fault_site.graphql("query Viewer { viewer { entity } }", {})[0] == 500
    assert fault_site.graphql("query Viewer { viewer { entity } }", {})[0] == 200
    assert fault_site.sink.client.faults()["faults"][0]["fired"] == 1


FOREIGN_HOSTS = [
    "evil.example",
    "evil.example:8765",
    "127.0.0.1.evil.example",
    "localhost.evil",
    "10.0.0.1:80",
    "127.0.0.2",
    "[::2]:80",
    "localhost:80x",
    "",
]
LOOPBACK_HOSTS = ["127.0.0.1", "127.0.0.1:8765", "localhost", "LOCALHOST:1", "[::1]", "[::1]:9"]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_a_foreign_host_header_is_refused_everywhere(site, host):
    for method, path in [
        ("GET", "/"),
        ("GET", "/api/runs"),
        ("POST", "/graphql"),
        ("GET", "/storage/local/p/r/a.txt"),
    ]:
        status, _ = site.request(method, path, b"{}", {"Host": host, "Authorization": site.auth})
        assert status == 403, (host, path)
    assert not is_loopback_host(host)


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_host_headers_are_served(site, host):
    headers = {"Host": host, "Authorization": site.auth}
    assert site.request("GET", "/api/runs", headers=headers) == (200, b"[]")


# The checks themselves, through the public functions the server uses.


@pytest.mark.parametrize("name", ["a.txt", "media/images/x_1.png", "code/train.py", "a:b c"])
def test_safe_file_names_pass(name):
    assert check_file_name(name) == name


@pytest.mark.parametrize("name", BAD_FILE_NAMES.values(), ids=BAD_FILE_NAMES.keys())
def test_unsafe_file_names_are_refused(name):
    with pytest.raises(BadName):
        check_file_name(name)


@pytest.mark.parametrize(
    "run_id",
    [
        "",
        " r",
        "r\t",
        ".",
        "..",
        "a/b",
        "a\\b",
        "a:b",
        "a;b",
        "a,b",
        "a#b",
        "a?b",
        "a'b",
        "x" * 256,
    ],
)
def test_run_ids_wandb_refuses_are_refused(run_id):
    with pytest.raises(BadName):
        check_run_id(run_id)


def test_names_wandb_accepts_pass():
    assert check_run_path("local", "my-project_1", "par-rank-3") == (
        "local",
        "my-project_1",
        "par-rank-3",
    )


def test_store_refuses_unsafe_names_and_symlinks_without_the_server(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep")
    store = Store(tmp_path / "data")
    try:
        for entity, project, run, name in [
            ("..", "..", "..", "outside.txt"),
            ("local", str(tmp_path), "r", "outside.txt"),
            ("local", "p", "r", "../../../../outside.txt"),
            ("local", "p", "r", str(outside)),
        ]:
            with pytest.raises(ValueError):
                store.save_file(entity, project, run, name, b"overwritten")
        plant(tmp_path / "data/files/local/p/r", tmp_path)
        with pytest.raises(ValueError):
            store.save_file("local", "p", "r", "outside.txt", b"overwritten")
        with pytest.raises(ValueError):
            store.file_path("local", "p", "r", "outside.txt")
    finally:
        store.close()
    assert outside.read_bytes() == b"keep"


def test_store_refuses_a_data_directory_whose_files_folder_is_a_symlink(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data" / "files").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError):
        Store(tmp_path / "data")


def test_the_upload_secret_is_private_and_kept(tmp_path):
    first = Store(tmp_path / "data")
    first.close()
    secret = tmp_path / "data" / "upload-secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    second = Store(tmp_path / "data")
    second.close()
    assert first.upload_tokens.token("e", "p", "r", "f") == second.upload_tokens.token(
        "e", "p", "r", "f"
    )
    assert os.path.getsize(secret) == 64


def test_serve_refuses_a_planted_secret_symlink_in_one_line(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "upload-secret").symlink_to(outside)
    result = subprocess.run(
        [sys.executable, "-m", "wbmerge.sink", "--port", "0", "--data", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("wbmerge: error: cannot serve from ")
    assert len(result.stderr.splitlines()) == 1 and "upload secret" in result.stderr
    assert outside.read_bytes() == b"keep"


def test_json_nested_past_pythons_limit_is_a_bad_request_not_a_server_error(site):
    """A body, a config or a history line nested 100,000 deep is refused (400) where it is
    read, and nothing of it is stored; the sink goes on answering."""
    deep = "[" * 100_000
    headers = {"Authorization": site.auth, "Content-Type": "application/json"}
    for path in ("/graphql", "/files/local/p/r/file_stream"):
        status, answer = site.request("POST", path, deep.encode(), headers)
        assert status == 400, (path, status, answer)
    status, answer = site.graphql(
        "mutation UpsertBucket($name: String, $project: String, $entity: String, "
        "$config: JSONString) { x }",
        {"entity": "local", "project": "p", "name": "r", "config": deep},
    )
    assert status == 400, (status, answer)
    body = json.dumps({"files": {"wandb-history.jsonl": {"offset": 0, "content": [deep]}}})
    status, answer = site.request("POST", "/files/local/p/r2/file_stream", body.encode(), headers)
    assert status == 400 and b"nested too deeply" in answer, (status, answer)
    status, answer = site.graphql(UPSERT, {"entity": "local", "project": "p", "name": "ok"})
    assert status == 200, answer
    assert [run["id"] for run in site.sink.client.runs(project="p")] == ["ok"]


def _gzip_of_zeros(size: int) -> bytes:
    """`size` zero bytes gzipped, a mebibyte at a time (the bytes are never all held)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [packer.compress(chunk) for _ in range(size >> 20)]
    return b"".join([*parts, packer.flush()])


def test_a_gzip_bomb_is_refused_without_unzipping_it_whole():
    # 256 MiB of zeros gzip to a quarter of a mebibyte; unzipping stops past the limit.
    bomb = _gzip_of_zeros(256 << 20)
    assert len(bomb) < 300_000
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="larger than 1048576 bytes unzipped") as refused:
            decode_body(bomb, limit=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.status == 413
    assert peak < 8 << 20, peak  # about the limit, not the 256 MiB
    assert decode_body(gzip.compress(b" " * 1000 + b"[1]"), limit=1003) == [1]


@pytest.mark.parametrize("path", ["/graphql", "/files/local/p/r/file_stream"])
@pytest.mark.parametrize("declared", [True, False])
def test_a_gzip_body_is_read_declared_or_not_and_a_broken_one_is_a_400(site, path, declared):
    # aiohttp undoes a declared Content-Encoding itself; wandb-core's file_stream bodies
    # come gzipped without one. Either way a good body is read and a broken one is a 400.
    if path == "/graphql":
        good = {"query": "query Viewer { viewer { id } }", "variables": {}}
    else:
        good = {"files": {"wandb-history.jsonl": {"offset": 0, "content": ['{"_step": 0}']}}}
    whole = gzip.compress(json.dumps(good).encode())
    headers = {"Authorization": site.auth, **({"Content-Encoding": "gzip"} if declared else {})}
    status, answer = site.request("POST", path, whole, headers)
    assert status == 200, answer
    broken = [whole + b"trailing", b"\x1f\x8b" + bytes(20)]
    broken += (
        [] if declared else [whole[:-5], whole[:12]]
    )  # (aiohttp reads a cut one as far as it goes)
    for body in broken:
        status, answer = site.request("POST", path, body, headers)
        assert status == 400, (body, answer)
        assert b"bad gzip body" in answer or b"bad request body" in answer
    assert site.request("GET", "/api/runs", headers={"Authorization": site.auth})[0] == 200

"""Artifacts in the sink: real offline runs (written by real wandb in the test's directory)
uploaded with the real `wandb sync`, then read back and compared with the source bytes."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from wandb.sdk.artifacts._generated.operations import (
    RUN_INPUT_ARTIFACTS_GQL,
    RUN_OUTPUT_ARTIFACTS_GQL,
)
from wandb.sdk.artifacts._generated.run_input_artifacts import RunInputArtifacts
from wandb.sdk.artifacts._generated.run_output_artifacts import RunOutputArtifacts

from ..conftest import ROOT
from ..support.sinktools import wandb_sync

pytestmark = pytest.mark.e2e

PROJECT = "arts"
# The queries wandb-core 0.31 sends (measured), so that a hand-made request is one the
# sink sees from the real uploader.
CREATE_ARTIFACT = "mutation CreateArtifact ($input: CreateArtifactInput!) { createArtifact }"
CREATE_MANIFEST = "mutation CreateArtifactManifest ($artifactID: ID!) { createArtifactManifest }"
CREATE_FILES = "mutation CreateArtifactFiles ($input: CreateArtifactFilesInput!) { files }"
COMMIT = "mutation CommitArtifact ($artifactID: ID!) { commitArtifact }"
USE = "mutation UseArtifact ($input: UseArtifactInput!) { useArtifact }"
CLIENT_ID_MAPPING = "query ClientIDMapping ($clientID: ID!) { clientIDMapping }"


def write_run(root: Path, run_id: str, weights: str) -> Path:
    """A real offline run (tests/support/artifact_run.py) under `root`; its directory."""
    root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        PYTHONPATH=str(ROOT),
        WANDB_DATA_DIR=str(root / "data"),
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_CONFIG_DIR=str(root / "config"),
        WANDB_SILENT="true",
    )
    cmd = [sys.executable, "-m", "tests.support.artifact_run", str(root), run_id, weights]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (root / "wandb").glob(f"offline-run-*-{run_id}")
    return run_dir


def sync(sink, run_dir: Path, cwd: Path) -> str:
    """`wandb sync` of one run into the sink; the text of the debug log it wrote."""
    for marker in run_dir.glob("*.synced"):
        marker.unlink()  # (so that syncing a run again sends it again)
    cwd.mkdir(exist_ok=True)
    result = wandb_sync(sink, [run_dir], "-p", PROJECT, "-e", "local", cwd=cwd)
    assert result.returncode == 0, result.stderr
    logs = sorted((cwd / "wandb" / "logs").glob("debug-sync.*.log"))
    assert logs, "wandb sync wrote no debug log"
    return "".join(log.read_text() for log in logs)


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def manifest_digest(files: dict[str, bytes]) -> str:
    """The digest wandb gives a manifest of these files (wandb's documented algorithm:
    MD5 over a header and one `path:md5` line per file, by path)."""
    text = "wandb-artifact-manifest-v1\n" + "".join(
        f"{path}:{md5_b64(data)}\n" for path, data in sorted(files.items())
    )
    return hashlib.md5(text.encode()).hexdigest()


def request(sink, method, path, body=None, auth=True):
    """(status, body) of a request to the sink."""
    headers = {"Authorization": sink.auth} if auth else {}
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(sink.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def graphql(sink, query, variables):
    status, body = request(sink, "POST", "/graphql", {"query": query, "variables": variables})
    return status, json.loads(body)


def test_a_logged_artifact_arrives_committed_with_every_file(sink, tmp_path):
    weights = "weights of run one\n" * 50
    debug_log = sync(sink, write_run(tmp_path / "one", "one", weights), tmp_path / "cwd")
    assert "failed to log artifact" not in debug_log
    source = {"weights.bin": weights.encode(), "nested/copy.bin": weights.encode()}

    got = sink.client.artifact("local", PROJECT, "ckpt:best")
    assert (got["name"], got["type"], got["version"], got["state"]) == (
        "ckpt",
        "model",
        "v0",
        "COMMITTED",
    )
    assert got["digest"] == manifest_digest(source)
    assert got["aliases"] == ["best", "latest"]
    assert got["metadata"] == {"epoch": 3, "note": "<b>x</b>"}
    assert {f["name"]: (f["size"], f["md5"]) for f in got["files"]} == {
        path: (len(data), md5_b64(data)) for path, data in source.items()
    }
    for path, data in source.items():
        assert sink.client.artifact_file("local", PROJECT, "ckpt:v0", path) == data

    # The same, read with the GraphQL query a verifier can send to W&B too.
    committed = sink.client.committed_files("local", PROJECT, "ckpt:latest")
    assert committed["state"] == "COMMITTED"
    assert committed["digest"] == manifest_digest(source)
    assert committed["versionIndex"] == 0
    assert committed["files"] == {p: (len(d), md5_b64(d)) for p, d in source.items()}

    logged = sink.client.run("local", PROJECT, "one")["artifacts"]["logged"]
    assert sorted((a["name"], a["version"], a["type"]) for a in logged) == [
        ("ckpt", "v0", "model"),
        ("run-one-samples", "v0", "run_table"),
    ]


def test_the_public_apis_run_artifact_queries_read_what_arrived(sink, tmp_path):
    """wandb's own queries (`run.logged_artifacts()`), answers read by wandb's own models."""
    weights = "w\n"
    sync(sink, write_run(tmp_path / "one", "one", weights), tmp_path / "cwd")
    variables = {"entity": "local", "project": PROJECT, "run": "one", "perPage": 1}
    pages = []
    while True:
        status, answer = graphql(sink, RUN_OUTPUT_ARTIFACTS_GQL, variables)
        assert status == 200, answer
        page = RunOutputArtifacts.model_validate(answer["data"]).project.run.artifacts
        pages.append(page)
        if not page.page_info.has_next_page:
            break
        variables["cursor"] = page.page_info.end_cursor
    assert [p.total_count for p in pages] == [2, 2]
    found = {e.node.artifact_sequence.name: e.node for p in pages for e in p.edges}
    checkpoint = found["ckpt"]
    source = {"weights.bin": weights.encode(), "nested/copy.bin": weights.encode()}
    assert (checkpoint.artifact_type.name, checkpoint.version_index) == ("model", 0)
    assert checkpoint.state == "COMMITTED" and checkpoint.digest == manifest_digest(source)
    assert sorted(a.alias for a in checkpoint.aliases) == ["best", "latest"]
    assert json.loads(checkpoint.metadata) == {"epoch": 3, "note": "<b>x</b>"}
    assert (checkpoint.file_count, checkpoint.size) == (2, 2 * len(weights))
    assert found["run-one-samples"].artifact_type.name == "run_table"

    status, answer = graphql(sink, RUN_INPUT_ARTIFACTS_GQL, {**variables, "cursor": None})
    used = RunInputArtifacts.model_validate(answer["data"]).project.run.artifacts
    assert (used.total_count, used.edges) == (0, [])


def test_a_tables_run_table_artifact_arrives_and_history_references_it(sink, tmp_path):
    sync(sink, write_run(tmp_path / "one", "one", "w"), tmp_path / "cwd")
    (row,) = sink.client.run("local", PROJECT, "one")["history"]
    reference = urllib.parse.urlparse(row["samples"]["artifact_path"])
    assert reference.scheme == "wandb-client-artifact"
    client_id = reference.netloc.split(":")[0]
    status, answer = graphql(sink, CLIENT_ID_MAPPING, {"clientID": client_id})
    table = sink.client.artifact("local", PROJECT, "run-one-samples:v0")
    assert status == 200 and answer["data"]["clientIDMapping"]["serverID"] == table["id"]
    assert (table["type"], table["state"]) == ("run_table", "COMMITTED")

    files = {f["name"]: f for f in table["files"]}
    table_json = json.loads(
        sink.client.artifact_file("local", PROJECT, "run-one-samples:v0", reference.path[1:])
    )
    assert table_json["columns"] == ["step", "image"]
    ((step, image),) = table_json["data"]
    assert step == 1 and image["path"] in files
    png = sink.client.artifact_file("local", PROJECT, "run-one-samples:v0", image["path"])
    assert md5_b64(png) == files[image["path"]]["md5"]
    pixels = np.asarray(Image.open(io.BytesIO(png)))
    assert (pixels == np.arange(48, dtype=np.uint8).reshape(4, 4, 3)).all()


def test_identical_content_makes_no_second_version(sink, tmp_path):
    one = write_run(tmp_path / "one", "one", "same weights")
    sync(sink, one, tmp_path / "cwd")
    sync(sink, one, tmp_path / "cwd")  # the same run again
    sync(sink, write_run(tmp_path / "two", "two", "same weights"), tmp_path / "cwd")
    first = sink.client.artifact("local", PROJECT, "ckpt:v0")
    assert sink.client.artifact("local", PROJECT, "ckpt:latest")["id"] == first["id"]
    assert request(sink, "GET", "/api/artifacts/local/arts/ckpt:v1")[0] == 404
    logged_by_two = sink.client.run("local", PROJECT, "two")["artifacts"]["logged"]
    assert first["id"] in [a["id"] for a in logged_by_two]

    # New content is a new version, and `latest` and the alias move to it.
    debug_log = sync(sink, write_run(tmp_path / "three", "three", "new"), tmp_path / "cwd")
    assert "failed to log artifact" not in debug_log
    second = sink.client.artifact("local", PROJECT, "ckpt:latest")
    assert second["version"] == "v1" and second["aliases"] == ["best", "latest"]
    assert sink.client.artifact("local", PROJECT, "ckpt:v0")["aliases"] == []


def start_artifact(sink, files: dict[str, bytes], name="hand", kind="model"):
    """Create a pending version of `files` as wandb-core does; (its id, upload URLs)."""
    status, answer = graphql(
        sink,
        CREATE_ARTIFACT,
        {
            "input": {
                "artifactCollectionName": name,
                "artifactTypeName": kind,
                "digest": manifest_digest(files),
                "projectName": PROJECT,
                "runName": "hand",
                "entityName": "",
                "clientID": f"c-{name}",
                "aliases": [{"alias": "latest", "artifactCollectionName": name}],
                "enableDigestDeduplication": True,
            }
        },
    )
    assert status == 200, answer
    artifact = answer["data"]["createArtifact"]["artifact"]
    assert artifact["state"] == "PENDING"
    specs = [{"artifactID": artifact["id"], "name": p, "md5": md5_b64(d)} for p, d in files.items()]
    status, answer = graphql(sink, CREATE_FILES, {"input": {"artifactFiles": specs}})
    assert status == 200, answer
    edges = answer["data"]["createArtifactFiles"]["files"]["edges"]
    urls = {
        spec["name"]: edge["node"]["uploadUrl"] for spec, edge in zip(specs, edges, strict=True)
    }
    return artifact["id"], urls


def put(url: str, data: bytes) -> int:
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def upload_manifest(sink, artifact_id: str, files: dict[str, bytes]) -> int:
    manifest = json.dumps(
        {
            "version": 1,
            "storagePolicy": "wandb-storage-policy-v1",
            "contents": {p: {"digest": md5_b64(d), "size": len(d)} for p, d in files.items()},
        }
    ).encode()
    status, answer = graphql(
        sink,
        CREATE_MANIFEST,
        {
            "artifactID": artifact_id,
            "digest": md5_b64(manifest),
            "includeUpload": True,
            "manifestType": "FULL",
        },
    )
    assert status == 200, answer
    url = answer["data"]["createArtifactManifest"]["artifactManifest"]["file"]["uploadUrl"]
    return put(url, manifest)


def test_a_put_with_a_wrong_md5_is_refused_and_nothing_commits(sink):
    files = {"model.pt": b"the real bytes"}
    artifact_id, urls = start_artifact(sink, files)
    assert put(urls["model.pt"], b"other bytes") == 400
    assert request(sink, "GET", "/api/artifacts/local/arts/hand:latest/files/model.pt")[0] == 404
    assert upload_manifest(sink, artifact_id, files) == 200
    status, answer = graphql(sink, COMMIT, {"artifactID": artifact_id})
    assert status == 409 and "model.pt" in answer["errors"][0]["message"]
    assert request(sink, "GET", "/api/artifacts/local/arts/hand")[0] == 404  # no version

    # A PUT without the URL's token stores nothing either.
    assert put(urls["model.pt"].split("?")[0], files["model.pt"]) == 401
    assert put(urls["model.pt"], files["model.pt"]) == 200
    status, answer = graphql(sink, COMMIT, {"artifactID": artifact_id})
    assert status == 200 and answer["data"]["commitArtifact"]["artifact"]["id"] == artifact_id
    got = sink.client.artifact("local", PROJECT, "hand:v0")
    assert got["state"] == "COMMITTED"
    assert got["files"][0]["md5"] == md5_b64(files["model.pt"])


def test_a_manifest_that_is_not_the_artifacts_is_refused(sink):
    files = {"a.txt": b"a"}
    artifact_id, urls = start_artifact(sink, files)
    assert put(urls["a.txt"], b"a") == 200
    # Its digest is not the artifact's: it lists another file.
    assert upload_manifest(sink, artifact_id, {"a.txt": b"a", "b.txt": b"b"}) == 400
    status, _ = graphql(sink, COMMIT, {"artifactID": artifact_id})
    assert status == 409
    assert upload_manifest(sink, artifact_id, files) == 200
    assert graphql(sink, COMMIT, {"artifactID": artifact_id})[0] == 200


def test_use_artifact_records_which_run_used_which_version(sink):
    files = {"rows.csv": b"a,b\n1,2\n"}
    artifact_id, urls = start_artifact(sink, files, name="data", kind="dataset")
    assert put(urls["rows.csv"], files["rows.csv"]) == 200
    assert upload_manifest(sink, artifact_id, files) == 200
    assert graphql(sink, COMMIT, {"artifactID": artifact_id})[0] == 200
    use = {
        "input": {
            "entityName": "",
            "projectName": PROJECT,
            "runName": "reader",
            "artifactID": artifact_id,
        }
    }
    status, answer = graphql(sink, USE, use)
    assert status == 200 and answer["data"]["useArtifact"]["artifact"]["id"] == artifact_id
    used = sink.client.run("local", PROJECT, "reader")["artifacts"]["used"]
    assert [(a["name"], a["version"]) for a in used] == [("data", "v0")]
    variables = {"entity": "local", "project": PROJECT, "run": "reader"}
    status, answer = graphql(sink, RUN_INPUT_ARTIFACTS_GQL, variables)
    (edge,) = RunInputArtifacts.model_validate(answer["data"]).project.run.artifacts.edges
    assert (edge.node.id, edge.node.artifact_sequence.name) == (artifact_id, "data")
    assert sink.client.run("local", PROJECT, "hand")["artifacts"]["used"] == []


HOSTILE_CREATES = [
    {"artifactCollectionName": "../up", "artifactTypeName": "model"},
    {"artifactCollectionName": "a/b", "artifactTypeName": "model"},
    {"artifactCollectionName": "x" * 200, "artifactTypeName": "model"},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "digest": "../../etc"},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "metadata": "[1]"},
    {
        "artifactCollectionName": "ok",
        "artifactTypeName": "model",
        "metadata": "[" * 100 + "]" * 100,
    },
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "metadata": {"a": 1}},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "aliases": "best"},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "aliases": [{"alias": "v3"}]},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "aliases": [{"alias": "a:b"}]},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "clientID": ["x"]},
    {"artifactCollectionName": "ok", "artifactTypeName": "model", "runName": "../../r"},
]


@pytest.mark.parametrize("fields", HOSTILE_CREATES)
def test_hostile_artifact_requests_get_400_for_themselves_alone(sink, fields):
    spec = {"digest": "0" * 32, "projectName": PROJECT, "runName": "r", **fields}
    status, answer = graphql(sink, CREATE_ARTIFACT, {"input": spec})
    assert status == 400, answer
    assert "errors" in answer
    assert request(sink, "GET", "/api/artifacts/local/arts/ok")[0] == 404
    status, runs = request(sink, "GET", "/api/runs")
    assert status == 200 and json.loads(runs) == []


def test_a_client_id_never_reaches_another_artifact(sink):
    files = {"a.txt": b"a"}
    artifact_id, urls = start_artifact(sink, files)  # clientID "c-hand"
    spec = {
        "artifactCollectionName": "other",
        "artifactTypeName": "model",
        "clientID": "c-hand",
        "digest": manifest_digest(files),
        "projectName": PROJECT,
        "runName": "r",
        "aliases": [{"alias": "taken", "artifactCollectionName": "other"}],
    }
    status, answer = graphql(sink, CREATE_ARTIFACT, {"input": spec})
    assert status == 409 and "errors" in answer
    assert put(urls["a.txt"], b"a") == 200
    assert upload_manifest(sink, artifact_id, files) == 200
    assert graphql(sink, COMMIT, {"artifactID": artifact_id})[0] == 200
    assert sink.client.artifact("local", PROJECT, "hand:v0")["aliases"] == ["latest"]
    assert request(sink, "GET", "/api/artifacts/local/arts/other")[0] == 404


def test_a_name_keeps_its_type(sink):
    start_artifact(sink, {"a.txt": b"a"})  # "hand", a model
    spec = {
        "artifactCollectionName": "hand",
        "artifactTypeName": "dataset",
        "runName": "r",
        "digest": manifest_digest({"b.txt": b"b"}),
        "projectName": PROJECT,
    }
    status, answer = graphql(sink, CREATE_ARTIFACT, {"input": spec})
    assert status == 409 and "'model'" in answer["errors"][0]["message"]
    logged = sink.client.run("local", PROJECT, "hand")["artifacts"]["logged"]
    assert [(a["name"], a["type"]) for a in logged] == [("hand", "model")]
    assert [r["id"] for r in sink.client.runs(project=PROJECT)] == ["hand"]


def test_hostile_files_ids_and_manifests_get_400(sink):
    files = {"a.txt": b"a"}
    artifact_id, urls = start_artifact(sink, files)
    bad_files = [
        {"artifactID": artifact_id, "name": "../../etc/passwd", "md5": md5_b64(b"a")},
        {"artifactID": artifact_id, "name": "/abs", "md5": md5_b64(b"a")},
        {"artifactID": artifact_id, "name": "b.txt", "md5": "not-md5"},
        {"artifactID": "QUJD", "name": "b.txt", "md5": md5_b64(b"a")},
        {
            "artifactID": base64.b64encode(b"Artifact:999").decode(),
            "name": "b",
            "md5": md5_b64(b""),
        },
    ]
    for spec in bad_files:
        status, answer = graphql(sink, CREATE_FILES, {"input": {"artifactFiles": [spec]}})
        assert status in (400, 404) and "errors" in answer, spec
    assert graphql(sink, COMMIT, {"artifactID": "Zm9vOjE="})[0] == 400  # "foo:1"
    assert put(urls["a.txt"], b"a") == 200
    manifests = [
        b"not json",
        b'{"version": 2, "contents": {}}',
        json.dumps({"version": 1, "contents": {"../x": {"digest": md5_b64(b"a")}}}).encode(),
        json.dumps({"version": 1, "contents": {"a.txt": {"digest": 5}}}).encode(),
        json.dumps(
            {"version": 1, "contents": {"a.txt": {"digest": md5_b64(b"a"), "size": -1}}}
        ).encode(),
    ]
    for manifest in manifests:
        status, answer = graphql(
            sink,
            CREATE_MANIFEST,
            {"artifactID": artifact_id, "includeUpload": True, "digest": md5_b64(manifest)},
        )
        url = answer["data"]["createArtifactManifest"]["artifactManifest"]["file"]["uploadUrl"]
        assert put(url, manifest) == 400, manifest
    assert graphql(sink, COMMIT, {"artifactID": artifact_id})[0] == 409  # no manifest kept
    status, runs = request(sink, "GET", "/api/runs")
    assert status == 200 and [r["id"] for r in json.loads(runs)] == ["hand"]
    assert request(sink, "GET", "/local/arts/runs/hand")[0] == 200


def test_the_run_page_lists_artifacts_and_escapes_their_names(sink, tmp_path):
    sync(sink, write_run(tmp_path / "one", "one", "w"), tmp_path / "cwd")
    hostile = "<img src=x onerror=alert(1)>"
    start_artifact(sink, {"x.txt": b"x"}, name=hostile, kind="<i>")
    status, page = request(sink, "GET", "/local/arts/runs/one")
    text = page.decode()
    assert status == 200
    digest = sink.client.artifact("local", PROJECT, "ckpt:v0")["digest"]
    assert f"ckpt:v0</td><td>model</td><td><code>{digest}</code></td><td>COMMITTED" in text
    assert "run-one-samples:v0" in text and "nested/copy.bin" in text
    status, page = request(sink, "GET", "/local/arts/runs/hand")
    text = page.decode()
    assert hostile not in text and "<i>" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;:pending" in text and "PENDING" in text


def test_distributed_artifacts_manifests_are_refused_not_half_taken(sink):
    artifact_id, _ = start_artifact(sink, {"a.txt": b"a"})
    patch = {
        "artifactID": artifact_id,
        "includeUpload": True,
        "manifestType": "PATCH",
        "digest": md5_b64(b"{}"),
    }
    status, answer = graphql(sink, CREATE_MANIFEST, patch)
    assert status == 400 and "FULL" in answer["errors"][0]["message"]
    update = "mutation UpdateArtifactManifest ($artifactManifestID: ID!) { x }"
    status, answer = graphql(sink, update, {"artifactManifestID": artifact_id})
    assert "not supported" in answer["errors"][0]["message"]
    assert sink.client.run("local", PROJECT, "hand")["artifacts"]["logged"][0]["state"] == "PENDING"


def test_artifact_files_are_private_and_no_symlink_is_followed(sink, tmp_path):
    files = {"a.txt": b"first", "b.txt": b"second"}
    _, urls = start_artifact(sink, files)
    assert put(urls["a.txt"], files["a.txt"]) == 200
    stored = list((sink.data_dir / "artifacts").rglob("*"))
    assert [p.read_bytes() for p in stored if p.is_file()] == [b"first"]
    assert all(p.stat().st_mode & 0o777 == (0o700 if p.is_dir() else 0o600) for p in stored)

    # A folder planted as a symlink where the next file would be kept is not written through.
    outside = tmp_path / "outside"
    outside.mkdir()
    (sink.data_dir / "artifacts" / hashlib.md5(b"second").hexdigest()[:2]).symlink_to(outside)
    assert 400 <= put(urls["b.txt"], files["b.txt"]) < 500
    assert list(outside.iterdir()) == []

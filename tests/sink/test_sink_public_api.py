"""wandb 0.31's public API (`wandb.Api()`, the real client, through its own wandb-core) on
the sink: runs uploaded with `wbmerge sync` and the real `wandb sync`, read back and
compared with what the ranks logged (read from their `.wandb` files with protobuf)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

import pyarrow.parquet as pq
import pytest
import wandb
from click.testing import CliRunner
from wandb.errors import CommError
from wandb.sdk.artifacts._generated.operations import GET_ARTIFACT_MEMBERSHIP_FILE_URLS_GQL

from wbmerge import api as wbmerge_api
from wbmerge.cli import main
from wbmerge.sink import UploadTokens

from ..conftest import ROOT, job_dir
from ..e2e.test_sync import UNLABELLED, cli_sync, sources_of, table_artifact_of
from ..support.sinktools import (
    expected_from_log,
    system_metric_values,
    wandb_sync,
)
from ..support.tagged_runs import RUNS as TAGGED

pytestmark = pytest.mark.e2e


@pytest.fixture
def api(sink, tmp_path, monkeypatch):
    """The real public API client, pointed at the sink, its caches in the test's directory."""
    for name in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return wandb.Api(overrides={"base_url": sink.url}, api_key=sink.api_key)


def synced(sink, tmp_path, job, *args):
    result = cli_sync(sink, tmp_path, job_dir(job), *args, "-e", "local")
    assert result.exit_code == 0, result.stderr
    return sources_of(job)


def test_a_shared_run_reads_back_as_every_rank_logged_it(sink, tmp_path, api):
    ranks = synced(sink, tmp_path, "one_node_4", "--run-mode", "shared", "-p", "pub")
    run = api.run("local/pub/fx-one-node-4")
    assert (run.id, run.state, run.group, run.job_type) == ("fx-one-node-4", "finished", None, None)
    primary = ranks[0][1]
    assert {k: run.config[k] for k in primary.config if k != "wbmerge"} == {
        k: v for k, v in primary.config.items() if k != "wbmerge"
    }
    for label, want, _ in ranks.values():
        for key, value in want.summary.items():
            if key not in UNLABELLED:
                assert run.summary[f"{key}/{label}"] == value, (key, label)

    # Every row, paged: every rank's value at its step under its label, nothing more.
    rows = list(run.scan_history(page_size=7))
    assert [row["_step"] for row in rows] == list(range(30))
    expected_keys: dict[int, set] = {}
    for label, want, _ in ranks.values():
        for source in want.history:
            for key, value in source.items():
                if key not in UNLABELLED:
                    assert rows[source["_step"]][f"{key}/{label}"] == value
                    expected_keys.setdefault(source["_step"], set()).add(f"{key}/{label}")
    assert all(set(row) - UNLABELLED == expected_keys[row["_step"]] for row in rows)

    # Keys: only the rows that hold all of them, each with just those keys and `_step`.
    for label, want, _ in ranks.values():
        key = f"train/loss/{label}"
        wanted = [{"_step": r["_step"], key: r["train/loss"]} for r in want.history]
        assert list(run.scan_history(keys=[key], page_size=4)) == wanted
        assert list(run.scan_history(keys=[key], min_step=10, max_step=20)) == wanted[10:20]

    # Sampled as W&B samples: every row when they fit, else `samples` of them spread
    # over the run, the first and the last kept.
    assert run.history(samples=500, pandas=False) == rows
    sampled = run.history(samples=10, pandas=False)
    steps = [row["_step"] for row in sampled]
    assert len(steps) == 10 and steps[0] == 0 and steps[-1] == 29
    assert steps == sorted(set(steps))
    assert sampled == [rows[step] for step in steps]
    keyed = run.history(samples=6, keys=["train/loss/rank-2", "train/loss/rank-3"], pandas=False)
    assert len(keyed) == 6 and keyed[0]["_step"] == 0 and keyed[-1]["_step"] == 29
    for row in keyed:
        step = row["_step"]
        assert row == {
            "_step": step,
            "train/loss/rank-2": ranks[2][1].history[step]["train/loss"],
            "train/loss/rank-3": ranks[3][1].history[step]["train/loss"],
        }

    # System metrics: every sample of every rank, labelled.
    events = system_metric_values(run.history(stream="events", pandas=False))
    assert len(events) == sum(len(want.stats) for _, want, _ in ranks.values())
    for label, want, _ in ranks.values():
        for sample in want.stats:
            assert {k if "/l:" in k else f"{k}/l:{label}": v for k, v in sample.items()} in events

    # Files: listed with their MD5, downloaded byte for byte.
    files = list(run.files())
    assert {f.name for f in files} == set(sink.client.run("local", "pub", run.id)["files"])
    assert {"wandb-summary.json", "config.yaml", "output.log"} <= {f.name for f in files}
    for file in files:
        with open(file.download(root=str(tmp_path / "files")).name, "rb") as got:
            data = got.read()
        assert data == sink.client.file("local", "pub", run.id, file.name)
        assert file.md5 == base64.b64encode(hashlib.md5(data).digest()).decode()
    (summary_file,) = run.files(names=["wandb-summary.json"])
    assert summary_file.name == "wandb-summary.json"
    by_pattern = [f.name for f in run.files(pattern="wandb-%.json")]
    assert by_pattern == ["wandb-metadata.json", "wandb-summary.json"]
    assert [f.name for f in run.files(pattern="config._aml")] == ["config.yaml"]
    assert [f.name for f in run.files(pattern="%y%a%")] == ["config.yaml"]


def write_tagged_runs(sink, tmp_path):
    """The runs of tests/support/tagged_runs.py, written by real wandb and sent by the real
    `wandb sync` to project `filters`."""
    root = tmp_path / "tagged"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        PYTHONPATH=str(ROOT),
        WANDB_SILENT="true",
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_CONFIG_DIR=str(root / "config"),
        WANDB_DATA_DIR=str(root / "data"),
    )
    cmd = [sys.executable, "-m", "tests.support.tagged_runs", str(root)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted((root / "wandb").glob("offline-run-*"))
    assert wandb_sync(sink, runs, "-p", "filters", "-e", "local", cwd=root).returncode == 0


def test_runs_are_found_by_group_job_type_tags_and_state(sink, tmp_path, api):
    result = cli_sync(
        sink,
        tmp_path,
        job_dir("recipe_job_type"),
        "--run-mode",
        "new",
        "-p",
        "filters",
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    write_tagged_runs(sink, tmp_path)
    # One run per rank; the ranks' own job types (main for one, worker for the others).
    kinds = Counter(
        expected_from_log(log).job_type
        for log in job_dir("recipe_job_type").glob("wandb/*/run-*.wandb")
    )
    assert kinds == {"main": 1, "worker": 3}
    job = {
        run["id"]: run["job_type"]
        for run in sink.client.runs(project="filters")
        if run["id"] not in TAGGED
    }
    assert Counter(job.values()) == kinds
    (group,) = {run["group"] for run in sink.client.runs(project="filters")} - {"g1", "g2"}

    def ids(filters=None, **kwargs):
        found = api.runs("local/filters", filters=filters, **kwargs)
        names = sorted(run.id for run in found)
        assert len(found) == len(names)  # (runCount counts the runs the filter passes)
        return names

    assert ids() == sorted([*job, *TAGGED])
    assert ids({"group": group}) == sorted(job)
    assert ids({"jobType": "worker"}) == sorted(r for r, kind in job.items() if kind == "worker")
    assert ids({"$and": [{"group": "g1"}, {"jobType": "train"}]}) == ["t-a"]
    assert ids({"group": {"$in": ["g1", "g2"]}}) == ["t-a", "t-b", "t-c"]
    assert ids({"tags": "ddp"}) == ["t-a", "t-b"]
    assert ids({"tags": {"$in": ["base", "nope"]}}) == ["t-a"]
    assert ids({"state": "failed"}) == ["t-b"]
    assert ids({"$or": [{"tags": "base"}, {"state": "failed"}, {"jobType": "main"}]}) == sorted(
        ["t-a", "t-b", *(r for r, kind in job.items() if kind == "main")]
    )
    assert ids({"state": {"$ne": "finished"}}) == ["t-b"]
    assert ids({"group": "nope"}) == []
    paged = [run.id for run in api.runs("local/filters", per_page=2, order="-created_at")]
    assert sorted(paged) == sorted([*job, *TAGGED]) and len(paged) == 7
    run = api.run("local/filters/t-a")
    assert (run.tags, run.group, run.job_type, run.state) == (
        ["base", "ddp"],
        "g1",
        "train",
        "finished",
    )
    losses = [row["loss"] for row in run.scan_history(keys=["loss"])]
    assert losses == [1 / (step + 1) for step in range(5)]

    # A filter the sink does not understand is refused, naming what it refuses.
    for filters, named in (
        ({"config.lr": {"$gt": 1}}, "config.lr"),
        ({"tags": {"$all": ["ddp"]}}, "$all"),
        ({"$nor": [{"group": "g1"}]}, "$nor"),
        ({"group": {"$regex": "g"}}, "$regex"),
    ):
        with pytest.raises(Exception, match=named.replace("$", r"\$")):
            list(api.runs("local/filters", filters=filters))


def test_a_query_the_sink_does_not_know_is_an_error_naming_it(sink):
    answer = sink.client.graphql("query RunStorageReport { viewer { id } }", {})
    assert answer["errors"][0]["message"] == (
        "operation RunStorageReport is not supported by this sink"
    )
    assert "data" not in answer


def test_artifacts_of_a_merged_run_are_listed_used_and_downloaded(sink, tmp_path, api):
    synced(sink, tmp_path, "media", "--run-mode", "shared", "-p", "media")
    name, files, _ = table_artifact_of(job_dir("media"))
    run = api.run("local/media/fx-media")
    (logged,) = run.logged_artifacts()
    assert (logged.type, logged.version) == ("run_table", "v0")
    assert logged.name == f"run-fx-media-{name.split('-', 2)[2]}:v0"
    artifact = api.artifact(f"local/media/{logged.name}")
    assert (artifact.id, artifact.digest) == (logged.id, logged.digest)
    assert {f.name: f.size for f in artifact.files()} == {p: s for p, (s, _) in files.items()}
    root = artifact.download(root=str(tmp_path / "artifact"))
    for path, (size, md5) in files.items():
        data = (tmp_path / "artifact" / path).read_bytes()
        assert (len(data), base64.b64encode(hashlib.md5(data).digest()).decode()) == (size, md5)
    assert str(root) == str(tmp_path / "artifact")
    assert artifact.logged_by().id == "fx-media"

    # Another run uses it (the public API's `use_artifact`): its used artifacts say so.
    ranks = synced(sink, tmp_path, "one_node_4", "--run-mode", "shared", "-p", "media")
    assert ranks
    reader = api.run("local/media/fx-one-node-4")
    assert list(reader.used_artifacts()) == []
    reader.use_artifact(artifact)
    assert [a.name for a in reader.used_artifacts()] == [logged.name]
    assert [r.id for r in artifact.used_by()] == ["fx-one-node-4"]
    assert list(run.used_artifacts()) == []
    with pytest.raises(CommError):
        api.artifact("local/media/no-such-artifact:v0")


def test_export_and_the_sink_agree_on_every_value(sink, tmp_path, api):
    """The same job through `wbmerge export` (Parquet), `wbmerge report` and `wandb.Api()`
    on its merged run: the same history values at the same steps and the same system-metric
    samples of every rank, none on one side only."""
    out = tmp_path / "values.parquet"
    result = CliRunner().invoke(main, ["export", str(job_dir("slow_rank")), "-o", str(out)])
    assert result.exit_code == 0, result.output
    synced(sink, tmp_path, "slow_rank", "--run-mode", "shared", "-p", "agree")
    exported = pq.read_table(out).to_pylist()
    history = {
        (row["step"], f"{row['key']}/{row['label']}"): exported_value(row)
        for row in exported
        if row["kind"] == "history"
    }
    system: dict[tuple, list] = {}
    for row in exported:
        if row["kind"] == "system":
            samples = system.setdefault((row["label"], row["key"]), [])
            samples.append((row["timestamp"], exported_value(row)))
    assert len(history) > 30 * 3 and len(system) > 3
    run = api.run("local/agree/fx-slow-rank")
    held = {
        (row["_step"], key): value
        for row in run.scan_history(page_size=11)
        for key, value in row.items()
        if key not in UNLABELLED
    }
    assert held == history
    # The report's series (kept for its page) are the same values again.
    (job,) = wbmerge_api.report([job_dir("slow_rank")], html=tmp_path / "report.html")
    reported = {}
    for metric in job.metrics:
        if metric.kind == "history":
            labels = {stats.rank: stats.label for stats in metric.ranks}
            for rank, (steps, values) in metric.series.items():
                for step, value in zip(steps, values, strict=True):
                    reported[step, f"{metric.key}/{labels[rank]}"] = value
    assert reported and reported == {k: v for k, v in held.items() if k in reported}
    reported_keys = {key for _, key in reported}
    assert {k for k in held if k[1] in reported_keys} == set(reported)
    held_system: dict[tuple, list] = {}
    for row in run.history(stream="events", samples=10_000, pandas=False):
        for key, value in row.items():
            if not key.startswith("_"):
                name, label = key.removeprefix("system.").rsplit("/l:", 1)
                held_system.setdefault((label, name), []).append((row["_timestamp"], value))
    assert held_system.keys() == system.keys()
    for series, samples in system.items():
        got = sorted(held_system[series])
        assert [value for _, value in got] == [value for _, value in sorted(samples)], series
        assert [at for at, _ in got] == pytest.approx([at for at, _ in sorted(samples)], abs=1e-6)


def exported_value(row: dict) -> object:
    """A value of the export as the API gives it: a number, else its JSON parsed."""
    return row["value"] if row["value_json"] is None else json.loads(row["value_json"])


def test_a_download_url_reads_its_one_file_for_an_hour_and_writes_nothing(sink, tmp_path):
    """wandb fetches artifact files and manifests without the key, as from W&B's pre-signed
    URLs: the sink's URL reads exactly its file until it expires, and never writes."""
    synced(sink, tmp_path, "media", "--run-mode", "shared", "-p", "media")
    name, files, _ = table_artifact_of(job_dir("media"))
    (path,) = files
    collection = f"run-fx-media-{name.split('-', 2)[2]}"
    variables = {"entity": "local", "project": "media", "collection": collection, "alias": "v0"}
    answer = sink.client.graphql(GET_ARTIFACT_MEMBERSHIP_FILE_URLS_GQL, variables)
    membership = answer["data"]["project"]["artifactCollection"]["artifactMembership"]
    (edge,) = membership["files"]["edges"]
    url = edge["node"]["directUrl"]
    status, data = fetch(url)
    assert status == 200 and base64.b64encode(hashlib.md5(data).digest()).decode() == files[path][1]

    base, _, query = url.partition("?")
    params = urllib.parse.parse_qs(query)
    token, expires = params["read"][0], int(params["expires"][0])
    artifact = int(base.split("/artifact-storage/")[1].split("/")[0])
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    manifest = f"{sink.url}/artifact-storage/{artifact}/manifest"
    tokens = UploadTokens.for_data_dir(sink.data_dir.resolve())
    past = int(time.time()) - 1
    for refused in (
        f"{base}?expires={expires}&read={forged}",  # not the sink's token
        f"{manifest}?expires={expires}&read={token}",  # another file's token
        f"{base}?expires={expires + 1}&read={token}",  # a later expiry than signed
        f"{base}?expires={past}&read={tokens.read_token(artifact, path, past)}",  # expired
    ):
        assert fetch(refused)[0] == 403, refused
    assert fetch(base)[0] == 401  # no token, no key
    assert fetch(url, method="PUT", body=b"other bytes")[0] in (401, 403)
    assert fetch(url) == (200, data)


def fetch(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a request without the API key."""
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()

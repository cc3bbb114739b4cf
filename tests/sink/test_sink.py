"""The local sink, driven by the real uploader (`wandb sync`, wandb-core), checked by value."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request

import pytest

from wbmerge.training import RankInfo
from wbmerge.upload import Credentials, ServerClient
from wbmerge.upload import serverclient as server_module

from ..conftest import FIXTURES, MANIFEST, job_dir
from ..support import synthetic
from ..support.sinktools import (
    console_text,
    copy_runs,
    expected_from_log,
    system_metric_values,
    wandb_sync,
)

pytestmark = pytest.mark.e2e

SYNCABLE = [n for n in MANIFEST["jobs"]]


def assert_arrived(client, project, log_path, files_dir=None):
    """Everything the source log says is in the sink, value for value."""
    want = expected_from_log(log_path)
    got = client.run("local", project, want.run_id)
    assert got["history"] == want.history
    assert {k: v for k, v in got["summary"].items() if k != "_wandb"} == want.summary
    assert got["config"] == want.config
    assert console_text(got["console"]) == want.console
    assert system_metric_values(got["system_metrics"]) == want.stats
    assert got["group"] == (want.group or None)
    assert got["job_type"] == (want.job_type or None)
    if want.exit_code is not None:
        assert got["exit_code"] == want.exit_code
        assert got["state"] == ("finished" if want.exit_code == 0 else "failed")
    if files_dir is not None:
        for source in files_dir.rglob("*"):
            name = source.relative_to(files_dir).as_posix()
            if source.is_file() and not name.startswith("output"):
                assert name in got["files"], name
                stored = client.file("local", project, want.run_id, name)
                assert stored == source.read_bytes(), name
    return got


@pytest.mark.parametrize("name", SYNCABLE)
def test_every_fixture_arrives_exactly(sink, tmp_path, name):
    runs = copy_runs(job_dir(name) / "wandb", tmp_path / "wandb")
    result = wandb_sync(sink, sorted(runs.glob("offline-run-*")), "-p", "fixtures", "-e", "local")
    assert result.returncode == 0, result.stderr
    logs = sorted(runs.glob("offline-run-*/run-*.wandb"))
    assert len(sink.client.runs(project="fixtures")) == len(logs)
    for log in logs:
        got = assert_arrived(sink.client, "fixtures", log, log.parent / "files")
        assert got["history"], "every fixture run logged history"


def test_media_from_a_non_zero_rank_arrives(sink, tmp_path):
    runs = copy_runs(job_dir("media") / "wandb", tmp_path / "wandb")
    assert wandb_sync(sink, sorted(runs.glob("offline-run-*")), "-p", "m").returncode == 0
    files = [
        f
        for r in sink.client.runs(project="m")
        for f in sink.client.run("local", "m", r["id"])["files"]
    ]
    assert any(f.startswith("media/images/") and f.endswith(".png") for f in files)
    assert any(f.endswith(".table.json") for f in files)


def synthetic_runs(root, count, steps=40):
    return [
        synthetic.write_rank(root, RankInfo(r, r, count, count, 0, job_id="par"), steps)
        for r in range(count)
    ]


def test_our_writer_uploads_and_16_runs_in_parallel_arrive_whole(sink, tmp_path):
    logs = synthetic_runs(tmp_path, 16)
    result = wandb_sync(sink, [p.parent for p in logs], "-p", "par", "-e", "local", "-n", "16")
    assert result.returncode == 0, result.stderr
    assert len(sink.client.runs(project="par")) == 16
    for log in logs:
        got = assert_arrived(sink.client, "par", log)
        assert [row["_step"] for row in got["history"]] == list(range(40))


def test_restart_between_uploads_keeps_the_first(sink, tmp_path):
    first, second = synthetic_runs(tmp_path, 2)
    assert wandb_sync(sink, [first.parent], "-p", "r").returncode == 0
    sink.restart()
    assert wandb_sync(sink, [second.parent], "-p", "r").returncode == 0
    assert len(sink.client.runs(project="r")) == 2
    assert_arrived(sink.client, "r", first)
    assert_arrived(sink.client, "r", second)


def test_upload_survives_injected_errors(make_sink, tmp_path):
    faults = [
        "graphql:UpsertBucket=500@1,2",
        "graphql:CreateRunFiles=429@1",
        "file_stream=500@1,2",
        "file_stream=429@3",
        "storage=drop@1",
        "*=delay:0.05x5",
    ]
    sink = make_sink(faults)
    logs = synthetic_runs(tmp_path, 2, steps=60)
    result = wandb_sync(sink, [p.parent for p in logs], "-p", "f", timeout=600)
    assert result.returncode == 0, result.stderr
    fired = {f["kind"] + "=" + f["action"]: f["fired"] for f in sink.client.faults()["faults"]}
    assert fired["graphql:UpsertBucket=500"] == 2
    assert fired["file_stream=500"] == 2 and fired["file_stream=429"] == 1
    assert fired["storage=drop"] == 1
    for log in logs:
        got = assert_arrived(sink.client, "f", log)
        assert len(got["history"]) == 60  # nothing lost, nothing doubled


def test_a_held_request_waits_until_the_faults_are_replaced(make_sink, tmp_path):
    """`hold` keeps an upload in its middle for as long as the test needs: no row is kept
    while the request waits, and once the test lifts the fault every row arrives once."""
    sink = make_sink(["file_stream=hold"])
    [log] = synthetic_runs(tmp_path, 1, steps=30)
    ended = []
    uploader = threading.Thread(
        target=lambda: ended.append(wandb_sync(sink, [log.parent], "-p", "held"))
    )
    uploader.start()
    deadline = time.monotonic() + 120
    while not sink.client.faults()["faults"][0]["fired"]:
        assert uploader.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2.0)  # (an unheld upload of 30 rows ends well within this)
    run_id = expected_from_log(log).run_id
    assert uploader.is_alive()
    assert sink.client.run("local", "held", run_id)["history"] == []
    sink.client.set_faults([])
    uploader.join(timeout=300)
    [result] = ended
    assert result.returncode == 0, result.stderr
    assert_arrived(sink.client, "held", log)


def graphql(sink, query, variables, key=None):
    token = base64.b64encode(f"api:{key or sink.api_key}".encode()).decode()
    request = urllib.request.Request(
        sink.url + "/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_resume_status_reports_counts_and_tails(sink, tmp_path):
    [log] = synthetic_runs(tmp_path, 1, steps=25)
    assert wandb_sync(sink, [log.parent], "-p", "res").returncode == 0
    run_id = expected_from_log(log).run_id
    status, answer = graphql(
        sink,
        "query RunResumeStatus($project: String, $entity: String, $name: String!) { x }",
        {"project": "res", "entity": "local", "name": run_id},
    )
    bucket = answer["data"]["model"]["bucket"]
    assert status == 200 and bucket["historyLineCount"] == 25
    assert json.loads(json.loads(bucket["historyTail"])[0])["_step"] == 24
    status, answer = graphql(
        sink,
        "query RunResumeStatus($project: String, $entity: String, $name: String!) { x }",
        {"project": "res", "entity": "local", "name": "nope"},
    )
    assert answer["data"]["model"]["bucket"] is None


def test_run_files_answers_state_names_and_every_file_a_page_at_a_time(sink, tmp_path, monkeypatch):
    """What the sink answers RunFiles (the public API's files query), read by wbmerge's own
    client two files a page: every file the uploader put, at the size stored."""
    source = copy_runs(job_dir("media") / "wandb", tmp_path / "media")
    assert wandb_sync(sink, sorted(source.glob("offline-run-*")), "-p", "listed").returncode == 0
    run_id = max(  # the rank that logged media
        (r["id"] for r in sink.client.runs(project="listed")),
        key=lambda r: len(sink.client.run("local", "listed", r)["files"]),
    )
    monkeypatch.setattr(server_module, "FILES_PAGE", 2)
    client = ServerClient(Credentials(sink.url, sink.api_key))
    found = client.run_files("local", "listed", run_id)
    stored = sink.client.run("local", "listed", run_id)
    assert found.state == stored["state"] == "finished"
    assert found.names[1:] == ("", "")  # (offline runs name no group or job type)
    assert sorted(found.sizes) == stored["files"] and len(found.sizes) > 4
    for name, size in found.sizes.items():
        assert size == len(sink.client.file("local", "listed", run_id, name))
    assert client.run_files("local", "listed", "nope") is None


def test_unknown_operation_is_a_graphql_error(sink):
    status, answer = graphql(sink, "mutation LaunchRockets { fire }", {})
    assert status == 200 and "not supported" in answer["errors"][0]["message"]


def test_short_api_key_is_refused(sink):
    status, answer = graphql(sink, "query Viewer { viewer { entity } }", {}, key="short")
    assert status == 401


def test_sink_show_cli(sink, tmp_path):
    from click.testing import CliRunner

    from wbmerge.cli import main

    def show(*args, key=None):
        env = {"WANDB_API_KEY": key}  # (None: unset, so the key is read from --data)
        return CliRunner().invoke(main, ["sink", "show", *args, "--url", sink.url], env=env)

    data = ["--data", str(sink.data_dir)]
    empty = show(*data)
    assert empty.exit_code == 0 and empty.stdout == ""
    assert empty.stderr == f"no runs on the sink at {sink.url} yet\n"
    [log] = synthetic_runs(tmp_path, 1, steps=5)
    assert wandb_sync(sink, [log.parent], "-p", "show").returncode == 0
    run_id = expected_from_log(log).run_id
    result = show(*data)
    assert f"local/show/{run_id}" in result.output
    result = show(f"local/show/{run_id}", key=sink.api_key)  # the key from WANDB_API_KEY
    assert "history rows 5" in result.output
    result = show("local/show/nope", *data)
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        f"wbmerge: error: no run local/show/nope on the sink at {sink.url} "
        "(`wbmerge sink show` lists its runs)\n"
    )
    result = show(key="f" * 40)  # a key of the right form, not the sink's
    assert result.exit_code == 2 and f"the sink at {sink.url} refused the key" in result.stderr
    assert run_id not in result.output
    result = show("--data", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "cannot read the sink's API key" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    result = CliRunner().invoke(main, ["sink", "show", *data, "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "cannot reach the sink" in result.stderr


def test_fixture_dir_is_not_modified_by_tests():
    assert not list(FIXTURES.rglob("*.synced")) and not list(FIXTURES.rglob("debug-sync*"))

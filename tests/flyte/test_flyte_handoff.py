"""The nodes' hand-off through Flyte's blob store: a real S3-compatible server on 127.0.0.1
(moto), a node whose upload fails or silently does nothing, and the manifest as hostile input."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import flyte.io
import pytest

from wbmerge.errors import WbmergeError
from wbmerge.flyte import MANIFEST, check_reports, fetch_runs, node_files, read_manifest

from ..support.flytetools import FAULT_JOB, flyte_env, run_example, run_script, start_object_store
from ..support.sinktools import console_text, expected_from_log


@pytest.fixture
def object_store(tmp_path_factory):
    store = start_object_store(tmp_path_factory.mktemp("s3") / "moto.log")
    yield store
    store.proc.terminate()
    store.proc.wait(timeout=30)


@pytest.mark.e2e
def test_every_rank_of_every_node_arrives_through_an_s3_store(sink, tmp_path, object_store):
    result = run_example(
        sink, tmp_path, "--run-mode", "new", "--rank-scope", "worker", nodes=2, nproc=2,
        raw=f"s3://{object_store.bucket}/flyte", env=object_store.env,
    )  # fmt: skip
    base = result["base"]
    keys = object_store.keys()
    handed = {k.split(f"/{base}/", 1)[1].split("/", 1)[0] for k in keys if f"/{base}/" in k}
    assert handed == {MANIFEST, "worker-0", "worker-1"}
    assert not list(tmp_path.glob("raw-data/**/*.wandb"))  # nothing went by the local disk
    for run in result["runs"]:
        want = expected_from_log(run.path)
        run_id = f"{base}-worker-{run.rank.worker}-rank-{run.rank.local_rank}"
        got = sink.client.run("local", "wbmerge-demo", run_id)
        assert got["history"] == want.history
        assert console_text(got["console"]) == want.console
    assert len(sink.client.runs(project="wbmerge-demo")) == 4


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("raise", "node 1 could not hand its runs to "),
        ("skip", "missing node 1: "),
    ],
)
def test_a_node_that_does_not_hand_its_runs_on_fails_the_job_by_name(sink, tmp_path, fault, says):
    env = flyte_env(sink, tmp_path, 2, 1, {"FAULT": fault, "FAULT_NODE": "1"})
    proc = run_script(FAULT_JOB, env, tmp_path, str(tmp_path / "raw-data"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    (failure,) = [line for line in proc.stdout.splitlines() if line.startswith("FAILED: ")]
    assert says in failure
    assert "node 0" not in failure
    assert sink.client.runs(project="fault") == []  # no merge of a job that lacks a node


def test_reports_name_the_nodes_that_failed_or_said_nothing():
    ok = {"worker": 0, "files": {"a": 1}, "target": "s3://b/p/worker-0"}
    failed = {"worker": 2, "error": "OSError: boom", "target": "s3://b/p/worker-2"}
    check_reports([ok], 1, "s3://b/p")
    with pytest.raises(WbmergeError, match=r"node 2 could not hand its runs to s3://b/p/worker-2"):
        check_reports([ok, failed], 3, "s3://b/p")
    with pytest.raises(WbmergeError, match=r"node 1, node 2 reported no upload"):
        check_reports([ok], 3, "s3://b/p")


def test_a_node_hands_on_each_runs_log_and_files_once(tmp_path):
    run_dir = tmp_path / "wandb" / "offline-run-1-abc"
    (run_dir / "files").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    (run_dir / "run-abc.wandb").write_bytes(b"x" * 7)
    (run_dir / "files" / "output.log").write_text("hi")
    (run_dir / "logs" / "debug-core.log").write_text("still being written")
    staged = run_dir / "wandb-data" / "artifacts" / "staging"  # (as wbmerge.init keeps it)
    staged.mkdir(parents=True)
    (staged / "tmpab12").write_bytes(b"weights")
    os.symlink(run_dir, tmp_path / "wandb" / "latest-run")
    assert node_files(tmp_path) == {
        "wandb/offline-run-1-abc/files/output.log": 2,
        "wandb/offline-run-1-abc/run-abc.wandb": 7,
        "wandb/offline-run-1-abc/wandb-data/artifacts/staging/tmpab12": 7,
    }


def test_a_node_sizes_a_log_once_wandbs_service_has_closed_it(tmp_path):
    """`run.finish()` returns before wandb's service writes the log's last block and closes
    it: the size handed on is the size after that, not the one while it is still open."""
    log = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"x" * 7)
    writer = os.open(log, os.O_WRONLY | os.O_APPEND)

    def close_later():
        time.sleep(0.5)
        os.write(writer, b"y" * 32761)  # the last block, written on close
        os.close(writer)

    closer = threading.Thread(target=close_later)
    closer.start()
    try:
        assert node_files(tmp_path) == {"wandb/offline-run-1-abc/run-abc.wandb": 32768}
    finally:
        closer.join()


def test_a_node_stops_waiting_for_a_log_that_stays_open(tmp_path):
    log = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"x" * 7)
    with open(log, "ab"):
        assert node_files(tmp_path, patience=0.5) == {"wandb/offline-run-1-abc/run-abc.wandb": 7}


def manifest_dir(tmp_path, manifest) -> flyte.io.Dir:
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    return flyte.io.Dir(path=str(tmp_path))


@pytest.mark.parametrize(
    "manifest",
    [
        {"format": 1, "workers": {"0": {"files": {"../../etc/passwd": 1}}}},
        {"format": 1, "workers": {"0": {"files": {"/etc/passwd": 1}}}},
        {"format": 1, "workers": {"x": {"files": {}}}},
        {"format": 1, "workers": {"0": {"files": {"a": "big"}}}},
        {"format": 2, "workers": {}},
        ["not", "a", "manifest"],
    ],
)
def test_a_hostile_manifest_is_refused_in_one_line(tmp_path, manifest):
    with pytest.raises(WbmergeError, match=MANIFEST):
        asyncio.run(read_manifest(manifest_dir(tmp_path, manifest)))


def test_no_manifest_says_which_dir(tmp_path):
    with pytest.raises(WbmergeError, match="no readable hand-off manifest"):
        asyncio.run(read_manifest(flyte.io.Dir(path=str(tmp_path))))


def test_files_lost_after_the_hand_off_are_named_by_node(tmp_path):
    (tmp_path / "worker-0").mkdir()
    (tmp_path / "worker-0" / "run-a.wandb").write_bytes(b"abc")
    (tmp_path / "worker-1").mkdir()
    (tmp_path / "worker-1" / "run-b.wandb").write_bytes(b"ab")  # shorter than reported
    files = {"0": {"files": {"run-a.wandb": 3}}, "1": {"files": {"run-b.wandb": 3}}}
    runs = manifest_dir(tmp_path, {"format": 1, "workers": files})
    manifest = asyncio.run(read_manifest(runs))
    assert asyncio.run(fetch_runs(runs, manifest, worker=0)) == tmp_path / "worker-0"
    with pytest.raises(WbmergeError, match=r"node 1: 1 of 1 file\(s\), e.g. run-b.wandb"):
        asyncio.run(fetch_runs(runs, manifest))


@pytest.mark.e2e
def test_the_shared_volume_handoff_stays_available(sink, tmp_path):
    result = run_example(
        sink, tmp_path, "--run-mode", "shared", nodes=2, nproc=1,
        env={"WBMERGE_HANDOFF": "shared-volume"},
    )  # fmt: skip
    base = result["base"]
    shared = tmp_path / "runs" / base  # every node wrote into one directory
    assert sorted(p.name for p in shared.iterdir()) == [MANIFEST, "worker-0", "worker-1"]
    assert not list((tmp_path / "raw-data").glob(f"*/{base}"))  # nothing through the store
    got = sink.client.run("local", "wbmerge-demo", base)
    rows = {row["_step"]: row for row in got["history"]}
    for run in result["runs"]:
        for row in expected_from_log(run.path).history:
            for key, value in row.items():
                if not key.startswith("_"):
                    assert rows[row["_step"]][f"{key}/{run.rank.label}"] == value

"""The nodes' hand-off through Flyte's blob store: a real S3-compatible server on 127.0.0.1
(moto), a node whose upload fails or silently does nothing, the manifest as hostile input,
and a job whose ranks log a checkpoint artifact and `wandb.save` it, handed on and uploaded
whole."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import flyte.io
import pytest
from wandb.sdk.artifacts._generated.operations import RUN_OUTPUT_ARTIFACTS_GQL
from wandb.sdk.artifacts._generated.run_output_artifacts import RunOutputArtifacts

from wbmerge.errors import WbmergeError
from wbmerge.flyte import MANIFEST, check_reports, fetch_runs, node_files, read_manifest

from ..sink.test_sink_artifacts import manifest_digest, md5_b64
from ..support.flytetools import (
    ARTIFACT_JOB,
    FAULT_JOB,
    flyte_env,
    run_example,
    run_script,
    start_object_store,
)
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
        sink,
        tmp_path,
        "--run-mode",
        "new",
        "--rank-scope",
        "worker",
        nodes=2,
        nproc=2,
        raw=f"s3://{object_store.bucket}/flyte",
        env=object_store.env,
    )
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
        sink,
        tmp_path,
        "--run-mode",
        "shared",
        nodes=2,
        nproc=1,
        env={"WBMERGE_HANDOFF": "shared-volume"},
    )
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


def output_artifacts(sink, project: str, run_id: str) -> list:
    """The artifact versions a run logged, read with the query wandb's public API sends
    (`run.logged_artifacts()`)."""
    variables = {"entity": "local", "project": project, "run": run_id, "perPage": 100}
    answer = sink.client.graphql(RUN_OUTPUT_ARTIFACTS_GQL, variables)
    run = RunOutputArtifacts.model_validate(answer["data"]).project.run
    assert run is not None, f"no run {run_id}"
    return [edge.node for edge in run.artifacts.edges]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["shared", "new"])
def test_a_checkpoint_artifact_and_saved_file_arrive_through_the_handoff(sink, tmp_path, mode):
    """Each rank's `log_artifact` of its checkpoint is committed under the target run with
    the checkpoint's bytes (manifest digest, size and MD5 of the file), and its
    `wandb.save` of it is uploaded: shared mode holds both ranks' (rank 1's artifact a
    second version of `ckpt`, its saved file under `rank-1/`), new mode one rank's each.
    The bytes are those each rank wrote in the ranks' working directory."""
    env = flyte_env(sink, tmp_path, 1, 2, {"RUN_MODE": mode})
    proc = run_script(ARTIFACT_JOB, env, tmp_path, str(tmp_path / "raw-data"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checkpoints = {
        rank: (tmp_path / f"ckpt-rank-{rank}" / "model.pt").read_bytes() for rank in (0, 1)
    }
    assert checkpoints[0] != checkpoints[1]

    # What went through the store: each rank's log, its files and its artifact staging.
    [manifest] = (tmp_path / "raw-data").glob(f"**/{MANIFEST}")
    handed = json.loads(manifest.read_text())["workers"]["0"]["files"]
    staged = [name for name in handed if "/wandb-data/artifacts/staging/" in name]
    assert sorted(handed[name] for name in staged) == sorted(map(len, checkpoints.values()))
    saved_copies = sorted((manifest.parent / "worker-0").glob("wandb/*/files/model.pt"))
    assert not any(path.is_symlink() for path in saved_copies)  # (resolved on the node)
    assert sorted(p.read_bytes() for p in saved_copies) == sorted(checkpoints.values())

    runs = sorted(run["id"] for run in sink.client.runs(project="handoff"))
    if mode == "shared":
        [base] = runs
        holds = {base: {0: "model.pt", 1: "rank-1/model.pt"}}
    else:
        base = runs[0].rsplit("-rank-", 1)[0]
        holds = {f"{base}-rank-{rank}": {rank: "model.pt"} for rank in (0, 1)}
    assert runs == sorted(holds)
    versions = []
    for run_id, saved in holds.items():
        for rank, name in saved.items():
            assert sink.client.file("local", "handoff", run_id, name) == checkpoints[rank]
        nodes = output_artifacts(sink, "handoff", run_id)
        want = {manifest_digest({"model.pt": checkpoints[rank]}): rank for rank in saved}
        assert sorted(node.digest for node in nodes) == sorted(want)
        for node in nodes:
            assert node.state == "COMMITTED" and node.artifact_sequence.name == "ckpt"
            data = checkpoints[want[node.digest]]
            version = f"ckpt:v{node.version_index}"
            committed = sink.client.committed_files("local", "handoff", version)
            assert committed["files"] == {"model.pt": (len(data), md5_b64(data))}
            assert sink.client.artifact_file("local", "handoff", version, "model.pt") == data
        versions += [node.version_index for node in nodes]
    assert sorted(versions) == [0, 1]  # (two ranks' `ckpt`: two versions of one artifact)

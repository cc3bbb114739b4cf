"""Artifacts of merged runs: each lands committed under the run `wbmerge sync` uploads, in
every run mode and rank scope, with every file intact, and no run is left under a rank's
offline id.

The job is real: two ranks (processes with torchrun's variables) that ran `wbmerge.init`
offline with real wandb and logged a `ckpt` artifact each (`tests/support/artifact_job.py`), rank 0
also a Table. What must arrive is taken from what the ranks wrote (their weights text and
their offline ids read from their directories), never from wbmerge's staging.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from wandb.sdk.artifacts._generated.operations import RUN_OUTPUT_ARTIFACTS_GQL
from wandb.sdk.artifacts._generated.run_output_artifacts import RunOutputArtifacts

from wbmerge import api
from wbmerge.cli import main
from wbmerge.log import pb, read_records
from wbmerge.merge import LoggedArtifact

from ..conftest import ROOT
from ..sink.test_sink_artifacts import CLIENT_ID_MAPPING, manifest_digest, md5_b64
from ..support.artifact_job import weights_text
from ..support.distributed_artifact_run import PARTS
from ..support.hostile import rewrite_log, tree_digest

pytestmark = pytest.mark.e2e

PROJECT = "arts"
JOB_ID = "artjob"
RANKS = (0, 1)


def rank_env(root: Path, rank: int) -> dict[str, str]:
    """torchrun's variables for rank `rank` of a two-node job of one process per node, and
    wandb's directories under the rank's own directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "WBMERGE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        RANK=str(rank),
        WORLD_SIZE=str(len(RANKS)),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        TORCHELASTIC_RUN_ID=JOB_ID,
        WANDB_DATA_DIR=str(root / "data"),
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_CONFIG_DIR=str(root / "config"),
        WANDB_SILENT="true",
    )
    return env


def write_job(job: Path, policy: str = "mutable") -> Path:
    """The job's ranks run side by side, each in `job/rank-{r}`; returns `job`."""
    procs = []
    for rank in RANKS:
        root = job / f"rank-{rank}"
        root.mkdir(parents=True)
        cmd = [sys.executable, "-m", "tests.support.artifact_job", str(root), str(rank), policy]
        procs.append(
            subprocess.Popen(
                cmd, env=rank_env(root, rank), cwd=root, stderr=subprocess.PIPE, text=True
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    return job


def offline_ids(job: Path) -> dict[int, str]:
    """rank -> the offline run id its wandb wrote (the end of its run directory's name)."""
    found = {}
    for rank in RANKS:
        (run_dir,) = (job / f"rank-{rank}" / "wandb").glob("offline-run-*")
        found[rank] = run_dir.name.rsplit("-", 1)[-1]
    return found


@pytest.fixture(scope="module")
def artifact_job(tmp_path_factory) -> Path:
    return write_job(tmp_path_factory.mktemp("artifact-job") / "job")


def cli(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(main, [*map(str, args)], env=env)


def output_artifacts(sink, run_id: str) -> dict[tuple[str, int], object]:
    """(name, version index) -> the node of each version the run logged, read with the
    query wandb's public API sends (`run.logged_artifacts()`)."""
    variables = {"entity": "local", "project": PROJECT, "run": run_id, "perPage": 100}
    answer = sink.client.graphql(RUN_OUTPUT_ARTIFACTS_GQL, variables)
    run = RunOutputArtifacts.model_validate(answer["data"]).project.run
    assert run is not None, f"no run {run_id}"
    return {
        (edge.node.artifact_sequence.name, edge.node.version_index): edge.node
        for edge in run.artifacts.edges
    }


def checkpoint_files(rank: int) -> dict[str, bytes]:
    data = weights_text(rank).encode()
    return {"weights.bin": data, "nested/copy.bin": data}


def assert_checkpoint_of(sink, node, rank: int) -> None:
    """`node` is rank `rank`'s checkpoint, committed, every file with the size and MD5 of
    the bytes the rank wrote."""
    files = checkpoint_files(rank)
    assert node.state == "COMMITTED"
    assert node.digest == manifest_digest(files)
    assert json.loads(node.metadata) == {"rank": rank}
    committed = sink.client.committed_files("local", PROJECT, f"ckpt:v{node.version_index}")
    assert committed["files"] == {path: (len(d), md5_b64(d)) for path, d in files.items()}


def table_reference(sink, run_id: str) -> str:
    """The server id of the artifact the run's one logged Table refers to from its history
    value (`wandb-client-artifact://CLIENT_ID:latest/...`, resolved as W&B resolves it)."""
    values = [
        value
        for row in sink.client.run("local", PROJECT, run_id)["history"]
        for value in row.values()
        if isinstance(value, dict) and "artifact_path" in value
    ]
    (value,) = values
    reference = urllib.parse.urlparse(value["artifact_path"])
    assert reference.scheme == "wandb-client-artifact"
    client_id = reference.netloc.split(":")[0]
    answer = sink.client.graphql(CLIENT_ID_MAPPING, {"clientID": client_id})
    return answer["data"]["clientIDMapping"]["serverID"]


# (mode, scope) -> {target run id: the ranks whose checkpoint it holds}
TARGETS = {
    ("auto", "global"): {JOB_ID: [0]},
    ("new", "global"): {f"{JOB_ID}-rank-0": [0], f"{JOB_ID}-rank-1": [1]},
    ("shared", "global"): {JOB_ID: [0, 1]},
    ("shared", "worker"): {f"{JOB_ID}-worker-0": [0], f"{JOB_ID}-worker-1": [1]},
}


@pytest.mark.parametrize(("mode", "scope"), list(TARGETS))
def test_each_artifact_is_committed_under_the_run_it_belongs_to(
    sink, tmp_path, artifact_job, mode, scope
):
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        artifact_job,
        "--run-mode",
        mode,
        "--rank-scope",
        scope,
        "-p",
        PROJECT,
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    targets = TARGETS[(mode, scope)]
    assert sorted(r["id"] for r in sink.client.runs(project=PROJECT)) == sorted(targets)
    stray = set(offline_ids(artifact_job).values())
    assert not stray & {r["id"] for r in sink.client.runs()}
    for run_id, ranks in targets.items():
        logged = output_artifacts(sink, run_id)
        checkpoints = sorted(
            (json.loads(node.metadata)["rank"], node)
            for (name, _), node in logged.items()
            if name == "ckpt"
        )
        assert [rank for rank, _ in checkpoints] == ranks
        for rank, node in checkpoints:
            assert_checkpoint_of(sink, node, rank)
        tables = [name for name, _ in logged if name != "ckpt"]
        assert tables == ([f"run-{run_id}-samples"] if 0 in ranks else [])
        if 0 in ranks:  # the Table's history value finds its run_table artifact
            assert table_reference(sink, run_id) == logged[(tables[0], 0)].id


def test_a_job_copied_elsewhere_sends_its_artifacts_from_its_run_directories(sink, tmp_path):
    """wbmerge.init keeps each rank's artifact staging in its run directory: a job moved to
    another place (a Flyte hand-off, rsync) still has its artifacts' files, though their
    manifests name the place where the ranks wrote them, and the sync leaves them there."""
    written = write_job(tmp_path / "written")
    moved = written.rename(tmp_path / "moved")
    before = tree_digest(moved)
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        moved,
        "--run-mode",
        "shared",
        "-p",
        PROJECT,
        "-e",
        "local",
    )
    assert result.exit_code == 0, result.stderr
    logged = output_artifacts(sink, JOB_ID)
    for rank in RANKS:
        (node,) = [
            n
            for (name, _), n in logged.items()
            if name == "ckpt" and json.loads(n.metadata)["rank"] == rank
        ]
        assert_checkpoint_of(sink, node, rank)
    assert tree_digest(moved) == before  # the ranks' staged files are all still there


def plain_run(root: Path, data_dir: Path, policy: str = "mutable", digest: str = "MD5") -> Path:
    """A plain `wandb.init` offline run (tests/support/artifact_run.py) that ran in `root` with
    wandb's data directory `data_dir`, its `ckpt` files added with `policy` and hashed with
    `digest`; its run directory."""
    root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "WBMERGE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        WANDB_DATA_DIR=str(data_dir),
        WANDB_SILENT="true",
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_CONFIG_DIR=str(root / "config"),
    )
    cmd = [
        sys.executable,
        "-m",
        "tests.support.artifact_run",
        str(root),
        "plain",
        "plain weights",
        policy,
        digest,
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = (root / "wandb").glob("offline-run-*-plain")
    return run_dir


def staged_file(run_dir: Path, artifact: str, path: str) -> str:
    """The `local_path` the run's own record gives the file `path` of `artifact`."""
    for record in read_records(run_dir / "run-plain.wandb"):
        if record.WhichOneof("record_type") == "artifact" and record.artifact.name == artifact:
            (entry,) = [e for e in record.artifact.manifest.contents if e.path == path]
            return entry.local_path
    raise AssertionError(f"no artifact {artifact}")


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.stderr, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wbmerge: error:"), result.stderr
    return lines[0]


def test_an_artifact_file_that_is_gone_fails_the_sync_naming_it(sink, tmp_path):
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data")
    gone = staged_file(run_dir, "ckpt", "nested/copy.bin")
    Path(gone).unlink()
    result = cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local")
    line = one_error_line(result)
    assert "'ckpt'" in line and "'nested/copy.bin'" in line and gone in line
    assert "does not exist" in line
    assert sink.client.runs() == []  # nothing uploaded


def test_an_artifact_file_outside_the_allowed_directories_is_read_only_when_named(sink, tmp_path):
    """wandb's data directory outside the directory the rank ran in (its default is in the
    home directory) is read only with --files-from, as a hostile record could name any
    file the user can read."""
    elsewhere = tmp_path / "elsewhere"
    run_dir = plain_run(tmp_path / "ran", elsewhere)
    outside = staged_file(run_dir, "ckpt", "nested/copy.bin")  # (read first)
    result = cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local")
    line = one_error_line(result)
    assert "'ckpt'" in line and outside in line and "--files-from" in line
    assert sink.client.runs() == []

    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        run_dir,
        "-p",
        PROJECT,
        "-e",
        "local",
        "--files-from",
        elsewhere,
    )
    assert result.exit_code == 0, result.stderr
    (run_id,) = [run["id"] for run in json.loads(result.stdout)["runs"]]
    node = output_artifacts(sink, run_id)[("ckpt", 0)]
    files = {"weights.bin": b"plain weights", "nested/copy.bin": b"plain weights"}
    assert node.state == "COMMITTED" and node.digest == manifest_digest(files)
    committed = sink.client.committed_files("local", PROJECT, "ckpt:v0")
    assert committed["files"] == {p: (len(d), md5_b64(d)) for p, d in files.items()}
    assert Path(outside).read_bytes() == b"plain weights"  # the user's copy is still there


def limit_written_bytes() -> None:
    """`preexec_fn`: a file the process writes may not pass 64 MiB (a larger write fails)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))


def test_an_artifact_file_grown_since_is_refused_before_it_is_copied(tmp_path):
    """A file an entry of size 13 names that is now a sparse 3 GiB file (no disk used) is
    refused by its size, before a byte of it is copied: the merge may write no more than
    64 MiB a file, and copying it first would pass that."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data")
    grown = staged_file(run_dir, "ckpt", "weights.bin")
    os.truncate(grown, 3 << 30)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "wbmerge.cli", "merge", str(run_dir), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), WBMERGE_STATE_DIR=str(tmp_path / "state"))
    result = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_written_bytes,
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == (
        f"wbmerge: error: plain: artifact 'ckpt' file 'weights.bin': {Path(grown).resolve()} is "
        "no longer the file the rank logged (its size differs from the manifest's)"
    )
    assert not out.exists() or not any(path.is_file() for path in out.rglob("*"))


def test_an_artifact_that_did_not_commit_fails_the_sync_and_a_rerun_sends_it_once(
    make_sink, tmp_path, artifact_job
):
    """wandb's uploader says a failed artifact only in its debug log and finishes the run:
    the check after the upload finds it missing, the run is not recorded as synced, and
    the next sync sends it again, into the same version."""
    sink = make_sink(faults=["graphql:CommitArtifact=400@1"])
    args = ("sync", artifact_job, "--run-mode", "new", "-p", PROJECT, "-e", "local")
    first = cli(sink, tmp_path, *args)
    assert first.exit_code == 1, first.stdout
    # (whichever artifact's commit came first: the runs upload side by side)
    assert re.search(
        r"artifact '(ckpt|run-artjob-rank-0-samples)' .*is not committed under "
        r"the run",
        first.stderr,
    ), first.stderr

    second = cli(sink, tmp_path, *args)
    assert second.exit_code == 0, second.stderr
    for rank in RANKS:
        (node,) = [
            n
            for (name, _), n in output_artifacts(sink, f"{JOB_ID}-rank-{rank}").items()
            if name == "ckpt"
        ]
        assert_checkpoint_of(sink, node, rank)
    versions = [sink.client.committed_files("local", PROJECT, f"ckpt:v{i}") for i in range(3)]
    assert [v is not None for v in versions] == [True, True, False]  # one per rank, no more
    tables = [
        sink.client.committed_files("local", PROJECT, f"run-{JOB_ID}-rank-0-samples:v{i}")
        for i in range(2)
    ]
    assert tables[0]["state"] == "COMMITTED" and tables[1] is None


def test_an_artifact_file_the_server_holds_other_bytes_of_fails_the_sync(sink, tmp_path):
    """The check reads each file's MD5 back from the server: bytes changed there after a
    verified upload make the next (forced) sync fail, naming the artifact and the file."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data")
    args = ("sync", "--json", run_dir, "-p", PROJECT, "-e", "local")
    assert cli(sink, tmp_path, *args).exit_code == 0
    blob = hashlib.md5(b"plain weights").hexdigest()
    (sink.data_dir / "artifacts" / blob[:2] / blob).write_bytes(b"plain weightz")
    result = cli(sink, tmp_path, *args, "--force")
    assert result.exit_code == 1, result.stdout
    assert "artifact 'ckpt' file 'weights.bin' is not the one the rank logged (MD5)" in (
        result.stderr
    )


def test_a_distributed_artifact_is_expected_whole_once_finished(sink, tmp_path):
    """The parts of a distributed artifact are not committed by their own records: what the
    upload must leave is the one artifact the finishing record commits, with every part's
    files. The sink takes no patch manifests, so there it is missing, and the sync says so
    rather than 'verified'."""
    root = tmp_path / "ran"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "WBMERGE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        WANDB_DATA_DIR=str(root / "data"),
        WANDB_SILENT="true",
        WANDB_CACHE_DIR=str(root / "cache"),
        WANDB_CONFIG_DIR=str(root / "config"),
    )
    cmd = [sys.executable, "-m", "tests.support.distributed_artifact_run", str(root)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (root / "wandb").glob("offline-run-*-dist")

    (staged,) = api.merge(run_dir, tmp_path / "out", files_from=root)
    parts = {name: text.encode() for name, text in PARTS.items()}
    files = tuple((name, len(data), md5_b64(data)) for name, data in parts.items())
    assert staged.artifacts == [LoggedArtifact("shards", None, files)]

    result = cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local")
    assert result.exit_code == 1, result.stdout
    assert "artifact 'shards' is not committed under the run" in result.stderr


def test_a_merge_directory_moved_elsewhere_sends_the_artifacts_it_holds(
    sink, tmp_path, artifact_job
):
    """`merge --out` copies each artifact file into the merged run; moved since (another
    machine, another disk), the merged run still sends them from where it now is."""
    out = tmp_path / "merged"
    merged = CliRunner().invoke(
        main, ["merge", str(artifact_job), "--run-mode", "shared", "--out", str(out)]
    )
    assert merged.exit_code == 0, merged.stderr
    moved = out.rename(tmp_path / "moved")
    result = cli(sink, tmp_path, "sync", moved, "-p", PROJECT, "-e", "local")
    assert result.exit_code == 0, result.stderr
    logged = output_artifacts(sink, JOB_ID)
    checkpoints = {json.loads(n.metadata)["rank"]: n for (k, _), n in logged.items() if k == "ckpt"}
    assert sorted(checkpoints) == list(RANKS)
    for rank, node in checkpoints.items():
        assert_checkpoint_of(sink, node, rank)


def test_a_gone_artifact_file_stops_the_merge_before_any_run_is_written(sink, tmp_path):
    """Checked with the saved files, before anything is merged or uploaded: in `new` mode
    rank 0's run, which has every file, is neither written nor sent."""
    job = write_job(tmp_path / "job")
    (staging,) = (job / "rank-1" / "wandb").glob("offline-run-*/wandb-data/artifacts/staging")
    for staged in staging.iterdir():
        staged.unlink()
    out = tmp_path / "out"
    for command in (["merge", "--out", out], ["sync", "-p", PROJECT, "-e", "local"]):
        result = cli(sink, tmp_path, command[0], job, "--run-mode", "new", *command[1:])
        line = one_error_line(result)
        assert "artifact 'ckpt'" in line and str(staging) in line and "does not exist" in line
    assert not out.exists() or not list(out.iterdir())
    assert sink.client.runs() == []


def xxh128_b64(data: bytes) -> str:
    """A file's XXH128 digest as a manifest entry of wandb's writes it (base64)."""
    return base64.b64encode(xxhash.xxh128(data).digest()).decode()


@pytest.mark.parametrize("digest", ["MD5", "XXH128"])
def test_an_artifact_file_changed_after_it_was_logged_stops_the_sync(sink, tmp_path, digest):
    """With the `immutable` policy the manifest names the user's own file: bytes changed
    there after logging (the size kept) are not the artifact the rank logged, whichever
    digest algorithm the artifact used, and nothing is uploaded."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data", "immutable", digest)
    weights = tmp_path / "ran" / "source" / "weights.bin"
    assert staged_file(run_dir, "ckpt", "weights.bin") == str(weights)
    weights.write_bytes(b"plain weightz")  # (13 bytes, as logged)
    line = one_error_line(cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local"))
    assert "'ckpt'" in line and str(weights) in line
    assert f"no longer the file the rank logged (its {digest} digest differs" in line
    assert sink.client.runs() == []


def test_an_xxh128_entry_naming_a_file_no_artifact_logged_stops_the_sync(sink, tmp_path):
    """A hostile XXH128 entry keeps its digest and size but names another file where files
    may be read: the file is not what the entry's digest names, and it is never sent."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data", "immutable", "XXH128")
    other = tmp_path / "ran" / "notes.txt"
    other.write_bytes(b"never logged!")  # (13 bytes, as the entry's size)

    def point_at_other(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") != "artifact" or record.artifact.name != "ckpt":
            return None
        (entry,) = [e for e in record.artifact.manifest.contents if e.path == "weights.bin"]
        assert entry.digest == xxh128_b64(b"plain weights")
        entry.local_path = str(other)
        return record

    rewrite_log(run_dir / "run-plain.wandb", point_at_other)
    line = one_error_line(cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local"))
    assert "'ckpt'" in line and "'weights.bin'" in line and str(other) in line
    assert sink.client.runs() == []


def test_an_xxh128_artifact_arrives_committed_with_its_files(sink, tmp_path):
    """An XXH128 artifact left as logged arrives whole, each file at its size and MD5.
    wandb's uploader hashes its files again with MD5 for this server (measured with
    wandb-core 0.31), so the version's digest is the MD5 one of the same files."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data", "immutable", "XXH128")
    result = cli(sink, tmp_path, "sync", "--json", run_dir, "-p", PROJECT, "-e", "local")
    assert result.exit_code == 0, result.stderr
    (run_id,) = [run["id"] for run in json.loads(result.stdout)["runs"]]
    node = output_artifacts(sink, run_id)[("ckpt", 0)]
    files = {"weights.bin": b"plain weights", "nested/copy.bin": b"plain weights"}
    assert node.state == "COMMITTED" and node.digest == manifest_digest(files)
    committed = sink.client.committed_files("local", PROJECT, "ckpt:v0")
    assert committed["files"] == {p: (len(d), md5_b64(d)) for p, d in files.items()}


SECRET = b"a private key of the user\n"


@pytest.mark.parametrize("where", ["secret", "relative", "dotdot"])
def test_an_artifact_record_naming_another_file_never_sends_it(sink, tmp_path, where):
    """A hostile record points a manifest entry at a file of the user's outside the run
    (with its size and MD5, so that the uploader would take it): nothing is read from
    there, the sync stops in one line, and the file's bytes are nowhere on the server."""
    run_dir = plain_run(tmp_path / "ran", tmp_path / "ran" / "data")
    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    path = {
        "secret": str(secret),
        "relative": "../../home/id_rsa",
        "dotdot": str(tmp_path / "ran" / ".." / "home" / "id_rsa"),
    }[where]

    def point_at_secret(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") != "artifact" or record.artifact.name != "ckpt":
            return None
        entry = record.artifact.manifest.contents[0]
        entry.local_path, entry.size, entry.digest = path, len(SECRET), md5_b64(SECRET)
        return record

    rewrite_log(run_dir / "run-plain.wandb", point_at_secret)
    result = cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local")
    line = one_error_line(result)
    assert "'ckpt'" in line and path in line
    assert sink.client.runs() == []
    kept = [p.read_bytes() for p in (sink.data_dir / "artifacts").rglob("*") if p.is_file()]
    assert SECRET not in kept


REFERENCES = 100_000  # wandb writes a manifest of more entries to a file of its own


def digest_of(digests: dict[str, str]) -> str:
    """A manifest's digest from its entries' digests (wandb's documented algorithm)."""
    text = "wandb-artifact-manifest-v1\n" + "".join(
        f"{path}:{digest}\n" for path, digest in sorted(digests.items())
    )
    return hashlib.md5(text.encode()).hexdigest()


def move_manifest_to_a_file(run_dir: Path, data_dir: Path) -> tuple[Path, str]:
    """Rewrite the `ckpt` record of a plain run as wandb writes an artifact of more than
    100000 entries (`interface._make_artifact_manifest`): no entries in the record, and
    `manifest_file_path` naming a gzip file of one JSON entry a line in wandb's staging
    (`artifact_manifests/`), here its two files and 100000 references. Returns the
    manifest file and the artifact's new digest."""
    manifest = (
        data_dir / "artifacts" / "staging" / "artifact_manifests" / "1.manifest_contents.jl.gz"
    )
    manifest.parent.mkdir(parents=True, exist_ok=True)
    digests: dict[str, str] = {}

    def to_file(record: pb.Record) -> pb.Record | None:
        if record.WhichOneof("record_type") != "artifact" or record.artifact.name != "ckpt":
            return None
        lines = []
        for entry in record.artifact.manifest.contents:
            lines.append(
                {
                    "path": entry.path,
                    "digest": entry.digest,
                    "size": entry.size,
                    "extra": {},
                    "local_path": entry.local_path,
                    "skip_cache": False,
                }
            )
        for i in range(REFERENCES):
            lines.append(
                {
                    "path": f"refs/{i:06d}.bin",
                    "digest": f"etag-{i}",
                    "size": i,
                    "ref": f"s3://bucket/refs/{i:06d}.bin",
                    "extra": {},
                    "skip_cache": False,
                }
            )
        digests.update((line["path"], line["digest"]) for line in lines)
        with gzip.open(manifest, "wt", compresslevel=1) as out:
            out.writelines(json.dumps(line) + "\n" for line in lines)
        del record.artifact.manifest.contents[:]
        del record.artifact.manifest.storage_policy_config[:]
        record.artifact.manifest.manifest_file_path = str(manifest)
        record.artifact.digest = digest_of(digests)
        return record

    rewrite_log(run_dir / "run-plain.wandb", to_file)
    return manifest, digest_of(digests)


def test_an_artifact_whose_manifest_is_a_file_of_its_own_arrives_whole(sink, tmp_path):
    """Beyond 100000 entries wandb writes the manifest to a file, which wandb-core deletes
    once it has read it: the merge copies it (and the files it names) into staging, so
    the artifact arrives committed with every entry and the rank's manifest stays."""
    data_dir = tmp_path / "ran" / "data"
    run_dir = plain_run(tmp_path / "ran", data_dir)
    manifest, digest = move_manifest_to_a_file(run_dir, data_dir)
    before = manifest.read_bytes()
    result = cli(sink, tmp_path, "sync", "--json", run_dir, "-p", PROJECT, "-e", "local")
    assert result.exit_code == 0, result.stderr
    (run_id,) = [run["id"] for run in json.loads(result.stdout)["runs"]]
    node = output_artifacts(sink, run_id)[("ckpt", 0)]
    assert node.state == "COMMITTED" and node.digest == digest
    committed = sink.client.committed_files("local", PROJECT, "ckpt:v0")
    assert len(committed["files"]) == REFERENCES + 2
    weights = b"plain weights"
    for path in ("weights.bin", "nested/copy.bin"):
        assert committed["files"][path] == (len(weights), md5_b64(weights))
        assert sink.client.artifact_file("local", PROJECT, "ckpt:v0", path) == weights
    assert manifest.read_bytes() == before  # (wandb-core deleted only the staged copy)


def test_a_manifest_file_that_is_not_wandbs_stops_the_sync_in_one_line(sink, tmp_path):
    data_dir = tmp_path / "ran" / "data"
    run_dir = plain_run(tmp_path / "ran", data_dir)
    manifest, _ = move_manifest_to_a_file(run_dir, data_dir)
    manifest.write_bytes(gzip.compress(b'{"path": "a"}\n'))  # (no digest)
    result = cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local")
    line = one_error_line(result)
    assert "'ckpt' manifest file" in line and str(manifest) in line and "line 1" in line
    manifest.write_bytes(b"not gzip")
    line = one_error_line(cli(sink, tmp_path, "sync", run_dir, "-p", PROJECT, "-e", "local"))
    assert "not a manifest file as wandb writes one" in line
    assert sink.client.runs() == []


def verify(sink, tmp_path, *args):
    """`wbmerge verify --json`: its exit code, its report and its stderr lines."""
    result = cli(sink, tmp_path, "verify", "--json", *args)
    report = json.loads(result.stdout) if result.stdout.strip() else None
    return result.exit_code, report, result.stderr.strip().splitlines()


def test_a_lost_artifact_file_is_named_by_verify(sink, tmp_path, artifact_job):
    """`wbmerge verify` of the job synced is clean, and names the file once the sink loses
    it from its store. (Here, not in tests/e2e/test_verify.py: the job is written once.)"""
    synced = cli(sink, tmp_path, "sync", artifact_job, "--run-mode", "new", "--base-id", "arta")
    assert synced.exit_code == 0, synced.output
    code, report, errors = verify(
        sink, tmp_path, artifact_job, "--run-mode", "new", "--base-id", "arta"
    )
    assert (code, errors) == (0, []), (errors, report)

    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        gone = db.execute("UPDATE artifact_files SET size = NULL WHERE path = 'nested/copy.bin'")
        assert gone.rowcount >= 2  # (each rank's checkpoint has one)
    db.close()
    code, report, _ = verify(sink, tmp_path, artifact_job, "--run-mode", "new", "--base-id", "arta")
    assert code == 1
    for run in report["runs"]:
        assert any("nested/copy.bin" in line for line in run["problems"]), run

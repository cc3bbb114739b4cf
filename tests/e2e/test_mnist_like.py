"""A job logged the way the Flyte MNIST tutorial and W&B's distributed-training guides log
arrives whole in every run mode: history (the `watch` histograms too), the Table of test
predictions and its `run_table` artifact, the checkpoint artifact, each rank's saved
checkpoint, the `val/*` metric definition, config (updated mid-run) and summary.

The fixture `recipe_mnist_like` is a real 2-rank torchrun job (`fixtures/make_fixtures.py`):
each rank ran plain `wandb.init(group="mnist")` offline in `rank-{r}/` of the fixture's
directory, with wandb's data directory (its artifact staging) at `wandb-data/` there. Its
links and manifests name the absolute paths where the fixture was made, so the tests pass
the fixture's directory with `--files-from`. What must arrive is read from the ranks' own
`.wandb` files with protobuf and from the files where the ranks left them, never from
wbmerge's staging.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest
from click.testing import CliRunner
from wandb.sdk.artifacts._generated.operations import RUN_OUTPUT_ARTIFACTS_GQL
from wandb.sdk.artifacts._generated.run_output_artifacts import RunOutputArtifacts

from wbmerge.cli import main
from wbmerge.log import read_records

from ..conftest import job_dir
from ..sink.test_sink_artifacts import CLIENT_ID_MAPPING, manifest_digest, md5_b64
from ..support.hostile import tree_digest
from ..support.sinktools import Expected, expected_from_log

pytestmark = pytest.mark.e2e
JOB = "recipe_mnist_like"
PROJECT = "mnist"
TABLE_KEY = "test/predictions"

# wandb-core's query for what a run holds (its resume query): the run's config as W&B
# stores it, with the metric definitions wandb-core sent under `_wandb.m`.
RUN_CONFIG = """
query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) { bucket(name: $name) { config } }
}
"""


def sources(job: Path) -> dict[int, Path]:
    """rank -> that rank's `.wandb` file (its config's `rank`, read with protobuf)."""
    logs = sorted(job.glob("wandb/*/run-*.wandb"))
    return {expected_from_log(log).config["rank"]: log for log in logs}


def logged_artifacts(log: Path) -> dict[str, dict[str, tuple[str, bytes]]]:
    """type -> {file path: (the manifest's MD5, the bytes)} of each artifact a rank logged,
    each file read where the rank's wandb staged it (`wandb-data/` of the fixture, found
    again at the same place under the fixture's directory wherever it now is)."""
    found: dict[str, dict[str, tuple[str, bytes]]] = {}
    for record in read_records(log):
        if record.WhichOneof("record_type") != "artifact":
            continue
        files = {}
        for entry in record.artifact.manifest.contents:
            staged = Path(entry.local_path).parts
            at = staged.index("wandb-data")
            data = job_dir(JOB).joinpath(*staged[at:]).read_bytes()
            files[entry.path] = (entry.digest, data)
        found[record.artifact.type] = files
    return found


def output_artifacts(sink, run_id: str) -> dict[str, object]:
    """type -> the node of each artifact version the run logged, read with the query
    wandb's public API sends (`run.logged_artifacts()`)."""
    variables = {"entity": "local", "project": PROJECT, "run": run_id, "perPage": 100}
    answer = sink.client.graphql(RUN_OUTPUT_ARTIFACTS_GQL, variables)
    run = RunOutputArtifacts.model_validate(answer["data"]).project.run
    assert run is not None, f"no run {run_id}"
    nodes = [edge.node for edge in run.artifacts.edges]
    assert len({node.artifact_type.name for node in nodes}) == len(nodes)
    return {node.artifact_type.name: node for node in nodes}


def server_config(sink, run_id: str) -> dict:
    answer = sink.client.graphql(
        RUN_CONFIG, {"entity": "local", "project": PROJECT, "name": run_id}
    )
    return json.loads(answer["data"]["model"]["bucket"]["config"])


def bound_metrics(sink, run_id: str, keys: set[str]) -> set[tuple[str, str]]:
    """(key, its step metric) for each of `keys` (the run's logged keys) that a metric
    definition the server holds gives a step metric, bound as wandb-core binds them: by
    name, else by a glob whose text before the `*` the key starts with. wandb-core sends
    each definition under `_wandb.m` of the config: `1` its name, `2` its glob, `5` the
    1-based index of the definition of its step metric."""
    metrics = server_config(sink, run_id)["_wandb"]["value"].get("m", [])
    bound = set()
    for key in keys:
        named = [m for m in metrics if m.get("1") == key]
        globs = [m for m in metrics if m.get("2") and key.startswith(m["2"].removesuffix("*"))]
        for metric in named or globs:
            if metric.get("5"):
                bound.add((key, metrics[metric["5"] - 1]["1"]))
    return bound


def cli(sink, tmp_path, *args):
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    return CliRunner().invoke(main, [*map(str, args)], env=env)


def targets(mode: str, base: str) -> dict[str, list[int]]:
    """run id -> the ranks it holds (docs/sync.md)."""
    if mode == "new":
        return {f"{base}-rank-{rank}": [rank] for rank in (0, 1)}
    return {base: [0] if mode == "auto" else [0, 1]}


def assert_history(server_rows: list[dict], want: dict[int, Expected], label) -> None:
    """Every value each rank logged, at its step, under its key in this run."""
    by_step = {row["_step"]: row for row in server_rows}
    for rank, expected in want.items():
        assert sorted(row["_step"] for row in expected.history) == sorted(by_step)
        for row in expected.history:
            arrived = by_step[row["_step"]]
            for key, value in row.items():
                if not key.startswith("_"):
                    assert arrived[label(key, rank)] == value, (rank, row["_step"], key)


@pytest.mark.parametrize("mode", ["auto", "shared", "new"])
def test_a_job_logged_as_the_mnist_guides_log_arrives_whole(sink, tmp_path, mode):
    job = job_dir(JOB)
    before = tree_digest(job)
    logs = sources(job)
    assert sorted(logs) == [0, 1]
    want = {rank: expected_from_log(log) for rank, log in logs.items()}
    base = want[0].run_id
    result = cli(
        sink,
        tmp_path,
        "sync",
        "--json",
        job / "wandb",
        "--run-mode",
        mode,
        "-p",
        PROJECT,
        "-e",
        "local",
        "--files-from",
        job,
    )
    assert result.exit_code == 0, result.stderr
    expected_runs = targets(mode, base)
    assert sorted(r["id"] for r in sink.client.runs()) == sorted(expected_runs)

    # What the ranks wrote, so that the checks below compare values, not absences.
    histograms = {k for row in want[1].history for k in row if k.startswith("gradients/")}
    assert len(histograms) == 4 and {"lr_schedule", "lr_after"} <= set(want[1].config)
    assert "best_acc" in want[0].summary and "best_acc" not in want[1].summary
    artifacts = logged_artifacts(logs[0])
    assert sorted(artifacts) == ["model", "run_table"] and not logged_artifacts(logs[1])
    checkpoints = {rank: (job / f"rank-{rank}" / "model.pt").read_bytes() for rank in (0, 1)}
    assert checkpoints[0] != checkpoints[1]

    for run_id, ranks in expected_runs.items():

        def label(key: str, rank: int) -> str:
            return f"{key}/rank-{rank}" if mode == "shared" else key

        run = sink.client.run("local", PROJECT, run_id)
        assert run["group"] == (base if mode == "new" else "mnist")
        assert_history(run["history"], {rank: want[rank] for rank in ranks}, label)
        primary = want[ranks[0]]
        config = {k: v for k, v in run["config"].items() if k != "wbmerge"}
        # The primary's config (the mid-run update included), and another rank's key where
        # its value is not the primary's, labelled: rank 1's own `rank`.
        others = {
            label(k, r): v
            for r in ranks[1:]
            for k, v in want[r].config.items()
            if primary.config.get(k) != v
        }
        assert config == {**primary.config, **others}
        assert others == ({"rank/rank-1": 1} if mode == "shared" else {})
        for rank in ranks:
            for key, value in want[rank].summary.items():
                if not key.startswith("_"):
                    assert run["summary"][label(key, rank)] == value, (rank, key)

        # Each rank's saved checkpoint, with its bytes; in shared mode under its label.
        saved = {
            ("model.pt" if rank == ranks[0] else f"rank-{rank}/model.pt"): checkpoints[rank]
            for rank in ranks
        }
        for name, data in saved.items():
            assert sink.client.file("local", PROJECT, run_id, name) == data, (run_id, name)

        # `val/*` bound to the key rank 0 logged, stepped by the `epoch` it logged.
        bound = {(label("val/acc", 0), label("epoch", 0))} if 0 in ranks else set()
        keys = {key for row in run["history"] for key in row}
        assert bound_metrics(sink, run_id, keys) == bound

        logged = output_artifacts(sink, run_id)
        if 0 not in ranks:
            assert logged == {}
            continue
        assert sorted(logged) == ["model", "run_table"]
        for kind, node in logged.items():  # committed with the bytes the rank wrote
            files = {path: data for path, (_, data) in artifacts[kind].items()}
            assert all(md5 == md5_b64(files[p]) for p, (md5, _) in artifacts[kind].items())
            assert node.state == "COMMITTED" and node.digest == manifest_digest(files)
            name = f"{node.artifact_sequence.name}:v{node.version_index}"
            committed = sink.client.committed_files("local", PROJECT, name)
            assert committed["files"] == {p: (len(d), md5_b64(d)) for p, d in files.items()}
        checkpoint = sink.client.artifact_file("local", PROJECT, "model-ckpt:best", "model.pt")
        assert checkpoint == checkpoints[0]
        assert json.loads(logged["model"].metadata) == {"best_acc": want[0].summary["best_acc"]}

        # The Table: its history value names the run_table artifact that arrived, whose
        # table holds the four images the artifact carries.
        [value] = [row[label(TABLE_KEY, 0)] for row in run["history"] if label(TABLE_KEY, 0) in row]
        reference = urllib.parse.urlparse(value["artifact_path"])
        assert reference.scheme == "wandb-client-artifact"
        client_id = reference.netloc.split(":")[0]
        answer = sink.client.graphql(CLIENT_ID_MAPPING, {"clientID": client_id})
        assert answer["data"]["clientIDMapping"]["serverID"] == logged["run_table"].id
        latest = urllib.parse.urlparse(value["_latest_artifact_path"]).netloc.split(":")[0]
        answer = sink.client.graphql(CLIENT_ID_MAPPING, {"clientID": latest})
        assert answer["data"]["clientIDMapping"] is not None  # (its artifact sequence)
        table_files = artifacts["run_table"]
        table = json.loads(table_files[f"{TABLE_KEY}.table.json"][1])
        images = sorted(row[0]["path"] for row in table["data"])
        assert len(images) == 4 and set(images) < set(table_files)
        stored_table = sink.client.file("local", PROJECT, run_id, value["path"])
        assert stored_table == (logs[0].parent / "files" / value["path"]).read_bytes()
    assert tree_digest(job) == before  # the user's files are read, never written

"""The metric definitions a run must hold (`define_metric`) are checked on the server after
its upload: a sync whose server lacks one fails with a line that names it.

The fixture `recipe_saved_files` is a real 4-rank torchrun job in which every rank calls
`define_metric("epoch", hidden=True)` and `define_metric("val/*", step_metric="epoch",
summary="max")`, and only rank 0 logs `epoch` and `val/acc`. What each target must hold is
read here from the ranks' own files with protobuf, and what the server holds from the
run's config as wandb-core sent it (`_wandb` -> `m`: `1` the name, `2` the glob, `5` the
1-based place of the step metric's definition, `6` the options set, `7` the summary types
set). The sink's `nometrics` fault keeps each config without `m`, as a server that lost
the definitions would.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.cli import main
from wbmerge.log import read_payloads
from wbmerge.wandbcore import Definition, definitions_missing, held_definitions

from ..conftest import job_dir

pytestmark = pytest.mark.e2e
JOB = "recipe_saved_files"
PROJECT = "defs"
RUN_CONFIG = """
query RunResumeStatus($project: String, $entity: String, $name: String!) {
  model(name: $project, entityName: $entity) { bucket(name: $name) { config } }
}
"""


def source_definitions() -> dict[int, list[pb.MetricRecord]]:
    """rank -> its metric records, read from its own `.wandb` file."""
    found = {}
    for log in job_dir(JOB).glob("wandb/*/run-*.wandb"):
        records = [pb.Record.FromString(payload) for payload in read_payloads(log)]
        rank = next(
            int(item.value_json)
            for record in records
            for item in record.run.config.update
            if item.key == "rank"
        )
        found[rank] = [record.metric for record in records if record.HasField("metric")]
    return found


def sync(sink, tmp_path, mode: str):
    job = job_dir(JOB)
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    args = [
        "sync",
        job / "wandb",
        "--run-mode",
        mode,
        "-p",
        PROJECT,
        "-e",
        "local",
        "--files-from",
        job,
    ]
    return CliRunner().invoke(main, [*map(str, args)], env=env)


def server_metrics(sink, run_id: str) -> list[dict]:
    answer = sink.client.graphql(
        RUN_CONFIG, {"entity": "local", "project": PROJECT, "name": run_id}
    )
    config = json.loads(answer["data"]["model"]["bucket"]["config"])
    return config["_wandb"]["value"].get("m", [])


def test_a_shared_run_holds_every_ranks_definitions_on_the_server(sink, tmp_path):
    by_rank = source_definitions()
    assert sorted(by_rank) == [0, 1, 2, 3]
    for metrics in by_rank.values():  # (what the fixture's ranks defined, read from them)
        assert [
            (m.name, m.glob_name, m.step_metric, m.options.hidden, m.summary.max) for m in metrics
        ] == [("epoch", "", "", True, False), ("", "val/*", "epoch", False, True)]
    result = sync(sink, tmp_path, "shared")
    assert result.exit_code == 0, result.stderr
    [run] = sink.client.runs()
    metrics = server_metrics(sink, run["id"])
    by_name = {m["1"]: m for m in metrics if "1" in m}
    for rank in range(4):  # each rank's hidden `epoch`, under its own label
        assert 2 in by_name[f"epoch/rank-{rank}"]["6"], by_name  # (option 2: hidden)
    # rank 0's `val/*` bound to the key it logged, stepped by its own `epoch`, summary max
    val = by_name["val/acc/rank-0"]
    assert metrics[val["5"] - 1]["1"] == "epoch/rank-0" and val["7"] == [2]
    held = held_definitions(json.dumps({"_wandb": {"value": {"m": metrics}}}))
    assert held is not None
    assert held[("name", "val/acc/rank-0")] == Definition(
        "epoch/rank-0", frozenset({"step_sync"}), frozenset({"max"})
    )
    assert f"verified {run['id']}" in result.stderr


@pytest.mark.parametrize("mode", ["shared", "new"])
def test_a_definition_missing_on_the_server_fails_the_sync_naming_it(make_sink, tmp_path, mode):
    sink = make_sink(["graphql:UpsertBucket=nometrics"])
    result = sync(sink, tmp_path, mode)
    assert result.exit_code == 1, result.stderr
    runs = sink.client.runs()
    assert len(runs) == (1 if mode == "shared" else 4)
    for run in runs:  # (the fault did keep the configs without definitions)
        assert server_metrics(sink, run["id"]) == []
    if mode == "shared":
        assert "metric definition name 'val/acc/rank-0' not on the server" in result.stderr
        assert "metric definition name 'epoch/rank-3' not on the server" in result.stderr
    else:
        for run in runs:  # (each rank's own run: its `val/*` as the rank defined it)
            assert (
                f"incomplete {run['id']}: metric definition name 'epoch' not on the server; "
                "metric definition glob 'val/*' not on the server"
            ) in result.stderr
    assert "verified" not in result.stderr

    again = sync(make_sink([]), tmp_path / "again", mode)  # (a server that keeps them)
    assert again.exit_code == 0, again.stderr


def test_a_definition_held_otherwise_is_named_with_both_settings():
    expected = {
        ("glob", "val/*"): Definition("epoch", frozenset({"step_sync"}), frozenset({"max"}))
    }
    held = held_definitions(
        json.dumps(
            {
                "_wandb": {
                    "value": {"m": [{"2": "val/*", "5": 2, "6": [1], "7": [1]}, {"1": "epoch"}]}
                }
            }
        )
    )
    [line] = definitions_missing(expected, held)
    assert "glob 'val/*'" in line and "summary min on the server" in line
    assert "the upload gives step metric 'epoch', step_sync, summary max" in line
    assert definitions_missing(expected, held_definitions('{"_wandb": {"value": {"m": 3}}}'))

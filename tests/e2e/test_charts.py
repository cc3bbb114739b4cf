"""Custom charts and the class names of boxes and masks, written by real wandb on every rank
of a job (`tests/support/charts_job.py`), synced in shared mode into the sink: each rank's
chart draws a table the run holds, and its class names sit under its own image key."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge import merge
from wbmerge.analyse import PerRank
from wbmerge.cli import main
from wbmerge.log import LogWriter, pb, read_payloads, read_records, record_kind
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.verify import source_shortfall

from ..support.charts_job import BOX_CLASSES, MASK_CLASSES
from ..verify.test_metric_definitions_on_server import RUN_CONFIG
from .test_sync import cli_sync

pytestmark = pytest.mark.e2e

CHARTS = ("charts/val_curve", "charts/spread", "eval/confusion")
WORLD = 2


def write_job(root: Path, world: int, *args: str, rates: tuple[float, ...] = ()) -> Path:
    """Every rank's offline run, written at once as the ranks of one job write them."""
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_SILENT="true", PYTHONPATH=str(Path(__file__).parents[2]))
    procs = []
    for rank in range(world):
        rate = ["--lr", str(rates[rank])] if rates else []
        command = ["-m", "tests.support.charts_job", str(root), str(rank), str(world), *args]
        procs.append(subprocess.Popen([sys.executable, *command, *rate], env=env))
    assert [proc.wait(timeout=300) for proc in procs] == [0] * world
    return root


@pytest.fixture(scope="module")
def charts_job(tmp_path_factory) -> Path:
    return write_job(tmp_path_factory.mktemp("charts"), WORLD)


def source_entries(root: Path, rank: int) -> dict[tuple[str, str], dict]:
    """The `_wandb` entries rank `rank`'s own log holds, read with protobuf."""
    [log] = [
        p for p in root.glob("wandb/offline-run-*/run-*.wandb") if _config_value(p, "rank") == rank
    ]
    entries: dict[tuple[str, str], dict] = {}
    for record in read_records(log):
        for item in record.config.update:
            if list(item.nested_key[:1]) == ["_wandb"] and len(item.nested_key) == 3:
                entries[(item.nested_key[1], item.nested_key[2])] = json.loads(item.value_json)
            elif item.key == "_wandb":
                for kind in ("bounding_box/class_labels", "mask/class_labels"):
                    for key, value in json.loads(item.value_json).get(kind, {}).items():
                        entries[(kind, key)] = value
    return entries


def _config_value(log: Path, key: str):
    for record in read_records(log):
        for item in record.run.config.update:
            if item.key == key:
                return json.loads(item.value_json)
    return None


def server_config(sink, project: str, run_id: str) -> dict:
    """The run's config as the server holds it, `_wandb` included (as W&B's API gives it)."""
    answer = sink.client.graphql(
        RUN_CONFIG, {"entity": "local", "project": project, "name": run_id}
    )
    return json.loads(answer["data"]["model"]["bucket"]["config"])


def table_key(chart: dict) -> str:
    [query] = chart["panel_config"]["userQuery"]["queryFields"]
    [table] = [f for f in query["fields"] if f["name"] == "summaryTable"]
    return table["args"][0]["value"]


@pytest.mark.parametrize("scope", ["global", "worker"])
def test_a_shared_run_holds_every_ranks_charts_and_class_names_under_its_own_keys(
    sink, tmp_path, charts_job, scope
):
    result = cli_sync(
        sink,
        tmp_path,
        charts_job,
        "--run-mode",
        "shared",
        "-p",
        "charts",
        "--rank-scope",
        scope,
        "--base-id",
        "C",
        "--files-from",
        charts_job,
    )
    assert result.exit_code == 0, result.stderr
    [run_id] = [
        run["id"]
        for run in sink.client.runs(project="charts")
        if run["id"].startswith("C") and run["config"]["wbmerge"]["rank_scope"] == scope
    ]
    got = sink.client.run("local", "charts", run_id)
    server = server_config(sink, "charts", run_id)
    config = server["_wandb"]["value"]
    labels = server["wbmerge"]["value"]["labels"]
    assert len(labels) == WORLD
    last_row = got["history"][-1]
    for rank in range(WORLD):
        label = labels[str(rank)]
        source = source_entries(charts_job, rank)
        for chart in CHARTS:
            held = config["visualize"][f"{chart}/{label}"]
            logged = source[("visualize", chart)]
            assert table_key(logged) == f"{chart}_table"
            assert table_key(held) == f"{chart}_table/{label}"
            assert held["panel_config"]["panelDefId"] == logged["panel_config"]["panelDefId"]
            assert held["panel_config"]["fieldSettings"] == logged["panel_config"]["fieldSettings"]
            # the table it draws is the run's, the rank's own
            assert last_row[table_key(held)]["_type"] == "table-file"
            assert last_row[table_key(held)]["path"] == got["summary"][table_key(held)]["path"]
        image = f"eval/detection/{label}"
        assert set(last_row[image]["boxes"]) == {"predictions"}
        assert set(last_row[image]["masks"]) == {"segmentation"}
        boxes = config["bounding_box/class_labels"][f"{image}_wandb_delimeter_predictions"]
        masks = config["mask/class_labels"][f"{image}_wandb_delimeter_segmentation"]
        assert boxes["key"] == f"{image}_wandb_delimeter_predictions"
        assert boxes["value"] == {str(k): v for k, v in BOX_CLASSES.items()}
        assert masks["value"] == {str(k): v for k, v in MASK_CLASSES.items()}
    # no entry is left under a key the run does not hold
    assert not set(CHARTS) & set(config["visualize"])
    assert "eval/detection_wandb_delimeter_predictions" not in config["bounding_box/class_labels"]


def drop_entry(log: Path, path: list[str]) -> None:
    """A stand-in fault of the merge: the staged run loses the config entry at `path`
    (every other record is written back as it was)."""
    payloads = list(read_payloads(log))
    with open(log, "wb") as stream, LogWriter(stream) as writer:
        for payload in payloads:
            if record_kind(payload) == "config":
                record = pb.Record.FromString(payload)
                kept = [i for i in record.config.update if list(i.nested_key) != path]
                del record.config.update[:]
                record.config.update.extend(kept)
                payload = record.SerializeToString()
            writer.write(payload)


@pytest.mark.parametrize(
    ("path", "named"),
    [
        (
            ["_wandb", "visualize", "charts/val_curve/rank-1"],
            "rank 1's chart 'charts/val_curve/rank-1': not in the staged config",
        ),
        (
            ["_wandb", "mask/class_labels", "eval/detection/rank-0_wandb_delimeter_segmentation"],
            "rank 0's mask class labels 'eval/detection/rank-0_wandb_delimeter_segmentation'",
        ),
    ],
)
def test_a_sync_whose_merge_lost_a_chart_or_class_names_fails_naming_it(
    sink, tmp_path, charts_job, monkeypatch, path, named
):
    stage = merge.stage

    def losing_stage(target, out_dir, options, **kwargs):
        staged = stage(target, out_dir, options, **kwargs)
        drop_entry(staged.log_path, path)
        return staged

    monkeypatch.setattr(merge, "stage", losing_stage)
    result = cli_sync(
        sink,
        tmp_path,
        charts_job,
        "--run-mode",
        "shared",
        "-p",
        "lost",
        "--base-id",
        "L",
        "--files-from",
        charts_job,
    )
    assert result.exit_code == 1
    [line] = [line for line in result.stderr.splitlines() if line.startswith("wbmerge: error")]
    assert f"run L: not sent: the staged run lacks what its ranks logged: {named}" in line
    assert sink.client.runs(project="lost") == []


def staged_config_entries(log: Path) -> set[tuple[str, str]]:
    """The `_wandb` entries a staged log sets by their path."""
    return {
        (item.nested_key[1], item.nested_key[2])
        for record in read_records(log)
        for item in record.config.update
        if len(item.nested_key) == 3 and item.nested_key[0] == "_wandb"
    }


@pytest.mark.parametrize("mode", ["new", "auto", "shared"])
def test_the_source_check_counts_every_ranks_charts_and_class_names(tmp_path, charts_job, mode):
    runs = merge_jobs(
        MergeRequest([charts_job], run_mode=mode, files_from=[charts_job]), tmp_path / "out"
    )
    for run in runs:
        assert source_shortfall(run.target, run.log_path) == []
        rank = run.target.primary_rank
        label = "rank-1" if mode == "shared" else None
        chart = f"charts/spread/{label}" if label else "charts/spread"
        assert ("visualize", chart) in staged_config_entries(run.log_path)
        drop_entry(run.log_path, ["_wandb", "visualize", chart])
        [problem] = source_shortfall(run.target, run.log_path)
        owner = 1 if label else rank
        assert (
            problem == f"rank {owner}'s chart {chart!r}: not in the staged config's "
            "_wandb.visualize"
        )


def test_entries_of_keys_per_rank_leaves_out_are_neither_staged_nor_expected(tmp_path, charts_job):
    request = MergeRequest(
        [charts_job], run_mode="shared", files_from=[charts_job], per_rank=["loss", "eval/*"]
    )
    [run] = merge_jobs(request, tmp_path / "out")
    per_rank = PerRank.parse(["loss", "eval/*"])
    assert source_shortfall(run.target, run.log_path, per_rank=per_rank) == []
    staged = staged_config_entries(run.log_path)
    assert {key for kind, key in staged if kind == "visualize"} == {
        f"eval/confusion/rank-{rank}" for rank in range(WORLD)
    }
    assert ("mask/class_labels", "eval/detection/rank-1_wandb_delimeter_segmentation") in staged


def merge_warnings(tmp_path: Path, root: Path) -> list[str]:
    out = tmp_path / "merged"
    args = ["merge", str(root), "--run-mode", "new", "--out", str(out), "--files-from", str(root)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("wbmerge: warning")]


def test_per_rank_seeds_shards_and_charts_of_one_job_say_nothing_of_config(tmp_path, charts_job):
    # (each rank's seed, data shard and chart title are its own: see charts_job.py)
    assert (
        len(
            {
                json.dumps(source_entries(charts_job, rank)[("visualize", "charts/val_curve")])
                for rank in range(WORLD)
            }
        )
        == WORLD
    )
    assert merge_warnings(tmp_path, charts_job) == []


def test_two_separate_experiments_still_get_the_config_warning(tmp_path):
    """Two runs that say they are ranks 0 and 1 of one group, with other learning rates:
    two experiments that reused a group name, and the warning names the learning rate."""
    root = write_job(tmp_path / "two", WORLD, "--job", "reused", rates=(0.1, 0.2))
    [warning] = merge_warnings(tmp_path, root)
    assert "its runs differ in config (lr; lr = " in warning
    for log in root.glob("wandb/offline-run-*/run-*.wandb"):
        run_id = log.stem.removeprefix("run-")
        assert f"{_config_value(log, 'lr')}: {run_id}" in warning
    assert warning.endswith("split them with --ranks FILE (its job column)")


def test_a_server_that_loses_the_charts_fails_the_sync_naming_them(make_sink, tmp_path, charts_job):
    """The check after the upload reads the charts back: a server that keeps the config
    without `_wandb.visualize` (the sink's `nocharts` fault) fails the run, naming each."""
    sink = make_sink(["graphql:UpsertBucket=nocharts"])
    result = cli_sync(
        sink,
        tmp_path,
        charts_job,
        "--run-mode",
        "shared",
        "-p",
        "charts",
        "--base-id",
        "N",
        "--files-from",
        charts_job,
    )
    assert result.exit_code == 1, result.stderr
    held = server_config(sink, "charts", "N")["_wandb"]["value"]
    assert "visualize" not in held and "mask/class_labels" in held  # (what the fault did)
    for rank in range(WORLD):
        for chart in CHARTS:
            assert f"chart '{chart}/rank-{rank}' not on the server" in result.stderr
    assert "class labels" not in result.stderr
    assert "verified" not in result.stderr
    again = cli_sync(
        make_sink([]),
        tmp_path / "again",
        charts_job,
        "--run-mode",
        "shared",
        "-p",
        "charts",
        "--base-id",
        "N",
        "--files-from",
        charts_job,
    )
    assert again.exit_code == 0, again.stderr


def test_each_ranks_own_run_keeps_its_charts_and_class_names_as_written(sink, tmp_path, charts_job):
    result = cli_sync(
        sink,
        tmp_path,
        charts_job,
        "--run-mode",
        "new",
        "-p",
        "own",
        "--base-id",
        "O",
        "--files-from",
        charts_job,
    )
    assert result.exit_code == 0, result.stderr
    for rank in range(WORLD):
        held = server_config(sink, "own", f"O-rank-{rank}")["_wandb"]["value"]
        for (kind, key), value in source_entries(charts_job, rank).items():
            assert held[kind][key] == value


def test_verify_names_the_charts_and_class_names_a_server_lost(sink, tmp_path, charts_job):
    """`wbmerge verify` checks a shared run's charts and class names on the server: whole
    after the sync, and each entry named once the server's config has lost them."""
    options = [
        "--run-mode",
        "shared",
        "-p",
        "chartsv",
        "--base-id",
        "V",
        "--files-from",
        charts_job,
    ]
    assert cli_sync(sink, tmp_path, charts_job, *options).exit_code == 0
    env = {**sink.env, "WBMERGE_STATE_DIR": str(tmp_path / "state")}
    verify = ["verify", "--json", str(charts_job), *map(str, options)]
    result = CliRunner().invoke(main, verify, env=env)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["whole"] is True

    with sqlite3.connect(sink.data_dir / "sink.sqlite3") as db:
        [config] = db.execute("SELECT config FROM runs WHERE name = 'V'").fetchone()
        held = json.loads(config)
        del held["_wandb"]["value"]["visualize"], held["_wandb"]["value"]["mask/class_labels"]
        db.execute("UPDATE runs SET config = ? WHERE name = 'V'", (json.dumps(held),))
    db.close()
    result = CliRunner().invoke(main, verify, env=env)
    assert result.exit_code == 1
    [run] = json.loads(result.stdout)["runs"]
    said = "; ".join(run["problems"])
    for rank in range(WORLD):
        for chart in CHARTS:
            assert f"chart '{chart}/rank-{rank}' not on the server" in said
        assert f"eval/detection/rank-{rank}" in said  # (its mask class names)

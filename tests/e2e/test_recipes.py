"""Runs written with plain `wandb.init` as W&B's guides show, end to end into the sink.

The rank that wrote a run is the `rank` value its training loop logs at every step (read
from the source file with protobuf): where the run says its rank (config, label, name),
that must be the rank wbmerge uses; where it says nothing, the documented start order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main

from ..conftest import MANIFEST, job_dir
from ..support.sinktools import expected_from_log
from .test_sync import assert_shared, cli_sync, tree_digest

pytestmark = pytest.mark.e2e

# recipe fixture -> (where the rank comes from, how the labels are spelled)
RECIPES = {
    "recipe_config": ("config", "rank-{rank}"),
    "recipe_name": ("name", "rank-{rank}"),
    "recipe_shared_label": ("label", "rank_{rank}"),
    "recipe_ui_label": ("label", "rank{rank}"),
    "recipe_node_label": ("label", "node{worker}_rank{local_rank}"),
    "recipe_host": ("config", "worker-{worker}-rank-{local_rank}"),
    "recipe_group": ("order", "{run_id}"),
    "recipe_group_reversed": ("order", "{run_id}"),
    "recipe_job_type": ("order", "{run_id}"),
    "recipe_launch_args": ("args", "rank-{rank}"),
    "recipe_srun": ("slurm", "worker-{worker}-rank-{local_rank}"),
}


def inspect_rows(path, *args):
    result = CliRunner().invoke(main, ["inspect", "--json", str(path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def truth(row):
    """The rank the run's own training loop logged, and the whole run as protobuf reads it."""
    want = expected_from_log(next(Path(row["path"]).glob("run-*.wandb")))
    [rank] = {r["rank"] for r in want.history}
    return rank, want


def test_every_recipe_fixture_is_covered():
    # (recipe_saved_files: test_saved_files, recipe_tensorboard: test_tensorboard,
    # recipe_mnist_like: test_mnist_like, with --files-from, as their links need)
    covered = {"recipe_rank0_only", "recipe_saved_files", "recipe_tensorboard", "recipe_mnist_like"}
    assert set(RECIPES) | covered == set(MANIFEST["recipes"]) - {
        n for n in MANIFEST["recipes"] if n.startswith("wandb_")
    }


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_are_identified_by_what_they_say(name):
    source, spelling = RECIPES[name]
    recipe = MANIFEST["recipes"][name]
    rows = inspect_rows(job_dir(name))
    world = recipe["nodes"] * recipe["nproc"]
    assert len(rows) == world and len({r["job_id"] for r in rows}) == 1
    for row in rows:
        logged, want = truth(row)
        assert row["source"] == source
        assert row["world_size"] == world
        if source == "order":
            continue
        assert row["rank"] == logged, "the rank the run says is the rank used"
        assert (row["local_rank"], row["worker"]) == (
            logged % recipe["nproc"],
            logged // recipe["nproc"],
        )
        assert row["label"] == spelling.format(
            rank=logged, worker=row["worker"], local_rank=row["local_rank"], run_id=row["run_id"]
        )
    rank0 = next(r for r in rows if r["rank"] == 0)
    assert rows[0]["job_id"] == rank0["run_id"]


def test_the_main_job_type_is_rank_0_and_the_rest_go_by_start_order():
    rows = inspect_rows(job_dir("recipe_job_type"))
    by_rank = {r["rank"]: r for r in rows}
    assert truth(by_rank[0])[1].job_type == "main"
    assert {truth(by_rank[r])[1].job_type for r in (1, 2, 3)} == {"worker"}
    assert all(r["label"] == r["run_id"] for r in rows)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shared_sync_gives_every_ranks_values_once_under_its_own_label(sink, tmp_path, name):
    rows = inspect_rows(job_dir(name))
    before = tree_digest(job_dir(name))
    # (a job whose rank 0 is only the first run to start is refused unless accepted)
    accept = ["--rank-order", "start"] if any(r["rank_guessed"] for r in rows) else []
    result = cli_sync(
        sink,
        tmp_path,
        job_dir(name),
        "--run-mode",
        "shared",
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "S",
        *accept,
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert tree_digest(job_dir(name)) == before
    got = sink.client.run("local", "e2e", "S")
    ranks = []
    for row in sorted(rows, key=lambda r: r["rank"]):
        logged, want = truth(row)
        ranks.append((row["label"], want, None))
        if RECIPES[name][0] != "order":
            # the key carries the label of the rank that logged the value
            for source_row in want.history:
                step = source_row["_step"]
                arrived = next(r for r in got["history"] if r["_step"] == step)
                assert arrived[f"rank/{row['label']}"] == logged
    assert_shared(got, ranks)
    assert got["state"] == "finished" and got["exit_code"] == 0


@pytest.mark.parametrize("name", ["recipe_shared_label", "recipe_node_label", "recipe_group"])
def test_new_sync_gives_each_rank_its_own_run(sink, tmp_path, name):
    rows = inspect_rows(job_dir(name))
    result = cli_sync(
        sink,
        tmp_path,
        job_dir(name),
        "--run-mode",
        "new",
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "N",
    )
    assert result.exit_code == 0, result.output + result.stderr
    runs = {r["id"]: r for r in sink.client.runs(project="e2e")}
    assert sorted(runs) == sorted(f"N-rank-{r['rank']}" for r in rows)
    for row in rows:
        _, want = truth(row)
        got = sink.client.run("local", "e2e", f"N-rank-{row['rank']}")
        assert got["group"] == "N"
        assert [{k: v for k, v in r.items() if k != "_runtime"} for r in got["history"]] == [
            {k: v for k, v in r.items() if k != "_runtime"} for r in want.history
        ]


@pytest.mark.parametrize("mode", ["auto", "shared", "new"])
def test_a_single_run_without_rank_information_is_uploaded_as_it_is(sink, tmp_path, mode):
    [row] = inspect_rows(job_dir("recipe_rank0_only"))
    assert (row["rank"], row["world_size"], row["source"]) == (0, 1, "order")
    _, want = truth(row)
    result = cli_sync(
        sink,
        tmp_path,
        job_dir("recipe_rank0_only"),
        "--run-mode",
        mode,
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "solo",
    )
    assert result.exit_code == 0, result.output + result.stderr
    assert "warning" not in result.stderr  # nothing was assumed about one run
    run_id = "solo-rank-0" if mode == "new" else "solo"
    got = sink.client.run("local", "e2e", run_id)
    if mode == "shared":
        assert_shared(got, [(row["label"], want, None)])
    else:
        assert [r["_step"] for r in got["history"]] == [r["_step"] for r in want.history]
        assert [r["train/loss"] for r in got["history"]] == [r["train/loss"] for r in want.history]


def test_export_and_report_take_the_same_ranks_and_labels(tmp_path):
    import pyarrow.parquet as pq

    rows = {r["run_id"]: r for r in inspect_rows(job_dir("recipe_node_label"))}
    out = tmp_path / "runs.parquet"
    result = CliRunner().invoke(main, ["export", str(job_dir("recipe_node_label")), "-o", str(out)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out).to_pylist()
    for value in table:
        if value["kind"] == "history" and value["key"] == "rank":
            row = rows[value["run_id"]]
            assert value["value"] == row["rank"] == value["rank"]
            assert value["label"] == row["label"] and value["worker"] == row["worker"]
    result = CliRunner().invoke(main, ["report", str(job_dir("recipe_node_label")), "--json"])
    assert result.exit_code == 0, result.output
    [job] = json.loads(result.output)
    metric = next(m for m in job["metrics"] if m["key"] == "rank")
    assert {(s["rank"], s["label"], s["mean"]) for s in metric["ranks"]} == {
        (r["rank"], r["label"], float(r["rank"])) for r in rows.values()
    }

"""Flyte: the example workflow in Flyte's local mode, end to end into the sink; the links."""

from __future__ import annotations

import json
import subprocess
import sys

import flyte
import pytest
from flyteplugins.pytorch.task import Elastic

import wbmerge.flyte as wf
from wbmerge.discover import discover
from wbmerge.errors import WbmergeError
from wbmerge.txlog import read_records

from .conftest import ROOT

HOST = "https://wandb.ai"


@pytest.mark.parametrize(
    ("run_mode", "rank_scope", "workers", "expected"),
    [
        ("auto", "global", 1, ["runs/B"]),
        ("shared", "global", 1, ["runs/B"]),
        ("new", "global", 1, ["groups/B"]),
        ("auto", "global", 2, ["runs/B"]),
        ("auto", "worker", 2, ["runs/B-worker-0", "runs/B-worker-1"]),
        ("shared", "global", 2, ["runs/B"]),
        ("shared", "worker", 2, ["runs/B-worker-0", "runs/B-worker-1"]),
        ("new", "global", 2, ["groups/B"]),
        ("new", "worker", 2, ["groups/B-worker-0", "groups/B-worker-1"]),
        ("shared", "worker", 1, ["runs/B"]),  # one node: worker scope is global
    ],
)
def test_links_follow_the_run_mode_table(run_mode, rank_scope, workers, expected):
    links = wf.run_links("B", run_mode, rank_scope, workers, HOST, "team", "proj")
    assert links == [f"{HOST}/team/proj/{tail}" for tail in expected]


def test_training_task_links_are_built_from_run_and_action_names():
    settings = wf.Settings(run_mode="new", rank_scope="worker", project="p", entity="e", nnodes=2)
    links = wf.training_links(settings)
    assert [link.name for link in links] == [
        "Weights & Biases worker 0",
        "Weights & Biases worker 1",
    ]
    rendered = [
        link.get_link("r1", "flyteproj", "dev", {}, "a0", "a7", "pod", **{}) for link in links
    ]
    assert rendered == [
        "https://wandb.ai/e/p/groups/r1-a7-worker-0",
        "https://wandb.ai/e/p/groups/r1-a7-worker-1",
    ]


def test_context_fills_what_the_decorator_left_open():
    (link,) = wf.training_links(wf.Settings(nnodes=1))
    context = {
        "wandb_project": "ctxp",
        "wandb_entity": "ctxe",
        "wandb_run_mode": "new",
        "wandb_host": "http://h",
    }
    assert link.get_link("r", "", "", context, "", "act", "") == "http://h/ctxe/ctxp/groups/r-act"


def test_merge_task_links_come_from_the_context_sync_sets():
    (link,) = wf.training_links(wf.Settings(project="p", entity="e", nnodes=1), from_context=True)
    context = {"wbmerge_base": "job-7", "wbmerge_run_mode": "shared"}
    assert (
        link.get_link("r", "", "", context, "", "merge-action", "")
        == "https://wandb.ai/e/p/runs/job-7"
    )


def test_decorator_wants_an_elastic_task():
    env = flyte.TaskEnvironment(name="not_elastic")

    @env.task
    def plain() -> int:
        return 1

    with pytest.raises(WbmergeError, match="Elastic"):
        wf.wandb_init(plain)


def test_decorator_records_settings_and_links_on_the_task():
    env = flyte.TaskEnvironment(
        name="elastic_env", plugin_config=Elastic(nnodes=2, nproc_per_node=2)
    )

    @wf.wandb_init(run_mode="shared", rank_scope="worker", project="p")
    @env.task
    def train() -> int:
        return 1

    assert (train.wbmerge_settings.nnodes, train.wbmerge_settings.nproc_per_node) == (2, 2)
    assert len([link for link in train.links if isinstance(link, wf.RunLink)]) == 2
    assert train.func.__name__ == "train"  # Flyte finds the task by its function's name


def run_example(sink, tmp_path, *args: str, nodes: int = 1, nproc: int = 2) -> dict:
    env = {
        **sink.env,
        "WBMERGE_DIR": str(tmp_path / "runs"),
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "NODES": str(nodes),
        "NPROC": str(nproc),
        "HOME": str(tmp_path),  # flyte's local run data
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "flyte_workflow.py"), "--steps", "6", "--json", *args],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (job_dir,) = (tmp_path / "runs").iterdir()
    result["base"] = job_dir.name
    result["runs"] = discover([job_dir])
    return result


def source_history(run) -> dict[int, dict[str, float]]:
    rows = {}
    for record in read_records(run.path):
        if record.WhichOneof("record_type") == "history":
            items = {(list(i.nested_key) or [i.key])[0]: i.value_json for i in record.history.item}
            rows[record.history.step.num] = {
                k: float(v) for k, v in items.items() if not k.startswith("_")
            }
    return rows


@pytest.mark.e2e
def test_auto_uploads_rank_0_as_the_job_run(sink, tmp_path):
    result = run_example(sink, tmp_path, "--run-mode", "auto")
    base = result["base"]
    assert base.startswith(result["flyte_run"] + "-")  # {run_name}-{action_name}
    assert {r.job_id for r in result["runs"]} == {base}
    assert sorted(r.rank.rank for r in result["runs"]) == [0, 1]  # two real ranks
    assert result["links"] == [f"{sink.url}/local/wbmerge-demo/runs/{base}"]
    (arrived,) = sink.client.runs(project="wbmerge-demo")
    assert arrived["id"] == base
    history = sink.client.run("local", "wbmerge-demo", base)["history"]
    rank0 = next(r for r in result["runs"] if r.rank.rank == 0)
    expected = source_history(rank0)
    assert {row["_step"]: {k: row[k] for k in expected[0]} for row in history} == expected


@pytest.mark.e2e
def test_shared_merges_every_rank_into_the_job_run(sink, tmp_path):
    result = run_example(sink, tmp_path, "--run-mode", "shared")
    base = result["base"]
    assert result["links"] == [f"{sink.url}/local/wbmerge-demo/runs/{base}"]
    (arrived,) = sink.client.runs(project="wbmerge-demo")
    assert arrived["id"] == base
    rows = {row["_step"]: row for row in sink.client.run("local", "wbmerge-demo", base)["history"]}
    for run in result["runs"]:
        label = run.rank.label
        for step, values in source_history(run).items():
            for key, value in values.items():
                assert rows[step][f"{key}/{label}"] == value


@pytest.mark.e2e
def test_new_on_two_nodes_with_worker_scope_groups_per_worker(sink, tmp_path):
    result = run_example(sink, tmp_path, "--run-mode", "new", "--rank-scope", "worker", nodes=2)
    base = result["base"]
    assert sorted((r.rank.worker, r.rank.local_rank) for r in result["runs"]) == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert result["links"] == [
        f"{sink.url}/local/wbmerge-demo/groups/{base}-worker-{w}" for w in (0, 1)
    ]
    arrived = {r["id"]: r["group"] for r in sink.client.runs(project="wbmerge-demo")}
    assert arrived == {
        f"{base}-worker-{w}-rank-{r}": f"{base}-worker-{w}" for w in (0, 1) for r in (0, 1)
    }
    for run in result["runs"]:
        run_id = f"{base}-worker-{run.rank.worker}-rank-{run.rank.local_rank}"
        history = sink.client.run("local", "wbmerge-demo", run_id)["history"]
        expected = source_history(run)
        assert {row["_step"]: {k: row[k] for k in expected[0]} for row in history} == expected

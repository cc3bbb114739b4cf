"""Flyte: the example workflow in Flyte's local mode, end to end into the sink; the links.

Several nodes share no directory here: each node's launcher has its own WBMERGE_DIR and the
runs reach the merge task only through the raw data store (a separate directory)."""

from __future__ import annotations

import flyte
import pytest
from flyteplugins.pytorch.task import Elastic

import wbmerge.flyte as wf
from wbmerge.errors import WbmergeError

from ..e2e.test_sync import assert_shared
from ..support.flytetools import run_example
from ..support.sinktools import console_text, expected_from_log, system_metric_values

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


def sources(runs) -> dict[int, tuple[str, object, object]]:
    """rank -> (label, what its .wandb file says, the run), read with protobuf directly."""
    return {r.rank.rank: (r.rank.label, expected_from_log(r.path), r) for r in runs}


def assert_passed_through(got, want) -> None:
    assert got["history"] == want.history
    assert {k: v for k, v in got["summary"].items() if k != "_wandb"} == want.summary
    assert console_text(got["console"]) == want.console
    assert system_metric_values(got["system_metrics"]) == want.stats


def assert_nodes_kept_apart(result, nodes: int) -> None:
    """Each node wrote only its own folder, in its own directory."""
    assert [sorted(p.name for p in d.iterdir()) for d in result["node_dirs"]] == [
        [f"worker-{n}"] for n in range(nodes)
    ]


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
    _, want, _ = sources(result["runs"])[0]
    assert_passed_through(sink.client.run("local", "wbmerge-demo", base), want)


@pytest.mark.e2e
def test_shared_on_two_nodes_without_a_shared_directory(sink, tmp_path):
    result = run_example(sink, tmp_path, "--run-mode", "shared", nodes=2, nproc=2)
    base = result["base"]
    assert_nodes_kept_apart(result, 2)
    (handed,) = (tmp_path / "raw-data").glob(f"*/{base}")  # one prefix of the raw data store
    assert sorted(p.name for p in handed.iterdir()) == [wf.MANIFEST, "worker-0", "worker-1"]
    ranks = sources(result["runs"])
    assert sorted(ranks) == [0, 1, 2, 3]
    assert result["links"] == [f"{sink.url}/local/wbmerge-demo/runs/{base}"]
    (arrived,) = sink.client.runs(project="wbmerge-demo")
    assert arrived["id"] == base
    got = sink.client.run("local", "wbmerge-demo", base)
    assert_shared(got, [ranks[r] for r in sorted(ranks)])


@pytest.mark.e2e
def test_new_on_two_nodes_with_worker_scope_merges_each_node_apart(sink, tmp_path):
    result = run_example(
        sink, tmp_path, "--run-mode", "new", "--rank-scope", "worker", nodes=2, nproc=2
    )
    base = result["base"]
    assert_nodes_kept_apart(result, 2)
    assert sorted((r.rank.worker, r.rank.local_rank) for r in result["runs"]) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert result["links"] == [
        f"{sink.url}/local/wbmerge-demo/groups/{base}-worker-{w}" for w in (0, 1)
    ]
    arrived = {r["id"]: r["group"] for r in sink.client.runs(project="wbmerge-demo")}
    assert arrived == {
        f"{base}-worker-{w}-rank-{r}": f"{base}-worker-{w}" for w in (0, 1) for r in (0, 1)
    }
    for _, want, run in sources(result["runs"]).values():
        run_id = f"{base}-worker-{run.rank.worker}-rank-{run.rank.local_rank}"
        assert_passed_through(sink.client.run("local", "wbmerge-demo", run_id), want)
    # one merge per node, each with its own record of what it uploaded
    ledgers = sorted(p.parent.name for p in (tmp_path / "state").glob("*/ledger.sqlite3"))
    assert ledgers == ["worker-0", "worker-1"]

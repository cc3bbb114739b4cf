"""The plain-wandb fixtures are what each recipe of W&B's distributed-training guides writes.

Each run is read record by record with protobuf; the rank that wrote a run is the `rank`
value the training loop logs at every step (the ground truth), so these tests check that
the recipe's own marks (group, job type, label, name, config, host) are in the file as the
recipe sets them, and that nothing from wbmerge is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from wbmerge.log import pb, read_payloads

from ..conftest import MANIFEST, job_dir

RECIPES = MANIFEST["recipes"]


@dataclass
class Written:
    """What one offline run holds, read with protobuf."""

    path: Path
    run: pb.RunRecord | None = None
    config: dict = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)
    stats_keys: set[str] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    exited: bool = False

    @property
    def rank(self) -> int:
        assert len(self.ranks) == 1, self.ranks
        return next(iter(self.ranks))


def read_run(path: Path) -> Written:
    written = Written(path)
    for payload in read_payloads(path):
        record = pb.Record.FromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            written.run = record.run
            written.config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            written.hosts.add(record.run.host)
        elif kind == "environment" and record.environment.host:
            written.hosts.add(record.environment.host)
        elif kind == "history":
            items = {tuple(i.nested_key) or (i.key,): i.value_json for i in record.history.item}
            written.steps.append(json.loads(items[("_step",)]))
            if ("rank",) in items:  # (a TensorBoard run logs only its scalars)
                written.ranks.add(json.loads(items[("rank",)]))
        elif kind == "stats":
            written.stats_keys.update(item.key for item in record.stats.item)
        elif kind == "exit":
            written.exited = True
    if not written.ranks and "rank" in written.config:
        written.ranks.add(written.config["rank"])
    return written


def job_runs(name: str) -> list[Written]:
    paths = sorted(job_dir(name).glob("wandb/offline-run-*/run-*.wandb"))
    return sorted((read_run(p) for p in paths), key=lambda w: w.rank)


def labels_in_stats(run: Written) -> set[str]:
    return {key.rsplit("/l:", 1)[1] for key in run.stats_keys if "/l:" in key}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_rank_wrote_one_whole_run(name):
    job = RECIPES[name]
    runs = job_runs(name)
    world = job["nodes"] * job["nproc"]
    expected_ranks = [0] if job["recipe"] == "rank0-only" else list(range(world))
    assert [r.rank for r in runs] == expected_ranks
    assert len(runs) == job["runs"]
    for run in runs:
        assert run.exited, run.path
        assert run.steps == list(range(job["steps"])), run.path
        assert "wbmerge" not in run.config  # plain wandb.init: nothing of ours


def by_recipe(recipe: str) -> list[Written]:
    """The runs of the one job written with `recipe` whose ranks started in rank order."""
    (name,) = [
        n
        for n, job in RECIPES.items()
        if job["recipe"] == recipe and "--start-stagger" not in job["train_args"]
    ]
    return job_runs(name)


def environments(run: Written) -> list[pb.EnvironmentRecord]:
    return [
        record.environment
        for p in read_payloads(run.path)
        if (record := pb.Record.FromString(p)).WhichOneof("record_type") == "environment"
    ]


@pytest.mark.parametrize(
    "name", [n for n, j in RECIPES.items() if "--start-stagger" in j["train_args"]]
)
def test_staggered_jobs_started_their_ranks_in_reverse_order(name):
    runs = job_runs(name)  # (by rank)
    starts = [r.run.start_time.ToNanoseconds() for r in runs]
    assert starts == sorted(starts, reverse=True)


def test_launch_recipe_passed_each_rank_its_local_rank():
    runs = job_runs("recipe_launch_args")
    for run in runs:
        [args] = {tuple(env.args) for env in environments(run) if env.args}
        assert args.count(f"--local-rank={run.rank}") == 1, args
        assert not any(env.slurm for env in environments(run))


def test_srun_recipe_recorded_each_tasks_slurm_variables():
    job = RECIPES["recipe_srun"]
    for run in job_runs("recipe_srun"):
        [slurm] = [dict(env.slurm) for env in environments(run) if env.slurm]
        node, local = divmod(run.rank, job["nproc"])
        assert (slurm["procid"], slurm["localid"], slurm["nodeid"]) == (
            str(run.rank),
            str(local),
            str(node),
        )
        assert slurm["step_id"] == "0" and slurm["ntasks"] == "4"
        assert run.hosts == {job["hosts"][node]}
        assert not any("--local" in a for env in environments(run) for a in env.args)


def test_group_recipe_puts_every_rank_in_group_ddp():
    runs = by_recipe("group")
    assert [r.run.run_group for r in runs] == ["DDP"] * 4
    assert all(not labels_in_stats(r) and not r.run.job_type for r in runs)


def test_job_type_recipe_marks_rank_0_main_and_the_others_worker():
    runs = by_recipe("job-type")
    assert [r.run.job_type for r in runs] == ["main", "worker", "worker", "worker"]
    assert {r.run.run_group for r in runs} == {"experiment_1"}


@pytest.mark.parametrize(
    ("recipe", "spelling"), [("shared-label", "rank_{}"), ("ui-label", "rank{}")]
)
def test_label_recipes_label_system_metrics_and_console(recipe, spelling):
    for run in by_recipe(recipe):
        label = spelling.format(run.rank)
        assert labels_in_stats(run) == {label}
        assert (run.path.parent / "files" / f"output_{label}.log").is_file()


def test_shared_label_recipe_leaves_the_environment_to_the_primary():
    """Odd but real: with x_primary=False wandb writes no environment record (no host) and no
    requirements.txt; only rank 0, the primary, has them."""
    runs = by_recipe("shared-label")
    assert [bool(r.hosts - {""}) for r in runs] == [True, True, True, True]  # the run record's
    envs = [
        any(
            pb.Record.FromString(p).WhichOneof("record_type") == "environment"
            for p in read_payloads(r.path)
        )
        for r in runs
    ]
    assert envs == [True, False, False, False]
    files = [(r.path.parent / "files" / "requirements.txt").exists() for r in runs]
    assert files == [True, False, False, False]


def test_name_recipe_names_each_run_after_its_rank():
    assert [r.run.display_name for r in by_recipe("name")] == [f"rank-{i}" for i in range(4)]


@pytest.mark.parametrize("recipe", ["config", "host"])
def test_config_recipes_record_rank_and_world_size(recipe):
    runs = by_recipe(recipe)
    assert [(r.config["rank"], r.config["world_size"]) for r in runs] == [
        (r.rank, len(runs)) for r in runs
    ]


def test_node_label_recipe_labels_node_and_local_rank():
    job = RECIPES["recipe_node_label"]
    for run in by_recipe("node-label"):
        node, local = divmod(run.rank, job["nproc"])
        assert labels_in_stats(run) == {f"node{node}_rank{local}"}


def test_host_recipe_records_each_nodes_host_for_its_ranks():
    job = RECIPES["recipe_host"]
    hosts = [r.hosts for r in by_recipe("host")]
    # ranks 0-1 ran under the first launcher, 2-3 under the second
    assert hosts == [{job["hosts"][rank // job["nproc"]]} for rank in range(4)]


def test_rank0_only_recipe_writes_one_run():
    (run,) = by_recipe("rank0-only")
    assert run.rank == 0 and not run.run.run_group and not labels_in_stats(run)


@pytest.mark.parametrize("name", [n for n, j in RECIPES.items() if j["wandb_version"]])
def test_old_wandb_jobs_were_written_by_that_version(name):
    for run in job_runs(name):
        assert run.run.telemetry.cli_version == RECIPES[name]["wandb_version"]
        assert run.run.display_name == f"rank-{run.rank}" and run.run.run_group == "DDP"


def test_jobs_that_share_a_group_do_not_overlap_in_time():
    """Several jobs wrote group "DDP"; they ran one after another, so each job's runs start
    after the previous job's last run started."""
    windows = []
    for name in RECIPES:
        runs = job_runs(name)
        if {r.run.run_group for r in runs} == {"DDP"}:
            starts = [r.run.start_time.ToSeconds() for r in runs]
            windows.append((min(starts), max(starts), name))
    assert len(windows) >= 3
    windows.sort()
    for (_, last, _), (first, _, name) in zip(windows, windows[1:], strict=False):
        assert first > last, name

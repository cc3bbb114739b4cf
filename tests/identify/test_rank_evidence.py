"""Ranks of plain runs from what the runs record of their processes, and no guessed primary.

The real fixtures were written by real DDP jobs whose ranks started in reverse order (rank 3
first), so a rank read from the start order is wrong in every one of them: only what the
runs record can make these tests pass. The truth is the `rank` value each training loop
logs at every step, read from the source file with protobuf.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.identify import Hints, identify
from wbmerge.identify.jobs import RunFacts
from wbmerge.identify.rankclaims import (
    config_claim,
    gpu_claim,
    launcher_claim,
    parse_spelling,
    slurm_claim,
)
from wbmerge.log import pb

from ..conftest import MANIFEST, job_dir
from ..e2e.test_sync import cli_sync
from ..support.hostile import rewrite_log
from ..support.sinktools import expected_from_log

# command line -> the local rank a launcher passed (None: none, or not one)
ARGS = [
    (["train.py", "--local_rank=3"], 3),  # DeepSpeed; torch.distributed.launch before 2.0
    (["train.py", "--local-rank=1", "--lr", "3"], 1),  # torch.distributed.launch since 2.0
    (["--local_rank", "2"], 2),
    (["--local-rank", "0", "--steps", "9"], 0),
    (["--local_rank=1", "--local_rank=1"], 1),  # said twice alike
    (["--local_rank=1", "--local-rank=2"], None),  # said twice, differently
    (["--local_rank"], None),  # no number
    (["--local_rank", "--lr"], None),
    (["--local_rank=-1"], None),  # argparse's default of scripts run without a launcher
    (["--local_ranks=2"], None),
    (["--my-local-rank=2"], None),
    (["--rank=2"], None),
    ([], None),
]


@pytest.mark.parametrize("args, local_rank", ARGS)
def test_the_local_rank_a_launcher_passed(args, local_rank):
    claim = launcher_claim(args)
    if local_rank is None:
        assert claim is None
    else:
        assert (claim.source, claim.local_rank, claim.rank, claim.node) == (
            "args",
            local_rank,
            None,
            None,
        )


def srun_task(procid, localid, nodeid, ntasks=4, nnodes=2, step="0", job="77"):
    """SLURM's variables as wandb records them: lower case, without `SLURM_`."""
    return {
        "procid": str(procid),
        "localid": str(localid),
        "nodeid": str(nodeid),
        "ntasks": str(ntasks),
        "nnodes": str(nnodes),
        "step_id": step,
        "job_id": job,
        "tasks_per_node": f"{ntasks // nnodes}(x{nnodes})",
    }


# SLURM variables -> (rank, local rank, node, world, local world, form); None: no task
SLURM = [
    (srun_task(3, 1, 1), (3, 1, 1, 4, 2, "slurm:slurm-77.0")),
    (srun_task(0, 0, 0, ntasks=2, nnodes=1), (0, 0, 0, 2, 2, "slurm:slurm-77.0")),
    (srun_task(2, 0, 1, step="3"), (2, 0, 1, 4, 2, "slurm:slurm-77.3")),
    (srun_task(0, 0, 0, step="4294967294"), None),  # the batch script's own step
    ({k: v for k, v in srun_task(1, 1, 0).items() if k != "step_id"}, None),  # sbatch, no srun
    ({"job_id": "77"}, None),
    ({}, None),
]


@pytest.mark.parametrize("slurm, expected", SLURM)
def test_the_place_of_an_srun_task(slurm, expected):
    claim = slurm_claim(slurm)
    if expected is None:
        assert claim is None
    else:
        got = (
            claim.rank,
            claim.local_rank,
            claim.node,
            claim.world_size,
            claim.local_world_size,
            claim.form,
        )
        assert (claim.source, got) == ("slurm", expected)


@pytest.mark.parametrize("gpus, local_rank", [({2}, 2), ((0,), 0), ({0, 3}, None), (set(), None)])
def test_the_one_gpu_a_process_used_is_its_local_rank(gpus, local_rank):
    claim = gpu_claim(gpus)
    assert (claim.local_rank if claim else None) == local_rank


def facts(run_id, start, **kw):
    return RunFacts(run_id=run_id, project="p", group="g", start=start, end=start + 100, **kw)


def ranks_of(runs, hints=None):
    """run id -> (rank, local rank, worker, source, guessed), after checking no problem."""
    found = identify(runs, hints)
    assert not found.problems, found.problems
    return {
        runs[i].run_id: (
            ident.rank.rank,
            ident.rank.local_rank,
            ident.rank.worker,
            ident.source,
            ident.guessed,
        )
        for i, ident in found.identities.items()
    }, found


def test_launcher_arguments_rank_runs_that_started_in_another_order():
    runs = [
        facts(f"r{rank}", start=10 - rank, args=("t.py", f"--local_rank={rank}"))
        for rank in range(4)
    ]
    got, found = ranks_of(runs)
    assert got == {f"r{rank}": (rank, rank, 0, "args", False) for rank in range(4)}
    assert not found.warnings


def test_launcher_arguments_on_two_hosts_are_local_ranks_of_each_host():
    runs = [
        facts(f"{host}{local}", start=local, host=host, args=(f"--local-rank={local}",))
        for host in ("a", "b")
        for local in (0, 1)
    ]
    got, found = ranks_of(runs)
    # Local ranks say nothing of which host is worker 0: name order, marked a guess.
    assert got == {
        "a0": (0, 0, 0, "args", True),
        "a1": (1, 1, 0, "args", True),
        "b0": (2, 0, 1, "args", True),
        "b1": (3, 1, 1, "args", True),
    }
    [warning] = [w.message for w in found.warnings if "which host is worker 0" in w.message]
    assert "worker 0=a, worker 1=b" in warning


def test_srun_tasks_give_rank_local_rank_and_node():
    places = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    runs = [
        facts(f"t{p}", start=9 - p, host=f"h{n}", slurm=srun_task(p, lo, n)) for p, lo, n in places
    ]
    got, _ = ranks_of(runs)
    assert got == {f"t{p}": (p, lo, n, "slurm", False) for p, lo, n in places}


def test_srun_starting_a_launcher_per_node_repeats_the_task_and_gives_way():
    """One srun task per node starting torch.distributed.launch: every worker of a node
    inherits that task's SLURM_PROCID. The tasks then say nothing of ranks; the launcher's
    argument gives the local rank and the task's SLURM_NODEID the node, even where the
    hosts' names sort the other way ("node10" < "node9")."""
    runs = []
    for node, host in ((0, "node9"), (1, "node10")):
        for local in (0, 1):
            task = srun_task(node, 0, node, ntasks=2, nnodes=2)
            args = (f"--local_rank={local}",)
            runs.append(facts(f"n{node}l{local}", start=local, host=host, slurm=task, args=args))
    got, _ = ranks_of(runs)
    assert got == {
        "n0l0": (0, 0, 0, "args", False),
        "n0l1": (1, 1, 0, "args", False),
        "n1l0": (2, 0, 1, "args", False),
        "n1l1": (3, 1, 1, "args", False),
    }


def test_the_gpu_a_process_used_ranks_runs_that_say_nothing_else():
    runs = [facts(f"g{r}", start=5 - r, process_gpus=(r,)) for r in range(3)]
    got, _ = ranks_of(runs)
    assert got == {f"g{r}": (r, r, 0, "gpu", False) for r in range(3)}


@pytest.mark.parametrize(
    "gpus, local_ranks",
    [
        ((4, 5, 6, 7), (0, 1, 2, 3)),  # CUDA_VISIBLE_DEVICES=4,5,6,7 on an 8-GPU machine
        ((7, 5, 3), (2, 1, 0)),  # =3,5,7, the runs started in another order
    ],
)
def test_gpus_whose_numbers_cannot_be_local_ranks_are_read_by_order_as_a_guess(gpus, local_ranks):
    runs = [facts(f"g{n}", start=n, process_gpus=(gpu,)) for n, gpu in enumerate(gpus)]
    got, found = ranks_of(runs)
    assert {k: v for k, v in got.items()} == {
        f"g{n}": (local, local, 0, "gpu", True) for n, local in enumerate(local_ranks)
    }
    [said] = [w.message for w in found.warnings if "order of the GPUs" in w.message]
    assert f"g0 on GPU {gpus[0]} as local rank {local_ranks[0]}" in said
    assert "holds only if no rank's run is missing" in said


@pytest.mark.parametrize(
    "gpus, config, ranks, world",
    [
        ((0, 1, 2, 3), {}, (0, 1, 2, 3), 4),  # all the machine's GPUs: the local ranks
        ((0, 1, 2, 4, 5, 6, 7), {}, (0, 1, 2, 4, 5, 6, 7), 8),  # GPU 3's rank is missing
        ((2, 3), {"world_size": 4}, (2, 3), 4),  # a stated world size: ranks 0-1 missing
    ],
)
def test_gpus_are_taken_as_they_are_where_they_can_be_local_ranks(gpus, config, ranks, world):
    runs = [
        facts(f"g{n}", start=n, process_gpus=(gpu,), config=config) for n, gpu in enumerate(gpus)
    ]
    found = identify(runs)
    got = {
        runs[i].run_id: (ident.rank.rank, ident.rank.world_size, ident.source)
        for i, ident in found.identities.items()
    }
    assert got == {f"g{n}": (rank, world, "gpu") for n, rank in enumerate(ranks)}
    assert not [w for w in found.warnings if "order of the GPUs" in w.message]


def test_gpus_of_runs_on_two_hosts_are_ordered_per_host():
    runs = [
        facts(f"{host}{gpu}", start=gpu, host=host, process_gpus=(gpu,))
        for host in ("a", "b")
        for gpu in (2, 3)
    ]
    got, found = ranks_of(runs)
    assert {k: v[1] for k, v in got.items()} == {"a2": 0, "a3": 1, "b2": 0, "b3": 1}
    assert all(v[4] for v in got.values())  # (a guess: which host is worker 0, and the GPUs)


def test_every_process_on_gpu_0_is_no_evidence_and_the_rank_0_is_a_guess():
    runs = [facts(f"g{r}", start=r, process_gpus=(0,)) for r in range(3)]
    got, found = ranks_of(runs)
    assert {v[3] for v in got.values()} == {"order"}
    assert all(v[4] for v in got.values()), "rank 0 by start order is marked a guess"
    assert any("assumed from start order" in w.message for w in found.warnings)


def test_evidence_that_disagrees_is_a_warning_naming_the_runs():
    runs = [
        facts("r0", start=1, label="rank_0", args=("--local_rank=0",)),
        facts("r1", start=2, label="rank_1", args=("--local_rank=1",), process_gpus=(1,)),
        facts("r2", start=3, label="rank_2", args=("--local_rank=2",), process_gpus=(3,)),
    ]
    got, found = ranks_of(runs)
    assert {k: v[0] for k, v in got.items()} == {"r0": 0, "r1": 1, "r2": 2}
    [warning] = [w.message for w in found.warnings if "disagrees" in w.message]
    assert "r2 is rank 2 by its args, but its gpu says local rank 3" in warning
    assert "r0" not in warning.split("disagrees")[1] and "r1 " not in warning


def test_start_order_marks_the_job_guessed_unless_rank_0_is_known():
    plain = [facts(f"p{i}", start=i) for i in range(3)]
    got, _ = ranks_of(plain)
    assert all(v[4] for v in got.values())
    with_main = [facts("m", start=5, job_type="main"), *plain[:2]]
    got, _ = ranks_of(with_main)
    assert got["m"][0] == 0 and not any(v[4] for v in got.values())
    got, found = ranks_of(plain, Hints(primary=frozenset({"p2"})))
    assert got == {
        "p2": (0, 0, 0, "given", False),
        "p0": (1, 1, 0, "order", False),
        "p1": (2, 2, 0, "order", False),
    }
    assert any("the --primary run is rank 0" in w.message for w in found.warnings)
    [alone] = [facts("solo", start=0)]
    got, _ = ranks_of([alone])
    assert got["solo"] == (0, 0, 0, "order", False), "one run is no guess"


def test_two_primaries_in_one_job_are_a_problem():
    runs = [facts(f"p{i}", start=i) for i in range(3)]
    found = identify(runs, Hints(primary=frozenset({"p0", "p2"})))
    [problem] = found.problems
    assert "--primary names p0, p2" in problem.message and not found.identities


# ---- the real fixtures ------------------------------------------------------------------


def inspect_rows(path, *args):
    result = CliRunner().invoke(main, ["inspect", "--json", str(path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def logged_rank(row_or_path) -> int:
    path = row_or_path if isinstance(row_or_path, Path) else Path(row_or_path["path"])
    want = expected_from_log(next(path.glob("run-*.wandb")))
    [rank] = {r["rank"] for r in want.history}
    return rank


def starts_reversed(rows):
    by_start = sorted(rows, key=lambda r: r["started"])
    return [logged_rank(r) for r in by_start] == sorted(
        (logged_rank(r) for r in rows), reverse=True
    )


@pytest.mark.parametrize("name, source", [("recipe_launch_args", "args"), ("recipe_srun", "slurm")])
def test_launch_and_srun_jobs_are_numbered_right_without_any_option(name, source):
    job = MANIFEST["recipes"][name]
    rows = inspect_rows(job_dir(name))
    assert starts_reversed(rows), "the fixture's ranks started in reverse order"
    assert len({r["job_id"] for r in rows}) == 1
    for row in rows:
        rank = logged_rank(row)
        assert (row["rank"], row["source"], row["rank_guessed"]) == (rank, source, False)
        assert (row["local_rank"], row["worker"]) == divmod(rank, job["nproc"])[::-1]
        assert row["world_size"] == job["nodes"] * job["nproc"]


def test_inspect_of_an_order_only_job_shows_the_guess_and_each_runs_evidence():
    source = job_dir("recipe_group_reversed")
    rows = inspect_rows(source)
    assert starts_reversed(rows)
    assert {(r["source"], r["rank_guessed"]) for r in rows} == {("order", True)}
    [primary] = [r for r in rows if logged_rank(r) == 0]
    assert primary["logged_only_here"] == ["best_val_loss", "val/loss"]
    assert all(r["logged_only_here"] == [] for r in rows if r is not primary)
    text = CliRunner().invoke(main, ["inspect", str(source)]).output
    assert "rank 0 is only the run that started first" in text
    assert "--primary RUN_ID" in text and "--rank-order start" in text
    for row in rows:
        [line] = [x for x in text.splitlines() if x.startswith(f"  run {row['run_id']}:")]
        assert row["started"] in line and f"on {row['host']}" in line
    assert f"run {primary['run_id']}: " in text
    assert "logged only here: best_val_loss, val/loss" in text


@pytest.mark.parametrize("mode", ["auto", "shared"])
@pytest.mark.parametrize("command", ["sync", "merge"])
def test_auto_and_shared_stop_at_a_guessed_primary_with_one_line(mode, command, tmp_path):
    source = job_dir("recipe_group_reversed")
    ids = sorted(r["run_id"] for r in inspect_rows(source))
    out = ["--out", str(tmp_path / "out")] if command == "merge" else ["--dry-run"]
    result = CliRunner().invoke(main, [command, "--run-mode", mode, *out, str(source)])
    assert result.exit_code == 2, result.output
    [line] = [x for x in result.stderr.splitlines() if x.startswith("wbmerge: error:")]
    assert "Traceback" not in result.stderr
    assert all(run_id in line for run_id in ids)
    for way_out in ("--primary RUN_ID", "--ranks FILE", "--rank-order start", "--run-mode new"):
        assert way_out in line
    assert not (tmp_path / "out").exists()


def test_new_mode_uploads_a_run_per_rank_without_a_primary(tmp_path):
    result = CliRunner().invoke(
        main,
        ["sync", "--dry-run", "--json", "--run-mode", "new", str(job_dir("recipe_group_reversed"))],
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 4


pytestmark_e2e = pytest.mark.e2e


@pytestmark_e2e
def test_primary_uploads_the_true_rank_0_in_auto_mode(sink, tmp_path):
    source = job_dir("recipe_group_reversed")
    rows = inspect_rows(source)
    [truth] = [r for r in rows if logged_rank(r) == 0]
    assert truth["rank"] != 0, "the start order alone would have picked another run"
    result = cli_sync(
        sink,
        tmp_path,
        source,
        "--run-mode",
        "auto",
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "A",
        "--primary",
        truth["run_id"],
    )
    assert result.exit_code == 0, result.output + result.stderr
    got = sink.client.run("local", "e2e", "A")
    want = expected_from_log(next(Path(truth["path"]).glob("run-*.wandb")))
    assert {row["rank"] for row in got["history"]} == {0}
    assert [r["_step"] for r in got["history"]] == [r["_step"] for r in want.history]
    assert [r.get("val/loss") for r in got["history"]] == [r.get("val/loss") for r in want.history]
    assert got["summary"]["best_val_loss"] == want.summary["best_val_loss"]


@pytestmark_e2e
def test_a_ranks_file_makes_the_true_rank_0_the_primary_of_a_shared_run(sink, tmp_path):
    source = job_dir("recipe_group_reversed")
    rows = inspect_rows(source)
    ranks = {r["run_id"]: logged_rank(r) for r in rows}
    (tmp_path / "ranks.json").write_text(json.dumps(ranks))
    result = cli_sync(
        sink,
        tmp_path,
        source,
        "--run-mode",
        "shared",
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "S",
        "--ranks",
        tmp_path / "ranks.json",
    )
    assert result.exit_code == 0, result.output + result.stderr
    got = sink.client.run("local", "e2e", "S")
    # Every rank's `rank` value arrives under its own label, which now names its true rank.
    for row in got["history"]:
        for rank in range(4):
            assert row[f"rank/rank-{rank}"] == rank
    [primary] = [r for r in rows if ranks[r["run_id"]] == 0]
    want = expected_from_log(next(Path(primary["path"]).glob("run-*.wandb")))
    assert got["summary"]["best_val_loss/rank-0"] == want.summary["best_val_loss"]


@pytestmark_e2e
def test_rank_order_start_accepts_the_guess_it_names(sink, tmp_path):
    source = job_dir("recipe_group_reversed")
    rows = inspect_rows(source)
    first = min(rows, key=lambda r: r["started"])
    result = cli_sync(
        sink,
        tmp_path,
        source,
        "--run-mode",
        "auto",
        "-p",
        "e2e",
        "-e",
        "local",
        "--base-id",
        "O",
        "--rank-order",
        "start",
    )
    assert result.exit_code == 0, result.output + result.stderr
    got = sink.client.run("local", "e2e", "O")
    assert {row["rank"] for row in got["history"]} == {logged_rank(first)}


def test_primary_errors_are_one_line(tmp_path):
    runner = CliRunner()
    plain = str(job_dir("recipe_group_reversed"))
    labelled = str(job_dir("recipe_launch_args"))
    rows = inspect_rows(job_dir("recipe_launch_args"))
    rank2 = next(r["run_id"] for r in rows if r["rank"] == 2)
    rank0 = next(r["run_id"] for r in rows if r["rank"] == 0)
    ids = [r["run_id"] for r in inspect_rows(job_dir("recipe_group_reversed"))]
    cases = [
        (["inspect", plain, "--primary", "nosuchrun"], "--primary names run(s) not found"),
        (["inspect", labelled, "--primary", rank2], "this one is rank 2 by its args"),
        (["inspect", plain, "--primary", "a/b"], "--primary:"),
        (
            ["sync", "--dry-run", plain, "--primary", ids[0], "--primary", ids[1]],
            f"--primary names {', '.join(sorted(ids[:2], key=ids.index))}",
        ),
    ]
    for args, message in cases:
        result = runner.invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        errors = [x for x in result.stderr.splitlines() if x.startswith("wbmerge: error:")]
        assert len(errors) == 1 and message in errors[0], (args, result.stderr)
    # Naming the rank 0 its job's evidence names already is no contradiction.
    assert runner.invoke(main, ["inspect", labelled, "--primary", rank0]).exit_code == 0


def gpu_stats(real_gpu: int, gpus: int = 4) -> list[pb.StatsItem]:
    """System-metric items as wandb-core writes them on a machine of `gpus` GPUs for a
    process using GPU `real_gpu`: every GPU's `gpu.N.*`, and the process's own
    `gpu.process.N.*`."""
    items = []
    for gpu in range(gpus):
        items.append(pb.StatsItem(key=f"gpu.{gpu}.gpu", value_json="12"))
        items.append(pb.StatsItem(key=f"gpu.{gpu}.memoryAllocated", value_json="40.5"))
    items.append(pb.StatsItem(key=f"gpu.process.{real_gpu}.gpu", value_json="97"))
    items.append(pb.StatsItem(key=f"gpu.process.{real_gpu}.memoryAllocated", value_json="40.5"))
    return items


def job_on_gpus(tmp_path, first_gpu: int, gpus: int) -> tuple[Path, dict[str, int]]:
    """The reversed-start job's runs with the GPU metrics a GPU machine of `gpus` GPUs
    records in their stats records, each process on GPU `first_gpu + its true rank`; the
    job's directory and each run's true rank."""
    job = tmp_path / "job"
    shutil.copytree(job_dir("recipe_group_reversed"), job)
    logs = sorted(job.glob("wandb/offline-run-*/run-*.wandb"))
    truth = {log.parent.name[-8:]: logged_rank(log.parent) for log in logs}
    for log in logs:
        rank = truth[log.parent.name[-8:]]
        seen = []

        def add_gpu(record, rank=rank, seen=seen):
            if record.WhichOneof("record_type") != "stats":
                return None
            seen.append(1)
            record.stats.item.extend(gpu_stats(first_gpu + rank, gpus))
            return record

        rewrite_log(log, add_gpu)
        assert seen, f"{log} has stats records to carry the GPU metrics"
    return job, truth


def test_recorded_gpu_stats_rank_a_plain_job(tmp_path):
    """Each process used the GPU of its true rank (as torchrun jobs bind it)."""
    job, truth = job_on_gpus(tmp_path, 0, 4)
    rows = inspect_rows(job)
    assert {r["run_id"]: (r["rank"], r["source"], r["rank_guessed"]) for r in rows} == {
        run_id: (rank, "gpu", False) for run_id, rank in truth.items()
    }
    result = CliRunner().invoke(main, ["sync", "--dry-run", "--run-mode", "auto", str(job)])
    assert result.exit_code == 0, result.output


def test_a_job_on_gpus_4_to_7_is_numbered_by_gpu_order_and_auto_asks_first(tmp_path):
    """The same runs recorded on GPUs 4-7 of an 8-GPU machine (`CUDA_VISIBLE_DEVICES`):
    local ranks by the GPUs' order, marked a guess, so `auto` names the ways out and
    `--rank-order start` accepts the order."""
    job, truth = job_on_gpus(tmp_path, 4, 8)
    rows = inspect_rows(job)
    assert {r["run_id"]: (r["rank"], r["source"], r["rank_guessed"]) for r in rows} == {
        run_id: (rank, "gpu", True) for run_id, rank in truth.items()
    }
    refused = CliRunner().invoke(main, ["sync", "--dry-run", "--run-mode", "auto", str(job)])
    assert refused.exit_code == 2
    assert "read from the order of the GPUs its runs used" in refused.stderr
    accepted = CliRunner().invoke(
        main, ["sync", "--dry-run", "--run-mode", "auto", "--rank-order", "start", str(job)]
    )
    assert accepted.exit_code == 0, accepted.output


def test_a_real_gpu_job_names_each_process_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(
            f"needs a machine with 2 GPUs to write real GPU metrics; this one has "
            f"{torch.cuda.device_count()} (the recorded GPU stats test covers the reading)"
        )
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"
    env = {**os.environ, "WANDB_SILENT": "true"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            "--dir",
            str(tmp_path),
            "--steps",
            "40",
            "--recipe",
            "group",
            "--stats-interval",
            "0.5",
            "--start-stagger",
            "1.0",
            "--cuda",
        ],
        env=env,
        check=True,
        timeout=600,
    )
    rows = inspect_rows(tmp_path)
    for row in rows:
        assert row["source"] == "gpu" and row["rank"] == logged_rank(row)


@pytest.mark.parametrize(
    "claim",
    [
        lambda: launcher_claim(["--local_rank=\u00b3"]),  # a digit to Python, no number
        lambda: launcher_claim(["--local_rank", "9" * 5000]),
        lambda: launcher_claim(["--local_rank=1048576"]),  # past the most ranks a job has
        lambda: config_claim({"rank": "\u00b2"}),
        lambda: config_claim({"rank": 10**30}),
        lambda: slurm_claim(srun_task(0, 0, 0, ntasks=10**12, nnodes=1)),
        lambda: slurm_claim({**srun_task(0, 0, 0), "step_id": "\u00b3"}),
        lambda: parse_spelling("rank99999999"),
        lambda: parse_spelling("node1-gpu\u00b3"),
        lambda: gpu_claim([10**9]),
    ],
)
def test_numbers_no_job_has_are_no_claim(claim):
    assert claim() is None


def test_a_hostile_world_size_is_no_rank_and_nothing_waits_on_it(tmp_path):
    """`--local_rank=10**30` or SLURM_NTASKS=10**12 once sized the job's list of ranks."""
    runs = [
        facts("h0", start=0, args=("--local_rank=" + "1" + "0" * 30,)),
        facts("h1", start=1, slurm=srun_task(1, 1, 0, ntasks=10**12, nnodes=1)),
    ]
    got, _ = ranks_of(runs)
    assert {v[3] for v in got.values()} == {"order"}
    (tmp_path / "ranks.json").write_text(json.dumps({"h0": 10**12}))
    result = CliRunner().invoke(
        main,
        ["inspect", str(job_dir("recipe_group_reversed")), "--ranks", str(tmp_path / "ranks.json")],
    )
    assert result.exit_code == 2 and "rank must be a whole number from 0 to" in result.stderr


def copy_with(tmp_path, name, change) -> Path:
    """A copy of fixture job `name` with `change(record, rank)` applied to each record of
    each run (the rank is the one its training loop logged)."""
    job = tmp_path / name
    shutil.copytree(job_dir(name), job)
    for log in sorted(job.glob("wandb/offline-run-*/run-*.wandb")):
        rank = logged_rank(log.parent)
        rewrite_log(log, lambda record, rank=rank: change(record, rank))
    return job


def test_a_start_time_no_clock_shows_is_inspected_in_seconds(tmp_path):
    def far(record, rank):
        if record.WhichOneof("record_type") != "run":
            return None
        record.run.start_time.seconds = 10**15
        return record

    job = copy_with(tmp_path, "recipe_group_reversed", far)
    result = CliRunner().invoke(main, ["inspect", str(job)])
    assert result.exit_code == 0, result.output
    assert "started 10000000000000" in result.output and " s after 1970 on vm" in result.output


def test_local_ranks_on_hosts_named_out_of_order_are_refused_as_a_guess(tmp_path):
    """The launch job made two nodes of two: ranks 0-1 on host "z-node", ranks 2-3 on
    "a-node", each node's launcher passing --local-rank 0 and 1. Local ranks alone would
    make "a-node" worker 0 and true rank 2 the primary."""

    def hosts(record, rank):
        kind = record.WhichOneof("record_type")
        if kind not in ("run", "environment"):
            return None
        getattr(record, kind).host = "z-node" if rank < 2 else "a-node"
        if kind == "environment" and record.environment.args:
            args = [a for a in record.environment.args if not a.startswith("--local-rank")]
            record.environment.ClearField("args")
            record.environment.args.extend([f"--local-rank={rank % 2}", *args])
        return record

    job = copy_with(tmp_path, "recipe_launch_args", hosts)
    rows = inspect_rows(job)
    assert {(r["source"], r["rank_guessed"]) for r in rows} == {("args", True)}
    result = CliRunner().invoke(main, ["sync", "--dry-run", "--run-mode", "auto", str(job)])
    assert result.exit_code == 2
    [line] = [x for x in result.stderr.splitlines() if x.startswith("wbmerge: error:")]
    assert "which host is worker 0, and so its rank 0, is a guess" in line
    assert "a-node, z-node" in line and "--ranks FILE" in line
    accepted = CliRunner().invoke(
        main, ["sync", "--dry-run", "--run-mode", "auto", "--rank-order", "start", str(job)]
    )
    assert accepted.exit_code == 0, accepted.output
    ranks = {r["run_id"]: logged_rank(r) for r in rows}
    (tmp_path / "ranks.json").write_text(json.dumps(ranks))
    told = CliRunner().invoke(
        main,
        [
            "sync",
            "--dry-run",
            "--json",
            "--run-mode",
            "auto",
            "--ranks",
            str(tmp_path / "ranks.json"),
            str(job),
        ],
    )
    assert told.exit_code == 0, told.output
    [target] = json.loads(told.stdout)
    [primary] = [r for r in rows if ranks[r["run_id"]] == 0]
    assert [s["path"] for s in target["sources"]] == [primary["path"]]

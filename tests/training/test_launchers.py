"""`wbmerge.init` under the launchers HPC users have, with real processes side by side.

No SLURM or MPI is installed here: each rank is started as `srun` (or `mpirun`) would start
it, with that launcher's variables, and the ranks train a real DDP model over gloo.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from wbmerge.cli import main
from wbmerge.identify import discover

from ..support.sinktools import expected_from_log

DDP_RANK = """
import os, torch, torch.distributed as dist
from torch import nn
import wbmerge

rank, world = int(os.environ["{rank_var}"]), int(os.environ["{world_var}"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=world)
run = wbmerge.init(project="launchers")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
for step in range(5):
    x = torch.randn(8, 4, generator=gen)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    run.log({{"loss": loss.item(), "who": rank * 100 + step}}, step=step)
run.finish()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, rank_var, world_var, envs):
    """Start one process per environment, as the launcher would, and wait for all."""
    script = tmp_path / "rank.py"
    script.write_text(
        textwrap.dedent(DDP_RANK.format(rank_var=rank_var, world_var=world_var, port=free_port()))
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("WANDB_", "RANK", "WORLD", "LOCAL_", "GROUP_", "TORCHELASTIC", "SLURM", "OMPI", "PMI")
        )
    }
    base.update(WANDB_DIR=str(tmp_path), WANDB_SILENT="true", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]


def test_srun_job_of_two_nodes_merges_with_its_ranks_workers_and_one_job_id(tmp_path):
    envs = [
        {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": str(rank % 2),
            "SLURM_NODEID": str(rank // 2),
            "SLURM_NNODES": "2",
            "SLURM_TASKS_PER_NODE": "2(x2)",
            "SLURM_JOB_ID": "777",
            "SLURM_STEP_ID": "3",
        }
        for rank in range(4)
    ]
    launch(tmp_path, "SLURM_PROCID", "SLURM_NTASKS", envs)
    runs = discover([tmp_path])
    assert len(runs) == 4
    for run in runs:
        rank = run.rank
        assert (rank.local_rank, rank.worker, rank.world_size) == (rank.rank % 2, rank.rank // 2, 4)
        assert rank.job_id == "slurm-777.3" and run.rank_source == "wbmerge"
        assert run.label == f"worker-{rank.rank // 2}-rank-{rank.rank % 2}"
        # the rank discovered is the rank that wrote the run
        history = expected_from_log(run.path).history
        assert [row["who"] for row in history] == [rank.rank * 100 + s for s in range(5)]
    result = CliRunner().invoke(
        main,
        [
            "merge",
            str(tmp_path),
            "--run-mode",
            "new",
            "--rank-scope",
            "worker",
            "--out",
            str(tmp_path / "out"),
            "--dry-run",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    targets = {t["id"]: t["group"] for t in json.loads(result.output)}
    assert targets == {
        f"slurm-777.3-worker-{w}-rank-{lr}": f"slurm-777.3-worker-{w}"
        for w in (0, 1)
        for lr in (0, 1)
    }


def test_open_mpi_job_merges_with_its_ranks(tmp_path):
    envs = [
        {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": "prterun-test-99@1",
        }
        for rank in range(2)
    ]
    launch(tmp_path, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", envs)
    runs = discover([tmp_path])
    assert sorted(r.rank.rank for r in runs) == [0, 1]
    assert {r.job_id for r in runs} == {"mpi-prterun-test-99@1"}
    for run in runs:
        history = expected_from_log(run.path).history
        assert history[0]["who"] == run.rank.rank * 100


def test_the_process_group_wins_over_launcher_variables_that_disagree(tmp_path):
    # One srun task that starts its own two workers (as mp.spawn would): both inherit
    # SLURM_PROCID 0 of 4, but the process group they train in has ranks 0 and 1 of 2.
    envs = [
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_TASKS_PER_NODE": "4",
            "SLURM_JOB_ID": "9",
            "SLURM_STEP_ID": "0",
            "SPAWNED_RANK": str(rank),
            "SPAWNED_WORLD": "2",
        }
        for rank in range(2)
    ]
    launch(tmp_path, "SPAWNED_RANK", "SPAWNED_WORLD", envs)
    runs = discover([tmp_path])
    assert sorted((r.rank.rank, r.rank.world_size) for r in runs) == [(0, 2), (1, 2)]
    assert len({r.job_id for r in runs}) == 1  # rank 0's id, broadcast over the group
    for run in runs:
        history = expected_from_log(run.path).history
        assert history[0]["who"] == run.rank.rank * 100

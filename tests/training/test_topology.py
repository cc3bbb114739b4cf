"""The plugin's topology rules, as table tests."""

from __future__ import annotations

import pytest

from wbmerge.training import RankInfo, from_env, label_for


def env(rank, world, local_rank, local_world, group, **extra):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group),
        **extra,
    }


@pytest.mark.parametrize(
    "variables, expected_label, multi",
    [
        (env(0, 4, 0, 4, 0), "rank-0", False),
        (env(3, 4, 3, 4, 0), "rank-3", False),
        (env(2, 4, 0, 2, 1), "worker-1-rank-0", True),
        (env(7, 8, 3, 4, 1), "worker-1-rank-3", True),
        (env(5, 16, 1, 2, 2), "worker-2-rank-1", True),
    ],
)
def test_labels_follow_the_plugin(variables, expected_label, multi):
    info = from_env(variables)
    assert info.label == expected_label
    assert info.multi_node is multi


@pytest.mark.parametrize(
    "variables",
    [
        {},
        {"RANK": "0"},
        {"WORLD_SIZE": "4"},
        {"RANK": "0", "WORLD_SIZE": "1"},
        {"RANK": "x", "WORLD_SIZE": "2"},
    ],
)
def test_not_distributed(variables):
    assert from_env(variables) is None


def test_missing_local_variables_mean_one_node():
    info = from_env({"RANK": "3", "WORLD_SIZE": "4"})
    assert (info.local_rank, info.local_world_size, info.worker, info.label) == (3, 4, 0, "rank-3")


def test_job_id_and_restart_from_torch_elastic():
    info = from_env(env(1, 2, 1, 2, 0, TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="2"))
    assert (info.job_id, info.restart) == ("abc", 2)
    # torchrun's default rendezvous id is the same for every job: not a job id
    assert from_env(env(1, 2, 1, 2, 0, TORCHELASTIC_RUN_ID="none")).job_id is None


def test_inconsistent_environment_is_rejected():
    with pytest.raises(ValueError):
        from_env(env(4, 4, 0, 4, 0))
    with pytest.raises(ValueError):
        from_env(env(1, 4, 3, 2, 0))


def test_metadata_round_trip():
    info = RankInfo(5, 1, 8, 4, 1, restart=2, job_id="job-1")
    block = info.to_metadata()
    assert block["label"] == "worker-1-rank-1" == label_for(5, 1, 1, True)
    assert RankInfo.from_metadata(block) == info


def slurm(procid, ntasks, localid, nodeid, nnodes, **extra):
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        **extra,
    }


# environment -> (rank, local rank, world, local world, worker, restart, job id)
LAUNCHERS = [
    (
        "srun, 2 nodes x 2 tasks, tasks per node as SLURM_TASKS_PER_NODE",
        slurm(3, 4, 1, 1, 2, SLURM_TASKS_PER_NODE="2(x2)"),
        (3, 1, 4, 2, 1, 0, "slurm-4242.0"),
    ),
    (
        "srun, SLURM_NTASKS_PER_NODE and a restart",
        slurm(2, 4, 0, 1, 2, SLURM_NTASKS_PER_NODE="2", SLURM_RESTART_COUNT="3"),
        (2, 0, 4, 2, 1, 3, "slurm-4242.0"),
    ),
    (
        "srun, one node",
        slurm(1, 2, 1, 0, 1, SLURM_TASKS_PER_NODE="2"),
        (1, 1, 2, 2, 0, 0, "slurm-4242.0"),
    ),
    (
        "srun, uneven tasks per node: one unit",
        slurm(4, 5, 1, 1, 2, SLURM_TASKS_PER_NODE="3,2"),
        (4, 4, 5, 5, 0, 0, "slurm-4242.0"),
    ),
    (
        "srun, the step id under its older name",
        {
            **slurm(1, 2, 1, 0, 1, SLURM_TASKS_PER_NODE="2"),
            "SLURM_STEP_ID": "",
            "SLURM_STEPID": "5",
        },
        (1, 1, 2, 2, 0, 0, "slurm-4242.5"),
    ),
    (
        "Open MPI, 2 nodes x 4",
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "PMIX_NAMESPACE": "prterun-h-1234@1",
        },
        (6, 2, 8, 4, 1, 0, "mpi-prterun-h-1234@1"),
    ),
    (
        "MPICH Hydra",
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        (3, 1, 4, 2, 1, 0, None),
    ),
    (
        "PMI without local variables: one node",
        {"PMI_RANK": "2", "PMI_SIZE": "3"},
        (2, 2, 3, 3, 0, 0, None),
    ),
    (
        "torchrun inside an srun allocation: torchrun wins",
        {**slurm(0, 8, 0, 0, 2, SLURM_TASKS_PER_NODE="4(x2)"), **env(5, 6, 2, 3, 1)},
        (5, 2, 6, 3, 1, 0, None),
    ),
]


@pytest.mark.parametrize("case, variables, expected", LAUNCHERS, ids=[c[0] for c in LAUNCHERS])
def test_launcher_environments(case, variables, expected):
    info = from_env(variables)
    got = (
        info.rank,
        info.local_rank,
        info.world_size,
        info.local_world_size,
        info.worker,
        info.restart,
        info.job_id,
    )
    assert got == expected


@pytest.mark.parametrize(
    "variables",
    [
        slurm(0, 1, 0, 0, 1),  # a single task
        {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"},  # an allocation, not a task
        # a batch script of `sbatch --ntasks=4`: no step, or the batch step's id
        {**slurm(0, 4, 0, 0, 1), "SLURM_STEP_ID": ""},
        {**slurm(0, 4, 0, 0, 1), "SLURM_STEP_ID": "4294967291"},
        {**slurm(0, 8, 0, 0, 2), "RANK": "0", "WORLD_SIZE": "1"},  # torchrun of one process
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
        {"PMI_RANK": "0"},
    ],
)
def test_launchers_of_one_process_are_not_distributed(variables):
    assert from_env(variables) is None

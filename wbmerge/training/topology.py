"""Who a rank is: pure functions from a launcher's environment to `RankInfo`.

These rules reproduce the online Flyte W&B plugin, so offline and online jobs line up:
labels are `rank-{r}` on one node and `worker-{w}-rank-{lr}` on several, and a job is
multi-node when `WORLD_SIZE // LOCAL_WORLD_SIZE > 1`. Besides torchrun, the launchers of
clusters whose compute nodes have no internet (SLURM's `srun`, Open MPI, MPICH) are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

METADATA_KEY = "wbmerge"  # config key under which every rank records its RankInfo


@dataclass(frozen=True)
class RankInfo:
    """The position of one process in a distributed job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    worker: int
    restart: int = 0
    job_id: str | None = None

    @property
    def num_workers(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def multi_node(self) -> bool:
        return self.num_workers > 1

    @property
    def label(self) -> str:
        return label_for(self.rank, self.local_rank, self.worker, self.multi_node)

    def to_metadata(self) -> dict[str, Any]:
        """The block written into the run's config (and read back by `from_metadata`)."""
        return {**asdict(self), "label": self.label, "num_workers": self.num_workers}

    @classmethod
    def from_metadata(cls, block: Mapping[str, Any]) -> RankInfo:
        """Inverse of `to_metadata`; raises ValueError on a block that is not ours."""
        try:
            info = cls(
                rank=int(block["rank"]),
                local_rank=int(block["local_rank"]),
                world_size=int(block["world_size"]),
                local_world_size=int(block["local_world_size"]),
                worker=int(block["worker"]),
                restart=int(block.get("restart", 0)),
                job_id=None if block.get("job_id") is None else str(block["job_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"incomplete wbmerge metadata: {exc}") from None
        validate(info)
        return info


# The most processes a job may have: a rank, size or node number past it (a hostile or
# corrupt run's, say `--local_rank=10**30`) is no rank, so that nothing sized by a job's
# world is ever that large.
MAX_RANKS = 1 << 20


def rank_number(text: str) -> int | None:
    """A decimal number below `MAX_RANKS` (`"12"`), or None: `"³"` is a digit to Python
    but not a number int() reads, and `"9" * 5000` is a number no job has."""
    text = text.strip()
    if not text.isdecimal() or len(text) > 7:
        return None
    number = int(text)
    return number if number < MAX_RANKS else None


SINGLE_PROCESS = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, worker=0)


def label_for(rank: int, local_rank: int, worker: int, multi_node: bool) -> str:
    """The plugin's `x_label` for a rank."""
    return f"worker-{worker}-rank-{local_rank}" if multi_node else f"rank-{rank}"


def validate(info: RankInfo) -> None:
    """Raise ValueError when the numbers cannot describe one rank of a real job."""
    if info.world_size < 1 or info.local_world_size < 1:
        raise ValueError("world sizes must be at least 1")
    if info.world_size > MAX_RANKS:
        raise ValueError(
            f"world size {info.world_size} is over the {MAX_RANKS} ranks a job may have"
        )
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} outside world size {info.world_size}")
    if not 0 <= info.local_rank < info.local_world_size:
        raise ValueError(f"local rank {info.local_rank} outside local world size")
    if not 0 <= info.worker < info.num_workers:
        raise ValueError(f"worker {info.worker} outside {info.num_workers} workers")
    if info.restart < 0:
        raise ValueError("restart count must not be negative")


def from_env(env: Mapping[str, str]) -> RankInfo | None:
    """RankInfo from the launcher's variables; None when the process is not distributed.

    torchrun / torch elastic first (where its `RANK` and `WORLD_SIZE` are set, they alone
    decide, also that a job of one process is not distributed), then SLURM's `srun`,
    Open MPI's `mpirun` and MPICH's Hydra / PMI. A world of one process is not distributed.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return _checked(_torchrun(env))
    for reader in (slurm_task, _open_mpi, _pmi):
        info = reader(env)
        if info is not None:
            return _checked(info)
    return None


def _checked(info: RankInfo | None) -> RankInfo | None:
    if info is None or info.world_size <= 1:
        return None
    validate(info)
    return info


def _torchrun(env: Mapping[str, str]) -> RankInfo | None:
    """torchrun's variables; missing per-node variables mean a single node."""
    rank, world_size = _int(env.get("RANK"), -1), _int(env.get("WORLD_SIZE"), 0)
    if rank < 0 or world_size < 1:
        return None
    local_world_size = _int(env.get("LOCAL_WORLD_SIZE"), world_size)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    return RankInfo(
        rank=rank,
        local_rank=_int(env.get("LOCAL_RANK"), rank % local_world_size),
        world_size=world_size,
        local_world_size=local_world_size,
        worker=_int(env.get("GROUP_RANK"), rank // local_world_size),
        restart=_int(env.get("TORCHELASTIC_RESTART_COUNT"), 0),
        # torchrun's default rendezvous id "none" is the same for every job: not an id.
        job_id=run_id if run_id and run_id != "none" else None,
    )


def slurm_task(env: Mapping[str, str]) -> RankInfo | None:
    """One task of `srun` (a job step): `SLURM_PROCID` of `SLURM_NTASKS`, `SLURM_LOCALID` on
    node `SLURM_NODEID`. The job id is `slurm-{SLURM_JOB_ID}.{SLURM_STEP_ID}`, so that two
    `srun` steps of one allocation are two jobs; restarts are `SLURM_RESTART_COUNT`."""
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not step or not step.isdecimal() or len(step) > 10 or int(step) >= _SLURM_SPECIAL_STEPS:
        # Only `srun` starts one process per task; a batch script (`sbatch --ntasks=4`
        # running python once, maybe spawning its own workers) has SLURM_PROCID 0 of 4.
        return None
    rank = _int(env.get("SLURM_PROCID"), -1)
    world_size = _int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS"), 0)
    if rank < 0 or world_size < 1:
        return None
    nodes = _int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"), 1)
    per_node = _int(env.get("SLURM_NTASKS_PER_NODE"), 0) or _tasks_per_node(
        env.get("SLURM_TASKS_PER_NODE", "")
    )
    local_rank = _int(env.get("SLURM_LOCALID"), rank)
    worker = _int(env.get("SLURM_NODEID"), 0)
    if not per_node or per_node * nodes != world_size:
        # Uneven tasks per node do not fit the plugin's topology (global rank =
        # worker * local world + local rank): the job is then taken as one unit.
        per_node, local_rank, worker = world_size, rank, 0
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    job_id = f"slurm-{job}.{step}" if job else None
    return RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=per_node,
        worker=worker,
        restart=_int(env.get("SLURM_RESTART_COUNT"), 0),
        job_id=job_id,
    )


_SLURM_SPECIAL_STEPS = 0xFFFFFFF0  # the batch, extern and interactive steps' ids lie above


def _tasks_per_node(value: str) -> int:
    """The tasks on every node from `SLURM_TASKS_PER_NODE` (`4(x2)`, `4,4`); 0 when the
    nodes differ (`3(x2),2`) or the value cannot be read."""
    counts = set()
    for part in filter(None, value.split(",")):
        count = part.split("(", 1)[0]
        if not count.isdigit():
            return 0
        counts.add(int(count))
    return counts.pop() if len(counts) == 1 else 0


def _open_mpi(env: Mapping[str, str]) -> RankInfo | None:
    """A process of Open MPI's `mpirun`."""
    job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
    return _mpi_rank(
        env,
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        f"mpi-{job}" if job else None,
    )


def _pmi(env: Mapping[str, str]) -> RankInfo | None:
    """A process of MPICH's Hydra (or another PMI launcher), with Hydra's local variables
    where set. PMI gives no job id."""
    return _mpi_rank(env, ("PMI_RANK", "PMI_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), None)


def _mpi_rank(
    env: Mapping[str, str], world: tuple[str, str], local: tuple[str, str], job_id: str | None
) -> RankInfo | None:
    """An MPI launcher's rank: ranks fill one node after another (its default by-slot
    mapping), so the node is `rank // local size`; no local size means one node."""
    rank, world_size = _int(env.get(world[0]), -1), _int(env.get(world[1]), 0)
    if rank < 0 or world_size < 1:
        return None
    per_node = _int(env.get(local[1]), world_size)
    return RankInfo(
        rank=rank,
        local_rank=_int(env.get(local[0]), rank % per_node),
        world_size=world_size,
        local_world_size=per_node,
        worker=rank // per_node,
        job_id=job_id,
    )


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def with_job(info: RankInfo, job_id: str | None) -> RankInfo:
    return replace(info, job_id=job_id)

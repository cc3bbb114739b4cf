"""Who a rank is: pure functions from a launcher's environment to `RankInfo`.

These rules reproduce the online Flyte W&B plugin, so offline and online jobs line up:
labels are `rank-{r}` on one node and `worker-{w}-rank-{lr}` on several, and a job is
multi-node when `WORLD_SIZE // LOCAL_WORLD_SIZE > 1`.
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


SINGLE_PROCESS = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, worker=0)


def label_for(rank: int, local_rank: int, worker: int, multi_node: bool) -> str:
    """The plugin's `x_label` for a rank."""
    return f"worker-{worker}-rank-{local_rank}" if multi_node else f"rank-{rank}"


def validate(info: RankInfo) -> None:
    """Raise ValueError when the numbers cannot describe one rank of a real job."""
    if info.world_size < 1 or info.local_world_size < 1:
        raise ValueError("world sizes must be at least 1")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} outside world size {info.world_size}")
    if not 0 <= info.local_rank < info.local_world_size:
        raise ValueError(f"local rank {info.local_rank} outside local world size")
    if not 0 <= info.worker < info.num_workers:
        raise ValueError(f"worker {info.worker} outside {info.num_workers} workers")
    if info.restart < 0:
        raise ValueError("restart count must not be negative")


def from_env(env: Mapping[str, str]) -> RankInfo | None:
    """RankInfo from torchrun / torch elastic variables; None when not distributed.

    Not distributed means `RANK` or `WORLD_SIZE` missing, or `WORLD_SIZE <= 1` (plugin rule).
    Missing per-node variables default to a single node.
    """
    try:
        rank = int(env["RANK"])
        world_size = int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world_size <= 1:
        return None
    local_world_size = _int(env.get("LOCAL_WORLD_SIZE"), world_size)
    local_rank = _int(env.get("LOCAL_RANK"), rank % local_world_size)
    worker = _int(env.get("GROUP_RANK"), rank // local_world_size)
    run_id = env.get("TORCHELASTIC_RUN_ID")
    info = RankInfo(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        worker=worker,
        restart=_int(env.get("TORCHELASTIC_RESTART_COUNT"), 0),
        # torchrun's default rendezvous id "none" is the same for every job: not an id.
        job_id=run_id if run_id and run_id != "none" else None,
    )
    validate(info)
    return info


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        return default


def with_job(info: RankInfo, job_id: str | None) -> RankInfo:
    return replace(info, job_id=job_id)

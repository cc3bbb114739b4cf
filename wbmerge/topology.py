"""Who a rank is: pure functions from torchrun's environment or from `x_label`s to `RankInfo`.

These rules reproduce the online Flyte W&B plugin, so offline and online jobs line up:
labels are `rank-{r}` on one node and `worker-{w}-rank-{lr}` on several, and a job is
multi-node when `WORLD_SIZE // LOCAL_WORLD_SIZE > 1`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

METADATA_KEY = "wbmerge"  # config key under which every rank records its RankInfo

_SINGLE_NODE_LABEL = re.compile(r"^rank-(\d+)$")
_MULTI_NODE_LABEL = re.compile(r"^worker-(\d+)-rank-(\d+)$")


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


def parse_label(label: str) -> tuple[int | None, int | None, int | None]:
    """(worker, local_rank, rank) from a plugin-style label; (None, None, None) otherwise."""
    match = _MULTI_NODE_LABEL.match(label)
    if match:
        return int(match[1]), int(match[2]), None
    match = _SINGLE_NODE_LABEL.match(label)
    if match:
        rank = int(match[1])
        return 0, rank, rank
    return None, None, None


def is_plugin_label(label: str) -> bool:
    return parse_label(label) != (None, None, None)


def infer_from_labels(labels: Iterable[str]) -> dict[str, RankInfo]:
    """Topology of a job known only by its ranks' plugin-style labels.

    Single-node labels give rank and world size (the highest rank + 1). Multi-node labels
    give worker and local rank; the local world size is the largest local rank seen + 1 and
    global ranks are `worker * local_world_size + local_rank`, as torchrun assigns them.
    Labels that follow neither convention are left out.
    """
    parsed = {label: parse_label(label) for label in set(labels)}
    single = {label: p for label, p in parsed.items() if p[2] is not None}
    multi = {label: p for label, p in parsed.items() if p[2] is None and p[0] is not None}
    result: dict[str, RankInfo] = {}
    if single and not multi:
        world = max(p[2] for p in single.values()) + 1
        for label, (_, _, rank) in single.items():
            result[label] = RankInfo(rank, rank, world, world, 0)
    elif multi and not single:
        local_world = max(p[1] for p in multi.values()) + 1
        workers = max(p[0] for p in multi.values()) + 1
        for label, (worker, local_rank, _) in multi.items():
            rank = worker * local_world + local_rank
            result[label] = RankInfo(rank, local_rank, workers * local_world, local_world, worker)
    return result


def with_job(info: RankInfo, job_id: str | None) -> RankInfo:
    return replace(info, job_id=job_id)

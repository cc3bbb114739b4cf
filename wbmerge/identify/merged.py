"""Runs that wbmerge merged already (a `merge --out` directory), to upload as they are.

`wbmerge merge --out DIR` writes offline runs that plain `wandb sync` can send; `wbmerge
sync DIR` sends them too, verified and recorded like any other sync. Such a run is told
apart by its `wbmerge` config block, which lists the `sources` it was merged from (a rank's
own block never does) and how they were merged. It is no rank of a job: it is uploaded
under its own id, group and name, so the options that shape a merge do not apply to it,
and runs of ranks given beside it are refused (the two would be uploaded by different
rules), unless `--job` picks one job of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import WbmergeError
from ..plan import RANK_SCOPES, RUN_MODES, Source, Target, check_run_id
from ..training import RankInfo


@dataclass(frozen=True)
class MergedBy:
    """How a run that a merge wrote was merged, as its `wbmerge` block says."""

    job_id: str
    run_mode: str
    rank_scope: str
    primary_rank: int
    world_size: int
    local_world_size: int


def is_merge_block(block: object) -> bool:
    """Whether a `wbmerge` config block was written by a merge: it lists its sources."""
    return isinstance(block, dict) and "sources" in block


def merged_by(block: object) -> MergedBy | None:
    """What a merge's `wbmerge` block says of how it merged, or None when the block is not
    a merge's or does not parse (a newer wbmerge's run mode, or a crafted block)."""
    if not is_merge_block(block) or not isinstance(block.get("sources"), list):  # type: ignore[union-attr]
        return None
    assert isinstance(block, dict)
    try:
        found = MergedBy(
            job_id=check_run_id(str(block["job_id"])),
            run_mode=str(block["run_mode"]),
            rank_scope=str(block["rank_scope"]),
            primary_rank=_whole(block["primary_rank"]),
            world_size=_whole(block["world_size"]),
            local_world_size=_whole(block["local_world_size"]),
        )
    except (KeyError, TypeError, ValueError, WbmergeError):
        return None
    fits = found.primary_rank < found.world_size and found.local_world_size >= 1
    modes_known = found.run_mode in RUN_MODES and found.rank_scope in RANK_SCOPES
    return found if fits and modes_known else None


def _whole(value: object) -> int:
    """`value` if it is a whole number (not a bool), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"not a whole number: {value!r}")
    return value


def merged_target(
    path: Path,
    run_id: str,
    merged: MergedBy,
    group: str | None,
    display_name: str,
    job_type: str | None,
    start_time: float = 0.0,
) -> Target:
    """A run that a merge wrote, as the target that uploads it unchanged (kind "merged").
    `run_id` is its run record's: the id wandb uploads it under."""
    try:
        check_run_id(run_id)
    except WbmergeError:
        raise WbmergeError(f"{path}: its run record's id {run_id!r} is not a W&B run id") from None
    primary = merged.primary_rank
    rank = RankInfo(
        rank=primary,
        local_rank=primary % merged.local_world_size,
        world_size=merged.world_size,
        local_world_size=merged.local_world_size,
        worker=primary // merged.local_world_size,
        job_id=merged.job_id,
    )
    source = Source(path, rank, display_name or run_id, start_time=start_time)
    return Target(
        id=run_id,
        group=group or None,
        display_name=display_name or run_id,
        job_type=job_type or None,
        primary_rank=primary,
        kind="merged",
        sources=(source,),
    )

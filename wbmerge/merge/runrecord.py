"""The run record of a merged run (new id, name, group, and the `wbmerge` config block that
says where it came from) and its exit record."""

from __future__ import annotations

import json

from ..log import pb
from ..plan import Target
from ..training import METADATA_KEY
from .options import MergeOptions
from .rankconfig import UNFOLDED_KEYS


def wbmerge_block(target: Target, options: MergeOptions, rank_block: dict | None) -> dict:
    """The `wbmerge` config value of a merged run: a pass-through run keeps its rank's own
    block and adds to it; a shared run speaks for all ranks."""
    first = target.sources[0].rank
    block = dict(rank_block or {}) if target.kind != "shared" else {}
    block.update(
        job_id=options.job_id or first.job_id,
        run_mode=options.run_mode,
        rank_scope=options.rank_scope,
        world_size=first.world_size,
        local_world_size=first.local_world_size,
        num_workers=first.num_workers,
        primary_rank=target.primary_rank,
        labels={str(rank): label for rank, label in sorted(target.labels.items())},
        sources=[
            {
                "rank": s.rank.rank,
                "label": s.label,
                "restart": s.restart,
                "run_id": s.run_id,
            }
            for s in (*target.sources, *target.extra_system_sources)
        ],
    )
    if target.worker is not None:
        block["worker"] = target.worker
    return block


def rewrite_run(payload: bytes, target: Target, options: MergeOptions) -> bytes:
    """A source's run record as the target's: its id, name, group, job type, project and
    entity, and the `wbmerge` block in place of the rank's own."""
    record = pb.Record.FromString(payload)
    run = record.run
    if target.kind in ("merged", "as-logged"):  # its own block says where it came from
        _set_names(run, target, options)
        return record.SerializeToString()
    rank_block = None
    kept = []
    for item in run.config.update:
        key = item.key or (item.nested_key[0] if len(item.nested_key) == 1 else "")
        if key == METADATA_KEY:
            try:
                rank_block = json.loads(item.value_json)
            except (ValueError, RecursionError):
                rank_block = None
            continue
        kept.append(item)
    del run.config.update[:]
    run.config.update.extend(kept)
    block = run.config.update.add()
    block.key = METADATA_KEY
    block.value_json = json.dumps(wbmerge_block(target, options, rank_block))
    _set_names(run, target, options)
    return record.SerializeToString()


def _set_names(run: pb.RunRecord, target: Target, options: MergeOptions) -> None:
    run.run_id = target.id
    run.display_name = target.display_name
    if target.group is not None:
        run.run_group = target.group
    if target.job_type:
        run.job_type = target.job_type
    if options.project:
        run.project = options.project
    if options.entity:
        run.entity = options.entity


def exit_record(code: int) -> bytes:
    record = pb.Record()
    record.exit.exit_code = code
    return record.SerializeToString()


def exit_code(exit_payload: bytes | None) -> int:
    """The exit code a run's exit record gives; 1 for a run that has none (crashed)."""
    if exit_payload is None:
        return 1
    return pb.Record.FromString(exit_payload).exit.exit_code


def restart_config(payload: bytes) -> bytes | None:
    """The config record an elastic restart's run record stands for in the target run,
    None when it sets nothing. A restart is one more offline run of the rank, and its
    `wandb.init(config=...)` may set what the first run did not (`attempt=2`); the target
    run keeps the first run's run record, so the restart's config is written where the
    restart starts, as an update. W&B's own `_wandb` key and the `wbmerge` block (the
    merge writes the target's) are left out. Raises DecodeError for a record that is not
    one."""
    run = pb.Record.FromString(payload).run
    record = pb.Record()
    for item in run.config.update:
        top = item.nested_key[0] if item.nested_key else item.key
        if top not in UNFOLDED_KEYS:
            record.config.update.add().CopyFrom(item)
    return record.SerializeToString() if record.config.update else None

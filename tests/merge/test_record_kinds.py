"""Each run mode does with a record of each kind what the table in `log.kinds` says: a
pass-through copies byte for byte what it does not rewrite, and a shared merge keeps a
rank's record of a kind it does not build from every rank, or from the primary only."""

from __future__ import annotations

from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import KINDS, PassThrough, Shared, read_payloads
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo

from ..support.ranklogs import exit_record, history_record, rank_log

# the kinds a merge takes as they are, in one mode at least (the rest it reads and builds)
AS_IS = [
    kind
    for kind, rule in KINDS.items()
    if rule.passthrough is PassThrough.COPIED
    and rule.shared in (Shared.EVERY_RANK, Shared.PRIMARY, Shared.PRIMARY_FIRST)
]


def marked(kind: str, rank: int, restart: int) -> bytes:
    """A record of `kind` that no other rank or start wrote: its uuid says whose it is."""
    record = pb.Record(uuid=f"{kind}/{rank}/{restart}")
    getattr(record, kind).SetInParent()
    return record.SerializeToString()


def write_job(root: Path, restarts: int = 1) -> None:
    for restart in range(restarts):
        for rank in (0, 1):
            info = RankInfo(rank, rank, 2, 2, 0, restart=restart, job_id="kinds")
            with rank_log(root, info, f"kinds{rank}r{restart}", "kinds") as writer:
                writer.write(history_record([("loss", "1.5")], step=restart))
                for kind in AS_IS:
                    writer.write(marked(kind, rank, restart))
                writer.write(exit_record(0))


def uuids(log: Path) -> set[str]:
    return {pb.Record.FromString(p).uuid for p in read_payloads(log)} - {""}


def test_the_table_leaves_kinds_for_the_merges_to_take_as_they_are():
    assert {"alert", "use_artifact", "environment", "telemetry", "tbrecord"} <= set(AS_IS)


@pytest.mark.parametrize("run_mode", ["new", "auto"])
def test_a_pass_through_copies_each_kind_it_does_not_rewrite_byte_for_byte(tmp_path, run_mode):
    write_job(tmp_path / "job")
    staged = merge_jobs(MergeRequest([tmp_path / "job"], run_mode=run_mode), tmp_path / "out")
    ranks = [0, 1] if run_mode == "new" else [0]
    assert len(staged) == len(ranks)
    for rank, run in zip(ranks, staged, strict=True):
        payloads = list(read_payloads(run.log_path))
        for kind in AS_IS:
            assert marked(kind, rank, 0) in payloads, kind


def test_a_shared_merge_keeps_each_kind_from_the_ranks_the_table_names(tmp_path):
    write_job(tmp_path / "job", restarts=2)
    [staged] = merge_jobs(MergeRequest([tmp_path / "job"], run_mode="shared"), tmp_path / "out")
    payloads = list(read_payloads(staged.log_path))
    want = set()
    for kind in AS_IS:
        for rank in (0, 1):
            for restart in (0, 1):
                rule = KINDS[kind].shared
                if (
                    rule is Shared.EVERY_RANK
                    or (rule is Shared.PRIMARY and rank == 0)
                    or (rule is Shared.PRIMARY_FIRST and rank == 0 and restart == 0)
                ):
                    want.add(f"{kind}/{rank}/{restart}")
                    assert marked(kind, rank, restart) in payloads, (kind, rank, restart)
    assert uuids(staged.log_path) == want
    assert "alert/1/1" in want and "environment/0/1" not in want and "tbrecord/1/0" not in want

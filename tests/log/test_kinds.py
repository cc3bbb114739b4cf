"""The record-kinds table names every kind wandb's protobuf has, and no other."""

from __future__ import annotations

from wbmerge.log import KINDS, PassThrough, Shared, passthrough_rewrites, shared_kept
from wbmerge.log.records import RECORD_KINDS


def test_the_table_names_every_kind_of_the_protobuf():
    # A newer wandb that adds a kind fails here until the kind has a row in `log.kinds`.
    assert set(KINDS) == set(RECORD_KINDS.values())


def test_a_pass_through_rewrites_only_what_names_the_target_run():
    assert sorted(passthrough_rewrites()) == ["artifact", "exit", "files", "run"]
    assert KINDS["history"].passthrough is PassThrough.MOVED


def test_a_shared_merge_keeps_the_machine_records_of_the_primary_first_start_only():
    primary_first = shared_kept(rank_is_primary=True, restart=0)
    primary_again = shared_kept(rank_is_primary=True, restart=1)
    other = shared_kept(rank_is_primary=False, restart=0)
    assert {"environment", "telemetry", "tbrecord", "alert"} <= primary_first
    assert "environment" not in primary_again and "tbrecord" in primary_again
    assert other == {"alert", "use_artifact", "files", "artifact"}
    # what a shared merge builds for itself is never kept as a rank wrote it
    built = {kind for kind, rule in KINDS.items() if rule.shared is Shared.ONCE}
    assert built == {"run", "exit", "header"} and not built & primary_first

"""What each stage does with each kind of record: one table.

wandb's `Record` protobuf names the kinds a `.wandb` file can hold (`records.RECORD_KINDS`
reads them from its descriptor). Every kind is named here once, with what

- a pass-through (`new`, `auto`) writes of it (`merge.passthrough`, `follow.passlive`),
- a shared merge writes of it (`merge.shared`, `merge.console`, `follow.incremental`),
- the source check counts of it (`verify.sourcecheck`: what a run must hold),
- and wandb's uploader makes of it on the server (`wandbcore.content`).

The merges take the kinds they route by rule from here (`passthrough_rewrites`,
`shared_kept`), so the table and the code cannot drift apart there; the rest is checked by
tests that merge a record of every kind (`tests/merge/test_record_kinds.py`). A kind that a
newer wandb adds fails `tests/log/test_kinds.py` until it has a row here. A record whose
kind is in no protobuf this wandb knows is refused, or copied as it is with
`--unknown-records copy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PassThrough(Enum):
    """What a pass-through writes of a record."""

    COPIED = "copied as it is"
    REWRITTEN = "rewritten for the target run"  # run, files, artifact, a restart's exit
    MOVED = "copied, moved past a restart's steps"  # history of a restart


class Shared(Enum):
    """What a shared merge writes of a record of each rank."""

    BY_STEP = "every rank's, merged into one row per step"
    FOLDED = "every rank's, folded into one record, other ranks' keys labelled"
    LABELLED = "every rank's, labelled with the rank"
    EVERY_RANK = "every rank's, as it is or filed under the merged run"
    ONCE = "one, made for the merged run"
    PRIMARY = "the primary rank's only"
    PRIMARY_FIRST = "the primary rank's, from its first start only"
    NONE = "none"


@dataclass(frozen=True)
class KindRule:
    passthrough: PassThrough
    shared: Shared
    counted: str  # what the source check counts of it ("" when nothing)
    server: str  # what wandb's uploader makes of it


KINDS: dict[str, KindRule] = {
    "history": KindRule(PassThrough.MOVED, Shared.BY_STEP,
                        "each value under its key", "history rows"),
    "summary": KindRule(PassThrough.COPIED, Shared.FOLDED,
                        "each key's last value", "the run's summary"),
    "config": KindRule(PassThrough.COPIED, Shared.FOLDED,
                       "each key's last value", "the run's config"),
    "run": KindRule(PassThrough.REWRITTEN, Shared.ONCE,
                    "the config it holds", "the run: names, group, tags, config"),
    "metric": KindRule(PassThrough.COPIED, Shared.LABELLED,
                       "each definition", "`_wandb.m` in the config"),
    "output": KindRule(PassThrough.COPIED, Shared.LABELLED,
                       "each console line", "lines of output.log"),
    "output_raw": KindRule(PassThrough.COPIED, Shared.LABELLED,
                           "each console line", "lines of output.log"),
    "output_logger": KindRule(PassThrough.COPIED, Shared.LABELLED,
                              "each line", "lines of output.log"),
    "stats": KindRule(PassThrough.COPIED, Shared.LABELLED,
                      "each system metric's values", "system metrics (events)"),
    "files": KindRule(PassThrough.REWRITTEN, Shared.EVERY_RANK,
                      "", "the files saved with the run"),
    "artifact": KindRule(PassThrough.REWRITTEN, Shared.EVERY_RANK,
                         "", "an artifact logged by the run"),
    "use_artifact": KindRule(PassThrough.COPIED, Shared.EVERY_RANK,
                             "", "an artifact used by the run"),
    "alert": KindRule(PassThrough.COPIED, Shared.EVERY_RANK, "", "an alert"),
    "exit": KindRule(PassThrough.REWRITTEN, Shared.ONCE, "", "the run's state and exit code"),
    "header": KindRule(PassThrough.COPIED, Shared.ONCE, "", "nothing (the file's version)"),
    "environment": KindRule(PassThrough.COPIED, Shared.PRIMARY_FIRST,
                            "", "wandb-metadata.json"),
    "telemetry": KindRule(PassThrough.COPIED, Shared.PRIMARY_FIRST,
                          "", "`_wandb.t` in the config"),
    "tbrecord": KindRule(PassThrough.COPIED, Shared.PRIMARY,
                         "", "TensorBoard events read from the log dir it names"),
    "final": KindRule(PassThrough.COPIED, Shared.PRIMARY, "", "nothing (the log's end)"),
    "footer": KindRule(PassThrough.COPIED, Shared.PRIMARY, "", "nothing"),
    "preempting": KindRule(PassThrough.COPIED, Shared.PRIMARY, "", "the run marked preempting"),
    "noop_link_artifact": KindRule(PassThrough.COPIED, Shared.PRIMARY,
                                   "", "nothing (a link made online only)"),
    "request": KindRule(PassThrough.COPIED, Shared.PRIMARY,
                        "", "nothing (a control request, not data)"),
}  # fmt: skip


def passthrough_rewrites() -> list[str]:
    """The kinds a pass-through does not copy as they are."""
    return [kind for kind, rule in KINDS.items() if rule.passthrough is PassThrough.REWRITTEN]


def shared_kept(rank_is_primary: bool, restart: int) -> frozenset[str]:
    """The kinds of `Shared.EVERY_RANK`, `PRIMARY` and `PRIMARY_FIRST` a shared merge keeps
    of a rank's start `restart` (0: the first)."""
    kept = {Shared.EVERY_RANK}
    if rank_is_primary:
        kept |= {Shared.PRIMARY} | ({Shared.PRIMARY_FIRST} if restart == 0 else set())
    return frozenset(kind for kind, rule in KINDS.items() if rule.shared in kept)

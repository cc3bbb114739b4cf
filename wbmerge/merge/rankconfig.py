"""The config of a shared run's ranks other than the primary: what they set that the
primary did not, labelled, so that no rank's config is lost and none is repeated.

A shared run holds the primary's config as the primary wrote it (its run record and every
`config.update` in place). Another rank's config is folded as wandb-core applies it (the
run record's, then each update and removal in order), and at the end each key whose final
value differs from the primary's final value, or that the primary does not hold, is added
under the rank's labelled name (`--key-format` on the top-level key, as for metrics). Keys
with the same value on every rank, the usual case (`config=args`), appear once. A key is
compared as the rank set it (`config.update({"trainer": {...}})` sets one key whose value
is the whole dict), so a dict that differs in one entry is added whole.

Example, with the default `{key}/{label}`: the primary (rank 0) holds `{"lr": 0.1,
"seed": 0}`, rank 1 holds `{"lr": 0.1, "seed": 1, "local_rank": 1}`; the run gets one
more config record, `{"seed/rank-1": 1, "local_rank/rank-1": 1}`.

W&B's own `_wandb` key and the `wbmerge` block (which the merge writes) are not folded.

A follow adds these keys only with its last round: a key another rank sets before the
primary sets it to the same value would differ in a round before, and the server keeps a
config key once sent (an upload resumes from the server's config).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from ..errors import WbmergeError
from ..log import pb

ConfigPath = tuple[str, ...]  # a key, or the path of a nested one
UNFOLDED_KEYS = ("_wandb", "wbmerge")


def fold_config(config: dict[ConfigPath, str], change: pb.ConfigRecord) -> None:
    """Apply a config record's updates, then its removals (as wandb-core does), to
    `config` (path -> value JSON). Keys and values are interned: every rank's config is
    kept until the end, and most of it is the same text on every rank, held once."""
    for item in change.update:
        path = tuple(map(sys.intern, item.nested_key or [item.key]))
        if path[0] not in UNFOLDED_KEYS:
            config[path] = sys.intern(item.value_json)
    for item in change.remove:
        config.pop(tuple(item.nested_key) or (item.key,), None)


def other_ranks_config(
    primary: dict[ConfigPath, str],
    others: Iterable[tuple[str, dict[ConfigPath, str]]],
    key_format: str,
) -> bytes | None:
    """The config record that adds each other rank's (label, folded config) keys that the
    primary's folded config lacks or holds with another value, labelled; None when there
    are none. A labelled name the primary's config holds already (its own `seed/rank-1`)
    is refused in one line: one of the two values would be lost."""
    record = pb.Record()
    primary_keys = {path[0] for path in primary}
    for label, config in others:
        for path, value in config.items():
            if primary.get(path) != value:
                item = record.config.update.add()
                labelled = key_format.format(key=path[0], label=label)
                if labelled in primary_keys:
                    raise WbmergeError(
                        f"{label}: its config key {path[0]!r} is {labelled!r} in the shared "
                        "run, a key the primary's config holds already; choose another "
                        "--key-format"
                    )
                if len(path) == 1:
                    item.key = labelled  # (as wandb writes a top-level key)
                else:
                    item.nested_key.extend([labelled, *path[1:]])
                item.value_json = value
    if not record.config.update:
        return None
    return record.SerializeToString()

"""The config entries wandb's SDK writes about what a run logged, as wandb-core leaves them
in the run's config on the server, and those a server's config lacks.

wandb 0.31's SDK keeps each custom chart (`_wandb.visualize.KEY`, `_wandb.viz.KEY`) and the
class names of an image's boxes and masks (`_wandb.bounding_box/class_labels.KEY`,
`_wandb.mask/class_labels.KEY`) in the config, keyed by the history key they describe. It
writes a chart by its path, and class names within the whole `_wandb` block, which it
writes again each time it stores them; wandb-core keeps an entry once set (a later whole
block does not remove the charts: measured with `wandb sync` of a run that logged charts,
then images with boxes).

Example: a log whose config records set `_wandb.visualize.charts/val_curve` holds the entry
("visualize", "charts/val_curve"); a server whose config `_wandb` lacks it gives
["chart 'charts/val_curve' not on the server"].
"""

from __future__ import annotations

import json

from ..log import pb

WANDB_KEY = "_wandb"
# The kinds of entry, as a failure line names them.
KEYED_KINDS = {
    "visualize": "chart",
    "viz": "chart",
    "bounding_box/class_labels": "box class labels",
    "mask/class_labels": "mask class labels",
}

Entries = dict[tuple[str, str], str]  # (kind, key) -> value JSON


def fold_logged_entries(entries: Entries, change: pb.ConfigRecord) -> None:
    """Apply a config record's entries to `entries`: an entry set by its path, or within a
    whole `_wandb` block; an entry once set is kept until set again."""
    for item in change.update:
        path = list(item.nested_key) or [item.key]
        if path[0] != WANDB_KEY:
            continue
        if len(path) == 3 and path[1] in KEYED_KINDS:
            entries[(path[1], path[2])] = item.value_json
        elif len(path) == 1:
            try:
                block = json.loads(item.value_json)
            except (ValueError, RecursionError):
                continue  # (a block that is no JSON object holds no entry that can be read)
            if not isinstance(block, dict):
                continue
            for kind in KEYED_KINDS:
                found = block.get(kind)
                if isinstance(found, dict):
                    for key, value in found.items():
                        entries[(kind, key)] = json.dumps(value)


def entries_missing(expected: Entries, config_json: str) -> list[str]:
    """The entries of `expected` that a server's config (as its `config` answer gives it,
    each key's `{"value": ...}`) does not hold at their value, a line each naming it."""
    try:
        config = json.loads(config_json or "{}")
    except (ValueError, RecursionError):
        config = {}
    wandb = config.get(WANDB_KEY) if isinstance(config, dict) else None
    held = wandb.get("value") if isinstance(wandb, dict) else None
    held = held if isinstance(held, dict) else {}
    problems = []
    for (kind, key), value_json in expected.items():
        of_kind = held.get(kind)
        if not isinstance(of_kind, dict) or key not in of_kind:
            problems.append(f"{KEYED_KINDS[kind]} {key!r} not on the server")
        elif of_kind[key] != _value(value_json):
            problems.append(f"{KEYED_KINDS[kind]} {key!r} other on the server")
    return problems


def _value(value_json: str) -> object:
    """An entry's value; its text when it is not JSON that can be read."""
    try:
        return json.loads(value_json)
    except (ValueError, RecursionError):
        return value_json

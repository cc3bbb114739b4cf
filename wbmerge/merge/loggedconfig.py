"""The config entries wandb's SDK writes about what a rank logged, relabelled for a shared
run.

wandb 0.31's SDK writes four kinds of entry into the config's `_wandb` block, each keyed
by a history key of the run:
- `visualize`: a `wandb.plot.*` chart, keyed by the key it was logged under; its
  `tableKey` names the history key of its table (`charts/val_curve_table`);
- `viz`: a `wandb.visualize` chart, keyed by the history key of its table, which its
  `historyFieldSettings.key` names too;
- `bounding_box/class_labels` and `mask/class_labels`: the class names of an image's boxes
  and masks, keyed `{history key}_wandb_delimeter_{group}`, a key its `key` field repeats.

In a shared run every rank's history key is labelled (`eval/detection/rank-1`), so each
rank's entries are kept under the labelled key they describe, pointing at its labelled
keys: one chart, and one set of class names, per rank. An entry whose key `--per-rank`
leaves out is left out too: it would describe a key the run does not hold.

A history key in an entry may be longer than the key the rank logged (an `EvalTable`
column, `table/source/column`): the longest top-level key the rank logged that it starts
with (then `/` or `.`) is the part labelled.

Example, with `{key}/{label}` and the label `rank-1`: the entry `visualize` /
`charts/val_curve` with `tableKey` `charts/val_curve_table` becomes `visualize` /
`charts/val_curve/rank-1` with `tableKey` `charts/val_curve_table/rank-1`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from ..errors import WbmergeError
from ..log import pb
from ..wandbcore import KEYED_KINDS

WANDB_KEY = "_wandb"
DELIMITER = "_wandb_delimeter_"  # (wandb's spelling)

Entries = dict[tuple[str, str], str]  # (kind, key) -> value JSON (`wandbcore.loggedentries`)


def without_logged_entries(change: pb.ConfigRecord) -> bool:
    """Remove the keyed `_wandb` entries from a config record in place (a shared run writes
    each rank's, relabelled, at its end); True when it changed."""
    changed = False
    kept = []
    for item in change.update:
        path = list(item.nested_key) or [item.key]
        if path[0] == WANDB_KEY and len(path) == 3 and path[1] in KEYED_KINDS:
            changed = True
            continue
        if path[0] == WANDB_KEY and len(path) == 1:
            try:
                block = json.loads(item.value_json)
            except (ValueError, RecursionError):
                block = None  # (left as it is: no entry of it can be read either)
            if isinstance(block, dict) and any(kind in block for kind in KEYED_KINDS):
                for kind in KEYED_KINDS:
                    block.pop(kind, None)
                item.value_json = json.dumps(block)
                changed = True
        kept.append(item)
    if changed:
        del change.update[:]
        change.update.extend(kept)
    return changed


def labelled_entries(
    entries: Entries,
    label: str,
    key_format: str,
    logged_keys: set[str],
    keeps: Callable[[str], bool],
) -> list[tuple[tuple[str, str], str]]:
    """A rank's entries as the shared run holds them: ((kind, labelled key), value JSON),
    each pointing at the rank's labelled history keys; those whose history key `keeps`
    (`--per-rank`) does not keep are left out. An entry whose value cannot be read is
    refused in one line: it could not be relabelled, and leaving it out would lose it."""
    out = []
    for (kind, key), value_json in entries.items():
        try:
            value = json.loads(value_json)
            json.dumps(value)  # (a value nested too deep to walk fails here, not below)
        except (ValueError, RecursionError):
            raise WbmergeError(
                f"{label}: its config entry _wandb.{kind}.{key!r} is not JSON that can be "
                "read; it names a key the shared run relabels"
            ) from None

        def label_key(history_key: str) -> str | None:
            top = _logged_top(history_key, logged_keys)
            if not keeps(top):
                return None
            return key_format.format(key=top, label=label) + history_key[len(top) :]

        try:
            found = _relabel(kind, key, value, label_key, key_format, label)
        except RecursionError:
            raise WbmergeError(
                f"{label}: its config entry _wandb.{kind}.{key!r} is nested too deep to read"
            ) from None
        if found is not None:
            out.append(((kind, found[0]), json.dumps(found[1])))
    return out


def _logged_top(history_key: str, logged_keys: set[str]) -> str:
    """The top-level key a rank logged that `history_key` names or starts (then `/` or
    `.`), the longest; `history_key` itself when none does."""
    if history_key in logged_keys:
        return history_key
    best = ""
    for top in logged_keys:
        if len(top) > len(best) and history_key[len(top) : len(top) + 1] in ("/", "."):
            if history_key.startswith(top):
                best = top
    return best or history_key


def _relabel(
    kind: str,
    key: str,
    value: object,
    label_key: Callable[[str], str | None],
    key_format: str,
    label: str,
) -> tuple[str, object] | None:
    if kind == "visualize":
        tables: list[dict] = []
        _table_keys(value, tables)
        if not tables:
            return None
        for arg in tables:
            labelled = label_key(arg["value"])
            if labelled is None:
                return None
            arg["value"] = labelled
        return key_format.format(key=key, label=label), value
    if kind == "viz":
        labelled = label_key(key)
        if labelled is None:
            return None
        settings = value.get("historyFieldSettings") if isinstance(value, dict) else None
        if isinstance(settings, dict) and "key" in settings:
            settings["key"] = labelled
        return labelled, value
    history_key, sep, group = key.partition(DELIMITER)
    labelled = label_key(history_key) if sep else None
    if labelled is None:
        return None
    new_key = labelled + DELIMITER + group
    if isinstance(value, dict) and "key" in value:
        value["key"] = new_key
    return new_key, value


def _table_keys(value: object, into: list[dict]) -> None:
    """The `{"name": "tableKey", "value": KEY}` arguments of a chart's query, in place."""
    if isinstance(value, dict):
        if value.get("name") == "tableKey" and isinstance(value.get("value"), str):
            into.append(value)
        for inner in value.values():
            _table_keys(inner, into)
    elif isinstance(value, list):
        for inner in value:
            _table_keys(inner, into)


def logged_entries_record(items: Iterable[tuple[tuple[str, str], str]], record: pb.Record) -> None:
    """Add each ((kind, key), value JSON) to `record`'s config as `_wandb.KIND.KEY`."""
    for (kind, key), value_json in items:
        item = record.config.update.add()
        item.nested_key.extend([WANDB_KEY, kind, key])
        item.value_json = value_json

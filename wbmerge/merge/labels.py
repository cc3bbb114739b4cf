"""A rank's items as they leave a shared merge: keys labelled with the rank's label, W&B's
own keys kept; history rows labelled as columns (`items`) where the batch split holds,
item by item (`wire`) where it does not; summaries folded to each key's last value."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from .. import items, records, wire
from ..steps import RESERVED
from ..txlog import Frames


class RankKeys:
    """One rank's item keys as they leave the merge, worked out once per distinct key.

    Maps an item's raw key part to (output key part, reserved name, skew key): user keys
    are labelled (only the top-level key, so a nested value such as an image stays whole)
    and have no reserved name; `_step`, `_runtime`, `_timestamp` and `_wandb` keep their key,
    written in the canonical `nested_key` form, and are named; the skew key is the top-level
    key of a one-level user key, whose numbers the spread is computed from.
    """

    def __init__(self, label: str, key_format: str) -> None:
        self.label = label
        self.key_format = key_format
        self.known: dict[bytes, tuple[bytes, str | None, str | None]] = {}

    def learn(self, raw: bytes) -> tuple[bytes, str | None, str | None]:
        path = wire.key_path(raw)
        top = path[0]
        if top in RESERVED:
            entry = (wire.key_part(path), top, None)
        else:
            labelled = [self.key_format.format(key=top, label=self.label), *path[1:]]
            entry = (wire.key_part(labelled), None, top if len(path) == 1 else None)
        self.known[raw] = entry
        return entry


# A rank's row on its way to the merged row: its labelled items (concatenated item
# fields), its reserved items (their names, and their fields concatenated), and (with
# --skew-metrics) its numbers by key.
Row = tuple[bytes, tuple[str, ...], bytes, Mapping[str, float]]
NO_NUMBERS: Mapping[str, float] = MappingProxyType({})  # a row's numbers without skew


class Labelled(NamedTuple):
    """`Row`s as columns: one list per field."""

    labelled: list[bytes]
    names: list[tuple[str, ...]]
    reserved: list[bytes]
    numbers: list[Mapping[str, float]]


def label_row(items_of_row: list[bytes], keys: RankKeys, skew: bool) -> Row:
    """One row's `Row`, item by item (its raw item fields)."""
    known, learn = keys.known, keys.learn
    split, item_field = wire.split_item, wire.item_field
    labelled = []
    reserved = {}
    numbers = {}
    for item in items_of_row:
        raw, value = split(item)
        out, name, skew_key = known.get(raw) or learn(raw)
        if name is None:
            labelled.append(item_field(out, value))
            if skew and skew_key is not None:
                try:
                    numbers[skew_key] = float(wire.value_json(value))
                except ValueError:
                    pass
        elif name != "_step":
            reserved[name] = item_field(out, value)
    return (
        b"".join(labelled),
        interned(tuple(reserved)),
        b"".join(reserved.values()),
        numbers if skew else NO_NUMBERS,
    )


def label_rows(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    keys: RankKeys,
    skew: bool,
    batch: items.Items | None = None,
) -> Labelled:
    """The `Row` of each history row (its item fields: `data[starts[i]:ends[i]]`), labelled
    as columns when the batch path applies, else item by item. `batch`: the rows' items,
    when the caller split them."""
    if not len(starts):
        return Labelled([], [], [], [])
    if batch is None:
        batch = items.split_spans(data, starts, ends)
    if batch is not None:
        try:
            return _label_batch(batch, len(starts), keys, skew)
        except ValueError:
            pass  # a key part that is not one: the split does not hold
    rows = [
        label_row(wire.region_items(data[start:end]), keys, skew)
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
    return Labelled(*map(list, zip(*rows, strict=True)))


def _label_batch(batch: items.Items, count: int, keys: RankKeys, skew: bool) -> Labelled:
    index, raw_keys = batch.key_codes()
    entries = [keys.known.get(raw) or keys.learn(raw) for raw in raw_keys]
    outs = [out for out, _, _ in entries]
    names = [name for _, name, _ in entries]
    mine = np.flatnonzero(np.array([name is None for name in names], bool)[index])
    # W&B's own items (`_runtime`, `_timestamp`; not `_step`, which the merged row sets)
    kept = {
        name: i
        for i, name in enumerate(dict.fromkeys(n for n in names if n not in (None, "_step")))
    }
    entry_id = np.array([kept.get(name, -1) for name in names], np.int64)
    item_id = entry_id[index]
    own = np.flatnonzero(item_id >= 0)
    both = np.concatenate([mine, own])
    pieces = batch.rekeyed(both, index[both], outs)  # (one pass for both kinds of item)
    labelled = items.join_rows(
        pieces[: 2 * len(mine)], 2 * np.bincount(batch.row[mine], minlength=count)
    )
    names_of, blobs = _reserved(
        batch.row[own], item_id[own], list(kept), pieces[2 * len(mine) :], count
    )
    if not skew:
        return Labelled(labelled, names_of, blobs, [NO_NUMBERS] * count)
    numbers: list[dict[str, float]] = [{} for _ in range(count)]
    skew_keys = [skew_key for _, _, skew_key in entries]
    where = np.flatnonzero(np.array([k is not None for k in skew_keys], bool)[index])
    texts = batch.json(where).to_pylist()
    for row, entry, text in zip(
        batch.row[where].tolist(), index[where].tolist(), texts, strict=True
    ):
        try:
            numbers[row][skew_keys[entry]] = float(text)
        except ValueError:
            pass
    return Labelled(labelled, names_of, blobs, numbers)


def _reserved(
    rows: np.ndarray, item_id: np.ndarray, by_id: list[str], pieces: pa.Array, count: int
) -> tuple[list[tuple[str, ...]], list[bytes]]:
    """Each row's reserved items (`_runtime`, `_timestamp`, ...): their names, and their
    fields concatenated in row order, as `label_row` gives them. Item i is in row `rows[i]`,
    named `by_id[item_id[i]]`, its field the two `pieces` from 2 i."""
    if not len(rows):
        return [()] * count, [b""] * count
    per_row = np.bincount(rows, minlength=count)
    width = int(per_row[0])
    if width and (per_row == width).all():  # the usual: every row the same names in order
        grid = item_id.reshape(count, width)
        if len(set(grid[0].tolist())) == width and (grid == grid[0]).all():
            names_tuple = interned(tuple(by_id[i] for i in grid[0].tolist()))
            return [names_tuple] * count, items.join_rows(pieces, 2 * per_row)
    per_name = np.bincount(rows * len(by_id) + item_id, minlength=count * len(by_id))
    if (per_name > 1).any():  # a name twice in a row: the last one counts, as in `label_row`
        dicts: list[dict[str, bytes]] = [{} for _ in range(count)]
        fields = items.join_rows(pieces, np.full(len(rows), 2))
        for row, name_id, field in zip(rows.tolist(), item_id.tolist(), fields, strict=True):
            dicts[row][by_id[name_id]] = field
        return [tuple(d) for d in dicts], [b"".join(d.values()) for d in dicts]
    blobs = items.join_rows(pieces, 2 * per_row)
    # a row's names in its order, as one number: its items' ids + 1 as digits, in base n + 1
    first = np.ones(len(rows), bool)
    first[1:] = rows[1:] != rows[:-1]
    starts = np.flatnonzero(first)
    position = np.arange(len(rows)) - np.repeat(starts, np.diff(np.append(starts, len(rows))))
    digits = item_id + 1
    base = len(by_id) + 1
    order_key = np.zeros(count, np.int64)
    for nth in range(int(position.max()) + 1):
        at = position == nth
        order_key[rows[at]] = order_key[rows[at]] * base + digits[at]
    spelled = {
        key: interned(_names_of_key(key, base, by_id)) for key in np.unique(order_key).tolist()
    }
    return [spelled[key] for key in order_key.tolist()], blobs


_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}


def interned(names: tuple[str, ...]) -> tuple[str, ...]:
    """One tuple object for equal names, so rows can be compared by identity."""
    return _NAMES.setdefault(names, names)


def _names_of_key(key: int, base: int, by_id: list[str]) -> tuple[str, ...]:
    spelled = []
    while key:
        key, digit = divmod(key, base)
        spelled.append(by_id[digit - 1])
    return tuple(reversed(spelled))


def fold_summaries(
    frames: Frames,
    which: np.ndarray,
    keys: RankKeys,
    summary: dict[bytes, bytes],
    batch: items.Items | None = None,
) -> None:
    """Fold the summary records `which`, in order, into the rank's `summary` (output key
    part -> value part, in the order the keys were first set; the last value of a key
    wins). `batch`: their items, when the caller split them."""
    if not len(which):
        return
    if batch is None:
        starts, ends = records.body_spans(frames, which, 0x1A)
        if (starts >= 0).all():
            batch = items.split_spans(frames.data, starts, ends)
    if batch is not None:
        try:
            index, raw_keys = batch.key_codes()
            entries = [keys.known.get(raw) or keys.learn(raw) for raw in raw_keys]
        except ValueError:
            batch = None
    if batch is None:  # (a removed key, say)
        for record in which.tolist():
            _fold_summary(frames.payload(record), keys, summary)
        return
    # As item by item: a key keeps the place where it was first set and takes its last
    # value, also when two spellings of a key share an output key. (The dictionary may hold
    # keys of the rows split with these records, which no summary here sets.)
    positions = np.arange(len(index))
    first = np.full(len(entries), len(index), np.int64)
    last = np.full(len(entries), -1, np.int64)
    np.minimum.at(first, index, positions)
    np.maximum.at(last, index, positions)
    first_of: dict[bytes, int] = {}
    last_of: dict[bytes, int] = {}
    for entry in np.flatnonzero(last >= 0).tolist():
        out = entries[entry][0]
        first_of[out] = min(first_of.get(out, len(index)), int(first[entry]))
        last_of[out] = max(last_of.get(out, -1), int(last[entry]))
    outs = sorted(first_of, key=first_of.__getitem__)
    values = batch.values(np.array([last_of[out] for out in outs], np.int64)).to_pylist()
    for out, value in zip(outs, values, strict=True):
        summary[out] = value


def _fold_summary(payload: bytes, keys: RankKeys, summary: dict[bytes, bytes]) -> None:
    known, learn = keys.known, keys.learn
    split = wire.split_item
    updates, removes = wire.summary_items(payload)
    for item in updates:
        raw, value = split(item)
        summary[(known.get(raw) or learn(raw))[0]] = value
    for item in removes:
        raw = split(item)[0]
        summary.pop((known.get(raw) or learn(raw))[0], None)

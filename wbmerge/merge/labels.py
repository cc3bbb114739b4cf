"""The ranks' items as they leave a shared merge: keys labelled with each rank's label, W&B's
own keys kept; history rows labelled as columns (`items`) where the batch split holds,
item by item (`wire`) where it does not; summaries folded to each key's last value.

The rows of many ranks are labelled at once: a key's output depends on its rank, so every
(rank, key) pair is learned once (`KeyTable`), and a batch's items find their output key
parts by array lookups, whatever the number of ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..analyse import PerRank
from ..log import RESERVED, Frames, items, records, wire

# A raw key's (output key part, reserved name); the part is None for a user key not kept
# per rank.
Entry = tuple[bytes | None, str | None]


class RankKeys:
    """One rank's item keys as they leave the merge, worked out once per distinct key.

    Maps an item's raw key part to (output key part, reserved name): user keys are
    labelled (only the top-level key, so a nested value such as an image stays whole) and
    have no reserved name; `_step`, `_runtime`, `_timestamp` and `_wandb` keep their key,
    written in the canonical `nested_key` form, and are named.
    """

    def __init__(self, label: str, key_format: str, per_rank: PerRank | None = None) -> None:
        self.label = label
        self.key_format = key_format
        self.per_rank = per_rank or PerRank()
        self.known: dict[bytes, Entry] = {}
        self.user_keys: set[str] = set()  # top-level user keys seen (for --per-rank's check)

    def learn(self, raw: bytes, path: list[str] | None = None) -> Entry:
        """`raw`'s entry; `path`: its key path, when the caller parsed it already. A user
        key not kept per rank (`--per-rank`) has output key part None: it is left out."""
        if path is None:
            path = wire.key_path(raw)
        top = path[0]
        if top in RESERVED:
            entry: Entry = (wire.key_part(path), top)
        else:
            self.user_keys.add(top)
            if self.per_rank.keeps(top):
                labelled = [self.key_format.format(key=top, label=self.label), *path[1:]]
                entry = (wire.key_part(labelled), None)
            else:
                entry = (None, None)
        self.known[raw] = entry
        return entry

    def entry(self, raw: bytes) -> Entry:
        return self.known.get(raw) or self.learn(raw)


class KeyTable:
    """Every rank's `RankKeys` as arrays: a pair id for each (rank, raw key) seen, and per
    pair its output key part and reserved name. Ranks are numbered by their place
    in `keys` (their slot)."""

    def __init__(self, keys: list[RankKeys]) -> None:
        self.keys = keys
        self._raw_ids: dict[bytes, int] = {}
        self._raws: list[bytes] = []
        self._pair = np.full((len(keys), 8), -1, np.int64)  # slot x raw id -> pair id
        self._paths: list[list[str] | None] = []  # by raw id, parsed when first needed
        self.outs: list[bytes | None] = []
        self.names: list[str | None] = []
        # by pair id: its (rank, output key) in a summary, numbered; two spellings of a key
        # of one rank share one
        self._summary_keys: dict[tuple[int, bytes], int] = {}
        self._summary_key: list[int] = []
        self._out_lengths = np.empty(0, np.int64)
        self._pool: pa.Array | None = None

    def pairs(self, slots: np.ndarray, raw_keys: list[bytes], codes: np.ndarray) -> np.ndarray:
        """The pair id of each item: of rank slot `slots[i]`, raw key `raw_keys[codes[i]]`.
        Raises ValueError for a raw key that is not a key part."""
        found = []
        for raw in raw_keys:
            raw_id = self._raw_ids.get(raw)
            if raw_id is None:
                raw_id = self._raw_ids[raw] = len(self._raws)
                self._raws.append(raw)
                self._paths.append(None)
            found.append(raw_id)
        ids = np.array(found, np.int64)
        if len(self._raw_ids) > self._pair.shape[1]:
            grown = np.full((len(self.keys), 2 * len(self._raw_ids)), -1, np.int64)
            grown[:, : self._pair.shape[1]] = self._pair
            self._pair = grown
        raw_of_item = ids[codes]
        pair = self._pair[slots, raw_of_item]
        missing = np.flatnonzero(pair < 0)
        if len(missing):
            width = self._pair.shape[1]
            for combined in np.unique(slots[missing] * width + raw_of_item[missing]).tolist():
                slot, raw_id = divmod(combined, width)
                raw, keys = self._raws[raw_id], self.keys[slot]
                entry = keys.known.get(raw)
                if entry is None:  # (the key path is the same for every rank: parsed once)
                    path = self._paths[raw_id]
                    if path is None:
                        path = self._paths[raw_id] = wire.key_path(raw)
                    entry = keys.learn(raw, path)
                out, name = entry
                self._pair[slot, raw_id] = len(self.outs)
                self.outs.append(out)
                self.names.append(name)
                self._summary_key.append(
                    self._summary_keys.setdefault((slot, out), len(self._summary_keys))
                )
            self._pool = None
            pair = self._pair[slots, raw_of_item]
        return pair

    def out_parts(self) -> tuple[pa.Array, np.ndarray]:
        """(every pair's output key part, their lengths), by pair id."""
        self._arrays()
        return self._pool, self._out_lengths

    def is_user(self) -> np.ndarray:
        """By pair id: whether its key is a user key that is labelled (not one of W&B's own,
        nor one not kept per rank)."""
        self._arrays()
        return self._user

    def own_names(self) -> tuple[list[str], np.ndarray]:
        """(W&B's own names a row keeps: all reserved names but `_step`; by pair id, the
        index of its name among them, -1 for a user key or `_step`)."""
        self._arrays()
        return self._own_names, self._own_of_pair

    def summary_keys(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(by pair id: its summary key; by summary key: its rank slot, its output key part)."""
        self._arrays()
        return self._summary_key_of, self._summary_slot, self._summary_out

    def _arrays(self) -> None:
        if self._pool is None:
            self._summary_key_of = np.array(self._summary_key, np.int64)
            self._summary_slot = np.array([slot for slot, _ in self._summary_keys], np.int64)
            self._summary_out = np.empty(len(self._summary_keys), object)
            self._summary_out[:] = [out for _, out in self._summary_keys]
            self._pool = pa.array(self.outs, pa.binary())
            lengths = (0 if out is None else len(out) for out in self.outs)
            self._out_lengths = np.fromiter(lengths, np.int64, len(self.outs))
            # (a user key not kept per rank has no output key: it is not labelled)
            kept = zip(self.names, self.outs, strict=True)
            self._user = np.array([name is None and out is not None for name, out in kept], bool)
            self._own_names = sorted({n for n in self.names if n not in (None, "_step")})
            number = {name: i for i, name in enumerate(self._own_names)}
            self._own_of_pair = np.array([number.get(n, -1) for n in self.names], np.int64)


# A rank's row on its way to the merged row: its labelled items (concatenated item
# fields), and its reserved items (the id of their names, and their fields concatenated).
Row = tuple[bytes, int, bytes]


class Labelled(NamedTuple):
    """`Row`s as columns."""

    labelled: list[bytes]
    names: np.ndarray  # int64 ids (`names_of`)
    reserved: list[bytes]


_NAMES: list[tuple[str, ...]] = [()]
_NAME_IDS: dict[tuple[str, ...], int] = {(): 0}


def name_id(names: tuple[str, ...]) -> int:
    """One number for equal tuples of reserved names, so rows can be compared as arrays."""
    found = _NAME_IDS.get(names)
    if found is None:
        found = _NAME_IDS[names] = len(_NAMES)
        _NAMES.append(names)
    return found


def names_of(names_id: int) -> tuple[str, ...]:
    return _NAMES[names_id]


def label_row(items_of_row: list[bytes], keys: RankKeys) -> Row:
    """One row's `Row`, item by item (its raw item fields)."""
    split, item_field = wire.split_item, wire.item_field
    labelled = []
    reserved = {}
    for item in items_of_row:
        raw, value = split(item)
        out, name = keys.entry(raw)
        if name is None:
            if out is not None:  # (None: not kept per rank)
                labelled.append(item_field(out, value))
        elif name != "_step":
            reserved[name] = item_field(out, value)
    return b"".join(labelled), name_id(tuple(reserved)), b"".join(reserved.values())


def label_rows(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    slots: np.ndarray,
    table: KeyTable,
    batch: items.Items | None,
) -> Labelled:
    """The `Row` of each history row (its item fields: `data[starts[i]:ends[i]]`, of the
    rank in slot `slots[i]`), labelled as columns from `batch`, the rows' items as the
    caller split them (`items.split_spans`); item by item where there is none (the split
    was refused) or it does not hold."""
    if not len(starts):
        return Labelled([], np.empty(0, np.int64), [])
    if batch is not None:
        try:
            return _label_batch(batch, slots, table)
        except ValueError:
            pass  # a key part that is not one: the split does not hold
    rows = [
        label_row(wire.region_items(data[start:end]), table.keys[slot])
        for start, end, slot in zip(starts.tolist(), ends.tolist(), slots.tolist(), strict=True)
    ]
    labelled, names, reserved = map(list, zip(*rows, strict=True))
    return Labelled(labelled, np.array(names, np.int64), reserved)


def _label_batch(batch: items.Items, slots: np.ndarray, table: KeyTable) -> Labelled:
    count = len(slots)
    index, raw_keys = batch.key_codes()
    pair = table.pairs(slots[batch.row], raw_keys, index)
    user = table.is_user()
    # W&B's own items (`_runtime`, `_timestamp`; not `_step`, which the merged row sets)
    own_names, own_of_pair = table.own_names()
    mine = np.flatnonzero(user[pair])
    own = np.flatnonzero(own_of_pair[pair] >= 0)
    both = np.concatenate([mine, own])
    fields = _fields(batch, both, pair[both], table)  # (one pass for both kinds of item)
    labelled = items.join_rows(fields[: len(mine)], np.bincount(batch.row[mine], minlength=count))
    names_of_rows, blobs = _reserved(
        batch.row[own], own_of_pair[pair[own]], own_names, fields[len(mine) :], count
    )
    return Labelled(labelled, names_of_rows, blobs)


def _fields(batch: items.Items, which: np.ndarray, pair: np.ndarray, table: KeyTable) -> pa.Array:
    """The items `which` as item fields again, item `which[i]` with the output key part of
    pair `pair[i]`: tag, length, key part, value part, built as arrays."""
    values = batch.values(which)
    pool, lengths = table.out_parts()
    keys = pool.take(pair)
    total = lengths[pair] + pc.binary_length(values).to_numpy(zero_copy_only=False)
    return pc.binary_join_element_wise(_heads(total), keys, values, b"")


def _heads(sizes: np.ndarray) -> pa.Array:
    """`0a` and the varint of each size: the head of an item field of that size."""
    widths = np.ones(len(sizes), np.int64)
    for bits in range(7, 64, 7):
        widths += sizes >= (1 << bits)
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(widths + 1, out=offsets[1:])
    data = np.empty(int(offsets[-1]), np.uint8)
    data[offsets[:-1]] = 0x0A
    rest = sizes.copy()
    for byte in range(int(widths.max(initial=1))):
        here = np.flatnonzero(widths > byte)
        more = widths[here] > byte + 1
        data[offsets[:-1][here] + 1 + byte] = (rest[here] & 0x7F) | np.where(more, 0x80, 0)
        rest >>= 7
    return pa.Array.from_buffers(
        pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    ).cast(pa.binary())


def _reserved(
    rows: np.ndarray, item_id: np.ndarray, by_id: list[str], fields: pa.Array, count: int
) -> tuple[np.ndarray, list[bytes]]:
    """Each row's reserved items (`_runtime`, `_timestamp`, ...): the id of their names, and
    their fields concatenated in row order, as `label_row` gives them. Item i is in row
    `rows[i]`, named `by_id[item_id[i]]`, its field `fields[i]`."""
    if not len(rows):
        return np.zeros(count, np.int64), [b""] * count
    per_row = np.bincount(rows, minlength=count)
    width = int(per_row[0])
    if width and (per_row == width).all():  # the usual: every row the same names in order
        grid = item_id.reshape(count, width)
        if len(set(grid[0].tolist())) == width and (grid == grid[0]).all():
            names = name_id(tuple(by_id[i] for i in grid[0].tolist()))
            return np.full(count, names, np.int64), items.join_rows(fields, per_row)
    per_name = np.bincount(rows * len(by_id) + item_id, minlength=count * len(by_id))
    if (per_name > 1).any():  # a name twice in a row: the last one counts, as in `label_row`
        dicts: list[dict[str, bytes]] = [{} for _ in range(count)]
        for row, name, field in zip(
            rows.tolist(), item_id.tolist(), fields.to_pylist(), strict=True
        ):
            dicts[row][by_id[name]] = field
        return (
            np.array([name_id(tuple(d)) for d in dicts], np.int64),
            [b"".join(d.values()) for d in dicts],
        )
    blobs = items.join_rows(fields, per_row)
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
    keys, inverse = np.unique(order_key, return_inverse=True)
    spelled = np.array([name_id(_names_of_key(key, base, by_id)) for key in keys.tolist()])
    return spelled[inverse].astype(np.int64), blobs


def _names_of_key(key: int, base: int, by_id: list[str]) -> tuple[str, ...]:
    spelled = []
    while key:
        key, digit = divmod(key, base)
        spelled.append(by_id[digit - 1])
    return tuple(reversed(spelled))


def fold_summaries(
    frames: Frames,
    which: np.ndarray,
    slots: np.ndarray,
    table: KeyTable,
    summaries: list[dict[bytes, bytes]],
    batch: items.Items | None = None,
) -> None:
    """Fold the summary records `which` (of the ranks in slots `slots`), in order, into
    each rank's summary (`summaries[slot]`: output key part -> value part, in the order the
    keys were first set; the last value of a key wins). `batch`: their items, when the
    caller split them."""
    if not len(which):
        return
    if batch is None:
        starts, ends = records.summary_spans(frames, which)
        if (starts >= 0).all():
            batch = items.split_spans(frames.data, starts, ends)
    pair = None
    if batch is not None:
        try:
            index, raw_keys = batch.key_codes()
            pair = table.pairs(slots[batch.row], raw_keys, index)
        except ValueError:
            pair = None
    if pair is None:  # (a removed key, say)
        for record, slot in zip(which.tolist(), slots.tolist(), strict=True):
            _fold_summary(frames.payload(record), table.keys[slot], summaries[slot])
        return
    # As item by item: a key keeps the place where it was first set and takes its last
    # value, also when two spellings of a key share an output key.
    key_of_pair, key_slot, key_out = table.summary_keys()
    key = key_of_pair[pair]
    seen, first = np.unique(key, return_index=True)
    last = np.full(len(key_slot), -1, np.int64)
    np.maximum.at(last, key, np.arange(len(key)))
    keys = seen[np.argsort(first)]
    values = batch.values(last[keys]).to_pylist()
    for slot, out, value in zip(
        key_slot[keys].tolist(), key_out[keys].tolist(), values, strict=True
    ):
        summaries[slot][out] = value


def _fold_summary(payload: bytes, keys: RankKeys, summary: dict[bytes, bytes]) -> None:
    split = wire.split_item
    updates, removes = wire.summary_items(payload)
    for item in updates:
        raw, value = split(item)
        summary[keys.entry(raw)[0]] = value
    for item in removes:
        raw = split(item)[0]
        summary.pop(keys.entry(raw)[0], None)

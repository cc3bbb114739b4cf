"""History and summary items of many records at once, as columns (numpy and pyarrow).

Every value of every rank passes through the shared merge and the Parquet export; in a
Python loop that costs about a microsecond a value. Here the items of a batch of records
are found with array operations over their concatenated bytes, so the cost per value is a
few array elements, and the result is columns: which record, raw key part, value part.

An item is `0x0a L` + key part + value part, where the key part is one or more `key` /
`nested_key` fields and the value part is `0x82 0x01 V` + V bytes of JSON. JSON text has no
control characters, so the value tag `82 01` cannot occur inside a value, and is found by a
vector comparison. From the tags, item bounds follow; they are then checked to chain exactly
from each region's start to its end (first byte `0a`, the length byte matching), so a batch
either splits exactly as protobuf would parse it or is refused (`None`) and the caller takes
the exact item-by-item path (`wire`). Key parts are checked by the caller when it first sees
one (`wire.key_path` parses it), which completes the proof.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import wire

_HEADS = pa.array([b"\x0a" + wire.encode_varint(n) for n in range(1 << 14)], pa.binary())


class Items:
    """The items of a batch of regions, in order: item i belongs to region `row[i]`.

    Built by `split_spans` from where each item's parts are (`bounds`); raw key parts,
    value parts (tag, length, JSON) and JSON texts are cut out of the bytes when first
    asked for, so a caller pays only for what it uses. Or built from those arrays.
    """

    def __init__(
        self,
        row: np.ndarray,
        counts: np.ndarray,
        key: pa.BinaryArray | None = None,
        value: pa.BinaryArray | None = None,
        texts: pa.StringArray | None = None,
        located: tuple[bytes, np.ndarray, np.ndarray | None] | None = None,
    ) -> None:
        self.row = row  # int64, non-decreasing
        self.counts = counts  # items per region
        self._key, self._value, self._texts = key, value, texts
        self._located = located  # (data, bounds, the items' order in `bounds` or None)
        self._codes: tuple[np.ndarray, list[bytes]] | None = None
        self._cut: dict[tuple[int, int], pa.LargeBinaryArray] = {}  # `_pieces`, by parts

    @property
    def key(self) -> pa.BinaryArray:
        """The raw key parts."""
        if self._key is None:
            self._key = self._take(self._pieces(_KEY, _VALUE)).cast(pa.binary())
        return self._key

    @property
    def value(self) -> pa.BinaryArray:
        """The value parts: tag, length, JSON."""
        if self._value is None:
            self._value = self._take(self._pieces(_VALUE, _END)).cast(pa.binary())
        return self._value

    def values(self, which: np.ndarray) -> pa.BinaryArray:
        """The value parts of the items `which` (indices), cut out for just those."""
        if self._located is None:
            return self.value.take(which)
        pick = self._located[2]
        pieces = self._pieces(_VALUE, _END)
        return pieces.take(2 * (which if pick is None else pick[which])).cast(pa.binary())

    def json(self) -> pa.Array:
        """The JSON text of every value (as split, its UTF-8 not yet checked)."""
        if self._texts is None:
            pieces = self._pieces(_TEXT, _END)
            texts = pa.Array.from_buffers(pa.large_string(), len(pieces), pieces.buffers())
            self._texts = self._take(texts)
        return self._texts

    def key_codes(self) -> tuple[np.ndarray, list[bytes]]:
        """(each item's index into the distinct key parts, the distinct key parts)."""
        if self._codes is None:
            if self._located is None:
                keys = self._key
            else:
                keys = self._take(self._pieces(_KEY, _VALUE))
            encoded = pc.dictionary_encode(keys)
            self._codes = encoded.indices.to_numpy(), encoded.dictionary.to_pylist()
        return self._codes

    def rows(self, lo: int, hi: int) -> Items:
        """The items of regions `lo` to `hi` (numbered from 0 again); key codes found for
        all of them are kept (one dictionary for both parts)."""
        a, b = np.searchsorted(self.row, [lo, hi]).tolist()
        row, counts = self.row[a:b] - lo, self.counts[lo:hi]
        if self._located is None:
            texts = None if self._texts is None else self._texts[a:b]
            part = Items(row, counts, self._key[a:b], self._value[a:b], texts)
        else:
            data, bounds, pick = self._located
            if pick is None:
                part = Items(row, counts, located=(data, bounds[:, a:b], None))
            else:  # the same bounds: the same pieces
                part = Items(row, counts, located=(data, bounds, pick[a:b]))
                part._cut = self._cut
        if self._codes is not None:
            part._codes = self._codes[0][a:b], self._codes[1]
        return part

    def _pieces(self, first: int, stop: int) -> pa.LargeBinaryArray:
        """Bytes `first` to `stop` (`bounds` columns) of every item in data order, each
        followed by the gap to the next: an array of twice as many pieces, no copy."""
        if (first, stop) in self._cut:
            return self._cut[first, stop]
        data, bounds, _ = self._located
        count = bounds.shape[1]
        base = bounds[_HEAD, 0]
        offsets = np.empty(2 * count + 1, np.int64)
        offsets[0:-1:2] = bounds[first]
        offsets[1:-1:2] = bounds[stop]
        offsets[-1] = bounds[stop, -1]
        offsets -= base
        pieces = pa.LargeBinaryArray.from_buffers(
            pa.large_binary(),
            2 * count,
            [None, pa.py_buffer(offsets), pa.py_buffer(memoryview(data)[base:])],
        )
        self._cut[first, stop] = pieces
        return pieces

    def _take(self, pieces: pa.Array) -> pa.Array:
        """The items' own pieces (not the gaps), in the items' order."""
        pick = self._located[2]
        return pieces.take(np.arange(0, len(pieces), 2) if pick is None else 2 * pick)


# Where each item's parts begin: its field head (tag, length), key part, value part (tag,
# length), JSON text; and where it ends. One row of `bounds` per part, one column per item.
_HEAD, _KEY, _VALUE, _TEXT, _END = range(5)


def split(regions: list[bytes]) -> Items | None:
    """Split item regions (item fields only, nothing else) into items; None if any region is
    not in the one-byte-length form wandb writes for ordinary values (see the module doc)."""
    if not regions:
        return None
    lengths = np.fromiter(map(len, regions), np.int64, len(regions))
    ends = np.cumsum(lengths)
    return split_spans(b"".join(regions), ends - lengths, ends)


def value_tags(data: bytes) -> np.ndarray:
    """Where the value tags (`82 01`) of `data` are: what `split_spans` starts from, found
    once for several calls on the same bytes."""
    buf = np.frombuffer(data, np.uint8)
    found = buf[1:] == 0x01
    found &= buf[:-1] == 0x82
    return np.flatnonzero(found)


def split_spans(
    data: bytes, starts: np.ndarray, ends: np.ndarray, tags: np.ndarray | None = None
) -> Items | None:
    """`split` of the regions `data[starts[i]:ends[i]]` (not overlapping), found in place:
    `data` may hold other bytes between them, and the regions need not be in data order.
    `tags`: `value_tags(data)`, when the caller has it."""
    if not len(starts):
        return None
    order = None
    if (starts[1:] < starts[:-1]).any():  # e.g. a record that spanned blocks, put last
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
    if tags is None:
        tags = value_tags(data)
    found = _bounds(np.frombuffer(data, np.uint8), starts, ends, tags)
    if found is None:
        return None
    row, bounds = found
    counts = np.bincount(row, minlength=len(starts))
    pick = None  # items in data order; put back in the caller's order of regions
    if order is not None:  # a region's items are together: move the ranges, not the items
        caller = np.argsort(order)  # the caller's region i is region caller[i] in data order
        firsts = (np.cumsum(counts) - counts)[caller]
        counts = counts[caller]
        pick = np.arange(len(row)) + np.repeat(firsts - (np.cumsum(counts) - counts), counts)
        row = np.repeat(np.arange(len(starts)), counts)
    return Items(row, counts, located=(data, bounds, pick))


def _bounds(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, tags: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """(region of each item, `bounds` of each item) of regions in data order, or None."""
    lengths = ends - starts
    row = np.searchsorted(ends, tags, side="right")  # the region a tag is in, if any
    inside = row < len(starts)
    inside[inside] = tags[inside] >= starts[row[inside]]
    tags, row = tags[inside], row[inside]
    if len(tags) == 0 or tags[-1] + 3 > len(buf):
        return None
    value_lengths = buf[tags + 2].astype(np.int64)
    value_ends = tags + 3 + value_lengths
    first = np.ones(len(tags), bool)
    first[1:] = row[1:] != row[:-1]
    # each region's first item starts at its start, each other at the previous one's end
    item_starts = np.empty_like(tags)
    item_starts[1:] = value_ends[:-1]
    item_starts[first] = starts[row[first]]
    counts = np.bincount(row, minlength=len(starts))
    filled = counts > 0
    last = (np.cumsum(counts) - 1)[filled]
    if (
        (value_lengths >= 0x80).any()
        or (lengths[~filled] != 0).any()
        or (value_ends[last] != ends[filled]).any()
        or (tags - item_starts < 3).any()
    ):
        return None
    heads = buf[item_starts]
    item_lengths = buf[item_starts + 1].astype(np.int64)
    if (
        (heads != 0x0A).any()
        or (item_lengths >= 0x80).any()
        or (item_starts + 2 + item_lengths != value_ends).any()
    ):
        return None
    key_tags = buf[item_starts + 2]
    if not ((key_tags == 0x0A) | (key_tags == 0x12)).all():
        return None
    bounds = np.empty((5, len(tags)), np.int64)
    bounds[_HEAD] = item_starts
    np.add(item_starts, 2, out=bounds[_KEY])
    bounds[_VALUE] = tags
    np.add(tags, 3, out=bounds[_TEXT])
    bounds[_END] = value_ends
    return row, bounds


def item_fields(keys: pa.BinaryArray, values: pa.BinaryArray) -> pa.BinaryArray:
    """Each (key part, value part) as an item field: tag, length, key, value."""
    lengths = pc.add(pc.binary_length(keys), pc.binary_length(values))
    if len(lengths) and pc.max(lengths).as_py() >= len(_HEADS):
        raise ValueError("item too long for the batch path")
    return pc.binary_join_element_wise(_HEADS.take(lengths), keys, values, b"")


def join_rows(fields: pa.BinaryArray, counts: np.ndarray) -> list[bytes]:
    """The concatenated fields of each row, given how many fields each row has."""
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    rows = pa.ListArray.from_arrays(pa.array(offsets), fields)
    return pc.binary_join(rows, b"").to_pylist()

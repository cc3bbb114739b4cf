"""History and summary items of many records at once, as columns (numpy and pyarrow).

Every value of every rank passes through the shared merge and the Parquet export; in a
Python loop that costs about a microsecond a value. Here the items of a batch of records
are found with array operations over their concatenated bytes, so the cost per value is a
few array elements, and the result is columns: which record, raw key part, value part.

An item is `0x0a L` + key part + value part, where the key part is one or more `key` /
`nested_key` fields and the value part is `0x82 0x01 V` + V bytes of JSON. The walk follows
the lengths, as protobuf does, but one item of every region per array step: each region's
items must chain exactly from its start to its end; then each item must hold key fields
(one, as wandb writes them, or several, walked the same way) and a value field that ends
exactly where the item does, every length in the one-byte form wandb writes for ordinary
values. So a batch either splits exactly as protobuf would parse it or is refused (`None`)
and the caller takes the exact item-by-item path (`wire`). Key parts are checked by the
caller when it first sees one (`wire.key_path` parses it), which completes the proof.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import wire

_PERIOD_SEARCH = 256  # the longest period of repeating keys looked for, in items


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
        return self._pieces(_VALUE, _END).take(self._places(which)).cast(pa.binary())

    def _places(self, which: np.ndarray) -> np.ndarray:
        """Where the items `which` (indices) are in a `_pieces` array."""
        pick = self._located[2]
        return 2 * (which if pick is None else pick[which])

    def json(self, which: np.ndarray | None = None) -> pa.Array:
        """The JSON text of every value, or of the items `which` (indices) only (as split,
        its UTF-8 not yet checked)."""
        if which is not None:
            if self._located is None:
                return self.json().take(which)
            return self._texts_and_gaps().take(self._places(which))
        if self._texts is None:
            self._texts = self._take(self._texts_and_gaps())
        return self._texts

    def _texts_and_gaps(self) -> pa.LargeStringArray:
        pieces = self._pieces(_TEXT, _END)
        return pa.Array.from_buffers(pa.large_string(), len(pieces), pieces.buffers())

    def value_spans(self) -> tuple[bytes, np.ndarray, np.ndarray] | None:
        """(the data split, start and end of each item's value part in it), in the items'
        order, to be read without cutting the parts out; None for items built from arrays."""
        if self._located is None:
            return None
        data, bounds, pick = self._located
        starts, ends = bounds[_VALUE], bounds[_END]
        return (data, starts, ends) if pick is None else (data, starts[pick], ends[pick])

    def key_codes(self) -> tuple[np.ndarray, list[bytes]]:
        """(each item's index into the distinct key parts, the distinct key parts)."""
        if self._codes is None:
            self._codes = self.repeating_key_codes()
        if self._codes is None:
            if self._located is None:
                keys = self._key
            else:
                keys = self._take(self._pieces(_KEY, _VALUE))
            encoded = pc.dictionary_encode(keys)
            self._codes = encoded.indices.to_numpy(), encoded.dictionary.to_pylist()
        return self._codes

    def repeating_key_codes(self) -> tuple[np.ndarray, list[bytes]] | None:
        """`key_codes` when the keys repeat, in data order, with a period of a few regions
        (every row logging the same keys; rows and summaries taking turns): proved by each
        key being equal to the key one period before, compared in place, which is cheaper
        than encoding every key. None when they do not."""
        count = 0 if self._located is None else self._located[1].shape[1]
        if count < 4:
            return None  # (and no items: nothing to compare with)
        pick = self._located[2]
        pieces = self._pieces(_KEY, _VALUE)  # key parts at even places, in data order
        early = pieces.slice(0, 2 * min(count, _PERIOD_SEARCH))
        same_as_first = pc.equal(early, pieces[0]).to_numpy(zero_copy_only=False)
        for period in np.flatnonzero(same_as_first[2::2])[:3].tolist():
            period += 1
            if 4 * period > count:
                break
            repeats = pc.equal(pieces.slice(2 * period), pieces.slice(0, 2 * (count - period)))
            if not even_places_true(repeats):
                continue
            encoded = pc.dictionary_encode(
                pieces.slice(0, 2 * period).take(np.arange(0, 2 * period, 2))
            )
            index = np.tile(encoded.indices.to_numpy(), -(-count // period))[:count]
            return index if pick is None else index[pick], encoded.dictionary.to_pylist()
        return None

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
        if not count:  # (a part of a batch with no items)
            return pa.array([], pa.large_binary())
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


def even_places_true(flags: pa.BooleanArray) -> bool:
    """Whether the flags (no nulls) at places 0, 2, 4, ... are all true, read off the bitmap
    (converting the flags to numpy costs several times more)."""
    if not len(flags):
        return True
    bitmap = np.frombuffer(flags.buffers()[1], np.uint8)
    bits = np.unpackbits(bitmap, count=flags.offset + len(flags), bitorder="little")
    return bool(bits[flags.offset :: 2].all())


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


def split_spans(data: bytes, starts: np.ndarray, ends: np.ndarray) -> Items | None:
    """`split` of the regions `data[starts[i]:ends[i]]` (not overlapping), found in place:
    `data` may hold other bytes between them, and the regions need not be in data order."""
    if not len(starts):
        return None
    order = None
    if (starts[1:] < starts[:-1]).any():  # e.g. a record that spanned blocks, put last
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
    found = _bounds(np.frombuffer(data, np.uint8), starts, ends)
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
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """(region of each item, `bounds` of each item) of regions in data order, or None.

    Walks the items of all regions at once (`_item_heads`), then checks every item's shape
    at once: its key part, then its value field, which must end exactly where the item does.
    Each gather reads four bytes: `0a L 12 K` (or `0a L 0a K`) at an item's start, `? 82 01
    V` before its value; a gather past the buffer's end is clipped, and then the check that
    the value ends where the item does fails."""
    found = _item_heads(buf, starts, ends)
    if found is None:
        return None
    row, heads, words = found
    if (words & 0x80FF != 0x0A).any():  # each item is field 1 with a one-byte length
        return None
    item_ends = heads + 2 + ((words >> 8) & 0xFF)
    keys = heads + 2
    # the usual key part: one `key` or `nested_key` field (0a, 12) of a one-byte length
    key_tags = (words >> 16) & 0xFF
    value = keys + 2 + (words >> 24)
    tail = _tails(buf, value)
    usual = (key_tags == 0x0A) | (key_tags == 0x12)
    usual &= (words >> 24) < 0x80
    usual &= (tail >> 8) & 0xFFFF == 0x0182
    if not usual.all():  # several key fields: walk them
        others = np.flatnonzero(~usual)
        after = _after_key_fields(buf, keys[others], item_ends[others])
        if after is None:
            return None
        value[others] = after
        tail[others] = _tails(buf, after)
        if ((tail[others] >> 8) & 0xFFFF != 0x0182).any():
            return None
    value_lengths = tail >> 24
    if (value_lengths >= 0x80).any() or (value + 3 + value_lengths != item_ends).any():
        return None
    bounds = np.empty((5, len(heads)), np.int64)
    bounds[_HEAD] = heads
    bounds[_KEY] = keys
    bounds[_VALUE] = value
    np.add(value, 3, out=bounds[_TEXT])
    bounds[_END] = item_ends
    return row, bounds


def _tails(buf: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The four bytes that end at each `value` + 3: the byte before it, then what should be
    a value field's tag (`82 01`) and one-byte length."""
    words = _words(buf)
    return words[np.clip(value - 1, 0, len(words) - 1)]


def _words(buf: np.ndarray) -> np.ndarray:
    """The little-endian u32 at every byte offset of `buf`, without copying."""
    return np.ndarray((max(len(buf) - 3, 0),), "<u4", buf, 0, (1,))


def _item_heads(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(region, start, first four bytes) of every item (`0a L` + L bytes) of the regions,
    region by region; None unless each region's items chain exactly from its start to its
    end. A step of the walk takes the next item of every region that has one; the items'
    heads are checked by the caller."""
    words_at = _words(buf)
    regions = np.flatnonzero(ends > starts)
    at, end = starts[regions], ends[regions]
    walked: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    while len(regions):
        try:
            words = words_at[at]
        except IndexError:  # an item less than 4 bytes before the end: not one of ours
            return None
        walked.append((regions, at, words))
        at = at + 2 + ((words >> 8) & 0xFF)
        going = at < end
        if not going.all():
            if (at[~going] != end[~going]).any():
                return None
            regions, at, end = regions[going], at[going], end[going]
    if not walked:
        return None
    if all(len(w[0]) == len(starts) for w in walked):  # as many items in every region
        count = len(walked)
        row = np.repeat(np.arange(len(starts)), count)
        return (
            row,
            np.stack([w[1] for w in walked], 1).ravel(),
            np.stack([w[2] for w in walked], 1).ravel(),
        )
    # from step order to region order: item k of region r goes to place firsts[r] + k
    region = np.concatenate([w[0] for w in walked])
    counts = np.bincount(region, minlength=len(starts))
    place = (np.cumsum(counts) - counts)[region]
    place += np.repeat(np.arange(len(walked)), [len(w[0]) for w in walked])
    heads = np.empty(len(place), np.int64)
    heads[place] = np.concatenate([w[1] for w in walked])
    words = np.empty(len(place), np.uint32)
    words[place] = np.concatenate([w[2] for w in walked])
    return np.repeat(np.arange(len(starts)), counts), heads, words


def _after_key_fields(buf: np.ndarray, at: np.ndarray, item_ends: np.ndarray) -> np.ndarray | None:
    """Where each item's key part (one or more fields `0a`/`12` + one-byte length + bytes)
    ends, from its start `at`; None if an item has none, or a length of two bytes."""
    walking = np.ones(len(at), bool)
    first = True
    while True:
        tags = buf.take(at, mode="clip")
        walking &= (at + 2 <= item_ends) & ((tags == 0x0A) | (tags == 0x12))
        if first and not walking.all():
            return None
        if not walking.any():
            return at
        lengths = buf.take(at + 1, mode="clip")
        if (lengths[walking] >= 0x80).any():
            return None
        at = np.where(walking, at + 2 + lengths, at)
        first = False


def join_rows(fields: pa.Array, counts: np.ndarray) -> list[bytes]:
    """The concatenated fields (or pieces) of each row, given how many each row has."""
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    rows = pa.ListArray.from_arrays(pa.array(offsets), fields)
    return pc.binary_join(rows, pa.scalar(b"", fields.type)).to_pylist()


# a JSON number, or the NaN and infinities Python's json module (and so wandb) writes
_JSON_NUMBER = r"^(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|NaN|-?Infinity)$"


def json_numbers(texts: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(float64 where the JSON text is a number, the text where it is not). A number is
    JSON's, or NaN, Infinity or -Infinity as wandb writes them; arrow's cast alone would
    also take `inf`, `+1` or `.5`, and only when every text of the window casts."""
    numeric = pc.match_substring_regex(texts, _JSON_NUMBER)
    if pc.all(numeric).as_py() is not False:  # the usual window: all numbers
        return pc.cast(texts, pa.float64()), pa.nulls(len(texts), pa.string())
    value = pc.cast(pc.if_else(numeric, texts, pa.scalar(None, pa.string())), pa.float64())
    value_json = pc.if_else(numeric, pa.scalar(None, texts.type), texts).cast(pa.string())
    try:
        value_json.validate(full=True)  # cut out of a record's bytes, not decoded yet
    except pa.ArrowInvalid as exc:  # a hostile record: protobuf would refuse it too
        raise UnicodeError(f"a value's JSON text is not valid UTF-8 ({exc})") from None
    return value, value_json


def split_exact(regions: list[bytes]) -> Items:
    """The exact item-by-item split, for rows the batch path refuses (long values)."""
    row_of, keys, values = [], [], []
    for index, region in enumerate(regions):
        for item in wire.region_items(region):
            key, value = wire.split_item(item)
            row_of.append(index)
            keys.append(key)
            values.append(value)
    return Items(
        row=np.array(row_of, np.int64),
        key=pa.array(keys, pa.binary()),
        value=pa.array(values, pa.binary()),
        counts=np.bincount(np.array(row_of, np.int64), minlength=len(regions)),
        texts=pa.array([wire.value_json(v).decode() for v in values], pa.string()),
    )

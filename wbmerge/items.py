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

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import wire

_HEADS = pa.array([b"\x0a" + wire.encode_varint(n) for n in range(1 << 14)], pa.binary())


@dataclass
class Items:
    """The items of a batch of regions, in order: item i belongs to region `row[i]`."""

    row: np.ndarray  # int64, non-decreasing
    key: pa.BinaryArray  # raw key parts
    value: pa.BinaryArray  # value parts: tag, length, JSON
    counts: np.ndarray  # items per region
    texts: pa.StringArray | None = None  # the JSON texts, when not in the one-byte form

    def json(self) -> pa.StringArray:
        """The JSON text of every value."""
        if self.texts is not None:
            return self.texts
        return pc.cast(pc.binary_slice(self.value, 3, 1 << 30), pa.string())  # (no stop: arrow bug)


def split(regions: list[bytes]) -> Items | None:
    """Split item regions (item fields only, nothing else) into items; None if any region is
    not in the one-byte-length form wandb writes for ordinary values (see the module doc)."""
    if not regions:
        return None
    data = b"".join(regions)
    buf = np.frombuffer(data, np.uint8)
    lengths = np.fromiter(map(len, regions), np.int64, len(regions))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    tags = np.flatnonzero((buf[:-1] == 0x82) & (buf[1:] == 0x01))
    if len(tags) == 0 or tags[-1] + 3 > len(buf):
        return None
    value_lengths = buf[tags + 2].astype(np.int64)
    value_ends = tags + 3 + value_lengths
    row = np.searchsorted(ends, tags, side="right")
    if row[-1] >= len(regions):
        return None
    item_starts = np.empty_like(tags)
    item_starts[0] = 0
    item_starts[1:] = value_ends[:-1]
    first = np.ones(len(tags), bool)
    first[1:] = row[1:] != row[:-1]
    counts = np.bincount(row, minlength=len(regions))
    filled = counts > 0
    last = (np.cumsum(counts) - 1)[filled]
    if (
        (value_lengths >= 0x80).any()
        or (lengths[~filled] != 0).any()
        # each region's first item starts at its start, each other at the previous end
        or (item_starts[first] != starts[row[first]]).any()
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
        or not np.isin(buf[item_starts + 2], (0x0A, 0x12)).all()
    ):
        return None
    # The buffer is tiled by (head, key part, value part) of consecutive items.
    offsets = np.empty(3 * len(tags) + 1, np.int64)
    offsets[0:-1:3] = item_starts
    offsets[1:-1:3] = item_starts + 2
    offsets[2:-1:3] = tags
    offsets[-1] = len(buf)
    pieces = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), 3 * len(tags), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    index = np.arange(len(tags), dtype=np.int64) * 3
    return Items(
        row=row,
        key=pieces.take(index + 1).cast(pa.binary()),
        value=pieces.take(index + 2).cast(pa.binary()),
        counts=counts,
    )


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

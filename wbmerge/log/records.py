"""What each record of a read is, worked out for all of a read's records at once.

`txlog.iter_frames` gives the records of a read as offsets into one buffer; here numpy
finds each record's kind and, for history records, its step and item fields, from the
bytes wandb writes (`num` first, then the one record field; a history record's step field
last, which counts as one only when the items before it end exactly where it starts: a
record without a step field, as wandb 0.16 writes them, may end in a value whose last bytes
look like one). A record in any other shape is handled by the exact one-record functions
(`record_kind`, `wire.history_region`), so the result is always what protobuf says.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import BinaryIO

import numpy as np
from google.protobuf.message import DecodeError

from . import wire
from .proto import pb
from .twins import twins
from .txlog import Frames, ReadReport, iter_payloads, read_frames, read_payloads
from .wire import skip_field, varint


def prove_nothing(data: bytes, starts: Sized, ends: Sized) -> tuple[bytearray, bytearray]:
    """The compiled proof's Python twin: it proves no record, so the caller parses each with
    protobuf, which decides. The contract of `proven_history` allows that: the answers stay
    the same, only slower."""
    return bytearray(len(starts)), bytearray(8 * len(starts))


# The proofs `proven_history` can use, by name: "python" always, "compiled" when built.
PROOFS, DEFAULT_PROOF = twins(prove_nothing, "_records", "proven")

# Field number of each member of Record's `record_type` oneof, and back.
RECORD_KINDS: dict[int, str] = {
    f.number: f.name for f in pb.Record.DESCRIPTOR.oneofs_by_name["record_type"].fields
}
# one-byte tags (fields 1-15, length-delimited) of the record kinds, for the common case
_KIND_BY_TAG_BYTE: list[str | None] = [
    RECORD_KINDS.get(byte >> 3) if byte & 7 == 2 else None for byte in range(128)
]

KIND_NAMES: list[str | None] = [None, *sorted(set(RECORD_KINDS.values()))]
_CODE = {name: code for code, name in enumerate(KIND_NAMES)}
# the kind code of each one-byte tag (fields 1-15, length-delimited); 0: not a kind
_CODE_BY_TAG = np.zeros(256, np.uint8)
for _tag in range(0x80):  # a byte with the top bit set is not a whole tag
    if _tag & 7 == 2 and _tag >> 3 in RECORD_KINDS:
        _CODE_BY_TAG[_tag] = _CODE[RECORD_KINDS[_tag >> 3]]


def record_kind(payload: bytes) -> str | None:
    """The `record_type` of a serialized Record, found by walking its top-level tags only.

    Lets pass-through code route records without parsing them (about 10x cheaper).
    """
    pos, end = 0, len(payload)
    if end > 2 and payload[0] == 0x08:  # `num` comes first in what wandb writes
        pos = 1
        while payload[pos] & 0x80:  # a cut varint raises IndexError: not a record
            pos += 1
        pos += 1
        if pos < end and payload[pos] < 0x80:
            kind = _KIND_BY_TAG_BYTE[payload[pos]]
            if kind is not None:
                return kind
    while pos < end:
        tag, pos = varint(payload, pos)
        field = tag >> 3
        if field in RECORD_KINDS:
            return RECORD_KINDS[field]
        try:
            pos = skip_field(payload, pos, tag & 7)
        except ValueError:
            return None
    return None


def iter_records(stream: BinaryIO, report: ReadReport | None = None) -> Iterator[pb.Record]:
    """Yield every readable record of `stream` as a parsed `Record`."""
    for payload in iter_payloads(stream, report):
        record = pb.Record()
        record.ParseFromString(payload)
        yield record


def read_records(path: str | Path, report: ReadReport | None = None) -> Iterator[pb.Record]:
    """`iter_records` over a file path."""
    with open(path, "rb") as stream:
        yield from iter_records(stream, report)


def code(kind: str) -> int:
    """The code `kinds` gives records of `kind`."""
    return _CODE[kind]


def kinds(frames: Frames) -> np.ndarray:
    """The kind code of every record of `frames` (uint8; `KIND_NAMES[code]` is its name)."""
    data = np.frombuffer(frames.data, np.uint8)
    starts, ends = frames.starts, frames.ends
    tag_at = _after_num(data, starts, ends)
    codes = np.zeros(len(starts), np.uint8)
    ok = tag_at < ends
    codes[ok] = _CODE_BY_TAG[data[tag_at[ok]]]
    for index in np.flatnonzero(codes == 0).tolist():  # not in the usual shape: the walk
        codes[index] = _CODE[record_kind(frames.payload(index))]
    return codes


@dataclass
class HistoryRows:
    """History records of a read: row i logs the item fields `data[starts[i]:ends[i]]` at
    `steps[i]` (as written: not yet continued across restarts)."""

    data: bytes
    steps: np.ndarray  # int64
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    # The rows in another shape than wandb's, decoded by protobuf: their items are appended
    # after the read's buffer, and their step is the step field, else the last `_step` item.
    decoded: np.ndarray  # int64 row indices
    # Whether every row's items lie in the read's own buffer (no decoded row has items).
    in_place: bool

    def __len__(self) -> int:
        return len(self.steps)


class RecordIndex:
    """One read's records, indexed once: each record's kind and, when first asked, the
    steps and item spans of its history records and the item spans of its summaries.

    Every reader of records (the merge, export and report, discovery, the upload's
    counts, the follower's cut) asks a read's questions here, so a read is classified
    once and in one way. Example: `index.of("history")` are the indices of the history
    records, `index.rows.steps[i]` the step of the i-th of them.
    """

    def __init__(self, frames: Frames) -> None:
        self.frames = frames
        self.codes = kinds(frames)  # uint8; KIND_NAMES[code] is the kind's name

    def __len__(self) -> int:
        return len(self.codes)

    def of(self, *names: str) -> np.ndarray:
        """The indices of the records of the kinds `names`, in order."""
        if len(names) == 1:
            return np.flatnonzero(self.codes == _CODE[names[0]])
        return np.flatnonzero(np.isin(self.codes, [_CODE[name] for name in names]))

    def kind(self, index: int) -> str | None:
        """The kind of record `index` (None: not a Record, or of no kind wbmerge knows)."""
        return KIND_NAMES[self.codes[index]]

    @cached_property
    def history(self) -> np.ndarray:
        """The indices of the history records."""
        return self.of("history")

    @cached_property
    def rows(self) -> HistoryRows:
        """The steps and item fields of the history records, in their order."""
        return history_rows(self.frames, self.history)

    @cached_property
    def summaries(self) -> np.ndarray:
        """The indices of the summary records."""
        return self.of("summary")

    @cached_property
    def summary_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) of each summary's items in the buffer; (-1, -1) for one written in
        another shape than wandb's (`body_spans`)."""
        return summary_spans(self.frames, self.summaries)


@dataclass(frozen=True)
class ProvenHistory:
    """What one compiled pass (`wbmerge/log/_records.c`) proves of history records.

    `proven[i]`: record i is certainly a history record protobuf parses, in the shape wandb
    writes them (`num`, then `history` of items and a step; every key and value valid
    UTF-8). Where False, that record's validity is for protobuf to decide.

    `step_known[i]`: record i is proven, and the `_step` wandb-core reads from its items is
    known: `steps[i]` where `has_step[i]`, else none (`sentrows.item_step` says what it is
    elsewhere, and is the reference for this).
    """

    proven: np.ndarray  # bool
    step_known: np.ndarray  # bool
    has_step: np.ndarray  # bool
    steps: np.ndarray  # int64


# The outcomes of `_records.proven` (see its C; its Python twin gives 0 for every record).
_PROVEN_NO_STEP, _PROVEN_STEP = 1, 2


def proven_history(frames: Frames, which: np.ndarray, proof: str = DEFAULT_PROOF) -> ProvenHistory:
    """Prove the records `which` valid history records and read their `_step` items, in one
    compiled pass (`ProvenHistory`). `history_rows` reads where a record's fields are, not
    whether they are valid; this is the proof for a reader that trusts its rows."""
    starts = np.ascontiguousarray(frames.starts[which], np.int64)
    ends = np.ascontiguousarray(frames.ends[which], np.int64)
    outcomes, steps = PROOFS[proof](frames.data, starts, ends)
    outcome = np.frombuffer(outcomes, np.uint8)
    has_step = outcome == _PROVEN_STEP
    return ProvenHistory(
        proven=outcome > 0,
        step_known=has_step | (outcome == _PROVEN_NO_STEP),
        has_step=has_step,
        steps=np.frombuffer(steps, np.int64),
    )


def read_indexed(
    path: str | Path, report: ReadReport | None = None, **read
) -> Iterator[RecordIndex]:
    """The `RecordIndex` of each read of the log at `path` (`txlog.read_frames`, which
    takes the `read_size`)."""
    for frames in read_frames(path, report, **read):
        yield RecordIndex(frames)


# The one-byte tags of Record's `history` and `summary` fields.
_HISTORY_TAG, _SUMMARY_TAG = 0x12, 0x1A


def body_spans(frames: Frames, which: np.ndarray, tag: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the record field (a one-byte `tag`) of each record `which`, where it
    is the record's last field, as wandb writes it; (-1, -1) where not."""
    data = np.frombuffer(frames.data, np.uint8)
    record_ends = frames.ends[which]
    tag_at = _after_num(data, frames.starts[which], record_ends)
    starts, ends = _span(data, tag_at + 1, record_ends)
    ok = (ends == record_ends) & (_at(data, tag_at) == tag)
    return np.where(ok, starts, -1), np.where(ok, ends, -1)


def summary_spans(frames: Frames, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the items of each summary record `which`; (-1, -1) where the record
    is not in wandb's shape (`body_spans`)."""
    return body_spans(frames, which, _SUMMARY_TAG)


def history_rows(frames: Frames, which: np.ndarray) -> HistoryRows:
    """The step and item fields of the history records `which` (indices into `frames`)."""
    data = np.frombuffer(frames.data, np.uint8)
    starts, ends = body_spans(frames, which, _HISTORY_TAG)
    steps = np.zeros(len(which), np.int64)
    fields_end = np.full(len(which), -1, np.int64)
    ok = ends - starts >= 2
    ends = np.where(ok, ends, 2)  # (keeps the reads below in bounds)
    empty = ok & (data[ends - 2] == 0x12) & (data[ends - 1] == 0)
    fields_end[empty] = ends[empty] - 2  # `step {}`: step 0
    for size in range(1, 11):  # `step { num: a varint of size bytes }` ends the record
        field = ends - size - 3
        fits = ok & (fields_end < 0) & (field >= starts)
        if not fits.any():
            break
        at = np.where(fits, field, 0)
        fits &= (data[at] == 0x12) & (data[at + 1] == size + 1) & (data[at + 2] == 0x08)
        number = np.zeros(len(which), np.int64)
        for byte in range(size):
            value = _at(data, at + 3 + byte).astype(np.int64)
            last = byte == size - 1
            fits &= (value < 0x80) if last else (value >= 0x80)
            number |= (value & 0x7F) << (7 * byte)
        fields_end[fits] = field[fits]
        steps[fits] = number[fits]
    # What looks like a step field at the end is one only if the items before it end exactly
    # there: else its bytes are inside the last item (a record without a step field, as
    # wandb 0.16 writes them, whose last value happens to end so) and protobuf decides.
    found = np.flatnonzero(fields_end > starts)
    fields_end[found[~_items_end_at(data, starts[found], fields_end[found])]] = -1
    odd = np.flatnonzero(fields_end < 0)
    buffer = frames.data
    if len(odd):  # another shape: protobuf says (its item fields go after the buffer)
        extra = []
        offset = len(buffer)
        for index in odd.tolist():
            record = which[index]
            payload = buffer[frames.starts[record] : frames.ends[record]]
            steps[index], region = wire.history_region(payload)
            starts[index], fields_end[index] = offset, offset + len(region)
            offset += len(region)
            extra.append(region)
        buffer = b"".join([buffer, *extra])
    in_place = len(buffer) == len(frames.data)
    return HistoryRows(buffer, steps, starts, fields_end, decoded=odd, in_place=in_place)


def _items_end_at(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Whether each `data[starts[i]:ends[i]]` is item fields only (`0a`, a length, that many
    bytes), the last ending exactly at `ends[i]`: walked one item of every region a step, as
    protobuf would read them, regions dropping out as they end. Lengths of up to 3 bytes
    (items under 2 MiB) are walked; a longer one is not (False: the caller asks protobuf)."""
    ok = np.zeros(len(starts), bool)
    heads = np.ndarray((max(len(data) - 1, 0),), "<u2", data, 0, (1,))  # tag | length << 8
    live, at, end = np.arange(len(starts)), starts, ends
    while len(live):
        try:
            word = heads[at].astype(np.int64)
        except IndexError:  # an item's start on the buffer's last byte: not an item
            word = heads[np.minimum(at, len(heads) - 1)].astype(np.int64)
            word[at >= len(heads)] = 0
        after = at + 2 + (word >> 8)
        tagged = word & 0xFF == 0x0A
        long = np.flatnonzero(word >= 0x8000)  # a length of more than one byte
        if len(long):
            after[long], tagged[long] = _long_item_ends(data, at[long], tagged[long])
        stop = ~tagged | (after >= end)
        if stop.any():
            ok[live[stop]] = tagged[stop] & (after[stop] == end[stop])
            go = ~stop
            live, after, end = live[go], after[go], end[go]
        at = after
    return ok


def _long_item_ends(
    data: np.ndarray, at: np.ndarray, tagged: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(end, still an item) of items at `at` whose length takes 2 or 3 bytes."""
    first = _at(data, at + 1).astype(np.int64) & 0x7F
    second = _at(data, at + 2).astype(np.int64)
    third = _at(data, at + 3).astype(np.int64)
    three = second >= 0x80
    length = first | (second & 0x7F) << 7 | np.where(three, third << 14, 0)
    tagged = tagged & ~(three & (third >= 0x80))
    return at + np.where(three, 4, 3) + length, tagged


def _at(data: np.ndarray, index: np.ndarray) -> np.ndarray:
    """`data[index]`, with indices past the end read as the last byte (callers check bounds
    themselves: this only keeps a damaged length from raising)."""
    return data[np.minimum(index, len(data) - 1)]


def _after_num(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Where the first field after a leading `num` varint starts (the record's start when
    it has no `num`); `ends` where that runs past the record."""
    has_num = (ends - starts > 1) & (_at(data, starts) == 0x08)
    at = np.where(has_num, starts + 1, starts)
    for _ in range(10):
        more = has_num & (at < ends) & (_at(data, at) >= 0x80)
        if not more.any():
            break
        at = at + more
    at = np.where(has_num, at + 1, at)
    return np.minimum(at, ends)


def _span(data: np.ndarray, at: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the length-delimited value whose length varint is at `at`; a value
    whose varint does not end within 3 bytes gets an empty span at -1 (the caller's odd)."""
    length = np.zeros(len(at), np.int64)
    start = np.full(len(at), -1, np.int64)
    pending = at < ends
    for byte in range(3):
        value = _at(data, at + byte).astype(np.int64)
        length |= np.where(pending, value & 0x7F, 0) << (7 * byte)
        done = pending & (value < 0x80)
        start[done] = at[done] + byte + 1
        pending &= ~done
    length[start < 0] = 0
    return start, np.where(start < 0, -1, start + length)


def find_invalid_record(path: str | Path) -> int | None:
    """The index of the first record with a valid checksum that is not a valid `Record`
    (protobuf), or None. Parses every record: for naming a hostile file after a failure,
    not for every read."""
    for index, payload in enumerate(read_payloads(path)):
        try:
            pb.Record.FromString(payload)
        except DecodeError:
            return index
    return None

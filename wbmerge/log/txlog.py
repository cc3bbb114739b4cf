"""Reading and writing W&B's `.wandb` transaction log, byte for byte as wandb-core frames it.

The file is a 7-byte header followed by LevelDB-style 32 KiB blocks of chunks
(`crc32 | length | type | payload`), each payload a serialized `Record` protobuf. This module is the framing only: it
never looks inside a payload (`records` says what a payload is).
The reader is a pure streaming function of bytes: it never holds more than one read
buffer, verifies every chunk's CRC, and tolerates the damage real runs show (a rank
killed mid-write, a corrupt block), reporting what it could not read in a `ReadReport`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..errors import NotATransactionLog
from . import purewalk
from .twins import twins

# The block walks `walk_segments` can use, by name: "python" always, "compiled" when built.
WALKS, DEFAULT_WALK = twins(purewalk.walk, "_walk", "walk")

FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK_SIZE = 32 * 1024
CHUNK_HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

try:  # the same CRC-32 as zlib's, several times faster (ISA-L); zlib's where it is missing
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; this is for odd platforms
    from zlib import crc32

_CHUNK_HEADER = struct.Struct("<IHB")
# A chunk's CRC covers its type byte and payload. Readers take it over the two as they lie
# (the type is the header's last byte); writers start from the type's CRC instead:
# crc32(bytes([type]) + payload) == crc32(payload, _TYPE_CRC[type]).
_TYPE_CRC = [crc32(bytes([t])) for t in range(5)]
_TYPE_AT = CHUNK_HEADER_SIZE - 1  # where a chunk's type byte is in it
_EMPTY_MIDDLE = _CHUNK_HEADER.pack(_TYPE_CRC[MIDDLE], 0, MIDDLE)
_READ_SIZE = 32 * BLOCK_SIZE  # 1 MiB per read call by default; always whole blocks


@dataclass
class ReadReport:
    """What a read saw besides the records: where the file was damaged, and how much."""

    records: int = 0
    bytes_read: int = 0
    truncated: bool = False
    truncated_bytes: int = 0
    dropped_records: int = 0
    dropped_bytes: int = 0

    @property
    def damaged(self) -> bool:
        return self.truncated or self.dropped_bytes > 0

    def describe(self) -> str:
        """A short human summary, empty for an intact file."""
        parts = []
        if self.truncated and self.truncated_bytes:
            parts.append(f"truncated ({self.truncated_bytes} B tail)")
        elif self.truncated:  # whole records, then nothing: its writer stopped, or goes on
            parts.append("no exit record (killed, or still writing)")
        if self.dropped_bytes:
            parts.append(
                f"corrupt: {self.dropped_records} records / {self.dropped_bytes} B dropped"
            )
        return ", ".join(parts)


@dataclass
class Frames:
    """The records of one read call: record i is `data[starts[i]:ends[i]]`.

    Whole-chunk records are not copied out of the read buffer; batch code (`records`,
    `items`) works on the offsets, so reading costs no Python object per record.
    """

    data: bytes
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.starts)

    def payload(self, index: int) -> bytes:
        return self.data[self.starts[index] : self.ends[index]]

    def payloads(self) -> Iterator[bytes]:
        data = self.data
        for start, end in zip(self.starts.tolist(), self.ends.tolist(), strict=True):
            yield data[start:end]


def iter_payloads(stream: BinaryIO, report: ReadReport | None = None) -> Iterator[bytes]:
    """Yield the raw payload of every complete, CRC-valid record in `stream`, in order."""
    for frames in iter_frames(stream, report):
        yield from frames.payloads()


def iter_frames(
    stream: BinaryIO,
    report: ReadReport | None = None,
    read_size: int = _READ_SIZE,
    walk: bool = True,
) -> Iterator[Frames]:
    """Yield every complete, CRC-valid record in `stream`, in order, a read call at a time.

    A corrupt chunk makes the reader skip to the next block (LevelDB semantics), dropping
    the records it interrupts; a tail that ends mid-record is reported as truncated.
    Raises `NotATransactionLog` when the stream does not start with the W&B header.
    `walk=False`: the chunk-by-chunk loop alone, the reference the walk is tested against.
    """
    if read_size <= 0 or read_size % BLOCK_SIZE:
        raise ValueError(f"read_size must be a positive multiple of {BLOCK_SIZE}")
    report = report if report is not None else ReadReport()
    buf = stream.read(len(FILE_HEADER))
    report.bytes_read = len(buf)
    if buf != FILE_HEADER[: len(buf)]:
        raise NotATransactionLog("not a W&B transaction log (bad file header)")
    if len(buf) < len(FILE_HEADER):  # killed before the header was written out
        report.truncated, report.truncated_bytes = True, len(buf)
        return

    pos = len(buf)  # read position; buf always starts on a block boundary
    partial: list[bytes] = []  # fragments of a record that spans blocks
    orphans = False  # skipping MIDDLE/LAST chunks of a record already dropped
    eof = False
    unpack = _CHUNK_HEADER.unpack_from  # hot loop
    while not eof:
        # reads end on block boundaries (the first is short by the header), so the walk
        # uses up a read and the next one needs no bytes carried over
        asked = read_size - len(buf) % BLOCK_SIZE if pos == len(buf) else read_size
        more = stream.read(asked)
        eof = not more
        if more:
            cut = pos - pos % BLOCK_SIZE
            buf = buf[cut:] + more
            pos -= cut
            report.bytes_read += len(more)
        end = len(buf)
        view = memoryview(buf)
        starts: list[int] = []  # of the records in this read, in order
        ends: list[int] = []
        joined: list[bytes] = []  # records that spanned blocks, placed after `buf`
        joined_at = end
        whole = end - end % BLOCK_SIZE  # the blocks all here: walked in one compiled pass
        walked = None
        if walk and whole > pos:
            walked = walk_segments(buf, [pos], [whole], [partial])
            walked = walked if walked.ok[0] else None  # damage: the loop below accounts for it
        if walked is not None:
            pos, partial, orphans = whole, walked.partials[0], False
            joined = [walked.joined] if walked.joined else []
            joined_at += len(walked.joined)
        ended = 0 < len(more) < asked and pos < end and end % BLOCK_SIZE  # (after `more`)
        if walk and ended and (walked is not None or whole <= pos):
            # the log's last block, short of a whole one: walked too when its chunks fill
            # it exactly (else the loop reads it, and says what is cut off); a thousand
            # small logs each end in one
            tail = walk_segments(buf, [pos], [end], [partial], [True])
            if tail.ok[0]:
                at_joined = np.where(tail.starts >= end, joined_at - end, 0)
                fast = [tail.starts + at_joined, tail.ends + at_joined]
                if walked is not None:
                    fast = [
                        np.concatenate([walked.starts, fast[0]]),
                        np.concatenate([walked.ends, fast[1]]),
                    ]
                walked = Walked(b"", fast[0], fast[1], tail.counts, tail.ok, [])
                joined += [tail.joined] if tail.joined else []
                joined_at += len(tail.joined)
                pos, partial, orphans = end, [], False
        while True:
            block_end = pos - pos % BLOCK_SIZE + BLOCK_SIZE
            if block_end - pos < CHUNK_HEADER_SIZE:
                if block_end > end:  # the block's trailer, not all here yet
                    break
                pos = block_end
                continue
            if pos + CHUNK_HEADER_SIZE > end:
                break
            crc, length, kind = unpack(buf, pos)
            if not (crc or length or kind):  # zero fill: the rest of the block is padding
                if block_end > end:
                    break
                pos = block_end
                continue
            chunk_end = pos + CHUNK_HEADER_SIZE + length
            sane = FULL <= kind <= LAST and chunk_end <= block_end
            if sane and chunk_end > end:
                break  # more bytes to come, or a truncated tail
            if not sane or crc32(view[pos + _TYPE_AT : chunk_end]) != crc:
                if block_end > end and not eof:
                    break  # count the loss once the whole block is here
                stop = min(block_end, end)
                report.dropped_bytes += stop - pos
                # the chunk's record; and the one it was continuing, unless it is that one
                continues = partial and sane and kind in (MIDDLE, LAST)
                report.dropped_records += 1 + (1 if partial and not continues else 0)
                if sane:
                    report.dropped_records += _count_chunks_after(buf, chunk_end, stop)
                partial, orphans = [], True
                pos = stop
                if pos == end:
                    break
                continue
            if kind == FULL or kind == FIRST:
                if partial:  # a FIRST whose LAST never came
                    report.dropped_records += 1
                    report.dropped_bytes += sum(map(len, partial))
                orphans = False
                if kind == FULL:
                    partial = []
                    starts.append(pos + CHUNK_HEADER_SIZE)
                    ends.append(chunk_end)
                else:
                    partial = [buf[pos + CHUNK_HEADER_SIZE : chunk_end]]
            elif partial:
                partial.append(buf[pos + CHUNK_HEADER_SIZE : chunk_end])
                if kind == LAST:
                    record, partial = b"".join(partial), []
                    starts.append(joined_at)
                    joined_at += len(record)
                    ends.append(joined_at)
                    joined.append(record)
            else:  # MIDDLE/LAST whose FIRST was lost
                report.dropped_bytes += CHUNK_HEADER_SIZE + length
                if not orphans:
                    report.dropped_records += 1
                orphans = kind == MIDDLE
            pos = chunk_end
        view.release()
        fast = [walked.starts, walked.ends] if walked is not None else [np.empty(0, np.int64)] * 2
        starts_array = np.concatenate([fast[0], np.array(starts, np.int64)])
        ends_array = np.concatenate([fast[1], np.array(ends, np.int64)])
        if len(starts_array):
            report.records += len(starts_array)
            yield Frames(b"".join([buf, *joined]) if joined else buf, starts_array, ends_array)
    tail = len(buf) - pos
    if partial or tail > 0:
        report.truncated = True
        report.truncated_bytes = tail + sum(map(len, partial))


@dataclass
class Walked:
    """What `walk_segments` found: record i is `(buf + joined)[starts[i]:ends[i]]`."""

    joined: bytes  # the records that spanned blocks, back to back (the rest are in `buf`)
    starts: np.ndarray  # int64, each segment's records together, in order
    ends: np.ndarray
    counts: np.ndarray  # how many records each segment has (none for one not intact)
    ok: np.ndarray  # bool: whether each segment is intact
    partials: list[list[bytes]]  # each intact segment's record that goes on past its end


def walk_segments(
    buf: bytes,
    starts: Sequence[int],
    ends: Sequence[int],
    partials: Sequence[list[bytes]],
    ended: Sequence[bool] | None = None,
    walk: str = DEFAULT_WALK,
) -> Walked:
    """The records of segments of logs laid out in `buf`, all their blocks walked in one
    compiled pass (`wbmerge/log/_walk.c`).

    Segment i is `buf[starts[i]:ends[i]]`, a log's chunks from `starts[i]` (after the file
    header, or where an earlier read stopped) on; `partials[i]`, the record that read left
    open. `buf`'s blocks are the logs' blocks; segments are in order and share no block; one
    ends on a block boundary unless `ended[i]` (it ends its log: a last chunk cut short or
    a record left open is damage). A segment with an impossible chunk, a bad CRC or a broken
    FIRST..LAST order is not `ok` and has no records: its caller's loop reads it, and
    accounts for the damage (as `iter_frames` does). The chunk loop of `iter_frames`
    (`walk=False`) is the reference this is tested against. `walk` names the block walk
    (`WALKS`): the compiled one where it is built, else its Python twin.
    """
    count = len(partials)
    flags = bytes(count) if ended is None else np.asarray(ended, bool).tobytes()
    joined, record_starts, record_ends, counts, ok, open_records = WALKS[walk](
        buf,
        np.asarray(starts, np.int64).tobytes(),
        np.asarray(ends, np.int64).tobytes(),
        flags,
        [list(partial) for partial in partials],
    )
    return Walked(
        joined,
        np.frombuffer(record_starts, np.int64),
        np.frombuffer(record_ends, np.int64),
        np.frombuffer(counts, np.int64),
        np.frombuffer(ok, np.bool_),
        open_records,
    )


def read_head(stream: BinaryIO, blocks: int) -> tuple[list[bytes], bytes | None] | None:
    """The first `blocks` blocks of a log: their records, and the start of the record that
    goes on into the next block (None if none does). None if the log is shorter or those
    blocks are damaged. With `LogWriter.end_block` and `copy_blocks`, a log's head can be
    rewritten and the rest copied as it is."""
    stream.seek(0)
    data = stream.read(blocks * BLOCK_SIZE)
    whole = len(data) == blocks * BLOCK_SIZE and data.startswith(FILE_HEADER)
    walked = walk_segments(data, [len(FILE_HEADER)], [len(data)], [[]]) if whole else None
    if walked is None or not walked.ok[0]:
        return None
    frames = Frames(data + walked.joined, walked.starts, walked.ends)
    partial = walked.partials[0]
    return list(frames.payloads()), b"".join(partial) if partial else None


def read_tail(stream: BinaryIO, blocks: int = 1) -> list[bytes]:
    """The payloads of the whole, CRC-valid records that start in the last `blocks` blocks.

    Reading the end of a log alone tells what a run did last (its exit record, its latest
    timestamps) without reading all of it. A record that began in an earlier block is
    skipped; a chunk that fails its CRC ends the walk of its block.
    """
    size = stream.seek(0, os.SEEK_END)
    if size <= len(FILE_HEADER):
        return []
    start = max(0, ((size - 1) // BLOCK_SIZE - (blocks - 1)) * BLOCK_SIZE)
    stream.seek(start)
    data = stream.read(size - start)
    payloads: list[bytes] = []
    partial: list[bytes] | None = None
    for block_start in range(0, len(data), BLOCK_SIZE):
        pos = block_start + (len(FILE_HEADER) if start + block_start == 0 else 0)
        end = min(block_start + BLOCK_SIZE, len(data))
        while end - pos >= CHUNK_HEADER_SIZE:
            checksum, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
            body = pos + CHUNK_HEADER_SIZE
            if (checksum, length, kind) == (0, 0, 0) or body + length > end:
                break
            if crc32(data[pos + _TYPE_AT : body + length]) != checksum:
                partial = None
                break
            piece = data[body : body + length]
            if kind == FULL:
                payloads.append(piece)
            elif kind == FIRST:
                partial = [piece]
            elif partial is not None and kind == MIDDLE:
                partial.append(piece)
            elif partial is not None and kind == LAST:
                payloads.append(b"".join([*partial, piece]))
                partial = None
            pos = body + length
    return payloads


def _count_chunks_after(block: bytes, pos: int, limit: int) -> int:
    """How many whole, CRC-valid chunks follow `pos` in a block that is being dropped.

    Only used to tell the user how many records a corrupt block cost; a count, not data.
    """
    count = 0
    while pos + CHUNK_HEADER_SIZE <= limit:
        crc, length, kind = _CHUNK_HEADER.unpack_from(block, pos)
        end = pos + CHUNK_HEADER_SIZE + length
        if not (FULL <= kind <= LAST) or end > limit:
            break
        if crc32(block[pos + _TYPE_AT : end]) != crc:
            break
        if kind in (FULL, FIRST):
            count += 1
        pos = end
    return count


class LogWriter:
    """Writes records framed exactly as wandb-core does, buffering whole blocks."""

    def __init__(self, stream: BinaryIO, flush_every: int = 1 << 20) -> None:
        self._stream = stream
        self._buffer = bytearray(FILE_HEADER)
        self._block_offset = len(FILE_HEADER)
        self._flush_every = flush_every
        self.records = 0

    def write(self, payload: bytes) -> None:
        """Append one record's serialized bytes, split across blocks when needed."""
        self._frame(memoryview(payload))
        self.records += 1
        if len(self._buffer) >= self._flush_every:
            self.flush()

    def write_many(self, data: bytes, starts: list[int], ends: list[int]) -> None:
        """Append the records `data[starts[i]:ends[i]]` in turn, as `write` of each would;
        the common case (a record that fits in its block) in one tight loop."""
        buffer = self._buffer
        offset = self._block_offset
        view = memoryview(data)
        pack, full_crc = _CHUNK_HEADER.pack, _TYPE_CRC[FULL]
        for start, end in zip(starts, ends, strict=True):
            length = end - start
            piece = view[start:end]
            if offset + CHUNK_HEADER_SIZE + length > BLOCK_SIZE:
                self._block_offset = offset
                self._frame(piece)
                offset = self._block_offset
                continue
            buffer += pack(crc32(piece, full_crc), length, FULL)
            buffer += piece
            offset += CHUNK_HEADER_SIZE + length
        view.release()
        self._block_offset = offset
        self.records += len(starts)
        if len(buffer) >= self._flush_every:
            self.flush()

    def _frame(self, view: memoryview, open_ended: bool = False) -> None:
        """Append one record as chunks, split across blocks when needed; `open_ended`: its
        last chunk is FIRST/MIDDLE, for a record that more chunks will finish."""
        buffer = self._buffer
        offset = self._block_offset
        remaining = len(view)
        start = 0
        first = True
        while True:
            room = BLOCK_SIZE - offset
            if room < CHUNK_HEADER_SIZE:
                buffer += bytes(room)
                offset = 0
                room = BLOCK_SIZE
            take = min(remaining, room - CHUNK_HEADER_SIZE)
            last = take == remaining
            closes = last and not open_ended
            kind = (FULL if closes else FIRST) if first else (LAST if closes else MIDDLE)
            piece = view[start : start + take]
            buffer += _CHUNK_HEADER.pack(crc32(piece, _TYPE_CRC[kind]), take, kind)
            buffer += piece
            offset += CHUNK_HEADER_SIZE + take
            start += take
            remaining -= take
            first = False
            if last:
                break
        self._block_offset = offset

    def end_block(self, open_record: bytes | None = None) -> None:
        """End the current block, so that what follows starts a block (see `copy_blocks`).

        Without `open_record` the rest of the block is zeros: readers (wandb-core's, wandb
        leet's, ours) take an all-zero chunk header as the end of a block's records, as
        LevelDB's do. `open_record` is the start of a record whose remaining chunks follow
        (copied from another log): it is written as FIRST/MIDDLE chunks, and the block is
        filled with empty MIDDLE chunks, so the record goes on in the next block.
        """
        if open_record is not None:
            self._frame(memoryview(open_record), open_ended=True)
            room = BLOCK_SIZE - self._block_offset
            self._buffer += _EMPTY_MIDDLE * (room // CHUNK_HEADER_SIZE)
            self._block_offset = BLOCK_SIZE - room % CHUNK_HEADER_SIZE
        if 0 < self._block_offset < BLOCK_SIZE:
            self._buffer += bytes(BLOCK_SIZE - self._block_offset)
        self._block_offset = 0

    def copy_blocks(self, source: BinaryIO, start: int, end: int, records: int) -> None:
        """Append another log's bytes `start:end` as they are, `start` a block boundary: its
        chunks stay valid at the same places in our blocks. Call on a block boundary
        (`end_block`, which can begin a record these bytes finish); `records` is how many
        records the bytes hold (finish)."""
        if self._block_offset % BLOCK_SIZE or start % BLOCK_SIZE:
            raise ValueError("copy_blocks goes from a block boundary to a block boundary")
        self.flush()
        _copy_range(source, self._stream, start, end)
        self._block_offset = (end - start) % BLOCK_SIZE
        self.records += records

    def flush(self) -> None:
        if self._buffer:
            self._stream.write(self._buffer)
            self._buffer = bytearray()
        self._stream.flush()

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_range(source: BinaryIO, target: BinaryIO, start: int, end: int) -> None:
    """Copy source[start:end] to target's position, in the kernel where it can."""
    done = start
    try:
        while done < end:
            copied = os.copy_file_range(source.fileno(), target.fileno(), end - done, done)
            if not copied:
                break
            done += copied
    except (AttributeError, OSError):  # no copy_file_range here, or not between these files
        pass
    if done < end:
        source.seek(done)
        while done < end:
            piece = source.read(min(1 << 22, end - done))
            if not piece:
                raise OSError(f"{source.name}: shorter than it was ({done} of {end} bytes)")
            target.write(piece)
            done += len(piece)
        target.flush()


def read_frames(
    path: str | Path, report: ReadReport | None = None, read_size: int = _READ_SIZE
) -> Iterator[Frames]:
    """`iter_frames` over a file path, closing the file when the iteration ends."""
    with open(path, "rb") as stream:
        yield from iter_frames(stream, report, read_size)


def read_payloads(path: str | Path, report: ReadReport | None = None) -> Iterator[bytes]:
    """`iter_payloads` over a file path, closing the file when the iteration ends."""
    with open(path, "rb") as stream:
        yield from iter_payloads(stream, report)


def write_payloads(path: str | Path, payloads: Iterable[bytes]) -> int:
    """Write a whole transaction log; returns the number of records written."""
    with open(path, "wb") as stream, LogWriter(stream) as writer:
        for payload in payloads:
            writer.write(payload)
        return writer.records

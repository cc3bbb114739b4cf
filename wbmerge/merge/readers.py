"""Many ranks' logs read side by side, a few blocks of each at a time, for the shared merge.

`txlog.iter_frames` walks the blocks of one read of one log as arrays; its cost is per read,
so a job of a thousand short ranks read a block or two at a time would pay it a thousand
times per step window. Here one call reads the next blocks of every rank asked for and walks
all of their chunks at once (`_walk`): one array step per chunk of a block, whatever the
number of ranks, and one `Frames` of all their records.

Only the intact case is walked so: a log whose bytes are anything else (a bad header, CRC
or chunk, a record cut short, a tail that ends mid-chunk) is read again from its start by
`txlog.read_frames`, which accounts for the damage exactly as every other reader does, and
the records this reader gave out already are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..txlog import (
    BLOCK_SIZE,
    CHUNK_HEADER_SIZE,
    FILE_HEADER,
    FIRST,
    FULL,
    LAST,
    MIDDLE,
    Frames,
    ReadReport,
    crc32,
    read_frames,
)

_TYPE_AT = CHUNK_HEADER_SIZE - 1


@dataclass
class SourceRead:
    """One rank's part of a read: which of its sources, whether it starts or ends there."""

    rank: int
    source: int  # index into the rank's sources
    starts: bool  # the source's first records (a restart begins)
    ended: bool  # the source was read to its end by this read
    report: ReadReport  # the source's (complete once `ended`)
    records: int = 0  # how many of the read's records are this rank's (they are together)


@dataclass
class _Log:
    """Where one rank is in its sources."""

    paths: list[Path]
    source: int = 0
    stream: object = None
    offset: int = 0  # bytes of the current source read so far (block-aligned after the first)
    partial: list[bytes] = field(default_factory=list)  # a record that goes on in the next read
    given: int = 0  # records of the current source given out
    fallback: Iterator[Frames] | None = None
    report: ReadReport = field(default_factory=ReadReport)
    started: bool = False

    @property
    def done(self) -> bool:
        return self.source >= len(self.paths)


class RankReaders:
    """The logs of every rank (rank -> its sources' paths, in restart order), read in
    turns: `read(ranks, blocks)` gives the next records of each rank asked for."""

    def __init__(self, paths: dict[int, list[Path]]) -> None:
        self._logs = {rank: _Log(list(sources)) for rank, sources in paths.items()}

    def live(self) -> list[int]:
        """The ranks with records still to read."""
        return [rank for rank, log in self._logs.items() if not log.done]

    def close(self) -> None:
        for log in self._logs.values():
            _close(log)

    def read(self, ranks: list[int], blocks: int) -> tuple[Frames, list[SourceRead]]:
        """The next `blocks` blocks' records of each of `ranks` (live ones), as one `Frames`
        (each rank's records together, in the order of the parts), and what each rank's part
        is. A rank whose source ends in its part goes on with its next source next time."""
        segments: list[tuple[int, bytes, bool, bool]] = []  # (rank, data, at file start, eof)
        for rank in ranks:
            log = self._logs[rank]
            if log.fallback is not None:
                continue
            if log.stream is None:
                log.stream = open(log.paths[log.source], "rb")
                log.offset, log.partial, log.given = 0, [], 0
                log.report = ReadReport()
                log.started = True
            want = blocks * BLOCK_SIZE
            data = log.stream.read(want)
            segments.append((rank, data, log.offset == 0, len(data) < want))
            log.offset += len(data)
        walked = _walk(segments, [self._logs[rank].partial for rank, *_ in segments])
        reads = []
        for i, (rank, _, _, eof) in enumerate(segments):
            log = self._logs[rank]
            if not walked.ok[i]:  # not the intact case: txlog reads it again, from its start
                _close(log)
                log.report = ReadReport()
                log.fallback = read_frames(log.paths[log.source], log.report, blocks * BLOCK_SIZE)
                continue
            log.partial = walked.partials[i]
            log.given += int(walked.counts[i])
            if eof:
                _close(log)
            reads.append(self._part(rank, log.stream is None, int(walked.counts[i])))
        pieces, starts, ends = [walked.data], [walked.starts], [walked.ends]
        at = len(walked.data)
        for rank in ranks:
            log = self._logs[rank]
            if log.fallback is None:
                continue
            data, found_starts, found_ends, ended = _from_fallback(log)
            reads.append(self._part(rank, ended, len(found_starts)))
            pieces.append(data)
            starts.append(found_starts + at)
            ends.append(found_ends + at)
            at += len(data)
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        return Frames(data, np.concatenate(starts), np.concatenate(ends)), reads

    def _part(self, rank: int, ended: bool, records: int) -> SourceRead:
        log = self._logs[rank]
        read = SourceRead(rank, log.source, log.started, ended, log.report, records)
        log.started = False
        if ended:
            log.source += 1
            log.fallback = None
        return read


def _close(log: _Log) -> None:
    if log.stream is not None:
        log.stream.close()
        log.stream = None


def _from_fallback(log: _Log) -> tuple[bytes, np.ndarray, np.ndarray, bool]:
    """The next read of a log that txlog reads, past the records given out before; ended
    when there is none."""
    assert log.fallback is not None
    for frames in log.fallback:
        skip = min(log.given, len(frames))
        log.given -= skip
        if skip < len(frames):
            return frames.data, frames.starts[skip:], frames.ends[skip:], False
    empty = np.empty(0, np.int64)
    return b"", empty, empty, True


@dataclass
class _Walked:
    """The records of the intact segments of a read, segment by segment."""

    data: bytes  # the segments at block boundaries, then the records that spanned blocks
    starts: np.ndarray
    ends: np.ndarray
    counts: np.ndarray  # records of each segment (none for one not intact)
    ok: np.ndarray  # whether each segment is intact
    partials: list[list[bytes]]  # each segment's record that goes on into its next read


def _walk(segments: list[tuple[int, bytes, bool, bool]], partials: list[list[bytes]]) -> _Walked:
    """The records of each segment (rank, data, at the log's start, at its end); a segment
    not in the intact case has none and `ok` false. The chunks of all segments' blocks are
    walked together: each segment is placed at a block boundary of one buffer."""
    count = len(segments)
    sizes = np.array([len(data) for _, data, _, _ in segments], np.int64)
    padded = -(-sizes // BLOCK_SIZE) * BLOCK_SIZE
    seg_starts = np.cumsum(padded) - padded
    pieces = []
    for (_, data, _, _), size, room in zip(segments, sizes.tolist(), padded.tolist(), strict=True):
        pieces += [data, bytes(room - size)]
    buf = b"".join(pieces) + bytes(8)  # (room for the 4-byte reads at the very end)
    ok = np.array(
        [not first or data.startswith(FILE_HEADER) for _, data, first, _ in segments], bool
    )
    data8 = np.frombuffer(buf, np.uint8)
    u16 = np.ndarray((len(buf) - 1,), "<u2", buf, 0, (1,))
    u32 = np.ndarray((len(buf) - 3,), "<u4", buf, 0, (1,))
    # every block of every segment: where its chunks start, and where its bytes end
    nblocks = padded // BLOCK_SIZE
    seg_of_block = np.repeat(np.arange(count), nblocks)
    block_starts = np.arange(len(seg_of_block), dtype=np.int64) * BLOCK_SIZE
    data_ends = seg_starts + sizes
    limits = np.minimum(block_starts + BLOCK_SIZE, data_ends[seg_of_block])
    at = block_starts.copy()
    firsts = np.array([first for _, _, first, _ in segments], bool)
    at[firsts[seg_of_block] & (block_starts == seg_starts[seg_of_block])] += len(FILE_HEADER)
    walk_end = at.copy()  # where each block's walk stopped
    block = np.arange(len(at))
    live = at + CHUNK_HEADER_SIZE <= limits
    at, block = at[live], block[live]
    found: list[np.ndarray] = []
    while len(at):
        after = at + CHUNK_HEADER_SIZE + u16[at + 4]
        kinds = data8[at + _TYPE_AT]
        odd = ((kinds - np.uint8(FULL)) > LAST - FULL) | (after > limits[block])
        if odd.any():
            padding = (kinds == 0) & (after == at + CHUNK_HEADER_SIZE) & (u32[at] == 0)
            ok[seg_of_block[block[odd & ~padding]]] = False
            walk_end[block[padding]] = -1  # padding: the block ends here, as it may
            keep = ~odd
            at, block, after = at[keep], block[keep], after[keep]
        found.append(at)
        walk_end[block] = after
        going = after + CHUNK_HEADER_SIZE <= limits[block]
        at, block = after[going], block[going]
    # a log that ends inside a block: its last chunk must end exactly there
    ends_inside = np.array([eof for *_, eof in segments], bool) & (sizes % BLOCK_SIZE > 0)
    last_blocks = np.cumsum(nblocks) - 1
    short = np.flatnonzero(ends_inside)
    ok[short[walk_end[last_blocks[short]] != data_ends[short]]] = False
    chunks = np.sort(np.concatenate(found)) if found else np.empty(0, np.int64)
    begins = chunks + CHUNK_HEADER_SIZE
    ends = begins + u16[chunks + 4]
    kinds = data8[chunks + _TYPE_AT]
    seg = np.searchsorted(seg_starts, chunks, "right") - 1
    view = memoryview(buf)
    typed = map(view.__getitem__, map(slice, (chunks + _TYPE_AT).tolist(), ends.tolist()))
    crcs = np.fromiter(map(crc32, typed), np.uint32, len(chunks))
    ok[seg[crcs != u32[chunks]]] = False
    # each chunk continues a record (MIDDLE, LAST) exactly when one is open before it
    first_of_seg = np.ones(len(chunks), bool)
    first_of_seg[1:] = seg[1:] != seg[:-1]
    carried = np.array([bool(partial) for partial in partials], bool)
    opened = np.empty(len(chunks), bool)
    opened[1:] = (kinds[:-1] == FIRST) | (kinds[:-1] == MIDDLE)
    opened[first_of_seg] = carried[seg[first_of_seg]]
    ok[seg[((kinds == MIDDLE) | (kinds == LAST)) != opened]] = False
    # records that span blocks: joined after the buffer, placed where their last chunk is
    full = kinds == FULL
    open_records: dict[int, list[bytes]] = {}
    joined: list[bytes] = []
    places: list[int] = []
    for index in np.flatnonzero(~full).tolist():
        where = int(seg[index])
        record = open_records.setdefault(where, list(partials[where]))
        record.append(bytes(view[int(begins[index]) : int(ends[index])]))
        if kinds[index] == LAST:
            joined.append(b"".join(record))
            places.append(index)
            record.clear()
    view.release()
    new_partials = [open_records.get(i, partials[i]) for i in range(count)]
    for i, (_, _, _, eof) in enumerate(segments):
        if eof and new_partials[i]:
            ok[i] = False  # a record cut short by the log's end
    sizes_joined = np.fromiter(map(len, joined), np.int64, len(joined))
    joined_ends = len(buf) + np.cumsum(sizes_joined)
    places_array = np.array(places, np.int64)
    positions = np.concatenate([chunks[full], chunks[places_array]])
    starts = np.concatenate([begins[full], joined_ends - sizes_joined])
    stops = np.concatenate([ends[full], joined_ends])
    order = np.argsort(positions, kind="stable")
    record_seg = np.concatenate([seg[full], seg[places_array]])[order]
    keep = ok[record_seg]
    return _Walked(
        b"".join([buf, *joined]) if joined else buf,
        starts[order][keep],
        stops[order][keep],
        np.bincount(record_seg[keep], minlength=count),
        ok,
        new_partials,
    )

"""Many ranks' logs read side by side, a few blocks of each at a time, for the shared merge.

`txlog.iter_frames` walks the blocks of one read of one log; a walk has a fixed cost per
call, so a job of a thousand short ranks read a block or two at a time would pay it a
thousand times per step window. Here one call reads the next blocks of every rank asked for
and walks all of their chunks at once (`txlog.walk_segments`, the compiled walk
`iter_frames` uses too), giving one `Frames` of all their records.

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

from ..log import BLOCK_SIZE, FILE_HEADER, Frames, ReadReport, Walked, read_frames, walk_segments


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
        want = blocks * BLOCK_SIZE
        segments: list[tuple[int, bytes, bool]] = []  # (rank, its next bytes, at file start)
        for rank in ranks:
            log = self._logs[rank]
            if log.fallback is not None:
                continue
            if log.stream is None:
                log.stream = open(log.paths[log.source], "rb")
                log.offset, log.partial, log.given = 0, [], 0
                log.report = ReadReport()
                log.started = True
            segments.append((rank, log.stream.read(want), log.offset == 0))
            log.offset += len(segments[-1][1])
        buf, walked = _walk(segments, [self._logs[rank].partial for rank, *_ in segments], want)
        reads = []
        for i, (rank, data, _) in enumerate(segments):
            log = self._logs[rank]
            if not walked.ok[i]:  # not the intact case: txlog reads it again, from its start
                _close(log)
                log.report = ReadReport()
                log.fallback = read_frames(log.paths[log.source], log.report, want)
                continue
            log.partial = walked.partials[i]
            log.given += int(walked.counts[i])
            if len(data) < want:
                _close(log)
            reads.append(self._part(rank, log.stream is None, int(walked.counts[i])))
        pieces = [buf + walked.joined if walked.joined else buf]
        starts, ends = [walked.starts], [walked.ends]
        at = len(pieces[0])
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


def _walk(
    segments: list[tuple[int, bytes, bool]], partials: list[list[bytes]], want: int
) -> tuple[bytes, Walked]:
    """Each segment (rank, its next bytes, whether they start its log) placed at a block
    boundary of one buffer, and all walked at once (`txlog.walk_segments`): the buffer and
    what the walk found. A log's first bytes must be its file header (then passed over);
    bytes short of `want` end their log."""
    sizes = np.array([len(data) for _, data, _ in segments], np.int64)
    rooms = -(-sizes // BLOCK_SIZE) * BLOCK_SIZE
    places = np.cumsum(rooms) - rooms
    headed = np.array(
        [not first or data.startswith(FILE_HEADER) for _, data, first in segments], bool
    )
    firsts = np.array([first for *_, first in segments], bool)
    starts = places + np.where(firsts & headed, len(FILE_HEADER), 0)
    ends = np.where(headed, places + sizes, starts)  # (a log with a bad header: none of it)
    pieces = []
    for (_, data, _), size, room in zip(segments, sizes.tolist(), rooms.tolist(), strict=True):
        pieces += [data, bytes(room - size)]
    buf = b"".join(pieces)
    walked = walk_segments(buf, starts, ends, partials, (sizes < want).tolist())
    walked.ok &= headed
    return buf, walked

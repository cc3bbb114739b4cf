"""The ranks' logs read from where the last round stopped: each round reads only the bytes
written since, up to the last whole chunk, and gives them to a merge that goes on.

A source is remembered as the block where reading resumes (`offset`, a block boundary), the
place in that block after the last whole chunk taken (`resume`), the record left open
across blocks (`partial`), and a hash of the bytes of that block before `resume`. Every
round checks that the file still holds those bytes, at that place, in the same file: a log
truncated, rewritten or replaced raises `NotIncremental`, and the follow merges from
scratch. So does any damage (a bad CRC or chunk): the one-shot reader accounts for it.

`LiveReaders.positions()` gives all of this as plain values (and a hash of each file's first
bytes read, which a follower restarted from them checks too: `saved`), and
`LiveReaders.resumed` reads on from them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..identify import RunStats
from ..log import (
    BLOCK_SIZE,
    CHUNK_HEADER_SIZE,
    FILE_HEADER,
    FIRST,
    FULL,
    LAST,
    Frames,
    ReadReport,
    pb,
    records,
    walk_segments,
)
from ..merge import SourceRead

_EXIT = records.code("exit")
_HEAD = CHUNK_HEADER_SIZE


class NotIncremental(Exception):
    """The files do not go on from what a follow read of them (or are damaged): merge them
    from scratch."""


@dataclass
class _Source:
    """How far one source of a rank has been read."""

    path: Path
    offset: int = 0  # the block where the next read starts
    resume: int = len(FILE_HEADER)  # where in that block the next chunk starts
    partial: list[bytes] = field(default_factory=list)  # a record going on in a later block
    digest: bytes = b""  # of the bytes `offset:offset + resume`
    identity: tuple[int, int] | None = None  # the file's device and inode
    started: bool = False  # records given out already (a restart begins at its first read)
    ended: bool = False  # read to its end: an earlier restart, or a log with its exit record
    size_at_end: int = -1
    exit_seen: bool = False
    last_read: int = 0  # bytes the last `_read_source` read
    head: bytes = b""  # the hash of the first block, once it was read whole (`positions`)

    def check(self) -> int:
        """The file's size now; raises NotIncremental unless it still holds what was read."""
        try:
            with open(self.path, "rb") as stream:
                stat = os.fstat(stream.fileno())
                consumed = (
                    os.pread(stream.fileno(), self.resume, self.offset) if self.digest else b""
                )
        except OSError as exc:
            raise NotIncremental(f"{self.path}: {exc.strerror or exc}") from None
        if self.identity is not None and (stat.st_dev, stat.st_ino) != self.identity:
            raise NotIncremental(f"{self.path} was replaced")
        if self.ended and stat.st_size != self.size_at_end:
            raise NotIncremental(f"{self.path} changed after its end was read")
        if self.digest and _digest(consumed) != self.digest:
            raise NotIncremental(f"{self.path} no longer holds what was read of it")
        return stat.st_size


# What `LiveReaders.positions` keeps of each source (`_Source`'s fields but its path)
PLACE = (
    "offset",
    "resume",
    "partial",
    "digest",
    "identity",
    "started",
    "ended",
    "size_at_end",
    "exit_seen",
)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _head(source: _Source) -> bytes:
    """The hash of the bytes of a source's first block read so far (b"" before any)."""
    if not source.digest:
        return b""
    if source.head:
        return source.head
    length = min(BLOCK_SIZE, source.offset + source.resume)
    head = _digest(_read_at(source.path, 0, length))
    if length == BLOCK_SIZE:
        source.head = head  # (the hash of the block as it was read whole, kept)
    return head


def _read_at(path: Path, offset: int, length: int) -> bytes:
    try:
        with open(path, "rb") as stream:
            return os.pread(stream.fileno(), length, offset)
    except OSError as exc:
        raise NotIncremental(f"{path}: {exc.strerror or exc}") from None


class LiveReaders:
    """The sources of every rank (rank -> paths, in restart order), read in turns as
    `merge.readers.RankReaders` reads whole logs, each only as far as it is written.

    `begin_round()` checks every source and makes the new bytes readable; `read()` gives
    them; `live()` names the ranks with bytes left this round; `open_ranks()` the ranks
    whose last source may still grow (its rows hold the merge back at its place)."""

    def __init__(self, paths: dict[int, list[Path]]) -> None:
        self._sources = {
            rank: [_Source(path) for path in sources] for rank, sources in paths.items()
        }
        self._current = dict.fromkeys(self._sources, 0)
        self._left: set[int] = set()
        self.bytes_read = 0  # of the logs, by `read` (a block read again where it resumes)

    def positions(self) -> dict[int, dict]:
        """Where every source stands, as plain values (rank -> its current source and each
        source's place): what `resumed` goes on from. Each source also gets a hash of the
        file's first bytes read (up to a block), which `resumed` checks besides the bytes
        of the block where reading resumes, so that a log rewritten while no follower ran
        is not continued."""
        found = {}
        for rank, sources in self._sources.items():
            places = []
            for source in sources:
                place = {name: getattr(source, name) for name in PLACE}
                place["head"] = _head(source)
                places.append(place)
            found[rank] = {"current": self._current[rank], "sources": places}
        return found

    @classmethod
    def resumed(cls, paths: dict[int, list[Path]], positions: dict[int, dict]) -> LiveReaders:
        """Readers of `paths` that go on from `positions` (as `positions()` gave them for
        the same paths). Raises NotIncremental when the files do not hold what was read."""
        readers = cls(paths)
        if set(positions) != set(paths):
            raise NotIncremental("other ranks than the saved state's")
        for rank, sources in readers._sources.items():
            saved = positions[rank]
            if len(saved["sources"]) != len(sources):
                raise NotIncremental(f"rank {rank} has other restarts than the saved state's")
            readers._current[rank] = saved["current"]
            for source, place in zip(sources, saved["sources"], strict=True):
                for name in PLACE:
                    setattr(source, name, place[name])
                if source.identity is not None:
                    source.identity = tuple(source.identity)
                if source.offset % BLOCK_SIZE or not 0 <= source.resume <= BLOCK_SIZE:
                    raise ValueError(f"{source.path}: a saved place that is not one")
                if source.digest and not source.started:
                    raise ValueError(f"{source.path}: read, and saved as not started")
                if source.digest and _head(source) != place["head"]:
                    raise NotIncremental(f"{source.path} no longer begins as it did")
                source.check()
            if not 0 <= readers._current[rank] < len(sources):
                raise ValueError(f"rank {rank}: a saved restart that is not one")
        return readers

    def started(self) -> dict[int, bool]:
        """Whether each rank's records were given out yet."""
        return {rank: sources[0].started for rank, sources in self._sources.items()}

    def last_rows(self) -> dict[int, tuple[int, bytes | None]]:
        """Each rank's current source (its index) and the last whole history record read
        of it (None: it has none), found by reading back from where reading resumes, at
        most `_LOOK_BACK` bytes: what a saved state says of a rank's last row is checked
        against it. Raises NotIncremental when it is further back than that."""
        return {
            rank: (self._current[rank], _row_read_back(sources[self._current[rank]]))
            for rank, sources in self._sources.items()
        }

    def records_read_back(self, rank: int, count: int) -> list[bytes]:
        """The last `count` whole records read of a rank's current source, or all of them
        when it has fewer, read back as `last_rows` reads; raises NotIncremental as it does."""
        source = self._sources[rank][self._current[rank]]
        end = source.offset + source.resume if source.digest else 0
        back = BLOCK_SIZE
        while True:
            start = max(0, source.offset - back)
            found, complete = _records_between(_read_at(source.path, start, end - start), start)
            if len(found) >= count or (start == 0 and complete):
                return found[len(found) - count :] if count < len(found) else found
            if start == 0 or back >= _LOOK_BACK:
                raise NotIncremental(f"{source.path}: the records read are too far back to check")
            back *= 4

    def row_read_at(self, rank: int, step: int) -> bytes | None:
        """The last whole history record at `step` read of a rank's current source (None:
        it has none), read back as `last_rows` reads; raises NotIncremental as it does."""
        return _row_read_back(self._sources[rank][self._current[rank]], step)

    def begin_round(self) -> None:
        """Check each source against what was read of it; raises NotIncremental."""
        for sources in self._sources.values():
            for source in sources:
                source.check()
        self._left = set(self._sources)

    def live(self) -> list[int]:
        return [rank for rank in self._sources if rank in self._left]

    def open_ranks(self) -> list[int]:
        return [rank for rank, sources in self._sources.items() if not sources[-1].ended]

    def read(self, ranks: list[int], blocks: int) -> tuple[Frames, list[SourceRead]]:
        """The records of the next `blocks` blocks of each of `ranks` (as far as written)."""
        want = blocks * BLOCK_SIZE
        pieces: list[bytes] = []
        starts, ends = [], []
        reads = []
        at = 0
        for rank in ranks:
            sources = self._sources[rank]
            index = self._current[rank]
            source = sources[index]
            last = index == len(sources) - 1
            data, found_starts, found_ends, at_end, whole = _read_source(source, want)
            self.bytes_read += source.last_read
            frames = Frames(data, found_starts, found_ends)
            if len(found_starts) and (records.kinds(frames) == _EXIT).any():
                source.exit_seen = True
            read = SourceRead(
                rank, index, not source.started, False, ReadReport(), len(found_starts)
            )
            source.started = True
            if at_end:
                if not last or (source.exit_seen and whole):
                    source.ended, source.size_at_end = True, source.check()
                    read.ended = True
                if not last:
                    self._current[rank] = index + 1
                else:
                    self._left.discard(rank)
            reads.append(read)
            pieces.append(data)
            starts.append(found_starts + at)
            ends.append(found_ends + at)
            at += len(data)
        empty = np.empty(0, np.int64)
        return (
            Frames(
                b"".join(pieces), np.concatenate([empty, *starts]), np.concatenate([empty, *ends])
            ),
            reads,
        )


_LOOK_BACK = 64 * BLOCK_SIZE  # bytes read back to find a source's last row (`last_rows`)


def _row_read_back(source: _Source, step: int | None = None) -> bytes | None:
    """The last whole history record before where `source` resumes (`step`: the last one
    at that step), read back from there; None when there is none."""
    end = source.offset + source.resume if source.digest else 0
    back = BLOCK_SIZE
    while True:
        start = max(0, source.offset - back)
        found, complete = _records_between(_read_at(source.path, start, end - start), start)
        for payload in reversed(found):
            if records.record_kind(payload) != "history":
                continue
            at = pb.Record.FromString(payload).history.step.num
            if step is None or at == step:
                return payload
            if at < step:
                return None
        if start == 0 and complete:
            return None
        if start == 0 or back >= _LOOK_BACK:
            raise NotIncremental(f"{source.path}: a row read is too far back to check")
        back *= 4


def first_records(path: Path, size: int) -> list[bytes]:
    """The whole records in the first `size` bytes of the log at `path`."""
    return _records_between(_read_at(path, 0, size), 0)[0]


def _records_between(data: bytes, start: int) -> tuple[list[bytes], bool]:
    """The whole records in `data`, the bytes of a log from `start` (a block boundary):
    those begun before it are left out. And whether none was (`data` read from a
    record's start)."""
    found: list[bytes] = []
    pieces: list[bytes] | None = None
    complete = True
    pos = len(FILE_HEADER) if start == 0 else 0
    while pos + _HEAD <= len(data):
        room = BLOCK_SIZE - (start + pos) % BLOCK_SIZE
        if room < _HEAD or not any(data[pos : pos + _HEAD]):
            pos += room
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload = data[pos + _HEAD : pos + _HEAD + length]
        pos += _HEAD + length
        if len(payload) < length:
            break
        if kind == FULL:
            found.append(payload)
            pieces = None
        elif kind == FIRST:
            pieces = [payload]
        elif pieces is not None:
            pieces.append(payload)
            if kind == LAST:
                found.append(b"".join(pieces))
                pieces = None
        else:
            complete = False  # (the rest of a record begun before `start`)
    return found, complete


def _read_source(source: _Source, want: int) -> tuple[bytes, np.ndarray, np.ndarray, bool, bool]:
    """The records of a source's next bytes (up to `want` from the block it resumes in, as
    far as whole chunks are written): its bytes and the records' spans in them, whether it
    read to the end of what is written, and whether that left nothing unread (no chunk or
    record written in part). Moves the source on."""
    try:
        with open(source.path, "rb") as stream:
            stat = os.fstat(stream.fileno())
            data = os.pread(stream.fileno(), want, source.offset)
    except OSError as exc:
        raise NotIncremental(f"{source.path}: {exc.strerror or exc}") from None
    source.identity = (stat.st_dev, stat.st_ino)
    source.last_read = len(data)
    if source.offset == 0 and not data.startswith(FILE_HEADER):
        if FILE_HEADER.startswith(data):  # (not even its header written yet)
            return b"", np.empty(0, np.int64), np.empty(0, np.int64), True, False
        raise NotIncremental(f"{source.path}: not a W&B transaction log")
    at_end = len(data) < want
    base, resume = source.offset, source.resume
    end = len(data)
    if at_end:  # (the last block may be partly written: up to its last whole chunk)
        end = _whole_chunks_end(data, max(resume, end - end % BLOCK_SIZE))
    found_starts = found_ends = np.empty(0, np.int64)
    buffer = data
    if end > resume:
        walked = walk_segments(data, [resume], [end], [source.partial])
        if not walked.ok[0]:
            raise NotIncremental(f"{source.path}: damaged after byte {base + resume}")
        source.partial = walked.partials[0]
        buffer = data + walked.joined if walked.joined else data
        found_starts, found_ends = walked.starts, walked.ends
    stop = max(end, resume)
    source.offset = base + stop - (base + stop) % BLOCK_SIZE
    source.resume = (base + stop) % BLOCK_SIZE
    block_start = source.offset - base
    source.digest = _digest(data[block_start:stop])
    whole = at_end and stop == len(data) and not source.partial
    return buffer, found_starts, found_ends, at_end, whole


def _whole_chunks_end(data: bytes, pos: int) -> int:
    """Where the last whole chunk in `data` from `pos` (a chunk's start) ends: a chunk whose
    bytes are not all written yet, or a block not filled yet, is read next round."""
    end = len(data)
    while True:
        block_end = pos - pos % BLOCK_SIZE + BLOCK_SIZE
        if block_end - pos < _HEAD or not any(data[pos : pos + _HEAD]):
            if block_end > end:  # (its trailer, or the rest of it, not written yet)
                return pos
            pos = block_end
            continue
        if pos + _HEAD > end:
            return pos
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        if pos + _HEAD + length > end:
            return pos
        pos += _HEAD + length


class ScannedLog:
    """What `offlinerun.scan` counts of a log (`RunStats`: its steps, its exit record), kept
    up to date by reading only what was written since the last look."""

    def __init__(self, path: Path) -> None:
        self._readers = LiveReaders({0: [path]})
        self.stats = RunStats()

    @property
    def bytes_read(self) -> int:
        """The bytes of the log read so far (a block again at each look)."""
        return self._readers.bytes_read

    def state(self) -> dict:
        """What `resumed` goes on from, as plain values: the counts so far and where the log
        was read to (`LiveReaders.positions`)."""
        s = self.stats
        counts = (s.records, s.history_rows, s.first_step, s.last_step, s.complete, s.exit_code)
        return {"counts": counts, "place": self._readers.positions()[0]}

    @classmethod
    def resumed(cls, path: Path, state: dict) -> ScannedLog:
        """The scan of `path` going on from `state()`. Raises NotIncremental when the log
        does not hold what was read of it, ValueError when `state` is not a place in it."""
        scanned = cls(path)
        scanned._readers = LiveReaders.resumed({0: [path]}, {0: state["place"]})
        scanned.stats = RunStats(*state["counts"])
        return scanned

    def update(self) -> RunStats:
        """The stats with the new records counted; raises NotIncremental when the log does
        not go on from what was read of it (or is damaged): then scan it whole."""
        stats = self.stats
        self._readers.begin_round()
        while ranks := self._readers.live():
            frames, _ = self._readers.read(ranks, _SCAN_BLOCKS)
            stats.count(frames)
        return stats


_SCAN_BLOCKS = 64  # (2 MiB a read)

"""Console lines and system metrics of a shared run: every rank's, labelled, by time.

Pass 1 of a shared merge sets them aside per source (`Spools`) while it reads the logs for
their rows; pass 2 (`write_console_and_stats`) merges them by timestamp.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import struct
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from pathlib import Path

from ..log import LogWriter, pb, record_kind
from ..plan import Source

# the record kinds pass 2 writes
PASS_TWO = ("output_raw", "output", "stats")


def console_and_stats(
    payloads: Iterable[bytes], source: Source, stats_only: bool = False
) -> Iterator[tuple[float, int, int, bytes]]:
    """One source's console lines (whole lines, `[label] ` prefixed) and system metrics
    (`/l:{label}` suffixed), as (timestamp, rank, n, payload), in file order."""
    label = source.label
    rank = source.rank.rank
    suffix = f"/l:{label}"
    pending: dict[int, tuple[float, list[str]]] = {}  # output type -> (time, text so far)
    n = 0
    for payload in payloads:
        kind = record_kind(payload)
        if kind == "stats":
            record = pb.Record.FromString(payload)
            for item in record.stats.item:
                if not item.key.endswith(suffix) and "/l:" not in item.key:
                    item.key += suffix
            t = record.stats.timestamp
            n += 1
            yield (t.seconds + t.nanos / 1e9, rank, n, record.SerializeToString())
        elif kind in ("output_raw", "output") and not stats_only:
            record = pb.Record.FromString(payload)
            out = record.output_raw if kind == "output_raw" else record.output
            when = out.timestamp.seconds + out.timestamp.nanos / 1e9
            started, parts = pending.get(out.output_type) or (when, [])
            parts.append(out.line)
            text = "".join(parts)
            if "\n" not in text:
                pending[out.output_type] = (started, [text])
                continue
            *lines, rest = text.split("\n")
            for line in lines:
                n += 1
                yield (started, rank, n, _console_record(out.output_type, started, label, line))
            if rest:
                pending[out.output_type] = (when, [rest])
            else:
                pending.pop(out.output_type, None)
    for output_type, (started, parts) in pending.items():
        text = "".join(parts)
        if text:
            n += 1
            yield (started, rank, n, _console_record(output_type, started, label, text))


def _console_record(output_type: int, when: float, label: str, line: str) -> bytes:
    record = pb.Record()
    out = record.output_raw
    out.output_type = output_type
    out.timestamp.FromNanoseconds(int(when * 1e9))
    prefix = f"[{label}] "
    out.line = prefix + line.replace("\r", "\r" + prefix) + "\n"
    return record.SerializeToString()


def write_console_and_stats(
    by_rank: dict[int, list[Source]], writer: LogWriter, spools: Spools
) -> None:
    """Pass 2: console and system metrics of every rank, by time, from what pass 1 set aside."""
    for record in heapq.merge(
        *(
            chain.from_iterable(console_and_stats(spools.read(s), s) for s in sources)
            for sources in by_rank.values()
        ),
        key=lambda r: (r[0], r[1], r[2]),
    ):
        writer.write(record[3])


class Spools:
    """Console and system-metric records of each source, set aside by pass 1 so that pass 2
    need not read the logs again.

    All sources share one scratch file, so a merge of 1,024 ranks holds one spool open, not
    1,024. Each source gathers its records (length-prefixed payloads) in a buffer of its
    own and appends the buffer to the file as a segment once it holds `SEGMENT` bytes; pass
    2 reads a source's segments back in order, then what its buffer still holds. Memory is
    one buffer per source and two numbers per segment.

    For example, with ranks 0 and 1 writing in turns, the file may hold a segment of rank
    0, two of rank 1, then another of rank 0; rank 0's records are read from its first and
    fourth segment, in that order.
    """

    SEGMENT = 8192  # bytes a source gathers before they go to the file (a write buffer's size)

    def __init__(self, scratch: Path, segment: int = SEGMENT) -> None:
        self.segment = segment
        # (unbuffered: every write is one segment, appended where `_end` says)
        self._file = tempfile.TemporaryFile(prefix=".wbmerge-spool-", dir=scratch, buffering=0)
        self._end = 0
        self._writers: dict[Path, SpoolWriter] = {}
        self._hash = hashlib.blake2b(digest_size=16)  # of the file's bytes up to `_end`

    @classmethod
    def kept(cls, path: Path, state: dict | None = None) -> Spools:
        """Spools in the file `path`, which outlives the process (a follow's, `state()` saved
        beside it): made empty, or with `state` (as `state()` gave it) going on from what
        the file held then. Bytes past that (a round that did not end) are written over.
        Raises ValueError when the file does not hold what `state` says, OSError."""
        spools = cls.__new__(cls)
        spools.segment, spools._writers = cls.SEGMENT, {}
        spools._hash = hashlib.blake2b(digest_size=16)
        if state is None:
            spools._file = open(path, "w+b", buffering=0)
            spools._end = 0
            return spools
        spools._file = open(path, "r+b", buffering=0)
        try:
            end = state["end"]
            at = 0
            while at < end:  # (the spool is small beside the logs: console and system metrics)
                data = os.pread(spools._file.fileno(), min(1 << 20, end - at), at)
                if not data:
                    raise ValueError(f"{path} is shorter than its saved state says")
                spools._hash.update(data)
                at += len(data)
            if spools._hash.digest() != state["digest"]:
                raise ValueError(f"{path} does not hold what its saved state says")
            spools._end = end
            os.ftruncate(spools._file.fileno(), end)  # (what a round that did not end wrote)
            for source_path, (offsets, sizes, pending) in state["writers"].items():
                writer = SpoolWriter(spools._append, spools.segment)
                writer.offsets.extend(offsets)
                writer.sizes.extend(sizes)
                if any(o < 0 or n < 0 or o + n > end for o, n in zip(offsets, sizes, strict=True)):
                    raise ValueError(f"{path}: a segment past its saved end")
                writer.pending += pending
                spools._writers[source_path] = writer
        except BaseException:
            spools._file.close()
            raise
        return spools

    def state(self) -> dict:
        """What `kept` goes on from, once `sync()` made the file's bytes durable: the end,
        a hash of the bytes to it, and each source's segments and buffer."""
        return {
            "end": self._end,
            "digest": self._hash.digest(),
            "writers": {
                path: (list(w.offsets), list(w.sizes), bytes(w.pending))
                for path, w in self._writers.items()
            },
        }

    def sync(self) -> None:
        os.fsync(self._file.fileno())

    def writer_of(self, source_path: Path) -> SpoolWriter | None:
        """The writer `writer()` last gave for the source at `source_path`."""
        return self._writers.get(source_path)

    def path_of(self, writer: SpoolWriter | None) -> Path | None:
        """The source path whose writer `writer` is (None for None)."""
        return next((path for path, w in self._writers.items() if w is writer), None)

    def __enter__(self) -> Spools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def writer(self, source: Source) -> SpoolWriter:
        writer = self._writers[source.path] = SpoolWriter(self._append, self.segment)
        return writer

    def _append(self, segment: bytes | bytearray) -> int:
        """Write `segment` at the end of the file; returns where it starts."""
        offset = self._end
        self._hash.update(segment)
        view = memoryview(segment)
        while view:
            written = os.pwrite(self._file.fileno(), view, self._end)
            self._end += written
            view = view[written:]
        return offset

    def read(self, source: Source) -> Iterator[bytes]:
        """The payloads `source`'s writer was given, in order."""
        writer = self._writers[source.path]
        header = _SPOOL_LENGTH
        fd = self._file.fileno()
        for offset, size in zip(writer.offsets, writer.sizes, strict=True):
            yield from _payloads(os.pread(fd, size, offset), header)
        yield from _payloads(bytes(writer.pending), header)

    def close(self) -> None:
        self._file.close()


_SPOOL_LENGTH = struct.Struct("<I")


def _payloads(data: bytes, header: struct.Struct) -> Iterator[bytes]:
    at = 0
    while at < len(data):
        (length,) = header.unpack_from(data, at)
        at += header.size
        yield data[at : at + length]
        at += length


class SpoolWriter:
    """Appends one source's records to its spool: to its buffer, and the buffer to the
    shared file as a segment once it is full."""

    def __init__(self, append: Callable[[bytearray], int], segment: int) -> None:
        self._append, self._segment = append, segment
        self.pending = bytearray()
        self.offsets = array("q")  # where each of its segments starts in the file
        self.sizes = array("q")

    def write(self, payload: bytes) -> None:
        self.pending += _SPOOL_LENGTH.pack(len(payload))
        self.pending += payload
        if len(self.pending) >= self._segment:
            self.offsets.append(self._append(self.pending))
            self.sizes.append(len(self.pending))
            self.pending = bytearray()

"""Console lines and system metrics of a shared run: every rank's, labelled, by time.

Pass 1 of a shared merge sets them aside per source (`Spools`) while it reads the logs for
their rows; pass 2 (`write_console_and_stats`) merges them by timestamp.
"""

from __future__ import annotations

import heapq
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path
from typing import BinaryIO

from ..plan import Source
from ..proto import pb
from ..records import record_kind
from ..txlog import LogWriter

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
    """Console and system-metric records of each source, set aside by pass 1 in a scratch
    file (length-prefixed payloads) so that pass 2 need not read the logs again."""

    def __init__(self, scratch: Path) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix=".wbmerge-spool-", dir=scratch))
        self._files: dict[Path, BinaryIO] = {}

    def __enter__(self) -> Spools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def writer(self, source: Source) -> SpoolWriter:
        stream = self._files[source.path] = open(self._dir / f"{len(self._files)}.spool", "w+b")
        return SpoolWriter(stream)

    def read(self, source: Source) -> Iterator[bytes]:
        stream = self._files[source.path]
        stream.flush()
        stream.seek(0)
        header = _SPOOL_LENGTH
        while chunk := stream.read(header.size):
            (length,) = header.unpack(chunk)
            yield stream.read(length)

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_SPOOL_LENGTH = struct.Struct("<I")


class SpoolWriter:
    """Appends one source's records to its spool."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream

    def write(self, payload: bytes) -> None:
        self._stream.write(_SPOOL_LENGTH.pack(len(payload)) + payload)

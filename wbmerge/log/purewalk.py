"""The block walk's Python twin: what `txlog.walk_segments` runs where `_walk` is not built.

`walk` takes the arguments of the compiled walk (wbmerge/log/_walk.c, whose comment describes
the format) and gives the same answers, only slower: it is a line-for-line port. A
platform without a compiler, or a build that skipped the extensions, still reads every
log. `WBMERGE_PURE=1` in the environment makes wbmerge use the Python twins although the
compiled kernels exist, which is how the tests run the core of the suite on this path.
"""

from __future__ import annotations

import struct
from zlib import crc32

BLOCK_SIZE = 32768
CHUNK_HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_HEADER = struct.Struct("<IHB")


def walk(
    buf: bytes, starts: bytes, ends: bytes, ended: bytes, partials: list[list[bytes]]
) -> tuple[bytes, bytearray, bytearray, bytearray, bytearray, list[list[bytes]]]:
    """`_walk.walk`: the records of segments of logs laid out in `buf` (see the C)."""
    count = len(partials)
    for name, given in (("starts", starts), ("ends", ends)):
        if len(given) != 8 * count:
            raise ValueError(f"{name}: {count} segments expected")
    segment_starts = struct.unpack(f"<{count}q", starts)
    segment_ends = struct.unpack(f"<{count}q", ends)
    if len(ended) != count:
        raise ValueError("ended: one byte per segment expected")
    if not all(
        isinstance(given, list) and all(type(piece) is bytes for piece in given)
        for given in partials
    ):
        raise TypeError("partials: a list of bytes per segment expected")
    joined = bytearray()
    record_starts: list[int] = []
    record_ends: list[int] = []
    counts, ok, kept = [], bytearray(), []
    for i, given in enumerate(partials):
        start, end = segment_starts[i], segment_ends[i]
        if start < 0 or end < start or end > len(buf):
            raise ValueError("a segment lies outside the buffer")
        spans: list[tuple[int, int]] = []
        joined_before = len(joined)
        walked = _walk_one(buf, start, end, bool(ended[i]), given, spans, joined)
        if walked is None:  # not intact: its records are taken back
            del joined[joined_before:]
            counts.append(0)
            ok.append(0)
            kept.append(list(given))
            continue
        record_starts += [s for s, _ in spans]
        record_ends += [e for _, e in spans]
        counts.append(len(spans))
        ok.append(1)
        kept.append([walked] if walked is not False else [])
    return (
        bytes(joined),
        bytearray(struct.pack(f"<{len(record_starts)}q", *record_starts)),
        bytearray(struct.pack(f"<{len(record_ends)}q", *record_ends)),
        bytearray(struct.pack(f"<{count}q", *counts)),
        ok,
        kept,
    )


def _walk_one(
    buf: bytes,
    start: int,
    end: int,
    ended: bool,
    open_record: list[bytes],
    spans: list[tuple[int, int]],
    joined: bytearray,
) -> bytes | bool | None:
    """One segment: None if it is not intact, else the record it leaves open (bytes), or
    False for none. `open_record` is the pieces of what an earlier read left open (an
    empty list: none; a list of an empty piece: a record open with nothing in it yet)."""
    is_open = bool(open_record)
    pieces = bytearray(b"".join(open_record))
    pos = start
    last_block = end - end % BLOCK_SIZE if end % BLOCK_SIZE else -1
    while pos < end:
        block = pos - pos % BLOCK_SIZE
        block_end = min(block + BLOCK_SIZE, end)
        if block_end - pos < CHUNK_HEADER_SIZE:
            if ended and block == last_block and pos != block_end:
                return None  # a chunk header cut off at the end of the log
            pos = block + BLOCK_SIZE
            continue
        checksum, length, kind = _HEADER.unpack_from(buf, pos)
        after = pos + CHUNK_HEADER_SIZE + length
        if not FULL <= kind <= LAST or after > block_end:
            if kind == 0 and length == 0 and checksum == 0:  # padding: the block ends
                if ended and block == last_block:
                    return None
                pos = block + BLOCK_SIZE
                continue
            return None
        if crc32(buf[pos + CHUNK_HEADER_SIZE - 1 : after]) != checksum:
            return None
        if (kind in (MIDDLE, LAST)) != is_open:
            return None
        if kind == FULL:
            spans.append((pos + CHUNK_HEADER_SIZE, after))
        else:
            if kind == FIRST:
                pieces.clear()
            pieces += buf[pos + CHUNK_HEADER_SIZE : after]
            is_open = kind != LAST
            if kind == LAST:
                at = len(buf) + len(joined)
                spans.append((at, at + len(pieces)))
                joined += pieces
                pieces.clear()
        pos = after
    if ended and is_open:
        return None
    return bytes(pieces) if is_open else False

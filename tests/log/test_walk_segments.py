"""One block walk serves both readers: `txlog.walk_segments` reads many logs' segments laid
out in one buffer exactly as it reads each of them alone, and as the plain reader reads the
whole log; and the shared merge's reader reads logs whose blocks are filled with empty
MIDDLE chunks (what a pass-through rewrite of a log's head leaves) as the plain reader does."""

from __future__ import annotations

import io
import os
import random
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.log import (
    BLOCK_SIZE,
    CHUNK_HEADER_SIZE,
    FILE_HEADER,
    FIRST,
    FULL,
    LAST,
    MIDDLE,
    LogWriter,
    ReadReport,
    read_head,
    read_payloads,
    walk_segments,
    write_payloads,
)
from wbmerge.log.txlog import WALKS, iter_payloads
from wbmerge.merge import RankReaders

EMPTY_MIDDLE = struct.pack("<IHB", zlib.crc32(bytes([MIDDLE])), 0, MIDDLE)


def chunk(kind: int, payload: bytes) -> bytes:
    """One chunk, framed with its right CRC."""
    return struct.pack("<IHB", zlib.crc32(bytes([kind]) + payload), len(payload), kind) + payload


def log_of(records: list[tuple[int, int, int]], rnd: random.Random) -> tuple[bytes, list[bytes]]:
    """A log of records (first piece's size, empty MIDDLE chunks after it, last piece's
    size; no empty chunks and no last piece: a FULL chunk), and their payloads. A chunk that
    does not fit in its block's room starts the next block."""
    out, payloads = bytearray(FILE_HEADER), []
    for first, empties, last in records:
        head, tail = rnd.randbytes(first), rnd.randbytes(last)
        if not empties and not last:
            pieces = [(FULL, head)]
        else:
            pieces = [(FIRST, head), *[(MIDDLE, b"")] * empties, (LAST, tail)]
        for kind, payload in pieces:
            room = BLOCK_SIZE - len(out) % BLOCK_SIZE
            if room < CHUNK_HEADER_SIZE + len(payload):
                out += bytes(room)
            out += chunk(kind, payload)
        payloads.append(head if len(pieces) == 1 else head + tail)
    return bytes(out), payloads


def records_of(buf: bytes, walked, index: int) -> list[bytes]:
    """The payloads `walk_segments` gave segment `index`."""
    data = buf + walked.joined
    first = int(walked.counts[:index].sum())
    return [
        data[start:end]
        for start, end in zip(
            walked.starts[first : first + walked.counts[index]].tolist(),
            walked.ends[first : first + walked.counts[index]].tolist(),
            strict=True,
        )
    ]


def laid_out(pieces: list[bytes]) -> tuple[bytes, list[int]]:
    """The pieces one after another, each at a block boundary; and where each begins."""
    places, out = [], bytearray()
    for piece in pieces:
        places.append(len(out))
        out += piece + bytes(-len(piece) % BLOCK_SIZE)
    return bytes(out), places


RECORDS = st.lists(
    st.tuples(
        st.integers(0, 20_000), st.sampled_from([0, 0, 1, 40, 3000, 5000]), st.integers(0, 20_000)
    ),
    max_size=10,
)

DAMAGE = st.sampled_from(["none", "changed", "cut", "cut at a block"])


def test_many_segments_read_as_each_alone_and_as_the_plain_reader():
    seen = {"intact": 0, "damaged": 0, "joined": 0, "runs": 0, "later": 0}

    # Derandomized: the counts below were at least 64 "later" cases in eight random runs,
    # but one run in CI drew only 30; a fixed draw keeps the check of what came up exact.
    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(
        st.lists(
            st.tuples(RECORDS, st.integers(0, 10**9), st.integers(0, 10**9), DAMAGE),
            min_size=1,
            max_size=5,
        ),
        st.integers(0, 2**32 - 1),
    )
    def check(logs, seed):
        rnd = random.Random(seed)
        pieces, bounds, partials, ended, wholes = [], [], [], [], []
        for records, cut_at, flip_at, damage in logs:
            data, payloads = log_of(records, rnd)
            if damage == "changed" and len(data) > 7:  # a byte changed after the header
                changed = bytearray(data)
                changed[7 + flip_at % (len(data) - 7)] ^= 0x40
                data = bytes(changed)
            elif damage == "cut":  # the log cut short anywhere (a rank killed mid-write)
                data = data[: 7 + flip_at % (len(data) - 6)]
            elif damage == "cut at a block":  # perhaps inside a record that spans blocks
                data = data[: max(7, flip_at % -(-len(data) // BLOCK_SIZE) * BLOCK_SIZE)]
            blocks = -(-len(data) // BLOCK_SIZE)
            first = cut_at % blocks  # the segment: blocks first..first + count - 1
            count = 1 + (cut_at // blocks) % (blocks - first)
            piece = data[first * BLOCK_SIZE : (first + count) * BLOCK_SIZE]
            # the record the blocks before left open, as a walk of them finds it
            partial = []
            if first:
                before = walk_segments(data, [len(FILE_HEADER)], [first * BLOCK_SIZE], [[]])
                partial = before.partials[0] if before.ok[0] else [b"x"]
            pieces.append(piece)
            bounds.append((len(FILE_HEADER) if first == 0 else 0, len(piece)))
            partials.append(partial)
            ended.append(first + count == blocks)
            whole = first == 0 and first + count == blocks
            wholes.append((data, payloads if damage == "none" else None) if whole else None)
        buf, places = laid_out(pieces)
        starts = [place + start for place, (start, _) in zip(places, bounds, strict=True)]
        ends = [place + end for place, (_, end) in zip(places, bounds, strict=True)]
        walked = walk_segments(buf, starts, ends, partials, ended)
        for name in WALKS:  # every block walk gives the same answer: the twins agree
            twin = walk_segments(buf, starts, ends, partials, ended, walk=name)
            assert twin.joined == walked.joined and twin.partials == walked.partials, name
            for field in ("starts", "ends", "counts", "ok"):
                assert getattr(twin, field).tolist() == getattr(walked, field).tolist(), name
        for i, piece in enumerate(pieces):
            alone_buf, _ = laid_out([piece])
            alone = walk_segments(
                alone_buf, [bounds[i][0]], [bounds[i][1]], [partials[i]], [ended[i]]
            )
            assert bool(walked.ok[i]) == bool(alone.ok[0])
            assert records_of(buf, walked, i) == records_of(alone_buf, alone, 0)
            if walked.ok[i]:
                assert walked.partials[i] == alone.partials[0]
                seen["intact"] += 1
                seen["joined"] += bool(alone.joined)
                seen["runs"] += EMPTY_MIDDLE * 100 in piece
                seen["later"] += bool(partials[i])
            else:
                assert walked.counts[i] == 0
                seen["damaged"] += 1
            if wholes[i] is not None:  # the whole log: what the plain reader reads
                data, payloads = wholes[i]
                report = ReadReport()
                plain = list(iter_payloads(io.BytesIO(data), report))
                assert bool(walked.ok[i]) == (not report.damaged)
                if walked.ok[i]:
                    assert records_of(buf, walked, i) == plain
                assert payloads is None or plain == payloads

    check()
    # the cases the property is about all came up, not only the easy ones
    assert seen["intact"] >= 150 and seen["damaged"] >= 50, seen
    assert seen["joined"] >= 80 and seen["runs"] >= 50 and seen["later"] >= 40, seen


def with_filled_block(source: Path, dest: Path, blocks: int, first: bytes) -> list[bytes]:
    """`dest` = `source` with its first record replaced by `first`, its first `blocks`
    blocks re-framed (as the pass-through merge does) and the rest copied as they are; the
    last re-framed block ends with the start of the record that goes on, then empty MIDDLE
    chunks. Returns the payloads `dest` holds."""
    payloads = list(read_payloads(source))
    with open(source, "rb") as stream:
        head = read_head(stream, blocks)
        assert head is not None
        kept, open_record = head
        with open(dest, "wb") as out, LogWriter(out) as writer:
            for payload in [first, *kept[1:]]:
                writer.write(payload)
            writer.end_block(open_record)
            size = source.stat().st_size
            writer.copy_blocks(stream, blocks * BLOCK_SIZE, size, len(payloads) - len(kept))
    return [first, *payloads[1:]]


@pytest.mark.parametrize("blocks", [1, 2, 8])
def test_the_shared_reader_reads_blocks_of_empty_middle_chunks_as_the_plain_reader(
    tmp_path, blocks
):
    rnd = random.Random(blocks)
    paths, wanted = {}, {}
    for rank in range(6):
        # a long first record, then one that spans blocks, then many short ones
        payloads = [rnd.randbytes(20_000), rnd.randbytes(100_000)]
        payloads += [rnd.randbytes(rnd.randrange(50, 3000)) for _ in range(300)]
        source = tmp_path / f"source{rank}.wandb"
        write_payloads(source, payloads)
        if rank == 5:  # one log as it was written, beside the rewritten ones
            paths[rank], wanted[rank] = [source], payloads
            continue
        dest = tmp_path / f"rank{rank}.wandb"
        wanted[rank] = with_filled_block(source, dest, 1 + rank % 3, rnd.randbytes(10))
        # the shorter first record left the rest of a block to empty MIDDLE chunks
        assert EMPTY_MIDDLE * 2000 in dest.read_bytes()
        assert list(read_payloads(dest)) == wanted[rank]
        paths[rank] = [dest]
    readers = RankReaders(paths)
    got = {rank: [] for rank in paths}
    while live := readers.live():
        frames, reads = readers.read(live, blocks)
        at = 0
        for read in reads:
            got[read.rank] += [frames.payload(i) for i in range(at, at + read.records)]
            at += read.records
            assert not read.report.damaged
    readers.close()
    assert got == wanted


def test_the_compiled_block_walk_is_built_unless_the_python_twin_is_asked_for():
    # The twin comparison above means something only where both exist: a build that
    # silently skipped the C extension must not pass for one that has it.
    assert set(WALKS) == ({"python"} if os.environ.get("WBMERGE_PURE") else {"compiled", "python"})

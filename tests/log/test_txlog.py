"""The `.wandb` reader and writer: exact framing, CRCs, and what damage does."""

from __future__ import annotations

import io
import random
import struct
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.errors import NotATransactionLog
from wbmerge.log import records, txlog

from ..conftest import FIXTURES, fixture_logs

LOGS = fixture_logs()
# A seeded `random.Random`: its bytes are not drawn from Hypothesis's own buffer, which caps
# the data of an example at 8 KB, so the logs made with it can span many blocks.
SEEDED = st.integers(0, 2**32 - 1).map(random.Random)


def read_all(data: bytes) -> tuple[list[bytes], txlog.ReadReport]:
    report = txlog.ReadReport()
    return list(txlog.iter_payloads(io.BytesIO(data), report)), report


def write_all(payloads: list[bytes]) -> bytes:
    out = io.BytesIO()
    with txlog.LogWriter(out, flush_every=4096) as writer:
        for payload in payloads:
            writer.write(payload)
    return out.getvalue()


def test_fixtures_exist():
    assert len(LOGS) >= 30


@pytest.mark.parametrize("path", LOGS, ids=lambda p: f"{p.parts[-4]}/{p.name}")
def test_every_fixture_rewrites_byte_identically(path):
    data = path.read_bytes()
    payloads, report = read_all(data)
    rewritten = write_all(payloads)
    if report.truncated:  # a killed rank: its complete records are a prefix of the file
        assert data.startswith(rewritten)
        assert len(data) - len(rewritten) == report.truncated_bytes
    elif len(data) % txlog.BLOCK_SIZE == 0 and rewritten != data:
        # killed right after wandb-core padded a block for a record it never flushed
        assert data.startswith(rewritten)
        assert set(data[len(rewritten) :]) == {0} and len(data) - len(rewritten) < 7
    else:
        assert rewritten == data
    assert report.dropped_bytes == 0
    assert report.records == len(payloads)


def test_fixture_records_parse_and_kind_agrees_with_protobuf():
    seen_spanning = False
    for path in LOGS:
        for payload in txlog.read_payloads(path):
            record = pb.Record.FromString(payload)
            assert records.record_kind(payload) == record.WhichOneof("record_type")
            seen_spanning |= len(payload) > txlog.BLOCK_SIZE - 7
    # the killed rank's first blocks end inside a record: spanning happens in real files
    killed = [p for p in LOGS if "killed_rank" in p.parts]
    data = killed[0].read_bytes()
    kinds = {data[off + 6] for off in range(txlog.BLOCK_SIZE, len(data), txlog.BLOCK_SIZE)}
    assert kinds & {txlog.MIDDLE, txlog.LAST} or seen_spanning


def test_header_and_crc_are_wandbs():
    data = LOGS[0].read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00"
    crc, length, kind = struct.unpack_from("<IHB", data, 7)
    assert crc == zlib.crc32(bytes([kind]) + data[14 : 14 + length])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=100_000), min_size=0, max_size=12), SEEDED)
def test_round_trip_random_sizes(sizes, rnd):
    payloads = [rnd.randbytes(n) for n in sizes]
    data = write_all(payloads)
    got, report = read_all(data)
    assert got == payloads
    assert not report.damaged
    assert write_all(got) == data


@pytest.mark.parametrize("left", [0, 1, 6, 7, 8, 20])
def test_block_tail_padding_and_empty_first_chunk(left):
    # Fill block 0 so that exactly `left` bytes remain, then write one more record.
    first = txlog.BLOCK_SIZE - 7 - 7 - left
    data = write_all([b"a" * first, b"b" * 100])
    assert read_all(data)[0] == [b"a" * first, b"b" * 100]
    if left < 7:
        assert data[txlog.BLOCK_SIZE - left : txlog.BLOCK_SIZE] == bytes(left)
        assert data[txlog.BLOCK_SIZE + 6] == txlog.FULL
    else:  # LevelDB: a FIRST chunk with what fits (possibly nothing), the rest in block 1
        assert data[txlog.BLOCK_SIZE - left + 6] == txlog.FIRST
        assert data[txlog.BLOCK_SIZE + 6] == txlog.LAST


def test_truncated_tail_yields_every_complete_record():
    payloads = [bytes([i]) * (i * 997 % 50_000) for i in range(1, 12)]
    data = write_all(payloads)
    boundaries = [len(write_all(payloads[:k])) for k in range(len(payloads) + 1)]
    for cut in range(7, len(data), 613):
        got, report = read_all(data[:cut])
        complete = max(k for k, b in enumerate(boundaries) if b <= cut)
        assert got == payloads[:complete], cut
        assert report.truncated == (cut not in boundaries and cut > boundaries[complete]), cut


def test_corrupt_chunk_skips_to_next_block_and_counts():
    payloads = [f"record {i}".encode() * 40 for i in range(200)]  # ~400 B each
    data = bytearray(write_all(payloads))
    before = read_all(bytes(data))[0]
    # flip a byte inside the 5th record's payload (block 0)
    offset = len(write_all(payloads[:4])) + 7 + 10
    data[offset] ^= 0xFF
    got, report = read_all(bytes(data))
    in_block0 = sum(
        1 for k in range(len(payloads)) if len(write_all(payloads[: k + 1])) <= txlog.BLOCK_SIZE
    )
    assert got[:4] == before[:4]
    assert got[4:] == payloads[len(payloads) - len(got) + 4 :]  # the rest resumes in block 1
    assert report.dropped_records == len(payloads) - len(got)
    assert report.dropped_records >= in_block0 - 4
    # Dropped: from the corrupt record's first byte to the first record that starts whole
    # in block 1 (the rest of block 0, then the continuation chunk of the record that
    # straddled the block boundary), measured on the writer's own offsets.
    resumed = len(payloads) - len(got) + 4
    assert report.dropped_bytes == len(write_all(payloads[:resumed])) - len(write_all(payloads[:4]))
    assert not report.truncated


def test_corrupt_fixture_copy_reports_drop():
    from ..conftest import FIXTURES

    corrupt = next(FIXTURES.glob("damaged/corrupt_block/wandb/*/run-*.wandb"))
    got, report = read_all(corrupt.read_bytes())
    assert report.dropped_bytes > 0 and report.dropped_records > 0
    for payload in got:
        pb.Record.FromString(payload)  # whatever is yielded is intact


@pytest.mark.parametrize("data", [b"PK\x03\x04zipfile", b'{"json": 1}', b":W&B\x00\x00\x00"])
def test_not_a_transaction_log(data):
    with pytest.raises(NotATransactionLog):
        read_all(data)


def test_empty_and_header_only_files():
    got, report = read_all(b"")
    assert got == [] and report.truncated
    got, report = read_all(txlog.FILE_HEADER)
    assert got == [] and not report.damaged


# -- the walk over whole blocks reads exactly as the chunk-by-chunk loop (`walk=False`) --


def read_both(data: bytes, read_size: int) -> tuple:
    """(records, report) read with the array walk, and with the loop alone."""

    def read(report: txlog.ReadReport, walk: bool) -> list[bytes]:
        frames = txlog.iter_frames(io.BytesIO(data), report, read_size, walk=walk)
        return [payload for f in frames for payload in f.payloads()]

    walked, looped = txlog.ReadReport(), txlog.ReadReport()
    got, want = read(walked, True), read(looped, False)
    return (got, walked), (want, looped)


ALL_LOGS = [p for p in sorted(FIXTURES.glob("**/run-*.wandb")) if "not_a_log" not in p.parts]


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: f"{p.parts[-4]}/{p.name}")
def test_walked_blocks_read_every_fixture_as_the_loop_does(path):
    data = path.read_bytes()
    for read_size in (txlog.BLOCK_SIZE, 3 * txlog.BLOCK_SIZE, 32 * txlog.BLOCK_SIZE):
        walked, looped = read_both(data, read_size)
        assert walked == looped


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=70_000), min_size=1, max_size=30),
    st.lists(st.integers(min_value=0, max_value=10**9), max_size=3),
    st.integers(min_value=0, max_value=10**9),
    st.sampled_from([1, 2, 5]),
    SEEDED,
)
def test_walked_blocks_read_damaged_logs_as_the_loop_does(sizes, flips, cut, blocks, rnd):
    data = bytearray(write_all([rnd.randbytes(n) for n in sizes]))
    for flip in flips:  # corrupt bytes anywhere: headers, lengths, payloads, padding
        data[7 + flip % (len(data) - 7)] ^= 0x5A
    data = bytes(data[: 7 + cut % len(data)]) if cut % 3 == 0 else bytes(data)
    walked, looped = read_both(data, blocks * txlog.BLOCK_SIZE)
    assert walked == looped


def chunked_log(chunks: list[tuple[int, int]]) -> bytes:
    """A log of the given (chunk type, payload size) chunks, whatever their order, each with
    a right CRC; a chunk that does not fit in its block's room starts the next block."""
    out = bytearray(txlog.FILE_HEADER)
    for kind, size in chunks:
        room = txlog.BLOCK_SIZE - len(out) % txlog.BLOCK_SIZE
        if room < txlog.CHUNK_HEADER_SIZE + size:
            out += bytes(room)
        payload = (bytes(range(256)) * (size // 256 + 1))[:size]
        out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + payload), size, kind) + payload
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(txlog.FULL, txlog.LAST), st.integers(0, 20_000)), max_size=30),
    st.sampled_from([1, 2]),
)
def test_chunks_in_any_order_read_as_the_loop_reads_them(chunks, blocks):
    """Right CRCs, wrong sequences (a LAST without its FIRST, a FIRST cut short by another
    record): the walk takes a block only when its sequence holds, as the loop reads it.
    Whole records follow, so that the chunks are in whole blocks, which the walk reads."""
    walked, looped = read_both(
        chunked_log(chunks + [(txlog.FULL, 30_000)] * 3), blocks * txlog.BLOCK_SIZE
    )
    assert walked == looped


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(txlog.FULL, txlog.LAST), st.integers(0, 3000), st.integers(1, 4700)),
        max_size=12,
    ),
    st.sampled_from([1, 2]),
)
def test_runs_of_empty_chunks_read_as_the_loop_reads_them(chunks, blocks):
    """Runs of empty chunks (`end_block` fills a block with empty MIDDLE ones after an open
    record), after a chunk of any type or none: the walk passes a run in one step, and
    reads exactly what the loop reads, damage included."""
    expanded = [
        chunk for kind, size, run in chunks for chunk in [(kind, size)] + [(txlog.MIDDLE, 0)] * run
    ]
    walked, looped = read_both(
        chunked_log(expanded + [(txlog.FULL, 30_000)] * 3), blocks * txlog.BLOCK_SIZE
    )
    assert walked == looped


def test_read_size_is_whole_blocks():
    with pytest.raises(ValueError, match="multiple"):
        list(txlog.iter_frames(io.BytesIO(txlog.FILE_HEADER), read_size=1000))


def test_frames_give_each_record_once_in_order_also_across_blocks():
    payloads = [bytes([i % 251]) * (i * 7919 % 90_000) for i in range(40)]
    data = write_all(payloads)
    frames = list(txlog.iter_frames(io.BytesIO(data), read_size=2 * txlog.BLOCK_SIZE))
    assert len(frames) > 1
    assert [p for f in frames for p in f.payloads()] == payloads


def test_the_block_walk_reads_intact_heads_and_refuses_damaged_ones():
    """`read_head` is the block walk alone (the fast path of every read): on intact blocks it
    gives exactly the records the writer put there, on a damaged block it gives up (None),
    leaving the damage to the chunk-by-chunk loop that accounts for it."""
    payloads = [bytes([i % 251]) * (300 + i * 37 % 2000) for i in range(3000)]
    data = bytearray(write_all(payloads))
    ends = [len(write_all(payloads[: k + 1])) for k in range(len(payloads))]
    for blocks in (1, 2, 5, 9):
        head = txlog.read_head(io.BytesIO(bytes(data)), blocks)
        assert head is not None
        whole = sum(1 for end in ends if end <= blocks * txlog.BLOCK_SIZE)
        assert head[0] == payloads[:whole]
        # The next record starts in these blocks unless fewer than a chunk header's 7 bytes
        # were left after the last whole one (then the writer pads to the block's end).
        left = blocks * txlog.BLOCK_SIZE - (ends[whole - 1] if whole else 7)
        spans_on = whole < len(payloads) and left >= txlog.CHUNK_HEADER_SIZE
        assert (head[1] is not None) == spans_on
        assert head[1] is None or payloads[whole].startswith(head[1])
    data[5 * txlog.BLOCK_SIZE + 100] ^= 0xFF  # damage in block 5
    assert txlog.read_head(io.BytesIO(bytes(data)), 5) is not None
    assert txlog.read_head(io.BytesIO(bytes(data)), 6) is None
    got, report = read_all(bytes(data))  # the loop reads past it, counting what it lost
    assert report.dropped_records > 0 and len(got) == len(payloads) - report.dropped_records


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=40_000), max_size=40),
    st.lists(st.integers(min_value=0, max_value=40), max_size=4),
    SEEDED,
)
def test_write_many_frames_as_write_does(sizes, cuts, rnd):
    payloads = [rnd.randbytes(n) for n in sizes]
    data = b"".join(payloads)
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    starts = [end - size for end, size in zip(ends, sizes, strict=True)]
    out = io.BytesIO()
    with txlog.LogWriter(out, flush_every=50_000) as writer:
        done = 0
        for cut in sorted({c % (len(sizes) + 1) for c in cuts}):  # interleaved with `write`
            if cut < done:
                continue
            writer.write_many(data, starts[done:cut], ends[done:cut])
            if cut < len(sizes):
                writer.write(payloads[cut])
                done = cut + 1
            else:
                done = cut
        writer.write_many(data, starts[done:], ends[done:])
        assert writer.records == len(payloads)
    assert out.getvalue() == write_all(payloads)


# -- a log's head rewritten, the rest copied as it is (`read_head`, `end_block`, `copy_blocks`)


def splice(source: Path, dest: Path, blocks: int, new_first: bytes) -> tuple[int, bytes | None]:
    """`dest` = `source` with its first record replaced, only its first `blocks` re-framed."""
    with open(source, "rb") as stream:
        head = txlog.read_head(stream, blocks)
        assert head is not None
        payloads, open_record = head
        with open(dest, "wb") as out, txlog.LogWriter(out) as writer:
            for payload in [new_first, *payloads[1:]]:
                writer.write(payload)
            writer.end_block(open_record)
            total = len(read_all(source.read_bytes())[0])
            size = source.stat().st_size
            writer.copy_blocks(stream, blocks * txlog.BLOCK_SIZE, size, total - len(payloads))
            assert writer.records == total
    return len(payloads), open_record


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=40_000), min_size=2, max_size=40),
    st.integers(min_value=1, max_value=3),
    st.integers(min_value=0, max_value=70_000),
    SEEDED,
)
def test_a_rewritten_head_and_copied_blocks_read_as_one_log(sizes, blocks, first, rnd):
    payloads = [rnd.randbytes(n) for n in sizes]
    with tempfile.TemporaryDirectory() as tmp:
        source, dest = Path(tmp, "a.wandb"), Path(tmp, "b.wandb")
        source.write_bytes(write_all(payloads))
        with open(source, "rb") as stream:
            head = txlog.read_head(stream, blocks)
            while head is not None and not head[0]:  # as the merge does: a head holds a record
                blocks += 1
                head = txlog.read_head(stream, blocks)
        if source.stat().st_size <= blocks * txlog.BLOCK_SIZE:
            assert head is None  # nothing after the head to copy
            return
        got_head, open_record = head
        assert got_head == payloads[: len(got_head)] and got_head
        if open_record is not None:  # the start of the record that goes on after the head
            assert payloads[len(got_head)].startswith(open_record)
        new_first = rnd.randbytes(first)
        splice(source, dest, blocks, new_first)
        data = dest.read_bytes()
        # the blocks after the head are the source's, byte for byte
        tail = source.read_bytes()[blocks * txlog.BLOCK_SIZE :]
        assert len(data) % txlog.BLOCK_SIZE == len(tail) % txlog.BLOCK_SIZE
        assert data.endswith(tail)
        for read_size in (txlog.BLOCK_SIZE, 4 * txlog.BLOCK_SIZE):
            walked, looped = read_both(data, read_size)
            assert walked == looped
            got, report = walked
            assert got == [new_first, *payloads[1:]]
            assert not report.damaged


@pytest.mark.parametrize("left", [0, 3, 7, 8, 500])
def test_head_ends_on_a_clean_boundary_or_an_open_record(left, tmp_path):
    """`left` bytes of block 0 free after the first record: 0-6 is a trailer and the next
    record starts block 1 (no open record); 7 is an empty FIRST chunk; more a FIRST chunk."""
    first = txlog.BLOCK_SIZE - len(txlog.FILE_HEADER) - txlog.CHUNK_HEADER_SIZE - left
    payloads = [b"r" * first, b"s" * 50_000, b"t" * 10]
    source = tmp_path / "a.wandb"
    source.write_bytes(write_all(payloads))
    with open(source, "rb") as stream:
        head = txlog.read_head(stream, 1)
    assert head == (payloads[:1], None if left < 7 else b"s" * (left - 7))
    splice(source, tmp_path / "b.wandb", 1, b"R" * 100)
    assert read_all((tmp_path / "b.wandb").read_bytes()) == (
        [b"R" * 100, *payloads[1:]],
        txlog.ReadReport(records=3, bytes_read=(tmp_path / "b.wandb").stat().st_size),
    )


def test_copy_blocks_starts_on_a_block_boundary(tmp_path):
    source = tmp_path / "a.wandb"
    source.write_bytes(write_all([b"x" * 100_000]))
    with open(source, "rb") as stream, open(tmp_path / "b", "wb") as out:
        writer = txlog.LogWriter(out)
        with pytest.raises(ValueError, match="block boundary"):
            writer.copy_blocks(stream, txlog.BLOCK_SIZE, 100_000, 1)  # not ended yet
        writer.end_block()
        with pytest.raises(ValueError, match="block boundary"):
            writer.copy_blocks(stream, 100, 100_000, 1)


def test_a_logs_last_block_short_of_a_whole_one_is_walked_too(monkeypatch):
    """A log's last block is most of a small log's chunks: when its chunks fill it exactly,
    the walk takes it, not the chunk loop (which checks each chunk's CRC in Python); what
    is read is the same."""
    payloads = [bytes([i % 251]) * (100 + i) for i in range(400)]  # ends mid-block
    data = write_all(payloads)
    assert len(data) % txlog.BLOCK_SIZE
    checked = []
    crc32 = txlog.crc32
    monkeypatch.setattr(txlog, "crc32", lambda *a: checked.append(1) or crc32(*a))
    (got, report), (want, looped) = read_both(data, 32 * txlog.BLOCK_SIZE)
    assert got == want == payloads and report == looped and not report.damaged
    loop_checks = len(checked)
    checked.clear()
    report = txlog.ReadReport()
    frames = txlog.iter_frames(io.BytesIO(data), report, 32 * txlog.BLOCK_SIZE)
    assert [p for f in frames for p in f.payloads()] == payloads
    assert checked == [] and loop_checks > 0

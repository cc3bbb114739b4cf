"""The fast source check (`sourcecheck.CHECKS["fast"]`) against the reference, value by value.

A pass-through proved a copy of its source by bytes (`copyproof`) is not read value by
value; every fault a copy can have (one byte other, a record dropped in the copied blocks
or in the head, a cut log, a run record with another config, a record left open at the
head's end that differs) must leave the copy unproved, and then the fast check names
what the reference names."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from wbmerge.log import BLOCK_SIZE, LogWriter, pb, read_head, read_payloads, record_kind
from wbmerge.sync import MergeRequest, merge_jobs
from wbmerge.training import RankInfo
from wbmerge.verify.copyproof import copied_alike
from wbmerge.verify.sourcecheck import same_run, source_shortfall

from ..conftest import job_dir
from ..support.ranklogs import exit_record, history_record, rank_log, summary_record

CHUNK_HEADER = struct.Struct("<IHB")  # crc32 (of type and payload), length, type
FULL = 1


def staged(tmp_path: Path, name: str, mode: str, scope: str = "global"):
    root = job_dir(name)
    request = MergeRequest([root], run_mode=mode, rank_scope=scope, files_from=[root])
    return merge_jobs(request, tmp_path / "out")


def both(run) -> tuple[list[str] | str, list[str] | str]:
    """(the fast check's lines, the reference's) of a staged run; for a check that raises,
    its error's name and message."""

    def outcome(check: str) -> list[str] | str:
        try:
            return source_shortfall(run.target, run.log_path, check=check)
        except Exception as exc:  # (compared: the same error is the same outcome)
            return f"{type(exc).__name__}: {exc}"

    return outcome("fast"), outcome("reference")


def proved(run) -> bool:
    return copied_alike(run.target.sources[0].path, run.log_path, same_run)


@pytest.mark.parametrize(
    "name", ["recipe_mnist_like", "two_nodes_2x2", "elastic_restart", "killed_rank", "media"]
)
@pytest.mark.parametrize("mode", ["new", "auto", "shared"])
def test_fast_and_reference_checks_agree_on_real_runs(tmp_path, name, mode):
    runs = staged(tmp_path, name, mode)
    assert runs
    for run in runs:
        assert both(run) == ([], [])


def test_a_spliced_pass_through_is_proved_by_its_bytes(tmp_path):
    """The real runs a pass-through splices (head written again, later blocks copied) are
    proved without reading a value; so the shortcut is the one under test below."""
    runs = staged(tmp_path, "recipe_mnist_like", "new")
    spliced = [run for run in runs if _head_blocks(run) is not None]
    assert spliced and all(map(proved, spliced))
    # the source's run record and the staged one differ (names, the wbmerge block)
    for run in spliced:
        [logged] = [p for p in read_payloads(run.target.sources[0].path) if record_kind(p) == "run"]
        [written] = [p for p in read_payloads(run.log_path) if record_kind(p) == "run"]
        assert logged != written and same_run(logged, written)


def spliced_run(tmp_path: Path):
    """A staged pass-through of a real run that the merge spliced, and the block its copied
    part starts at."""
    for run in staged(tmp_path, "recipe_mnist_like", "new"):
        head = _head_blocks(run)
        if head is not None and proved(run):
            return run, head
    raise AssertionError("no spliced pass-through among the fixture's runs")


def _head_blocks(run) -> int | None:
    """How many blocks of a staged log come before the blocks copied from its source as
    they are (found by comparing the two); None when none are copied."""
    source, staged = run.target.sources[0].path.read_bytes(), run.log_path.read_bytes()
    shift, uneven = divmod(len(staged) - len(source), BLOCK_SIZE)
    for head in range(max(1, 1 + shift), len(staged) // BLOCK_SIZE + 1):
        if staged[head * BLOCK_SIZE :] == source[(head - shift) * BLOCK_SIZE :] and not uneven:
            return head if head * BLOCK_SIZE < len(staged) else None
    return None


def full_chunks(data: bytes, block: int) -> list[tuple[int, bytes]]:
    """(offset, payload) of the FULL chunks of block `block` of a log."""
    found = []
    pos = block * BLOCK_SIZE + (7 if block == 0 else 0)
    end = min(len(data), (block + 1) * BLOCK_SIZE)
    while end - pos >= 7:
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if not (crc or length or kind):
            break
        if kind == FULL:
            found.append((pos, data[pos + 7 : pos + 7 + length]))
        pos += 7 + length
    return found


def set_bytes(log: Path, position: int, new: bytes) -> None:
    """Put `new` at `position` of a log, inside one chunk, and make that chunk's CRC right:
    a log the reader takes whole, with other bytes."""
    data = bytearray(log.read_bytes())
    block = position // BLOCK_SIZE
    pos = block * BLOCK_SIZE + (7 if block == 0 else 0)
    while True:
        _, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if pos + 7 <= position and position + len(new) <= pos + 7 + length:
            break
        assert length or kind, "the bytes are in no chunk"
        pos += 7 + length
    data[position : position + len(new)] = new
    body = bytes(data[pos + 7 : pos + 7 + length])
    data[pos : pos + 4] = struct.pack("<I", zlib.crc32(bytes([kind]) + body))
    log.write_bytes(bytes(data))


def one_digit_other(payload: bytes) -> tuple[bytes, str]:
    """A history record with one digit of a user value changed, and the key it is of."""
    record = pb.Record.FromString(payload)
    for item in record.history.item:
        key = item.nested_key[0] if item.nested_key else item.key
        text = item.value_json
        at = next((i for i, c in enumerate(text) if c in "123456789"), None)
        if not key.startswith("_") and at is not None:
            digit = "2" if text[at] == "1" else "1"
            changed = payload.replace(
                text.encode(), (text[:at] + digit + text[at + 1 :]).encode(), 1
            )
            assert changed != payload and len(changed) == len(payload)
            return changed, key
    raise AssertionError("no user value with a digit")


def history_chunk(data: bytes, blocks: range) -> tuple[int, bytes]:
    """The offset and payload of the first whole history record in one of `blocks`."""
    return next(
        (at, p) for b in blocks for at, p in full_chunks(data, b) if record_kind(p) == "history"
    )


@pytest.mark.parametrize("where", ["copied", "head"])
def test_a_copy_that_differs_in_one_byte_is_named(tmp_path, where):
    run, head = spliced_run(tmp_path)
    data = run.log_path.read_bytes()
    blocks = range(head, len(data) // BLOCK_SIZE + 1) if where == "copied" else range(head)
    at, payload = history_chunk(data, blocks)
    changed, key = one_digit_other(payload)
    set_bytes(run.log_path, at + 7, changed)
    assert run.log_path.stat().st_size == len(data)
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference
    [problem] = fast
    assert f"history key {key!r}" in problem and "other values staged" in problem


def test_a_record_dropped_in_the_copied_blocks_is_named(tmp_path):
    """The copied part loses a history record: its chunk is zeros, which ends the block."""
    run, head = spliced_run(tmp_path)
    data = bytearray(run.log_path.read_bytes())
    at, _ = history_chunk(bytes(data), range(head, head + 1))
    data[at : (head + 1) * BLOCK_SIZE] = bytes((head + 1) * BLOCK_SIZE - at)
    run.log_path.write_bytes(bytes(data))
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference
    assert any("values logged" in line and "staged" in line for line in fast), fast


def test_a_copy_cut_at_a_block_boundary_is_named(tmp_path):
    run, head = spliced_run(tmp_path)
    data = run.log_path.read_bytes()
    run.log_path.write_bytes(
        data[: (head + 1) * BLOCK_SIZE]
        if len(data) > (head + 1) * BLOCK_SIZE
        else data[: head * BLOCK_SIZE]
    )
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference and fast


def respliced(run, head: int, change) -> None:
    """The staged log written again as the merge splices it: its head's records through
    `change` (a list of payloads -> a list), the record it leaves open, the rest copied."""
    log = run.log_path
    with open(log, "rb") as stream:
        payloads, open_record = read_head(stream, head)
        rest = stream.seek(0, 2)
        copy = log.with_suffix(".copy")
        with open(copy, "wb") as out, LogWriter(out) as writer:
            for payload in change(payloads):
                writer.write(payload)
            writer.end_block(open_record)
            writer.copy_blocks(stream, head * BLOCK_SIZE, rest, 0)
    copy.replace(log)


def with_config(payloads: list[bytes], key: str, value: str) -> list[bytes]:
    out = []
    for payload in payloads:
        if record_kind(payload) == "run":
            record = pb.Record.FromString(payload)
            item = next(i for i in record.run.config.update if i.key == key)
            item.value_json = value
            payload = record.SerializeToString()
        out.append(payload)
    return out


def test_the_same_splice_written_again_is_proved(tmp_path):
    """The test's own splice (below) makes a log the proof takes, so the faults it makes
    are what leaves a copy unproved."""
    run, head = spliced_run(tmp_path)
    respliced(run, head, lambda payloads: payloads)
    assert proved(run)


def test_a_run_record_with_another_config_value_is_named(tmp_path):
    run, head = spliced_run(tmp_path)
    [logged] = [p for p in read_payloads(run.log_path) if record_kind(p) == "run"]
    config = pb.Record.FromString(logged).run.config
    key = next(i.key for i in config.update if i.key and not i.key.startswith(("_", "wbmerge")))
    respliced(run, head, lambda payloads: with_config(payloads, key, json.dumps("other")))
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference
    [problem] = fast
    assert f"config key {key!r}" in problem and '"other" staged' in problem


def test_a_run_record_with_other_names_and_block_is_proved(tmp_path):
    """What the check does not count of a run record (its names, the `wbmerge` block) may
    differ: a copy is still proved."""
    run, head = spliced_run(tmp_path)

    def renamed(payloads):
        out = []
        for payload in payloads:
            if record_kind(payload) == "run":
                record = pb.Record.FromString(payload)
                record.run.display_name = "another name"
                payload = record.SerializeToString()
            out.append(payload)
        return out

    respliced(run, head, lambda payloads: with_config(renamed(payloads), "wbmerge", "{}"))
    assert proved(run)
    assert both(run) == ([], [])


def test_a_record_dropped_from_the_head_is_named(tmp_path):
    run, head = spliced_run(tmp_path)

    def without_a_row(payloads):
        at = next(i for i, p in enumerate(payloads) if record_kind(p) == "history")
        return payloads[:at] + payloads[at + 1 :]

    respliced(run, head, without_a_row)
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference
    assert any("values logged" in line for line in fast), fast


def test_a_record_left_open_at_the_head_end_that_differs_is_named(tmp_path):
    """A history record that goes on past the head: its start is written again by the
    merge, its end copied. Its start in the staged head other than the source's is a value
    other, though every whole record and every copied byte is the same."""
    root = tmp_path / "job"
    info = RankInfo(0, 0, 1, 1, 0, 0, "open-record")
    with rank_log(root, info, "openrec", "p") as writer:
        for step in range(60):
            writer.write(history_record([("loss", str(1000 + step) + "." + "5" * 900)], step))
            writer.write(summary_record({"loss": 1.5}))
        writer.write(exit_record(0))
    [run] = merge_jobs(MergeRequest([root], run_mode="new"), tmp_path / "out")
    head = _head_blocks(run)
    assert head is not None and proved(run)
    with open(run.log_path, "rb") as stream:
        _, open_record = read_head(stream, head)
    assert open_record and record_kind(open_record) == "history"
    at = open_record.index(b".55555") - 1  # (the last digit of the value's whole part)
    other = b"1" if open_record[at : at + 1] != b"1" else b"2"
    start = run.log_path.read_bytes().index(open_record, (head - 1) * BLOCK_SIZE)
    set_bytes(run.log_path, start + at, other)
    key = "loss"
    assert not proved(run)
    fast, reference = both(run)
    assert fast == reference
    [problem] = fast
    assert f"history key {key!r}" in problem and "other values staged" in problem


def test_broken_bytes_anywhere_give_the_reference_lines(tmp_path):
    """Hostile copies: one byte flipped (the CRC left wrong) at places all over the staged
    log; the reader drops what it cannot read, and the fast check says what the
    reference says."""
    run, _ = spliced_run(tmp_path)
    data = run.log_path.read_bytes()
    for at in range(0, len(data), len(data) // 23):
        broken = bytearray(data)
        broken[at] ^= 0x40
        run.log_path.write_bytes(bytes(broken))
        fast, reference = both(run)
        assert fast == reference, at
    shutil.copyfile(run.target.sources[0].path, run.log_path)  # the source itself, unnamed
    assert both(run)[0] == both(run)[1]

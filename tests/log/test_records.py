"""The array reading of a read's records (`records`) agrees with the one-record functions."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import records, txlog, wire

from ..conftest import FIXTURES
from .test_txlog import write_all

LOGS = [p for p in sorted(FIXTURES.glob("**/run-*.wandb")) if "not_a_log" not in p.parts]


def step_item(history: pb.HistoryRecord) -> int:
    """The step of a record without a step field (wandb 0.16): its last `_step` item that is
    a JSON integer from 0 to 2**63 - 1, else 0."""
    step = 0
    for item in history.item:
        if (list(item.nested_key) or [item.key]) == ["_step"]:
            try:
                value = json.loads(item.value_json)
            except ValueError:
                continue
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
                step = value
    return step


def check_frames(frames: txlog.Frames) -> int:
    """Assert every record's kind, and every history record's step and item fields, as the
    one-record functions give them; returns how many history records were checked."""
    payloads = list(frames.payloads())
    index_of = records.RecordIndex(frames)
    kinds = [records.record_kind(p) for p in payloads]
    assert [index_of.kind(i) for i in range(len(index_of))] == kinds
    history = index_of.history
    assert history.tolist() == [i for i, kind in enumerate(kinds) if kind == "history"]
    assert index_of.of("exit", "stats").tolist() == [
        i for i, kind in enumerate(kinds) if kind in ("exit", "stats")
    ]
    rows = index_of.rows
    in_place = True
    for row, index in enumerate(history.tolist()):
        step, region = wire.history_region(payloads[index])
        assert rows.steps[row] == step
        assert rows.data[rows.starts[row] : rows.ends[row]] == region
        parsed = pb.Record.FromString(payloads[index]).history  # and both as protobuf says
        assert list(pb.HistoryRecord.FromString(region).item) == list(parsed.item)
        assert step == (parsed.step.num if parsed.HasField("step") else step_item(parsed))
        if row not in rows.decoded:  # read in place: wandb's shape, the step field last
            assert parsed.HasField("step") and rows.steps[row] == parsed.step.num
        in_place &= rows.ends[row] <= len(frames.data)  # (an empty region may be at its end)
    assert rows.in_place == in_place
    if in_place:  # the spans hold in the read's own buffer
        assert rows.data == frames.data
    summaries = index_of.summaries
    assert summaries.tolist() == [i for i, kind in enumerate(kinds) if kind == "summary"]
    starts, ends = index_of.summary_spans
    for start, end, index in zip(starts.tolist(), ends.tolist(), summaries.tolist(), strict=True):
        fields = top_level_fields(payloads[index])
        if fields[:1] == [1]:  # `num` first, as wandb writes it
            fields = fields[1:]
        if fields == [wire.RECORD_SUMMARY]:  # the summary is the record's one and last field
            span = wire.submessage(payloads[index], wire.RECORD_SUMMARY)
            offset = frames.starts[index]
            assert (start, end) == (span[0] + offset, span[1] + offset)
        else:  # in another shape: no span, the exact one-record functions take it
            assert (start, end) == (-1, -1)
    return len(history)


def top_level_fields(payload: bytes) -> list[int]:
    """The field numbers of a serialized message, in the order they are written."""
    fields, pos = [], 0
    while pos < len(payload):
        tag, pos = wire.varint(payload, pos)
        fields.append(tag >> 3)
        pos = wire.skip_field(payload, pos, tag & 7)
    return fields


@pytest.mark.parametrize("path", LOGS, ids=lambda p: f"{p.parts[-4]}/{p.name}")
def test_every_fixture_record_reads_as_one_by_one(path):
    with open(path, "rb") as stream:
        for frames in txlog.iter_frames(stream, read_size=2 * txlog.BLOCK_SIZE):
            check_frames(frames)


def test_the_fixtures_have_history_to_check():
    checked = 0
    for path in LOGS:
        for frames in txlog.read_frames(path):
            checked += check_frames(frames)
    assert checked > 500


# values as wandb writes them, one of 200 bytes (a length of two bytes), and ones whose last
# bytes look like a step field (`12 02 08 05`, `12 00`): without a step field of its own, a
# record ending in one must not be read as if it had one
VALUES = ["1", "2.5", '"x"', "NaN", "7", "1" * 200, "1\x12\x02\x08\x05", "2\x12\x00"]


@st.composite
def any_record(draw: st.DrawFn) -> bytes:
    """Records as wandb writes them and in shapes it does not: no `num`, a field after the
    record's body, a step of any size, an empty step, other kinds."""
    record = pb.Record()
    if draw(st.booleans()):
        record.num = draw(st.integers(0, 2**40))
    kind = draw(st.sampled_from(["history", "summary", "stats", "output_raw", "exit"]))
    if kind == "history":
        old_style = draw(st.booleans())  # wandb 0.16: `key`, no step field, a `_step` item
        for _ in range(draw(st.integers(0, 4))):
            item = record.history.item.add()
            name = draw(st.one_of(st.just("_step"), st.text(min_size=1, max_size=12)))
            if old_style:
                item.key = name
            else:
                item.nested_key.append(name)
            item.value_json = draw(st.sampled_from(VALUES))
        step = draw(st.sampled_from(["num", "empty", "none"]))
        if step == "num":
            record.history.step.num = draw(st.integers(0, 2**62))
        elif step == "empty":
            record.history.step.SetInParent()  # `step {}`
    elif kind == "summary":
        item = record.summary.update.add()
        item.key = draw(st.text(min_size=1, max_size=12))
        item.value_json = "1"
    elif kind == "stats":
        record.stats.item.add(key="cpu", value_json="3")
    elif kind == "output_raw":
        record.output_raw.line = draw(st.text(max_size=30))
    else:
        record.exit.exit_code = draw(st.integers(0, 3))
    if draw(st.integers(0, 4)) == 0:
        record.uuid = "after the body"
    payload = record.SerializeToString()
    if record.num and draw(st.integers(0, 4)) == 0:  # fields in another order: `num` last
        num = record.num
        record.num = 0
        payload = record.SerializeToString() + b"\x08" + wire.encode_varint(num)
    return payload


@settings(max_examples=200, deadline=None)
@given(st.lists(any_record(), min_size=1, max_size=40), st.sampled_from([1, 2]))
def test_any_records_read_as_one_by_one(payloads, blocks):
    data = write_all(payloads)
    read = []
    for frames in txlog.iter_frames(io.BytesIO(data), read_size=blocks * txlog.BLOCK_SIZE):
        check_frames(frames)
        read.extend(frames.payloads())
    assert read == payloads

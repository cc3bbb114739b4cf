"""The array reading of a read's records (`records`) agrees with the one-record functions."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import records, txlog, wire

from .conftest import FIXTURES
from .test_txlog import write_all

LOGS = [p for p in sorted(FIXTURES.glob("**/run-*.wandb")) if "not_a_log" not in p.parts]


def check_frames(frames: txlog.Frames) -> int:
    """Assert every record's kind, and every history record's step and item fields, as the
    one-record functions give them; returns how many history records were checked."""
    payloads = list(frames.payloads())
    codes = records.kinds(frames)
    assert [records.KIND_NAMES[c] for c in codes] == [txlog.record_kind(p) for p in payloads]
    history = np.flatnonzero(codes == records.code("history"))
    rows = records.history_rows(frames, history)
    for row, index in enumerate(history.tolist()):
        step, region = wire.history_region(payloads[index])
        assert rows.steps[row] == step
        assert rows.data[rows.starts[row] : rows.ends[row]] == region
    summaries = np.flatnonzero(codes == records.code("summary"))
    starts, ends = records.body_spans(frames, summaries, 0x1A)
    for start, end, index in zip(starts.tolist(), ends.tolist(), summaries.tolist(), strict=True):
        span = wire.submessage(payloads[index], wire.RECORD_SUMMARY)
        offset = frames.starts[index]
        assert (start, end) == (span[0] + offset, span[1] + offset) or start == -1
    return len(history)


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


@st.composite
def any_record(draw: st.DrawFn) -> bytes:
    """Records as wandb writes them and in shapes it does not: no `num`, a field after the
    record's body, a step of any size, an empty step, other kinds."""
    record = pb.Record()
    if draw(st.booleans()):
        record.num = draw(st.integers(0, 2**40))
    kind = draw(st.sampled_from(["history", "summary", "stats", "output_raw", "exit"]))
    if kind == "history":
        for _ in range(draw(st.integers(0, 4))):
            item = record.history.item.add()
            item.nested_key.append(draw(st.text(min_size=1, max_size=12)))
            item.value_json = draw(st.sampled_from(["1", "2.5", '"x"', "NaN"]))
        if draw(st.booleans()):
            record.history.step.num = draw(st.integers(0, 2**62))
        else:
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

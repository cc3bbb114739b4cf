"""A shared merge writes each step's rows as one record, in bulk the same as one by one."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from wandb.proto import wandb_internal_pb2 as pb

from wbmerge import txlog
from wbmerge.merge.labels import RankKeys, label_row
from wbmerge.merge.rows import Rows, merged_row, write_merged

from .test_items import history_records, protobuf_item_fields


@st.composite
def step_rows(draw: st.DrawFn) -> list[tuple[int, int, tuple]]:
    """(step, rank, row) sorted by step then rank, as the merge hands them over: some steps
    without the primary's row, rows with different W&B keys (`_runtime` here, not there)."""
    rows = []
    for step in sorted(draw(st.sets(st.integers(0, 10**6), min_size=1, max_size=6))):
        for rank in sorted(draw(st.sets(st.integers(0, 4), min_size=1, max_size=4))):
            payload = draw(history_records())
            items = protobuf_item_fields(payload)
            rows.append(
                (step, rank, label_row(items, RankKeys(f"rank-{rank}", "{key}/{label}"), False))
            )
    return rows


def as_columns(rows: list[tuple[int, int, tuple]]) -> Rows:
    """(step, rank, row) triples as the columns the merge hands over."""
    steps, ranks, fields = zip(*rows, strict=True)
    columns = map(list, zip(*fields, strict=True))
    return Rows(np.array(steps, np.int64), np.array(ranks, np.int64), *columns)


@settings(max_examples=200, deadline=None)
@given(step_rows(), st.sampled_from([0, 1]))
def test_bulk_merged_rows_are_the_one_by_one_records(rows, primary):
    out = io.BytesIO()
    with txlog.LogWriter(out) as writer:
        written_rows = write_merged(as_columns(rows), writer, primary, False)
    written = list(txlog.iter_payloads(io.BytesIO(out.getvalue())))
    want = []
    for step in sorted({step for step, _, _ in rows}):
        group = [(rank, row) for s, rank, row in rows if s == step]
        want.append(merged_row(step, group, primary, False))
    assert written == want
    assert written_rows == len(want)
    for payload in written:  # and each is a history record protobuf reads
        assert pb.Record.FromString(payload).HasField("history")

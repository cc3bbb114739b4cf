"""Statistics across ranks saved between two rounds of a follow and restored in a new
process: fed the rest of the rows, they write what statistics fed every row at once write.

The expected fields are those of one `MergedRankStats` (or `MergedSpreads`) fed all rows
without a restore; the state passes through the follow's own encoding (`saved.encode`,
JSON, `saved.decode`), as a follower started again reads it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from wbmerge.follow import saved
from wbmerge.log import pb
from wbmerge.merge import DEFAULT_KEY_FORMAT, MergedRankStats, MergedSpreads

RESERVED = ("_step", "_runtime", "_timestamp", "_wandb")
RANKS = {0: (0, 30), 1: (0, 28), 2: (2, 30), 3: (15, 30)}  # rank -> its steps, first to last
CUT = 12  # the first round reads the rows before this step
WRITTEN = 10  # and writes the steps before this one: the rest of its numbers wait


def logged(rank: int, step: int) -> list[tuple[list[str], str]]:
    """Rank `rank`'s items at `step` (key path, JSON text): NaN and the infinities, a key
    logged only early (its last statistics are from before the restore), one first logged
    late (after it), a nested key, a reserved key, a string and a tie."""
    row = [(["_timestamp"], json.dumps(1.7e9 + step)), (["loss"], repr(rank + step / 8))]
    if step % 5 == 1:
        row.append((["loss"], "NaN" if rank == 1 else "Infinity"))  # (a key twice: the last)
    if step % 7 == 3:
        row.append((["acc"], "-Infinity" if rank == 2 else repr(0.5 - rank / 10)))
    else:
        row.append((["acc"], repr(step / (rank + 1))))
    if step < 6:
        row.append((["early"], repr(rank * 1.5 - step)))
    if step >= CUT + 2:
        row.append((["late"], "2.0" if step % 3 else json.dumps(float(rank))))
    if rank != 2:
        row.append((["eval", "loss"], repr(1 / (step + rank + 1))))
    row.append((["note"], '"text"' if step % 2 else "true"))
    return row


def rows_of(first: int, last: int) -> tuple[np.ndarray, np.ndarray, bytes, np.ndarray, np.ndarray]:
    """Every rank's rows of steps `first` to `last - 1` as `add_rows` takes them, each
    rank's together and in step order; their item fields written by protobuf."""
    ranks, steps, regions = [], [], []
    for rank, (begin, end) in RANKS.items():
        for step in range(max(first, begin), min(last, end)):
            record = pb.HistoryRecord()
            for path, value_json in logged(rank, step):
                item = record.item.add()
                if len(path) == 1:
                    item.key = path[0]
                else:
                    item.nested_key.extend(path)
                item.value_json = value_json
            ranks.append(rank)
            steps.append(step)
            regions.append(record.SerializeToString())
    ends = np.cumsum([len(region) for region in regions], dtype=np.int64)
    starts = ends - [len(region) for region in regions]
    return np.array(ranks), np.array(steps), b"".join(regions), starts, ends


def through_a_saved_file(state: dict) -> dict:
    encoded = saved.encode(state, saved.ACROSS)
    return saved.decode(json.loads(json.dumps(encoded, allow_nan=False)), saved.ACROSS)


@pytest.mark.parametrize("kind", [MergedRankStats, MergedSpreads])
def test_statistics_restored_between_two_halves_write_what_one_pass_writes(kind):
    every_step = np.arange(30)
    whole = kind(DEFAULT_KEY_FORMAT, RESERVED)
    whole.add_rows(*rows_of(0, 30), None)
    want_rows = whole.row_fields(every_step)

    first = kind(DEFAULT_KEY_FORMAT, RESERVED)
    first.add_rows(*rows_of(0, CUT), None)
    got_rows = first.row_fields(every_step[:WRITTEN])
    state = through_a_saved_file(first.state())
    again = kind(DEFAULT_KEY_FORMAT, RESERVED)
    again.restore(state)
    again.add_rows(*rows_of(CUT, 30), None)
    got_rows += again.row_fields(every_step[WRITTEN:])

    assert got_rows == want_rows
    assert again.summary_fields() == whole.summary_fields()
    assert again.metrics == whole.metrics
    # (the rows hold what the test means them to: statistics of a key first logged after
    # the restore, in steps whose numbers waited across it; NaN and infinities)
    key = b"late/ranks/max" if kind is MergedRankStats else b"wbmerge/spread/late"
    assert key not in b"".join(got_rows[:CUT]) and key in got_rows[CUT + 2]
    if kind is MergedRankStats:
        assert b"Infinity" in got_rows[1] and b"NaN" in got_rows[1]
        assert b"early/ranks/mean" in whole.summary_fields()
    else:
        assert b"wbmerge/spread/acc" in got_rows[WRITTEN]


def test_a_state_of_other_statistics_is_refused():
    spreads = MergedSpreads(DEFAULT_KEY_FORMAT, RESERVED)
    spreads.add_rows(*rows_of(0, CUT), None)
    with pytest.raises(ValueError, match="statistics"):
        MergedRankStats(DEFAULT_KEY_FORMAT, RESERVED).restore(spreads.state())

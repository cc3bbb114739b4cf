"""Steps continue across elastic restarts the same way row by row and a read at a time."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.steps import Steps


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=4), max_size=4))
def test_a_read_at_a_time_is_place_in_turn(restarts):
    """`restarts`: each restart's reads, each read's raw steps (repeats and rewinds too).
    `place_rows` drops what `place_row` drops; `shifted` keeps every row (as a pass-through
    does) and moves it as `place` does."""
    one, rows, shifted = Steps(), Steps(), Steps()
    for reads in restarts:
        for steps in (one, rows, shifted):
            steps.restart()
        for raw in reads:
            before = one.last
            want = [one.place(step) for step in raw]
            assert shifted.shifted(np.array(raw, np.int64)).tolist() == want
            kept = [
                placed if placed > max([before, *want[:i]]) else -1 for i, placed in enumerate(want)
            ]
            assert rows.place_rows(np.array(raw, np.int64)).tolist() == kept
            assert rows.last == shifted.last == one.last


def test_a_restart_that_repeats_steps_moves_after_them():
    steps = Steps()
    steps.restart()
    assert steps.place_rows(np.array([0, 1, 2, 2, 3])).tolist() == [0, 1, 2, -1, 3]
    steps.restart()  # the restart logs from step 1 again
    assert steps.place_rows(np.array([1, 2])).tolist() == [4, 5]


def test_a_restart_that_repeats_steps_is_shifted_whole():
    steps = Steps()
    steps.restart()
    assert steps.shifted(np.array([0, 1, 2, 2, 3])).tolist() == [0, 1, 2, 2, 3]
    steps.restart()  # logs from step 1 again: every row of it moves by 3
    assert steps.shifted(np.array([1, 2])).tolist() == [4, 5]
    assert steps.shifted(np.array([2, 9])).tolist() == [5, 12]

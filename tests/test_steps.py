"""Steps continue across elastic restarts the same way row by row and a read at a time."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.steps import Steps


def place_row(steps: Steps, step: int) -> int | None:
    """The row rule one row at a time: placed, or None at or before the last row."""
    before = steps.last
    placed = steps.place(step)
    return placed if placed > before else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=4), max_size=4))
def test_place_rows_is_place_row_in_turn(restarts):
    """`restarts`: each restart's reads, each read's raw steps (repeats and rewinds too)."""
    one, batch = Steps(), Steps()
    for reads in restarts:
        one.restart()
        batch.restart()
        for steps in reads:
            want = [place_row(one, step) for step in steps]
            got = batch.place_rows(np.array(steps, np.int64)).tolist()
            assert got == [-1 if w is None else w for w in want]
            assert batch.last == one.last


def test_a_restart_that_repeats_steps_moves_after_them():
    steps = Steps()
    steps.restart()
    assert steps.place_rows(np.array([0, 1, 2, 2, 3])).tolist() == [0, 1, 2, -1, 3]
    steps.restart()  # the restart logs from step 1 again
    assert steps.place_rows(np.array([1, 2])).tolist() == [4, 5]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=4), max_size=4))
def test_shifted_is_place_in_turn(restarts):
    """`shifted` keeps every row (as a pass-through does) and moves it as `place` does."""
    one, batch = Steps(), Steps()
    for reads in restarts:
        one.restart()
        batch.restart()
        for steps in reads:
            want = [one.place(step) for step in steps]
            assert batch.shifted(np.array(steps, np.int64)).tolist() == want
            assert batch.last == one.last


def test_a_restart_that_repeats_steps_is_shifted_whole():
    steps = Steps()
    steps.restart()
    assert steps.shifted(np.array([0, 1, 2, 2, 3])).tolist() == [0, 1, 2, 2, 3]
    steps.restart()  # logs from step 1 again: every row of it moves by 3
    assert steps.shifted(np.array([1, 2])).tolist() == [4, 5]
    assert steps.shifted(np.array([2, 9])).tolist() == [5, 12]

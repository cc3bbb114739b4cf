"""Steps continue across elastic restarts the same way row by row and a read at a time."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.errors import WbmergeError
from wbmerge.log import Steps


class OneByOne:
    """The step rule one row at a time, the reference `Steps` is held to: a restart's first
    row fixes its shift, `max(0, last + 1 - step)`, and every row of the restart moves by it."""

    def __init__(self) -> None:
        self.last, self.shift = -1, None

    def restart(self) -> None:
        self.shift = None

    def place(self, step: int) -> int:
        if self.shift is None:
            self.shift = max(0, self.last + 1 - step)
        self.last = max(self.last, step + self.shift)
        return step + self.shift


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(0, 50), max_size=6), max_size=4), max_size=4))
def test_a_read_at_a_time_is_place_in_turn(restarts):
    """`restarts`: each restart's reads, each read's raw steps (repeats and rewinds too).
    `place_rows` drops a row placed at or before the last; `shifted` keeps every row (as a
    pass-through does); both move a row as the one-row reference does."""
    one, rows, shifted = OneByOne(), Steps(), Steps()
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


LARGEST = 2**63 - 1  # a W&B step is a 64-bit integer


def test_a_restart_moved_past_the_largest_step_is_an_error_not_a_wrap():
    """Restart 1 logs steps 0 and 2**63 - 1 after step 5: moved by 6, its last row would
    pass the largest step; numpy's int64 would wrap it to a negative step in silence."""
    for place in (Steps.shifted, Steps.place_rows):
        steps = Steps()
        steps.restart()
        place(steps, np.array([5]))
        steps.restart()
        with pytest.raises(WbmergeError, match="64-bit"):
            place(steps, np.array([0, LARGEST]))


def test_a_restart_from_far_below_zero_is_moved_exactly():
    """A restart whose first step is -2**63 moves by 2**63 or more, more than an int64
    holds, though every step it moves to fits: after step 7 it goes on at 8, as the first
    restart at 0."""
    for before, want in (([7], [8, 12]), ([], [0, 4])):
        steps = Steps()
        steps.restart()
        steps.shifted(np.array(before, np.int64))
        steps.restart()
        assert steps.shifted(np.array([-(2**63), -(2**63) + 4])).tolist() == want

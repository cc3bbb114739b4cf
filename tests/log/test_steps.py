"""Steps continue across elastic restarts the same way row by row and a read at a time."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wbmerge.errors import WbmergeError
from wbmerge.log import Steps
from wbmerge.log import steps as steps_module


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


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(-1, 40),  # the last step placed before
            st.sampled_from([None, 0, 3]),  # the restart's shift
            st.lists(st.integers(0, 50), max_size=6),  # the read's raw steps
        ),
        max_size=6,
    ),
    st.booleans(),
)
def test_many_reads_are_placed_together_as_read_by_read(reads, rise):
    """`PLACE_WAYS`: every way places each read's rows, and leaves each read's `Steps`, as
    `place_rows` read by read does; `rise` makes most reads simply rise."""
    if rise:
        reads = [
            (last, shift, sorted(set(s + last + 1 for s in raw))) for last, shift, raw in reads
        ]
    bounds = np.cumsum([0, *(len(raw) for _, _, raw in reads)])
    raw = np.array([s for _, _, r in reads for s in r], np.int64)
    answers = {}
    for name, place in steps_module.PLACE_WAYS.items():
        states = [Steps.at(last, shift) for last, shift, _ in reads]
        placed = place(states, raw, bounds)
        answers[name] = (placed.tolist(), [s.place_state() for s in states])
    assert answers["together"] == answers["reference"]


def test_reads_that_rise_are_taken_together_and_a_fall_is_not():
    """The fast way takes a read whose rows rise above its last step; a read that repeats a
    step, starts at or below its last step, or has a restart's shift is placed row by row."""
    reads = [
        (Steps.at(-1, None), [0, 1, 2]),  # rises: taken
        (Steps.at(5, 0), [6, 9]),  # rises: taken
        (Steps.at(5, 0), [7, 7]),  # repeats a step
        (Steps.at(5, None), [5, 6]),  # starts at its last step: moved by 1
        (Steps.at(5, 2), [8, 9]),  # shifted
        (Steps.at(5, None), []),  # no rows
        (Steps.at(1, None), [2, 3]),  # rises, after a read that ends higher
    ]
    bounds = np.cumsum([0, *(len(raw) for _, raw in reads)])
    raw = np.array([s for _, r in reads for s in r], np.int64)
    rising = steps_module.rising_reads([s for s, _ in reads], raw, bounds)
    assert rising.tolist() == [True, True, False, False, False, False, True]
    placed = steps_module.place_reads_together([s for s, _ in reads], raw, bounds)
    assert placed.tolist() == [0, 1, 2, 6, 9, 7, -1, 6, 7, 10, 11, 2, 3]
    assert [s.place_state() for s, _ in reads] == [
        (2, 0),
        (9, 0),
        (7, 0),
        (7, 1),
        (11, 2),
        (5, None),
        (3, 0),
    ]

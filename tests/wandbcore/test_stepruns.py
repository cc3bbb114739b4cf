"""The steps of a log's rows kept as runs (`wbmerge.wandbcore.StepRuns`), against the plain
list of items they stand for: every operation the upload and the follow use gives what the
same operation on the list gives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wbmerge.wandbcore import StagedContent, StepRuns, sent_steps

from ..support.steprows import INT64_MAX, INT64_MIN

# Items as logs hold them: mostly rising runs, with gaps, repeats, rows without a step and
# the ends of int64, where wandb-core goes on from the largest step at the smallest.
ITEM = st.one_of(
    st.none(),
    st.integers(-3, 12),
    st.sampled_from([INT64_MIN, INT64_MIN + 1, INT64_MAX - 1, INT64_MAX]),
)


@st.composite
def items(draw) -> list[int | None]:
    out: list[int | None] = []
    for _ in range(draw(st.integers(0, 8))):
        first = draw(ITEM)
        length = draw(st.integers(1, 5))
        if first is None:
            out += [None] * length
        else:
            out += [first + i for i in range(length) if first + i <= INT64_MAX]
    return out


def test_the_worked_example_is_four_runs():
    steps = StepRuns.of([0, 1, 2, 3, 9, 10, None, None, 11])
    assert steps.runs() == [[0, 4], [9, 2], [None, 2], [11, 1]]
    assert steps[5] == 10
    assert steps[6] is None
    assert len(steps) == 9


def test_a_run_wandb_writes_is_one_run_however_long():
    steps = StepRuns.from_arrays(np.arange(1_000_000, dtype=np.int64), np.ones(1_000_000, bool))
    assert steps.runs() == [[0, 1_000_000]]
    assert steps[999_999] == 999_999
    assert steps[500_000:].runs() == [[500_000, 500_000]]


def test_steps_past_int64s_largest_are_no_run():
    steps = StepRuns.of([INT64_MAX - 1, INT64_MAX, INT64_MIN, INT64_MIN + 1])
    assert steps.runs() == [[INT64_MAX - 1, 2], [INT64_MIN, 2]]
    assert not steps.rising_from(INT64_MIN)


@given(items())
def test_runs_hold_the_items_in_order(listed):
    steps = StepRuns.of(listed)
    assert list(steps) == listed
    assert len(steps) == len(listed)
    assert [steps[i] for i in range(-len(listed), len(listed))] == listed + listed
    assert steps == listed and steps == tuple(listed)
    assert hash(steps) == hash(tuple(listed))  # (equal, so the same key in a dict or set)
    # (a run never continues the one before it: the same items always give the same runs)
    runs = steps.runs()
    for (start, length), (after, _) in zip(runs, runs[1:], strict=False):
        if start is None:
            assert after is not None
        elif after is not None:
            assert after != start + length or start + length - 1 == INT64_MAX


@given(items(), st.integers(-12, 40), st.integers(-12, 40))
def test_a_slice_is_the_slice_of_the_items(listed, first, stop):
    steps = StepRuns.of(listed)
    assert list(steps[first:stop]) == listed[first:stop]
    assert list(steps[first:]) == listed[first:]
    assert steps[first:stop] == StepRuns.of(listed[first:stop])


@given(st.lists(items(), max_size=4))
def test_parts_joined_are_the_items_one_after_another(parts):
    joined = [item for part in parts for item in part]
    assert StepRuns.join(StepRuns.of(p) for p in parts) == StepRuns.of(joined)
    if parts:
        assert StepRuns.of(parts[0]) + joined[len(parts[0]) :] == joined


@given(items(), st.integers(-5, 5))
def test_rising_from_is_each_item_an_integer_above_the_one_before(listed, start):
    rising = all(item is not None for item in listed) and (
        not listed
        or (listed[0] >= start and all(b > a for a, b in zip(listed, listed[1:], strict=False)))
    )
    assert StepRuns.of(listed).rising_from(start) == rising


@given(items())
def test_runs_written_as_json_read_back_equal(listed):
    steps = StepRuns.of(listed)
    again = StepRuns.from_runs(json.loads(json.dumps(steps.runs())))
    assert again == steps and list(again) == listed
    assert hash(again) == hash(steps)


@pytest.mark.parametrize(
    "runs",
    [
        [[0, 0]],  # a run of no rows
        [[0, -1]],
        [[0, 1.5]],
        [[0, True]],
        [["0", 1]],
        [[INT64_MAX, 2]],  # past int64's largest step
        [[INT64_MIN - 1, 1]],
    ],
)
def test_a_pair_that_is_no_run_is_refused(runs):
    with pytest.raises(ValueError):
        StepRuns.from_runs(runs)


@pytest.mark.parametrize(
    "runs",
    [
        [[0, INT64_MAX], [None, INT64_MAX], [0, 2]],  # 2**64 rows, which int64 counts as 0
        [[None, INT64_MAX], [None, INT64_MAX], [0, 7]],  # 2**64 + 5: as 5
        [[None, INT64_MAX], [0, 1]],  # 2**63
    ],
)
def test_runs_of_more_rows_than_int64_counts_are_refused(runs):
    """A hostile state's runs, each a run, whose rows add up past int64: counted in int64
    they would wrap to a count a state's `rows_sent` can agree with."""
    with pytest.raises(ValueError, match="rows"):
        StepRuns.from_runs(runs)


@given(items(), st.integers(-3, 3))
def test_a_logs_sent_steps_are_those_of_the_listed_items(listed, start):
    """`StagedContent` keeps its items as runs; the steps a whole upload and a cut upload
    send are `sent_steps` of the listed items, the reference."""
    content = StagedContent(tuple(listed), 0, 0, start)
    assert isinstance(content.step_items, StepRuns)
    assert list(content.history_steps) == sent_steps(listed, start)
    for row in range(len(listed) + 1):
        assert list(content.steps_sent_from(row)) == sent_steps(listed[row:], start)

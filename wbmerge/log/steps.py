"""The step rule shared by the merge, `export` and `report`: which keys are W&B's own, and
how elastic restarts continue each other's steps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import WbmergeError
from .proto import item_path, pb

# W&B's own keys: never labelled; in a merged row and summary they are the primary's
RESERVED = ("_step", "_runtime", "_timestamp", "_wandb")
# A record's step is a 64-bit integer: a moved step past this would wrap around in numpy.
_LARGEST_STEP = 2**63 - 1


class Steps:
    """Elastic restarts continue the steps: a restart that repeats steps is moved after them.

    Call `restart()` before each restart's records, then `shifted` for each read's rows
    (every row kept, as a pass-through keeps them) or `place_rows`, which also drops a row
    at or before the last one: never two rows at one step. The rule, one row at a time: the
    first row of a restart fixes its shift, `max(0, last + 1 - step)`, and every row of the
    restart moves by it (the tests hold both methods to that reference).
    """

    def __init__(self) -> None:
        self.last = -1
        self._shift: int | None = None

    def restart(self) -> None:
        self._shift = None

    def place_state(self) -> tuple[int, int | None]:
        """(the last step placed, the current restart's shift, None before its first row):
        all a follow must keep to place the rows it reads next (`at`)."""
        return self.last, self._shift

    @classmethod
    def at(cls, last: int, shift: int | None) -> Steps:
        """Steps that go on from `place_state()`."""
        steps = cls()
        steps.last, steps._shift = last, shift
        return steps

    def shifted(self, steps: np.ndarray) -> np.ndarray:
        """Each step moved by its restart's shift, every row kept (as a pass-through keeps them). A
        row moved past the largest step a record holds is bad input (`WbmergeError`), not a
        step wrapped around to a negative one."""
        if not len(steps):
            return steps
        if self._shift is None:
            self._shift = max(0, self.last + 1 - int(steps[0]))
        shift = self._shift
        if int(steps.max()) + shift > _LARGEST_STEP:
            raise WbmergeError(
                f"a restart's step {int(steps.max())}, moved by {shift} to go on after the "
                "restarts before it, leaves the 64-bit range of W&B's steps"
            )
        if shift > _LARGEST_STEP:  # (a first step far below zero) exact in Python's integers
            placed = np.array([step + shift for step in steps.tolist()], np.int64)
        else:
            placed = steps + shift
        self.last = max(self.last, int(placed.max()))
        return placed

    def place_rows(self, steps: np.ndarray) -> np.ndarray:
        """Each step moved by its restart's shift: the placed steps, -1 where a row is dropped (placed
        at or before the last row placed)."""
        last = self.last
        placed = self.shifted(steps)
        if not len(placed):
            return placed
        before = np.maximum.accumulate(np.concatenate([[last], placed[:-1]]))
        return np.where(placed > before, placed, -1)


def place_reads_one_by_one(
    states: Sequence[Steps], steps: np.ndarray, bounds: np.ndarray
) -> np.ndarray:
    """`place_rows` of many reads: read i is `steps[bounds[i]:bounds[i + 1]]`, placed by
    `states[i]` (each read's own `Steps`; a `Steps` placing two reads is called in order)."""
    placed = np.empty(len(steps), np.int64)
    for state, lo, hi in zip(states, bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        placed[lo:hi] = state.place_rows(steps[lo:hi])
    return placed


def rising_reads(states: Sequence[Steps], steps: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Which reads `place_rows` keeps whole and unmoved, found for all reads at once: the
    read has rows, its restart's shift is 0 or is fixed at 0 by its first row, and its steps
    rise, each above the one before and the first above its `Steps`' last."""
    lo, hi = bounds[:-1], bounds[1:]
    rising = hi > lo
    if not rising.any():
        return rising
    lasts = np.fromiter((s.last for s in states), np.int64, len(states))
    unshifted = np.fromiter((s._shift in (None, 0) for s in states), bool, len(states))
    firsts = steps[np.minimum(lo, max(len(steps) - 1, 0))]
    rising &= unshifted & (firsts > lasts)
    falls = np.flatnonzero(steps[1:] <= steps[:-1]) + 1  # row i is not above row i - 1
    if len(falls):
        # a fall at a read's first row is that read's and the read before's boundary
        read_of = np.searchsorted(hi, falls, "right")
        rising[read_of[falls != lo[np.minimum(read_of, len(lo) - 1)]]] = False
    return rising


def place_reads_together(
    states: Sequence[Steps], steps: np.ndarray, bounds: np.ndarray
) -> np.ndarray:
    """`place_reads_one_by_one`, with the reads that rise (`rising_reads`: all, in a job
    without restarts) placed as they are, in one pass; the others read by read."""
    if len(set(map(id, states))) < len(states):  # (a Steps placing two reads: in order)
        return place_reads_one_by_one(states, steps, bounds)
    rising = rising_reads(states, steps, bounds)
    placed = steps.astype(np.int64, copy=True)
    ends = bounds[1:].tolist()
    for i in np.flatnonzero(rising).tolist():
        state = states[i]
        state._shift = 0
        state.last = int(steps[ends[i] - 1])
    for i in np.flatnonzero(~rising).tolist():
        lo, hi = int(bounds[i]), ends[i]
        placed[lo:hi] = states[i].place_rows(steps[lo:hi])
    return placed


# The ways to place many reads' rows: the reference, read by read, and the one the merge
# uses (`WBMERGE_PURE=1` picks the reference); the tests hold them to the same answers.
PLACE_WAYS: dict[str, Callable[[Sequence[Steps], np.ndarray, np.ndarray], np.ndarray]] = {
    "reference": place_reads_one_by_one,
    "together": place_reads_together,
}
place_reads = PLACE_WAYS["reference" if os.environ.get("WBMERGE_PURE") else "together"]


def restep(payload: bytes, placed: int) -> bytes:
    """A pass-through history record moved to step `placed` (`Steps.shifted`): its restart
    repeated earlier steps. Its `_step` items say `placed` in each form they have: the JSON
    text, and the typed value wandb writes beside it when told to (wandb-core reads that
    one first)."""
    record = pb.Record.FromString(payload)
    record.history.step.num = placed
    for item in record.history.item:
        if item_path(item) == ["_step"]:
            item.value_json = str(placed)
            if item.WhichOneof("value") is not None:
                item.integer = placed
    return record.SerializeToString()

"""The step rule shared by the merge, `export` and `report`: which keys are W&B's own, and
how elastic restarts continue each other's steps.
"""

from __future__ import annotations

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

"""The `_step` of every history row of a log, kept as runs of consecutive integers.

A follow keeps the steps of every row it sent for as long as the run lasts, and a sync of
a run of a million steps counts as many. As a tuple of Python integers that costs about 40
bytes a row; as runs it costs 17 bytes a run, and every log wandb writes is one run
(`_step` 0, 1, 2, ...) or a few (a resumed run, a `step=` the user skips ahead with).

Worked example: the items 0, 1, 2, 3, 9, 10, None, None, 11 are four runs, starts
(0, 9, -, 11) and lengths (4, 2, 2, 1), the third run's items None (rows without an
integer `_step`). Row 5 is in the second run, at offset 1: step 10.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import overload

import numpy as np

INT64_MAX = 2**63 - 1


class StepRuns(Sequence):
    """A sequence of history rows' step items (an integer, or None), stored as runs.

    It compares equal to any sequence of the same items (a tuple, a list), so it can
    stand wherever a tuple of steps stood. Build one with `of`, `from_arrays` or
    `from_runs`; it is immutable.
    """

    __slots__ = ("_starts", "_lengths", "_known", "_ends")

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, known: np.ndarray) -> None:
        # (the arrays are joined where runs meet, so that equal items give equal runs)
        self._starts, self._lengths, self._known = _joined(starts, lengths, known)
        self._ends = np.cumsum(self._lengths)

    @classmethod
    def of(cls, items: Iterable[int | None]) -> StepRuns:
        """The items given one by one (each an int64 integer or None)."""
        if isinstance(items, StepRuns):
            return items
        items = list(items)
        known = np.fromiter((item is not None for item in items), bool, len(items))
        steps = np.fromiter((0 if item is None else item for item in items), np.int64, len(items))
        return cls.from_arrays(steps, known)

    @classmethod
    def from_arrays(cls, steps: np.ndarray, known: np.ndarray) -> StepRuns:
        """The items `steps[i]` where `known[i]`, else None."""
        count = len(steps)
        return cls(np.asarray(steps, np.int64), np.ones(count, np.int64), np.asarray(known, bool))

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence]) -> StepRuns:
        """The inverse of `runs`; ValueError on a pair that is no run (a hostile state)."""
        runs = list(runs)
        for start, length in runs:
            if type(length) is not int or length < 1:
                raise ValueError(f"a run of {length!r} steps")
            if start is not None and not (
                type(start) is int and -(2**63) <= start and start + length - 1 <= INT64_MAX
            ):
                raise ValueError(f"a run of steps from {start!r}")
        # (counted in int64, more rows would wrap to a count a state's `rows_sent` may match)
        if sum(length for _, length in runs) > INT64_MAX:
            raise ValueError("runs of more rows than int64 counts")
        starts = np.array([0 if start is None else start for start, _ in runs], np.int64)
        lengths = np.array([length for _, length in runs], np.int64)
        known = np.array([start is not None for start, _ in runs], bool)
        return cls(starts, lengths, known)

    @classmethod
    def join(cls, parts: Iterable[StepRuns]) -> StepRuns:
        """The parts one after another."""
        parts = list(parts)
        if not parts:
            return cls.of(())
        return cls(
            np.concatenate([p._starts for p in parts]),
            np.concatenate([p._lengths for p in parts]),
            np.concatenate([p._known for p in parts]),
        )

    def runs(self) -> list[list]:
        """The runs as [first step, rows] pairs (first step None for rows without one):
        JSON, for a follow's saved state."""
        return [
            [int(start) if known else None, int(length)]
            for start, length, known in zip(
                self._starts.tolist(), self._lengths.tolist(), self._known.tolist(), strict=True
            )
        ]

    def rising_from(self, start: int) -> bool:
        """Whether every item is an integer, the first at least `start` and each above the
        one before (as in every log wandb writes): checked run by run."""
        if not len(self._lengths):
            return True
        if not self._known.all() or int(self._starts[0]) < start:
            return False
        lasts = self._starts + (self._lengths - 1)  # (no overflow: a run ends in int64)
        return bool((self._starts[1:] > lasts[:-1]).all())

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @overload
    def __getitem__(self, index: int) -> int | None: ...

    @overload
    def __getitem__(self, index: slice) -> StepRuns: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            first, stop, stride = index.indices(len(self))
            if stride != 1:
                return StepRuns.of(list(self)[index])
            return self._between(first, max(first, stop))
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("step index out of range")
        run = int(np.searchsorted(self._ends, index, side="right"))
        if not self._known[run]:
            return None
        return int(self._starts[run]) + index - (int(self._ends[run]) - int(self._lengths[run]))

    def _between(self, first: int, stop: int) -> StepRuns:
        """Rows `first` to `stop` (not included), in O(runs)."""
        if first >= stop:
            return StepRuns.of(())
        begins = self._ends - self._lengths
        head = int(np.searchsorted(self._ends, first, side="right"))
        tail = int(np.searchsorted(self._ends, stop - 1, side="right"))
        starts = self._starts[head : tail + 1].copy()
        lengths = self._lengths[head : tail + 1].copy()
        known = self._known[head : tail + 1]
        skipped = first - int(begins[head])
        starts[0] += skipped * int(known[0])  # (an unknown run's start stays 0)
        lengths[0] -= skipped
        lengths[-1] -= int(self._ends[tail]) - stop
        return StepRuns(starts, lengths, known)

    def __iter__(self) -> Iterator[int | None]:
        for start, length, known in zip(
            self._starts.tolist(), self._lengths.tolist(), self._known.tolist(), strict=True
        ):
            if known:
                yield from range(start, start + length)
            else:
                yield from repeat(None, length)

    def __add__(self, other: Sequence[int | None]) -> StepRuns:
        return StepRuns.join([self, StepRuns.of(other)])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepRuns):
            return (
                np.array_equal(self._starts * self._known, other._starts * other._known)
                and np.array_equal(self._lengths, other._lengths)
                and np.array_equal(self._known, other._known)
            )
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(
                a == b and (a is None) == (b is None) for a, b in zip(self, other, strict=True)
            )
        return NotImplemented

    def __hash__(self) -> int:
        # The tuple's hash, as it compares equal to the tuple: a row at a time, but nothing
        # on a round's path hashes the steps.
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"StepRuns.from_runs({self.runs()!r})"


def _joined(
    starts: np.ndarray, lengths: np.ndarray, known: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs with each run that continues the one before it merged into it: two runs of
    unknown items, or a known run starting where the one before it ends (not past int64's
    largest step, after which wandb-core goes on at its smallest)."""
    starts = np.where(known, starts, 0).astype(np.int64, copy=False)
    if len(lengths) < 2:
        return starts, np.asarray(lengths, np.int64), np.asarray(known, bool)
    lasts = starts[:-1] + (lengths[:-1] - 1)
    below_max = lasts < INT64_MAX
    follows = np.where(
        known[1:] & known[:-1],
        below_max & (starts[1:] == np.where(below_max, lasts, 0) + 1),
        ~known[1:] & ~known[:-1],
    )
    begins = np.flatnonzero(np.concatenate(([True], ~follows)))
    return starts[begins], np.add.reduceat(lengths, begins), known[begins]

"""Proof that the server holds every history row of a run once, with the values sent.

A server's line count is only the next line number it expects (W&B's, and the sink's, is
the highest line held plus one), so a count that matches does not show that every line
arrived: a server that acknowledged a batch and lost it (wandb#12269) still counts past
it, and two writers of one run leave some steps twice. So after an upload every row is
read back by step, in pages, the way the public API's `scan_history` reads a run, and
compared with the steps the upload sent: each must be there exactly once, and nothing
else. The values of a sample of rows (or of every row, `full`) are compared too.

This module decides what to ask and what the answers mean; `readback.rows_not_held` asks.

Pages are step windows that each hold about `PAGE` of the steps sent, so that a run that
logs every 100th step is read in as few requests as one that logs every step. A window
is asked for with room for `SLACK` times its rows; an answer that fills that room may be
a sample (W&B samples a range it would return too much of), so the window is halved and
each half asked again, until no answer is full. Worked example, steps 0..4999 sent and
`PAGE` 1000: windows [-2**63, 1000), [1000, 2000), ..., [4000, 5000) and a last one from
5000 on to one past the server's last step (a row outside the sent ones is one too many).

In every log wandb writes the steps sent rise, one row per step. A log whose `_step`
items run past 2**63 - 1 makes wandb-core wrap around to negative steps and send some
steps twice (`sentrows`); so the steps are compared as counts (each step held as often as
it was sent), and a row at step 2**63 - 1 itself, which no step range can name (the end
is exclusive), is left to the line count.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .remainder import same_value

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # W&B's steps are int64
PAGE = 1000  # steps sent per window: the public API's page size
SLACK = 4  # a window is asked for with room for this many times its rows
SAMPLED_ROWS = 64  # rows whose values are compared when not every row is
# The keys wandb-core adds to every row it sends, not in the staged row's items.
ADDED_BY_UPLOAD = frozenset({"_step", "_runtime", "_timestamp"})
_PLAIN = frozenset({int, float, str, bool, type(None)})


def windows(order: Sequence[int], last_held: int | None, page: int = PAGE) -> list[tuple[int, int]]:
    """Step windows [start, end) that together cover every step from the least int64 to
    past both the last step sent and the last one the server holds, each holding at most
    `page` of the steps sent (`order`: the steps sent, sorted)."""
    top = max(order[-1] if order else -1, -1 if last_held is None else last_held)
    end = min(top + 1, INT64_MAX)
    bounds = [INT64_MIN]
    for i in range(page, len(order), page):
        if bounds[-1] < order[i] < end:
            bounds.append(order[i])
    bounds.append(end)
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def room(window: tuple[int, int], order: Sequence[int]) -> int:
    """How many rows to ask a window for: `SLACK` times the steps sent in it (`order`:
    sorted), at least 16."""
    inside = bisect.bisect_left(order, window[1]) - bisect.bisect_left(order, window[0])
    return max(16, SLACK * inside)


def halves(window: tuple[int, int]) -> list[tuple[int, int]]:
    """A window too full to be read whole, cut in two (a window of one step cannot be: its
    rows are all the same step, and `room` then asks for more)."""
    lo, hi = window
    middle = (lo + hi) // 2
    return [(lo, middle), (middle, hi)] if hi - lo > 1 else [window]


@dataclass
class StepCheck:
    """How the steps the server holds differ from the steps sent."""

    missing: list[int] = field(default_factory=list)  # held less often than sent
    lacking: int = 0  # the rows those steps lack in all
    twice: list[int] = field(default_factory=list)  # held more often than sent
    extra: list[int] = field(default_factory=list)  # held, never sent
    unstepped: int = 0  # rows held without a whole-number `_step`

    def problems(self, sent: int) -> list[str]:
        """One phrase per kind of difference, naming the steps."""
        out = []
        if self.missing:
            out.append(
                f"the server lacks {self.lacking:,} of {sent:,} rows sent "
                f"(steps {spans(self.missing)})"
            )
        if self.twice:
            out.append(
                f"the server holds {len(self.twice):,} steps more often than they were "
                f"sent (steps {spans(self.twice)})"
            )
        if self.extra:
            out.append(
                f"the server holds rows at {len(self.extra):,} steps that were not sent "
                f"(steps {spans(self.extra)})"
            )
        if self.unstepped:
            out.append(f"the server holds {self.unstepped:,} rows without a _step")
        return out


def compare_steps(sent: Iterable[int], held: Iterable[int | None]) -> StepCheck:
    """How the steps `held` (the rows read back, in any order) differ from the steps `sent`,
    each step counted as often as it occurs.

    >>> check = compare_steps([0, 1, 2, 3], [0, 2, 2, 3, 9])
    >>> check.missing, check.twice, check.extra
    ([1], [2], [9])
    """
    want, got = Counter(sent), Counter()
    check = StepCheck()
    for step in held:
        if step is None:
            check.unstepped += 1
        else:
            got[step] += 1
    check.missing = sorted(step for step, count in want.items() if got[step] < count)
    check.lacking = sum(want[step] - got[step] for step in check.missing)
    check.twice = sorted(step for step, count in got.items() if 0 < want[step] < count)
    check.extra = sorted(step for step in got if step not in want)
    return check


def spans(steps: Sequence[int], shown: int = 4) -> str:
    """`1000-6693, 7000, 7002-7010 and 3 more ranges` for sorted steps."""
    ranges: list[tuple[int, int]] = []
    for step in steps:
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], step)
        else:
            ranges.append((step, step))
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges[:shown])
    more = len(ranges) - shown
    return text + (f" and {more} more range{'s' * (more != 1)}" if more > 0 else "")


def sampled(count: int, most: int = SAMPLED_ROWS) -> list[int]:
    """Indices of the rows whose values are compared: `most` of `count`, spread evenly,
    the first and the last among them."""
    if count <= most:
        return list(range(count))
    last = count - 1
    return sorted({round(i * last / (most - 1)) for i in range(most)})


def value_problem(step: int, staged: dict, held: dict) -> str | None:
    """How the row the server holds at `step` differs from the staged row, or None."""
    for key, value in staged.items():
        if key == "_step":
            continue
        if key not in held:
            return f"the row at step {step} lacks {key!r}"
        got = held[key]
        # (a number or text of one type and equal is the same to `same_value`; NaN and
        # containers, where `==` is not its rule, go to it)
        if type(got) is type(value) and type(value) in _PLAIN and got == value:
            continue
        if not same_value(got, value):
            return f"the row at step {step} holds {key!r} = {got!r}, sent {value!r}"
    extra = sorted(set(held) - set(staged) - ADDED_BY_UPLOAD)
    if extra:
        return f"the row at step {step} holds {extra[0]!r}, which was not sent"
    return None

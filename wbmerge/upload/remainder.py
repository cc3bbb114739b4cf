"""What is still to send, from what was staged and what the server holds: pure functions.

How `wandb sync` (wandb-core 0.31) continues a run that already exists, which this relies on:

- The first UpsertBucket answer carries the run's `historyLineCount`; wandb-core sends the
  log's history lines from that offset on. So if the server holds the first H rows of a
  staged run, dropping the first H history records from the log sends exactly the rest,
  each at its own line number and with its own `_step` (sync sends history records as they
  are stored; it renumbers no step unless told to resume, which wbmerge never asks).
- System-metric ("events") lines and console (`output.log`) lines start at offset 0 again.
  W&B and the sink keep file_stream lines by offset, so sending all of them again rewrites
  the same lines in place: once, not twice. They are therefore always sent whole.
- Files are put again by name (the same name replaces the file); config is merged and the
  summary replaced; the exit record sends the final state.

The server is checked to hold a prefix of the staged run (its row count and the `_step` of
its last row); anything else (rows of another merge, duplicates of an older tool) is a
`Mismatch`, refused rather than "repaired".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import records
from ..content import StagedContent
from ..proto import pb
from ..txlog import LogWriter, read_frames
from .server import Held


@dataclass(frozen=True)
class Remainder:
    """What to send of a staged log: all of it but the first `skip_history` history rows."""

    skip_history: int

    @property
    def resends(self) -> bool:
        return self.skip_history > 0


class Mismatch(ValueError):
    """The server holds rows of this run that are not a prefix of the staged run."""


def remainder(
    staged: StagedContent, held: Held, staged_row: Callable[[int], dict] | None = None
) -> Remainder:
    """The part of `staged` the server lacks (see the module docstring for why this suffices).

    `staged_row(i)` gives the staged history row i; with it, the server's last row must
    equal the staged row at its place (same keys and values), not only have its `_step`.
    """
    have = held.history_lines if held.exists else 0
    if have == 0:
        return Remainder(0)
    rows = len(staged.history_steps)
    if have > rows:
        raise Mismatch(f"the server holds {have} history rows, more than the {rows} staged")
    expected = staged.history_steps[have - 1]
    if expected is not None and held.last_step != expected:
        raise Mismatch(
            f"the server's row {have} has _step {held.last_step}, the staged row {expected}"
        )
    if staged_row is not None and held.last_row is not None:
        if not same_value(staged_row(have - 1), held.last_row):
            raise Mismatch(f"the server's row {have} differs from the staged row {have}")
    return Remainder(have)


def same_value(a: object, b: object) -> bool:
    """JSON values equal as W&B sees them: numbers by value (wandb-core writes the float 5.0
    as `5`), NaN equal to NaN, objects key by key, lists item by item."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers):
        if isinstance(a, bool) or isinstance(b, bool):
            return a is b
        return a == b or (a != a and b != b)  # NaN is the one value not equal to itself
    return a == b


def history_row(log: Path, index: int) -> dict:
    """History row `index` of a log as wandb-core sends it: nested keys as nested objects,
    and `_step` the record's step field when it has one (in rows wandb writes, the `_step`
    wandb-core sends; see `content._step_of`)."""
    seen = 0
    for read in records.read_indexed(log):
        history = read.history
        if seen + len(history) > index:
            row: dict = {}
            payload = read.frames.payload(int(history[index - seen]))
            record = pb.Record.FromString(payload).history
            for item in record.item:
                keys = list(item.nested_key) or [item.key]
                target = row
                for key in keys[:-1]:
                    target = target.setdefault(key, {})
                try:
                    target[keys[-1]] = json.loads(item.value_json)
                except (ValueError, RecursionError):  # not JSON to us: cannot equal the server's
                    target[keys[-1]] = {"unparsed value": item.value_json}
            if record.HasField("step"):
                row["_step"] = record.step.num
            return row
        seen += len(history)
    raise IndexError(index)


def shortfall(staged: StagedContent, held: Held) -> list[str]:
    """What the server lacks (or holds too much of) after a whole upload; [] when all is there."""
    if not held.exists:
        return ["the run is not on the server"]
    problems = []
    rows = len(staged.history_steps)
    if held.history_lines != rows:
        problems.append(f"history rows {held.history_lines} of {rows}")
    elif (
        rows and staged.history_steps[-1] is not None and held.last_step != staged.history_steps[-1]
    ):
        problems.append(f"last _step {held.last_step}, staged {staged.history_steps[-1]}")
    if held.events_lines < staged.events:
        problems.append(f"system-metric rows {held.events_lines} of {staged.events}")
    if staged.console_lines is not None and held.log_lines < staged.console_lines:
        problems.append(f"console lines {held.log_lines} of {staged.console_lines}")
    return problems


def write_remainder(log: Path, out: Path, plan: Remainder) -> int:
    """Write `log` without its first `plan.skip_history` history records; returns records.

    A read's records are kept or skipped as spans and framed together (`write_many`
    frames them as `write` of each would), so the log is not re-framed record by record."""
    to_skip = plan.skip_history
    with open(out, "wb") as stream, LogWriter(stream) as writer:
        for frames in read_frames(log):
            keep = np.ones(len(frames), bool)
            if to_skip:
                skipped = records.RecordIndex(frames).history[:to_skip]
                keep[skipped] = False
                to_skip -= len(skipped)
            kept = np.flatnonzero(keep)
            writer.write_many(frames.data, frames.starts[kept].tolist(), frames.ends[kept].tolist())
        return writer.records

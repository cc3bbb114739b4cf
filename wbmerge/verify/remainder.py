"""What is still to send, from what was staged and what the server holds: pure functions.

How `wandb sync` (wandb-core 0.31) continues a run that already exists, which this relies on:

- The first UpsertBucket answer carries the run's `historyLineCount`; wandb-core sends the
  log's history lines from that offset on. So if the server holds the first H rows of a
  staged run, dropping the first H history records from the log sends exactly the rest,
  each at its own line number. It numbers their `_step` from the run's starting step again
  (`sentrows`). For rows wandb writes, that is each row's own `_step` item, as in a whole
  upload; a row it would number otherwise (in an edited log) is given the `_step` of a
  whole upload before it is sent, so that a cut upload ends as a whole one would.
- System-metric ("events") lines and console (`output.log`) lines start at offset 0 again.
  W&B and the sink keep file_stream lines by offset, so sending all of them again rewrites
  the same lines in place: once, not twice. They are therefore always sent whole.
- Files are put again by name (the same name replaces the file); config is merged and the
  summary replaced; the exit record sends the final state.

The server is checked to hold a prefix of the staged run (its row count, and the `_step` and
values of its last row, and no more system-metric rows than staged); anything else (rows of
another merge, duplicates of an older tool, every rank's system metrics where the staged run
has the primary's) is a `Mismatch`, refused rather than "repaired".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..log import LogWriter, read_frames, records
from ..upload import Held, read_json
from ..wandbcore import StagedContent, sentrows


@dataclass(frozen=True)
class Remainder:
    """What to send of a staged log: all of it but the first `skip_history` history rows,
    with the rows `resteps` names (by their index in the log) moved to the `_step` given."""

    skip_history: int
    resteps: dict[int, int] = field(default_factory=dict)

    @property
    def resends(self) -> bool:
        return self.skip_history > 0


class Mismatch(ValueError):
    """The server holds rows of this run that are not a prefix of the staged run.
    `resend_mends`: whether `sync --resend` (each line sent again over the one at its
    place) would leave the run exact; it never removes lines the server holds past the
    staged run's."""

    def __init__(self, message: str, resend_mends: bool = True) -> None:
        super().__init__(message)
        self.resend_mends = resend_mends


def remainder(
    staged: StagedContent, held: Held, staged_row: Callable[[int], dict] | None = None
) -> Remainder:
    """The part of `staged` the server lacks (see the module docstring for why this suffices).

    `staged_row(i)` gives the staged history row i; with it, the server's last row must
    equal the staged row at its place (same keys and values), not only have its `_step`.

    The server's rows are expected at the `_step` a whole upload gives them; the rows the
    upload that continues the run would number otherwise are moved there (`resteps`).
    """
    if extra := held_beyond(staged, held):
        raise Mismatch(extra[0], resend_mends=False)
    have = held.history_lines if held.exists else 0
    if have == 0:
        return Remainder(0)
    rows = len(staged.step_items)
    if have > rows:
        raise Mismatch(
            f"the server holds {have} history rows, more than the {rows} staged",
            resend_mends=False,
        )
    expected = staged.history_steps[have - 1]
    if held.last_step != expected:
        raise Mismatch(
            f"the server's row {have} has _step {held.last_step}, the staged row {expected}"
        )
    if staged_row is not None and held.last_row is not None:
        row = {**staged_row(have - 1), "_step": expected}  # (the `_step` it was sent at)
        if not same_value(row, held.last_row):
            raise Mismatch(f"the server's row {have} differs from the staged row {have}")
    whole = staged.history_steps[have:]
    cut = staged.steps_sent_from(have)
    if cut == whole:  # (every log wandb writes: compared run by run)
        return Remainder(have)
    resteps = {have + i: s for i, (s, c) in enumerate(zip(whole, cut, strict=True)) if s != c}
    if resteps:  # (only in an edited log) the moved rows must then be sent where they belong
        items = [resteps.get(have + i, item) for i, item in enumerate(staged.step_items[have:])]
        if sentrows.sent_steps(items, staged.starting_step) != whole:
            raise Mismatch(  # (only past int64's largest step, below the starting step)
                f"rows after the server's row {have} cannot be sent at their steps again"
            )
    return Remainder(have, resteps)


def resend_whole(
    staged: StagedContent, held: Held, config_keys: Collection[str] | None = ()
) -> Remainder:
    """The plan of `sync --resend`: all of `staged` again, each line over the one at its
    place (the relay puts wandb-core's first line at line 0). Lines are replaced, never
    removed, and the server merges the config it is sent into the one it holds, so a
    server holding more than is staged (history, system-metric or console lines, or a
    config key that none of the staged log's records sets, `config_keys`) is a Mismatch:
    the run would keep them. `config_keys` None: the config is not checked
    (`Delivery.config_checked`), since a key left there does not fail the run."""
    rows = len(staged.step_items)
    if held.history_lines > rows:
        raise Mismatch(
            f"the server holds {held.history_lines} history rows, more than the {rows} staged, "
            "and sending the run again cannot remove rows",
            resend_mends=False,
        )
    if extra := held_beyond(staged, held):
        raise Mismatch(f"{extra[0]}, and sending the run again cannot remove rows", False)
    if held.log_lines > staged.console_lines:
        raise Mismatch(
            f"the server holds {held.log_lines} console lines, more than the "
            f"{staged.console_lines} staged, and sending the run again cannot remove them",
            resend_mends=False,
        )
    if config_keys is not None:
        keeps_no_config(held, config_keys)
    return Remainder(0)


def keeps_no_config(held: Held, config_keys: Collection[str]) -> None:
    """A Mismatch when the server's config holds a key that none of the staged log's
    records sets (`config_left_behind`): no upload of the staged run can remove it."""
    if left := config_left_behind(held.config_json, config_keys):
        raise Mismatch(
            f"the server's config holds {', '.join(left[:3])}{' ...' * (len(left) > 3)}, "
            "which the staged run does not, and sending the run again cannot remove them",
            resend_mends=False,
        )


def config_left_behind(config_json: str, config_keys: Collection[str]) -> list[str]:
    """The top-level keys of the server's config (JSON text) that are not among
    `config_keys`, the keys the staged log's records set (`logged_config_keys`). The
    server merges the config it is sent into the one it holds, keeping every key once
    sent (wandb issue #11055), so these stay after any upload of the staged run. A key's
    value is replaced whole by wandb's uploader (wandb issue #9844), so keys inside an
    object are not left over. Keys that start with `_` are wandb's own. Example: the
    server's `{"lr": ..., "old": ...}` and the keys {"lr"} give ["old"]."""
    try:
        held = json.loads(config_json) if config_json else {}
    except (ValueError, RecursionError):
        return []
    if not isinstance(held, dict):
        return []
    return sorted(key for key in held if not key.startswith("_") and key not in config_keys)


def not_a_beginning(what: str, sources_changed: bool) -> str:
    """The refusal of a run the server holds other rows of: what differs (`what`), and
    why; `sources_changed` when this machine's ledger verified the run from other files
    or settings (the likeliest cause, said for sure)."""
    why = (
        "this machine verified it from other files or settings before: its sources or "
        "options changed since"
        if sources_changed
        else "its sources changed since an earlier upload, or it was uploaded with another "
        "run mode or other options, such as --system-metrics all?"
    )
    return f"{what}: the server's run is not a beginning of this one ({why}) and is left as it is"


def sends_no_row(staged: StagedContent, plan: Remainder) -> str | None:
    """What a user should know of a run sent again with none of its rows, the server
    holding all of them (its files, names or state were not whole): wandb-core gives the
    summary its `_step` only from the rows an upload sends, and nothing else sets it (a
    summary record's `_step` is dropped; measured with wandb 0.31), so the run's summary
    on the server then lacks `_step`. None when the upload sends a row, or there is none."""
    if not staged.step_items or plan.skip_history < len(staged.step_items):
        return None
    return (
        f"sent again with no row (the server holds all {plan.skip_history}), so its summary "
        "on the server now lacks `_step`: wandb-core sets it only from the rows an upload sends"
    )


def with_last_row(staged: StagedContent, plan: Remainder) -> Remainder:
    """`plan` of a run the server holds every row of, made to send the last row again, over
    the line that holds it, so that the summary gets its `_step` (see `sends_no_row`):
    a run whose rows are whole but whose summary, config, console or files are not ends
    exact in one upload. `plan` as it is when it sends a row already, or when the last
    row would go at another step than the one it is held at (an edited log)."""
    rows = len(staged.step_items)
    if not rows or plan.skip_history < rows:
        return plan
    last = rows - 1
    if staged.steps_sent_from(last) != staged.history_steps[last:]:
        return plan
    return Remainder(last)


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
    """History row `index` of a log as wandb-core builds it from the items (`sentrows.row_of`):
    nested keys as nested objects, items it drops left out. Its `_step` is what its items
    say; the `_step` it is sent at is `StagedContent.history_steps`."""
    for _, row in staged_rows(log, [index]):
        return row
    raise IndexError(index)


def staged_rows(log: Path, indices: Sequence[int]) -> Iterator[tuple[int, dict]]:
    """History rows `indices` (rising) of a staged log as wandb-core sends them
    (`sentrows.row_of`), in one pass; only those rows are parsed, their texts by orjson
    where it reads them as `json` does (`upload.read_json`)."""
    wanted, at, seen = list(indices), 0, 0
    for read in records.read_indexed(log):
        history = read.history
        while at < len(wanted) and wanted[at] < seen + len(history):
            payload = read.frames.payload(int(history[wanted[at] - seen]))
            yield wanted[at], sentrows.record_row(payload, read_json)
            at += 1
        seen += len(history)
        if at == len(wanted):
            return


def shortfall(staged: StagedContent, held: Held) -> list[str]:
    """What the server lacks (or holds too much of) after a whole upload; [] when all is there."""
    if not held.exists:
        return ["the run is not on the server"]
    problems = []
    rows = len(staged.step_items)
    if held.history_lines != rows:
        problems.append(f"history rows {held.history_lines} of {rows}")
    elif rows and held.last_step != staged.history_steps[-1]:
        problems.append(f"last _step {held.last_step}, staged {staged.history_steps[-1]}")
    if held.events_lines < staged.events:
        problems.append(f"system-metric rows {held.events_lines} of {staged.events}")
    if held.log_lines < staged.console_lines:
        problems.append(f"console lines {held.log_lines} of {staged.console_lines}")
    return problems + held_beyond(staged, held)


def held_beyond(staged: StagedContent, held: Held) -> list[str]:
    """The system-metric rows the server holds past the staged run's.

    An upload of the staged run rewrites these lines from the first on (see the module
    docstring), and a run only gains them as its ranks write, so more than the staged run
    has are another run's: for example one synced before with every rank's system metrics
    (`--system-metrics all`), which an upload of the primary's alone would leave mixed.
    Console lines are not held to this: the lines a shared run's console makes can shrink
    from one round of a follow to the next, when a rank that lagged adds cursor moves
    (progress bars) among lines sent already."""
    if held.events_lines > staged.events:
        return [
            f"the server holds {held.events_lines} system-metric rows, more than the "
            f"{staged.events} staged"
        ]
    return []


def write_remainder(log: Path, out: Path, plan: Remainder) -> int:
    """Write `log` without its first `plan.skip_history` history records, the rows of
    `plan.resteps` moved to their step (`sentrows.with_step`); returns records written.

    A read's records are kept or skipped as spans and framed together (`write_many`
    frames them as `write` of each would), so the log is not re-framed record by record."""
    to_skip = plan.skip_history
    row = 0  # the index in the log of the read's first history record
    moved_rows = np.array(sorted(plan.resteps), np.int64)
    with open(out, "wb") as stream, LogWriter(stream) as writer:
        for frames in read_frames(log):
            if not to_skip and (not len(moved_rows) or moved_rows[-1] < row):
                # (nothing left to cut or move: the read goes as it is, not indexed)
                writer.write_many(frames.data, frames.starts.tolist(), frames.ends.tolist())
                continue
            history = records.RecordIndex(frames).history
            keep = np.ones(len(frames), bool)
            skipped = history[:to_skip]
            keep[skipped] = False
            to_skip -= len(skipped)
            lo, hi = np.searchsorted(moved_rows, [row, row + len(history)])
            moved = {int(history[r - row]): plan.resteps[r] for r in moved_rows[lo:hi].tolist()}
            keep[list(moved)] = False
            done = 0
            for at in [*moved, len(frames)]:  # (in order: rows are in the log's order)
                kept = np.flatnonzero(keep[done:at]) + done
                writer.write_many(
                    frames.data, frames.starts[kept].tolist(), frames.ends[kept].tolist()
                )
                if at < len(frames):
                    writer.write(sentrows.with_step(frames.payload(at), moved[at]))
                done = at + 1
            row += len(history)
        return writer.records

"""What a log will put on the server when `wandb sync` sends it whole: its history rows'
steps, its system-metric rows and its console lines. An upload is verified against this.

The counts are taken a read at a time (`ContentCounter.add`), so that a step that reads a
log for its own purpose anyway, such as the check before a log is spliced into staging,
counts it on the way instead of reading it again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import records
from .proto import pb

_CURSOR_MOVES = ("\x1b[A", "\x1b[1A", "\x1b[2K")  # consoles wandb's emulator may fold


@dataclass(frozen=True)
class StagedContent:
    """What one staged log will put on the server when sent whole."""

    history_steps: tuple[int | None, ...]  # `_step` of each history row, in order
    events: int  # system-metric rows
    console_lines: int | None  # output.log lines; None when the console cannot be foretold


def console_line_count(texts: Sequence[str]) -> int | None:
    """Lines wandb's console emulator makes of one stream's text (None if not foreseeable).

    Every `\\n` ends a line; a last line without one is still a line; `\\r` rewrites the
    line it is on. Cursor movement (progress bars) folds lines in ways only the emulator
    knows, so such a console is not counted.
    """
    lines = ConsoleLines()
    for text in texts:
        lines.add(text)
    return lines.count()


class ConsoleLines:
    """`console_line_count` of one stream's text, taken a piece at a time without keeping
    the text: a log's console may be far larger than memory should hold for a count."""

    _KEEP = max(map(len, _CURSOR_MOVES)) - 1  # text kept to find a move split between pieces

    def __init__(self) -> None:
        self.newlines = 0
        self.written = False  # any text at all
        self.ends_line = False  # the text so far ends with `\n`
        self.folded = False  # a cursor movement was seen: not foreseeable
        self._tail = ""

    def add(self, text: str) -> None:
        if self.folded or not text:
            return
        joined = self._tail + text
        if any(move in joined for move in _CURSOR_MOVES):
            self.folded = True
            return
        self.newlines += text.count("\n")
        self.written, self.ends_line = True, text.endswith("\n")
        self._tail = joined[-self._KEEP :]

    def count(self) -> int | None:
        if self.folded:
            return None
        return self.newlines + (0 if not self.written or self.ends_line else 1)


class ContentCounter:
    """Counts what a log holds, one `records.read_indexed` read after another, in order."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []
        self.events = 0
        self.streams: dict[int, ConsoleLines] = {}  # output type -> its console's lines
        self.logger_lines = 0

    def add(self, read: records.RecordIndex) -> None:
        frames = read.frames
        self.steps += history_steps(read)
        self.events += len(read.of("stats"))
        for index in read.of("output_raw").tolist():
            output = pb.Record.FromString(frames.payload(index)).output_raw
            self.streams.setdefault(output.output_type, ConsoleLines()).add(output.line)
        for index in read.of("output_logger").tolist():
            # wandb writes these lines as they are, one per line
            text = pb.Record.FromString(frames.payload(index)).output_logger.line
            self.logger_lines += len(text.removesuffix("\n").split("\n"))

    def content(self) -> StagedContent:
        counts = [stream.count() for stream in self.streams.values()]
        console = None if None in counts else self.logger_lines + sum(c or 0 for c in counts)
        return StagedContent(tuple(self.steps), self.events, console)


def read_staged(log: Path) -> StagedContent:
    """Count what a staged log holds: history steps, system-metric rows, console lines."""
    counter = ContentCounter()
    for read in records.read_indexed(log):
        counter.add(read)
    return counter.content()


# Bytes of a history record (about 150 items) above which protobuf is faster: finding a
# row's step field walks its items, a numpy step per item of a read's widest row, and a
# shared run of 256 ranks x 20 metrics has 5,140 items a row (3.4 s to count its staged
# log, against 0.7 s parsed).
_WIDE_ROW = 4096


def history_steps(read: records.RecordIndex) -> list[int | None]:
    """`_step_of` of the history records of a read. A row in wandb's shape ends with its
    step field, which `RecordIndex.rows` reads for all rows at once, and in rows wandb
    writes that field is the `_step` the server shows (`_step_of` says when it is not);
    such a row is taken so once `records.proven_history` proves it valid protobuf. Rows in
    another shape (no step field, as wandb 0.16 writes them), rows not proven (protobuf
    raises DecodeError on an invalid one, which a sync reports as a record that cannot be
    read) and reads of wide rows take `_step_of` itself."""
    frames, which = read.frames, read.history
    if not len(which):
        return []
    if (frames.ends[which] - frames.starts[which]).mean() > _WIDE_ROW:
        return [_step_of(frames.payload(i)) for i in which.tolist()]
    rows = read.rows
    steps: list[int | None] = rows.steps.tolist()
    parse = ~records.proven_history(frames, which)
    parse[rows.decoded] = True
    for row in np.flatnonzero(parse).tolist():
        steps[row] = _step_of(frames.payload(int(which[row])))
    return steps


def _as_step(value: object) -> int | None:
    """A JSON value as a step: a number, made an int; None for anything else, `true`, NaN
    and the infinities included (as the server's last row is read, `upload.server`)."""
    if isinstance(value, float) and not math.isfinite(value) or isinstance(value, bool):
        return None
    return int(value) if isinstance(value, int | float) else None


def _step_of(payload: bytes) -> int | None:
    """The `_step` the count expects for a history record: its step field when it has one,
    else its first `_step` item. wandb-core sends the last `_step` item when that is an
    integer above the previous row's `_step`, else the previous + 1, whatever the field
    says: the same step for every row wandb writes (field and item agree, and rise), but
    not for a row whose field and item disagree (see ARCHITECTURE.md)."""
    history = pb.Record.FromString(payload).history
    if history.HasField("step"):
        return history.step.num
    for item in history.item:
        if item.key == "_step" or list(item.nested_key) == ["_step"]:
            try:
                value = json.loads(item.value_json)
            except (ValueError, RecursionError):  # not JSON, or nested past the limit
                return None
            return _as_step(value)
    return None

"""A staged run as a round of a follow sends it: only final rows, and still running.

The merge writes a run as if its ranks were done: every row it could read and, at the end,
an exit record (the primary's, or exit code 1 when the primary has none yet). While ranks
still write, two things are changed in the staged log before it is uploaded:

- Rows after the watermark are left out. A merged row of a shared run holds every rank's
  values of its step; a rank that is behind adds its value later. The server keeps each
  row as first sent (a later upload continues after the rows it holds), so a row may only
  go out once every rank that will contribute to it has.
- When the watermark leaves no row out, the last row is held back (unless the server holds
  it already): it goes with a later round that has a row after it to send, or with the
  round that sends the exit record.
  wandb-core gives the summary the `_step` of the last row an upload sends, and nothing
  else can set it (a summary record's `_step` is ignored; measured with wandb 0.31): a
  final round that sent no row, because the ranks logged their last rows a round before
  they finished, would leave the run's summary without `_step`. Rows the watermark
  leaves out are still in the log at the final round, so then nothing need wait.
- The exit record becomes one with `not_complete` set. wandb-core then uploads the
  summary, config and files and closes the upload without marking the run finished
  (`FinishWithoutExit` in its sender): the run stays running on the server until the
  round that sends the real exit record.

For example, with rows at steps 0-9 staged: with the watermark at 7, a round sends the rows
of steps 0-7; with every rank past step 9, it sends 0-8. Either way the final round sends
the rest, at least one row, with the exit record.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..log import LogWriter, ReadReport, pb, records


@dataclass(frozen=True)
class LiveCut:
    """How many history rows a cut log sends, of the rows its staged log holds."""

    rows_sent: int
    rows_staged: int

    def sent_early(self, server_rows: int) -> bool:
        """The server holds rows past those this cut sends, which every rank has logged,
        and no row the staged log lacks: another upload sent rows before every rank had
        logged them (a one-shot sync of the job while it trains). They can be checked
        only once every rank has logged them; an upload now would be refused."""
        return self.rows_sent < server_rows <= self.rows_staged


def running_exit_record() -> bytes:
    """An exit record that ends an upload and leaves the run running."""
    record = pb.Record()
    record.exit.not_complete = True
    return record.SerializeToString()


def cut_live(log: Path, out: Path, last_step: int | None, server_rows: int = 0) -> LiveCut:
    """Write `log` to `out` without its history rows after `last_step` (None: all kept), or
    without its last row when that leaves none out and the server (holding `server_rows`)
    lacks it, and with a `not_complete` exit record in place of its exit record.

    A row the server holds already is not held back: another upload sent it (a one-shot
    sync between two follows sends every row). The cut keeps it, so that the upload, which
    sends only the rows the server lacks, checks that the server's last row is this one."""
    all_rows = rows_kept = 0
    for index in _indexed(log):
        all_rows += len(index.history)
        rows_kept += len(_rows_kept(index, last_step))
    held_back = -1  # (the index of the row held back)
    if rows_kept == all_rows and server_rows < rows_kept:
        held_back = rows_kept - 1
    before = 0  # the rows kept in the reads before this one
    with open(out, "xb") as stream, LogWriter(stream) as writer:
        for index in _indexed(log):
            keep = np.ones(len(index), bool)
            keep[index.of("exit")] = False
            keep[index.history] = False
            rows = _rows_kept(index, last_step)
            keep[rows] = True
            if before <= held_back < before + len(rows):
                keep[rows[held_back - before]] = False
            before += len(rows)
            written = np.flatnonzero(keep)
            frames = index.frames
            writer.write_many(
                frames.data, frames.starts[written].tolist(), frames.ends[written].tolist()
            )
        writer.write(running_exit_record())
    return LiveCut(rows_kept if held_back < 0 else rows_kept - 1, all_rows)


def _indexed(log: Path) -> Iterator[records.RecordIndex]:
    return records.read_indexed(log, ReadReport())


def _rows_kept(index: records.RecordIndex, last_step: int | None) -> np.ndarray:
    """The indices of the history records of a read at or before `last_step`."""
    if last_step is None:
        return index.history
    return index.history[index.rows.steps <= last_step]

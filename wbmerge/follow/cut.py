"""A staged run as a round of a follow sends it: only final rows, and still running.

The merge writes a run as if its ranks were done: every row it could read and, at the end,
an exit record (the primary's, or exit code 1 when the primary has none yet). While ranks
still write, two things are changed in the staged log before it is uploaded:

- Rows after the watermark are left out. A merged row of a shared run holds every rank's
  values of its step; a rank that is behind adds its value later. The server keeps each
  row as first sent (a later upload continues after the rows it holds), so a row may only
  go out once every rank that will contribute to it has.
- The exit record becomes one with `not_complete` set. wandb-core then uploads the
  summary, config and files and closes the upload without marking the run finished
  (`FinishWithoutExit` in its sender): the run stays running on the server until the
  round that sends the real exit record.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import records
from ..proto import pb
from ..txlog import LogWriter, ReadReport


def running_exit_record() -> bytes:
    """An exit record that ends an upload and leaves the run running."""
    record = pb.Record()
    record.exit.not_complete = True
    return record.SerializeToString()


def cut_live(log: Path, out: Path, last_step: int | None) -> None:
    """Write `log` to `out` without its history rows after `last_step` (None: all kept)
    and with a `not_complete` exit record in place of its exit record."""
    with open(out, "xb") as stream, LogWriter(stream) as writer:
        for index in records.read_indexed(log, ReadReport()):
            keep = np.ones(len(index), bool)
            keep[index.of("exit")] = False
            if last_step is not None and len(index.history):
                keep[index.history[index.rows.steps > last_step]] = False
            kept = np.flatnonzero(keep)
            frames = index.frames
            writer.write_many(frames.data, frames.starts[kept].tolist(), frames.ends[kept].tolist())
        writer.write(running_exit_record())

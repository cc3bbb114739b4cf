"""When staged runs go out: how many runs a new `wandb sync` takes, and with how many lanes;
and which of a batch's runs the server is asked about while it uploads.

The deliverers of one sync share its upload slots (`-n`, `UploadSlots`), so that two jobs
uploading side by side still send at most `-n` runs at once. A batch is one `wandb sync`
process, not one per run, because every `wandb sync` costs about a second of CPU to start
(measured with wandb 0.31: 0.9 s for one small run), which would cost more than the
overlap gains. The rules are pure functions of counts, so that they can be read and
tested as a table.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence

PATIENCE = 0.5  # seconds a ready run waits for more, to fill the free slots with one process
START_COST = 2.0  # seconds a `wandb sync` takes to start sending (wandb 0.31, measured)


def batch_size(
    ready: int,
    coming: int,
    uploading: int,
    free: int,
    parallel: int,
    waited: float,
    idle: float = 0.0,
) -> int:
    """How many of the `ready` runs a new `wandb sync` takes now (0: not now).

    `coming`: runs of this delivery not ready yet (being staged, or the server being
    asked about them); `uploading`: its runs in batches that have not finished them;
    `free`: upload slots free of `parallel` (the others may be another job's); `waited`:
    seconds since the last run became ready; `idle`: seconds slots have been free. Every
    process costs a start (`START_COST`) and CPU, so runs are gathered: while more are
    coming, a batch starts only once staging has stalled, no run having become ready for
    `PATIENCE` (staging that keeps up goes out in one process, and staging that is slow
    still has its first runs sent meanwhile). While other uploads run, a batch starts
    once it has its part of the slots (in proportion to the runs left), half the slots,
    or slots have idled for as long as a start takes. It takes its share of the runs
    left, `free / parallel` of them, so that batches side by side end together.
    """
    left = ready + coming
    if not ready or not free:
        return 0
    if coming and waited < PATIENCE:
        return 0
    part = parallel * left // (left + uploading)  # its slots in proportion to the runs left
    if free < parallel and free < min(math.ceil(parallel / 2), left, part) and idle < START_COST:
        return 0
    share = math.ceil((left + uploading) * free / parallel)
    return min(ready, max(free, share))


def batch_lanes(runs: int, coming: int, uploading: int, free: int, parallel: int) -> int:
    """How many of the `free` slots a new batch of `runs` takes (its `wandb sync -n`).

    With nothing more coming, every free slot it can use. While runs are still coming, an
    early batch takes only its part, in proportion to its runs among all not yet finished
    (at least one): the slots left are there for the batch of the runs still being staged,
    which then starts at once instead of waiting for this one to end.
    """
    lanes = min(runs, free)
    if coming:
        part = parallel * runs // (runs + coming + uploading)
        lanes = min(lanes, max(1, part))
    return lanes


class UploadSlots:
    """The runs one sync may upload at once (`-n`), shared by all of its deliverers.

    Its condition is also what every deliverer waits on: a slot given back, a run ready,
    a batch ended, all wake the deliverers to look again.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.busy = 0
        self.changed = threading.Condition()
        self._free_since = time.monotonic()

    @property
    def free(self) -> int:
        return self.limit - self.busy

    @property
    def idle(self) -> float:
        """Seconds since a slot last became free (0 while none is)."""
        return time.monotonic() - self._free_since if self.busy < self.limit else 0.0

    def take(self, count: int) -> None:
        """Take `count` slots (holding `changed`)."""
        self.busy += count
        if self.busy >= self.limit:
            self._free_since = time.monotonic()  # idle counts from the next slot given back

    def give_back(self, count: int) -> None:
        """Give back `count` slots (holding `changed`), waking every deliverer."""
        if count > 0 and self.busy >= self.limit:
            self._free_since = time.monotonic()
        self.busy -= count
        self.changed.notify_all()


def runs_to_ask(
    unfinished: Sequence[str], asked_at: Mapping[str, float], started: set[str], count: int
) -> list[str]:
    """Which `count` of a batch's `unfinished` runs to ask the server about now, to see
    whether the upload moves.

    `asked_at`: when each run was last asked (never: first); `started`: runs the server
    was seen to hold more of than before their upload, that is runs being sent. Half the
    questions go to the started runs, the ones asked longest ago first, and half to the
    others in the same way (either half takes what the other does not need). wandb-core
    sends the runs of a batch in an order of its own, so the runs being sent are found by
    asking; once found, each is asked every few seconds however many runs wait, so that an
    upload of large runs, which says nothing until a run ends, is not taken for stuck.

    Example, `count` 4: of 100 unfinished runs with `r7` and `r9` started, `r7` and `r9`
    are asked each time, and two of the other 98, in turn, each every 49 times. A `count`
    of 1 cannot be halved: it goes to the run asked longest ago of all.
    """

    def oldest(runs: list[str]) -> list[str]:
        return sorted(runs, key=lambda run: asked_at.get(run, -math.inf))

    runs = list(dict.fromkeys(unfinished))  # (each run once)
    if count < 2:
        return oldest(runs)[: max(count, 0)]
    sending = oldest([run for run in runs if run in started])
    waiting = oldest([run for run in runs if run not in started])
    to_sending = min(len(sending), max(count // 2, count - len(waiting)))
    return sending[:to_sending] + waiting[: count - to_sending]

"""Follow a running job: its merged runs kept up to date on the server while the ranks write
offline, finished when the ranks are.

`follow(request)` is `wbmerge sync --follow`: a round every `interval` seconds (`rounds`),
until every rank of every job has written its exit record and every run is verified with
its final state, or until no file changed for `idle_timeout` seconds (counted from the
first run found: a follow started before the job waits for it); then one `wbmerge
sync` of the same paths gives the runs their final state by the one-shot rules (a rank
that never finished is a crashed rank) and the runs not found still running are named.

The modules, one job each: `live` (reading runs still being written: which exist, how far
each rank is, which rows are final), `tails` (logs read on from where the last round
stopped), `incremental` (a shared merge kept between rounds), `passlive` (a pass-through
target kept so), `saved` (either kept in the state directory, for a follower started
again), `cut` (a staged run as a round sends it), `fallback` (why a round merges a target
from scratch), `rounds` (one round: discover, plan, stage, cut, upload exactly once).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import RERUN, WbmergeError
from ..sync import MergeRequest, SyncReport, UploadFailed, sigterm_raises, sync
from ..upload import ServerError
from . import saved
from .lines import idle_warning, round_lines
from .live import find_live_runs
from .rounds import RESTART_GRACE, Follower, RoundReport, TargetRound
from .tails import NotIncremental, ScannedLog

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_INTERVAL",
    "FollowReport",
    "Follower",
    "NotIncremental",
    "RoundReport",
    "ScannedLog",
    "check_seconds",
    "find_live_runs",
    "follow",
    "idle_warning",
    "round_lines",
    "saved",
]


DEFAULT_INTERVAL = 60.0  # seconds between rounds
DEFAULT_IDLE_TIMEOUT = 600.0  # seconds without a changed file before the job is taken as over


@dataclass
class FollowReport:
    rounds: int
    links: list[dict] = field(default_factory=list)
    targets: list[TargetRound] = field(default_factory=list)  # the last round's
    unfinished: list[str] = field(default_factory=list)  # ranks never finished (idle end)
    final_sync: SyncReport | None = None  # the one-shot sync after an idle end


def check_seconds(**seconds: object) -> None:
    """Raise WbmergeError (exit 2) unless each value is a finite number of seconds, 0 or
    more: a NaN interval made the rounds a busy loop, a NaN idle timeout never ended."""
    for name, value in seconds.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:  # type: ignore[arg-type]
            raise WbmergeError(
                f"{name} must be a finite number of seconds, 0 or more, not {value!r}"
            )


def follow(
    request: MergeRequest,
    interval: float = DEFAULT_INTERVAL,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    parallel: int = 4,
    timeout: float = 300.0,
    on_round: Callable[[RoundReport], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    on_idle: Callable[[list[str]], None] | None = None,
    job_prefix: str | None = None,
    restart_grace: float = RESTART_GRACE,
) -> FollowReport:
    """Keep the merged runs of the jobs under `request.paths` up to date until they end.

    Raises WbmergeError for bad input (exit 2) and, from the last one-shot sync after an
    idle end, `UploadFailed` (exit 1; every job's last sync ran, also after the server or
    the input failed one, and its `report` holds the runs they verified).
    KeyboardInterrupt and SIGTERM (`Terminated`) stop the uploader and leave the runs as
    uploaded so far: running, every row sent once; a later `wbmerge sync` of the same
    paths completes them. `job_prefix` follows only the jobs whose id starts with it (and
    the last sync syncs only those). `restart_grace` is how long a run whose ranks ended,
    some failed, waits for an elastic restart.
    """
    check_seconds(interval=interval, idle_timeout=idle_timeout, restart_grace=restart_grace)
    follower = Follower(request, parallel, timeout, on_wait, job_prefix, restart_grace)
    with sigterm_raises(), follower:
        last_change = None  # the idle clock starts with the first run found
        while True:
            started = time.monotonic()
            report = follower.round()
            if not report.started:
                last_change = None
            elif report.changed or last_change is None:
                last_change = started
            if on_round:
                on_round(report)
            if report.done:
                return FollowReport(report.number, follower.links(), report.targets)
            # Idle only when a round started the timeout after the last change and found
            # none: a round longer than the timeout (late counts waited for) has not looked.
            if last_change is not None and started - last_change >= idle_timeout:
                break
            time.sleep(max(0.0, min(interval - (time.monotonic() - started), idle_timeout)))
        unfinished = follower.unfinished()
        jobs = sorted({plan.job.job_id for plan in follower.planned})
        places = follower.saved_places()
        follower.release()
    if on_idle:
        on_idle(unfinished)
    if job_prefix is not None and not jobs:
        return FollowReport(report.number, [], report.targets, unfinished)
    requests = [replace(request, job=job) for job in jobs] if job_prefix is not None else [request]
    final, failures = SyncReport([]), []
    for job_request in requests:  # (every job's, also after one of them failed)
        try:
            part = sync(job_request, parallel=parallel, timeout=timeout, on_wait=on_wait)
        except UploadFailed as exc:
            part, failures = exc.report, failures + exc.lines
        except ServerError as exc:  # (before this job's first run was verified)
            part, failures = SyncReport([]), [*failures, str(exc), RERUN]
        except WbmergeError as exc:  # (this job's runs, as they are now, cannot be synced)
            part, failures = SyncReport([]), [*failures, str(exc)]
        final.jobs += part.jobs
        final.targets += part.targets
        final.links += part.links
        final.warnings += part.warnings
    if failures:
        raise UploadFailed(failures, final)
    for place in places:  # (the runs are synced whole: nothing goes on from their merges)
        saved.remove(place)
    return FollowReport(report.number, final.links, report.targets, unfinished, final)

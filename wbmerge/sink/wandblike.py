"""How the sink can behave like W&B's cloud instead of an ideal server (`--like-wandb`).

Each behaviour is switched on its own, so that a test can show what one of them does to a
sync; docs/sink.md says where the evidence for each comes from:

- `write_cursor`: the server keeps a write position per stream of a run; a batch sent past
  it lands at it, and every batch leaves it at the batch's end (wandb#12269).
- `lag`: the line counts, the history tail and the summary a run is asked about are those
  of `lag` seconds earlier (wandb#12421, wandb#12668); `tail_lag`, when given, is the
  tail's and summary's own (a cache that can be staler than the counts).
- `sampling`: a history range of more rows than asked for answers a sample of them, spread
  over the range; the ideal sink answers the range's first rows.
- `limits`: file_stream requests per run, requests and bytes per project, each per second,
  past which a request is answered 429 with `Retry-After`; and the longest history line.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WANDB_LAG = 3.0  # seconds: W&B's counts "materialize asynchronously, ~2-4 s" (wandb#12421)
RUN_REQUESTS = 2.0  # file_stream requests a second per run
PROJECT_REQUESTS = 500.0  # requests a second per project
PROJECT_BYTES = 120e6  # request bytes a second per project
MAX_LINE_BYTES = (10 << 20) - (100 << 10)  # the longest history line W&B takes
WINDOW = 1.0  # seconds over which the rates are counted


@dataclass(frozen=True)
class Limits:
    """W&B's rate limits and its longest line (its documented defaults unless given)."""

    run_requests: float = RUN_REQUESTS
    project_requests: float = PROJECT_REQUESTS
    project_bytes: float = PROJECT_BYTES
    line_bytes: int = MAX_LINE_BYTES


@dataclass(frozen=True)
class LikeWandb:
    """Which of W&B's behaviours the sink models; all off is the ideal server."""

    write_cursor: bool = False
    lag: float = 0.0
    sampling: bool = False
    limits: Limits | None = None
    tail_lag: float | None = None  # None: the tail and summary are as late as the counts

    @property
    def tail_seconds(self) -> float:
        return self.lag if self.tail_lag is None else self.tail_lag

    @classmethod
    def all_on(cls, lag: float = WANDB_LAG) -> LikeWandb:
        return cls(write_cursor=True, lag=lag, sampling=True, limits=Limits())

    @classmethod
    def from_switches(
        cls,
        like_wandb: bool = False,
        write_cursor: bool | None = None,
        lag: float | None = None,
        sampling: bool | None = None,
        limits: bool | None = None,
        run_rate: float | None = None,
        project_rate: float | None = None,
        project_bytes: float | None = None,
        tail_lag: float | None = None,
    ) -> LikeWandb:
        """The behaviours `wbmerge sink serve`'s switches name: `like_wandb` turns all on,
        and each switch given (not None) sets its own; a rate given turns the limits on."""
        base = cls.all_on() if like_wandb else cls()
        rates = {
            "run_requests": run_rate,
            "project_requests": project_rate,
            "project_bytes": project_bytes,
        }
        given = {name: value for name, value in rates.items() if value is not None}
        if limits is None:
            limits = True if given else base.limits is not None
        return cls(
            write_cursor=base.write_cursor if write_cursor is None else write_cursor,
            lag=base.lag if lag is None else lag,
            sampling=base.sampling if sampling is None else sampling,
            limits=Limits(**given) if limits else None,
            tail_lag=tail_lag,
        )

    def cli_args(self) -> list[str]:
        """The switches of `wbmerge sink serve` that make a sink behave so."""
        args = [
            "--write-cursor" if self.write_cursor else "--no-write-cursor",
            "--lag",
            repr(float(self.lag)),
            "--sampling" if self.sampling else "--no-sampling",
        ]
        if self.tail_lag is not None:
            args += ["--tail-lag", repr(float(self.tail_lag))]
        if self.limits is None:
            return [*args, "--no-limits"]
        return [
            *args,
            "--run-rate",
            repr(self.limits.run_requests),
            "--project-rate",
            repr(self.limits.project_requests),
            "--project-bytes",
            repr(self.limits.project_bytes),
        ]

    def describe(self) -> str:
        """The behaviours on, for the start-up line ("" when none is)."""
        on = []
        if self.write_cursor:
            on.append("write cursor")
        if self.lag:
            on.append(f"counts {self.lag:g} s late")
        if self.tail_seconds != self.lag:
            on.append(f"tail and summary {self.tail_seconds:g} s late")
        if self.sampling:
            on.append("sampled history")
        if self.limits:
            limits = self.limits
            on.append(
                f"limits {limits.run_requests:g} file_stream/s per run, "
                f"{limits.project_requests:g} requests/s and "
                f"{limits.project_bytes / 1e6:g} MB/s per project"
            )
        return ", ".join(on)


class LaggingViews:
    """What each run looked like over the last `lag` seconds, to answer as of then.

    After every write the store records the run's reported fields (`record`); `view` gives
    the newest record at least `seconds` old, or None when there is none: the run as it
    was before its first write (no lines, no summary)."""

    def __init__(self, lag: float) -> None:
        self.lag = lag  # (the longest lag asked for: older views are not kept)
        self._views: dict[tuple[str, str, str], deque[tuple[float, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def record(self, run: tuple[str, str, str], view: dict[str, Any]) -> None:
        now = time.monotonic()
        with self._lock:
            views = self._views.setdefault(run, deque())
            views.append((now, view))
            # Only one view older than the lag is ever needed: the newest of them.
            while len(views) > 1 and views[1][0] <= now - self.lag:
                views.popleft()

    def known(self, run: tuple[str, str, str]) -> bool:
        with self._lock:
            return run in self._views

    def view(self, run: tuple[str, str, str], seconds: float) -> dict[str, Any] | None:
        seen = time.monotonic() - seconds
        with self._lock:
            views = self._views.get(run)
            if not views:
                return None
            times = [at for at, _ in views]
            index = bisect.bisect_right(times, seen) - 1
            return views[index][1] if index >= 0 else None


@dataclass
class Throttle:
    """Counts requests and bytes per second; says how long a request must wait (429)."""

    limits: Limits
    _run_requests: dict[tuple[str, str, str], deque[float]] = field(default_factory=dict)
    _project_requests: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    _project_bytes: dict[tuple[str, str], deque[tuple[float, int]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    refused: dict[str, int] = field(default_factory=dict)  # 429s answered, per kind

    def admit(self, entity: str, project: str, run: str | None, size: int) -> float | None:
        """Count one request of `size` bytes to `entity/project` (a file_stream request of
        `run`, when given); None when it may go on, else the seconds until it may be sent
        again (it is then not counted)."""
        now = time.monotonic()
        since = now - WINDOW
        with self._lock:
            waits = []
            if run is not None:
                runs = self._run_requests.setdefault((entity, project, run), deque())
                waits.append(_wait_for_rate(runs, self.limits.run_requests, now))
            requests = self._project_requests.setdefault((entity, project), deque())
            waits.append(_wait_for_rate(requests, self.limits.project_requests, now))
            waits = [wait for wait in waits if wait is not None]
            sizes = self._project_bytes.setdefault((entity, project), deque())
            while sizes and sizes[0][0] <= since:
                sizes.popleft()
            if sizes and sum(n for _, n in sizes) + size > self.limits.project_bytes:
                waits.append(sizes[0][0] + WINDOW - now)
            if waits:
                kind = "graphql" if run is None else "file_stream"
                self.refused[kind] = self.refused.get(kind, 0) + 1
                return max(waits)
            if run is not None:
                runs.append(now)
            requests.append(now)
            sizes.append((now, size))
            return None


def _wait_for_rate(times: deque[float], rate: float, now: float) -> float | None:
    """Seconds until one more request fits `rate` requests a second, given the `times` of
    those admitted (the old ones are dropped); None when it fits now. A rate below one is
    counted over 1/rate seconds: 0.1 admits one request in any 10 s."""
    window = max(WINDOW, 1 / rate)
    while times and times[0] <= now - window:
        times.popleft()
    if len(times) >= rate * window:
        return times[0] + window - now
    return None


def retry_after(seconds: float) -> str:
    """A `Retry-After` of whole seconds (at least 1) for a wait of `seconds`."""
    return str(max(1, math.ceil(seconds)))

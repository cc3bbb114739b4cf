"""Fault injection for reliability tests: errors, latency and dropped connections on demand.

A fault applies to requests whose kind matches (`graphql:<Operation>`, `file_stream`,
`file_stream:history` for those that carry history lines, `storage`, or `*`) and fires on
chosen request numbers (counted per kind: `file_stream@2` is the second file_stream request,
`file_stream:history@2` the second that carries history lines, `@2+` the second and every
later one) or on every request, up to `times` times. Specs come from the CLI or JSON, e.g.
`--fault 'graphql:UpsertBucket=500x2'`, `--fault 'file_stream=429@3'`,
`--fault '*=delay:0.2'`, `--fault 'storage=drop@1'`.

`lose` acknowledges a file_stream request and keeps none of its lines: the client sees
success, the line counts still reach past the lost lines (they are the highest offset
held, plus one), and only reading the rows back shows the hole. W&B has lost rows so
(wandb#12269); it is how the tests prove that verification reads every row back.

`nometrics` (UpsertBucket only) keeps the run's config without the metric definitions
wandb-core sends in it (`_wandb` -> `m`) and answers as if it kept them all: how the tests
prove that a definition missing on the server fails the sync. `nocharts` (UpsertBucket only)
keeps it without its custom charts (`_wandb` -> `visualize`), likewise.

`hold` keeps each matching request waiting until the fault plan is replaced (a test sets
new faults, or none): a writer held so stays in the middle of its upload for as long as a
test needs, however slow the machine is.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field

_SPEC = re.compile(
    r"^(?P<kind>[\w:*.-]+)=(?P<action>\d{3}|drop|lose|hold|nometrics|nocharts|delay:[\d.]+)"
    r"(?:@(?P<nth>[\d,]+)(?P<onwards>\+)?)?(?:x(?P<times>\d+))?$"
)


@dataclass
class Fault:
    kind: str  # graphql:UpsertBucket | file_stream | storage | *
    action: str  # "429", "500", "drop", "lose", "hold", "delay:0.5"
    nth: tuple[int, ...] = ()  # 1-based request numbers of this kind; () = any
    times: int | None = None  # how often it may fire; None = unlimited
    fired: int = 0
    onwards: bool = False  # also every request after the last of `nth`

    def matches(self, kind: str, count: int) -> bool:
        if self.kind not in ("*", kind) and not kind.startswith(self.kind + ":"):
            return False
        if self.nth and count not in self.nth and not (self.onwards and count > max(self.nth)):
            return False
        return self.times is None or self.fired < self.times

    @property
    def status(self) -> int | None:
        return int(self.action) if self.action.isdigit() else None

    @property
    def delay(self) -> float:
        return float(self.action.split(":", 1)[1]) if self.action.startswith("delay:") else 0.0


def parse_fault(spec: str) -> Fault:
    match = _SPEC.match(spec.strip())
    if not match:
        raise ValueError(f"bad fault spec {spec!r} (e.g. 'file_stream=500@2', '*=delay:0.1')")
    if match["action"] == "lose" and match["kind"].split(":")[0] != "file_stream":
        raise ValueError(f"bad fault spec {spec!r}: only file_stream requests can be lost")
    if match["action"] in ("nometrics", "nocharts") and match["kind"] != "graphql:UpsertBucket":
        raise ValueError(f"bad fault spec {spec!r}: only UpsertBucket configs lose parts")
    nth = tuple(int(n) for n in match["nth"].split(",")) if match["nth"] else ()
    onwards = bool(match["onwards"])
    times = int(match["times"]) if match["times"] else (None if onwards else len(nth) or None)
    return Fault(match["kind"], match["action"], nth, times, onwards=onwards)


@dataclass
class FaultPlan:
    """The faults in force and the per-kind request counters, safe across threads."""

    faults: list[Fault] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self, kind: str) -> list[Fault]:
        """Count one request of `kind`; return the faults that fire for it."""
        with self._lock:
            family = kind.split(":", 1)[0]
            for counted in {kind, family}:  # (`graphql` and `file_stream` count them all)
                self.counts[counted] = self.counts.get(counted, 0) + 1
            firing = [
                f
                for f in self.faults
                if f.matches(kind, self.counts.get(f.kind, self.counts[kind]))
            ]
            for fault in firing:
                fault.fired += 1
            return firing

    def replace(self, faults: list[Fault]) -> None:
        with self._lock:
            self.faults = faults
            self.counts = {}

    def holds(self, fault: Fault) -> bool:
        """Whether `fault` (a `hold`) is still in force: until the plan is replaced."""
        with self._lock:
            return any(f is fault for f in self.faults)

    def summary(self) -> dict:
        with self._lock:
            return {
                "counts": dict(self.counts),
                "faults": [
                    {"kind": f.kind, "action": f.action, "nth": list(f.nth), "fired": f.fired}
                    for f in self.faults
                ],
            }


def without_metric_definitions(variables: dict, part: str = "m") -> None:
    """Drop the metric definitions (`_wandb` -> `m`), or another `part` of `_wandb` (the
    charts, `visualize`), from an UpsertBucket's config, in place (the `nometrics` and
    `nocharts` faults); a config not in wandb-core's shape is left as it is."""
    try:
        config = json.loads(variables.get("config") or "{}")
    except (ValueError, TypeError, RecursionError):
        return
    wandb = config.get("_wandb") if isinstance(config, dict) else None
    inner = wandb.get("value") if isinstance(wandb, dict) else None
    if isinstance(inner, dict) and part in inner:
        del inner[part]
        variables["config"] = json.dumps(config)

"""The read side of wandb 0.31's public API (`wandb.Api()`): the queries `api.runs`,
`api.run`, `run.history`, `run.scan_history`, `run.summary`, `run.config` and
`run.wait_until_finished` send, answered from a `Store` with every field wandb's queries
ask for (read from wandb's own `wandb/apis/public/runs.py` and, for `scan_history`, from
the queries its wandb-core sends).

`run.history(samples=N)` reads the `history` field `HistoryPage` reads, over every step,
sampled by the store. With `keys` (`sampledHistory`) only the rows that hold every key
count, as on W&B (wandb/wandb#2266), each with just those keys; more than N of them are
spread evenly in step order, the first and the last kept.
"""

from __future__ import annotations

import datetime
import json
import re
import zlib
from typing import Any

from .names import DEFAULT_ENTITY, BadName, check_entity, check_project, check_run_path
from .runfilters import FilterError, matcher
from .store import Store

MAX_PAGE = 1000
MAX_SAMPLES = 100_000
MAX_ROWS = 2**62  # (every row of a run: `history_page` takes a count)
# Orders `api.runs(order=...)` may ask for; W&B's default is the oldest run first.
ORDERS = {"created_at": "created", "heartbeat_at": "updated", "name": "id"}
EVENTS_FIELD = re.compile(r"\bevents\s*\(")  # RunFullHistory's field for stream="events"


class QueryError(ValueError):
    """A public API query the sink cannot answer as asked; its message says why."""


def iso_time(seconds: float) -> str:
    """A time as W&B's API gives it (ISO 8601, UTC, no zone suffix)."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.replace(tzinfo=None).isoformat(timespec="seconds")


def project_id(entity: str, project: str) -> str:
    """A stable number for a project (the sink keeps no project table)."""
    return str(zlib.crc32(f"{entity}/{project}".encode()))


def _project(v: dict[str, Any]) -> tuple[str, str]:
    try:
        return check_entity(v.get("entity") or DEFAULT_ENTITY), check_project(v.get("project"))
    except BadName as exc:
        raise QueryError(str(exc)) from None


def _run_path(v: dict[str, Any], key: str = "name") -> tuple[str, str, str]:
    try:
        return check_run_path(v.get("entity") or DEFAULT_ENTITY, v.get("project"), v.get(key))
    except BadName as exc:
        raise QueryError(str(exc)) from None


def _count(value: object, name: str, default: int, most: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= most:
        raise QueryError(f"{name} must be a whole number from 1 to {most}")
    return value


def _cursor(value: object) -> int:
    """The index after the one a cursor (the index of the last item sent) names."""
    if value is None:
        return 0
    if not isinstance(value, str) or not value.isdigit() or len(value) > 9:
        raise QueryError("a cursor must be one this sink handed out")
    return int(value) + 1


def _value_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        kind = value.get("_type")
        return kind if isinstance(kind, str) else "map"
    return "nil"


def history_keys(lines: list[str]) -> dict[str, Any]:
    """W&B's `historyKeys` of a run: each key's value types with their counts, and the last
    step (-1 for a run without history)."""
    counts: dict[str, dict[str, int]] = {}
    last = -1
    for line in lines:
        row = json.loads(line)
        step = row.get("_step")
        if isinstance(step, int) and not isinstance(step, bool):
            last = max(last, step)
        for key, value in row.items():
            types = counts.setdefault(key, {})
            kind = _value_type(value)
            types[kind] = types.get(kind, 0) + 1
    keys = {
        key: {"typeCounts": [{"type": t, "count": n} for t, n in types.items()]}
        for key, types in counts.items()
    }
    return {"keys": keys, "lastStep": last}


def spread(items: list[Any], samples: int) -> list[Any]:
    """At most `samples` of `items`: all of them when there are no more, else evenly spread,
    the first and the last included."""
    if len(items) <= samples:
        return items
    if samples == 1:
        return [items[-1]]
    last = len(items) - 1
    return [items[(i * last) // (samples - 1)] for i in range(samples)]


def _run_node(store: Store, run: dict[str, Any], query: str) -> dict[str, Any]:
    """A run with every field of wandb's `RunFragment` and `LightweightRunFragment`."""
    entity, project, name = run["entity"], run["project"], run["id"]
    node: dict[str, Any] = {
        "id": f"{entity}/{project}/{name}",
        "projectId": project_id(entity, project),
        "name": name,
        "displayName": run["display_name"] or name,
        "tags": run["tags"],
        "sweepName": None,
        "state": run["state"],
        "group": run["group"],
        "jobType": run["job_type"],
        "commit": None,
        "readOnly": False,
        "createdAt": iso_time(run["created"]),
        "heartbeatAt": iso_time(run["updated"]),
        "description": run["notes"],
        "notes": run["notes"],
        "historyLineCount": run["history_line_count"],
        "user": {"name": DEFAULT_ENTITY, "username": DEFAULT_ENTITY},
        "config": run["raw_config"],
        "summaryMetrics": run["raw_summary"],
        "systemMetrics": run["events_tail"] or "{}",
    }
    if "historyKeys" in query:
        lines = store.stream_lines(entity, project, name, "history") or []
        node["historyKeys"] = history_keys(lines)
    return node


def default_entity(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    return {"viewer": {"id": "local-viewer", "entity": DEFAULT_ENTITY}}


def runs(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """A page of a project's runs that pass `filters`, in `order`, with their count."""
    entity, project = _project(v)
    filters = v.get("filters")
    try:
        predicate = matcher(json.loads(filters) if isinstance(filters, str) else filters)
    except FilterError as exc:
        raise QueryError(str(exc)) from None
    except ValueError:
        raise QueryError("filters must be a JSON object") from None
    order = v.get("order") or "+created_at"
    if not isinstance(order, str) or order.lstrip("+-") not in ORDERS:
        raise QueryError(
            f"order {order!r} is not supported by this sink (only "
            + ", ".join(sorted(ORDERS))
            + ", with + or -)"
        )
    everything = store.runs(entity, project)
    if not everything:
        return {"project": None}
    found = [run for run in everything if predicate(run)]
    found.sort(key=lambda run: (run[ORDERS[order.lstrip("+-")]], run["id"]))
    if order.startswith("-"):
        found.reverse()
    start, per_page = _cursor(v.get("cursor")), _count(v.get("perPage"), "perPage", 50, MAX_PAGE)
    page = found[start : start + per_page]
    edges = []
    for i, brief in enumerate(page):
        run = store.run(entity, project, brief["id"])
        if run is not None:
            edges.append({"node": _run_node(store, run, query), "cursor": str(start + i)})
    info = {
        "endCursor": edges[-1]["cursor"] if edges else None,
        "hasNextPage": start + per_page < len(found),
    }
    return {
        "project": {
            "internalId": project_id(entity, project),
            "runCount": len(found),
            "readOnly": False,
            "runs": {"edges": edges, "pageInfo": info},
        }
    }


def run(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """One run (`api.run`, and a lazy run's full load), or `run: null`."""
    entity, project, name = _run_path(v)
    found = store.run(entity, project, name)
    node = None if found is None else _run_node(store, found, query)
    return {"project": {"run": node}}


def run_state(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    entity, project, name = _run_path(v)
    found = store.run(entity, project, name)
    return {"project": {"run": None if found is None else {"state": found["state"]}}}


def run_history_keys(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """The run's `historyKeys`; `scan_history` reads its `lastStep`."""
    entity, project, name = _run_path(v)
    lines = store.stream_lines(entity, project, name, "history")
    run = None if lines is None else {"historyKeys": history_keys(lines)}
    return {"project": {"run": run}}


def run_full_history(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """`run.history()` without keys: sampled history lines, or system-metric lines for
    `stream="events"` (whichever field the query asks for)."""
    entity, project, name = _run_path(v)
    samples = _count(v.get("samples"), "samples", 500, MAX_SAMPLES)
    if EVENTS_FIELD.search(query):
        lines = store.stream_lines(entity, project, name, "events")
        answer = None if lines is None else {"events": spread(lines, samples)}
    else:  # the same `history` field as HistoryPage's, over every step, always a sample
        # (W&B samples `run.history()`; HistoryPage's ranges are sampled only when W&B's
        # sampling is modelled, so every row is read first and spread here)
        lines = store.history_page(entity, project, name, -(2**63), 2**63 - 1, MAX_ROWS)
        answer = None if lines is None else {"history": spread(lines, samples)}
    return {"project": {"run": answer}}


def _by_step(lines: list[str]) -> list[str]:
    """History lines in step order (as W&B reads history), lines without a step last."""
    keyed = []
    for offset, line in enumerate(lines):
        step = json.loads(line).get("_step")
        whole = isinstance(step, int) and not isinstance(step, bool)
        keyed.append(((0, step, offset) if whole else (1, 0, offset), line))
    keyed.sort(key=lambda pair: pair[0])
    return [line for _, line in keyed]


def run_sampled_history(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """`run.history(keys=...)`: for each spec, the rows that hold every key of it, each
    with only those keys, sampled to at most its `samples`."""
    specs = v.get("specs")
    if not isinstance(specs, list) or not 0 < len(specs) <= 100:
        raise QueryError("specs must be a list of 1 to 100 JSON strings")
    return _sampled(store, _run_path(v), specs)


def sampled_history_page(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """A page of `run.scan_history(keys=...)` as wandb-core asks for it: one spec whose
    `minStep` and `maxStep` bound the steps, both included (wandb-core asks for a page of
    steps [a, b) as minStep a, maxStep b - 1, samples b - a)."""
    return _sampled(store, _run_path(v, "run"), [v.get("spec")])


def _sampled(store: Store, path: tuple[str, str, str], specs: list[object]) -> dict:
    parsed = [_spec(text) for text in specs]
    lines = store.stream_lines(*path, "history")
    if lines is None:
        return {"project": {"run": None}}
    rows = [json.loads(line) for line in _by_step(lines)]
    answers = []
    for keys, samples, low, high in parsed:
        held = [
            {k: row[k] for k in keys}
            for row in rows
            if all(k in row for k in keys) and _step_within(row, low, high)
        ]
        answers.append(spread(held, samples))
    return {"project": {"run": {"sampledHistory": answers}}}


def _spec(text: object) -> tuple[list[str], int, int | None, int | None]:
    """(keys, samples, minStep, maxStep) of one sampledHistory spec (a JSON string)."""
    try:
        spec = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise QueryError("each spec must be a JSON object")
    unknown = sorted(set(spec) - {"keys", "samples", "minStep", "maxStep"})
    if unknown:
        raise QueryError(f"spec field {unknown[0]!r} is not supported by this sink")
    keys = spec.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise QueryError("a spec's keys must be a non-empty list of strings")
    bounds = [spec.get("minStep"), spec.get("maxStep")]
    for bound in bounds:
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool)):
            raise QueryError("a spec's minStep and maxStep must be whole numbers")
    samples = _count(spec.get("samples"), "samples", 500, MAX_SAMPLES)
    return list(dict.fromkeys(keys)), samples, bounds[0], bounds[1]


def _step_within(row: dict[str, Any], low: int | None, high: int | None) -> bool:
    if low is None and high is None:
        return True
    step = row.get("_step")
    if not isinstance(step, int) or isinstance(step, bool):
        return False
    return (low is None or step >= low) and (high is None or step <= high)


def run_parquet_history(store: Store, v: dict[str, Any], base_url: str, query: str) -> dict:
    """Where `run.scan_history` (wandb-core) reads history: the sink exports no Parquet
    files, so every row is live data, given with the `liveKeys` asked for (wandb-core asks
    for `_step`, to learn where the live rows begin); the rows themselves are then read
    with `HistoryPage` and `SampledHistoryPage`."""
    live_keys = v.get("liveKeys")
    if not isinstance(live_keys, list) or not all(isinstance(k, str) for k in live_keys):
        raise QueryError("liveKeys must be a list of strings")
    lines = store.stream_lines(*_run_path(v, "runName"), "history")
    if lines is None:
        return {"project": {"run": None}}
    rows = (json.loads(line) for line in _by_step(lines))
    live = [{k: row[k] for k in live_keys if k in row} for row in rows if "_step" in row]
    return {"project": {"run": {"parquetHistory": {"parquetUrls": [], "liveData": live}}}}


HANDLERS = {
    "GetDefaultEntity": default_entity,
    "Runs": runs,
    "Run": run,
    "RunState": run_state,
    "RunHistoryKeys": run_history_keys,
    "RunFullHistory": run_full_history,
    "RunSampledHistory": run_sampled_history,
    "SampledHistoryPage": sampled_history_page,
    "RunParquetHistory": run_parquet_history,
}

"""`wbmerge inspect`: what offline runs are there, which rank wrote each, and are they whole.

A file that cannot be read is listed too (its `unreadable` says why), so that one bad
file among a thousand does not hide the others; the CLI then exits non-zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from ..errors import NotATransactionLog
from ..log import pb, read_frames, record_kind
from .discover import OfflineRun, discover, job_problem
from .jobs import Hints


def describe(run: OfflineRun) -> dict[str, Any]:
    """One run as the JSON object `inspect --json` prints (None where unknown)."""
    rank, stats = run.rank, run.stats
    report = stats.report if stats else None
    return {
        "path": str(run.run_dir),
        "run_id": run.run_id,
        "job_id": run.job_id,
        "rank": rank.rank if rank else None,
        "local_rank": rank.local_rank if rank else None,
        "worker": rank.worker if rank else None,
        "world_size": rank.world_size if rank else None,
        "local_world_size": rank.local_world_size if rank else None,
        "label": run.label,
        "restart": rank.restart if rank else None,
        "source": run.rank_source,
        "problem": run.problem,
        "warnings": run.warnings,
        "project": run.project or None,
        "group": run.group or None,
        "name": run.display_name or None,
        "host": run.host or None,
        "started": _utc(run.start_time) if run.start_time else None,
        "rank_guessed": run.rank_guessed,
        "logged_only_here": None,  # (filled in for a job whose rank 0 is a guess)
        "history_rows": stats.history_rows if stats else None,
        "last_step": stats.last_step if stats else None,
        "size": _size(run),
        "complete": stats.complete if stats else None,
        "exit_code": stats.exit_code if stats else None,
        "truncated": report.truncated if report else None,
        "dropped_records": report.dropped_records if report else None,
        "dropped_bytes": report.dropped_bytes if report else None,
        "damage": (report.describe() or None) if report else None,
        "unreadable": run.unreadable,
    }


def _size(run: OfflineRun) -> int | None:
    try:
        return run.size
    except OSError:
        return None  # removed since it was found


def inspect_runs(paths: Iterable[str | Path], hints: Hints | None = None) -> list[dict[str, Any]]:
    """Describe every offline run under `paths` after a full read of each."""
    found = discover(paths, full_scan=True, hints=hints, keep_unreadable=True)
    by_job: dict[str, list[OfflineRun]] = {}
    for run in found:
        if run.rank is not None:
            by_job.setdefault(run.job_id or "", []).append(run)
    only_here: dict[int, list[str]] = {}
    for job_id, members in by_job.items():
        # What `sync` and `merge` would refuse, said here too: a diagnosis must not pass a
        # job that the upload then stops at.
        problem = job_problem(job_id, members)
        if problem:  # (on the job's first run: the table shows it once, the JSON too)
            members[0].warnings.append(f"sync and merge stop here: {problem}")
        if any(run.rank_guessed for run in members):
            by_order = all(run.rank_source == "order" for run in members)
            members[0].warnings.append(GUESSED_NOTE if by_order else GUESSED_HOSTS_NOTE)
            only_here.update(_keys_only_here(members))
    rows = [describe(run) for run in found]
    for index, run in enumerate(found):
        if id(run) in only_here:
            rows[index]["logged_only_here"] = only_here[id(run)]
    return rows


GUESSED_NOTE = (
    "no run says its rank, so rank 0 is only the run that started first; sync and merge in "
    "auto and shared mode stop here: name rank 0 with --primary RUN_ID (the run that logged "
    "what only the primary logs, below), say every rank with --ranks FILE, or accept the "
    "order with --rank-order start"
)


GUESSED_HOSTS_NOTE = (
    "which host is worker 0 is a guess (hosts in name order), and so is rank 0; sync and "
    "merge in auto and shared mode stop here: say every rank with --ranks FILE, or accept "
    "the order with --rank-order start"
)


def _keys_only_here(members: list[OfflineRun]) -> dict[int, list[str]]:
    """For each run (by `id`), the keys it logged that no other run of its job logged: the
    primary of a training loop is often the one run with validation metrics or a best
    value. Read from the runs' summary records, which name every key a run logged."""
    keys = {id(run): _logged_keys(run.path) for run in members}
    return {
        id(run): sorted(
            keys[id(run)].difference(*(k for other, k in keys.items() if other != id(run)))
        )
        for run in members
    }


def _logged_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    try:
        for frames in read_frames(path):
            for payload in frames.payloads():
                if record_kind(payload) != "summary":
                    continue
                for item in pb.Record.FromString(payload).summary.update:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        keys.add(key)
    except (OSError, NotATransactionLog, DecodeError):
        pass  # (a run that cannot be read whole: its damage column says why)
    return keys


def _utc(seconds: float) -> str:
    """A start time as the user reads it, to the millisecond: runs started in one second
    are told apart."""
    try:
        moment = datetime.fromtimestamp(seconds, tz=timezone.utc)
    except (ValueError, OverflowError, OSError):  # (a start time no clock shows)
        return f"{seconds:.3f} s after 1970"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def unreadable_summary(rows: list[dict[str, Any]]) -> str | None:
    """One line about the runs that could not be read, or None when every run was read."""
    reasons = [row["unreadable"] for row in rows if row["unreadable"]]
    if not reasons:
        return None
    more = f" (and {len(reasons) - 1} more unreadable run(s))" if len(reasons) > 1 else ""
    return f"{reasons[0]}{more}"


COLUMNS = [
    ("run id", "run_id"),
    ("rank", "rank"),
    ("local", "local_rank"),
    ("worker", "worker"),
    ("world", "world_size"),
    ("label", "label"),
    ("source", "source"),
    ("restart", "restart"),
    ("rows", "history_rows"),
    ("last step", "last_step"),
    ("size", "size"),
    ("complete", "complete"),
    ("exit", "exit_code"),
    ("damage", "damage"),
]


def format_inspection(rows: list[dict[str, Any]]) -> str:
    """Human tables, one per job, each followed by what was assumed about the job; then
    the runs of unknown rank, with why."""
    jobs: dict[tuple[str | None, bool], list[dict[str, Any]]] = {}
    for row in rows:
        jobs.setdefault((row["job_id"], row["source"] == "merged"), []).append(row)
    out = []
    for (job_id, merged), members in jobs.items():
        if merged:
            out.append(f"runs merged from job {job_id} (`wbmerge sync` uploads them as they are)")
        else:
            out.append(f"job {job_id}" if job_id else "runs of unknown rank")
        out.append(_table([[_cell(m, key) for _, key in COLUMNS] for m in members]))
        notes = [*(w for m in members for w in m["warnings"]), *(m["problem"] for m in members)]
        out.extend(f"  note: {note}" for note in dict.fromkeys(n for n in notes if n))
        out.extend(_evidence_lines(m) for m in members if m["rank_guessed"])
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _evidence_lines(row: dict[str, Any]) -> str:
    """What a run numbered by a guess shows to whoever picks its job's rank 0."""
    only = row["logged_only_here"] or []
    logged = f"logged only here: {', '.join(only[:8])}" if only else "logged nothing of its own"
    if len(only) > 8:
        logged += f" and {len(only) - 8} more"
    return (
        f"  run {row['run_id']}: started {row['started'] or '?'} on {row['host'] or '?'}, "
        f"{row['history_rows']} rows; {logged}"
    )


def _cell(row: dict[str, Any], key: str) -> str:
    value = row[key]
    if key == "size":
        return "-" if value is None else _human_size(value)
    if key == "complete":
        return "yes" if value else ("no" if value is not None else "-")
    if key == "damage":
        return "unreadable" if row["unreadable"] else (value or "-")
    return "-" if value is None else str(value)


def _human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(body: list[list[str]]) -> str:
    header = [name for name, _ in COLUMNS]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *body]
    ]
    return "\n".join(["  " + line for line in lines])

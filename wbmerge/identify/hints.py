"""The user's word on ranks: `--label-pattern` and `--ranks FILE`, read and checked.

`--ranks FILE` is JSON or CSV. JSON maps run ids to a rank, or to an object with `rank`
and optionally `local_rank`, `worker`, `restart` and `job`:

    {"3fz9k2ab": 0, "8xk1qq7c": {"rank": 1, "local_rank": 1, "worker": 0}}

CSV has a header row naming the same columns, `run_id` and `rank` required:

    run_id,rank,local_rank,worker
    3fz9k2ab,0,0,0
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import WbmergeError
from ..plan import check_run_id
from ..training import MAX_RANKS, rank_number
from .jobs import GivenRank, Hints
from .rankclaims import compile_pattern

_COLUMNS = ("rank", "local_rank", "worker", "restart")


def make_hints(
    label_pattern: str | None = None,
    ranks_file: str | Path | None = None,
    primary: Iterable[str] = (),
) -> Hints:
    """Hints from the CLI's options; WbmergeError (one line) for a bad pattern, file or run
    id. `primary` names rank 0 of jobs whose runs say nothing of their ranks."""
    if isinstance(primary, str):  # (one run id from the API, not its characters)
        primary = [primary]
    for run_id in primary:
        try:
            check_run_id(run_id)
        except WbmergeError as exc:
            raise WbmergeError(f"--primary: {exc}") from None
    pattern = None
    if label_pattern:
        try:
            pattern = compile_pattern(label_pattern)
        except ValueError as exc:
            raise WbmergeError(f"bad --label-pattern: {exc}") from None
    given = load_ranks(Path(ranks_file)) if ranks_file else {}
    return Hints(label_pattern=pattern, given=given, primary=frozenset(primary))


def load_ranks(path: Path) -> dict[str, GivenRank]:
    """The run id -> rank assignments of a `--ranks` file (JSON or CSV)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # spreadsheets save CSV with a BOM
    except (OSError, UnicodeDecodeError) as exc:
        raise WbmergeError(f"--ranks {path}: cannot read ({exc})") from None
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            rows = _json_rows(json.loads(text))
        except (ValueError, RecursionError) as exc:
            raise WbmergeError(f"--ranks {path}: not valid JSON ({exc})") from None
    else:
        # (blank lines before the header are skipped; cells past the header's are not ours)
        reader = csv.DictReader(io.StringIO(stripped), skipinitialspace=True)
        header = {name.strip() for name in reader.fieldnames or []}
        if not {"run_id", "rank"} <= header:
            raise WbmergeError(f"--ranks {path}: a CSV file needs a header with run_id and rank")
        rows = [
            {k.strip(): (v or "").strip() for k, v in row.items() if isinstance(k, str)}
            for row in reader
        ]
    if not rows:
        raise WbmergeError(f"--ranks {path}: names no run")
    given: dict[str, GivenRank] = {}
    for number, row in enumerate(rows, start=1):
        run_id = str(row.get("run_id") or "").strip()
        where = f"--ranks {path}, entry {number}"
        try:
            check_run_id(run_id)
        except WbmergeError as exc:
            raise WbmergeError(f"{where}: {exc}") from None
        if run_id in given:
            raise WbmergeError(f"{where}: run {run_id} given twice")
        given[run_id] = _given(row, where)
    return given


def _json_rows(data: object) -> list[Mapping]:
    if isinstance(data, list):
        if not all(isinstance(row, dict) for row in data):
            raise ValueError("a list must hold objects with run_id and rank")
        return data
    if not isinstance(data, dict):
        raise ValueError("expected an object of run id -> rank")
    rows = []
    for run_id, value in data.items():
        row = dict(value) if isinstance(value, dict) else {"rank": value}
        rows.append({**row, "run_id": run_id})
    return rows


def _given(row: Mapping, where: str) -> GivenRank:
    numbers: dict[str, int | None] = {}
    for column in _COLUMNS:
        value = row.get(column)
        if value is None or value == "":
            numbers[column] = None
            continue
        number = None if isinstance(value, bool) else rank_number(str(value))
        if number is None:
            raise WbmergeError(
                f"{where}: {column} must be a whole number from 0 to {MAX_RANKS - 1}, not {value!r}"
            )
        numbers[column] = number
    if numbers["rank"] is None:
        raise WbmergeError(f"{where}: no rank")
    if (numbers["local_rank"] is None) != (numbers["worker"] is None):
        raise WbmergeError(f"{where}: give local_rank and worker together, or neither")
    job = row.get("job")
    if job not in (None, ""):
        try:
            check_run_id(str(job))  # the job id becomes the base of run ids
        except WbmergeError as exc:
            raise WbmergeError(f"{where}: job: {exc}") from None
    return GivenRank(
        rank=numbers["rank"],
        local_rank=numbers["local_rank"],
        worker=numbers["worker"],
        restart=numbers["restart"] or 0,
        job=str(job) if job not in (None, "") else None,
    )

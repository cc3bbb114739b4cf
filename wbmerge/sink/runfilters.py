"""The MongoDB-style run filters of W&B's public API (`api.runs(path, filters=...)`), as far as
the sink answers them: `$and`, `$or`, equality (a plain value or `$eq`), `$ne`, `$in` and
`$nin`, on a run's group, job type, tags, state, id and display name.

A tag filter matches a run that has the tag (or, for `$in`, any of the tags), as MongoDB
matches an array. Any other operator or field is refused with an error that names it, so
a filter the sink does not understand never answers with the wrong runs.
"""

from __future__ import annotations

from typing import Any

# filter field -> the key of a run as `Store.runs` gives it
FIELDS = {
    "group": "group",
    "jobType": "job_type",
    "job_type": "job_type",
    "tags": "tags",
    "state": "state",
    "name": "id",
    "displayName": "display_name",
    "display_name": "display_name",
}
COMPARISONS = ("$eq", "$ne", "$in", "$nin")
MAX_DEPTH = 32  # nested $and/$or; a hostile filter cannot exhaust the stack


class FilterError(ValueError):
    """A filter the sink does not answer; its message names the operator or field."""


def matcher(filters: object) -> Any:
    """A predicate on runs (`Store.runs` dicts) for a filter document; FilterError for any
    part of it the sink does not support, before any run is looked at."""
    return _document({} if filters is None else filters, 0)


def _document(doc: object, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise FilterError(f"filters nested deeper than {MAX_DEPTH} levels")
    if not isinstance(doc, dict):
        raise FilterError("a filter must be a JSON object")
    parts = [_clause(key, value, depth) for key, value in doc.items()]
    return lambda run: all(part(run) for part in parts)


def _clause(key: object, value: object, depth: int) -> Any:
    if key in ("$and", "$or"):
        if not isinstance(value, list) or not value:
            raise FilterError(f"{key} needs a non-empty list of filters")
        parts = [_document(item, depth + 1) for item in value]
        if key == "$and":
            return lambda run: all(part(run) for part in parts)
        return lambda run: any(part(run) for part in parts)
    if not isinstance(key, str) or key.startswith("$"):
        raise FilterError(f"filter operator {key} is not supported by this sink")
    if key not in FIELDS:
        raise FilterError(
            f"filter field {key!r} is not supported by this sink (only "
            + ", ".join(sorted(FIELDS))
            + ")"
        )
    column = FIELDS[key]
    if isinstance(value, dict) and any(isinstance(k, str) and k.startswith("$") for k in value):
        tests = [_comparison(op, operand, key) for op, operand in value.items()]
        return lambda run: all(test(run.get(column)) for test in tests)
    _check_scalar(value, key)
    return lambda run: _equal(run.get(column), value)


def _comparison(op: object, operand: object, field: str) -> Any:
    if op not in COMPARISONS:
        raise FilterError(f"filter operator {op} is not supported by this sink (on {field!r})")
    if op in ("$in", "$nin"):
        if not isinstance(operand, list):
            raise FilterError(f"{op} on {field!r} needs a list")
        for item in operand:
            _check_scalar(item, field)
        if op == "$in":
            return lambda have: any(_equal(have, want) for want in operand)
        return lambda have: not any(_equal(have, want) for want in operand)
    _check_scalar(operand, field)
    if op == "$eq":
        return lambda have: _equal(have, operand)
    return lambda have: not _equal(have, operand)


def _check_scalar(value: object, field: str) -> None:
    if not (value is None or isinstance(value, (str, int, float, bool))):
        raise FilterError(f"the value of {field!r} must be a string, number, true, false or null")


def _equal(have: object, want: object) -> bool:
    """MongoDB's equality: a list (a run's tags) matches a value it holds."""
    if isinstance(have, list):
        return want in have
    return have == want

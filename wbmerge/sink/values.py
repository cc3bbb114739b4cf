"""Which values a request may store, checked before anything of the request is written.

Everything the sink stores is read again by every page, by `/api/runs` and by
`wbmerge sink show`, for every run at once. A stored summary that is not JSON, or an exit
code that is a string of HTML, would break (or inject into) all of them, so each value
must have the type W&B gives it: summaries, config and history and system-metric lines
are JSON objects nested at most `MAX_DEPTH` deep, exit codes integers, line offsets
non-negative integers, names and notes strings. A value that is not is a `BadValue`,
which the server answers with 400 for that request alone.
"""

from __future__ import annotations

import json
from typing import Any

# Deeper than any summary or config a training script logs; far from Python's recursion
# limit, so that every reader (json, str, the pages) handles a stored value.
MAX_DEPTH = 64
MAX_OFFSET = (1 << 53) - 1  # what a JSON number holds exactly; SQLite's INTEGER holds more
EXIT_CODE_RANGE = (-(1 << 31), (1 << 31) - 1)  # a process's exit status fits in 32 bits


class BadValue(ValueError):
    """A value a request wants stored that does not have the type W&B gives it."""


def json_object_text(text: object, what: str) -> str:
    """`text` if it is a string holding a JSON object nested at most MAX_DEPTH deep."""
    json_object(text, what)
    return str(text)


def json_object(text: object, what: str) -> dict[str, Any]:
    """The JSON object a string holds; BadValue for anything else or anything too deep."""
    if not isinstance(text, str):
        raise BadValue(f"{what} must be a string of JSON")
    try:
        value = json.loads(text)
    except RecursionError:
        raise BadValue(f"{what} is nested too deeply") from None
    except ValueError:
        raise BadValue(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise BadValue(f"{what} is not a JSON object")
    if depth(value) > MAX_DEPTH:
        raise BadValue(f"{what} is nested more than {MAX_DEPTH} deep")
    return value


def depth(value: Any) -> int:
    """How deeply lists and objects nest in a JSON value (a scalar is 0), without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            deepest = max(deepest, level)
            continue
        deepest = max(deepest, level + 1)
        pending.extend((child, level + 1) for child in item)
    return deepest


def exit_code(value: object) -> int | None:
    """An exit code as wandb sends it: an integer (of 32 bits), or None when there is none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadValue("exitcode must be an integer")
    low, high = EXIT_CODE_RANGE
    if not low <= value <= high:
        raise BadValue(f"exitcode {value} is out of range")
    return value


def offset(value: object) -> int:
    """A file_stream chunk's offset: the line number of its first line."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OFFSET:
        raise BadValue("a chunk's offset must be a non-negative integer")
    return value


def text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise BadValue(f"{what} must be a string")
    return value


def tags(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(tag, str) for tag in value):
        raise BadValue("tags must be a list of strings")
    return value


def chunks(files: object) -> list[tuple[str, int, list[str]]]:
    """A file_stream body's `files`: (file name, offset, lines) for each chunk, checked."""
    if files is None:
        return []
    if not isinstance(files, dict):
        raise BadValue("files must be a JSON object of chunks")
    checked = []
    for name, chunk in files.items():
        if not isinstance(chunk, dict):
            raise BadValue(f"the chunk of {name} must be a JSON object")
        lines = chunk.get("content") or []
        if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
            raise BadValue(f"the content of {name} must be a list of strings")
        checked.append((name, offset(chunk.get("offset", 0)), lines))
    return checked

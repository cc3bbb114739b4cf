"""The history rows wandb-core sends, as it reads them from a log: pure functions.

Measured with wandb 0.31's `wandb sync` into the sink, and as wandb-core's source says.
wandb-core reads a history record's items in order into a row (`set_item`). It parses each
value with its own JSON parser (github.com/wandb/simplejsonext, `json_value`) and drops an
item the parser refuses. It takes an object apart into its leaves. It ignores the record's
step field: the row's own step is its `_step` when that is an integer (`item_step`). Then
it numbers the rows (`sent_steps`):

    next = the run record's `starting_step` (0 unless set)
    each row: step = its own step if that is an integer >= next, else next
              next = step + 1 (in int64: after 2**63 - 1 comes -2**63)

Worked example, from 0: rows whose `_step` items say 0, 1, (none), 2, 9, "x", 5 are sent
at 0, 1, 2, 3, 9, 10, 11. The fourth row's 2 is behind 3, the sixth row's "x" is no
integer, and the last row's 5 is behind 11.

An upload that continues a run (the rows the server holds cut from the log's head) starts
again at the starting step, not at the server's last step: the rows it sends are numbered
as if they were the whole log.

In every row wandb writes, the `_step` item is an integer above the previous row's, so each
row is sent at its own item, whichever rows are cut.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from json.decoder import scanstring

from .proto import pb

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NOT_JSON = object()  # what `json_value` gives for a text wandb-core's parser refuses

_BLANKS = " \t\n\r"
_MAX_DEPTH = 501  # a value inside more arrays and objects than 500 is refused
# A number is the longest run of these characters; any but digits and `-` make it a float.
_NUMBER = re.compile(r"[-0-9IN][-0-9.+eEIinfatyN]*")
_INTEGER = re.compile(r"-?[0-9]+")
_WORDS = {"null": None, "true": True, "false": False}


class _Refused(Exception):
    """The parser refuses the text."""


def json_int(text: str) -> int | None:
    """`text` as an integer when wandb-core's parser reads it as one, else None.

    Blanks around it are allowed and leading zeros too (`0100` is 100); `+7`, `7.0` and
    `1e2` are floats; a number longer than int64's text (its leading zeros counted) or
    above it is a float as well, so `00000000000000000001` is no integer.
    """
    value = json_value(text)
    return value if type(value) is int else None


def json_value(text: str) -> object:
    """`text` as wandb-core's JSON parser reads it, or `NOT_JSON` where it refuses it.

    It is Python's json but for numbers and nesting. A number is read whole
    (`_number`): leading zeros are allowed (`0100`, `01.5`), and so are `Inf`, `Infinity`
    and `NaN` without a sign before NaN. An integer past int64 becomes a float. A value
    inside more than 500 arrays and objects is refused.
    """
    try:
        value, at = _parse(text)
    except (_Refused, ValueError, IndexError):  # (IndexError: the text ended too soon)
        return NOT_JSON
    return value if _skip(text, at) == len(text) else NOT_JSON


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at] in _BLANKS:
        at += 1
    return at


def _parse(text: str) -> tuple[object, int]:
    """The value at the start of `text` and where it ends, read without recursion: `open`
    holds the arrays and objects being read (with the key an object's next value takes)."""
    open: list[tuple[list | dict, str | None]] = []
    at = 0
    while True:
        at = _skip(text, at)
        if len(open) >= _MAX_DEPTH:
            raise _Refused
        char = text[at]
        if char in "[{":
            container: list | dict = [] if char == "[" else {}
            at = _skip(text, at + 1)
            if text[at] != ("]" if char == "[" else "}"):
                key, at = (None, at) if char == "[" else _key(text, at)
                open.append((container, key))
                continue
            value, at = container, at + 1
        elif char == '"':
            value, at = scanstring(text, at + 1, True)
        elif (word := next((w for w in _WORDS if text.startswith(w, at)), None)) is not None:
            value, at = _WORDS[word], at + len(word)
        elif match := _NUMBER.match(text, at):
            value, at = _number(match[0]), match.end()
        else:
            raise _Refused
        while True:  # put the value in its container; close the containers that end here
            if not open:
                return value, at
            container, key = open[-1]
            if isinstance(container, list):
                container.append(value)
            else:
                container[key] = value
            at = _skip(text, at)
            if text[at] == ",":
                key, at = (None, at + 1) if isinstance(container, list) else _key(text, at + 1)
                open[-1] = (container, key)
                break
            if text[at] != ("]" if isinstance(container, list) else "}"):
                raise _Refused
            open.pop()
            value, at = container, at + 1


def _key(text: str, at: int) -> tuple[str, int]:
    """An object's key and the colon after it, from `at`; returns the key and where its
    value starts."""
    at = _skip(text, at)
    if text[at] != '"':
        raise _Refused
    key, at = scanstring(text, at + 1, True)
    at = _skip(text, at)
    if text[at] != ":":
        raise _Refused
    return key, at + 1


def _number(token: str) -> int | float:
    """A number's characters as the parser reads them: an integer when they are digits
    (and a leading `-`) that fit int64's text, else Go's float of them."""
    if _INTEGER.fullmatch(token):
        limit = str(INT64_MIN if token.startswith("-") else INT64_MAX)
        if len(token) < len(limit) or len(token) == len(limit) and token <= limit:
            return int(token)
    elif token.startswith("-") and token[1:2] in ("n", "N"):
        raise _Refused  # Go's float parser takes no sign before NaN (Python's does)
    return float(token)  # (raises ValueError where Go's parser refuses it too)


def set_item(row: dict, path: list[str], value: object) -> None:
    """Put an item's parsed `value` at `path` in `row`, as wandb-core builds a row: an
    object is taken apart into its leaves (an empty one puts nothing), and a value put
    below a leaf replaces that leaf by an object."""
    if isinstance(value, dict):
        for key, inner in value.items():
            set_item(row, [*path, key], inner)
        return
    for key in path[:-1]:
        if not isinstance(row.get(key), dict):
            row[key] = {}
        row = row[key]
    row[path[-1]] = value


def item_step(payload: bytes) -> int | None:
    """The step a history record's items give its row: its `_step` when that is an integer
    (the last items at or below the path `_step` decide). None for anything else: no such
    item, a float, a string, or an object (an item below `_step`). Raises protobuf's
    DecodeError for a record that is not valid protobuf."""
    row: dict = {}
    for item in pb.Record.FromString(payload).history.item:
        path = list(item.nested_key) or [item.key]
        if path[0] == "_step" and (value := json_value(item.value_json)) is not NOT_JSON:
            set_item(row, path, value)
    step = row.get("_step")
    return step if type(step) is int else None


def sent_steps(items: Sequence[int | None], starting_step: int = 0) -> list[int]:
    """The `_step` wandb-core sends rows at whose items give `items` (`item_step`), in order."""
    steps = []
    next_step = starting_step
    for item in items:
        step = item if item is not None and item >= next_step else next_step
        steps.append(step)
        next_step = step + 1 if step < INT64_MAX else INT64_MIN
    return steps


def with_step(payload: bytes, step: int) -> bytes:
    """A history record whose row wandb-core sends at `step` wherever it is sent from: its
    items at or below the path `_step` replaced by the one item `_step` = `step`, and its
    step field set to it. (A whole upload replaces what those items say by the step it
    numbers the row at, so the row arrives as it would then.)"""
    record = pb.Record.FromString(payload)
    items = [i for i in record.history.item if (list(i.nested_key) or [i.key])[0] != "_step"]
    del record.history.item[:]
    record.history.item.extend(items)
    item = record.history.item.add()
    item.nested_key.append("_step")
    item.value_json = str(step)
    record.history.step.num = step
    return record.SerializeToString()

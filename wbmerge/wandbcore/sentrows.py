"""The history rows wandb-core sends, as it reads them from a log: pure functions.

Measured with wandb 0.31's `wandb sync` into the sink, and as wandb-core's source says.
wandb-core reads a history record's items in order into a row (`row_of`). It takes each
item's typed value when wandb wrote one (`item_value`), else parses its JSON text with its
own parser (github.com/wandb/simplejsonext, `json_value`), and drops an item the parser
refuses or that has no key. It takes an object apart into its leaves. It ignores the
record's step field: the row's own step is its `_step` when that is an integer
(`item_step`). Then it numbers the rows (`sent_steps`):

    next = where the run starts (`starting_step`: 0 unless a run record sets it)
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

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from json.decoder import scanstring

from ..log import item_path, pb, twins

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NOT_JSON = object()  # what `json_value` gives for a text wandb-core's parser refuses

_BLANKS = " \t\n\r"
_MAX_DEPTH = 501  # a value inside more arrays and objects than 500 is refused
# A number is the longest run of these characters; any but digits and `-` make it a float.
_NUMBER = re.compile(r"[-0-9IN][-0-9.+eEIinfatyN]*")
_INTEGER = re.compile(r"-?[0-9]+")
_WORDS = {"null": None, "true": True, "false": False}
_LONE_HALF = re.compile("[\ud800-\udfff]")  # (Python joins the halves of a pair)


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


def json_value(text: str, reference: bool = False) -> object:
    """`text` as wandb-core's JSON parser reads it, or `NOT_JSON` where it refuses it.

    It is Python's json but for numbers and nesting. A number is read whole
    (`_number`): leading zeros are allowed (`0100`, `01.5`), and so are `Inf`, `Infinity`
    and `NaN` without a sign before NaN. An integer past int64 becomes a float. A value
    inside more than 500 arrays and objects is refused.

    A text that is one number and nothing else, as nearly every metric's is, is read
    without the parser (`bare_number`), at a third of its cost; with `reference` every
    text goes through the parser (the tests compare the two).
    """
    if not reference and (value := bare_number(text)) is not None:
        return value
    try:
        value, at = _parse(text)
    except (_Refused, ValueError, IndexError):  # (IndexError: the text ended too soon)
        return NOT_JSON
    return value if _skip(text, at) == len(text) else NOT_JSON


def bare_number(text: str) -> object:
    """`json_value` of a text that is one number token and nothing else, read as the parser
    reads such a token (`_number`) without the parser; None for any other text (blanks
    around the number included), which the parser reads."""
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return _number(text)
    except (_Refused, ValueError):
        return NOT_JSON


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
            value, at = _string(text, at)
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
    key, at = _string(text, at)
    at = _skip(text, at)
    if text[at] != ":":
        raise _Refused
    return key, at + 1


def _string(text: str, at: int) -> tuple[str, int]:
    """The string whose quote is at `at`, and where it ends. A `\\u` escape of half a
    UTF-16 pair with no other half reads as U+FFFD, as in Go (Python keeps the half)."""
    value, at = scanstring(text, at + 1, True)
    return _LONE_HALF.sub("\ufffd", value), at


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


def item_value(item: pb.HistoryItem) -> object:
    """A history item's value as wandb-core reads it (`NOT_JSON` where it drops the item):
    its typed value when it has one (wandb writes one beside the JSON text when told to,
    with `x_history_value_encoding="json,typed"`), else its JSON text (`json_value`)."""
    typed = item.WhichOneof("value")
    if typed is None:
        return json_value(item.value_json)
    if typed == "json":
        return json_value(item.json)
    return None if typed == "none" else getattr(item, typed)


def reference_row(history: pb.HistoryRecord, top: str | None = None) -> dict:
    """The row wandb-core builds from a history record's items, in order (only the items
    under the name `top`, when given): each value put at its path (`set_item`); an item
    without a key, or whose value it refuses, left out."""
    row: dict = {}
    for item in history.item:
        path = item_path(item)
        if path == [""] and not item.nested_key or top is not None and path[0] != top:
            continue
        if (value := item_value(item)) is not NOT_JSON:
            set_item(row, path, value)
    return row


def flat_row(history: pb.HistoryRecord, top: str | None = None) -> dict:
    """`reference_row`, but a row of plain values read in one call of `json`, not item by
    item (the read-back builds 64 rows of every run: item by item was most of its cost).

    Only a row whose items each have one name (a key, or a nested key of one part, as
    wandb writes them) and no typed value, and whose texts hold no string, array or
    object and are each one value to `json`, is read so: for such texts `json` reads as
    wandb-core's parser does, but for an integer past int64 (a float to the parser). Any
    other row (leading zeros, `Inf`, `+7`, a text of two values, that integer) is the
    reference's."""
    if top is not None:
        return reference_row(history, top)
    keys: list[str | None] = []
    texts = []
    for item in history.item:
        nested = item.nested_key
        if len(nested) > 1 or item.WhichOneof("value") is not None:
            return reference_row(history)
        keys.append(nested[0] if nested else item.key or None)  # (None: dropped, no key)
        texts.append(item.value_json)
    row = _flat(keys, texts)
    return reference_row(history) if row is None else row


def _flat(
    keys: list[str | None], texts: list[str], loads: Callable[[str], object] = json.loads
) -> dict | None:
    """The row of items of these names and texts when their texts are plain values (see
    `flat_row`), else None. `loads` reads the texts: `json.loads`, or one that reads every
    text as it does (see `record_row`)."""
    text = ",".join(texts)
    if _NOT_SCALAR.search(text):
        return None
    try:
        values = loads(f"[{text}]")
    except ValueError:
        return None
    if len(values) != len(keys):  # (a text with a comma in it: more values than items)
        return None
    row: dict = {}
    for key, value in zip(keys, values, strict=True):
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            return None
        if key is not None:
            row[key] = value
    return row


def _no_flat_items(payload: bytes) -> None:
    """The Python twin of `_records.flat_items`: it reads no record so, and every record
    goes to protobuf (as `records.prove_nothing` proves none)."""
    return None


# A history record's names and texts read from its bytes, where it is in wandb's shape
# (`wbmerge/log/_records.c`); None sends it to protobuf.
FLAT_ITEMS, FLAT_ITEMS_WAY = twins(_no_flat_items, "_records", "flat_items")


def record_row(payload: bytes, loads: Callable[[str], object] = json.loads) -> dict:
    """`row_of` of a history record's bytes. With the flat way, a record in wandb's shape
    has its names and texts read from its bytes in one compiled call rather than item by
    item through protobuf, and its texts by `loads`: `json.loads`, or a reader that reads
    every text as it does (the read-back passes orjson's, `upload.serverjson`, which
    parsed a row in 13 us rather than 18 us); any other record, or a row whose texts are
    not plain values, is parsed and read as before. Raises protobuf's DecodeError for a
    record that is not valid protobuf."""
    if row_of is flat_row and (items := FLAT_ITEMS[FLAT_ITEMS_WAY](payload)) is not None:
        row = _flat(*items, loads)
        if row is not None:
            return row
    return row_of(pb.Record.FromString(payload).history)


_NOT_SCALAR = re.compile(r'["\[\]{}]')

# The ways to build a row (`reference_row` the one the tests compare the other with);
# `WBMERGE_PURE=1` uses the reference, as for the compiled twins (`log.twins`).
ROW_WAYS: dict[str, Callable[..., dict]] = {"reference": reference_row, "flat": flat_row}
row_of = ROW_WAYS["reference" if os.environ.get("WBMERGE_PURE") else "flat"]


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
    step = row_of(pb.Record.FromString(payload).history, "_step").get("_step")
    return step if type(step) is int else None


def starting_step(runs: Sequence[pb.RunRecord]) -> int:
    """The step wandb-core numbers a log's rows from, given the run records before its
    first history row: the last that sets one, by a fork's branch point on `_step` (one
    after it) or by its `starting_step`; else 0."""
    step = 0
    for run in runs:
        point = run.branch_point
        if point.run and point.run != run.run_id and point.metric == "_step":
            step = _go_int64(point.value) + 1
        elif run.starting_step:
            step = run.starting_step
    return step


def _go_int64(value: float) -> int:
    """Go's int64(value) on x86-64: truncated toward zero; NaN and values out of int64's
    range give int64's least."""
    return int(value) if math.isfinite(value) and -(2.0**63) <= value < 2.0**63 else INT64_MIN


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
    items = [item for item in record.history.item if item_path(item)[0] != "_step"]
    del record.history.item[:]
    record.history.item.extend(items)
    item = record.history.item.add()
    item.nested_key.append("_step")
    item.value_json = str(step)
    record.history.step.num = step
    return record.SerializeToString()

"""JSON from the server read fast, meaning exactly what the standard `json` module reads.

After an upload every history row of a run is read back, and each row is a JSON line
inside a JSON answer: parsing them was about a third of a sync's own CPU. orjson parses
them several times faster, but it does not read every text as `json` does, and what a
row means must not depend on the parser. orjson refuses the `NaN` and `Infinity` tokens
wandb writes, numbers past a double's range (`1e400`, which `json` reads as infinity),
and lone surrogates in strings: such a text is read again by `json`. Two differences
raise nothing, so they are looked for in what orjson gives: an integer past 64 bits it
reads as a float (so a float of at least 2**63 in size sends the text to `json`, which
reads the rare true float of that size alike), and it reads nesting far deeper than
`json` can (nesting past `DEEP` sends the text to `json`, which raises RecursionError
where it did before).

`WAYS` holds both; `json` is the reference the tests compare orjson's way with, and the
one used when orjson is not installed or `WBMERGE_PURE=1` is set (as for the compiled
twins, `log.twins`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

try:
    import orjson
except ImportError:  # (a dependency; without it the reference reads alone)
    orjson = None

BIG = 2.0**63  # a float this large may be an integer orjson could not hold in 64 bits
DEEP = 64  # containers nested past this are read by `json` (rows nest two or three deep)
Text = str | bytes


def reference(text: Text) -> object:
    """`text` as the standard `json` module reads it (raises ValueError or RecursionError)."""
    return json.loads(text)


def fast(text: Text) -> object:
    """`text` as `reference` reads it, read by orjson when orjson reads it alike."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
    if _numbers_in_range(value):  # (most rows: the walk over every value is skipped)
        return value
    return json.loads(text) if _unlike(value) else value


def _numbers_in_range(value: object) -> bool:
    """Whether `value` is an object of numbers only, each less than `BIG` in size, found
    by two calls rather than a walk: then `_unlike` would find nothing. Anything else (a
    string, a container, None, nothing at all) makes the comparison fail or raise."""
    if type(value) is not dict or not value:
        return False
    try:
        return -BIG < min(value.values()) and max(value.values()) < BIG
    except TypeError:
        return False


def _unlike(value: object) -> bool:
    """Whether orjson's reading may differ from `json`'s: a float of 2**63 or more in size
    (maybe an integer past 64 bits), or containers nested past `DEEP`."""
    kind = type(value)
    if kind is float:
        return not -BIG < value < BIG
    if kind is not dict and kind is not list:
        return False
    stack = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        for item in container.values() if type(container) is dict else container:
            kind = type(item)
            if kind is float:
                if not -BIG < item < BIG:
                    return True
            elif kind is dict or kind is list:
                if depth >= DEEP:
                    return True
                stack.append((item, depth + 1))
    return False


WAYS: dict[str, Callable[[Text], object]] = {"json": reference}
if orjson is not None:
    WAYS["orjson"] = fast
WAY = "orjson" if "orjson" in WAYS and not os.environ.get("WBMERGE_PURE") else "json"
loads = WAYS[WAY]

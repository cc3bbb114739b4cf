"""A follow's merge kept on disk, so that a follower killed and started again goes on from
its last verified round instead of merging every run from scratch.

Each target followed a round at a time has a directory under the state directory,
`follow/<hash of the run's key>`, holding `state.json` (the `LiveShared.state()` of a
shared target's last verified round, or a pass-through's `LivePassthrough.state()`) and
`spool` (its console and system-metric spool, or the pass-through's records sent:
`Spools.kept`); one more directory per set of paths followed holds `scans.json`, how far
each log's steps and exit record were counted (`tails.ScannedLog`), a shortcut that is
checked as the merge is. The state is written after
the round's upload was verified, to a temporary file that is synced and then renamed over
the last one (the spool synced first), so a follower killed at any point leaves the state
of a round the server holds, or of the round before it: then the server holds more rows
than the state says, and the round merges from scratch, or the same rows (the lost round
sent none), and the round reads again what the lost one read.

The state directory may hold anything, so the file is data only: one line of JSON naming
the format, its version and a hash of the rest, then the state as JSON, bytes in base64.
Every value is checked against `STATE` (its type, and that an integer fits in 64 bits)
before any of it is used. A file that is not there, damaged, of another version, or made
for other sources or options (a rank or an elastic restart joined, another `--key-format`)
is not used: the follower says why in one line and merges from scratch. Values of the
right types may still be wrong (the hash is no secret): the merge that goes on from a state
checks it against the files (`incremental`, `passlive`), and the round against what the
server holds (`rounds`), and a state that does not fit is dropped the same way.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

FORMAT = "wbmerge follow state"
# 2: a definition written again when it changes the run; 3: the statistics across ranks;
# 4: the steps of the rows sent as runs (`StepRuns.runs`), not one by one
VERSION = 4
STATE_FILE = "state.json"
SPOOL_FILE = "spool"
SCANS_FILE = "scans.json"
_LARGEST_FILE = 1 << 30  # bytes: far past the state of a long run (a few MB at 160k steps)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class Unusable(Exception):
    """A saved state that must not be used: the message says why, as a phrase."""


def directory(state_dir: Path, key: str) -> Path:
    """Where the follow of the run `key` (`Ledger.key`) keeps its merge."""
    return state_dir / "follow" / hashlib.sha256(key.encode()).hexdigest()[:32]


def made_for(key: str, settings: Mapping[str, object], sources: tuple) -> str:
    """What a state is of: the run, the merge's settings and its sources (`sources_of`)."""
    text = json.dumps(
        [key, settings, [list(map(str, s)) if isinstance(s, tuple) else str(s) for s in sources]],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


# The shape of `LiveShared.state()`: how each value is written and checked.
BYTES, INT, BOOL, STR = "bytes", "int", "bool", "str"


def opt(kind: object) -> tuple:
    return ("opt", kind)


def list_of(kind: object) -> tuple:
    return ("list", kind)


def int_map(kind: object) -> tuple:
    """A dict with integer keys, written as a list of [key, value] pairs."""
    return ("int_map", kind)


def str_map(kind: object) -> tuple:
    """A dict with string keys, written as a list of [key, value] pairs."""
    return ("str_map", kind)


def pair(*kinds: object) -> tuple:
    """A list of so many values, each of its own kind."""
    return ("tuple", kinds)


_PLAIN = (INT, STR, opt(INT))  # (lists of these are JSON as they are)

SOURCE = {
    "offset": INT,
    "resume": INT,
    "partial": list_of(BYTES),
    "digest": BYTES,
    "identity": opt(pair(INT, INT)),
    "started": BOOL,
    "ended": BOOL,
    "size_at_end": INT,
    "exit_seen": BOOL,
    "head": BYTES,
}
RANK = {
    "known": list_of(BYTES),
    "summary": list_of(pair(opt(BYTES), BYTES)),
    "exit": opt(BYTES),
    "steps": pair(INT, opt(INT)),
    "seq": INT,
    "last_key": list_of(INT),
    "last_rows": INT,
    "globs": list_of(BYTES),
    "named": list_of(STR),
    "spool": opt(STR),
}
# `MergedRankStats.state()`, one per kind of statistics (`--skew-metrics`, `--rank-stats`):
# its arrays as their bytes
ACROSS = {
    "statistics": list_of(STR),
    "keys": list_of(BYTES),
    "pending": list_of(pair(BYTES, BYTES, BYTES, BYTES)),
    "last": {"keys": BYTES, "columns": list_of(pair(STR, BYTES))},
}
STATE = {
    "rounds": INT,
    "rows_sent": INT,
    "others_sent": list_of(BYTES),
    "held": opt(BYTES),
    "step_runs": list_of(pair(opt(INT), INT)),  # (`StepRuns.runs`)
    "last_row": opt(BYTES),
    "readers": int_map({"current": INT, "sources": list_of(SOURCE)}),
    "ranks": int_map(RANK),
    "pending": {
        "steps": list_of(INT),
        "ranks": list_of(INT),
        "labelled": list_of(BYTES),
        "names": list_of(list_of(STR)),
        "reserved": list_of(BYTES),
    },
    "events": list_of(pair(list_of(INT), BYTES)),
    "seen": list_of(BYTES),
    "across": list_of(ACROSS),
    "spool": {
        "end": INT,
        "digest": BYTES,
        "writers": str_map(pair(list_of(INT), list_of(INT), BYTES)),
    },
}


# The shape of `LivePassthrough.state()` (a pass-through target: `new`, `auto`).
PASSTHROUGH = {
    **{
        name: STATE[name]
        for name in ("rounds", "rows_sent", "held", "step_runs", "last_row", "readers", "spool")
    },
    "head": list_of(BYTES),
    "before_run": list_of(BYTES),
    "waiting": list_of(pair(opt(STR), INT, BYTES)),
    "steps": pair(INT, opt(INT)),
    "summary": list_of(pair(list_of(STR), BOOL, BYTES)),
}

# How far a follower counted each log's steps (`tails.ScannedLog.state`), by path
SCANS = str_map(
    {
        "counts": pair(INT, INT, opt(INT), opt(INT), BOOL, opt(INT)),
        "place": {"current": INT, "sources": list_of(SOURCE)},
    }
)


def encode(value: object, kind: object) -> object:
    """`value` as JSON values, by `kind` (see `STATE`)."""
    if kind == BYTES:
        return base64.b64encode(value).decode()  # type: ignore[arg-type]
    if kind in (INT, BOOL, STR):
        return value
    if isinstance(kind, dict):
        return {name: encode(value[name], inner) for name, inner in kind.items()}  # type: ignore[index]
    shape, inner = kind  # type: ignore[misc]
    if shape == "opt":
        return None if value is None else encode(value, inner)
    if shape == "list":
        if inner in _PLAIN:  # (a step per row sent: the one list as long as the run)
            return list(value)  # type: ignore[call-overload]
        return [encode(item, inner) for item in value]  # type: ignore[attr-defined]
    if shape in ("int_map", "str_map"):
        return [[k, encode(v, inner)] for k, v in value.items()]  # type: ignore[attr-defined]
    return [encode(item, each) for item, each in zip(value, inner, strict=True)]  # type: ignore[call-overload]


def decode(value: object, kind: object) -> object:
    """The value `encode` gave `value` as, checked; raises ValueError when it is not."""
    if kind == BYTES:
        if not isinstance(value, str):
            raise ValueError("not bytes")
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ValueError("not base64") from None
    if kind == INT:
        if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"not a 64-bit integer: {value!r:.40}")
        return value
    if kind == BOOL:
        if type(value) is not bool:
            raise ValueError("not true or false")
        return value
    if kind == STR:
        if not isinstance(value, str):
            raise ValueError("not a string")
        return value
    if isinstance(kind, dict):
        if not isinstance(value, dict) or set(value) != set(kind):
            raise ValueError(f"not an object of {sorted(kind)}")
        return {name: decode(value[name], inner) for name, inner in kind.items()}
    shape, inner = kind  # type: ignore[misc]
    if shape == "opt":
        return None if value is None else decode(value, inner)
    if not isinstance(value, list):
        raise ValueError("not a list")
    if shape == "list":
        if inner == opt(INT) and all(type(item) is int for item in value):
            if value and not _INT64[0] <= min(value) <= max(value) <= _INT64[1]:
                raise ValueError("not a 64-bit integer")
            return value
        return [decode(item, inner) for item in value]
    if shape in ("int_map", "str_map"):
        found = {}
        for entry in value:
            if not isinstance(entry, list) or len(entry) != 2:
                raise ValueError("not a [key, value] pair")
            found[decode(entry[0], INT if shape == "int_map" else STR)] = decode(entry[1], inner)
        if len(found) != len(value):
            raise ValueError("a key twice")
        return found
    if len(value) != len(inner):
        raise ValueError(f"not {len(inner)} values")
    return tuple(decode(item, each) for item, each in zip(value, inner, strict=True))


def load(place: Path, made: str, name: str = STATE_FILE, shape: object = STATE) -> dict | None:
    """The state saved in `place` for what `made` (`made_for`) names; None when there is
    none. Raises Unusable (why, as a phrase) when there is one that must not be used, and
    OSError when it cannot be read. (`name` and `shape`: the follower's `SCANS_FILE` of
    `SCANS` instead of a merge's state.)"""
    path = place / name
    try:
        with open(path, "rb") as stream:
            data = stream.read(_LARGEST_FILE + 1)
    except FileNotFoundError:
        return None
    if len(data) > _LARGEST_FILE:
        raise Unusable(f"its saved state {path} is larger than any it writes")
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError
    except ValueError:
        raise Unusable(f"its saved state {path} is damaged (not one wbmerge wrote)") from None
    if header.get("version") != VERSION:
        raise Unusable(
            f"its saved state {path} is of another wbmerge (format {header.get('version')!r:.20}, "
            f"this one reads {VERSION})"
        )
    if header.get("digest") != body_digest(body):
        raise Unusable(f"its saved state {path} is damaged (its hash does not match)")
    try:
        saved = json.loads(body)
        if not isinstance(saved, dict) or set(saved) != {"made_for", "state"}:
            raise ValueError("not the state's object")
        if saved["made_for"] != made:
            raise Unusable(
                "its saved state is of other sources or options (a rank or an elastic "
                "restart joined, or the options changed)"
            )
        return decode(saved["state"], shape)  # type: ignore[return-value]
    except (ValueError, RecursionError) as exc:
        raise Unusable(f"its saved state {path} is damaged ({exc})") from None


def save(
    place: Path, made: str, state: dict, name: str = STATE_FILE, shape: object = STATE
) -> None:
    """Replace the state saved in `place` by `state`, atomically; raises OSError."""
    place.mkdir(parents=True, exist_ok=True)
    body = json.dumps(
        {"made_for": made, "state": encode(state, shape)}, separators=(",", ":")
    ).encode()
    header = {"format": FORMAT, "version": VERSION, "digest": body_digest(body)}
    temporary = place / f".{name}.{os.getpid()}"
    try:
        with open(temporary, "wb") as stream:
            stream.write(json.dumps(header).encode() + b"\n" + body)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, place / name)
    finally:
        temporary.unlink(missing_ok=True)
    _sync_directory(place)


def body_digest(body: bytes) -> str:
    """The hash the header gives of the rest of the file."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def discard(place: Path, name: str = STATE_FILE) -> None:
    """Remove the state saved in `place` (before its spool is made anew): from now on a
    follower started again merges from scratch."""
    try:
        (place / name).unlink(missing_ok=True)
        _sync_directory(place)
    except OSError:
        pass  # (a directory never made, or gone: there is nothing to go on from either)


def remove(place: Path) -> None:
    """Remove all a follow kept of a run (it is final: nothing goes on from it)."""
    discard(place)
    shutil.rmtree(place, ignore_errors=True)


def _sync_directory(place: Path) -> None:
    fd = os.open(place, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

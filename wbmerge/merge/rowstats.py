"""The shared merge's side of `--rank-stats`: each merged row's statistics across ranks.

The shared merge feeds `add_rows` the history rows of each turn, all ranks' rows at once
(the rows' steps as the merge places them, restarts continued), and asks `row_fields` for
the statistic items of the steps it writes, in step order: a step is written only once
every rank's rows of it have been read, so they have all been fed. Values wait here only
from the read of a row to the writing of its step, so memory follows the merge's
read-ahead, not the run's length. The statistics are
`rankstats.across_ranks` of the numbers the ranks logged, one batch of steps at a time;
the items are built as columns too.

A key's statistics are of the key as logged, a nested key by its full name joined with
`.` (`eval.loss` gets `eval.loss/ranks/max`). The merged run's summary holds each statistic
key's last value, the statistics of the last step at which a rank logged a number for the
key: the last point of its chart.

`state()` gives all it holds as plain values and `restore` sets a new one to them, so a
follower started again goes on (`follow.incremental`): the raw key parts that were given
an id, in the order they were met (replayed, they give the same ids; a key part without
statistics gives none, and is found again when it is met), the numbers read and not yet
written, and each key's last statistics. Arrays are their bytes (NaN and the infinities
as they are, which JSON cannot hold), so the state is O(keys + numbers waiting), never
O(steps).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..analyse import STATS, AcrossRanks, across_ranks, dense_ids, last_of_each, spread_of, stat_key
from ..log import items, wire

_MAX_TEXT = 64  # longer than any number's JSON text (a float64's is at most 24 characters)


class MergedRankStats:
    """Statistics across the ranks of one shared target, fed while its rows are read.

    `--rank-stats`: `STATS` of every user key, in the rows and (their last values) the
    summary. Subclasses choose other statistics of other keys (`MergedSpreads`).
    """

    statistics: tuple[str, ...] = STATS  # of each key, in the order they are written
    finite_only = False  # whether NaN and the infinities are left out of the statistics
    in_summary = True  # whether the summary holds each statistic's last value

    def __init__(self, key_format: str, reserved: Iterable[str]) -> None:
        self.key_format = key_format
        self._reserved = frozenset(reserved)
        self._key_of_raw: dict[bytes, int] = {}  # raw key part -> key id, -1: no statistics
        self._key_ids: dict[str, int] = {}  # key name -> id
        self._key_parts: list[list[bytes]] = []  # key id -> the key part of each statistic
        self._name_places = np.empty(0, np.int64)  # key id -> its place in name order
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._last: dict[int, tuple] = {}  # key id -> its latest statistics, for the summary

    @property
    def metrics(self) -> int:
        """The distinct statistic keys written so far."""
        return len(self.statistics) * len(self._last)

    def add_rows(
        self,
        ranks: np.ndarray,
        steps: np.ndarray,
        data: bytes,
        starts: np.ndarray,
        ends: np.ndarray,
        batch: items.Items | None,
    ) -> None:
        """Rows of one or many ranks: row i is of rank `ranks[i]`, placed at `steps[i]`,
        its item fields `data[starts[i]:ends[i]]`; each rank's rows are together, in step
        order. `batch`: their items as the caller split them (`items.split_spans`), None
        where the split was refused: then they are split item by item (the caller gives a
        rank's rows on their own then, so one rank's long value costs only its rows)."""
        if not len(steps):
            return
        if batch is not None:
            try:
                self._add(ranks, steps, batch)
                return
            except ValueError:
                pass  # a key part that is not one: the split does not hold
        regions = [data[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        self._add(ranks, steps, items.split_exact(regions))

    def _add(self, ranks: np.ndarray, steps: np.ndarray, batch: items.Items) -> None:
        index, raw_keys = batch.key_codes()
        ids = np.array([self._key_id(raw) for raw in raw_keys], np.int64)
        if not len(ids):
            return
        key = ids[index]
        where = np.flatnonzero(key >= 0)
        if not len(where):
            return
        numbers, _ = items.json_numbers(batch.json(where))
        logged = numbers.is_valid().to_numpy(zero_copy_only=False)
        values = numbers.to_numpy(zero_copy_only=False)[logged]
        where = where[logged]
        if self.finite_only:  # a key twice in a row: its last number counts, then if finite
            last = last_of_each(batch.row[where] * (int(key.max()) + 1) + key[where])
            finite = last[np.isfinite(values[last])]
            values, where = values[finite], where[finite]
        row = batch.row[where]
        step = np.asarray(steps, np.int64)[row]
        rank = np.asarray(ranks, np.int64)[row]
        key = key[where]
        if len(step) > 1 and (step[1:] < step[:-1]).any():
            # several ranks' rows: by step, so that `row_fields` can cut where steps pass
            # (stable: a rank's repeated key keeps its order, the last value counts)
            order = np.argsort(step, kind="stable")
            step, key, rank, values = step[order], key[order], rank[order], values[order]
        self._pending.append((step, key, rank, values))

    def _key_id(self, raw: bytes) -> int:
        found = self._key_of_raw.get(raw)
        if found is None:
            path = wire.key_path(raw)
            parts = None if path[0] in self._reserved else self._statistic_parts(path)
            if parts is None:
                found = -1
            else:  # (two spellings of a key, `key` and `nested_key`, have one path)
                found = self._key_ids.setdefault(".".join(path), len(self._key_ids))
                if found == len(self._key_parts):
                    self._key_parts.append(parts)
            self._key_of_raw[raw] = found
        return found

    def _statistic_parts(self, path: list[str]) -> list[bytes] | None:
        """The key part of each statistic of the user key `path` (None: it has none). A
        nested key is named by its path joined with `.`."""
        name = ".".join(path)
        return [wire.key_part([stat_key(self.key_format, name, s)]) for s in self.statistics]

    def _values(self, stats: AcrossRanks) -> tuple[list[np.ndarray], np.ndarray]:
        """(each statistic's values, whether they are defined) of every entry of `stats`."""
        return [stats.column(stat) for stat in self.statistics], np.ones(len(stats), bool)

    def row_fields(self, steps: np.ndarray) -> list[bytes]:
        """The statistic item fields of each of `steps` (ascending, the merged rows being
        written, after those of every earlier call), concatenated per step."""
        fields = [b""] * len(steps)
        if not len(steps) or not self._pending:
            return fields
        through = int(steps[-1])
        taken, kept = [], []
        for chunk in self._pending:  # each chunk's steps ascend: cut it where they pass
            cut = int(np.searchsorted(chunk[0], through, side="right"))
            if cut:
                taken.append(chunk if cut == len(chunk[0]) else tuple(c[:cut] for c in chunk))
            if cut < len(chunk[0]):
                kept.append(chunk if not cut else tuple(c[cut:] for c in chunk))
        self._pending = kept
        if not taken:
            return fields
        stats = across_ranks(*(np.concatenate(column) for column in zip(*taken, strict=True)))
        columns, defined = self._values(stats)
        self._remember_last(stats.key[defined], [column[defined] for column in columns])
        at = np.searchsorted(steps, stats.step)
        written = (at < len(steps)) & (steps[np.minimum(at, len(steps) - 1)] == stats.step)
        rows = np.flatnonzero(written & defined)
        if not len(rows):
            return fields
        # a step's statistics in the order of their keys' names, whatever order reads met them
        rows = rows[np.lexsort((self._name_place()[stats.key[rows]], stats.step[rows]))]
        joined = self._fields(stats, columns, rows)
        places = at[rows]  # (ascending)
        for place, text in zip(places[_firsts(places)].tolist(), joined, strict=True):
            fields[place] = text
        return fields

    def _name_place(self) -> np.ndarray:
        """By key id: the key's place among all keys' names, sorted."""
        if len(self._name_places) < len(self._key_ids):
            order = np.argsort(np.array(list(self._key_ids), str), kind="stable")
            self._name_places = np.empty(len(order), np.int64)
            self._name_places[order] = np.arange(len(order))
        return self._name_places

    def _fields(
        self, stats: AcrossRanks, columns: list[np.ndarray], rows: np.ndarray
    ) -> list[bytes]:
        """The item fields of the statistics (`columns`) of the entries `rows` (by step),
        joined per step."""
        count = len(self.statistics)
        texts = [_json_texts(column[rows]) for column in columns]
        # field (group g, statistic s) at g * count + s: its head (tag, length, key part,
        # value tag and length), then its JSON text
        text = pa.concat_arrays([t.cast(pa.binary()) for t in texts])  # statistic-major
        order = (np.arange(len(rows))[:, None] + len(rows) * np.arange(count)).ravel()
        text = text.take(order)
        length = pc.binary_length(text).to_numpy().astype(np.int64)
        code = (stats.key[rows][:, None] * count + np.arange(count)).ravel()
        pair = code * _MAX_TEXT + length
        head_at, present = dense_ids(pair)  # (a small range: no sort)
        heads = []
        for value in present.tolist():
            code_of, size = divmod(value, _MAX_TEXT)
            part = self._key_parts[code_of // count][code_of % count]
            value_part = b"\x82\x01" + bytes([size])
            heads.append(b"\x0a" + wire.encode_varint(len(part) + 3 + size) + part + value_part)
        pool = pa.concat_arrays([pa.array(heads, pa.binary()), text])
        pieces = np.empty(2 * len(pair), np.int64)
        pieces[0::2] = head_at.reshape(-1)
        pieces[1::2] = np.arange(len(pair)) + len(heads)
        per_step = np.diff(np.append(_firsts(stats.step[rows]), len(rows)))
        return items.join_rows(pool.take(pieces), 2 * count * per_step)

    def _remember_last(self, keys: np.ndarray, columns: list[np.ndarray]) -> None:
        """Each key's statistics at its latest step so far (entries are sorted by step)."""
        found, from_end = np.unique(keys[::-1], return_index=True)
        rows = len(keys) - 1 - from_end
        latest = [column[rows].tolist() for column in columns]
        for position, key in enumerate(found.tolist()):
            self._last[key] = tuple(column[position] for column in latest)

    def state(self) -> dict:
        """All this holds, as plain values (see the module's docstring), for `restore`."""
        last = [np.asarray(column) for column in zip(*self._last.values(), strict=True)]
        if not last:
            last = [np.empty(0, np.float64)] * len(self.statistics)
        return {
            "statistics": list(self.statistics),
            "keys": [raw for raw, found in self._key_of_raw.items() if found >= 0],
            "pending": [[_array_bytes(column) for column in chunk] for chunk in self._pending],
            "last": {
                "keys": _array_bytes(np.array(list(self._last), np.int64)),
                "columns": [[column.dtype.kind, _array_bytes(column)] for column in last],
            },
        }

    def restore(self, state: dict) -> None:
        """Set this one, new and made with the same key format, to `state` (`state()`).
        Raises ValueError when `state` is of other statistics or not one `state()` gives."""
        if tuple(state["statistics"]) != self.statistics:
            raise ValueError(f"statistics {state['statistics']} saved, not {list(self.statistics)}")
        for raw in state["keys"]:
            if self._key_id(raw) < 0:
                raise ValueError("a saved statistic key of no statistics")
        keys = len(self._key_parts)
        for chunk in state["pending"]:
            step, key, rank = (_array_of(part, "i") for part in chunk[:3])
            values = _array_of(chunk[3], "f")
            if not len(step) or len({len(step), len(key), len(rank), len(values)}) != 1:
                raise ValueError("numbers waiting in columns of unequal lengths")
            if (step[1:] < step[:-1]).any() or key.min() < 0 or key.max() >= keys:
                raise ValueError("numbers waiting out of step order or of keys not saved")
            self._pending.append((step, key, rank, values))
        last = state["last"]
        ids = _array_of(last["keys"], "i")
        columns = [_array_of(data, kind).tolist() for kind, data in last["columns"]]
        if len(columns) != len(self.statistics) or any(len(c) != len(ids) for c in columns):
            raise ValueError("last statistics of other columns than the keys'")
        if len(ids) and (ids.min() < 0 or ids.max() >= keys or len(np.unique(ids)) < len(ids)):
            raise ValueError("last statistics of keys not saved")
        self._last = dict(zip(ids.tolist(), zip(*columns, strict=True), strict=True))

    def summary_fields(self) -> bytes:
        """The summary items of every statistic key: its last value."""
        if not self.in_summary:
            return b""
        parts = []
        place = self._name_place()
        for key, values in sorted(self._last.items(), key=lambda entry: place[entry[0]]):
            for part, value in zip(self._key_parts[key], values, strict=True):
                parts.append(wire.item_field(part, wire.value_part(json.dumps(value))))
        return b"".join(parts)


class MergedSpreads(MergedRankStats):
    """`--skew-metrics`: `wbmerge/spread/{key}` of every one-level user key at each step,
    (max - min) / |median| over the ranks' finite values (`spread.spread_of`), where it is defined
    (two values or more, a median not zero). Not in the summary."""

    statistics = ("spread",)
    finite_only = True
    in_summary = False

    def _statistic_parts(self, path: list[str]) -> list[bytes] | None:
        return [wire.key_part([f"wbmerge/spread/{path[0]}"])] if len(path) == 1 else None

    def _values(self, stats: AcrossRanks) -> tuple[list[np.ndarray], np.ndarray]:
        value = spread_of(stats.count, stats.min, stats.median, stats.max)
        return [value], ~np.isnan(value)


def _firsts(ascending: np.ndarray) -> np.ndarray:
    """Where each run of equal values of `ascending` starts."""
    return np.flatnonzero(np.concatenate([[True], ascending[1:] != ascending[:-1]]))


_SAVED_KINDS = {"i": "<i8", "f": "<f8"}  # how a saved array's kind is held: 64 bits


def _array_bytes(column: np.ndarray) -> bytes:
    return np.ascontiguousarray(column, _SAVED_KINDS[column.dtype.kind]).tobytes()


def _array_of(data: bytes, kind: str) -> np.ndarray:
    """The array `_array_bytes` gave `data` as (a copy: it is written to)."""
    if kind not in _SAVED_KINDS:
        raise ValueError(f"a saved array of kind {kind!r:.10}")
    return np.frombuffer(data, _SAVED_KINDS[kind]).copy()


def _json_texts(numbers: np.ndarray) -> pa.Array:
    """Each number as JSON text, NaN and the infinities as Python's json module writes them,
    a float always a float (arrow writes 2.0 as `2`, JSON's integer)."""
    text = pc.cast(pa.array(numbers), pa.string())
    if numbers.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            whole = np.flatnonzero(numbers == np.trunc(numbers))
        if len(whole):
            bare = pc.match_substring_regex(text.take(whole), r"^-?[0-9]+$").to_numpy(
                zero_copy_only=False
            )
            mask = np.zeros(len(numbers), bool)
            mask[whole[bare]] = True
            text = pc.if_else(pa.array(mask), pc.binary_join_element_wise(text, ".0", ""), text)
        for test, word in (
            (np.isnan, "NaN"),
            (np.isposinf, "Infinity"),
            (np.isneginf, "-Infinity"),
        ):
            mask = test(numbers)
            if mask.any():
                text = pc.if_else(pa.array(mask), pa.scalar(word), text)
    return text

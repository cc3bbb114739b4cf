"""Whether a staged run holds what its ranks logged, counted from the ranks' own logs.

The check after an upload compares the server with the staged run; whatever the merge left
out of the staged run would be invisible to it. So before a staged run is sent, what it
must hold is counted from its sources' `.wandb` files (`expected_of`) and compared with
what the staged log holds (`held_by`), read on its own: the chain is then source ->
staged (here, every value) -> server (`verify.readback`, after the upload).

Nothing here uses the merge's own relabelling path, or the check could not catch a fault
of it: only the record reader (`wbmerge.log`) and the naming rules the docs state (a user
key `k` of a rank labelled `l` becomes `--key-format`'s `k/l` in a shared run, and so
does a config key of a rank other than the primary whose value is not the primary's; a
system metric gets the suffix `/l:l`; a console or wandb logger line the prefix `[l] `). Memory does not grow with the steps: a history key (and a
system metric, and a rank's console) is a count and an order-independent digest of its
values (the sum of their hashes), however many rows hold it.

`reference_shortfall` counts both sides value by value; `source_shortfall` takes the
faster `fast_shortfall` unless told otherwise (`CHECKS`), which gives the same lines: a
pass-through whose staged log is its one source log copied, proved by the bytes of both
(`copyproof`: the copied blocks compared, the head's records compared one by one), is
not read value by value, since the value-by-value fold of two such logs is the same;
every other staged run, and every log that proof does not take, is counted as the
reference counts it, but for its history values, hashed a read at a time in one
compiled call (XXH64, `log.digest`) and summed per key over arrays rather than one by one
in Python. Both sides of a check hash alike, so which hash a check uses changes no line;
each check seeds XXH64 afresh at random, as Python seeds its own hash for each process,
since values whose XXH64 sums collide under a known seed can be searched for.

The fast check keeps the rule above: both sides are still read here, from the ranks' own
logs and the staged log, by the record reader alone; the copy proof compares the bytes
of the rank's own log with the staged one, and never asks the merge what it copied.

A follow's last round is checked by the same fold, kept between its rounds: each rank's
records are folded as the follow's kept merge reads them (`ExpectedFold`), and the rows
each round sent are tallied as it staged them (`rows_tally`); the last round's check then
reads only its own log (`continued_shortfall`). The seed of those digests lives in the
follower's memory only.

What legitimately differs, and so is not counted:
- W&B's own history and summary keys (`_step`, `_runtime`, `_timestamp`, `_wandb`):
  wandb-core sets them, a pass-through renumbers `_step` across restarts, and a shared run
  keeps one rank's.
- The `wbmerge` config key, replaced by the merge's block naming the target's topology
  and sources; and of the `_wandb` config key, what wandb-core and the SDK write about the
  run rather than about what it logged (telemetry `t`, which wandb-core makes again;
  metric definitions `m`, counted as definitions; versions, `code_path`, `pinned_keys`):
  a shared run keeps the primary's. Its entries keyed by a history key are counted
  (`logged`): charts (`visualize`, `viz`) and the class names of boxes and masks, each
  rank's under the key it describes, labelled in a shared run, pointing at the rank's
  labelled keys.
- In a shared run, the keys `--per-rank` leaves out, and the config keys of another rank
  that hold the primary's value: the docs say a shared run is made so (another rank's key
  is expected, labelled, only where its value is not the primary's).
- Steps: a value is counted under its key whatever row or step it lands in, since a
  shared run aligns the ranks' rows by step and a pass-through moves a restart's rows
  after the steps before it; which step wandb-core sends each row at is the check after
  the upload's (`content`, `sentrows`).
- Summary values a later write replaced: only each key's last value is expected.
- Keys the merge adds (statistics, spreads): more than the sources is not a shortfall.
- Rows or records a damaged log loses: both sides are read by the same reader, so what
  it cannot read of a source (said as a warning naming the damage) is not expected.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from google.protobuf.message import DecodeError

from ..analyse import PerRank
from ..log import RESERVED, pb, records, wire
from ..log import digest as hashing
from ..merge import DEFAULT_KEY_FORMAT  # (the naming rule the docs state)
from ..plan import Source, Target
from .copyproof import copied_alike

if TYPE_CHECKING:
    from ..log import items


def _split_spans(data: bytes, starts: np.ndarray, ends: np.ndarray) -> items.Items | None:
    """`log.items.split_spans`, imported on first use: it needs pyarrow (85 ms of a start),
    which the command line does without at its start."""
    from ..log import items

    return items.split_spans(data, starts, ends)


# How much of a staged log is read at a time. A shared run's rows hold every rank's items,
# and the readers split a read's rows one item of every row a step: steps cost per read, so
# a wide row is read in fewer, larger reads (memory is bounded by this, not by the log).
STAGED_READ = 16 << 20

KeyPath = tuple[str, ...]  # a key path (`nested_key`, or the one `key`)
# A key's tally: how many values, and the sum of their hashes (mod 2**64).
Tally = list[int]


_MASK = (1 << 64) - 1


def _add(tallies: dict, key: object, count: int, digest: int) -> None:
    found = tallies.get(key)
    if found is None:
        tallies[key] = [count, digest & _MASK]
    else:
        found[0] += count
        found[1] = (found[1] + digest) & _MASK


@dataclass
class Holdings:
    """What a log holds (or what the sources say a target must hold) of each kind, by the
    target's key; `origin`: the rank each expected key came from, for the failure line."""

    history: dict[KeyPath, Tally] = field(default_factory=dict)
    summary: dict[KeyPath, bytes] = field(default_factory=dict)  # key -> value part
    config: dict[KeyPath, str] = field(default_factory=dict)  # key -> JSON text
    console: dict[str | None, Tally] = field(default_factory=dict)  # label (None) -> lines
    logger: dict[str, Tally] = field(default_factory=dict)  # wandb's own logger lines
    stats: dict[str, Tally] = field(default_factory=dict)
    metrics: Counter[bytes] = field(default_factory=Counter)  # definitions, serialized
    # The last definition of each (name, glob), which decides what wandb-core ends with
    # (a definition is merged into the one before it, or replaces it): None where two
    # ranks' definitions of one name (W&B's own `_` keys) leave the order to the merge.
    last_definitions: dict[tuple[str, str], bytes | None] = field(default_factory=dict)
    clashes: list[str] = field(default_factory=list)  # keys two ranks' values cannot share
    # A shared run's keys a rank's glob definition binds: target key -> the step metrics
    # (labelled) of the globs that match it; one of them must be bound to it.
    bindings: dict[str, set[str]] = field(default_factory=dict)
    origin: dict[tuple[str, object], int] = field(default_factory=dict)
    # The `_wandb` config entries that describe a history key: (kind, key) -> value.
    logged: dict[tuple[str, str], object] = field(default_factory=dict)


# A key's name in the target: None for a key not counted.
Rename = Callable[[KeyPath], KeyPath | None]


def _own(path: KeyPath) -> KeyPath | None:
    """A staged key as it is; W&B's own keys are not counted (see the module docstring)."""
    return None if path[0] in RESERVED else path


def _labeller(label: str, key_format: str, per_rank: PerRank) -> Rename:
    """A rank's user key as a shared run names it (the docs' rule): the top-level key
    labelled; W&B's own keys and keys `--per-rank` leaves out are not counted."""

    def rename(path: KeyPath) -> KeyPath | None:
        top = path[0]
        if top in RESERVED or not per_rank.keeps(top):
            return None
        return (key_format.format(key=top, label=label), *path[1:])

    return rename


@dataclass(frozen=True)
class ValueHashes:
    """How history values are hashed for their digests: `one` a value at a time (what
    `value_identity` gives), `spans` a read's value parts at once (None: one at a time).
    Both sides of a check hash alike; which hash is the check's choice (`CHECKS`)."""

    one: Callable[[bytes], int]
    spans: Callable[[bytes, np.ndarray, np.ndarray], np.ndarray] | None = None


# The reference: Python's own hash (seeded at random for each process), a value at a time.
REFERENCE_HASHES = ValueHashes(hash)


def fast_hashes(seed: int | None = None) -> ValueHashes:
    """The fast check's: XXH64 with `seed` (None: a fresh random one, so no logged value
    can have been chosen to collide with another), a read's values hashed in one compiled
    call (`log.digest`), each sum taken over arrays."""
    seed = hashing.random_seed() if seed is None else seed
    return ValueHashes(partial(hashing.hash_of, seed=seed), partial(hashing.span_hashes, seed=seed))


class _History:
    """Tallies history values by target key, a read at a time, with each raw key part's
    path and target key worked out once."""

    def __init__(self, tallies: dict[KeyPath, Tally], rename: Rename, hashes: ValueHashes) -> None:
        self.tallies, self.rename, self.hashes = tallies, rename, hashes
        self.known: dict[bytes, tuple[KeyPath, KeyPath | None]] = {}
        self.tops: set[str] = set()  # the top-level keys seen (a rank's keys, for globs)

    def target(self, raw: bytes) -> KeyPath | None:
        """The target key of an item's raw key part; None for an item not counted: one
        without a key, or with an empty `key` and no nested key, which wandb-core leaves
        out of the row it sends (`sentrows.row_of`), or one the rename leaves out."""
        found = self.known.get(raw)
        if found is None:
            if not raw:  # (no key field at all)
                self.known[raw] = ((), None)
                return None
            path = tuple(wire.key_path(raw))
            found = self.known[raw] = (path, None if path == ("",) else self.rename(path))
            self.tops.add(path[0])
        return found[1]

    def add(self, read: records.RecordIndex) -> None:
        rows = read.rows
        if not len(rows):
            return
        batch = _split_spans(rows.data, rows.starts, rows.ends) if rows.in_place else None
        if batch is not None:
            try:
                self._add_batch(batch)
                return
            except ValueError:
                pass  # a key part that is not one: item by item
        tallies = {}
        for start, end in zip(rows.starts.tolist(), rows.ends.tolist(), strict=True):
            for item in wire.region_items(rows.data[start:end]):
                raw, value = wire.split_item(item)
                key = self.target(raw)
                if key is not None:
                    _add(tallies, key, 1, self.hashes.one(value_identity(value)))
        for key, (count, digest) in tallies.items():
            _add(self.tallies, key, count, digest)

    def _add_batch(self, batch: items.Items) -> None:
        codes, raw_keys = batch.key_codes()
        keys = [self.target(raw) for raw in raw_keys]  # (ValueError: not a key part)
        spans = batch.value_spans() if self.hashes.spans is not None else None
        if spans is not None:
            hashes = self.hashes.spans(*spans)
            sums = hashing.sums_by_code(codes, hashes, len(raw_keys))
        else:
            values = batch.value.to_pylist()
            hashes = np.fromiter(map(self.hashes.one, values), np.int64, len(values))
            sums = np.zeros(len(raw_keys), np.uint64)
            np.add.at(sums, codes, hashes.view(np.uint64))  # (wraps around: mod 2**64)
        counts = np.bincount(codes, minlength=len(raw_keys))
        for key, count, digest in zip(keys, counts.tolist(), sums.tolist(), strict=True):
            if key is not None and count:
                _add(self.tallies, key, count, digest)


def value_identity(value: bytes) -> bytes:
    """What a history item's value part says, in one spelling: the part itself when it is
    one JSON text (as wandb writes values, and as the batch split takes them), else its
    fields in protobuf's own order. A value wandb wrote typed beside its JSON text
    (`x_history_value_encoding`) is written back in that order by a record re-serialized
    (a restart's row moved to its step), saying the same."""
    if value.startswith(b"\x82\x01"):
        length, start = wire.varint(value, 2)
        if start + length == len(value):
            return value
    return pb.HistoryItem.FromString(value).SerializeToString(deterministic=True)


def _fold_summaries(
    read: records.RecordIndex, summary: dict, target: Callable[[bytes], KeyPath | None]
) -> None:
    """Apply a read's summary records in order. wandb writes one with every row, so they
    are taken as columns where they split (`items`: updates only), each key to its last
    value; record by record where they do not."""
    which = read.summaries
    if not len(which):
        return
    starts, ends = read.summary_spans
    batch = None
    if (starts >= 0).all():
        batch = _split_spans(read.frames.data, starts, ends)
    if batch is not None:
        try:
            codes, raw_keys = batch.key_codes()
            keys = [target(raw) for raw in raw_keys]  # (ValueError: not a key part)
        except ValueError:
            batch = None
    if batch is None:
        for index in which.tolist():
            _fold_summary(read.frames.payload(index), summary, target)
        return
    last = np.full(len(raw_keys), -1, np.int64)
    np.maximum.at(last, codes, np.arange(len(codes)))
    seen = np.flatnonzero(last >= 0)
    seen = seen[np.argsort(last[seen])]  # (two spellings of one key: the later one wins)
    values = batch.values(last[seen]).to_pylist()
    for code, value in zip(seen.tolist(), values, strict=True):
        if keys[code] is not None:
            summary[keys[code]] = value


def _fold_summary(payload: bytes, summary: dict, target: Callable[[bytes], KeyPath | None]) -> None:
    """Apply a summary record's updates, then its removals (as wandb-core does)."""
    updates, removes = wire.summary_items(payload)
    for item in updates:
        raw, value = wire.split_item(item)
        key = target(raw)
        if key is not None:
            summary[key] = value
    for item in removes:
        key = target(wire.split_item(item)[0])
        if key is not None:
            summary.pop(key, None)


_UNCOUNTED_CONFIG = ("_wandb", "wbmerge")  # (see the module docstring)


def _fold_config(change: pb.ConfigRecord, config: dict[KeyPath, str]) -> None:
    """Apply a config record to `config` as wandb-core does: its updates, then its
    removals (texts interned: every rank's config is held until all are read)."""
    for item in change.update:
        path = tuple(map(sys.intern, item.nested_key or [item.key]))
        if path[0] not in _UNCOUNTED_CONFIG:
            config[path] = sys.intern(item.value_json)
    for item in change.remove:
        config.pop(tuple(item.nested_key) or (item.key,), None)


# wandb 0.31's SDK writes these `_wandb` config entries keyed by a history key (see
# `logged_entries`), named here as the failure line names them.
LOGGED_KINDS = {
    "visualize": "chart",
    "viz": "chart",
    "bounding_box/class_labels": "box class labels",
    "mask/class_labels": "mask class labels",
}
_DELIMITER = "_wandb_delimeter_"  # (wandb's spelling)


def _fold_logged(change: pb.ConfigRecord, logged: dict[tuple[str, str], object]) -> None:
    """Apply a config record's `_wandb` entries keyed by a history key: set by their path
    (`_wandb.visualize.KEY`), or within a whole `_wandb` block, as the SDK writes class
    names. An entry once set stays until set again."""
    for item in change.update:
        path = list(item.nested_key) or [item.key]
        if path[0] != "_wandb" or len(path) not in (1, 3):
            continue
        try:
            value = json.loads(item.value_json)
        except (ValueError, RecursionError):
            continue  # (an entry that cannot be read: the merge refuses it in one line)
        if len(path) == 3:
            if path[1] in LOGGED_KINDS:
                logged[(path[1], path[2])] = value
        elif isinstance(value, dict):
            for kind in LOGGED_KINDS:
                if isinstance(value.get(kind), dict):
                    for key, entry in value[kind].items():
                        logged[(kind, key)] = entry


def _expected_logged(
    logged: dict[tuple[str, str], object],
    rank: _Rank,
    shared: bool,
    key_format: str,
    tops: set[str],
) -> Iterable[tuple[tuple[str, str], object]]:
    """A rank's `_wandb` entries as the target must hold them (the docs' rule): as they are
    in a pass-through; in a shared run under the key they describe, labelled, and pointing
    at the rank's labelled history keys (a key longer than one the rank logged, an
    `EvalTable` column's, is labelled in its logged part). An entry whose history key is
    not kept (`--per-rank`) is not expected."""

    def history_key(key: str) -> str | None:
        top = (
            key
            if key in tops
            else max(
                (t for t in tops if key.startswith(t) and key[len(t) : len(t) + 1] in ("/", ".")),
                key=len,
                default=key,
            )
        )
        renamed = rank.rename((top,))
        return None if renamed is None else renamed[0] + key[len(top) :]

    for (kind, key), value in logged.items():
        value = json.loads(json.dumps(value))  # (a copy to relabel)
        if not shared:
            yield (kind, key), value
            continue
        if kind == "visualize":
            tables: list[dict] = []
            _table_args(value, tables)
            keys = [history_key(arg["value"]) for arg in tables]
            if not keys or None in keys:
                continue
            for arg, labelled in zip(tables, keys, strict=True):
                arg["value"] = labelled
            yield (kind, key_format.format(key=key, label=rank.label)), value
        elif kind == "viz":
            labelled = history_key(key)
            if labelled is not None:
                if isinstance(value, dict) and isinstance(value.get("historyFieldSettings"), dict):
                    value["historyFieldSettings"]["key"] = labelled
                yield (kind, labelled), value
        else:
            image, sep, group = key.partition(_DELIMITER)
            labelled = history_key(image) if sep else None
            if labelled is not None:
                if isinstance(value, dict) and "key" in value:
                    value["key"] = labelled + _DELIMITER + group
                yield (kind, labelled + _DELIMITER + group), value


def _table_args(value: object, into: list[dict]) -> None:
    """A chart's `{"name": "tableKey", "value": KEY}` arguments (the tables it draws)."""
    if isinstance(value, dict):
        if value.get("name") == "tableKey" and isinstance(value.get("value"), str):
            into.append(value)
        for inner in value.values():
            _table_args(inner, into)
    elif isinstance(value, list):
        for inner in value:
            _table_args(inner, into)


class _Lines:
    """Console text as lines, per stream: a line ends at a newline; what a log leaves
    open at its end is a line too (`finish`). A line is tallied under the label its text
    starts with (`[label] `, a shared run's), or under None."""

    def __init__(self, tallies: dict[str | None, Tally], labelled: bool = False) -> None:
        self.tallies, self.labelled = tallies, labelled
        self.open: dict[int, str] = {}

    def write(self, stream: int, text: str) -> None:
        text = self.open.pop(stream, "") + text
        *lines, rest = text.split("\n")
        for line in lines:
            self._line(stream, line)
        if rest:
            self.open[stream] = rest

    def finish(self) -> None:
        for stream, rest in self.open.items():
            self._line(stream, rest)
        self.open.clear()

    def _line(self, stream: int, line: str) -> None:
        label = None
        if self.labelled and line.startswith("["):
            label, sep, _ = line[1:].partition("] ")
            if sep:
                # (a shared run writes each line as `[label] text`, and a carriage
                # return inside it as `\r[label] `: the rank's own text comes back)
                prefix = f"[{label}] "
                line = line[len(prefix) :].replace("\r" + prefix, "\r")
            else:
                label = None
        _add(self.tallies, label, 1, hash((stream, line)))


def _logger(read: records.RecordIndex, tallies: dict[str, Tally], labelled: bool) -> None:
    """Tally a read's lines of wandb's own logger (each record is one line) under "wandb",
    or when `labelled` (a shared run's, `[label] ` prefixed) under their label."""
    for index in read.of("output_logger").tolist():
        line = pb.Record.FromString(read.frames.payload(index)).output_logger.line
        key = "wandb"
        if labelled and line.startswith("["):
            label, sep, rest = line[1:].partition("] ")
            if sep:
                key, line = label, rest
        _add(tallies, key, 1, hash(line))


def _console(read: records.RecordIndex, lines: _Lines) -> None:
    """Feed a read's console text (stdout and stderr; `output` is the older record of it)."""
    for index in read.of("output_raw", "output").tolist():
        record = pb.Record.FromString(read.frames.payload(index))
        out = record.output_raw if record.HasField("output_raw") else record.output
        lines.write(out.output_type, out.line)


def _stats(
    read: records.RecordIndex, tallies: dict[str, Tally], rename: Callable[[str], str]
) -> None:
    for index in read.of("stats").tolist():
        for item in pb.Record.FromString(read.frames.payload(index)).stats.item:
            _add(tallies, rename(item.key), 1, hash(item.value_json))


def _system_label(label: str) -> Callable[[str], str]:
    """A system metric of a rank in a run of several ranks (the docs' rule): W&B's
    `/l:{label}` suffix added, unless the key carries a `/l:` label already."""
    suffix = f"/l:{label}"
    return lambda key: key if "/l:" in key else key + suffix


def _definition(metric: pb.MetricRecord) -> bytes:
    return metric.SerializeToString(deterministic=True)


def _defines(metric: pb.MetricRecord) -> tuple[str, str]:
    """What a metric definition defines: (its name, its glob)."""
    return metric.name, metric.glob_name


def held_by(log: Path, labelled: bool = False, hashes: ValueHashes = REFERENCE_HASHES) -> Holdings:
    """What a staged log holds, read on its own: history values, summary and config as
    wandb-core applies them, console lines (per `[label]` of a shared run: `labelled`),
    system metric values and metric definitions."""
    held = Holdings()
    history = _History(held.history, _own, hashes)
    lines = _Lines(held.console, labelled)
    for read in records.read_indexed(log, read_size=STAGED_READ):
        history.add(read)
        _fold_summaries(read, held.summary, history.target)
        for index in read.of("run", "config", "metric").tolist():
            record = pb.Record.FromString(read.frames.payload(index))
            if record.HasField("metric"):
                held.metrics[_definition(record.metric)] += 1
                held.last_definitions[_defines(record.metric)] = _definition(record.metric)
            else:
                change = record.run.config if record.HasField("run") else record.config
                _fold_config(change, held.config)
                _fold_logged(change, held.logged)
        _console(read, lines)
        _logger(read, held.logger, labelled)
        _stats(read, held.stats, str)
    lines.finish()
    return held


@dataclass
class _Rank:
    """One rank's logs, and how its keys are named in the target."""

    rank: int
    label: str
    sources: list[Source]
    rename: Rename
    system_rename: Callable[[str], str]
    primary: bool


def expected_of(
    target: Target,
    key_format: str = DEFAULT_KEY_FORMAT,
    per_rank: PerRank | None = None,
    hashes: ValueHashes = REFERENCE_HASHES,
) -> Holdings:
    """What `target`'s staged run must hold, counted from its sources' own logs (see the
    module docstring for what is not counted, and why); history values hashed by
    `hashes`, as the staged side must be (`held_by`)."""
    per_rank = per_rank or PerRank()
    shared = target.kind == "shared"
    expected = Holdings()
    configs = []
    for rank in _ranks(target, key_format, per_rank):
        fold = RankFold(rank, shared, key_format, per_rank, hashes)
        for source in rank.sources:
            for read in records.read_indexed(source.path):
                fold.add(read)
            fold.end_source()
        configs.append((rank, fold.into(expected)))
    _expect_config(expected, configs, key_format)
    for source in target.extra_system_sources:  # (auto --system-metrics all)
        stats: dict[str, Tally] = {}
        for read in records.read_indexed(source.path):
            _stats(read, stats, _system_label(source.label))
        _merge_into(expected, "system metric", expected.stats, stats, source.rank.rank)
    return expected


def _ranks(target: Target, key_format: str, per_rank: PerRank) -> list[_Rank]:
    """The target's ranks, in the order of its sources, each with its naming rules."""
    shared = target.kind == "shared"
    by_rank: dict[int, list[Source]] = {}
    for source in target.sources:
        by_rank.setdefault(source.rank.rank, []).append(source)
    ranks = []
    for rank, sources in by_rank.items():
        label = sources[0].label
        rename = _labeller(label, key_format, per_rank) if shared else _own
        system = _system_label(label) if shared else str
        ranks.append(_Rank(rank, label, sources, rename, system, rank == target.primary_rank))
    return ranks


class ExpectedFold:
    """`expected_of` a read at a time: a follow's kept merge gives it the records its
    readers read, each round (`add`), so that its last round's check folds only what is
    new. The records are the follow's live reader's (`follow.tails`, tested to give each
    record once, as the one-shot reader does); what they say is folded here by the rules
    above, never by the merge's relabelling. Only for a target without other ranks'
    system metrics (`auto --system-metrics all` is merged whole each round)."""

    def __init__(
        self, target: Target, key_format: str, per_rank: PerRank | None, hashes: ValueHashes
    ) -> None:
        if target.extra_system_sources:
            raise ValueError("other ranks' system metrics are not folded a read at a time")
        per_rank = per_rank or PerRank()
        self.key_format = key_format
        shared = target.kind == "shared"
        self.folds = {
            rank.rank: RankFold(rank, shared, key_format, per_rank, hashes)
            for rank in _ranks(target, key_format, per_rank)
        }
        self._source = dict.fromkeys(self.folds, 0)  # (the source each rank is read in)

    def add(self, rank: int, source: int, read: records.RecordIndex) -> None:
        """Fold a read of `rank`'s source `source` (an index into its sources)."""
        fold = self.folds[rank]
        while self._source[rank] < source:
            fold.end_source()
            self._source[rank] += 1
        fold.add(read)

    def expected(self) -> Holdings:
        """What the target must hold of everything added: once, when every log was read."""
        expected = Holdings()
        configs = [(fold.rank, fold.into(expected)) for fold in self.folds.values()]
        _expect_config(expected, configs, self.key_format)
        return expected


def _merge_into(expected: Holdings, kind: str, into: dict, tallies: dict, rank: int) -> None:
    for key, (count, digest) in tallies.items():
        _add(into, key, count, digest)
        expected.origin[(kind, key)] = rank


def _expect_config(
    expected: Holdings, configs: list[tuple[_Rank, dict[KeyPath, str]]], key_format: str
) -> None:
    """The config the target must hold (the docs' rule): the primary's; and of each other
    rank (a shared run's), every key whose value is not the primary's, labelled."""
    primary = next((config for rank, config in configs if rank.primary), {})
    primary_keys = {key[0] for key in primary}
    for rank, config in sorted(configs, key=lambda pair: not pair[0].primary):
        for key, value in config.items():
            if not rank.primary:
                if primary.get(key) == value:
                    continue
                key = (key_format.format(key=key[0], label=rank.label), *key[1:])
                if key[0] in primary_keys:  # (the primary's value, or this one, is lost)
                    expected.clashes.append(
                        f"rank {rank.rank}'s config key {key[0]!r}: "
                        "the primary's config holds it too"
                    )
                    continue
            expected.config[key] = value
            expected.origin[("config key", key)] = rank.rank


class RankFold:
    """What one rank's logs say the target must hold, folded a read at a time, in order
    (`add`), a source after another (`end_source`); `into` counts it into the target's."""

    def __init__(
        self,
        rank: _Rank,
        shared: bool,
        key_format: str,
        per_rank: PerRank,
        hashes: ValueHashes,
    ) -> None:
        self.rank, self.shared = rank, shared
        self.key_format, self.per_rank = key_format, per_rank
        self.history: dict[KeyPath, Tally] = {}
        self.counter = _History(self.history, rank.rename, hashes)
        self.summary: dict[KeyPath, bytes] = {}
        self.config: dict[KeyPath, str] = {}
        self.logged: dict[tuple[str, str], object] = {}
        self.console: dict[str | None, Tally] = {}
        self.logger: dict[str, Tally] = {}
        self.stats: dict[str, Tally] = {}
        self.definitions: list[pb.MetricRecord] = []
        # A pass-through concatenates a rank's restarts, so a line one leaves open is
        # continued by the next; a shared run ends it where the rank restarted (each line
        # is labelled).
        self.lines = _Lines(self.console)

    def add(self, read: records.RecordIndex) -> None:
        rank = self.rank
        self.counter.add(read)
        _fold_summaries(read, self.summary, self.counter.target)
        for at in read.of("run", "config", "metric").tolist():
            record = pb.Record.FromString(read.frames.payload(at))
            if record.HasField("metric"):
                self.definitions.append(record.metric)
            elif record.HasField("config"):
                _fold_config(record.config, self.config)
                _fold_logged(record.config, self.logged)
            elif record.HasField("run"):  # (a restart's: an update, as the docs say)
                _fold_config(record.run.config, self.config)
                _fold_logged(record.run.config, self.logged)
        _console(read, self.lines)
        _logger(read, self.logger, labelled=False)
        _stats(read, self.stats, rank.system_rename)

    def end_source(self) -> None:
        if self.shared:
            self.lines.finish()

    def into(self, expected: Holdings) -> dict[KeyPath, str]:
        """Count what the rank's logs say the target must hold into `expected`; returns the
        rank's config, folded (the target's config depends on the primary's:
        `_expect_config`). Once, after the last read."""
        rank, shared, key_format, per_rank = self.rank, self.shared, self.key_format, self.per_rank
        counter, logger = self.counter, self.logger
        self.lines.finish()
        label = rank.label if shared else None
        _merge_into(expected, "history key", expected.history, self.history, rank.rank)
        _merge_into(expected, "system metric", expected.stats, self.stats, rank.rank)
        if shared and "wandb" in logger:  # (each rank's lines under its label)
            logger = {rank.label: logger.pop("wandb")}
        _merge_into(expected, "wandb logger", expected.logger, logger, rank.rank)
        if None in self.console:
            console = {label: self.console[None]}
            _merge_into(expected, "console", expected.console, console, rank.rank)
        for key, value in self.summary.items():
            expected.summary[key] = value
            expected.origin[("summary key", key)] = rank.rank
        for entry, value in _expected_logged(self.logged, rank, shared, key_format, counter.tops):
            expected.logged[entry] = value
            expected.origin[(LOGGED_KINDS[entry[0]], entry[1])] = rank.rank
        last = expected.last_definitions
        definitions = self.definitions
        for definition in _definitions(definitions, rank, shared, key_format, per_rank, counter):
            expected.metrics[definition] += 1
            expected.origin[("metric definition", definition)] = rank.rank
            defines = _defines(pb.MetricRecord.FromString(definition))
            if expected.origin.get(("metric defined", defines), rank.rank) != rank.rank:
                last[defines] = None  # (another rank's too: either may come last)
            elif last.get(defines, b"") is not None:
                last[defines] = definition
            expected.origin[("metric defined", defines)] = rank.rank
        if shared:
            for key, steps in _glob_bindings(
                definitions, rank.label, key_format, per_rank, counter.tops
            ).items():
                expected.bindings[key] = steps
                expected.origin[("metric glob", key)] = rank.rank
        return self.config


def _glob_bindings(
    definitions: list[pb.MetricRecord],
    label: str,
    key_format: str,
    per_rank: PerRank,
    keys: set[str],
) -> dict[str, set[str]]:
    """The keys of a rank's shared run a glob definition of the rank binds: each top-level
    key the rank logged that a glob matches (wandb takes a glob as a prefix with a trailing
    `*`) and that the rank did not define by name (an explicit definition shadows globs in
    wandb-core), by its labelled name, with the labelled step metrics of the globs that
    match it. W&B's own `_` keys, and keys `--per-rank` leaves out, are not bound."""
    globs = [m for m in definitions if m.glob_name]
    named = {m.name for m in definitions if m.name}
    bound: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith("_") or key in named or not per_rank.keeps(key):
            continue
        for metric in globs:
            if key.startswith(metric.glob_name.removesuffix("*")):
                step = metric.step_metric
                if step and not step.startswith("_"):
                    step = key_format.format(key=step, label=label)
                bound.setdefault(key_format.format(key=key, label=label), set()).add(step)
    return bound


def _definitions(
    definitions: list[pb.MetricRecord],
    rank: _Rank,
    shared: bool,
    key_format: str,
    per_rank: PerRank,
    history: _History,
) -> Iterable[bytes]:
    """A rank's metric definitions as the target must hold them: as they are in a
    pass-through; in a shared run a name and its step metric labelled (W&B's own `_` keys
    as they are; a name `--per-rank` leaves out is gone). A shared run's glob definitions
    are written as one definition per key of the rank they bind to, or as a labelled glob,
    as `--key-format` allows; which of the two is the merge's choice, so they are checked
    by key in `shortfall` (`glob_bindings`), not here."""
    if not shared:
        yield from map(_definition, definitions)
        return
    for metric in definitions:
        if metric.glob_name:
            continue
        labelled = pb.MetricRecord()
        labelled.CopyFrom(metric)
        if metric.name and not metric.name.startswith("_"):
            if not per_rank.keeps(metric.name):
                continue
            labelled.name = key_format.format(key=metric.name, label=rank.label)
        if metric.step_metric and not metric.step_metric.startswith("_"):
            labelled.step_metric = key_format.format(key=metric.step_metric, label=rank.label)
        yield _definition(labelled)


def shortfall(expected: Holdings, held: Holdings) -> list[str]:
    """What `held` (a staged run) lacks of `expected` (its sources'), a line each naming
    the rank, the kind and the key; [] when it holds everything."""
    problems = list(expected.clashes)

    def lack(kind: str, key: object, what: str) -> None:
        rank = expected.origin.get((kind, key))
        shown = ".".join(key) if isinstance(key, tuple) else key
        problems.append(f"rank {rank}'s {kind} {shown!r}: {what}")

    for key, what in _tally_shortfall(expected.history, held.history, "values", "values", "none"):
        lack("history key", key, what)
    for key, value in expected.summary.items():
        if key not in held.summary:
            lack("summary key", key, "not in the staged summary")
        elif held.summary[key] != value:
            lack("summary key", key, f"{_text(value)} logged, {_text(held.summary[key])} staged")
    for key, text in expected.config.items():
        if key not in held.config:
            lack("config key", key, "not in the staged config")
        elif held.config[key] != text:
            lack("config key", key, f"{_short(text)} logged, {_short(held.config[key])} staged")
    for (kind, key), value in expected.logged.items():
        if (kind, key) not in held.logged:
            lack(LOGGED_KINDS[kind], key, f"not in the staged config's _wandb.{kind}")
        elif held.logged[(kind, key)] != value:
            lack(LOGGED_KINDS[kind], key, f"other than logged in the staged _wandb.{kind}")
    for kind, logged, staged, unit, other in (
        ("console", expected.console, held.console, "lines", "lines"),
        ("wandb logger", expected.logger, held.logger, "lines", "lines"),
        ("system metric", expected.stats, held.stats, "samples", "values"),
    ):
        for key, what in _tally_shortfall(logged, staged, unit, other, "0"):
            lack(kind, key, what)
    # Every definition logged must be staged (one written again unchanged need not be
    # staged twice: it changes nothing), and the last of each name must be staged last.
    for definition in expected.metrics:
        if not held.metrics[definition]:
            metric = pb.MetricRecord.FromString(definition)
            rank = expected.origin.get(("metric definition", definition))
            name = metric.name or metric.glob_name
            problems.append(
                f"rank {rank}'s metric definition {name!r} "
                f"(step metric {metric.step_metric!r}): not staged"
            )
    for defines, definition in expected.last_definitions.items():
        if definition is not None and definition in held.metrics:
            if held.last_definitions.get(defines) != definition:
                rank = expected.origin.get(("metric defined", defines))
                name = defines[0] or defines[1]
                problems.append(
                    f"rank {rank}'s metric definition {name!r}: not the last one staged of its name"
                )
    if expected.bindings:
        steps_of = _staged_bindings(held.metrics)
        for key, steps in expected.bindings.items():
            if not steps & steps_of(key):
                wanted = " or ".join(sorted(map(repr, steps)))
                lack("metric glob", key, f"not bound to its step metric {wanted}")
    return problems


def _tally_shortfall(
    expected: dict, held: dict, unit: str, other: str, absent: str
) -> Iterable[tuple[object, str]]:
    """Each key whose tally `held` lacks of `expected`: fewer (or more) of them staged than
    logged (`absent` says how many when the key is not staged at all), or as many with
    other values (the digests differ)."""
    for key, (count, digest) in expected.items():
        found = held.get(key)
        if found is None:
            yield key, f"{count} {unit} logged, {absent} staged"
        elif found[0] != count:
            yield key, f"{count} {unit} logged, {found[0]} staged"
        elif found[1] != digest:
            yield key, f"{count} {unit} logged, other {other} staged"


def _staged_bindings(metrics: Iterable[bytes]) -> Callable[[str], set[str]]:
    """The step metrics a staged run's definitions bind a key to: a definition by its
    name, else every glob that matches it (as a prefix)."""
    named: dict[str, set[str]] = {}
    globs: list[tuple[str, str]] = []
    for definition in metrics:
        metric = pb.MetricRecord.FromString(definition)
        if metric.glob_name:
            globs.append((metric.glob_name.removesuffix("*"), metric.step_metric))
        elif metric.name:
            named.setdefault(metric.name, set()).add(metric.step_metric)

    def steps_of(key: str) -> set[str]:
        if key in named:
            return named[key]
        return {step for prefix, step in globs if key.startswith(prefix)}

    return steps_of


def _text(value: bytes) -> str:
    return _short(wire.value_json(value).decode(errors="replace"))


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def source_shortfall(
    target: Target,
    staged_log: Path,
    key_format: str = DEFAULT_KEY_FORMAT,
    per_rank: PerRank | None = None,
    check: str = "fast",
) -> list[str]:
    """What the staged log of `target` lacks of what its ranks logged: [] when it holds
    everything. `check` names the way it is found (`CHECKS`): each gives the same lines."""
    return CHECKS[check](target, staged_log, key_format, per_rank)


def reference_shortfall(
    target: Target, staged_log: Path, key_format: str, per_rank: PerRank | None
) -> list[str]:
    """The reference: both sides counted value by value (`expected_of`, `held_by`,
    `shortfall`)."""
    expected = expected_of(target, key_format, per_rank)
    return shortfall(expected, held_by(staged_log, labelled=target.kind == "shared"))


def fast_shortfall(
    target: Target,
    staged_log: Path,
    key_format: str,
    per_rank: PerRank | None,
    seed: int | None = None,
) -> list[str]:
    """The reference's answer at less cost: a pass-through proved a copy of its source by
    bytes (`copyproof`) lacks nothing; anything else is counted as the reference counts,
    but for history values hashed a read at a time (`fast_hashes(seed)`)."""
    if _one_primary_log(target) and copied_alike(target.sources[0].path, staged_log, same_run):
        return []
    hashes = fast_hashes(seed)  # (both sides: one seed)
    expected = expected_of(target, key_format, per_rank, hashes)
    labelled = target.kind == "shared"
    return shortfall(expected, held_by(staged_log, labelled, hashes))


def rows_tally(log: Path, hashes: ValueHashes) -> dict[KeyPath, Tally]:
    """The history values of a staged log's rows, tallied as `held_by` tallies them: what a
    follow's round sent, kept so that the last round's check reads only its own log."""
    tallies: dict[KeyPath, Tally] = {}
    history = _History(tallies, _own, hashes)
    for read in records.read_indexed(log, read_size=STAGED_READ):
        history.add(read)
    return tallies


def add_tallies(into: dict[KeyPath, Tally], tallies: dict[KeyPath, Tally]) -> None:
    """Add `tallies` (`rows_tally`) into `into`: the rows of two logs, counted as one."""
    for key, (count, digest) in tallies.items():
        _add(into, key, count, digest)


def continued_shortfall(
    target: Target,
    staged_log: Path,
    expected: ExpectedFold,
    hashes: ValueHashes,
    rows_sent: dict[KeyPath, Tally],
) -> list[str]:
    """`fast_shortfall` of a staged log that continues logs sent before it (a follow's last
    round), its sources folded a read at a time (`expected`) with `hashes`: every record
    but their rows is in it, and their rows are `rows_sent`, tallied by `rows_tally` with
    the same `hashes` when each was staged."""
    held = held_by(staged_log, target.kind == "shared", hashes)
    add_tallies(held.history, rows_sent)
    return shortfall(expected.expected(), held)


def _one_primary_log(target: Target) -> bool:
    """Whether `target` expects what one log of its primary rank folds to, as it is: a
    run of one log and no other rank's system metrics, not shared (`expected_of`)."""
    return (
        target.kind != "shared"
        and len(target.sources) == 1
        and not target.extra_system_sources
        and target.sources[0].rank.rank == target.primary_rank
    )


def same_run(logged: bytes, written: bytes) -> bool:
    """Whether two run records change the holdings alike (`copyproof`): only their config
    is folded, so the same counted updates (of each path its last), the same removals and
    the same `_wandb` entries keyed by a history key. False for one that does not parse."""
    try:
        return _config_effect(logged) == _config_effect(written)
    except (ValueError, DecodeError, RecursionError):
        return False


def _config_effect(payload: bytes) -> tuple[dict, set, dict]:
    change = pb.Record.FromString(payload).run.config
    config: dict[KeyPath, str] = {}
    logged: dict[tuple[str, str], object] = {}
    _fold_config(change, config)  # (updates then removals: on any config, the same change)
    _fold_logged(change, logged)  # (only sets entries: on any, the same change)
    removed = {tuple(item.nested_key) or (item.key,) for item in change.remove}
    return config, removed, logged


# The ways `source_shortfall` finds a staged run's shortfall, by name; "reference" is the
# one the others are tested against.
CHECKS: dict[str, Callable[[Target, Path, str, PerRank | None], list[str]]] = {
    "reference": reference_shortfall,
    "fast": fast_shortfall,
}


# How many checks of staged runs a process runs at once (`lacking_line`). A check's read of
# a staged log peaks at about 120 MB (`STAGED_READ`); the eight preparers of a follow's last
# round checked eight pass-through runs side by side and held 690 MB. The checks share one
# interpreter lock, so two at once keep two cores as busy as eight.
CHECKS_AT_ONCE = 2
CHECK_SLOTS = threading.BoundedSemaphore(CHECKS_AT_ONCE)


def lacking_line(check: Callable[[], list[str]] | None) -> str | None:
    """The one line that says what a staged run lacks of its sources (`check`, say a
    `source_shortfall` with its arguments bound), or that they could not be compared; None
    when it lacks nothing (or there is nothing to check). Such a run is not sent: sending
    it would record as synced a run that lacks what a rank logged. It waits for one of
    `CHECK_SLOTS`."""
    if check is None:
        return None
    try:
        with CHECK_SLOTS:
            problems = check()  # (ValueError: a key that is no text; RecursionError: too deep)
    except (OSError, ValueError, DecodeError, RecursionError) as exc:
        return f"not sent: it could not be compared with its ranks' logs ({exc})"
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (
        f"not sent: the staged run lacks what its ranks logged: {problems[0]}{more}; this is "
        "a fault of wbmerge's merge (please report it)"
    )

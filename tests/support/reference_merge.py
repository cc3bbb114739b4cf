"""A plain, obviously correct shared merge of history rows, metric definitions and
summaries, record by record with protobuf, that the merge engine is compared against.

It is the rule written out once, slowly: every rank's rows (a row at or before the rank's
last row is dropped), one merged row per step with the primary's row first and then the
others by rank, each user key labelled; W&B's own keys (`_runtime`, `_timestamp`, ...)
from the first row that has them; `_step` set by the merged row; with `skew`, the spread
of every one-level numeric key across the step's rows (a rank's number is its row's last
JSON number for the key, counted when finite), in the order of the keys' names. Metric definitions are labelled and
follow the row they were written after (one the same as the last written for its name is
left out: wandb-core folds a definition into the one before, so it changes nothing). The primary's config records follow the row they were written after; the other
ranks' config, folded, comes after everything else but the summary, in one record: each
key whose final value is not the primary's final one, labelled, rank by rank. The summary
holds every rank's last values under labelled keys, in the order they were first set, W&B's
own keys the primary's only.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import RESERVED

Items = list[tuple[list[str], str]]  # (key path, value JSON) in record order

# JSON's number grammar, and the three words wandb writes for the floats JSON lacks
JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|NaN|-?Infinity")


def _items(repeated) -> Items:
    return [(list(item.nested_key) or [item.key], item.value_json) for item in repeated]


def _labelled(path: list[str], label: str, key_format: str) -> list[str]:
    if path[0] in RESERVED:
        return path
    return [key_format.format(key=path[0], label=label), *path[1:]]


def _add(repeated, path: list[str], value: str) -> None:
    item = repeated.add()
    item.nested_key.extend(path)
    item.value_json = value


def merged_records(
    ranks: Mapping[int, tuple[str, list[bytes]]],
    primary: int,
    skew: bool = False,
    key_format: str = "{key}/{label}",
) -> list[pb.Record]:
    """The history, metric and summary records of the shared run of `ranks` (rank ->
    (label, its records in file order)), in order."""
    rows: dict[int, dict[int, Items]] = {}  # step -> rank -> the row's items
    events: list[tuple[tuple, pb.Record]] = []  # ((step of the row before, rank, n), record)
    summaries: dict[int, dict[tuple[str, ...], str]] = {}
    configs: dict[int, dict[tuple[str, ...], str]] = {}
    for rank, (label, payloads) in ranks.items():
        last = -1
        summary = summaries.setdefault(rank, {})
        config = configs.setdefault(rank, {})
        for n, payload in enumerate(payloads):
            record = pb.Record.FromString(payload)
            if record.HasField("history"):
                step = record.history.step.num
                if step > last:
                    rows.setdefault(step, {})[rank] = _items(record.history.item)
                    last = step
            elif record.HasField("summary"):
                for path, value in _items(record.summary.update):
                    summary[tuple(_labelled(path, label, key_format))] = value
                for item in record.summary.remove:
                    path = list(item.nested_key) or [item.key]
                    summary.pop(tuple(_labelled(path, label, key_format)), None)
            elif record.HasField("config"):
                for path, value in _items(record.config.update):
                    config[tuple(path)] = value
                for path, _ in _items(record.config.remove):
                    config.pop(tuple(path), None)
                if rank == primary:
                    events.append(((last, rank, n), record))
            elif record.HasField("metric"):
                metric = record.metric
                if metric.name and not metric.name.startswith("_"):
                    metric.name = key_format.format(key=metric.name, label=label)
                if metric.glob_name:
                    continue  # (bound after the rows, to the keys it matches: metricglobs)
                if metric.step_metric and not metric.step_metric.startswith("_"):
                    metric.step_metric = key_format.format(key=metric.step_metric, label=label)
                events.append(((last, rank, n), record))
    out: list[tuple[tuple, pb.Record]] = []
    for step, by_rank in rows.items():
        labels = {rank: ranks[rank][0] for rank in by_rank}
        out.append(((step, 0), merged_row(step, by_rank, labels, primary, skew, key_format)))
    out += [((after, 1, rank, n), record) for (after, rank, n), record in events]
    written: list[pb.Record] = []
    last_definition: dict[tuple[str, str], bytes] = {}
    for _, record in sorted(out, key=lambda pair: pair[0]):
        payload = record.SerializeToString()
        if record.HasField("metric"):
            defines = (record.metric.name, record.metric.glob_name)
            if last_definition.get(defines) == payload:
                continue
            last_definition[defines] = payload
        written.append(record)
    others = pb.Record()
    for rank in ranks:
        for path, value in configs[rank].items():
            if rank != primary and configs[primary].get(path) != value:
                item = others.config.update.add()
                labelled = key_format.format(key=path[0], label=ranks[rank][0])
                if len(path) == 1:
                    item.key = labelled
                else:
                    item.nested_key.extend([labelled, *path[1:]])
                item.value_json = value
    if others.config.update:
        written.append(others)
    final = pb.Record()
    final.summary.SetInParent()
    for rank in sorted(summaries):
        for path, value in summaries[rank].items():
            if path[0] not in RESERVED or rank == primary:
                _add(final.summary.update, list(path), value)
    written.append(final)
    return written


def spread(values: list[float]) -> float | None:
    """(max - min) / |median| of the finite values, the true median; None for fewer than two
    values or a median of zero."""
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < 2:
        return None
    middle = len(finite) // 2
    median = finite[middle] if len(finite) % 2 else (finite[middle - 1] + finite[middle]) / 2
    return None if median == 0 else (finite[-1] - finite[0]) / abs(median)


def merged_row(
    step: int,
    by_rank: Mapping[int, Items],
    labels: Mapping[int, str],
    primary: int,
    skew: bool = False,
    key_format: str = "{key}/{label}",
) -> pb.Record:
    """The merged history record of the rows `by_rank` (rank -> items) at `step`."""
    order = sorted(by_rank, key=lambda rank: (rank != primary, rank))
    record = pb.Record()
    history = record.history
    for rank in order:
        for path, value in by_rank[rank]:
            if path[0] not in RESERVED:
                _add(history.item, _labelled(path, labels[rank], key_format), value)
    _add(history.item, ["_step"], str(step))
    have: set[str] = set()
    for rank in order:  # W&B's own keys: of the first row that has each (its last value)
        own: dict[str, tuple[list[str], str]] = {}
        for path, value in by_rank[rank]:
            if path[0] in RESERVED and path[0] != "_step":
                own[path[0]] = (path, value)
        for name, (path, value) in own.items():
            if name not in have:
                have.add(name)
                _add(history.item, path, value)
    if skew:
        numbers: dict[str, list[float]] = {}
        for rank in order:
            row: dict[str, float] = {}
            for path, value in by_rank[rank]:
                if len(path) == 1 and path[0] not in RESERVED and JSON_NUMBER.fullmatch(value):
                    row[path[0]] = float(value)
            for key, number in row.items():
                numbers.setdefault(key, []).append(number)
        for key, values in sorted(numbers.items()):
            found = spread(values)
            if found is not None:
                _add(history.item, [f"wbmerge/spread/{key}"], json.dumps(found))
    history.step.SetInParent()
    history.step.num = step
    return record

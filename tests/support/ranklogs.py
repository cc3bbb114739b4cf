"""Small offline runs written by the tests themselves: a rank's run directory and log, its
run record carrying the `wbmerge` block, ready for the records each test writes next; and
the history and exit records they write."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

from wbmerge.log import LogWriter
from wbmerge.training import METADATA_KEY, RankInfo


@contextmanager
def rank_log(root: Path, info: RankInfo, run_id: str, project: str) -> Iterator[LogWriter]:
    """A writer of `root/wandb/offline-run-…-{run_id}/run-{run_id}.wandb`, its run record
    (with `info` as the `wbmerge` block) written already."""
    run_dir = root / "wandb" / f"offline-run-20260101_000000-{run_id}"
    (run_dir / "files").mkdir(parents=True)
    with open(run_dir / f"run-{run_id}.wandb", "wb") as stream, LogWriter(stream) as writer:
        record = pb.Record()
        record.run.run_id, record.run.project = run_id, project
        item = record.run.config.update.add()
        item.key, item.value_json = METADATA_KEY, json.dumps(info.to_metadata())
        writer.write(record.SerializeToString())
        yield writer


def history_record(items: list[tuple], step: int | None, num: int = 0) -> bytes:
    """A history record: items as (nested key, or a plain key, JSON value), each maybe
    followed by its typed value as {field: value} (wandb writes one beside the JSON when
    told to), and a step field unless `step` is None (wandb 0.16 writes none); `num` as
    wandb numbers records."""
    record = pb.Record(num=num)
    for key, value, *typed in items:
        item = record.history.item.add()
        if isinstance(key, str):
            item.key = key
        else:
            item.nested_key.extend(key)
        item.value_json = value
        for field, typed_value in (typed[0] if typed else {}).items():
            setattr(item, field, typed_value)
    if step is not None:
        record.history.step.num = step
    return record.SerializeToString()


def exit_record(code: int) -> bytes:
    """The exit record wandb writes when a run ends with exit code `code`."""
    record = pb.Record()
    record.exit.exit_code = code
    return record.SerializeToString()


def summary_record(values: dict) -> bytes:
    """A summary record setting each of `values` (plain keys, JSON-encodable values)."""
    record = pb.Record()
    for key, value in values.items():
        item = record.summary.update.add()
        item.key, item.value_json = key, json.dumps(value)
    return record.SerializeToString()


def config_record(values: dict) -> bytes:
    """A config record setting each of `values` (plain keys, JSON-encodable values), as
    `config.update` makes wandb write one."""
    record = pb.Record()
    for key, value in values.items():
        item = record.config.update.add()
        item.key, item.value_json = key, json.dumps(value)
    return record.SerializeToString()


def console_record(text: str, stderr: bool = False) -> bytes:
    """A console record of stdout (or stderr) text, as wandb writes what a rank prints."""
    record = pb.Record()
    record.output_raw.output_type = record.output_raw.STDERR if stderr else record.output_raw.STDOUT
    record.output_raw.line = text
    return record.SerializeToString()

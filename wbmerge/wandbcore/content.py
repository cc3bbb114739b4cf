"""What a log will put on the server when `wandb sync` sends it whole: its history rows'
steps, its system-metric rows, its console lines and its metric definitions. An upload is verified against this.

The counts are taken a read at a time (`ContentCounter.add`), so that a step that reads a
log for its own purpose anyway, such as the check before a log is spliced into staging,
counts it on the way instead of reading it again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..log import item_path, pb, records
from . import sentrows, terminal
from .loggedentries import Entries, fold_logged_entries
from .metricdefs import Definition, DefinitionKey, fold
from .stepruns import StepRuns


@dataclass(frozen=True)
class StagedContent:
    """What one staged log will put on the server when sent whole."""

    # each history row's `_step` item (`sentrows.item_step`); any sequence given is kept as
    # `StepRuns`, whose size does not grow with the rows of a run wandb wrote
    step_items: Sequence[int | None]
    events: int  # system-metric rows
    console_lines: int  # output.log lines (`terminal.Console.lines`)
    starting_step: int = 0  # where wandb-core numbers the rows from (`sentrows.starting_step`)
    metadata: bool = False  # an environment record, which wandb-core puts as wandb-metadata.json
    # The metric definitions wandb-core folds the log's metric records into and sends in the
    # run's config (`metricdefs`), as (key, definition) pairs in the order first defined.
    metric_definitions: tuple[tuple[DefinitionKey, Definition], ...] = ()
    # The charts and class names its config records leave in the run's config
    # (`loggedentries`): ((kind, key), value JSON) pairs.
    logged_entries: tuple[tuple[tuple[str, str], str], ...] = ()
    # Every top-level config key its run and config records set (`logged_config_keys`),
    # counted in the same pass; None where not counted.
    config_keys: frozenset[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_items", StepRuns.of(self.step_items))

    @cached_property
    def history_steps(self) -> StepRuns:
        """The `_step` of each history row on the server once the whole log is sent."""
        return self.steps_sent_from(0)

    def steps_sent_from(self, row: int) -> StepRuns:
        """The `_step` of history rows `row`, `row + 1`, ... when an upload sends the log from
        that row on (the rows before it cut, as the server holds them): numbered again from
        the starting step (see `sentrows`)."""
        items = self.step_items[row:]
        if items.rising_from(self.starting_step):
            return items  # (every row at its own item, as in every log wandb writes)
        return StepRuns.of(sentrows.sent_steps(items, self.starting_step))


class ContentCounter:
    """Counts what a log holds, one `records.read_indexed` read after another, in order."""

    def __init__(self) -> None:
        self.step_parts: list[StepRuns] = []  # (the steps of each read)
        self.runs: list[pb.RunRecord] = []  # the run records before the first history row
        self.events = 0
        self.console = terminal.Console(keep_text=False)
        self.metadata = False
        self.metrics: dict[DefinitionKey, Definition] = {}
        self.entries: Entries = {}
        self.run_keys: set[str] = set()  # the config keys run records set
        self.config_keys: set[str] = set()  # those config records set

    def add(self, read: records.RecordIndex) -> None:
        frames = read.frames
        if not any(self.step_parts):  # (no history row yet)
            runs = read.of("run")
            if len(read.history):
                runs = runs[runs < read.history[0]]
            self.runs += [pb.Record.FromString(frames.payload(i)).run for i in runs.tolist()]
        self.step_parts.append(step_items(read))
        self.events += len(read.of("stats"))
        self.metadata = self.metadata or bool(len(read.of("environment")))
        for index in read.of("output_raw", "output_logger").tolist():
            record = pb.Record.FromString(frames.payload(index))
            _write_console(self.console, record)
        metrics = read.of("metric").tolist()
        fold((pb.Record.FromString(frames.payload(i)).metric for i in metrics), self.metrics)
        for index in read.of("run", "config").tolist():
            record = pb.Record.FromString(frames.payload(index))
            is_run = record.HasField("run")
            change = record.run.config if is_run else record.config
            fold_logged_entries(self.entries, change)
            (self.run_keys if is_run else self.config_keys).update(_keys_set(change))

    def content(self, run_keys: set[str] | None = None) -> StagedContent:
        """What was counted; `run_keys`: the config keys of the run records as written,
        where they were rewritten after they were counted (a splice's head)."""
        start = sentrows.starting_step(self.runs)
        keys = self.run_keys if run_keys is None else run_keys
        return StagedContent(
            StepRuns.join(self.step_parts),
            self.events,
            self.console.lines,
            start,
            self.metadata,
            tuple(self.metrics.items()),
            tuple(self.entries.items()),
            frozenset(self.config_keys | keys),
        )


def read_staged(log: Path) -> StagedContent:
    """Count what a staged log holds: history steps, system-metric rows, console lines."""
    counter = ContentCounter()
    for read in records.read_indexed(log):
        counter.add(read)
    return counter.content()


@dataclass(frozen=True)
class LoggedRun:
    """What a log's records give its run on the server: the display name, group and job
    type and the tags of its first run record ("" and () where it gives none), the config
    and summary they set (nested keys as nested objects), and the `output.log` wandb-core
    writes of its console (`terminal.Console.text`, as UTF-8; None for a console over
    the limit)."""

    names: tuple[str, str, str] = ("", "", "")
    tags: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    console: bytes | None = None
    # Every top-level config key any of its run and config records set, those removed or
    # set again later included: wandb-core sends the whole config after each change, and
    # the server keeps a key once sent (`logged_config_keys`).
    config_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:  # (the config's own keys are among them, always)
        object.__setattr__(self, "config_keys", frozenset(self.config_keys) | set(self.config))


_STREAMS = {pb.OutputRawRecord.STDOUT: "stdout", pb.OutputRawRecord.STDERR: "stderr"}


def _write_console(console: terminal.Console, record: pb.Record) -> None:
    """Feed a console record to `console`: a line of wandb's logger, or text of stdout or
    stderr (wandb-core drops text of any other stream, and so does this)."""
    if record.HasField("output_logger"):
        console.write("logger", record.output_logger.line)
    elif record.output_raw.output_type in _STREAMS:
        console.write(_STREAMS[record.output_raw.output_type], record.output_raw.line)


def read_logged_run(log: Path, console_limit: int = 64 << 20) -> LoggedRun:
    """The `LoggedRun` of a log, its updates and removals applied in order, as wandb-core
    applies them (ValueError for a value that is not JSON); its console only when its
    texts hold at most `console_limit` characters."""
    first: pb.RunRecord | None = None
    config: dict = {}
    keys: set[str] = set()
    summary: dict = {}
    console: terminal.Console | None = terminal.Console()
    size = 0
    kinds = ("run", "config", "summary", "output_raw", "output_logger")
    for read in records.read_indexed(log):
        for index in read.of(*kinds).tolist():
            record = pb.Record.FromString(read.frames.payload(index))
            kind = record.WhichOneof("record_type")
            if kind in ("output_raw", "output_logger"):
                size += len(getattr(record, kind).line)
                if size > console_limit:
                    console = None
                elif console is not None:
                    _write_console(console, record)
            elif kind == "run":
                first = first or record.run
                _apply(config, record.run.config)
                keys.update(_keys_set(record.run.config))
            else:
                _apply(config if kind == "config" else summary, getattr(record, kind))
                if kind == "config":
                    keys.update(_keys_set(record.config))
    text = None if console is None else console.text().encode()
    if first is None:
        return LoggedRun(config=config, summary=summary, console=text, config_keys=frozenset(keys))
    names = (first.display_name, first.run_group, first.job_type)
    return LoggedRun(names, tuple(first.tags), config, summary, text, frozenset(keys))


def logged_config_keys(log: Path) -> frozenset[str]:
    """`LoggedRun.config_keys` of a log, reading only its run and config records (a run's
    summary records, one a step, cost most of a whole read). wandb-core sends the whole
    config after each change and the server keeps a top-level key once sent, so a key the
    log set and later removed may be on the server; no other key may."""
    keys: set[str] = set()
    for read in records.read_indexed(log):
        for index in read.of("run", "config").tolist():
            record = pb.Record.FromString(read.frames.payload(index))
            change = record.run.config if record.HasField("run") else record.config
            keys.update(_keys_set(change))
    return frozenset(keys)


def run_config_keys(payloads: Iterable[bytes]) -> set[str]:
    """The top-level config keys the run records among `payloads` set."""
    keys: set[str] = set()
    for payload in payloads:
        record = pb.Record.FromString(payload)
        if record.HasField("run"):
            keys.update(_keys_set(record.run.config))
    return keys


def _keys_set(change: pb.ConfigRecord) -> Iterator[str]:
    """The top-level config keys a run or config record's updates set."""
    return (item_path(item)[0] for item in change.update)


def _apply(tree: dict, change: pb.ConfigRecord | pb.SummaryRecord) -> None:
    """Apply a config or summary record's updates, then its removals, to `tree`."""
    for item in change.update:
        *parents, leaf = item_path(item)
        place = tree
        for key in parents:  # (a value in the way is replaced by an object, as wandb-core does)
            child = place.get(key)
            if not isinstance(child, dict):
                child = place[key] = {}
            place = child
        try:
            place[leaf] = json.loads(item.value_json)
        except RecursionError:
            raise ValueError(f"a value of {leaf} is nested too deep") from None
    for item in change.remove:
        *parents, leaf = item_path(item)
        place = tree
        for key in parents:
            place = place.get(key) if isinstance(place, dict) else None
        if isinstance(place, dict):
            place.pop(leaf, None)


def step_items(read: records.RecordIndex) -> StepRuns:
    """`sentrows.item_step` of each history record of a read. The compiled proof of the
    records (`records.proven_history`) reads the `_step` item of every row wandb writes;
    the rows it leaves (not proven valid, or whose last `_step` item is not a plain
    integer) are parsed with protobuf, which raises DecodeError on an invalid one: a sync
    reports that as a record that cannot be read."""
    frames, which = read.frames, read.history
    if not len(which):
        return StepRuns.of(())
    proof = records.proven_history(frames, which)
    steps = np.where(proof.has_step, proof.steps, 0).astype(np.int64)
    known = np.array(proof.has_step, bool)
    for row in np.flatnonzero(~proof.has_step).tolist():
        if proof.step_known[row]:
            continue  # (proven to have no integer `_step`)
        item = sentrows.item_step(frames.payload(int(which[row])))
        if item is not None:
            steps[row], known[row] = item, True
    return StepRuns.from_arrays(steps, known)

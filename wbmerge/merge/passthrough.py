"""Pass-through targets (`new`, `auto`): one rank's records as they are, restarts
concatenated, with the run record rewritten. A clean log is spliced: its head re-framed,
every later block copied in the kernel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from ..errors import WbmergeError
from ..log import (
    BLOCK_SIZE,
    LogWriter,
    ReadReport,
    Steps,
    passthrough_rewrites,
    read_head,
    record_kind,
    records,
    restep,
)
from ..plan import Source, Target
from ..wandbcore import ContentCounter, run_config_keys
from .artifacts import ArtifactRecords
from .console import console_and_stats
from .files import files_record
from .options import MergeOptions
from .outcome import Outcome, check_known, damage_warnings, is_record, not_a_record
from .runrecord import exit_code, exit_record, restart_config, rewrite_run

_PASSTHROUGH_READ = 128 * BLOCK_SIZE
_RUN, _HEADER, _EXIT, _ARTIFACT = map(records.code, ("run", "header", "exit", "artifact"))
_UNKNOWN = 0  # the kind code of a record of no known kind (checked before it is copied)
# records a pass-through does not copy as they are (and history records a restart moves);
# the header is written once, before the run record
_SPECIAL = [*map(records.code, passthrough_rewrites()), _HEADER, _UNKNOWN]
_HEAD_BLOCKS = 64  # how far a log's head may reach: its run record and the records beside it


def write_passthrough(
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    artifacts: ArtifactRecords,
    count_content: bool = False,
) -> Outcome:
    """A rank's records as they are (restarts concatenated), the run record rewritten,
    `files` records without the paths that would lead the uploader out of the run's files
    (`stagefiles.files_record`) and artifact records filed under the target run
    (`artifacts`): one clean log by copying its blocks (`write_spliced`), anything else
    record by record."""
    if len(target.sources) == 1 and not target.extra_system_sources:
        spliced = write_spliced(target.sources[0], target, writer, options, count_content)
        if spliced is not None:
            return spliced
    outcome = Outcome()
    warnings = outcome.warnings
    exit_payload = None
    steps = Steps()
    several = len(target.sources) > 1
    body = HeldUntilTheRunRecord(writer)  # (the header and run record go to `writer`)
    for index, source in enumerate(target.sources):
        report = ReadReport()
        steps.restart()
        exit_payload = None
        for read in records.read_indexed(source.path, report, read_size=_PASSTHROUGH_READ):
            frames, codes = read.frames, read.codes
            special = np.isin(codes, _SPECIAL)
            moved: dict[int, int] = {}  # history records a restart moves: to their step
            if several and len(read.history):
                placed = steps.shifted(read.rows.steps)
                rows = np.flatnonzero(placed != read.rows.steps)
                special[read.history[rows]] = True
                moved = dict(zip(read.history[rows].tolist(), placed[rows].tolist(), strict=True))
            starts, ends = frames.starts.tolist(), frames.ends.tolist()
            done = 0
            for at in np.flatnonzero(special).tolist():
                body.write_many(frames.data, starts[done:at], ends[done:at])
                done = at + 1
                payload = frames.payload(at)
                kind = read.kind(at)
                if kind == "run":
                    if index == 0:
                        writer.write(rewrite_run(payload, target, options))
                        body.release()
                    elif (
                        config := passed_record(kind, payload, source, options, artifacts, warnings)
                    ) is not None:
                        body.write(config)
                elif kind == "exit":
                    exit_payload = payload
                elif kind == "header":
                    if index == 0:  # (once)
                        writer.write(payload)
                else:
                    passed = passed_record(
                        kind, payload, source, options, artifacts, warnings, moved.get(at)
                    )
                    if passed is not None:
                        body.write(passed)
            body.write_many(frames.data, starts[done:], ends[done:])
        warnings += damage_warnings(source, report, exit_payload is not None, target.primary_rank)
    for extra in target.extra_system_sources:
        stats = console_and_stats(_stats_payloads(extra.path), extra, stats_only=True)
        for record in stats:
            body.write(record[3])
    outcome.exit_code = exit_code(exit_payload)
    body.write(exit_payload if exit_payload is not None else exit_record(outcome.exit_code))
    body.release()  # (a log without a run record: as it was)
    return outcome


def passed_record(
    kind: str | None,
    payload: bytes,
    source: Source,
    options: MergeOptions,
    artifacts: ArtifactRecords,
    warnings: list[str],
    placed: int | None = None,
) -> bytes | None:
    """What a pass-through writes of a `files`, artifact, unknown or history record of
    `source` (`placed`: the step a restart moves a history record to), or of a restart's
    run record (its config: `restart_config`), None when it is left out. One rule for the
    one-shot pass-through and a follow's rounds (`follow.passlive`), so that both write
    every record alike."""
    if kind == "run":
        try:
            return restart_config(payload)
        except DecodeError:
            warnings.append(not_a_record(source))
            return None
    if kind == "files":
        return files_record(payload, source, warnings)
    if kind == "artifact":
        return artifacts.rewrite(payload, source)
    if kind is None:
        if not is_record(payload):
            warnings.append(not_a_record(source))
            return None
        check_known(payload, source, options.copy_unknown)
        return payload
    if kind == "history" and placed is not None:
        return restep(payload, placed)
    return payload


class HeldUntilTheRunRecord:
    """A writer that holds what a log has before its run record, to write it after.

    wandb-core's uploader drops the history rows and system metrics that come before a
    log's run record (measured with `wandb sync` 0.31; wandb itself always writes the run
    record right after the header), so a pass-through that copied them where they were
    would lose them. What is held is bounded: a log whose run record comes later than
    `limit` bytes is refused in one line.
    """

    def __init__(self, writer: LogWriter, limit: int = _HEAD_BLOCKS * BLOCK_SIZE) -> None:
        self.writer, self.limit = writer, limit
        self.held: list[bytes] | None = []  # None once released
        self.size = 0

    def write(self, payload: bytes) -> None:
        if self.held is None:
            self.writer.write(payload)
            return
        self.size += len(payload)
        if self.size > self.limit:
            raise WbmergeError(
                f"a log holds more than {self.limit // 1024} KiB of records before its run "
                "record, which wandb's uploader would drop; it cannot be passed through"
            )
        self.held.append(bytes(payload))

    def write_many(self, data: bytes, starts: list[int], ends: list[int]) -> None:
        if self.held is None:
            self.writer.write_many(data, starts, ends)
            return
        for start, end in zip(starts, ends, strict=True):
            self.write(data[start:end])

    def release(self) -> None:
        """Write what is held, and pass everything after it straight through."""
        if self.held is not None:
            for payload in self.held:
                self.writer.write(payload)
            self.held = None


def write_spliced(
    source: Source,
    target: Target,
    writer: LogWriter,
    options: MergeOptions,
    count_content: bool = False,
) -> Outcome | None:
    """One clean log without re-framing it: its head (the blocks up to the end of the run
    record) re-framed with the run record rewritten, then every later block copied as it
    is, in the kernel. The common case of `new` and `auto`: copying costs a fraction of
    framing every record again.

    The check that the log can be copied reads every record anyway; with `count_content`
    it also counts what the staged log will put on the server (`Outcome.content`: of the
    head's rewritten run record only its config keys, taken as written), so that the
    upload need not read the staged log again.

    Returns None, having written nothing, for any other log: damaged or truncated, without
    exactly one exit record, with a run or header record after the head, with a `files`
    record that must be changed, an artifact record (each is rewritten) or a record of no
    known kind that is not valid protobuf, or too short.
    """
    report = ReadReport()
    counts = np.zeros(256, np.int64)
    exit_payload = b""
    copyable = True
    content = ContentCounter() if count_content else None
    for read in records.read_indexed(source.path, report, read_size=_PASSTHROUGH_READ):
        frames = read.frames
        if content is not None:
            content.add(read)
        counts += np.bincount(read.codes, minlength=256)
        exits = read.of("exit")
        if len(exits):
            exit_payload = frames.payload(int(exits[-1]))
        for index in read.of("files").tolist():
            payload = frames.payload(index)
            copyable = copyable and files_record(payload, source, []) == payload
        for index in np.flatnonzero(read.codes == _UNKNOWN).tolist():
            payload = frames.payload(index)
            valid = is_record(payload)
            copyable = copyable and valid
            if valid:
                check_known(payload, source, options.copy_unknown)
    if report.damaged or counts[_EXIT] != 1 or counts[_ARTIFACT] or not copyable:
        return None
    with open(source.path, "rb") as stream:
        for blocks in range(1, _HEAD_BLOCKS + 1):  # the head: up to the end of the run record
            head = read_head(stream, blocks)
            if head is None:
                return None
            payloads, open_record = head
            kinds = [record_kind(payload) for payload in payloads]
            if "run" in kinds:
                break
        else:
            return None
        if kinds.count("run") != counts[_RUN] or kinds.count("header") != counts[_HEADER]:
            return None  # a run or header record after the head: re-frame the whole log
        if set(kinds[: kinds.index("run")]) - {"header"}:
            return None  # records before the run record: moved after it record by record
        written = [
            rewrite_run(payload, target, options) if kind == "run" else payload
            for payload, kind in zip(payloads, kinds, strict=True)
        ]
        for payload in written:
            writer.write(payload)
        writer.end_block(open_record)
        copied = report.records - len(payloads)  # (the bytes read, should the log grow)
        writer.copy_blocks(stream, blocks * BLOCK_SIZE, report.bytes_read, copied)
    counted = None
    if content is not None:  # (every run record is in the head: their keys as written)
        runs = [payload for payload, kind in zip(written, kinds, strict=True) if kind == "run"]
        counted = content.content(run_config_keys(runs))
    return Outcome(exit_code=exit_code(exit_payload), content=counted)


def _stats_payloads(path: Path) -> Iterator[bytes]:
    """The system-metric records of a log, picked out a read at a time (`RecordIndex`)
    rather than by walking every record's tags in Python."""
    for read in records.read_indexed(path, ReadReport()):
        yield from map(read.frames.payload, read.of("stats").tolist())

"""A pass-through target (`new`, `auto`) followed a round at a time: each round reads only
what its rank wrote since the last one and stages a log that continues the rounds sent.

A pass-through run is one rank's records as they are, its restarts concatenated (a restart
that repeats steps moved after them), the run record rewritten (`merge.passthrough`). Kept
between rounds, per source (the rank's first run and each restart): where its log was read
to (`tails`), where the restarts' steps stand (`Steps`), the header and rewritten run record
(the log's head), the records read past the watermark (they wait for a round that may send
them), and what the server holds: the rows sent (`incremental.LiveRounds`), every record
other than a row sent so far, in order, in a spool file beside the state (`Spools.kept`),
and the summary records sent, folded into the last update or removal of each key.

A round's log is what `cut` and `verify.remainder` would make of the one-shot pass-through
of the files as they are: the head, the records other than rows sent before, the folded
summary, then the records read since (up to the first row past the watermark), the last
row held back while none is left out, and an exit record that leaves the run running.

Anything a round cannot continue gives way to a merge from scratch (`stage` gives a
`Fallback`): a log truncated, rewritten or damaged, a restart added, an artifact record (its
files are copied into one round's staging), a head that is not what the one-shot would keep.
The last round (every rank finished) goes on from the kept merge too, as a shared one does
(`incremental`): it writes every record left, no row held back, then the last source's own
exit record where the one-shot writes it, so the run ends as `wbmerge sync` makes it. It is
checked against the rank's records folded as the rounds read them (`verify.ExpectedFold`),
the rows sent before counted by their tallies: only its own log is read again. A merge
taken up from a saved state (its counts live in memory only) ends with a one-shot merge of
the files. A target whose system metrics come from every rank (`auto` with
`--system-metrics all`) is merged from scratch every round.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from google.protobuf.message import DecodeError

from ..log import BLOCK_SIZE, Frames, LogWriter, ReadReport, Steps, items, pb, records, restep, wire
from ..merge import (
    MergeOptions,
    Spools,
    Staged,
    damage_warnings,
    exit_code,
    new_run_dir,
    passed_record,
    rewrite_run,
    staged_with_files,
)
from ..plan import Target
from ..wandbcore import StagedContent
from .cut import running_exit_record
from .fallback import NOT_YET, Fallback
from .incremental import (
    LiveRounds,
    NotIncremental,
    check_last_step,
    folded,
    saved_record,
)
from .tails import LiveReaders, first_records

_READ_BLOCKS = 128  # blocks a read takes (as the one-shot pass-through reads)
_HEAD_LIMIT = 64 * BLOCK_SIZE  # records before the run record (`HeldUntilTheRunRecord`)


# Rows without their own `_step` (not as wandb writes them) that wandb's uploader would
# number from the run's start when a log continues the rows sent: the whole log moves them
# to their steps (`verify.remainder`), so the last round is merged whole, as the normal course.
_NUMBERED_OTHERWISE = Fallback("its rows would be numbered otherwise", said=False)


def _numbered_otherwise(content: StagedContent, rows_sent: int) -> bool:
    """Whether the rows after the first `rows_sent` would go to other steps than in a whole
    upload, were the log cut there (as a round's log is)."""
    return content.steps_sent_from(rows_sent) != content.history_steps[rows_sent:]


class _NoArtifacts:
    """An artifact record's files are copied into one round's staging: merged from scratch."""

    def rewrite(self, payload: bytes, source: object) -> bytes:
        raise NotIncremental("its rank logged an artifact")


class LivePassthrough(LiveRounds):
    """One pass-through target, kept between the rounds of a follow.

    `spool`: the file for the records other than rows sent, when it is to outlive the
    process (else a temporary file in `scratch`); `saved`: a `state()` of the same target
    and options to go on from. Raises NotIncremental when the files do not hold what
    `saved` read of them, ValueError when `saved` does not fit."""

    ENDS_KEPT = True

    def __init__(
        self,
        target: Target,
        options: MergeOptions,
        scratch: Path,
        spool: Path | None = None,
        saved: dict | None = None,
    ) -> None:
        if target.extra_system_sources:
            raise NotIncremental("every rank's system metrics are merged from scratch")
        super().__init__(target, options, scratch)
        self._several = len(target.sources) > 1  # (only restarts are moved: as the one-shot)
        self._steps = Steps()
        self._head: list[bytes] = []  # the header and rewritten run record
        self._before_run: list[bytes] = []  # records read before the run record
        # records read and not sent yet: (kind, the step of a row, as the run holds it)
        self._waiting: list[tuple[str | None, int, bytes]] = []
        # the summary sent: each key's last update (False) or removal (True), in order
        self._summary: dict[tuple[str, ...], tuple[bool, bytes]] = {}
        # what the one-shot pass-through says of each source (said by the last round)
        self._warnings: dict[int, list[str]] = {}
        self._exit: bytes | None = None  # the exit record of the source read last
        self._ended: set[int] = set()  # the sources read with an exit record
        paths = {0: [s.path for s in target.sources]}
        first = target.sources[0]
        if saved is None:
            self._spools = Spools(scratch) if spool is None else Spools.kept(spool)
            self._kept = self._spools.writer(first)
            self._readers = LiveReaders(paths)
            return
        assert spool is not None
        self._readers = LiveReaders.resumed(paths, saved["readers"])
        try:
            self._restore(saved)
        except (IndexError, KeyError, TypeError, DecodeError) as exc:  # (of the right types)
            raise ValueError(f"a saved value that is not one ({type(exc).__name__})") from None
        self._check_with_files()
        writers = saved["spool"]["writers"]
        if set(writers) != {str(first.path)}:
            raise ValueError("a spool of a file that is not the first source")
        self._spools = Spools.kept(
            spool, {**saved["spool"], "writers": {first.path: writers[str(first.path)]}}
        )
        kept = self._spools.writer_of(first.path)
        assert kept is not None
        self._kept = kept

    def state(self) -> dict:
        """What a round needs to go on from this one, as plain values (`saved.PASSTHROUGH`):
        how far each source was read, the head, the records waiting, where the steps stand,
        the summary sent and what the server holds. The spool must be `sync`ed with it."""
        spool = self._spools.state()
        return {
            **self._rounds_state(),
            "readers": self._readers.positions(),
            "head": list(self._head),
            "before_run": list(self._before_run),
            "waiting": [list(item) for item in self._waiting],
            "steps": list(self._steps.place_state()),
            "summary": [
                [list(path), removed, item] for path, (removed, item) in self._summary.items()
            ],
            "spool": {**spool, "writers": {str(p): w for p, w in spool["writers"].items()}},
        }

    def _restore(self, saved: dict) -> None:
        self._restore_rounds(saved)
        self._head = list(saved["head"])
        self._before_run = list(saved["before_run"])
        self._waiting = [(kind, step, payload) for kind, step, payload in saved["waiting"]]
        for kind, _, payload in self._waiting:
            if kind not in records.KIND_NAMES or records.record_kind(payload) != kind:
                raise ValueError("a record waiting that is not of its kind")
            saved_record(payload)
        self._steps = Steps.at(*saved["steps"])
        self._summary = {tuple(path): (removed, item) for path, removed, item in saved["summary"]}
        for _, item in self._summary.values():
            pb.SummaryItem.FromString(item)  # (DecodeError: not one)

    def _check_with_files(self) -> None:
        """ValueError unless what the state says of the log is in it: the head is the log's
        header and run record, rewritten; the last row read is the log's last row before
        where reading resumes, placed where the steps say (the rows sent after it, the run
        record and the rows to send go to the server as the state holds them)."""
        if self._read_head() != self._head or self._before_run:
            raise ValueError("a saved head that is not its log's header and run record")
        index, found = self._readers.last_rows()[0]
        check_last_step(0, self._steps.place_state(), found, self._several)
        rows = [payload for kind, _, payload in self._waiting if kind == "history"]
        last_read = next((p for p in (*rows[-1:], self._held, self._last_payload) if p), None)
        if found is not None and self._several:
            step = saved_record(found, "history").history.step.num
            placed = step + (self._steps.place_state()[1] or 0)
            found = found if placed == step else restep(found, placed)
        if found != last_read and (found is not None or index == 0):
            raise ValueError("a saved last row read that is not its log's")
        self._check_waiting()

    def _check_waiting(self) -> None:
        """ValueError unless the records waiting are the last ones read of the log (those
        a pass-through rewrites, of their kind; the exit record is not kept)."""
        if not self._waiting:
            return
        read = self._readers.records_read_back(0, len(self._waiting) + 1)
        read = [payload for payload in read if records.record_kind(payload) != "exit"]
        if len(read) < len(self._waiting):
            raise ValueError("records waiting that were not read of its log")
        for (kind, step, payload), was in zip(
            self._waiting, read[-len(self._waiting) :], strict=True
        ):
            rewritten = kind in ("files", "artifact", None) or (kind == "history" and self._several)
            if records.record_kind(was) != kind or (payload != was and not rewritten):
                raise ValueError("records waiting that are not the last ones read of its log")
            if kind == "history" and saved_record(payload).history.step.num != step:
                raise ValueError("a row waiting at another step than it holds")

    def _read_head(self) -> list[bytes]:
        """The first log's header and run record, rewritten (what `_take` keeps as the head),
        read from its start: a block or two, more only while no run record is found."""
        size = 2 * BLOCK_SIZE
        while True:
            head = []
            for payload in first_records(self.target.sources[0].path, size):
                kind = records.record_kind(payload)
                if kind == "header":
                    head.append(payload)
                elif kind == "run":
                    return [*head, rewrite_run(payload, self.target, self.options)]
            if size > _HEAD_LIMIT:
                return head
            size *= 4

    @property
    def _has_run(self) -> bool:
        """Whether the head holds the run record yet (it holds the header and it, at most)."""
        return any(records.record_kind(payload) == "run" for payload in self._head)

    def sync(self) -> None:
        """Make the spool's bytes durable (before a `state()` of them is saved)."""
        self._spools.sync()

    def close(self) -> None:
        self._spools.close()

    def _stage(
        self, out_dir: Path, watermark: int | None, server_rows: int, final: bool
    ) -> tuple[Staged, StagedContent | None] | Fallback:
        """`stage` for a pass-through: the rank's new records as the one-shot passes them;
        `NOT_YET` while its log has no run record. The last round's (`final`) ends as the
        one-shot ends: every record left, then the last source's own exit record."""
        target = self.target
        self.rounds += 1
        self._readers.begin_round()
        read_before = self._readers.bytes_read
        rank = target.sources[0].rank.rank
        while self._readers.live():
            frames, reads = self._readers.read([0], _READ_BLOCKS)
            read = records.RecordIndex(frames)
            if self._expected is not None and reads[0].records:  # (the last round's check)
                self._expected.add(rank, reads[0].source, read)
            self._take(read, reads[0].source, reads[0].starts)
        self.bytes_read = self._readers.bytes_read - read_before
        if not self._has_run:
            return NOT_YET
        if final and (self._readers.open_ranks() or self._exit is None):
            raise NotIncremental("its log is not read to its exit record")
        waiting = self._waiting
        cut = len(waiting)
        if watermark is not None and not final:
            cut = next(
                (
                    i
                    for i, (kind, step, _) in enumerate(waiting)
                    if kind == "history" and step > watermark
                ),
                cut,
            )
        written = [(kind == "history", payload) for kind, _, payload in waiting[:cut]]
        arranged = self._arrange(written, cut < len(waiting), server_rows, final)
        if isinstance(arranged, Fallback):
            return arranged
        written, held = arranged
        run_dir = new_run_dir(target, out_dir)
        try:
            staged, _ = staged_with_files(target, run_dir, self.options.files_from)
            with open(staged.log_path, "xb") as stream, LogWriter(stream) as writer:
                for payload in self._head:
                    writer.write(payload)
                for payload in self._spools.read(target.sources[0]):
                    writer.write(payload)
                for payload in self._summary_records():
                    writer.write(payload)
                for _, payload in written:
                    writer.write(payload)
                writer.write(self._exit if final and self._exit else running_exit_record())
                staged.records = writer.records
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        del waiting[:cut]  # (what is left waits for the next round)
        content = self._finish(staged.log_path, written, held, final)
        if final and content is not None and _numbered_otherwise(content, self.rows_sent):
            shutil.rmtree(run_dir, ignore_errors=True)
            return _NUMBERED_OTHERWISE
        if final:  # (its exit code, and what the one-shot says of each source)
            staged.exit_code = exit_code(self._exit)
            for index, source in enumerate(target.sources):
                staged.warnings += self._warnings.get(index, [])
                staged.warnings += damage_warnings(
                    source, ReadReport(), index in self._ended, target.primary_rank
                )
        return staged, content

    def _take(self, read: records.RecordIndex, index: int, starts: bool) -> None:
        """One read's records of source `index` as the one-shot pass-through writes them,
        added to those waiting (or to the head, and before the run record)."""
        source = self.target.sources[index]
        if starts:
            self._steps.restart()
            self._exit = None
        steps: dict[int, int] = {}
        moved: dict[int, int] = {}
        if len(read.history):
            at = read.history.tolist()
            if self._several:
                placed = self._steps.shifted(read.rows.steps).tolist()
                moved = {
                    i: s
                    for i, s, was in zip(at, placed, read.rows.steps.tolist(), strict=True)
                    if s != was
                }
            else:
                placed = read.rows.steps.tolist()
            steps = dict(zip(at, placed, strict=True))
        frames = read.frames
        view = memoryview(frames.data)
        names = records.KIND_NAMES
        has_run = self._has_run  # (asked once a read: it changes only below)
        spans = zip(read.codes.tolist(), frames.starts.tolist(), frames.ends.tolist(), strict=True)
        for i, (code, start, end) in enumerate(spans):
            kind = names[code]
            payload = bytes(view[start:end])
            if kind == "exit":  # (a round ends with one that leaves the run running)
                self._exit = payload
                self._ended.add(index)
                continue
            if kind == "run" and index:  # a restart's: its config, where the restart starts
                passed = passed_record(
                    kind,
                    payload,
                    source,
                    self.options,
                    _NoArtifacts(),  # type: ignore[arg-type]
                    self._warnings.setdefault(index, []),
                )
                if passed is None:
                    continue
                kind, payload = "config", passed
            elif kind in ("run", "header"):
                if index:
                    continue  # (a restart's header: the first run's stands for the run)
                if kind == "run":
                    payload = rewrite_run(payload, self.target, self.options)
                if not has_run:
                    self._head.append(payload)
                    if kind == "run":
                        has_run = True
                        self._waiting += [(records.record_kind(p), -1, p) for p in self._before_run]
                        self._before_run = []
                    continue
            elif kind in ("files", "artifact", None) or i in moved:
                passed = passed_record(
                    kind,
                    payload,
                    source,
                    self.options,
                    _NoArtifacts(),  # type: ignore[arg-type]
                    self._warnings.setdefault(index, []),
                    moved.get(i),
                )
                if passed is None:
                    continue
                payload = passed
            if not has_run:
                self._before_run.append(payload)
                if sum(map(len, self._before_run)) > _HEAD_LIMIT:
                    raise NotIncremental("records before its run record")
                continue
            self._waiting.append((kind, steps.get(i, -1), payload))

    def _summary_records(self) -> list[bytes]:
        """The summary sent so far as records: each key's last update or removal, in the
        order they were made, consecutive updates (removals) in one record."""
        found: list[bytes] = []
        record: pb.Record | None = None
        removing = False
        for removed, item in self._summary.values():
            if record is None or removed != removing:
                if record is not None:
                    found.append(record.SerializeToString())
                record, removing = pb.Record(), removed
                record.summary.SetInParent()
            (record.summary.remove if removed else record.summary.update).add().MergeFromString(
                item
            )
        if record is not None:
            found.append(record.SerializeToString())
        return found

    def _to_keep(self, others: list[bytes]) -> object:
        """The records other than rows of a round, but the summary records, and those
        folded (a key's last update or removal stands for all): held until the round is
        verified, O(keys) rather than a summary record a step."""
        kept, summaries = [], []
        for payload in others:
            (summaries if records.record_kind(payload) == "summary" else kept).append(payload)
        last = _last_updates(summaries) if summaries else {}
        if last is None:  # (a summary not in wandb's shape, or with removals: one by one)
            last = {}
            for payload in summaries:
                summary = pb.Record.FromString(payload).summary
                for removed, items in ((False, summary.update), (True, summary.remove)):
                    for item in items:
                        path = tuple(item.nested_key) or (item.key,)
                        last.pop(path, None)
                        last[path] = (removed, item.SerializeToString())
        return kept, last

    def sent_summary(self) -> dict:
        return folded([saved_record(p).summary for p in self._summary_records()])

    def sent_others(self) -> list[bytes]:
        return list(self._spools.read(self.target.sources[0]))

    def _keep(self, kept: object) -> None:
        """A verified round's records other than rows: to the spool, in order, and its
        summary folded into the summary sent."""
        others, last = kept  # type: ignore[misc]
        for payload in others:
            self._kept.write(payload)
        for path, change in last.items():
            self._summary.pop(path, None)
            self._summary[path] = change


def _last_updates(summaries: list[bytes]) -> dict[tuple[str, ...], tuple[bool, bytes]] | None:
    """Each key's last update in `summaries` (summary records), in the order of those last
    updates, found as columns (`log.items`): a round of 10k steps whose summaries set the
    same keys each step folds in milliseconds, not a Python step per value. None when a
    record is not in wandb's shape (or removes a key): fold them one by one."""
    lengths = np.fromiter(map(len, summaries), np.int64, len(summaries))
    ends = np.cumsum(lengths)
    frames = Frames(b"".join(summaries), ends - lengths, ends)
    starts, stops = records.summary_spans(frames, np.arange(len(summaries)))
    if (starts < 0).any():
        return None
    found = items.split_spans(frames.data, starts, stops)
    if found is None:
        return None
    codes, keys = found.key_codes()
    _, first_from_end = np.unique(codes[::-1], return_index=True)
    taken = np.sort(len(codes) - 1 - first_from_end)
    last: dict[tuple[str, ...], tuple[bool, bytes]] = {}
    try:
        for at, value in zip(taken.tolist(), found.values(taken).to_pylist(), strict=True):
            key = keys[codes[at]]
            path = tuple(wire.key_path(key))
            last.pop(path, None)
            last[path] = (False, key + value)
    except (ValueError, UnicodeDecodeError):
        return None
    return last

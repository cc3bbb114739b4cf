"""A shared target merged a round at a time: the merge kept between rounds, fed only what
the ranks wrote since, and the log a round stages holding only what the server lacks.

The merge of a shared run (`merge.shared.SharedMerge`) writes rows in step order as soon as
every rank has passed their step, and keeps per rank only what is O(keys): the key table,
the summary folded so far, where its steps stand. A follow keeps one such merge per target
and, each round, reads each rank's log from where the last round stopped (`tails`), so a
round costs what the ranks wrote since, not what the run holds.

What the server already holds is known from the rounds sent: the rows, and the records
other than rows (config, metric definitions, files, telemetry), kept in order. A round's
log is then what `verify.remainder` would cut a whole log down to: the header and run
record, every record other than a row sent so far, the rows written since (the last one
held back while no row is left out, as `cut` does), then the globs, console lines, system
metrics and summary as of now (the uploader sends these whole every time), and an exit
record that leaves the run running. Its `Delivery` says so (`rows_cut`, `row_before`), with
what the whole log would hold (`content`), so the upload checks the server's count and last
row, sends the log as it is, and reads back only the new rows.

The merge is given up, and the next round merges from scratch, when anything does not go
on from what it read: a source added (a rank or restart started), a log truncated,
rewritten or damaged (`tails.NotIncremental`, which `stage` turns into a `Fallback`), an
upload not verified, or a server that holds other rows than this follow sent. The final
round (every rank finished) goes on from the merge too, and ends its log as a one-shot
merge ends it: the other ranks' config, the final summary, the real exit record. It is
checked against the ranks' logs as a one-shot sync is, at the cost of what is new: the
ranks' records are folded for the check as the merge reads them, round by round
(`verify.ExpectedFold`), and the rows each round sent are tallied when staged
(`verify.rows_tally`); only the last round's log is read again. Those counts live in this
process only (their hash seed is never saved): a merge taken up from a saved state, or any
merge that cannot go on, ends with a one-shot merge of the files.

`state()` gives what a round needs to go on as plain values, O(keys) per rank plus the rows
and records held back and the steps of the rows sent; the console and system-metric spool
is a file of its own beside it (`Spools.kept`). A follower saves both after each verified
round (`saved`) and a restarted one goes on from them (`LiveShared(..., saved=state)`),
also with statistics across ranks (`--skew-metrics`, `--rank-stats`): their keys, the
numbers read and not yet written and each key's last statistics (`MergedRankStats.state`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from ..log import Frames, LogWriter, Steps, item_path, pb, records
from ..log.wire import key_part
from ..merge import (
    KeyTable,
    MergeOptions,
    Rows,
    SharedMerge,
    SourceRead,
    Spools,
    Staged,
    exit_code,
    exit_record,
    name_id,
    names_of,
    new_run_dir,
    staged_with_files,
    write_console_and_stats,
)
from ..plan import Target
from ..runtime import allow_open_files
from ..verify import ExpectedFold, add_tallies, continued_shortfall, fast_hashes, rows_tally
from ..wandbcore import StagedContent, StepRuns, read_staged, sentrows
from .cut import running_exit_record
from .fallback import Fallback, server_rows_differ
from .tails import LiveReaders, NotIncremental


class _Recorder:
    """Stands in for the merged log's writer: keeps what the merge writes, in order. The
    shared merge writes its rows with `write_many` (`rows.write_merged`) and every other
    record with `write`."""

    def __init__(self) -> None:
        self.items: list[tuple[bool, bytes]] = []  # (is a row, payload)

    def write(self, payload: bytes) -> None:
        self.items.append((False, payload))

    def write_many(self, data: bytes, starts: list[int], ends: list[int]) -> None:
        view = memoryview(data)
        self.items += [(True, bytes(view[s:e])) for s, e in zip(starts, ends, strict=True)]


class _Folded:
    """The merge's readers, each read also folded by the source check (`ExpectedFold`):
    the ranks' records are counted in the pass that merges them, not read again."""

    def __init__(self, readers: LiveReaders, expected: ExpectedFold) -> None:
        self.readers, self.expected = readers, expected

    def live(self) -> list[int]:
        return self.readers.live()

    def read(self, ranks: list[int], blocks: int) -> tuple[Frames, list[SourceRead]]:
        frames, reads = self.readers.read(ranks, blocks)
        at = 0
        for read in reads:
            part = Frames(
                frames.data,
                frames.starts[at : at + read.records],
                frames.ends[at : at + read.records],
            )
            at += read.records
            if read.records:
                self.expected.add(read.rank, read.source, records.RecordIndex(part))
        return frames, reads


def sources_of(target: Target) -> tuple:
    """What a target's merge is made of: a merge kept between rounds goes on only while it
    is the same."""
    return tuple(
        (str(s.path), s.rank.rank, s.rank.restart, s.label, s.run_id) for s in target.sources
    ) + (target.primary_rank, target.id)


class _NoArtifacts:
    """What a kept merge does with an artifact record: give up. The record's files are
    copied into one round's staging, and a later round would name them after that staging
    is gone; a round whose ranks logged an artifact merges from scratch, which copies them
    again (and the server keeps one version per digest)."""

    def rewrite(self, payload: bytes, source: object) -> bytes:
        raise NotIncremental("its ranks logged an artifact")


class LiveRounds:
    """What the server holds of a target's rounds, and how a round's log continues them:
    the part a kept shared merge (`LiveShared`) and a kept pass-through
    (`passlive.LivePassthrough`) share. A round gives its records in order (`written`,
    each a row or not); `_arrange` puts the row the last round held back before them and
    holds the last one back as `cut` does, `_finish` says what the staged log continues,
    and `sent` records what the server holds once the upload was verified. What is sent of
    the records other than rows is the subclass's to keep (`_keep`)."""

    # Whether its last round goes on from it (`stage(final=True)`), its rows sent tallied.
    ENDS_KEPT = False

    def __init__(self, target: Target, options: MergeOptions, scratch: Path) -> None:
        self.target, self.made_of = target, sources_of(target)
        self.options = options
        scratch.mkdir(parents=True, exist_ok=True)
        self.rows_sent = 0
        self._held: bytes | None = None  # the last row written, held back
        self._step_items = StepRuns.of(())  # (the steps of the rows sent, as runs)
        self._last_row: dict | None = None  # the last row sent, as wandb-core sends it
        self._last_payload: bytes | None = None  # (its record)
        # the round staged: what `_keep` is to keep of it, the row held back, the last row sent
        self._round: tuple[object, bytes | None, bytes | None] | None = None
        self.rounds = 0  # rounds staged
        self.bytes_read = 0  # of the ranks' logs, by the last round
        # The history values of the rows sent, tallied as the source check tallies a staged
        # log (one seed for the merge's life, never saved), so that the last round's check
        # reads only its own log; None when not known (a merge resumed from a saved state).
        self._hashes = fast_hashes()
        self._rows_tally: dict | None = {} if self.ENDS_KEPT else None
        self._round_tally: dict | None = None  # (the round staged's, kept once verified)
        # the ranks' records the merge read, folded as the source check folds them
        self._expected: ExpectedFold | None = None
        if self.ENDS_KEPT and not target.extra_system_sources:
            hashes, key_format, per_rank = self._hashes, options.key_format, options.per_rank
            self._expected = ExpectedFold(target, key_format, per_rank, hashes)

    def stage(
        self, out_dir: Path, watermark: int | None, server_rows: int, final: bool = False
    ) -> tuple[Staged, StagedContent | None] | Fallback:
        """Read what the ranks wrote since the last round and stage the round's log in
        `out_dir`, its rows up to `watermark` (None: all); with its whole content when the
        log continues the rounds sent (None: the log is whole, rows_cut 0). A `Fallback`
        when the round cannot go on from the last: the server holds other rows than were
        sent, or the files do not go on from what was read. (`NotIncremental` is raised deep
        in the readers and the merge; it stops here.) Raises WbmergeError (a file went away).
        `final`: every rank finished; the log ends the run as a one-shot merge ends it (its
        real exit record), and no row is held back."""
        try:
            return self._stage(out_dir, watermark, server_rows, final)
        except NotIncremental as exc:
            return Fallback(str(exc))

    def _stage(
        self, out_dir: Path, watermark: int | None, server_rows: int, final: bool
    ) -> tuple[Staged, StagedContent | None] | Fallback:
        raise NotImplementedError

    def _arrange(
        self, written: list[tuple[bool, bytes]], left_out: bool, server_rows: int, final: bool
    ) -> tuple[list[tuple[bool, bytes]], bytes | None] | Fallback:
        """The round's records after the row held back by the rounds before, without its
        last row when no row is left out and the server lacks it (it waits for the round
        after, as `cut` holds it back), and that row; a Fallback when the server holds other
        rows than the rounds sent (another sync sent rows past the watermark, or since)."""
        rows = sum(is_row for is_row, _ in written)
        fresh = self._held is None and self.rows_sent == 0
        if server_rows > rows if fresh else server_rows != self.rows_sent:
            return server_rows_differ(server_rows, self.rows_sent)
        if self._held is not None:
            written.insert(0, (True, self._held))
            rows += 1
        held = None
        if rows and not left_out and not final and server_rows < self.rows_sent + rows:
            last_at = max(i for i, (is_row, _) in enumerate(written) if is_row)
            held = written.pop(last_at)[1]
        return written, held

    def _finish(
        self, log: Path, written: list[tuple[bool, bytes]], held: bytes | None, final: bool = False
    ) -> StagedContent | None:
        """The round's log is staged: its whole content when it continues the rounds sent
        (None: the log is whole, rows_cut 0). The last round's rows are not tallied: its own
        check reads its log (`source_shortfall`), and no round comes after to add them to."""
        last_row = next((p for is_row, p in reversed(written) if is_row), None)
        self._round = (self._to_keep([p for is_row, p in written if not is_row]), held, last_row)
        if self._rows_tally is not None and not final:
            self._round_tally = rows_tally(log, self._hashes)
        if not self.rows_sent:
            return None
        new = read_staged(log)
        return dataclasses.replace(new, step_items=self._step_items + new.step_items)

    def sent_others(self) -> list[bytes]:
        """The records other than rows the rounds sent, in order (the server holds them)."""
        raise NotImplementedError

    def sent_config(self) -> dict:
        """The config keys the records other than rows sent set, each key's last value."""
        records = [saved_record(payload) for payload in self.sent_others()]
        return folded([r.config for r in records if r.WhichOneof("record_type") == "config"])

    def sent_summary(self) -> dict:
        """The summary the last round sent (the server holds it: the uploader sends it
        whole), each key's value."""
        raise NotImplementedError

    @property
    def last_step_sent(self) -> int | None:
        return self._step_items[-1] if self.rows_sent else None

    @property
    def row_before(self) -> dict | None:
        """The last row the server holds of this merge, as wandb-core sent it."""
        return self._last_row

    def _to_keep(self, others: list[bytes]) -> object:
        """What `_keep` is given of the records other than rows a round staged, once it is
        verified (held until then: the least of them that will do)."""
        return others

    def _keep(self, kept: object) -> None:
        """Keep what a verified round sent of the records other than rows, for the next."""
        raise NotImplementedError

    def sent(self, content: StagedContent) -> None:
        """The round's log was uploaded and verified: the server holds what it sent."""
        assert self._round is not None
        kept, held, last_row = self._round
        self._keep(kept)
        if self._rows_tally is not None and self._round_tally is not None:
            add_tallies(self._rows_tally, self._round_tally)
        self._round_tally = None
        self._held = held
        self.rows_sent = len(content.step_items)
        self._step_items = content.step_items
        if last_row is not None:
            self._last_payload = last_row
            self._last_row = sentrows.row_of(pb.Record.FromString(last_row).history)
        self._round = None

    def _rounds_state(self) -> dict:
        """What `_restore_rounds` goes on from: what the server holds of the rounds."""
        return {
            "rounds": self.rounds,
            "rows_sent": self.rows_sent,
            "held": self._held,
            "step_runs": self._step_items.runs(),
            "last_row": self._last_payload,
        }

    @property
    def can_end(self) -> bool:
        """Whether the last round can go on from this merge: the rows sent were tallied in
        this process (`source_shortfall`)."""
        return self._rows_tally is not None and self._expected is not None

    def source_shortfall(self, log: Path) -> list[str]:
        """What the last round's staged `log` lacks of what the ranks logged, folded as the
        merge read them; the rows the rounds before sent counted by their tallies
        (`verify.continued_shortfall`)."""
        assert self._rows_tally is not None and self._expected is not None
        return continued_shortfall(self.target, log, self._expected, self._hashes, self._rows_tally)

    def _restore_rounds(self, saved: dict) -> None:
        self._rows_tally = self._expected = None  # (not saved: the last round is from scratch)
        self.rounds, self.rows_sent = saved["rounds"], saved["rows_sent"]
        self._held = saved["held"]
        self._step_items = StepRuns.from_runs(saved["step_runs"])
        if self.rows_sent != len(self._step_items):
            raise ValueError("rows sent and their steps disagree")
        self._last_payload = saved["last_row"]
        if (self._last_payload is None) != (self.rows_sent == 0):
            raise ValueError("a last row sent that is not the rows sent's")
        last_step = self._step_items[-1] if self.rows_sent else None
        if self._last_payload is not None:
            last = saved_record(self._last_payload, "history").history
            if last_step is not None and last.step.num != last_step:
                raise ValueError("a last row sent at another step than the rows sent's last")
            self._last_row = sentrows.row_of(last)
        if self._held is not None:
            held = saved_record(self._held, "history").history
            if last_step is not None and held.step.num <= last_step:
                raise ValueError("a row held back that is not after the rows sent")


def folded(changes: list) -> dict:
    """What config or summary records (their `config` or `summary` parts) set, in order:
    each key's last value, nested keys as objects. Raises ValueError for a value that is
    not JSON."""
    found: dict = {}
    for change in changes:
        for item in change.update:
            path = item_path(item)
            place = found
            for part in path[:-1]:
                if not isinstance(place.get(part), dict):
                    place[part] = {}
                place = place[part]
            place[path[-1]] = json.loads(item.value_json)
        for item in change.remove:
            found.pop(item_path(item)[0], None)
    return found


def saved_record(payload: bytes, kind: str | None = None) -> pb.Record:
    """A record a saved state holds, parsed; ValueError when it is not one (of `kind`)."""
    try:
        record = pb.Record.FromString(payload)
    except DecodeError:
        raise ValueError("a saved record that is not one") from None
    if kind is not None and record.WhichOneof("record_type") != kind:
        raise ValueError(f"a saved {kind} record that is not one")
    return record


def check_last_step(rank: int, steps: tuple, found: bytes | None, shift_applies: bool) -> None:
    """ValueError unless a rank's saved steps (`Steps.place_state`) place the last row
    read of its current source (`LiveReaders.last_rows`) where they say it went: what a
    state says of a rank's steps is checked against its file."""
    last, shift = steps
    if found is None:
        if shift is not None and shift_applies:
            raise ValueError(f"rank {rank}: a saved shift for a restart with no row read")
        return
    step = saved_record(found, "history").history.step.num
    if shift_applies and (shift is None or last != step + shift):
        raise ValueError(f"rank {rank}: saved steps that do not place its last row read")


def _checked_last_key(rank: int, kept: dict, before_all: tuple) -> tuple:
    """A rank's saved `last_key`, the key of the last row or record it read: nothing, its
    last row's (step, 0, rank), or after it its last other record's (step, 1, rank, seq).
    ValueError when it is none of these (a rank read past where it was would hold every
    rank's rows back wrongly, or let them go too soon)."""
    key = tuple(kept["last_key"])
    last = kept["steps"][0]
    if key == before_all or key in ((last, 0, rank), (last, 1, rank, kept["seq"])):
        return key
    raise ValueError(f"rank {rank}: a saved last key that is not where it was read")


def _values(row: pb.HistoryRecord, key_of: Callable) -> dict[bytes, bytes]:
    """A row's values (each item without its key) by `key_of(its key path)`, but those it
    gives None."""
    found = {}
    for item in row.item:
        key = key_of(item_path(item))
        if key is not None:
            value = pb.HistoryItem()
            value.CopyFrom(item)
            value.ClearField("key")
            value.ClearField("nested_key")
            found[key] = value.SerializeToString()
    return found


def _labelled(keys: Any, path: list[str]) -> bytes | None:  # (a `RankKeys`)
    """The key part a rank's key has in the merged rows (None: W&B's own, or not kept)."""
    out, name = keys.entry(key_part(path))
    return out if name is None else None


class LiveShared(LiveRounds):
    """One shared target's merge, kept between the rounds of a follow.

    `spool`: the file for its console lines and system metrics, when it is to outlive the
    process (else a temporary file in `scratch`); `saved`: a `state()` of the same target
    and options to go on from (its spool in `spool`). Raises NotIncremental when the files
    do not hold what `saved` read of them, ValueError when `saved` does not fit."""

    ENDS_KEPT = True

    def __init__(
        self,
        target: Target,
        options: MergeOptions,
        scratch: Path,
        spool: Path | None = None,
        saved: dict | None = None,
    ) -> None:
        super().__init__(target, options, scratch)
        self._recorder = _Recorder()
        self.merge = SharedMerge(
            target,
            self._recorder,
            options,
            {},
            _NoArtifacts(),  # type: ignore[arg-type]
        )
        self.merge.write_head()
        self._head = [payload for _, payload in self._recorder.items]
        self._recorder.items.clear()
        paths = {rank: [s.path for s in sources] for rank, sources in self.merge.by_rank.items()}
        # What the server holds of what this merge wrote, besides rows (`LiveRounds`):
        self._others_sent: list[bytes] = []  # records other than rows, in order
        if saved is None:
            self._spools = Spools(scratch) if spool is None else Spools.kept(spool)
            self._readers = LiveReaders(paths)
            return
        assert spool is not None
        self._readers = LiveReaders.resumed(paths, saved["readers"])
        try:
            self._restore(saved)
        except (IndexError, KeyError, TypeError, DecodeError) as exc:  # (of the right types)
            raise ValueError(f"a saved value that is not one ({type(exc).__name__})") from None
        for rank, (_, found) in self._readers.last_rows().items():
            check_last_step(rank, saved["ranks"][rank]["steps"], found, True)
        if self._held is not None:
            self._check_held()
        known = {str(path): path for sources in paths.values() for path in sources}
        writers = saved["spool"]["writers"]
        if not set(writers) <= set(known):
            raise ValueError("a spool of a file that is not a source")
        spool_state = {**saved["spool"], "writers": {known[p]: w for p, w in writers.items()}}
        self._spools = Spools.kept(spool, spool_state)
        started = self._readers.started()
        for rank, state in self.merge.states.items():
            path = saved["ranks"][rank]["spool"]
            state.spool = None if path is None else self._spools.writer_of(known.get(path))
            if (path is not None or started[rank]) and state.spool is None:
                self._spools.close()
                raise ValueError(f"rank {rank}: no spool of {path}")

    def _check_held(self) -> None:
        """ValueError unless the row held back holds, under each rank's labelled keys,
        what the rank's file holds at its step (read back from where reading resumes)."""
        assert self._held is not None
        held = saved_record(self._held, "history").history
        got = _values(held, lambda path: None if path[0].startswith("_") else key_part(path))
        want: dict[bytes, bytes] = {}
        for rank, state in self.merge.states.items():
            shift = state.steps.place_state()[1] or 0
            found = self._readers.row_read_at(rank, held.step.num - shift)
            if found is not None:
                row = saved_record(found, "history").history
                want.update(_values(row, lambda path, keys=state.keys: _labelled(keys, path)))
        if got != want if not self.merge.across else not want.items() <= got.items():
            raise ValueError("a row held back that is not what the ranks' files hold")

    def state(self) -> dict:
        """What a round needs to go on from this one, as plain values (bytes, numbers,
        strings, lists and dicts): how far each rank's logs were read, each rank's keys,
        folded summary and step placement, the rows and records held back, and what the
        server holds of this merge. The spool file must be `sync`ed with it."""
        merge = self.merge
        ranks = {}
        for rank, state in merge.states.items():
            last, shift = state.steps.place_state()
            spool = self._spools.path_of(state.spool)
            ranks[rank] = {
                "known": list(state.keys.known),
                "summary": [[out, value] for out, value in state.summary.items()],
                "exit": state.exit_payload,
                "steps": [last, shift],
                "seq": state.seq,
                "last_key": list(state.last_key),
                "last_rows": state.last_rows,
                "globs": list(state.globs),
                "named": sorted(state.named),
                "spool": None if spool is None else str(spool),
            }
        pending = merge.pending
        spool = self._spools.state()
        return {
            **self._rounds_state(),
            "others_sent": list(self._others_sent),
            "readers": self._readers.positions(),
            "ranks": ranks,
            "pending": {
                "steps": pending.steps.tolist(),
                "ranks": pending.ranks.tolist(),
                "labelled": pending.labelled.tolist(),
                "names": [list(names_of(n)) for n in pending.names.tolist()],
                "reserved": pending.reserved.tolist(),
            },
            "events": [[list(key), event] for key, event in merge.events],
            "seen": sorted(merge.seen),
            "across": [statistics.state() for statistics in merge.across],
            "spool": {**spool, "writers": {str(p): w for p, w in spool["writers"].items()}},
        }

    def sync(self) -> None:
        """Make the spool's bytes durable (before a `state()` of them is saved)."""
        self._spools.sync()

    def _restore(self, saved: dict) -> None:
        """Set the merge (made for the same target and options) to `saved` (`state()`)."""
        merge = self.merge
        if set(saved["ranks"]) != set(merge.states) or len(saved["across"]) != len(merge.across):
            raise ValueError("other ranks or options than the saved state's")
        for statistics, kept in zip(merge.across, saved["across"], strict=True):
            statistics.restore(kept)  # (in the order of the options: refused if not theirs)
        for rank, state in merge.states.items():
            kept = saved["ranks"][rank]
            for raw in kept["known"]:
                state.keys.learn(raw)
            for out, value in kept["summary"]:
                pb.SummaryItem.FromString(out + value)  # (DecodeError: not one)
            state.summary.update((out, value) for out, value in kept["summary"])
            if kept["exit"] is not None:
                saved_record(kept["exit"], "exit")
            state.exit_payload = kept["exit"]
            state.steps = Steps.at(*kept["steps"])
            state.seq, state.last_rows = kept["seq"], kept["last_rows"]
            state.last_key = _checked_last_key(rank, kept, state.last_key)
            for payload in kept["globs"]:
                saved_record(payload, "metric")
            state.globs, state.named = list(kept["globs"]), set(kept["named"])
        merge.table = KeyTable([state.keys for state in merge.states.values()])
        pending = saved["pending"]
        objects = []
        for column in (pending["labelled"], pending["reserved"]):
            array = np.empty(len(column), object)
            array[:] = column
            objects.append(array)
        merge.pending = Rows(
            np.array(pending["steps"], np.int64),
            np.array(pending["ranks"], np.int64),
            objects[0],
            np.array([name_id(tuple(n)) for n in pending["names"]], np.int64),
            objects[1],
        )
        if not len(set(map(len, (merge.pending.steps, merge.pending.ranks, *objects)))) == 1:
            raise ValueError("rows held back of unequal columns")
        if not set(merge.pending.ranks.tolist()) <= set(merge.states):
            raise ValueError("rows held back of a rank not merged")
        for step, rank in zip(
            merge.pending.steps.tolist(), merge.pending.ranks.tolist(), strict=True
        ):
            if step > merge.states[rank].steps.last:
                raise ValueError(f"rank {rank}: a row held back past its last step read")
        merge.events = [(tuple(key), event) for key, event in saved["events"]]
        for key, event in merge.events:
            if len(key) != 4 or key[1] != 1 or key[2] not in merge.states:
                raise ValueError("a record held back at no place of its rank")
            if key > merge.states[key[2]].last_key:
                raise ValueError("a record held back past where its rank was read")
            saved_record(event)
        for payload in [*saved["seen"], *saved["others_sent"]]:
            saved_record(payload)
        merge.remember(saved["seen"])
        self._restore_rounds(saved)
        self._others_sent = list(saved["others_sent"])

    def close(self) -> None:
        self._spools.close()

    def _stage(
        self, out_dir: Path, watermark: int | None, server_rows: int, final: bool
    ) -> tuple[Staged, StagedContent | None] | Fallback:
        """`stage` for a shared merge: the ranks' new records merged up to `watermark`;
        the last round's (`final`) ends as `SharedMerge.run` ends a one-shot merge."""
        target = self.target
        self.rounds += 1
        allow_open_files(len(target.sources) + 1)
        run_dir = new_run_dir(target, out_dir)
        try:
            staged, self.merge.file_map = staged_with_files(
                target, run_dir, self.options.files_from
            )
            self._readers.begin_round()
            read_before = self._readers.bytes_read
            # (rows to the watermark, and records after)
            cap = None if watermark is None or final else (watermark, 2)
            merge = self.merge
            readers = (
                self._readers if self._expected is None else _Folded(self._readers, self._expected)
            )
            merge.take_turns(readers, self._spools, self._readers.open_ranks, cap)
            self.bytes_read = self._readers.bytes_read - read_before
            if final and (self._readers.open_ranks() or len(merge.pending) or merge.events):
                raise NotIncremental("a rank's log is not read to its exit record")
            written = self._recorder.items
            self._recorder.items = []
            arranged = self._arrange(written, bool(len(merge.pending)), server_rows, final)
            if isinstance(arranged, Fallback):
                shutil.rmtree(run_dir, ignore_errors=True)
                return arranged
            written, held = arranged
            with open(staged.log_path, "xb") as stream, LogWriter(stream) as writer:
                for payload in [*self._head, *self._others_sent]:
                    writer.write(payload)
                for _, payload in written:
                    writer.write(payload)
                for payload in self.merge.glob_definitions():
                    writer.write(payload)
                write_console_and_stats(merge.by_rank, writer, self._spools)
                config = merge.config_record() if final else None
                if config is not None:  # (the other ranks' config: a one-shot merge's end)
                    writer.write(config)
                writer.write(merge.summary_record())
                code = exit_code(merge.states[merge.primary].exit_payload) if final else None
                writer.write(running_exit_record() if code is None else exit_record(code))
                staged.records = writer.records
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        staged.metrics, staged.bound_notice = self.merge.metrics()
        if final:
            assert code is not None
            staged.exit_code = code
            for rank, sources in merge.by_rank.items():  # (as a one-shot merge says them)
                for index in range(len(sources)):
                    staged.warnings += merge.warnings.get((rank, index), [])
        return staged, self._finish(staged.log_path, written, held, final)

    def _keep(self, kept: object) -> None:
        self._others_sent += kept  # type: ignore[arg-type]

    def sent_others(self) -> list[bytes]:
        return self._others_sent

    def sent_summary(self) -> dict:
        return folded([saved_record(self.merge.summary_record()).summary])

"""One round of a follow: what every rank wrote since the last round, merged and appended to
the target runs, exactly once.

A round reads the paths again (ranks and restarts that started since join their targets),
plans the jobs as a one-shot sync does, and for every target whose files changed stages it
from what is readable now, keeps only its final rows (`cut`), and uploads it with the same
`Deliverer` as `wbmerge sync`: the server is asked what it holds and only the rest is sent,
so a row goes out once however many rounds stage it. A target whose ranks have all finished
is staged with its real exit record (by its kept merge, or whole) and checked against the
ranks' logs: its run gets its final state, and it is recorded in the ledger as a one-shot
sync records it, so that a `wbmerge sync` afterwards finds it synced. Until then the ledger
is not touched.

Every round reads back the rows it sent, the last one too. The rows that an earlier round
of this process read back are not read again: the server's line count, which must equal
the rows sent, covers them, and what is read starts after their last step. A follower
started again proves every row once more in its last round (its rounds before it skip the
rows the saved state says were sent and verified).

A shared or pass-through target's merge kept between rounds (`incremental`, `passlive`) is
saved in the state directory after each verified round (`saved`), so that a follower
started again goes on from it; a saved state that does not fit the files or the server, or
a kept merge that cannot go on, is a `Fallback`: `Follower.fall_back` drops the kept
merge, says its one line, and the round merges the target from scratch.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from google.protobuf.message import DecodeError

from .. import merge  # (stage is called as merge.stage: the seam a test stands a broken merge in)
from ..errors import WbmergeError
from ..identify import Job, make_hints
from ..merge import Staged, check_key_format
from ..plan import Target, app_url, check_destination
from ..runtime import one_malloc_arena
from ..sync import MergeRequest, PlannedJob, UploadSession, delivery_of, plan_found
from ..upload import (
    Delivery,
    Ledger,
    ServerError,
    state_dir,
)
from ..verify import same_value
from ..wandbcore import StagedContent
from . import saved
from .cut import cut_live
from .fallback import (
    LAST_ROUND,
    NOT_KEPT,
    NOT_YET,
    UNVERIFIED,
    Fallback,
    no_saved_state,
    restarted,
    saved_misfit,
)
from .incremental import LiveShared, NotIncremental, sources_of
from .live import Progress, find_live_runs, finished, progress, signature, watermark
from .passlive import LivePassthrough
from .tails import ScannedLog

RESTART_GRACE = 60.0  # seconds (see `Follower`)
# What a saved state of the right types but wrong values raises when it is taken up, or
# in the first round that goes on from it: it does not fit, and the round merges from
# scratch (a value the checks did not foresee must not end the follow).
SAVED_MISFITS = (ValueError, LookupError, TypeError, AttributeError, OverflowError, DecodeError)
# The targets merged a round at a time, by kind: what keeps them, and its saved state's shape
# (`auto` with every rank's system metrics, "auto+system", is merged from scratch).
_KEPT: dict[str, tuple[type, object]] = {
    "shared": (LiveShared, saved.STATE),
    "passthrough": (LivePassthrough, saved.PASSTHROUGH),
}


@dataclass
class TargetRound:
    """What one round did for one target run."""

    run_id: str
    status: str  # "sent" | "unchanged" | "failed"
    rows: int = 0  # history rows on the server after the round
    added: int = 0  # of which this round added
    final: bool = False  # sent with its exit record: the run has its final state
    exit_code: int | None = None  # the final exit code, when final
    problems: list[str] = field(default_factory=list)
    # merged only what the ranks wrote since the last round, by the merge kept from it
    # (in this process, or saved by a follower before it)
    continued: bool = False
    # bytes of the ranks' logs the round's merge read: when continued, what was written
    # since the last round (from the block where that one stopped); else the whole logs
    bytes_read: int = 0


@dataclass
class RoundReport:
    number: int
    targets: list[TargetRound] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # what the round could not read yet
    warnings: list[str] = field(default_factory=list)  # each said once in a follow
    changed: bool = False  # some file changed since the last round
    # bytes of the logs read to count the ranks' steps and exit records: of a log counted
    # before (in this process, or by a follower before it), only what was written since
    bytes_scanned: int = 0
    started: bool = False  # some run file exists under the paths
    done: bool = False  # every rank of every job finished, every run final and verified


@dataclass
class _Known:
    """What the follower remembers of one target between rounds."""

    key: str
    signature: tuple | None = None  # of the files last sent whole and verified
    rows: int | None = None  # history rows on the server
    final: bool = False  # verified with its exit record
    exit_code: int | None = None  # the exit code it was finished with
    finished_seen: tuple | None = None  # the signature when every rank was first seen done
    finished_at: float = 0.0  # when (time.monotonic()) it was first seen so
    over_bound_said: bool = False  # its metric count passed W&B's bound, and it was said
    # The steps of the first rows of the run that this process read back after its own
    # verified uploads (`Delivery.steps_checked`): a later round reads back only the rows
    # after them. Kept in memory only, so a follower started again reads every row back.
    proven: Sequence[int] = ()

    def unchanged(self, run_id: str) -> TargetRound:
        return TargetRound(
            run_id, "unchanged", self.rows or 0, final=self.final, exit_code=self.exit_code
        )


class Follower:
    """Rounds of a follow over one set of paths; `close()` (or `with`) releases everything."""

    def __init__(
        self,
        request: MergeRequest,
        parallel: int = 4,
        timeout: float = 300.0,
        on_wait: Callable[[str], None] | None = None,
        job_prefix: str | None = None,
        restart_grace: float = RESTART_GRACE,
    ) -> None:
        """`job_prefix`: follow only the jobs whose id starts with it (those of one Flyte
        run, whose job ids are `{run name}-{action}`), among others under the paths.
        `restart_grace`: seconds a run whose ranks all ended, some failed, waits for an
        elastic restart (with no file changed) before it is sent with its final state."""
        check_key_format(request.key_format)
        one_malloc_arena()  # (a follow runs for days: its memory must not creep up)
        self.request, self.job_prefix = request, job_prefix
        self.restart_grace = restart_grace
        self.hints = make_hints(request.label_pattern, request.ranks_file, request.primary)
        self.on_wait = on_wait
        self.uploads = UploadSession(
            parallel, timeout, every_value=request.verify == "full", kind="follow"
        )
        self._locks = ExitStack()
        self.known: dict[str, _Known] = {}
        self._scans: dict[Path, tuple] = {}
        self._sizes: dict[Path, tuple[int, int]] | None = None
        self.number = 0
        self.planned: list[PlannedJob] = []
        self._said: set[str] = set()  # warnings given in earlier rounds
        # targets merged a round at a time (`incremental`, `passlive`), and those staged so now
        self._live: dict[str, LiveShared | LivePassthrough] = {}
        self._staged_live: set[str] = set()
        self._live_made = 0  # (each merge's scratch directory is named by its number)
        self._saved_at: dict[str, tuple[Path, str]] = {}  # run id -> (`saved` place, made for)
        # how far a follower before this one counted each log (`saved.SCANS`), by path,
        # taken up when the log is found (so only the logs under the paths are read)
        follows = json.dumps([[str(p) for p in request.paths], request.job, job_prefix])
        self._scans_at = saved.directory(state_dir(), f"scans|{follows}")
        self._scans_made = saved.made_for(f"scans|{follows}", {}, ())
        try:
            found = saved.load(self._scans_at, self._scans_made, saved.SCANS_FILE, saved.SCANS)
        except (saved.Unusable, OSError):
            found = None  # (a shortcut only: each log is counted from its start, as at first)
        self._saved_scans: dict[str, dict] = found or {}
        self._bytes_read: dict[str, int] = {}  # run id -> the bytes its staging read

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the runs' locks, the ledger, the server's connections and the staging."""
        for run_id in list(self._live):
            self._drop_live(run_id)
        # (the runs are released on the server first: a sync waiting for a local lock then
        # finds them free, not held by a follow, which it would not wait for)
        self.uploads.close()
        self._locks.close()

    def round(self) -> RoundReport:
        """Read, merge and upload what the ranks wrote since the last round."""
        self.number += 1
        report = RoundReport(self.number)
        self._bytes_read.clear()
        live = find_live_runs(self.request.paths, self.hints, self.request.job, self.job_prefix)
        report.changed = live.sizes != self._sizes
        report.started = bool(live.sizes)
        self._sizes = live.sizes
        report.waiting += [f"{path.parent.name}: nothing on disk yet" for path in live.waiting]
        report.warnings += live.notes
        workdir = self.uploads.staging / f"round-{self.number}"
        todo: dict[tuple[str, str | None], list[tuple[Target, Delivery, tuple, int | None]]] = {}
        all_done = bool(live.jobs) and not live.waiting
        planned = []
        try:
            for job in live.jobs:
                try:
                    (plan,) = plan_found(self.request, [job])
                except WbmergeError as exc:  # the primary rank has not started, or is a guess
                    said, named = str(exc), f"job {job.job_id}: "
                    report.waiting.append(said if said.startswith(named) else named + said)
                    all_done = False
                    continue
                check_destination(plan.project, plan.entity)
                planned.append(plan)
                report.warnings += plan.warnings  # what was assumed about its ranks
                self._resume_scans(job)
                scanned = self._scanned()
                ranks = progress(job, live.sizes, self._scans)
                report.bytes_scanned += self._scanned_since(scanned)
                all_done &= _job_finished(job, ranks)
                for target in plan.targets:
                    entry = self._target_round(plan, target, ranks, workdir, report)
                    if entry is not None:
                        entity = self.uploads.entity(plan.entity)
                        todo.setdefault((plan.project, entity), []).append(entry)
            self.planned = planned
            for (project, entity), entries in todo.items():
                self._deliver(project, entity, entries, workdir, report)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        report.warnings = [w for w in dict.fromkeys(report.warnings) if w not in self._said]
        self._said.update(report.warnings)
        order = {t.id: i for plan in planned for i, t in enumerate(plan.targets)}
        report.targets.sort(key=lambda t: order.get(t.run_id, len(order)))
        report.done = all_done and all(
            self.known[t.id].final for plan in planned for t in plan.targets
        )
        if report.done:
            saved.remove(self._scans_at)
        elif report.changed:
            self._save_scans()
        return report

    def _resume_scans(self, job: Job) -> None:
        """Count the job's logs on from where a follower before this one stopped, those
        that go on from it (the others are counted from their start)."""
        for run in job.runs:
            state = self._saved_scans.pop(str(run.path), None)
            if state is None or run.path in self._scans:
                continue
            try:
                scanned = ScannedLog.resumed(run.path, state)
            except (NotIncremental, ValueError):
                continue
            self._scans[run.path] = ((-1, -1), scanned.stats, scanned)  # (read on next look)

    def _scanned(self) -> dict[Path, tuple[ScannedLog, int]]:
        return {path: (e[2], e[2].bytes_read) for path, e in self._scans.items() if e[2]}

    def _scanned_since(self, before: dict[Path, tuple[ScannedLog, int]]) -> int:
        """The bytes the logs' counts read since `before` (`_scanned()`)."""
        total = 0
        for path, (scanned, read) in self._scanned().items():
            was = before.get(path)
            total += read - was[1] if was is not None and was[0] is scanned else read
        return total

    def _save_scans(self) -> None:
        """Save how far each log was counted (`saved.SCANS`), for a follower started again."""
        scans = {str(path): scanned.state() for path, (scanned, _) in self._scanned().items()}
        try:
            saved.save(self._scans_at, self._scans_made, scans, saved.SCANS_FILE, saved.SCANS)
        except OSError:
            saved.discard(self._scans_at, saved.SCANS_FILE)  # (the next counts all)

    def _target_round(
        self,
        plan: PlannedJob,
        target: Target,
        ranks: dict[int, Progress],
        workdir: Path,
        report: RoundReport,
    ) -> tuple[Target, Delivery, tuple, int | None] | None:
        """Stage one target if it changed; None when there is nothing to send."""
        assert plan.project
        entity = self.uploads.entity(plan.entity)
        known = self.known.get(target.id)
        if known is None:
            key = self.uploads.key(entity, plan.project, target)
            self._locks.enter_context(self.uploads.locks([key], self.on_wait))
            known = self.known[target.id] = _Known(key)
        if known.final:
            report.targets.append(known.unchanged(target.id))
            return None
        now = signature(target, self._sizes or {})
        done = finished(target, ranks)
        settings = plan.ledger_settings(self.request)
        if done and self.uploads.ledger.synced(known.key, Ledger.fingerprint(target, settings)):
            known.final, known.signature = True, now
            known.exit_code = ranks[target.primary_rank].exit_code  # the staged run's
            report.targets.append(known.unchanged(target.id))
            return None
        codes = [ranks[r].exit_code for r in ranks if r in {s.rank.rank for s in target.sources}]
        if done and any(codes):
            # A rank that failed may be restarted (torch elastic stops the other ranks and
            # starts them again, which takes seconds): wait `restart_grace` with no change.
            if known.finished_seen != now:
                known.finished_seen, known.finished_at = now, time.monotonic()
            done = time.monotonic() - known.finished_at >= self.restart_grace
        if not done and known.signature == now:
            report.targets.append(known.unchanged(target.id))
            return None
        fingerprint = Ledger.fingerprint(target, settings)
        staged, content = None, None
        if target.kind in _KEPT and (not done or self._ends_kept(target)):
            server_rows = self._server_rows(known, entity, plan.project, target.id)
            found = self._stage_live(
                plan, target, ranks, workdir, server_rows, known, report, final=done
            )
        else:
            found = LAST_ROUND if done else NOT_KEPT
        if isinstance(found, Fallback):
            self.fall_back(target.id, found, report)
        else:
            staged, content = found
        if staged is None:
            self._bytes_read[target.id] = sum(_size(s.path) for s in target.sources)
        try:
            options = replace(plan.options(self.request), live=not done)
            staged = staged or merge.stage(target, workdir / "runs", options)
        except WbmergeError as exc:
            if done:
                raise  # the files are whole: bad input, as for a one-shot sync
            # a file of a rank's run went away or changed while it was copied: next round
            report.targets.append(
                TargetRound(target.id, "failed", known.rows or 0, problems=[str(exc)])
            )
            return None
        if staged.bound_notice and not known.over_bound_said:  # once (its count grows)
            known.over_bound_said = True
            report.warnings.append(staged.bound_notice)
        if done:  # what a one-shot sync says of these runs (of a live one it would mislead)
            report.warnings += [f"{target.id}: {w}" for w in staged.warnings]
        elif target.id in self._staged_live:
            pass  # (cut at the watermark as it was merged, its last row held back)
        else:
            cut = staged.log_path.with_name(staged.log_path.name + ".cut")
            server_rows = self._server_rows(known, entity, plan.project, target.id)
            live_cut = cut_live(staged.log_path, cut, watermark(target, ranks), server_rows)
            cut.replace(staged.log_path)
            if live_cut.sent_early(server_rows):
                known.rows = None  # (asked again next round: the run may have been deleted)
                known.proven = ()
                problem = (
                    f"the server holds {server_rows} history rows, past the "
                    f"{live_cut.rows_sent} that every rank has logged (another sync sent them "
                    "during training?); they are checked once every rank has logged them"
                )
                report.targets.append(
                    TargetRound(target.id, "failed", server_rows, problems=[problem])
                )
                return None
        # (a live round's sources grow past what it staged: only the last is checked whole)
        options = plan.options(self.request) if done else None
        delivery = delivery_of(target, staged, known.key, fingerprint, options, final=done)
        if done and target.id in self._staged_live:  # (its rows sent: counted when staged)
            delivery.source_check = partial(self._live[target.id].source_shortfall, staged.log_path)
        if content is not None:  # (a log that continues the rounds sent: `incremental`)
            live = self._live[target.id]
            delivery.content, delivery.rows_cut = content, live.rows_sent
            delivery.row_before = live.row_before
            if not done:  # (the rows the rounds sent, some maybe by a follower before this one)
                delivery.steps_checked = content.history_steps[: live.rows_sent]
        if done or content is None:
            # Only the rows after those this process read back are read (the last round's
            # too): the line count, which must equal the rows sent, covers the rest.
            delivery.steps_checked = known.proven
        return target, delivery, now, staged.exit_code if done else None

    def _ends_kept(self, target: Target) -> bool:
        """Whether a target's last round goes on from its kept merge: one made in this
        process for the same sources, which counted the rows it sent (`LiveShared`,
        `LivePassthrough`)."""
        live = self._live.get(target.id)
        return live is not None and live.can_end and live.made_of == sources_of(target)

    def _stage_live(
        self,
        plan: PlannedJob,
        target: Target,
        ranks: dict[int, Progress],
        workdir: Path,
        server_rows: int,
        known: _Known,
        report: RoundReport,
        final: bool = False,
    ) -> tuple[Staged, StagedContent | None] | Fallback:
        """Stage a target's round from its merge kept since the last round (made now if
        there is none, or if its sources changed: from the state a follower before this one
        saved, when it fits); a Fallback when that merge cannot go on (the caller acts on
        it). Errors of the files and of a saved state are turned into one here. `final`:
        the last round, from the kept merge only (`_ends_kept`)."""
        self._staged_live.discard(target.id)
        live = self._live.get(target.id)
        if live is not None and live.made_of != sources_of(target):
            self.fall_back(target.id, restarted(), report)  # (and a new merge, below)
            live = None
        if final and live is None:
            return LAST_ROUND
        found: tuple[Staged, StagedContent | None] | Fallback
        resumed = False
        try:
            if live is None:
                live, resumed = self._make_live(plan, target, known, server_rows, report)
                if resumed and server_rows == live.rows_sent:  # (else the stage says it)
                    assert plan.project
                    self._check_on_server(
                        live, self.uploads.entity(plan.entity), plan.project, target.id
                    )
            found = live.stage(workdir / "runs", watermark(target, ranks), server_rows, final)
            self._bytes_read[target.id] = live.bytes_read
        except (NotIncremental, WbmergeError, OSError) as exc:
            found = Fallback(str(exc))
        except SAVED_MISFITS as exc:  # (a saved state that passed its checks, yet does not fit)
            if not resumed:
                raise
            found = Fallback(str(exc) or type(exc).__name__)
        if isinstance(found, Fallback):
            if resumed and found != NOT_YET:
                found = self._misfit(target.id, found.reason)
            return found
        self._staged_live.add(target.id)
        return found

    def _make_live(
        self,
        plan: PlannedJob,
        target: Target,
        known: _Known,
        server_rows: int,
        report: RoundReport,
    ) -> tuple[LiveShared | LivePassthrough, bool]:
        """A target's merge to go on with: from its saved state when there is one that
        fits (and then True), else a new one (whose saved state is removed first: its spool
        is made anew; a state that does not fit is a fallback, said). Raises
        NotIncremental, OSError (a new one's spool)."""
        settings = plan.ledger_settings(self.request)
        place = saved.directory(state_dir(), known.key)
        made = saved.made_for(known.key, settings, sources_of(target))
        first = target.id not in self._saved_at  # (later, this follower removed its state)
        self._saved_at[target.id] = (place, made)
        scratch = self.uploads.staging / "live" / str(self._live_made)
        self._live_made += 1
        options = plan.options(self.request)
        spool = place / saved.SPOOL_FILE
        kind, shape = _KEPT[target.kind]
        try:
            state = saved.load(place, made, shape=shape)
            if state is not None:
                live = self._live[target.id] = kind(target, options, scratch, spool, state)
                return live, True
            if server_rows and first:  # (rows sent: by a follower whose state is lost, a sync)
                self.fall_back(target.id, no_saved_state(), report)
        except saved.Unusable as exc:  # (damaged, or made for other files: its own words)
            self.fall_back(target.id, Fallback(str(exc)), report)
        except (NotIncremental, OSError, *SAVED_MISFITS) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.fall_back(target.id, self._misfit(target.id, why or type(exc).__name__), report)
        saved.discard(place)
        place.mkdir(parents=True, exist_ok=True)
        live = self._live[target.id] = kind(target, options, scratch, spool)
        return live, False

    def _say_waiting(self, run_id: str, line: str) -> None:
        """A run another sync holds on the server is waited for: said as for a sync that
        holds its lock here (`on_wait`)."""
        known = self.known.get(run_id)
        if self.on_wait is not None and known is not None:
            self.on_wait(known.key)

    def _check_on_server(
        self, live: LiveShared | LivePassthrough, entity: str | None, project: str, run_id: str
    ) -> None:
        """ValueError unless the server holds what a saved state says the rounds sent: its
        last row, the config its records other than rows set, and its summary."""
        held = self.uploads.client.held(entity, project, run_id)
        if live.rows_sent and (
            held.last_step != live.last_step_sent
            or held.last_row is None
            or not same_value({**(live.row_before or {}), "_step": held.last_step}, held.last_row)
        ):
            raise ValueError(
                f"the server's row {live.rows_sent} is not the last row it says was sent"
            )
        config = {
            key: entry["value"] if isinstance(entry, dict) and "value" in entry else entry
            for key, entry in _json_object(held.config_json).items()
        }
        summary = _json_object(held.summary_json)
        for what, sent, there in (
            ("config", live.sent_config(), config),
            ("summary", live.sent_summary(), summary),
        ):
            for key, value in sent.items():
                if not key.startswith("_") and not (key in there and same_value(value, there[key])):
                    raise ValueError(f"the server's {what} {key!r} is not what it says was sent")

    def _misfit(self, run_id: str, why: str) -> Fallback:
        """The fallback of a saved state that does not fit, naming its file."""
        return saved_misfit(self._saved_at[run_id][0] / saved.STATE_FILE, why)

    def fall_back(self, run_id: str, fallback: Fallback, report: RoundReport) -> None:
        """Act on a round's fallback, the one place that does: drop the target's kept merge
        (and its saved state, unless the fallback keeps it) and say the fallback's line
        when it is said. The round then merges the target from scratch: a one-shot merge
        of its files, or a kept merge made anew."""
        self._drop_live(run_id, forget=fallback.forget)
        if fallback.said:
            report.warnings.append(fallback.line(run_id))

    def _drop_live(self, run_id: str, forget: bool = False) -> None:
        """Let go of a target's merge; `forget`: also of its saved state (it went wrong, and
        a follower started again must not go on from it)."""
        self._staged_live.discard(run_id)
        live = self._live.pop(run_id, None)
        if live is not None:
            live.close()
        if forget and run_id in self._saved_at:
            saved.discard(self._saved_at[run_id][0])

    def _save_live(
        self, run_id: str, live: LiveShared | LivePassthrough, report: RoundReport
    ) -> None:
        """Save a target's merge after a verified round (`saved`); a state that cannot be
        saved is said, and removed (a follower started again merges from scratch)."""
        place, made = self._saved_at[run_id]
        try:
            live.sync()
            saved.save(place, made, live.state(), shape=_KEPT[live.target.kind][1])
        except OSError as exc:
            saved.discard(place)
            report.warnings.append(
                f"{run_id}: the follow's state could not be saved in "
                f"{place} ({exc.strerror or exc}); a follower started "
                "again merges this run from scratch"
            )

    def _deliver(
        self,
        project: str,
        entity: str | None,
        entries: list[tuple[Target, Delivery, tuple, int | None]],
        workdir: Path,
        report: RoundReport,
    ) -> None:
        """Upload one project's staged targets in one `wandb sync`; record the final ones."""
        for target, _, _, _ in entries:
            self._server_rows(self.known[target.id], entity, project, target.id)
        uploader = workdir / f"uploader-{len(report.targets)}"
        deliverer = self.uploads.deliverer(
            project, entity, uploader, progress=False, say_waiting=self._say_waiting
        )
        try:
            deliverer.deliver([d for _, d, _, _ in entries])
        except ServerError as exc:
            for _, delivery, _, _ in entries:
                delivery.problems.append(str(exc))
        finally:
            deliverer.stop()
        for target, delivery, now, code in entries:
            known = self.known[target.id]
            report.warnings += [f"{target.id}: {w}" for w in delivery.warnings]
            if delivery.unrecorded:  # (a ledger that cannot record would fail every round)
                raise WbmergeError(f"run {target.id}: {'; '.join(delivery.problems)}", 1)
            if not delivery.verified:
                report.targets.append(
                    TargetRound(target.id, "failed", known.rows or 0, problems=delivery.problems)
                )
                known.rows = None  # (what the server holds now is asked again next round)
                known.proven = ()  # (and every row read back)
                self.fall_back(target.id, UNVERIFIED, report)
                continue
            assert delivery.content is not None
            rows = len(delivery.content.step_items)
            if _begins(known.proven, delivery.steps_checked):
                # (the read-back skipped only rows this process proved before, or none)
                known.proven = delivery.content.history_steps
            continued = False
            if target.id in self._staged_live and not delivery.final:
                live = self._live[target.id]
                continued = live.rounds > 1
                live.sent(delivery.content)
                self._save_live(target.id, live, report)
            elif delivery.final:
                continued = target.id in self._staged_live
                self._drop_live(target.id)
                saved.remove(saved.directory(state_dir(), known.key))
            added = rows - (known.rows or 0)
            known.rows, known.final, known.exit_code = rows, delivery.final, code
            known.signature = now
            report.targets.append(
                TargetRound(
                    target.id,
                    "sent",
                    rows,
                    added,
                    delivery.final,
                    code,
                    continued=continued,
                    bytes_read=self._bytes_read.pop(target.id, 0),
                )
            )

    def _server_rows(self, known: _Known, entity: str | None, project: str, run_id: str) -> int:
        """The history rows the server holds of a target: asked in the first round that
        stages it (a run may hold rows from before this follow) and after a failed upload,
        else as the last verified upload left it."""
        if known.rows is None:
            try:
                known.rows = self.uploads.client.held(entity, project, run_id).history_lines
            except ServerError:
                return 0  # (asked again next time; the upload asks for itself anyway)
        return known.rows

    def links(self) -> list[dict]:
        """The runs' (or, for `new`, the groups') links, as `sync` gives them."""
        from ..plan import links

        url = app_url(self.uploads.credentials.base_url)
        found = []
        for plan in self.planned:
            entity = self.uploads.entity(plan.entity)
            if entity and plan.project:
                found += links(plan.targets, url, entity, plan.project, plan.run_mode)
        return found

    def unfinished(self) -> list[str]:
        """The ranks that have not finished (or not started), one phrase per job."""
        phrases = []
        for plan in self.planned:
            ranks = progress(plan.job, self._sizes or {}, self._scans)
            open_ranks = _open_ranks(plan.job, ranks)
            if open_ranks:
                phrases.append(f"job {plan.job.job_id}: rank(s) {', '.join(map(str, open_ranks))}")
        return phrases

    def saved_places(self) -> list[Path]:
        """Where the runs followed keep their merge (`saved`), whether or not they have one,
        and where the follower keeps how far it counted the logs."""
        runs = [saved.directory(state_dir(), known.key) for known in self.known.values()]
        return [*runs, self._scans_at]

    def release(self) -> None:
        """Let other syncs take the runs' locks (the last, one-shot sync needs them)."""
        self._locks.close()
        self._locks = ExitStack()


def _begins(steps: Sequence[int], first: Sequence[int]) -> bool:
    """Whether `steps` begins with `first`."""
    return len(first) <= len(steps) and steps[: len(first)] == first


def _json_object(text: str) -> dict:
    """The server's JSON object `text`; {} for anything else."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _job_finished(job: Job, ranks: dict[int, Progress]) -> bool:
    """Every rank of the job's world has started and written its exit record."""
    return not _open_ranks(job, ranks)


def _open_ranks(job: Job, ranks: dict[int, Progress]) -> list[int]:
    """The ranks of the job's world (as recorded, or as found) not started or not finished."""
    world = max(job.world_size, max(ranks, default=-1) + 1)
    return [rank for rank in range(world) if rank not in ranks or not ranks[rank].finished]

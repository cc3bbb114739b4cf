"""Exactly once: send staged runs so that the server ends with each of them whole, uploading
the first runs while the rest are still being staged.

For every run: ask the server what it holds, send only the remainder through `wandb sync`,
then read back what it holds and compare with what was staged. A run is recorded in the
ledger the moment it is verified, so an interruption keeps what completed; a run that is
short, or whose files failed to upload, is reported and not recorded, and a rerun sends
what is still missing.

Runs are handed over one at a time (`submit`) as they are staged; the server is asked
about each in a few threads of their own, while the next runs are staged; and ready runs go
out in batches, each one `wandb sync` process, started as soon as upload slots are free
(`batches` says how many runs each takes).
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import WbmergeError
from ..upload import (
    DEFAULT_TIMEOUT,
    Claims,
    Credentials,
    Delivery,
    DeliveryReport,
    Held,
    Ledger,
    OtherWriter,
    OwnerRecord,
    Progress,
    Relay,
    ServerClient,
    ServerError,
    Uploader,
    UploadSlots,
    batch_lanes,
    batch_size,
    runs_to_ask,
    wait_settled,
)
from ..verify import (
    AFTER_UPLOAD,
    COUNTS_LAG,
    COUNTS_LATE,
    WHOLE,
    Mismatch,
    RowsLost,
    RunOnServer,
    checked_config_keys,
    counts,
    counts_behind,
    counts_caught_up,
    history_row,
    keeps_no_config,
    lacking_line,
    not_a_beginning,
    prove,
    remainder,
    resend_whole,
    sends_no_row,
    shortfall,
    with_last_row,
    write_remainder,
)
from ..wandbcore import StagedContent, read_staged

# Runs of one batch checked at once after their upload: one at a time, the checks of 256
# small runs fell 2 s behind the upload (each waits on a server busy with the upload).
VERIFIERS = 4
# Runs asked about at once before their upload. Asked one after another, 256 runs waited
# 256 round trips before any was sent: 12.8 s of a 27 s sync against a server 50 ms away
# (bench_sync_e2e.py --latency 0.05; plain `wandb sync` took 13.5 s).
PREPARERS = 8
# While a batch uploads, `PROBED` of its unfinished runs (`runs_to_ask`) are asked how far
# they are every `PROBE_EVERY` seconds: 4 questions a second at most, however large the
# batch. An upload counts as stuck only after --timeout (300 s) in which neither its output
# nor any answer moved.
PROBED = 4
PROBE_EVERY = 1.0
STOP_WAIT = 2.0  # seconds stop() waits for runs being asked about before it returns
_JOIN = 60.0  # seconds to wait for an uploader thread after its process was stopped


class Deliverer:
    """Delivers the staged runs of one project, exactly once, verified, while they come.

    `submit` each run as it is staged (`expected` of them), then `finish()`; `stop()` ends
    every upload at once (Ctrl-C). One of the two ends every deliverer: its threads wait
    for them. With `remove_verified`, a run's staged directory is removed as soon as the
    run is verified, so staging holds only runs still to send.
    """

    def __init__(
        self,
        client: ServerClient,
        credentials: Credentials,
        ledger: Ledger,
        project: str,
        entity: str | None,
        parallel: int,
        workdir: Path,
        timeout: float = DEFAULT_TIMEOUT,
        progress: Callable[[Progress], None] | None = None,
        staging: OwnerRecord | None = None,
        slots: UploadSlots | None = None,
        claims: Claims | None = None,
        say_waiting: Callable[[str, str], None] | None = None,
        expected: int = 0,
        remove_verified: bool = False,
        every_value: bool = False,
        resend: bool = False,
        release_verified: bool = False,
    ) -> None:
        """`resend`: send each run the server holds rows of whole again, from its first
        row, over what the server holds (`wbmerge sync --resend`, the way out of a run
        refused as not a beginning, or of rows lost inside it). `claims`: the session's
        hold on the runs it sends (None: no other writer is kept out); `say_waiting(run_id,
        line)` is told that a run waits for another writer (else the progress callback).
        `release_verified`: give back each run's claim once it is verified whole (a sync
        sends it no more), not when the session ends."""
        self.client, self.ledger_path = client, ledger.path
        self.release_verified = release_verified
        self.resend = resend
        self.credentials, self.project, self.entity = credentials, project, entity
        self.workdir, self.timeout, self.owner = workdir, timeout, staging
        self.slots = slots or UploadSlots(parallel)
        self.claims, self.say_waiting = claims, say_waiting
        self.expected, self.remove_verified = expected, remove_verified
        self.every_value = every_value  # compare every row's values read back, not a sample
        self.progress = progress or (lambda p: None)
        self.lock = self.slots.changed  # one lock for the slots and all state below
        self.deliveries: list[Delivery] = []
        self._ready: list[tuple[Delivery, float]] = []  # with the time it became ready
        self._uploading: dict[str, Delivery] = {}  # in a batch, not yet finished
        self._preparing = 0  # handed over, the server still being asked what it holds
        self._to_prepare: queue.SimpleQueue[Delivery | None] = queue.SimpleQueue()
        self._stop_asked = threading.Event()  # ends the preparers' waits at once
        self._uploaders: list[Uploader] = []
        # The next batch's uploader, started ahead so that the batch skips wandb's start.
        self._standby: Uploader | None = None
        self._uploaders_made = 0
        self._threads: list[threading.Thread] = []
        self._sealed = self._stopping = self.timed_out = False
        self._error: BaseException | None = None
        self._done = 0
        self._settling_said = False  # (the wait after a stopped upload is said once)
        self._lag_said = False  # (and the wait for late line counts)
        # The entity the server answered it holds the runs under (`Held.entity`): the one
        # wandb-core used when none was given, for the links of the report.
        self._entity_seen: str | None = None
        self._rows: dict[str, int] = {}  # history rows the server holds, per run
        self._counts: dict[str, tuple[int, int, int]] = {}  # all its line counts, per run
        # The line counts each run had before its upload: a run being sent holds more.
        self._before: dict[str, tuple[int, int, int]] = {}
        self._asked_at: dict[str, float] = {}  # when each run was last asked how far it is
        # wandb-core sends through a relay that holds each run's lines to the offsets
        # planned here, so that another sync of the same runs rewrites them instead of
        # adding them again (see `relay`); the uploader of each run being sent, to stop it
        # when its lines cannot be placed.
        self.relay = Relay(credentials.base_url, self._cannot_place)
        self._uploader_of: dict[str, Uploader] = {}
        # Daemon threads: a Ctrl-C does not wait for a question to the server to end.
        for number in range(PREPARERS):
            threading.Thread(
                target=self._prepare_each, name=f"wbmerge-prepare-{number}", daemon=True
            ).start()
        self._dispatcher = threading.Thread(target=self._dispatch, daemon=True)
        self._dispatcher.start()
        self._stand_by()

    # -- the producer's side ----------------------------------------------------------------

    def prepare(self, delivery: Delivery) -> None:
        """Cut the staged log down to what the server lacks (raises Mismatch, ServerError);
        when it lacks nothing, set `delivery.held_already` instead: nothing is to be sent.

        What the staged log holds is counted here only when the server holds rows of the
        run already (to cut them off), or under `--force` (to find the run whole);
        otherwise the whole log goes, and it is counted while its upload starts
        (`_read_contents`), for the check after it. Counts are read only once a stopped
        upload's last requests have landed (see `settle`)."""
        wait_settled(self._stop_asked, self._say_settling)
        if self.given_up:
            return
        held = self._held_to_send(delivery.run_id)
        if held is None or self.given_up:
            return
        if held.history_lines and not self.resend:
            held = self._tail_caught_up(delivery, held)
        counts = (held.history_lines, held.events_lines, held.log_lines)
        with self.lock:  # (so the first question during the upload can see it move)
            self._before[delivery.run_id] = self._counts[delivery.run_id] = counts
            self._entity_seen = self._entity_seen or held.entity
        if delivery.row_before is not None and held.history_lines != delivery.rows_cut:
            raise Mismatch(
                f"the server holds {held.history_lines} history rows, not the "
                f"{delivery.rows_cut} the rounds before sent"
            )
        # Whatever is sent of the run continues at the rows held now (the remainder below
        # cuts exactly these), wherever wandb-core would begin; a run sent again whole
        # begins at its first row, and each line replaces the one at its place.
        resend = self.resend and held.exists and held.history_lines > 0
        self.relay.plan(delivery.run_id, 0 if resend else held.history_lines * held.exists)
        if resend:  # (each line replaces the one at its place: none may be left beyond)
            content = self._content(delivery)
            resend_whole(content, held, checked_config_keys(delivery, content))
            self._tell(f"sending {delivery.run_id} again whole, over the server's rows")
            return
        if not held.exists or not (held.history_lines or delivery.verified_before):
            if held.exists and delivery.config_checked:  # (its keys counted with the rest)
                keys = checked_config_keys(delivery, self._content(delivery))
                assert keys is not None  # (its config is checked)
                keeps_no_config(held, keys)
            return  # (nothing to cut, nor to find whole: counted while the upload starts)
        content = self._content(delivery)
        plan = remainder(content, held, lambda index: _staged_row(delivery, index))
        # (after the rows: a refusal names rows first, as they are likelier)
        if (keys := checked_config_keys(delivery, content)) is not None:
            keeps_no_config(held, keys)
        if plan.skip_history == len(content.step_items) and not shortfall(content, held):
            problems = prove(self._on_server(delivery, held, content), WHOLE)
            if delivery.refused:  # (rows lost inside the run: sending cannot fill them)
                raise RowsLost(problems)
            if not problems:
                delivery.held_already = True
                with self.lock:
                    self._rows[delivery.run_id] = held.history_lines
                return
            self._tell(f"sending {delivery.run_id} again: {'; '.join(problems)}")
        # Its rows are whole, the rest is not: the last row goes again, over itself, so that
        # the summary keeps its `_step` (a log cut already holds no row before the rest).
        last_again = with_last_row(content, plan) if delivery.row_before is None else plan
        if last_again != plan:
            plan = last_again
            self.relay.plan(delivery.run_id, plan.skip_history)
        if delivery.row_before is not None and plan.resteps:
            raise Mismatch("rows of a log cut already would be sent at other steps")
        if (warning := sends_no_row(content, plan)) and delivery.final:
            delivery.warnings.append(warning)
        if plan.resends and not self.given_up and delivery.row_before is None:
            # (a log cut already holds only the rest; after a stop, staging is being removed)
            cut = delivery.log.with_name(delivery.log.name + ".remainder")
            write_remainder(delivery.log, cut, plan)
            cut.replace(delivery.log)
            delivery.rows_cut = plan.skip_history

    def _held_to_send(self, run_id: str) -> Held | None:
        """What the server holds of a run, asked once this writer holds the run (None if
        the delivery was stopped while another writer held it)."""
        if self.claims is None:
            return self.client.held(self.entity, self.project, run_id)
        say_waiting = self.say_waiting
        say = self._tell if say_waiting is None else lambda line: say_waiting(run_id, line)
        return self.claims.take(self.entity, self.project, run_id, self._stop_asked, say)

    def _tail_caught_up(self, delivery: Delivery, held: Held) -> Held:
        """`held` asked again, for up to `COUNTS_LAG` seconds, while it looks like late
        numbers of a run that continues the staged one: a last row not the staged row's
        step at its place (W&B's tail can be staler than its count), or fewer rows than
        the rounds before sent. What it says after that is taken as the server's."""
        steps = self._content(delivery).history_steps
        cut = delivery.rows_cut if delivery.row_before is not None else 0

        def behind(now: Held) -> bool:
            have = now.history_lines
            stale_tail = 0 < have <= len(steps) and now.last_step != steps[have - 1]
            return stale_tail or have < cut

        if not behind(held):
            return held
        self._say_lagging()
        return counts_caught_up(
            self.client,
            self.entity,
            self.project,
            delivery.run_id,
            held,
            behind,
            time.monotonic() + COUNTS_LAG,
            self._stop_asked,
        )

    def submit(self, delivery: Delivery) -> None:
        """Hand over one staged run: it is prepared in a thread of its own while the next runs
        are staged, and uploaded when slots allow.

        A run the server holds other rows of is not sent (a problem of that run); after the
        upload was given up, nothing more is sent. An error in preparing a run (the server
        could not be asked) stops the delivery: `failure` says it to the stager at once, and
        `finish()` raises it.
        """
        with self.lock:
            self.deliveries.append(delivery)
            if self.given_up:
                delivery.problems.append("not sent: the upload was given up")
                return
            self._preparing += 1
        self._to_prepare.put(delivery)

    def _prepare_each(self) -> None:
        """A preparer thread: `prepare` handed-over runs and make them ready, until told to
        end. A run the server holds whole already is recorded here, and not sent."""
        ledger: Ledger | None = None  # a connection of this thread's own, when needed
        while (delivery := self._to_prepare.get()) is not None:
            ready = False
            try:
                if self.given_up:
                    delivery.problems.append("not sent: the upload was given up")
                elif lacking := lacking_line(delivery.source_check):
                    delivery.problems.append(lacking)  # (before `prepare` may cut the log)
                    delivery.merge_fault = True
                else:
                    self.prepare(delivery)
                    if delivery.held_already and not self.given_up:
                        ledger = ledger or Ledger(self.ledger_path)
                        self._verified(delivery, ledger)
                        self._said(delivery)
                    else:
                        ready = not self.given_up
            except RowsLost as exc:
                delivery.problems.extend(exc.args[0])
            except OtherWriter as exc:
                delivery.problems.append(f"not sent: {exc}")
            except Mismatch as exc:
                delivery.refused = True
                delivery.resend_mends = exc.resend_mends and not self.resend
                ledger = ledger or Ledger(self.ledger_path)
                changed = ledger.recorded_otherwise(delivery.key, delivery.fingerprint)
                delivery.problems.append(not_a_beginning(str(exc), changed))
            except BaseException as exc:  # said by `failure`, and raised by finish()
                with self.lock:
                    self._error = self._error or exc
                    self._stopping = True
                # The uploads are stopped now, not when the stager next looks (a run's
                # staging may take minutes); from another thread, as stopping waits.
                threading.Thread(target=self._stop_uploads, daemon=True).start()
            finally:
                with self.lock:
                    self._preparing -= 1
                    if ready:
                        self._ready.append((delivery, time.monotonic()))
                    self.lock.notify_all()
        if ledger is not None:
            ledger.close()

    def _end_preparers(self, wait: float | None) -> None:
        """Tell the preparer threads to end once the runs handed over are prepared (or, after
        a stop, passed over); wait up to `wait` seconds (None: without a bound) for them."""
        for _ in range(PREPARERS):
            self._to_prepare.put(None)
        with self.lock:
            self.lock.wait_for(lambda: self._preparing == 0, wait)

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the delivery in one of its threads, if one did."""
        with self.lock:
            return self._error

    @property
    def given_up(self) -> bool:
        """True once an upload made no progress for `timeout` (or `stop()` was called)."""
        return self.timed_out or self._stopping

    def finish(self) -> DeliveryReport:
        """Wait until every submitted run is uploaded and verified (or failed)."""
        with self.lock:
            self._sealed = True
            self.lock.notify_all()
        self._end_preparers(wait=None)  # every run is ready now, or has failed
        if self.failure is not None:  # the server could not be asked: end the uploads too
            self.stop()
            raise self.failure
        self._dispatcher.join()
        for thread in list(self._threads):
            thread.join()
        self._end_standby()
        if self._error is not None:
            raise self._error
        for delivery in self.deliveries:
            if self.timed_out and not (delivery.verified or delivery.problems):
                delivery.problems.append("not complete when the upload was given up")
        self.relay.close()
        report = DeliveryReport(self.entity or self._entity_seen, self.timed_out)
        report.failed = [d for d in self.deliveries if not d.verified]
        return report

    def deliver(self, deliveries: list[Delivery]) -> DeliveryReport:
        """Send what the server lacks of each of `deliveries`, all staged already."""
        with self.lock:
            self.expected = len(self.deliveries) + len(deliveries)
        for delivery in deliveries:
            self.submit(delivery)
        return self.finish()

    def stop(self) -> None:
        """Stop every upload and wait for them: nothing more is verified or recorded."""
        with self.lock:
            self._sealed = True
        self._stop_uploads()
        # Runs not yet asked about are passed over; a question under way ends within the
        # client's timeout and its run is not sent, so a Ctrl-C waits for it only briefly.
        self._end_preparers(wait=STOP_WAIT)
        self._dispatcher.join(_JOIN)
        for thread in list(self._threads):
            thread.join(_JOIN)
        self.relay.close()

    def _cannot_place(self, run_id: str, why: str) -> None:
        """The relay could not place `run_id`'s lines where planned, or refused the
        server's answer (and sent none of them): the run fails with `why` (every run being
        sent, for run_id ""), and its upload is stopped, from a thread of its own (the
        relay's thread waits for the answer to give wandb-core)."""
        with self.lock:
            runs = [run_id] if run_id else list(self._uploading)
            uploaders = {id(u): u for r in runs if (u := self._uploader_of.get(r)) is not None}
            for run in runs:
                delivery = self._uploading.get(run)
                if delivery is not None and why not in delivery.problems:
                    delivery.problems.append(why)
        for uploader in uploaders.values():
            threading.Thread(target=uploader.stop, daemon=True).start()

    def _say_settling(self, seconds: float) -> None:
        """Say once why the runs wait before anything is asked (after a stopped upload)."""
        with self.lock:
            said, self._settling_said = self._settling_said, True
        if not said and seconds >= 1:
            self._tell(f"waiting {seconds:.0f} s for the last requests of a stopped upload to land")

    def _say_lagging(self) -> None:
        """Say once that runs wait for the server's counts (W&B fills them in late)."""
        with self.lock:
            said, self._lag_said = self._lag_said, True
        if not said:
            self._tell(f"{COUNTS_LATE}: asking again for up to {COUNTS_LAG:.0f} s")

    def _stop_uploads(self) -> None:
        """Give up: end every uploader (waiting for each), and start nothing more."""
        with self.lock:
            self._stopping = True
            uploaders = list(self._uploaders)
            self.lock.notify_all()
        self._stop_asked.set()
        self._end_standby()
        for uploader in uploaders:
            uploader.stop()

    # -- the uploads ------------------------------------------------------------------------

    def _make_uploader(self) -> Uploader:
        """A new uploader, working in a directory of its own (called holding the lock)."""
        number = self._uploaders_made
        self._uploaders_made += 1
        relayed = Credentials(self.relay.url, self.credentials.api_key)
        return Uploader(
            relayed,
            self.project,
            self.entity,
            self.workdir / f"batch-{number}",
            self.timeout,
            owner=self.owner,
        )

    def _stand_by(self) -> None:
        """Start the next batch's uploader now, unless one waits already or all is sent.

        Its start (wandb's imports and wandb-core, about 0.8 s of CPU) then overlaps the
        staging of the runs it will be given, instead of delaying their upload."""
        with self.lock:
            if self._standby is not None or self.given_up:
                return
            if self._sealed and not self._ready and not self._preparing:
                return
            self._standby = standby = self._make_uploader()
        standby.start()  # outside the lock: a stop() meanwhile keeps it from starting

    def _take_uploader(self) -> Uploader:
        """The waiting uploader, else a new one (called holding the lock)."""
        uploader, self._standby = self._standby, None
        return uploader or self._make_uploader()

    def _end_standby(self) -> None:
        with self.lock:
            standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()

    def _dispatch(self) -> None:
        """Start batches as runs become ready and slots free; end when all have ended."""
        try:
            self._start_batches()
        except BaseException as exc:  # said in finish(), in the thread that waits
            with self.lock:
                self._error = self._error or exc
                self._stopping = True

    def _start_batches(self) -> None:
        with self.lock:
            while True:
                batch, lanes = self._next_batch()
                if batch:
                    self.slots.take(lanes)
                    for delivery in batch:
                        self._uploading[delivery.run_id] = delivery
                    uploader = self._take_uploader()
                    for delivery in batch:
                        self._uploader_of[delivery.run_id] = uploader
                    self._uploaders.append(uploader)
                    thread = threading.Thread(
                        target=self._upload, args=(batch, lanes, uploader), daemon=True
                    )
                    self._threads.append(thread)
                    thread.start()
                    continue
                running = any(t.is_alive() for t in self._threads)
                nothing_left = not self._ready and not self._preparing
                if self._sealed and not running and (nothing_left or self.given_up):
                    return
                self.lock.wait(0.1)

    def _next_batch(self) -> tuple[list[Delivery], int]:
        """The runs to start now and the slots they take (called holding the lock)."""
        if self.given_up or not self._ready:
            return [], 0
        coming = self._preparing + self._unsubmitted()
        waited = time.monotonic() - self._ready[-1][1]
        count = batch_size(
            len(self._ready),
            coming,
            len(self._uploading),
            self.slots.free,
            self.slots.limit,
            waited,
            self.slots.idle,
        )
        batch = [d for d, _ in self._ready[:count]]
        del self._ready[:count]
        lanes = batch_lanes(count, coming, len(self._uploading), self.slots.free, self.slots.limit)
        return batch, lanes

    def _upload(self, batch: list[Delivery], lanes: int, uploader: Uploader) -> None:
        """One `wandb sync` of `batch` with `lanes` runs at a time; verifies each as it ends.
        While more runs are coming, the next batch's uploader starts beside it."""
        by_id = {d.run_id: d for d in batch}
        holding = [lanes]
        unfinished = [len(batch)]  # the batch's runs not finished yet
        ledgers: list[Ledger] = []
        own = threading.local()
        checks: list[Future] = []
        checkers = ThreadPoolExecutor(VERIFIERS, thread_name_prefix="wbmerge-verify")
        try:
            with self.lock:
                if self.given_up:  # stopped, or timed out, since the batch was made
                    return
                more = self._preparing + self._unsubmitted() > 0
            if more or self._ready:
                self._stand_by()

            def check(delivery: Delivery, errors: list[str], ended: float) -> None:
                if not hasattr(own, "ledger"):
                    own.ledger = Ledger(self.ledger_path)  # a connection of this thread's own
                    with self.lock:
                        ledgers.append(own.ledger)
                self._verify(delivery, errors, own.ledger, ended)
                self._said(delivery)

            def finished(run_id: str, errors: list[str] | None = None) -> None:
                delivery = by_id.get(run_id)
                with self.lock:
                    if delivery is None or self._stopping:
                        return
                    if self._uploading.pop(run_id, None) is None:
                        return  # said twice
                    unfinished[0] -= 1
                    if unfinished[0] < holding[0]:  # lanes beyond its runs left: for others
                        self.slots.give_back(holding[0] - unfinished[0])
                        holding[0] = unfinished[0]
                if not delivery.problems:
                    found = uploader.errors().get(run_id, []) if errors is None else errors
                    ended = time.monotonic()  # (late counts are waited for from here)
                    checks.append(checkers.submit(check, delivery, found, ended))

            def probe() -> bool:
                return self._probe([d for d in batch if d.run_id in self._uploading])

            threading.Thread(target=self._read_contents, args=(batch,), daemon=True).start()
            outcome = uploader.run([d.run_dir for d in batch], lanes, finished, probe, PROBE_EVERY)
            with self.lock:
                if outcome.timed_out and not self._stopping:
                    self.timed_out = True
                    others = [u for u in self._uploaders if u is not uploader]
                else:
                    others = []
            for other in others:  # one upload without progress: the server is stuck
                other.stop()
            for delivery in batch:  # the runs the uploader did not say it finished
                if self.timed_out and delivery.run_id in self._uploading:
                    delivery.problems.append("not complete when the upload was given up")
                finished(delivery.run_id, outcome.errors.get(delivery.run_id, []))
            for done in checks:
                done.result()  # (an error of a check is raised here)
        except BaseException as exc:  # said in finish(), in the thread that waits
            with self.lock:
                self._error = self._error or exc
                self._stopping = True
        finally:
            uploader.stop()  # (an uploader that ran has ended: this only waits for it)
            with self.lock:
                for delivery in batch:
                    self._uploading.pop(delivery.run_id, None)
                if uploader in self._uploaders:
                    self._uploaders.remove(uploader)
            checkers.shutdown(wait=True)
            for ledger in ledgers:
                ledger.close()
            with self.lock:
                self.slots.give_back(holding[0])

    def _content(self, delivery: Delivery) -> StagedContent:
        """What the staged log of `delivery` holds, counted once (by whichever thread asks first)."""
        with delivery.counting:
            if delivery.content is None:
                delivery.content = read_staged(delivery.log)
            return delivery.content

    def _read_contents(self, batch: list[Delivery]) -> None:
        """Count the staged logs of a batch while its `wandb sync` starts (a start is mostly
        waiting here), so that each run is checked as soon as it is sent."""
        for delivery in batch:
            if self.given_up:
                return
            try:
                self._content(delivery)
            except OSError:
                return  # (said by `_verify`, which counts again in the thread that reports)

    def _verify(self, delivery: Delivery, errors: list[str], ledger: Ledger, ended: float) -> None:
        """Read back what the server holds; record the run only when nothing is missing.
        Counts that fall short are asked again until `COUNTS_LAG` seconds after the
        upload `ended` (a `time.monotonic()`): W&B's lag behind the rows it holds."""
        content = self._content(delivery)
        run_id = delivery.run_id
        try:
            held = self.client.held(self.entity, self.project, run_id)
            if late := counts_behind(content, held) and not errors:
                self._say_lagging()
                held = counts_caught_up(
                    self.client,
                    self.entity,
                    self.project,
                    run_id,
                    held,
                    lambda h: counts_behind(content, h),
                    ended + COUNTS_LAG,
                    self._stop_asked,
                )
        except ServerError as exc:
            delivery.problems.append(f"could not be verified: {exc}")
            return
        with self.lock:
            self._rows[run_id] = held.history_lines
            self._entity_seen = self._entity_seen or held.entity
        on_server = self._on_server(delivery, held, content)
        # What the counts lack and what the uploader said of the run are said together.
        problems = counts(on_server) + list(dict.fromkeys(errors))
        if problems and late:
            problems.append(f"still so {COUNTS_LAG:.0f} s after the upload ended")
        problems = problems or prove(on_server, AFTER_UPLOAD)
        if problems:
            delivery.problems.extend(problems)
            return
        self._verified(delivery, ledger)

    def _on_server(self, delivery: Delivery, held: Held, content: StagedContent) -> RunOnServer:
        """The run as staged and as the server holds it, for the checks of `verify.proof`."""
        return RunOnServer(
            self.client, self.entity, self.project, delivery, held, content, self.every_value
        )

    def _verified(self, delivery: Delivery, ledger: Ledger) -> None:
        """Record a run found whole (unless a live round sent it), and drop its staging. A
        ledger that cannot record it (a full disk) fails the run, saying it is whole."""
        if delivery.final:
            try:
                ledger.record(delivery.key, delivery.fingerprint, self.entity)
            except WbmergeError as exc:
                delivery.unrecorded = True
                delivery.problems.append(
                    f"on the server whole and verified, but not recorded as synced: {exc}; a "
                    "rerun finds the run whole on the server and records it without sending "
                    "it again"
                )
                return
        delivery.verified = True
        if delivery.final and self.release_verified and self.claims is not None:
            self.claims.release(self.entity, self.project, delivery.run_id)
        if self.remove_verified:
            shutil.rmtree(delivery.run_dir, ignore_errors=True)

    def _said(self, delivery: Delivery) -> None:
        """Tell the progress callback that a run ended, verified or not."""
        with self.lock:
            self._done += delivery.verified
        staged_rows = len(self._content(delivery).step_items)
        if delivery.held_already:
            self._tell(f"verified {delivery.run_id}: {staged_rows} rows, all on the server already")
        elif delivery.verified:
            self._tell(f"verified {delivery.run_id}: {staged_rows} rows")
        elif delivery.unrecorded:
            self._tell(f"verified {delivery.run_id}: {staged_rows} rows, not recorded")
        else:
            self._tell(f"incomplete {delivery.run_id}: {'; '.join(delivery.problems)}")

    def _tell(self, message: str = "") -> None:
        """Give the progress callback the runs verified and rows on the server, and a line."""
        with self.lock:
            done, rows = self._done, sum(self._rows.values())
        self.progress(Progress(done, self._total(), rows, message))

    def _probe(self, deliveries: list[Delivery]) -> bool:
        """Ask the server how far `PROBED` of `deliveries` are (`runs_to_ask`); True if any
        moved since it was last asked."""
        with self.lock:
            started = {
                run for run, counts in self._counts.items() if counts != self._before.get(run)
            }
            chosen = runs_to_ask([d.run_id for d in deliveries], self._asked_at, started, PROBED)
            asked = [d for d in deliveries if d.run_id in chosen]
            for delivery in asked:
                self._asked_at[delivery.run_id] = time.monotonic()
        moved = False
        for delivery in asked:
            try:
                held = self.client.held(self.entity, self.project, delivery.run_id)
            except ServerError:
                continue
            counts = (held.history_lines, held.events_lines, held.log_lines)
            with self.lock:
                moved |= self._counts.get(delivery.run_id) not in (None, counts)
                self._counts[delivery.run_id] = counts
                self._rows[delivery.run_id] = held.history_lines
        self._tell()
        return moved

    def _total(self) -> int:
        return max(self.expected, len(self.deliveries))

    def _unsubmitted(self) -> int:
        """Runs still to be handed over (called holding the lock)."""
        return 0 if self._sealed else max(0, self.expected - len(self.deliveries))


def _staged_row(delivery: Delivery, index: int) -> dict:
    """The staged run's history row `index`, from the staged log, or the row before a log
    that comes cut already (`Delivery.row_before`)."""
    if delivery.row_before is not None and index == delivery.rows_cut - 1:
        return delivery.row_before
    return history_row(delivery.log, index - (delivery.rows_cut if delivery.row_before else 0))

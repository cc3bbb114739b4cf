"""Exactly once: send a set of staged runs so that the server ends with each of them whole.

For every run: ask the server what it holds, send only the remainder through `wandb sync`,
then read back what it holds and compare with what was staged. A run is recorded in the
ledger the moment it is verified, so an interruption keeps what completed; a run that is
short, or whose files failed to upload, is reported and not recorded, and a rerun sends
what is still missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .credentials import Credentials
from .ledger import Ledger
from .remainder import (
    Mismatch,
    StagedContent,
    history_row,
    read_staged,
    remainder,
    shortfall,
    write_remainder,
)
from .server import ServerClient, ServerError
from .uploader import DEFAULT_TIMEOUT, Uploader


@dataclass
class Delivery:
    """One staged run to deliver: where it is, and under which ledger key."""

    run_id: str
    run_dir: Path
    log: Path
    key: str
    fingerprint: str
    content: StagedContent | None = None
    problems: list[str] = field(default_factory=list)
    verified: bool = False


@dataclass
class Progress:
    """How far an upload is: runs verified of all, and history rows the server holds."""

    done: int
    total: int
    rows: int
    message: str = ""  # a finished or failed run, said once


@dataclass
class DeliveryReport:
    entity: str | None
    timed_out: bool = False
    failed: list[Delivery] = field(default_factory=list)


class Deliverer:
    """Delivers the staged runs of one project, exactly once, verified."""

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
        staging: Path | None = None,
    ) -> None:
        self.client, self.ledger = client, ledger
        self.project, self.entity = project, entity
        self.uploader = Uploader(
            credentials, project, entity, parallel, workdir, timeout, staging=staging
        )
        self.progress = progress or (lambda p: None)
        self._rows: dict[str, int] = {}  # history rows the server holds, per run
        self._counts: dict[str, tuple[int, int, int]] = {}  # all its line counts, per run

    def prepare(self, delivery: Delivery) -> None:
        """Cut the staged log down to what the server lacks (raises Mismatch, ServerError)."""
        delivery.content = read_staged(delivery.log)
        held = self.client.held(self.entity, self.project, delivery.run_id)
        plan = remainder(delivery.content, held, lambda index: history_row(delivery.log, index))
        if plan.resends:
            cut = delivery.log.with_name(delivery.log.name + ".remainder")
            write_remainder(delivery.log, cut, plan)
            cut.replace(delivery.log)

    def deliver(self, deliveries: list[Delivery]) -> DeliveryReport:
        """Send what the server lacks of each run in one `wandb sync`, verifying each run as
        the uploader finishes it (and the rest after it exits); failed runs say why."""
        report = DeliveryReport(self.entity)
        todo = []
        for delivery in deliveries:
            try:
                self.prepare(delivery)
                todo.append(delivery)
            except Mismatch as exc:
                delivery.problems.append(
                    f"{exc}: the server's run is not a beginning of this one and is left "
                    "as it is (delete it on the server, or pick another --base-id)"
                )
        by_id = {d.run_id: d for d in todo}
        done = [0]

        def finished(run_id: str, errors: list[str] | None = None) -> None:
            delivery = by_id.get(run_id)
            if delivery is None or delivery.verified or delivery.problems:
                return
            assert delivery.content is not None
            found = self.uploader.errors().get(run_id, []) if errors is None else errors
            self._verify(delivery, found)
            done[0] += delivery.verified
            message = (
                f"verified {run_id}: {len(delivery.content.history_steps)} rows"
                if delivery.verified
                else f"incomplete {run_id}: {'; '.join(delivery.problems)}"
            )
            self.progress(Progress(done[0], len(deliveries), self._total_rows(), message))

        def probe() -> bool:
            moved = False
            for delivery in todo:
                if delivery.verified or delivery.problems:
                    continue
                try:
                    held = self.client.held(self.entity, self.project, delivery.run_id)
                except ServerError:
                    continue
                counts = (held.history_lines, held.events_lines, held.log_lines)
                moved |= self._counts.get(delivery.run_id) not in (None, counts)
                self._counts[delivery.run_id] = counts
                self._rows[delivery.run_id] = held.history_lines
            self.progress(Progress(done[0], len(deliveries), self._total_rows()))
            return moved

        if todo:
            probe_every = max(2.0, 0.25 * len(todo))  # at most ~4 queries a second
            outcome = self.uploader.run([d.run_dir for d in todo], finished, probe, probe_every)
            report.timed_out = outcome.timed_out
            report.entity = self.entity or outcome.entity
            for delivery in todo:  # the runs the uploader did not say it finished
                if outcome.timed_out and not (delivery.verified or delivery.problems):
                    delivery.problems.append("not complete when the upload was given up")
                finished(delivery.run_id, outcome.errors.get(delivery.run_id, []))
        report.failed = [d for d in deliveries if not d.verified]
        return report

    def _verify(self, delivery: Delivery, errors: list[str]) -> None:
        """Read back what the server holds; record the run only when nothing is missing."""
        assert delivery.content is not None
        try:
            held = self.client.held(self.entity, self.project, delivery.run_id)
        except ServerError as exc:
            delivery.problems.append(f"could not be verified: {exc}")
            return
        self._rows[delivery.run_id] = held.history_lines
        problems = shortfall(delivery.content, held) + list(dict.fromkeys(errors))
        if problems:
            delivery.problems.extend(problems)
            return
        self.ledger.record(delivery.key, delivery.fingerprint, self.entity)
        delivery.verified = True

    def _total_rows(self) -> int:
        return sum(self._rows.values())

    def stop(self) -> None:
        self.uploader.stop()

"""`wbmerge verify`: whether a server holds everything the ranks' files hold, asked read-only.

It plans the runs a sync of the same files makes (or, for runs that plain `wandb sync`
uploaded, each rank's run under its own id), stages each one in private staging as a sync
would, checks the staged run against the ranks' own logs, and proves it on the server
with the checks a sync uses to find a run whole (`verify.WHOLE`). It writes nothing on the
server and nothing in the ledger: it is what a user runs after a server incident, or to
audit a project synced long ago.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

from .. import merge  # (stage is called as merge.stage: the seam a test stands a broken merge in)
from ..errors import WbmergeError
from ..identify import discover, few, make_hints, selects_merged
from ..plan import Target, app_url, as_logged, check_destination, run_url
from ..upload import (
    Credentials,
    Delivery,
    Held,
    ServerClient,
    ServerError,
    find_credentials,
    make_staging,
)
from ..verify import (
    COUNTS_LAG,
    COUNTS_LATE,
    WHOLE,
    Mismatch,
    RunOnServer,
    checked_config_keys,
    counts_behind,
    counts_caught_up,
    prove,
    resend_whole,
)
from ..wandbcore import StagedContent, read_staged
from .pipeline import PlannedJob, plan_jobs, sigterm_raises
from .request import MergeRequest
from .session import delivery_of

UploadedBy = Literal["wbmerge", "wandb"]


@dataclass
class RunVerdict:
    """One run the files say the server must hold, and what keeps it from being whole."""

    target: Target
    project: str
    entity: str | None
    link: str
    problems: list[str] = field(default_factory=list)
    # What mends it: "resend" (`wbmerge sync --resend` sends it whole again over what the
    # server holds), "other ids" (the server holds more of it than the files make, which no
    # upload removes: rows, system metrics or console lines past the staged ones), "verify"
    # (it could not be checked), "none" (the staged run lacks what its ranks logged).
    mend: Literal["resend", "other ids", "verify", "none"] = "resend"

    @property
    def whole(self) -> bool:
        return not self.problems

    def as_json(self) -> dict:
        return {
            "run_id": self.target.id,
            "project": self.project,
            "entity": self.entity,
            "link": self.link,
            "whole": self.whole,
            "problems": self.problems,
            "sources": [str(s.path.parent) for s in self.target.sources],
        }


class LateCounts:
    """The one wait of a verify for counts that lag (W&B counts a run's lines some seconds
    after they arrive). Every upload being checked ended before verify started, so counts
    asked `COUNTS_LAG` seconds after the first run found behind are the server's own: one
    deadline for all runs, said once, and a verify waits at most that long in all."""

    def __init__(self, note: Callable[[str], None] | None) -> None:
        self.note = note
        self.until: float | None = None

    def deadline(self) -> float:
        if self.until is None:
            self.until = time.monotonic() + COUNTS_LAG
            if self.note:
                self.note(f"{COUNTS_LATE}: asking again for up to {COUNTS_LAG:.0f} s")
        return self.until


@dataclass
class VerifyReport:
    """Every run checked; `whole` when the server holds each of them whole."""

    runs: list[RunVerdict] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return all(run.whole for run in self.runs)

    def mending(self, merged: bool = False) -> str:
        """What mends the runs that are not whole, said as commands that do: a plain
        `wbmerge sync` finds them recorded as synced in its ledger and sends nothing, and
        sending again never removes what the server holds. `merged`: the runs' ids were
        chosen by a merge, so other ids come from merging again."""
        broken = [run for run in self.runs if not run.whole]
        by_mend = {
            mend: [run.target.id for run in broken if run.mend == mend]
            for mend in ("resend", "other ids", "verify", "none")
        }
        parts = []
        if ids := by_mend["resend"]:
            parts.append(
                "`wbmerge sync --resend` with them sends the runs whole again over "
                f"what the server holds, which mends {few(ids)}"
            )
        if ids := by_mend["other ids"]:
            how = "merge them again with --base-id ID" if merged else "sync with --base-id ID"
            parts.append(
                f"the server holds more of {few(ids)} than the files make, which no upload "
                f"can remove: delete them on the server, then `wbmerge sync --resend` with "
                f"them, or upload under other run ids ({how})"
            )
        if ids := by_mend["verify"]:
            parts.append(f"{few(ids)} could not be checked: run verify again")
        if ids := by_mend["none"]:
            parts.append(
                f"no upload mends {few(ids)}: its line says what the files hold that the merge lost"
            )
        return "; ".join(parts)


def plan_verified(request: MergeRequest, uploaded_by: UploadedBy) -> list[PlannedJob]:
    """The runs the server must hold: those `wbmerge sync` makes of the files, or, for
    `uploaded_by` "wandb", each offline run as plain `wandb sync` uploads it."""
    if uploaded_by == "wbmerge":
        return plan_jobs(request)
    if uploaded_by != "wandb":
        raise WbmergeError(f"uploaded_by takes 'wbmerge' or 'wandb', not {uploaded_by!r}")
    given = [
        name
        for name, value in (
            ("--run-mode", request.run_mode),
            ("--rank-scope", request.rank_scope),
            ("--base-id", request.base_id),
        )
        if value
    ]
    if given:
        raise WbmergeError(
            f"{given[0]} does not apply to --uploaded-by wandb: plain `wandb sync` uploads "
            "each offline run under its own id"
        )
    hints = make_hints(request.label_pattern, request.ranks_file, request.primary)
    if selects_merged(discover(request.paths, hints=hints), request.job):
        # (a merge wrote them under their ids and names: plain `wandb sync` uploads them so)
        return plan_jobs(request)
    # Each offline run on its own, as plain `wandb sync` took it: no rank needs another.
    planned = plan_jobs(replace(request, run_mode="new", allow_missing_ranks=True))
    for job in planned:
        job.targets = [
            as_logged(run.source(), run.run_id, run.group, run.display_name, run.job_type)
            for run in job.job.runs
        ]
        job.run_mode = "as logged"
    ids = Counter(t.id for job in planned for t in job.targets)
    shared = sorted(run_id for run_id, count in ids.items() if count > 1)
    if shared:
        raise WbmergeError(
            f"offline runs share the run id {shared[0]} (a resumed or restarted run): plain "
            "`wandb sync` puts them in one run, which verify cannot check; name one with --job"
        )
    return planned


def verify_jobs(
    request: MergeRequest,
    uploaded_by: UploadedBy = "wbmerge",
    note: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Check every run the files say the server must hold; read-only on the server.
    `note` is given a line when verify waits for counts that lag."""
    credentials = find_credentials()
    planned = plan_verified(request, uploaded_by)
    for job in planned:  # (bad input first: exit 2 whether the server answers or not)
        check_destination(job.project, job.entity)
        if not job.project:
            raise WbmergeError(
                f"job {job.job.job_id}: its runs name no project; give it with -p PROJECT"
            )
    report = VerifyReport()
    client = ServerClient(credentials)
    staging = None
    with sigterm_raises():  # (a SIGTERM removes the staged copies of the runs, as Ctrl-C)
        try:
            viewer_entity = client.viewer_entity()  # fails in seconds, naming the URL
            staging = make_staging()
            late = LateCounts(note)
            for index, job in enumerate(planned):
                _verify_job(
                    request,
                    job,
                    client,
                    credentials,
                    viewer_entity,
                    staging / f"job-{index}",
                    report,
                    late,
                )
        finally:
            client.close()
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    return report


def _verify_job(
    request: MergeRequest,
    job: PlannedJob,
    client: ServerClient,
    credentials: Credentials,
    viewer_entity: str | None,
    workdir: Path,
    report: VerifyReport,
    late: LateCounts,
) -> None:
    assert job.project
    options = job.options(request)
    entity = job.entity or viewer_entity
    url = app_url(credentials.base_url)
    workdir.mkdir(parents=True)
    for target in job.targets:
        link = run_url(url, entity, job.project, target.id) if entity else ""
        verdict = RunVerdict(target, job.project, entity, link)
        report.runs.append(verdict)
        staged = merge.stage(target, workdir, options, count_content=True)
        try:
            made = delivery_of(target, staged, "", "", options)
            assert made.source_check is not None
            verdict.problems = made.source_check()
            if verdict.problems:
                verdict.mend = "none"
                continue  # (the staged run is not what the files hold: nothing to compare)
            content = made.content or read_staged(staged.log_path)
            held = client.held(entity, job.project, target.id)
            # (late counts, or a run that is not whole; a run the server lacks is no lag)
            if held.exists and counts_behind(content, held):
                behind = partial(counts_behind, content)
                until = late.deadline()
                held = counts_caught_up(client, entity, job.project, target.id, held, behind, until)
            if not held.exists:
                verdict.problems = ["the server holds no such run"]
                continue
            on_server = RunOnServer(
                client,
                entity,
                job.project,
                made,
                held,
                content,
                every_value=request.verify == "full",
            )
            verdict.problems = prove(on_server, WHOLE)
            if verdict.problems:
                verdict.mend = _mend(content, held, made)
        except ServerError as exc:
            verdict.problems = [f"could not be verified: {exc}"]
            verdict.mend = "verify"
        finally:
            shutil.rmtree(staged.run_dir, ignore_errors=True)


def _mend(content: StagedContent, held: Held, made: Delivery) -> Literal["resend", "other ids"]:
    """Whether `sync --resend` leaves a run that is not whole exact: not when the server
    holds lines past the staged run's or config keys it lacks where its config is checked
    (`resend_whole`, `Delivery.config_checked`), which sending again cannot remove."""
    try:
        resend_whole(content, held, checked_config_keys(made))
    except (Mismatch, ValueError):  # (ValueError: a config not JSON, which --resend refuses)
        return "other ids"
    return "resend"

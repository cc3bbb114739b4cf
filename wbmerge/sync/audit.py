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
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from .. import merge  # (stage is called as merge.stage: the seam a test stands a broken merge in)
from ..errors import WbmergeError
from ..identify import discover, make_hints, selects_merged
from ..plan import Target, app_url, as_logged, check_destination, run_url
from ..upload import Credentials, ServerClient, ServerError, find_credentials, make_staging
from ..verify import WHOLE, RunOnServer, prove
from ..wandbcore import read_staged
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


@dataclass
class VerifyReport:
    """Every run checked; `whole` when the server holds each of them whole."""

    runs: list[RunVerdict] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return all(run.whole for run in self.runs)


def plan_verified(request: MergeRequest, uploaded_by: UploadedBy) -> list[PlannedJob]:
    """The runs the server must hold: those `wbmerge sync` makes of the files, or, for
    `uploaded_by` "wandb", each offline run as plain `wandb sync` uploads it."""
    if uploaded_by == "wbmerge":
        return plan_jobs(request)
    if uploaded_by != "wandb":
        raise WbmergeError(f"uploaded_by takes 'wbmerge' or 'wandb', not {uploaded_by!r}")
    given = [name for name, value in (("--run-mode", request.run_mode),
             ("--rank-scope", request.rank_scope), ("--base-id", request.base_id)) if value]  # fmt: skip
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


def verify_jobs(request: MergeRequest, uploaded_by: UploadedBy = "wbmerge") -> VerifyReport:
    """Check every run the files say the server must hold; read-only on the server."""
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
            for index, job in enumerate(planned):
                _verify_job(request, job, client, credentials, viewer_entity,
                            staging / f"job-{index}", report)  # fmt: skip
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
                continue  # (the staged run is not what the files hold: nothing to compare)
            held = client.held(entity, job.project, target.id)
            if not held.exists:
                verdict.problems = ["the server holds no such run"]
                continue
            content = made.content or read_staged(staged.log_path)
            on_server = RunOnServer(client, entity, job.project, made, held, content,
                                    every_value=request.verify == "full")  # fmt: skip
            verdict.problems = prove(on_server, WHOLE)
        except ServerError as exc:
            verdict.problems = [f"could not be verified: {exc}"]
        finally:
            shutil.rmtree(staged.run_dir, ignore_errors=True)

"""The `wbmerge` command line: a thin click layer over the library."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from .. import __version__
from ..errors import WbmergeError
from .exits import OneLineUsage, one_line_errors, printable_json
from .sink import sink

if TYPE_CHECKING:
    from ..sync import SyncReport


def request_option(name: str, **overrides: Any) -> Callable[..., Any]:
    """The click option of `MergeRequest` field `name`, built from its one declaration
    (`sync.request`): its flags, help and default, and a type from the field's: a flag for
    a bool, a choice for a Literal, repeatable for a sequence, a path for a path."""
    from ..sync import request_fields

    field, spelling = request_fields()[name]
    settings: dict[str, Any] = {"help": spelling.help, "show_default": spelling.show_default}
    if spelling.metavar:
        settings["metavar"] = spelling.metavar
    if field.choices is not None:
        settings["type"] = click.Choice([str(c) for c in field.choices if c is not None])
    elif field.is_path:
        settings["type"] = click.Path()
    if field.is_flag:
        settings["is_flag"] = True
    if field.is_sequence:
        settings["multiple"] = True
    else:
        settings["default"] = field.default
    settings.update(overrides)
    return click.option(*spelling.flags, name, **settings)


def rank_options() -> list[Callable[..., Any]]:
    """How to read the ranks of runs written without wbmerge (every reading command)."""
    return [
        request_option("label_pattern", multiple=True, callback=_one_pattern),
        request_option("ranks_file"),
        request_option("primary"),
    ]


def _one_pattern(ctx: click.Context, param: click.Parameter, given: tuple[str, ...]) -> str | None:
    """The one --label-pattern given. Given twice, click would keep the last in silence,
    and a user who wrote two (one per spelling of the names) would think both apply."""
    if len(given) > 1:
        raise click.BadParameter(
            f"given {len(given)} times; one pattern reads every run (`wbmerge inspect` shows "
            "the names), or say each run's rank with --ranks FILE"
        )
    return given[0] if given else None


class Seconds(click.FloatRange):
    """A number of seconds, `min` or more, and finite: click's FloatRange lets `nan`
    through (no comparison with it is true), and a `--interval nan` follow busy-looped, an
    `--idle-timeout nan` one never ended."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds.", param, ctx)
        return seconds


def _seconds_option(name: str, default: float, help: str) -> Callable[..., Any]:
    """A --follow option of a number of seconds, 0 or more, its default shown."""
    return click.option(name, default=default, show_default=True, type=Seconds(min=0), help=help)


def _with_rank_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(rank_options()):
        func = option(func)
    return func


@click.group(cls=OneLineUsage, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="wbmerge")
def main() -> None:
    """Merge and upload the offline W&B runs of every rank of a distributed job."""


main.add_command(sink)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array, one object per run.")
@_with_rank_options
@one_line_errors
def inspect(
    paths: tuple[str, ...],
    as_json: bool,
    label_pattern: str | None,
    ranks_file: str | None,
    primary: tuple[str, ...],
) -> None:
    """List the offline runs under PATHS: rank (and where it came from), label, rows,
    completeness, damage."""
    from .. import api
    from ..identify import format_inspection, unreadable_summary

    rows = api.inspect(paths, label_pattern=label_pattern, ranks_file=ranks_file, primary=primary)
    if as_json:
        click.echo(printable_json(rows))
    else:
        click.echo(format_inspection(rows), nl=False)
    unreadable = unreadable_summary(rows)
    if unreadable:
        raise WbmergeError(unreadable)  # listed above; the exit status says it too


def _warn_jobs(planned: list) -> None:
    for job in planned:
        for warning in job.warnings:
            click.echo(f"wbmerge: warning: {warning}", err=True)


# The options `merge`, `sync`, `follow` and `verify` share, in the order help lists them.
MERGE_OPTIONS = (
    "run_mode",
    "rank_scope",
    "base_id",
    "job",
    "allow_missing_ranks",
    "system_metrics",
    "key_format",
    "skew_metrics",
    "rank_stats",
    "per_rank",
    "project",
    "entity",
    "job_type",
    "files_from",
    "unknown_records",
)


def merge_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options `merge` and `sync` share: what to merge, and how."""
    options = [
        click.argument("paths", nargs=-1, required=True, type=click.Path()),
        *(request_option(name) for name in MERGE_OPTIONS),
        *rank_options(),
        request_option("rank_order"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _print_plan(planned: list, as_json: bool) -> None:
    targets = [t.as_json() for job in planned for t in job.targets]
    if as_json:
        click.echo(printable_json(targets))
        return
    for job in planned:
        click.echo(
            f"job {job.job.job_id}: run_mode={job.run_mode} rank_scope={job.rank_scope} "
            f"project={job.project or '-'} -> {len(job.targets)} run(s)"
        )
        for t in job.targets:
            labels = ", ".join(
                s.label + (f" (restart {s.restart})" if s.restart else "") for s in t.sources
            )
            if t.kind == "merged":
                labels = f"merged already, uploaded as it is ({t.sources[0].path.parent})"
            group = f" group={t.group}" if t.group else ""
            click.echo(f"  {t.id}{group} primary=rank {t.primary_rank}: {labels}")


class _Progress:
    """A progress bar over the runs being merged, on a terminal only."""

    def __init__(self, total: int) -> None:
        self.bar = None
        if total and sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label="merging", file=sys.stderr)
            self.bar.__enter__()

    def __call__(self, staged: Any) -> None:
        if self.bar:
            self.bar.update(1)
        if staged.bound_notice:  # as soon as it is known: before the upload
            start = "\n" if self.bar else ""  # (off the progress bar's line)
            click.echo(f"{start}wbmerge: warning: {staged.bound_notice}", err=True)

    def close(self) -> None:
        if self.bar:
            self.bar.__exit__(None, None, None)


class _UploadProgress:
    """Upload progress: a status line on a terminal, a line per finished run otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()

    def __call__(self, progress: Any) -> None:
        if self.tty:
            click.echo(
                f"\ruploading: {progress.done}/{progress.total} runs verified, "
                f"{progress.rows} rows on the server",
                err=True,
                nl=False,
            )
            if progress.message:
                click.echo(f"\r{progress.message}\033[K", err=True)
        elif progress.message:
            click.echo(f"{progress.message} ({progress.done}/{progress.total} runs)", err=True)


def _say_waiting(key: str) -> None:
    run = key.rsplit("|", 1)[-1]
    click.echo(f"wbmerge: another sync is uploading run {run}; waiting for it", err=True)


def _say_note(line: str) -> None:
    click.echo(f"wbmerge: {line}", err=True)


@main.command()
@merge_options
@click.option(
    "--out", "out_dir", required=True, type=click.Path(), help="Where to write the merged runs."
)
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def merge(out_dir: str, dry_run: bool, as_json: bool, **kw: Any) -> None:
    """Merge the offline runs under PATHS into new offline runs in --out (no upload)."""
    from .. import api

    planned = api.plan(**kw)
    _warn_jobs(planned)
    if dry_run:
        _print_plan(planned, as_json)
        return
    progress = _Progress(sum(len(j.targets) for j in planned))
    try:
        staged = api.merge(out=out_dir, progress=progress, planned=planned, **kw)
    finally:
        progress.close()
    for s in staged:
        for warning in s.warnings:
            click.echo(f"wbmerge: warning: {s.target.id}: {warning}", err=True)
    if as_json:
        click.echo(
            printable_json(
                [
                    {
                        "id": s.target.id,
                        "path": str(s.run_dir),
                        "kind": s.target.kind,
                        "exit_code": s.exit_code,
                    }
                    for s in staged
                ]
            )
        )
        return
    for s in staged:
        rows = f"{s.history_rows} merged rows, " if s.target.kind == "shared" else ""
        click.echo(f"{s.run_dir}  ({rows}exit code {s.exit_code})")
    click.echo(f"upload later, verified and once, with: wbmerge sync {shlex.quote(out_dir)}")


def upload_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options of every command that uploads: `sync` and `follow`."""
    for option in reversed(
        [
            click.option(
                "--parallel",
                "-n",
                default=4,
                show_default=True,
                type=click.IntRange(min=1),
                help="Runs uploaded at once.",
            ),
            click.option(
                "--timeout",
                default=300.0,
                show_default=True,
                type=Seconds(min=1),
                help="Seconds without upload progress before the upload is given up (exit 1).",
            ),
            click.option("--json", "as_json", is_flag=True),
            request_option("verify"),
        ]
    ):
        func = option(func)
    return func


def follow_options(prefix: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of a follow's rounds; `prefix` says in `sync`'s help that they are
    `--follow`'s."""

    def say(text: str) -> str:
        return prefix + text if prefix else text[0].upper() + text[1:]

    def add(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(
            [
                _seconds_option("--interval", 60.0, say("seconds between rounds.")),
                _seconds_option(
                    "--idle-timeout",
                    600.0,
                    say(
                        "end after this many seconds without a new "
                        "record, with a warning naming the ranks that never finished."
                    ),
                ),
                _seconds_option(
                    "--restart-grace",
                    60.0,
                    say(
                        "seconds a run whose ranks ended, some "
                        "failed, waits for an elastic restart before it is finished."
                    ),
                ),
                click.option("--quiet", "-q", is_flag=True, help=say("no line per round.")),
            ]
        ):
            func = option(func)
        return func

    return add


@main.command()
@merge_options
@upload_options
@click.option(
    "--force",
    is_flag=True,
    help="Check runs the ledger says are synced with the server again, and send what it "
    "lacks (nothing is sent twice).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan; write and upload nothing.")
@click.option("--keep-staging", type=click.Path(), help="Stage merged runs here and keep them.")
@click.option(
    "--follow",
    is_flag=True,
    help="What `wbmerge follow` does: keep the runs of a job that is still training up to "
    "date, round after round, until every rank has finished (or --idle-timeout).",
)
@follow_options("--follow: ")
@request_option("resend")
@one_line_errors
def sync(
    parallel: int,
    force: bool,
    dry_run: bool,
    keep_staging: str | None,
    timeout: float,
    as_json: bool,
    follow: bool,
    interval: float,
    idle_timeout: float,
    restart_grace: float,
    quiet: bool,
    **kw: Any,
) -> None:
    """Merge the offline runs under PATHS and upload each exactly once, verified.

    Each run ends as "uploaded" (sent, then verified on the server), "already synced"
    (the ledger knew it; nothing asked or sent) or "already complete" (the server held it
    whole already; nothing sent).
    """
    from .. import api
    from ..plan import check_destination
    from ..upload import find_credentials

    if follow:
        for flag, given in (
            ("--dry-run", dry_run),
            ("--keep-staging", keep_staging),
            ("--force", force),
            ("--resend", kw.get("resend")),
        ):
            if given:
                raise WbmergeError(f"{flag} cannot be used with --follow")
        find_credentials()
        kw["restart_grace"] = restart_grace
        _follow(parallel, timeout, interval, idle_timeout, quiet, as_json, **kw)
        return
    if not dry_run:
        find_credentials()  # before any work: no credentials, no reading of runs
    planned = api.plan(**kw)
    _warn_jobs(planned)
    if dry_run:
        for job in planned:  # (refused as a sync would refuse it)
            check_destination(job.project, job.entity)
        _print_plan(planned, as_json)
        return
    progress = _Progress(sum(len(j.targets) for j in planned))
    failure = None
    try:
        report = api.sync(
            parallel=parallel,
            force=force,
            timeout=timeout,
            keep_staging=keep_staging,
            progress=progress,
            upload_progress=_UploadProgress(),
            on_wait=_say_waiting,
            planned=planned,
            **kw,
        )
    except api.UploadFailed as exc:  # (the runs verified are said, then what failed)
        report, failure = exc.report, exc
    finally:
        progress.close()
    _print_synced(report, as_json)
    if failure is not None:
        raise failure


@main.command("verify")
@merge_options
@click.option(
    "--uploaded-by",
    type=click.Choice(["wbmerge", "wandb"]),
    default="wbmerge",
    show_default=True,
    help="wandb: the runs were uploaded by plain `wandb sync`, each "
    "offline run under its own id (--run-mode, --rank-scope and --base-id do not apply).",
)
@request_option(
    "verify",
    help="Every row is read back and checked present once; full: compare every row's "
    "values too, not a sample of 64.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@one_line_errors
def verify_command(uploaded_by: str, as_json: bool, **kw: Any) -> None:
    """Check, read-only, that the server holds every run the offline runs under PATHS make,
    whole: rows once, values, summary, config, files, artifacts and metric definitions.
    Give the options the runs were synced with. Exit 0 when every run is whole, 1 when one
    is not."""
    from .. import api
    from ..upload import find_credentials

    find_credentials()  # before any work: no credentials, no reading of runs
    report = api.verify(uploaded_by=uploaded_by, on_note=_say_note, **kw)  # type: ignore[arg-type]
    if as_json:
        runs = [run.as_json() for run in report.runs]
        click.echo(printable_json({"whole": report.whole, "runs": runs}))
    else:
        for run in report.runs:
            if run.whole:
                click.echo(f"{'whole':>10}: {run.target.id}  {run.link}".rstrip())
            else:
                click.echo(f"{'incomplete':>10}: {run.target.id}: {'; '.join(run.problems)}")
    if not report.whole:
        broken = sum(not run.whole for run in report.runs)
        merged = any(run.target.kind == "merged" for run in report.runs)
        mend = (  # (sync takes no --uploaded-by: its runs would not be these)
            " as these options make them (give the options the runs were synced with, such "
            f"as --skew-metrics); {report.mending(merged)}"
            if uploaded_by == "wbmerge"
            else " (uploaded by plain `wandb sync`; each run's line says what it lacks)"
        )
        raise WbmergeError(
            f"{broken} of {len(report.runs)} runs are not whole on the server{mend}", exit_code=1
        )


@main.command("follow")
@merge_options
@upload_options
@follow_options("")
@one_line_errors
def follow_command(
    parallel: int,
    timeout: float,
    as_json: bool,
    interval: float,
    idle_timeout: float,
    restart_grace: float,
    quiet: bool,
    **kw: Any,
) -> None:
    """Keep the merged runs of a job that is still training up to date, while its ranks
    write offline: a round every --interval seconds merges and uploads what the ranks wrote
    since, exactly once, until every rank has finished (or --idle-timeout). The same as
    `wbmerge sync --follow`."""
    from ..upload import find_credentials

    find_credentials()
    kw["restart_grace"] = restart_grace
    _follow(parallel, timeout, interval, idle_timeout, quiet, as_json, **kw)


def _print_synced(report: SyncReport, as_json: bool) -> None:
    """The runs a sync verified (all of them, unless it failed) and their links."""
    for warning in report.warnings:
        click.echo(f"wbmerge: warning: {warning}", err=True)
    if as_json:
        click.echo(
            printable_json(
                {
                    "links": report.links,
                    "runs": [
                        {
                            "id": t.target.id,
                            "group": t.target.group,
                            "status": t.status,
                            "url": t.url,
                        }
                        for t in report.targets
                    ],
                }
            )
        )
        return
    for t in report.targets:
        click.echo(f"{t.status:>16}: {t.target.id}")
    for link in report.links:
        click.echo(f"{link['kind']}: {link['url']}")


def _follow(
    parallel: int,
    timeout: float,
    interval: float,
    idle_timeout: float,
    quiet: bool,
    as_json: bool,
    **kw: Any,
) -> None:
    """`sync --follow`: a line per round (unless quiet), the links at the end."""
    from .. import api
    from ..follow import idle_warning, round_lines

    def on_round(report: Any) -> None:
        lines = round_lines(report)
        for line in lines[1:]:  # failures and what is waited for: always said
            click.echo(f"wbmerge: warning: {line}", err=True)
        if not quiet:
            click.echo(lines[0], err=as_json)  # (stdout is the JSON's, with --json)

    def on_idle(unfinished: list[str]) -> None:
        click.echo(f"wbmerge: warning: {idle_warning(idle_timeout, unfinished)}", err=True)

    for path in kw["paths"]:  # (a job may not have made its directory yet: a typo may be)
        if not os.path.lexists(path):
            click.echo(
                f"wbmerge: warning: {path} does not exist yet; waiting for runs to "
                "appear there (Ctrl-C stops)",
                err=True,
            )
    try:
        result = api.follow(
            interval=interval,
            idle_timeout=idle_timeout,
            parallel=parallel,
            timeout=timeout,
            on_round=on_round,
            on_wait=_say_waiting,
            on_idle=on_idle,
            **kw,
        )
    except KeyboardInterrupt:
        click.echo(
            "wbmerge: interrupted; the runs keep what was sent, still running "
            "(`wbmerge sync` of the same paths completes them)",
            err=True,
        )
        sys.exit(130)
    except api.UploadFailed as exc:  # the last sync's: as a one-shot sync says it
        _print_synced(exc.report, as_json)
        raise
    for warning in result.final_sync.warnings if result.final_sync else []:
        click.echo(f"wbmerge: warning: {warning}", err=True)
    if as_json:
        click.echo(printable_json({"rounds": result.rounds, "links": result.links}))
        return
    for link in result.links:
        click.echo(f"{link['kind']}: {link['url']}")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--out", "-o", required=True, type=click.Path(), help="The Parquet file to write.")
@click.option("--job", help="Only this job id (default: every job found).")
@click.option("--wide", is_flag=True, help="One row per rank and step, a column per history key.")
@_with_rank_options
@one_line_errors
def export(
    paths: tuple[str, ...],
    out: str,
    job: str | None,
    wide: bool,
    label_pattern: str | None,
    ranks_file: str | None,
    primary: tuple[str, ...],
) -> None:
    """Write every rank's history and system metrics to one Parquet file."""
    from .. import api
    from ..identify import few_ranks

    result = api.export(
        paths,
        out,
        job=job,
        wide=wide,
        label_pattern=label_pattern,
        ranks_file=ranks_file,
        primary=primary,
    )
    for job_id, missing in result.missing.items():
        click.echo(
            f"wbmerge: warning: job {job_id}: rank(s) {few_ranks(missing)} have no "
            "offline run; the export covers the others",
            err=True,
        )
    for line in [*result.warnings, *result.damage]:
        click.echo(f"wbmerge: warning: {line}", err=True)
    shape = "rows (rank x step)" if wide else "values"
    click.echo(
        f"wrote {result.rows} {shape} of {result.ranks} rank{'s' * (result.ranks != 1)} "
        f"(job {', '.join(result.jobs)}) to {result.path}"
    )


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--metric", "-m", "metrics", multiple=True, help="A metric key (repeatable).")
@click.option("--job", help="Only this job id (default: every job found).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--rank-stats",
    is_flag=True,
    help="Add min, median, max, mean across ranks (and their ranks) at the last step.",
)
@click.option(
    "--html",
    "html_out",
    type=click.Path(dir_okay=False),
    help="Also write the report as one self-contained page (charts, no script).",
)
@_with_rank_options
@one_line_errors
def report(
    paths: tuple[str, ...],
    metrics: tuple[str, ...],
    job: str | None,
    as_json: bool,
    rank_stats: bool,
    html_out: str | None,
    label_pattern: str | None,
    ranks_file: str | None,
    primary: tuple[str, ...],
) -> None:
    """Per-rank skew of each metric: which rank is slow, and by how much."""
    from .. import api
    from ..analyse import format_report

    reports = api.report(
        paths,
        metrics=metrics,
        job=job,
        label_pattern=label_pattern,
        ranks_file=ranks_file,
        primary=primary,
        rank_stats=rank_stats,
        html=html_out,
    )
    for line in (line for r in reports for line in [*r.warnings, *r.damage]):
        click.echo(f"wbmerge: warning: {line}", err=True)
    if html_out is not None:
        jobs = ", ".join(r.job_id for r in reports)
        click.echo(f"wrote the report of job {jobs} to {html_out}", err=True)
    if as_json:
        click.echo(printable_json([r.to_dict() for r in reports]))
    else:
        click.echo(format_report(reports, color=sys.stdout.isatty()), nl=False)

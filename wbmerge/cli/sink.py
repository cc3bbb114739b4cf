"""`wbmerge sink serve` and `wbmerge sink show`: the local sink's commands, beside the
main flow (`cli` adds them to the `wbmerge` group)."""

from __future__ import annotations

import json
import os

import click

from ..errors import WbmergeError
from .exits import one_line_errors

DEFAULT_SINK_DATA = "./wbmerge-sink"


@click.group()
def sink() -> None:
    """The local W&B-compatible sink: the quickstart's upload target and the tests' server.

    A sync goes to it when WANDB_BASE_URL names it (otherwise to W&B itself)."""


@sink.command("serve")
@click.option(
    "--port",
    default=8765,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port on 127.0.0.1 (0: any free).",
)
@click.option("--data", "data_dir", default=DEFAULT_SINK_DATA, show_default=True, type=click.Path())
@click.option(
    "--allow-faults", is_flag=True, help="Let POST /api/faults inject faults (for tests)."
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    help="Inject a fault, e.g. 'file_stream=500@2' (allows faults).",
)
@click.option("--port-file", type=click.Path(), help="Write the bound port to this file.")
@click.option(
    "--like-wandb",
    is_flag=True,
    help="Behave like W&B's cloud: all of the behaviours below on (docs/sink.md).",
)
@click.option(
    "--write-cursor/--no-write-cursor",
    default=None,
    help="Keep a write position per run: a batch sent past it lands at it (wandb#12269).",
)
@click.option(
    "--lag",
    type=click.FloatRange(0, 600),
    metavar="SECONDS",
    help="Answer line counts, history tail and summary as of SECONDS ago (--like-wandb: 3).",
)
@click.option(
    "--tail-lag",
    type=click.FloatRange(0, 600),
    metavar="SECONDS",
    help="Answer the history tail and summary as of SECONDS ago (default: as --lag).",
)
@click.option(
    "--sampling/--no-sampling",
    default=None,
    help="Answer a sample of a history range holding more rows than asked for.",
)
@click.option(
    "--limits/--no-limits",
    default=None,
    help="Answer 429 with Retry-After past W&B's rate limits; refuse over-long history lines.",
)
@click.option(
    "--run-rate",
    type=click.FloatRange(min=0.1),
    metavar="N",
    help="file_stream requests a second per run (default 2; turns --limits on).",
)
@click.option(
    "--project-rate",
    type=click.FloatRange(min=0.1),
    metavar="N",
    help="Requests a second per project (default 500; turns --limits on).",
)
@click.option(
    "--project-bytes",
    type=click.FloatRange(min=1),
    metavar="N",
    help="Request bytes a second per project (default 120e6; turns --limits on).",
)
@one_line_errors
def sink_serve(
    port: int,
    data_dir: str,
    allow_faults: bool,
    faults: tuple[str, ...],
    port_file: str | None,
    like_wandb: bool,
    write_cursor: bool | None,
    lag: float | None,
    tail_lag: float | None,
    sampling: bool | None,
    limits: bool | None,
    run_rate: float | None,
    project_rate: float | None,
    project_bytes: float | None,
) -> None:
    """Serve the sink on 127.0.0.1 until interrupted (stop it with `kill PID`).

    By default it is an ideal server; --like-wandb, or each behaviour's own switch, makes
    it behave as W&B's cloud does where that differs (docs/sink.md)."""
    from ..sink import LikeWandb, parse_fault, serve

    like = LikeWandb.from_switches(
        like_wandb,
        write_cursor,
        lag,
        sampling,
        limits,
        run_rate,
        project_rate,
        project_bytes,
        tail_lag,
    )

    for spec in faults:
        try:
            parse_fault(spec)
        except ValueError as exc:
            raise WbmergeError(str(exc)) from None
    try:
        serve(data_dir, port, list(faults), port_file, allow_faults, like)
    except OSError as exc:
        raise WbmergeError(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    except ValueError as exc:  # an unsafe data directory (a symlink in it), a bad secret file
        raise WbmergeError(f"cannot serve from {data_dir}: {exc}") from None


@sink.command("show")
@click.argument("run_path", required=False)
@click.option(
    "--url",
    default="http://127.0.0.1:8765",
    show_default=True,
    envvar="WANDB_BASE_URL",
    help="The sink's address; WANDB_BASE_URL when set.",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(),
    help="The sink's data directory, whose api-key file holds its key. Default: the key in "
    "WANDB_API_KEY, else ./wbmerge-sink's.",
)
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def sink_show(run_path: str | None, url: str, data_dir: str | None, as_json: bool) -> None:
    """List the sink's runs, or show one: RUN_PATH is ENTITY/PROJECT/RUN_ID."""
    import urllib.error

    from ..sink import SinkClient

    client = SinkClient(url, _sink_key(data_dir))
    try:
        if run_path is None:
            runs = client.runs()
            if as_json:
                click.echo(json.dumps(runs, indent=2))
            if not runs and not as_json:
                click.echo(f"no runs on the sink at {url} yet", err=True)
            for r in [] if as_json else runs:
                click.echo(
                    f"{r['entity']}/{r['project']}/{r['id']}  group={r['group'] or '-'}  "
                    f"state={r['state']}  exit={r['exit_code']}"
                )
            return
        parts = run_path.strip("/").split("/")
        if len(parts) != 3:
            raise WbmergeError("RUN_PATH must be ENTITY/PROJECT/RUN_ID")
        run = client.run(*parts)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and run_path is not None:
            raise WbmergeError(
                f"no run {run_path.strip('/')} on the sink at {url} "
                "(`wbmerge sink show` lists its runs)"
            ) from None
        if exc.code == 401:
            raise WbmergeError(
                f"the sink at {url} refused the key (HTTP 401): name its data directory "
                "with --data, or set WANDB_API_KEY to the key `wbmerge sink serve` printed"
            ) from None
        raise WbmergeError(f"{url}: {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise WbmergeError(f"cannot reach the sink at {url}: {exc.reason}") from None
    if as_json:
        click.echo(json.dumps(run, indent=2))
        return
    click.echo(
        f"{run['entity']}/{run['project']}/{run['id']}: {run['state']} (exit {run['exit_code']})"
    )
    click.echo(f"  group {run['group'] or '-'}, job type {run['job_type'] or '-'}")
    click.echo(
        f"  history rows {len(run['history'])}, system metric rows {len(run['system_metrics'])}"
    )
    click.echo(f"  console lines {len(run['console'])}, files {len(run['files'])}")
    click.echo(f"  summary keys: {', '.join(sorted(run['summary']))}")


def _sink_key(data_dir: str | None) -> str:
    """The key `sink show` sends: --data's, else WANDB_API_KEY, else ./wbmerge-sink's."""
    from ..sink import read_api_key

    if data_dir is None and os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"]
    try:
        return read_api_key(data_dir or DEFAULT_SINK_DATA)
    except ValueError as exc:
        raise WbmergeError(f"{exc}; name the sink's data directory with --data") from None

"""The `wbmerge` command line: a thin click layer over the library."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from . import __version__
from .errors import WbmergeError


def _one_line_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input is one line on stderr and exit 2; a bug says so, still without a traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except WbmergeError as exc:
            click.echo(f"wbmerge: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("wbmerge: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # the last line of defence of the CLI
            if os.environ.get("WBMERGE_DEBUG"):
                raise
            click.echo(
                f"wbmerge: internal error: {type(exc).__name__}: {exc} "
                "(rerun with WBMERGE_DEBUG=1 for a traceback)",
                err=True,
            )
            sys.exit(70)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="wbmerge")
def main() -> None:
    """Merge and upload the offline W&B runs of every rank of a distributed job."""


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array, one object per run.")
@_one_line_errors
def inspect(paths: tuple[str, ...], as_json: bool) -> None:
    """List the offline runs under PATHS: rank, label, rows, completeness, damage."""
    from .inspect import format_report, inspect_runs

    rows = inspect_runs(paths)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(format_report(rows), nl=False)


@main.group()
def sink() -> None:
    """The local W&B-compatible sink: default upload target and test backend."""


@sink.command("serve")
@click.option("--port", default=8765, show_default=True, help="Port on 127.0.0.1 (0: any free).")
@click.option("--data", "data_dir", default="./wbmerge-sink", show_default=True, type=click.Path())
@click.option("--fault", "faults", multiple=True, help="Inject a fault, e.g. 'file_stream=500@2'.")
@click.option("--port-file", type=click.Path(), help="Write the bound port to this file.")
@_one_line_errors
def sink_serve(port: int, data_dir: str, faults: tuple[str, ...], port_file: str | None) -> None:
    """Serve the sink on 127.0.0.1 until interrupted."""
    from .sink.faults import parse_fault
    from .sink.server import serve

    for spec in faults:
        try:
            parse_fault(spec)
        except ValueError as exc:
            raise WbmergeError(str(exc)) from None
    try:
        serve(data_dir, port, list(faults), port_file)
    except OSError as exc:
        raise WbmergeError(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}") from None


@sink.command("show")
@click.argument("run_path", required=False)
@click.option("--url", default="http://127.0.0.1:8765", show_default=True, envvar="WANDB_BASE_URL")
@click.option("--json", "as_json", is_flag=True)
@_one_line_errors
def sink_show(run_path: str | None, url: str, as_json: bool) -> None:
    """List the sink's runs, or show one: RUN_PATH is ENTITY/PROJECT/RUN_ID."""
    import urllib.error

    from .sink.client import SinkClient

    client = SinkClient(url)
    try:
        if run_path is None:
            runs = client.runs()
            if as_json:
                click.echo(json.dumps(runs, indent=2))
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

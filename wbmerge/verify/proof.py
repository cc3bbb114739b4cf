"""What proves a run on the server: one list of checks, run in one place.

Each check takes the run as staged and as the server holds it (`RunOnServer`) and gives
the lines that say what is missing or wrong, [] when nothing is. `prove` runs a list in
order and stops at the first check that finds problems, since a later check would only
repeat them at more cost: rows counted short are not read back.

- `AFTER_UPLOAD`: what a sync checks once `wandb sync` has sent a run.
- `WHOLE`: what a run the server holds already must be to count as sent (a sync then
  sends nothing), and what `wbmerge verify` checks of every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..upload import Delivery, Held, ServerClient
from ..wandbcore import StagedContent, logged_config_keys
from .artifactcheck import artifacts_missing
from .readback import not_whole_on_server, rows_held, saved_files_missing
from .remainder import shortfall
from .whole import config_not_logged, logged_entries_missing, metric_definitions_missing


@dataclass
class RunOnServer:
    """One staged run and what the server answered of it (`ServerClient.held`)."""

    client: ServerClient
    entity: str | None
    project: str
    delivery: Delivery
    held: Held
    content: StagedContent
    every_value: bool = False  # read back every value of every row, not a sample


Check = Callable[[RunOnServer], list[str]]


def counts(run: RunOnServer) -> list[str]:
    """Rows, system metrics and console lines, as the server counts them."""
    return shortfall(run.content, run.held)


def whole(run: RunOnServer) -> list[str]:
    """State, names, tags, config, summary, metric definitions and files, as a whole upload
    leaves them."""
    return not_whole_on_server(
        run.client, run.entity, run.project, run.delivery, run.held, run.content
    )


def checked_config_keys(
    delivery: Delivery, content: StagedContent | None = None
) -> frozenset[str] | None:
    """The config keys the staged log's records set, all a server may hold of the run;
    None where its config is not checked so (`Delivery.config_checked`). The one source of
    the keys for the check after an upload, of a run found whole, and before one. Taken
    from `content` where it counted them (`StagedContent.config_keys`, in the pass that
    counted the rest), else read from the staged log."""
    if not delivery.config_checked:
        return None
    if content is not None and content.config_keys is not None:
        return content.config_keys
    return logged_config_keys(delivery.log)


def config(run: RunOnServer) -> list[str]:
    """No config key that the files do not set: the server keeps a key once sent, so an
    earlier upload of other files leaves its keys."""
    keys = checked_config_keys(run.delivery, run.content)
    return [] if keys is None else config_not_logged(run.held, keys)


def saved_files(run: RunOnServer) -> list[str]:
    """Each file saved with `wandb.save`, at its size."""
    if not run.delivery.saved_files:
        return []
    return saved_files_missing(run.client, run.entity, run.project, run.delivery)


def metric_definitions(run: RunOnServer) -> list[str]:
    """Each `define_metric`, in the run's config."""
    return metric_definitions_missing(run.content, run.held)


def logged_entries(run: RunOnServer) -> list[str]:
    """Each rank's charts and class names (config entries keyed by a history key)."""
    return logged_entries_missing(run.content, run.held)


def artifacts(run: RunOnServer) -> list[str]:
    """Each artifact logged, committed under the run with every file."""
    if not run.delivery.artifacts:
        return []
    entity = run.entity or run.held.entity
    return artifacts_missing(run.client, entity, run.project, run.delivery)


def rows(run: RunOnServer) -> list[str]:
    """Every history row read back once, at its step, with its values."""
    return rows_held(
        run.client, run.entity, run.project, run.delivery, run.held, run.content, run.every_value
    )


AFTER_UPLOAD: tuple[Check, ...] = (
    counts,
    config,
    saved_files,
    metric_definitions,
    logged_entries,
    artifacts,
    rows,
)
# (`whole` compares the metric definitions, charts and class names too)
WHOLE: tuple[Check, ...] = (counts, whole, rows, artifacts)


def prove(run: RunOnServer, checks: Sequence[Check]) -> list[str]:
    """The problems of the first check that finds any; [] when every check passes."""
    for check in checks:
        problems = check(run)
        if problems:
            return problems
    return []

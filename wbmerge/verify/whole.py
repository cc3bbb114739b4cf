"""Whether the server holds a run whole already, as a whole upload of the staged run
leaves it: then sending it again would only do harm. Pure functions.

It would harm because of how wandb-core (0.31) sets a run's summary: the summary's `_step`
is the `_step` of the last history row an upload sends, and nothing else sets it. An upload
that sends no row (every row is on the server) replaces the summary with one without
`_step`. So a run found whole is verified without being sent (`Deliverer.prepare`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

import yaml

from ..identify import few
from ..upload import Held, RunListing
from ..wandbcore import (
    LoggedRun,
    StagedContent,
    definitions_missing,
    entries_missing,
    held_definitions,
)
from .remainder import config_left_behind, same_value, shortfall

# Files wandb-core writes itself as it uploads a run (from the config, the summary, the
# console and the environment record), whatever a staged `files/` holds under these names.
MADE_BY_UPLOAD = frozenset(
    {"config.yaml", "wandb-summary.json", "output.log", "wandb-metadata.json"}
)


def files_expected(staged_files: dict[str, int], staged: StagedContent) -> dict[str, int | None]:
    """The files a whole upload of a staged run leaves on the server, by name: the size of
    each file of its `files/` (`staged_files`), None where only the name can be foretold.

    wandb-core always puts `config.yaml` and `wandb-summary.json` (measured with wandb
    0.31), `output.log` when there is console output and `wandb-metadata.json` when the
    log holds an environment record; it writes these itself, so their contents are not
    the staged ones. Example: a run with console lines and `files/media/a.png` of 90 bytes
    expects {"media/a.png": 90, "config.yaml": None, "wandb-summary.json": None,
    "output.log": None}.
    """
    expected: dict[str, int | None] = {
        name: None if name in MADE_BY_UPLOAD else size for name, size in staged_files.items()
    }
    expected["config.yaml"] = expected["wandb-summary.json"] = None
    if staged.console_lines:
        expected["output.log"] = None
    if staged.metadata:
        expected["wandb-metadata.json"] = None
    return expected


def files_missing(expected: dict[str, int | None], held: dict[str, int]) -> list[str]:
    """What the server lacks of the `expected` files (`files_expected`), given the sizes of
    the files it holds; [] when it holds every one at its size."""
    problems = []
    for name, size in expected.items():
        if name not in held:
            problems.append(f"file {name} not on the server")
        elif size is not None and held[name] != size:
            problems.append(f"file {name} holds {held[name]} bytes of {size}")
    return problems


def files_changed(staged_md5s: dict[str, str], listing: RunListing) -> list[str]:
    """The staged files (by their MD5s, `staging.staged_md5s`) that the server holds at
    their size but with other content, as a later version whose upload failed leaves
    them; [] when none. A file the server gives no MD5 of cannot be shown to be the
    staged one, so it counts as changed."""
    return [
        f"file {name} is not the staged one (MD5)"
        for name, md5 in staged_md5s.items()
        if listing.md5s.get(name) != md5
    ]


def not_held_whole(
    staged: StagedContent,
    held: Held,
    listing: RunListing,
    expected_files: dict[str, int | None],
    logged: LoggedRun,
    exit_code: int,
    config_checked: bool = True,
) -> list[str]:
    """What keeps the server's run from being what a whole upload of the staged run leaves;
    [] when it is. `listing` is the server's state, names and files; `expected_files` what
    the upload would put (`files_expected`); `logged` the names, tags, config and summary
    the staged log gives the run (a name it leaves empty is not compared); `exit_code` the
    staged one. Keys that start with `_` are wandb's own (`_step`, `_runtime`, `_wandb`).
    `config_checked` (`Delivery.config_checked`): a config key the server holds that none
    of the log's records sets fails the run, as it fails the check after an upload.

    Example: a run whose rows all arrived, but whose upload was stopped before its last
    request, gives ["state running, a whole upload leaves finished"]; one whose summary
    was edited on the server since gives ["summary keys differ: loss"]."""
    problems = shortfall(staged, held)
    state = "finished" if exit_code == 0 else "failed"
    if listing.state != state:
        problems.append(f"state {listing.state or 'unknown'!r}, a whole upload leaves {state}")
    for what, mine, theirs in zip(
        ("display name", "group", "job type"), logged.names, listing.names, strict=True
    ):
        if mine and mine != theirs:
            problems.append(f"{what} {theirs!r}, this upload gives {mine!r}")
    missing_tags = [tag for tag in logged.tags if tag not in held.tags]
    if missing_tags:
        problems.append(f"tags not on the server: {few(missing_tags)}")
    config = _unwrapped(_json_object(held.config_json))
    summary = _json_object(held.summary_json)
    for what, mine, theirs in (
        ("config", logged.config, config),
        ("summary", logged.summary, summary),
    ):
        differ = [
            key
            for key, value in mine.items()
            if not key.startswith("_") and not (key in theirs and same_value(value, theirs[key]))
        ]
        if differ:
            problems.append(f"{what} keys differ: {few(differ)}")
    if config_checked:
        problems += config_not_logged(held, logged.config_keys)
    problems += metric_definitions_missing(staged, held) + logged_entries_missing(staged, held)
    return problems + files_missing(expected_files, listing.sizes)


def config_not_logged(held: Held, config_keys: Collection[str]) -> list[str]:
    """The config keys the server holds that none of the staged log's records sets
    (`config_keys`): the server keeps a key once sent, so an earlier upload of other files
    leaves its keys there."""
    left = config_left_behind(held.config_json, config_keys)
    return [f"config keys not in the files: {few(left)}"] if left else []


def metric_definitions_missing(staged: StagedContent, held: Held) -> list[str]:
    """The metric definitions a whole upload of the staged run leaves in its config (as
    wandb-core folds them, `metricdefs`) that the server's config does not hold as they
    are, a line each naming it; [] when it holds every one.

    Example: a shared run whose rank 0 defined `val/*` with step metric `epoch` and logged
    `val/acc` must hold the definition `val/acc/rank-0` stepped by `epoch/rank-0`; a
    server that kept the config without `_wandb.m` gives ["metric definition name
    'val/acc/rank-0' not on the server", ...]."""
    expected = dict(staged.metric_definitions)
    return definitions_missing(expected, held_definitions(held.config_json) if expected else {})


def logged_entries_missing(staged: StagedContent, held: Held) -> list[str]:
    """The charts and class names (`_wandb` entries keyed by a history key) a whole upload of
    the staged run leaves in its config that the server's config does not hold at their
    value, a line each naming it (`loggedentries`); [] when it holds every one.

    Example: a shared run whose rank 1 logged `wandb.plot.line` under `charts/val_curve`
    must hold the chart `charts/val_curve/rank-1`; a server that kept the config without
    `_wandb.visualize` gives ["chart 'charts/val_curve/rank-1' not on the server", ...]."""
    if not staged.logged_entries:
        return []
    return entries_missing(dict(staged.logged_entries), held.config_json)


# The files a whole upload writes from what it sends, read back to tell whether they came
# from an upload of this very run (`made_files_stale`), with the most bytes read of each: a
# larger one is not read, and its run is sent again. YAML is read by a loader whose
# constructor is Python (a hostile 4 MB took 3-8 s of CPU and 300-600 MB), so the config's
# bound is the tightest; a config of hyperparameters is some KB.
# `wandb-metadata.json` is the environment record, written once when a run starts, so its
# name on the server suffices.
READ_BACK = {"wandb-summary.json": 8 << 20, "config.yaml": 1 << 20, "output.log": 64 << 20}


def made_files_stale(
    made: dict[str, bytes | None], staged: StagedContent, logged: LoggedRun
) -> list[str]:
    """What shows that a file wandb-core made in the server's run (`READ_BACK`, read back
    as `made`: None where it could not be read) was written by an upload of other content
    than the staged run; [] when each is what a whole upload of the staged run writes.

    A file is put whole or not at all, so a made file is some upload's whole file; it is
    stale when that upload sent other content, as when a later upload of more rows sent
    its values and was stopped before it put its files. Then `wandb-summary.json` lacks
    the staged summary or the `_step` of the last staged row; `config.yaml` lacks staged
    config; `output.log` is not what wandb-core writes of the staged console
    (`logged.console`, as `terminal.Console` makes it).
    Example: the staged run's last row is at step 29 and its summary is {"loss": 0.3}; the
    server's summary file says {"_step": 19, "loss": 0.3}, from an upload of 20 rows:
    that gives ["wandb-summary.json from another upload: _step"].
    """
    problems = []
    if "wandb-summary.json" in made:
        if made["wandb-summary.json"] is None:
            problems.append("wandb-summary.json could not be read")
        else:
            summary = _json_object(made["wandb-summary.json"])
            expected = dict(logged.summary)
            if staged.history_steps:
                expected["_step"] = staged.history_steps[-1]
            differ = [
                key
                for key, value in expected.items()
                if (key == "_step" or not key.startswith("_"))
                and not (key in summary and same_value(value, summary[key]))
            ]
            if differ:
                problems.append(f"wandb-summary.json from another upload: {few(differ)}")
    if "config.yaml" in made:
        config = _yaml_config(made["config.yaml"])
        if config is None:
            problems.append("config.yaml could not be read as a config")
        else:
            differ = [
                key
                for key, value in logged.config.items()
                if not key.startswith("_")
                and not (key in config and same_value(value, config[key]))
            ]
            if differ:
                problems.append(f"config.yaml from another upload: {few(differ)}")
    if "output.log" in made:
        if logged.console is None:
            problems.append("output.log not foretold: the console is over its limit")
        elif made["output.log"] is None:
            problems.append("output.log could not be read")
        elif made["output.log"] != logged.console:
            problems.append("output.log from another upload: not the staged console")
    return problems


_SAFE_LOADER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


class _Yaml12Loader(_SAFE_LOADER):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader (libyaml's parser where there is one), reading scalars as
    wandb-core (Go's yaml.v3, YAML 1.2) writes them: it writes 1e-05 bare, which YAML 1.1
    reads as a string, and leaves bare what YAML 1.1 alone reads as a timestamp
    (2024-05-06T07:08:09), a value (=) or a merge key (<<)."""

    yaml_implicit_resolvers = {
        first: [
            (tag, rule)
            for tag, rule in rules
            if tag.rsplit(":", 1)[-1] not in ("timestamp", "value", "merge")
        ]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _yaml_config(data: bytes | None) -> dict | None:
    """The config of a `config.yaml` (each key's `value`), None when it is not one. A
    document with aliases is not read: they could make comparing it take exponential time."""
    if data is None:
        return None
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(data, _Yaml12Loader)):
            return None
        tree = yaml.load(data, _Yaml12Loader)  # (a safe loader: plain data, no objects)
    except (yaml.YAMLError, RecursionError, ValueError):
        return None
    return _unwrapped(tree) if isinstance(tree, dict) else None


def _unwrapped(config: dict) -> dict:
    """A config as W&B keeps it, each key's `{"value": ...}`, as the values themselves."""
    return {
        key: entry["value"] if isinstance(entry, dict) and "value" in entry else entry
        for key, entry in config.items()
    }


def _json_object(text: str | bytes) -> dict:
    """The JSON object of the server's `text`; {} for anything else (then nothing matches)."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}

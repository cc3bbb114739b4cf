"""Merge: write each planned target as a new offline run directory that `wandb sync` accepts.

Pass-through targets (`new`, `auto`) copy a rank's records as raw bytes and rewrite only
the run record (`passthrough`). Shared targets merge every rank's rows by step into one
run, in two streaming passes over the ranks' logs (`shared`). The modules, one job each:

- `staging`: the entry point, `stage()`; the run directory, created and cleaned up;
- `options`: what the user chose (`MergeOptions`); `outcome`: what a merge found;
- `runrecord`: the merged run's run record (`wbmerge` config block) and exit record;
- `passthrough`: pass-through and splicing for `new` and `auto`;
- `shared`: the shared merge: its state, and its turns (read the ranks furthest behind,
  label their rows, write everything every rank has reached);
- `readers`: many ranks' logs read side by side, all their blocks walked at once;
- `labels`: the ranks' keys labelled, their rows as columns, their summaries folded;
- `rows`: merged rows and the final summary;
- `rankconfig`: the other ranks' config, where it is not the primary's, labelled;
- `loggedconfig`: each rank's chart and class-name config entries, relabelled;
- `artifacts`: artifact records filed under the target run, their files copied in;
- `console`: console lines and system metrics, labelled and merged by time.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .artifactfiles import LoggedArtifact
from .console import Spools, write_console_and_stats
from .files import check_files, files_from_dirs
from .metricglobs import glob_definitions
from .options import DEFAULT_KEY_FORMAT, MergeOptions, check_key_format
from .outcome import damage_warnings
from .passthrough import HeldUntilTheRunRecord, passed_record
from .readers import RankReaders, SourceRead
from .runrecord import exit_code, exit_record, rewrite_run
from .staging import Staged, new_run_dir, stage, staged_with_files

__all__ = [
    "DEFAULT_KEY_FORMAT",
    "HeldUntilTheRunRecord",
    "KeyTable",
    "LoggedArtifact",
    "MergeOptions",
    "MergedRankStats",
    "MergedSpreads",
    "RankReaders",
    "Rows",
    "SharedMerge",
    "SourceRead",
    "Spools",
    "Staged",
    "check_files",
    "check_key_format",
    "damage_warnings",
    "exit_code",
    "exit_record",
    "files_from_dirs",
    "glob_definitions",
    "name_id",
    "names_of",
    "new_run_dir",
    "passed_record",
    "rewrite_run",
    "shared",
    "stage",
    "staged_with_files",
    "write_console_and_stats",
]

if TYPE_CHECKING:
    from .labels import KeyTable, name_id, names_of
    from .rows import Rows
    from .rowstats import MergedRankStats, MergedSpreads
    from .shared import SharedMerge

# Imported on first use: these modules need pyarrow (85 ms of a start), which a
# pass-through sync and the command line's start do without.
_ON_FIRST_USE = {
    "KeyTable": "labels",
    "name_id": "labels",
    "names_of": "labels",
    "MergedRankStats": "rowstats",
    "MergedSpreads": "rowstats",
    "Rows": "rows",
    "SharedMerge": "shared",
}


def __getattr__(name: str) -> object:
    """A name of `_ON_FIRST_USE`, or the module `shared`, imported when first asked for."""
    if name in _ON_FIRST_USE:
        return getattr(import_module(f".{_ON_FIRST_USE[name]}", __name__), name)
    if name == "shared":  # the module, whose constants tests tune
        return import_module(".shared", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

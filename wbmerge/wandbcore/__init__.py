"""What wandb's uploader (wandb-core) makes of a log: the rows, lines and files a server ends
with.

wbmerge verifies every upload against what the ranks wrote, so it must know what wandb-core
will send of a log: `sentrows` the `_step` it sends each history row at, `terminal` a port
of its terminal emulator (the console lines and `output.log` it makes), `metricdefs` the
metric definitions it sends in a run's config, `loggedentries` the charts and class
names kept there, and `content` the counts of a whole log a
read at a time (its rows' steps as `stepruns`, runs of consecutive steps). All of it is
pure: it reads logs, never a server.
"""

from .content import (
    ContentCounter,
    LoggedRun,
    StagedContent,
    logged_config_keys,
    read_logged_run,
    read_staged,
    run_config_keys,
)
from .loggedentries import KEYED_KINDS, entries_missing, fold_logged_entries
from .metricdefs import Definition, definitions_missing, held_definitions
from .sentrows import item_step, json_value, sent_steps, with_step
from .stepruns import StepRuns
from .terminal import Console

__all__ = [
    "Console",
    "KEYED_KINDS",
    "ContentCounter",
    "Definition",
    "LoggedRun",
    "StagedContent",
    "StepRuns",
    "content",
    "definitions_missing",
    "entries_missing",
    "fold_logged_entries",
    "held_definitions",
    "item_step",
    "json_value",
    "logged_config_keys",
    "read_logged_run",
    "read_staged",
    "run_config_keys",
    "sent_steps",
    "sentrows",
    "with_step",
]

"""What the uploader's process runs, and how a later sync knows such a process again.

A sync started as root stops the uploaders that a killed sync left behind, with SIGKILL.
It must never stop anything else: a pid and a start time are public in /proc, so a process
is taken for an orphaned uploader only when it also runs as this user and its command line
is one that wbmerge starts (see `is_uploader`).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

# What the uploader's process runs (`python -c`): the `wandb` command's own entry point,
# given its arguments on standard input once wandb is imported and wandb-core has started.
# `wandb.setup()` is wandb's public call that starts wandb-core for the process (it loads
# the settings from the environment, as `wandb sync` does, and `wandb sync` then uses the
# wandb-core it started). The working directory leaves sys.path first (it is staging,
# never a place to import from). An end of input before any arguments (wbmerge stopped,
# or died) ends it, sending nothing.
STANDBY = """\
import json, sys
del sys.path[0]
import wandb
from wandb.cli.cli import cli
wandb.setup()
arguments = sys.stdin.readline()
if not arguments:
    sys.exit(0)
cli.main(args=json.loads(arguments), prog_name="wandb")
"""


def is_standby(argv: Sequence[str]) -> bool:
    """Whether a command line is that of the uploader's process (any Python running
    `STANDBY`: a later sync may run under another interpreter)."""
    return len(argv) == 3 and argv[1:] == ["-c", STANDBY]


def is_uploader(argv: Sequence[str], standby_pids: Collection[int]) -> bool:
    """Whether a command line is the uploader's process, or the wandb-core that one of the
    uploader processes `standby_pids` started (wandb gives it its parent's pid as `--pid`)."""
    if is_standby(argv):
        return True
    if not argv or os.path.basename(argv[0]) != "wandb-core" or "--pid" not in argv[:-1]:
        return False
    parent = argv[argv.index("--pid") + 1]
    return parent.isdigit() and int(parent) in standby_pids

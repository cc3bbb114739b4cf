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
- `artifacts`: artifact records filed under the target run, their files copied in;
- `console`: console lines and system metrics, labelled and merged by time.
"""

from ..log.steps import RESERVED, Steps
from .options import DEFAULT_KEY_FORMAT, MergeOptions, check_key_format
from .staging import Staged, stage

__all__ = [
    "DEFAULT_KEY_FORMAT",
    "RESERVED",
    "MergeOptions",
    "Staged",
    "Steps",
    "check_key_format",
    "stage",
]

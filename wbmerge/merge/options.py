"""What the user chose for a merge, the same for every target of a job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..rankstats import PerRank

DEFAULT_KEY_FORMAT = "{key}/{label}"


@dataclass
class MergeOptions:
    project: str | None = None
    entity: str | None = None
    key_format: str = DEFAULT_KEY_FORMAT
    run_mode: str = "auto"
    rank_scope: str = "global"
    job_id: str = ""
    skew_metrics: bool = False
    rank_stats: bool = False  # shared mode: per-step statistics across ranks (`rankstats`)
    per_rank: PerRank = field(default_factory=PerRank)  # shared mode: keys labelled per rank
    # Where saved files (`wandb.save` links) may also be read, beside the directory each
    # rank ran in (`savedfiles`); it changes where files are found, never what is merged.
    files_from: tuple[Path, ...] = ()

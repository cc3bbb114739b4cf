"""Plan (pure): a job's ranks -> the W&B runs to create, under names W&B accepts.

`targets` is the run_mode x rank_scope table of the online Flyte plugin (run ids, groups,
which ranks each run is made of), `wandbnames` W&B's rules for run ids, projects and
entities (the sink reads the same), and `urls` the app pages wbmerge links to. Nothing here
reads files: a `Source` carries what discovery found.
"""

from .targets import (
    RANK_SCOPES,
    RUN_MODES,
    RankScope,
    RunMode,
    Source,
    Target,
    as_logged,
    check_destination,
    check_run_id,
    plan,
    run_id_from_file,
)
from .urls import app_url, group_url, links, run_url
from .wandbnames import NAME_MAX_BYTES, NAME_MAX_CHARS, PROJECT_RESERVED, RUN_ID_RESERVED

__all__ = [
    "NAME_MAX_BYTES",
    "NAME_MAX_CHARS",
    "PROJECT_RESERVED",
    "RANK_SCOPES",
    "RUN_ID_RESERVED",
    "RUN_MODES",
    "RankScope",
    "RunMode",
    "Source",
    "Target",
    "app_url",
    "as_logged",
    "check_destination",
    "check_run_id",
    "group_url",
    "links",
    "plan",
    "run_id_from_file",
    "run_url",
]

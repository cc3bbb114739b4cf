"""The training side, the first stage: what runs on every rank while the job trains.

`topology` holds the pure rules that say who a rank is from its launcher's environment
(torchrun, SLURM, Open MPI, MPICH), the same rules the online Flyte plugin uses, and the
`RankInfo` every later stage reads back from a run. `offline` is `wbmerge.init`: an offline
W&B run per rank that records its `RankInfo` in its own config, and keeps its artifact
staging inside the run directory so that a copied run still holds its files.
"""

from .offline import (
    DATA_DIR_ENV,
    JOB_ID_ENV,
    RUN_DATA_DIR,
    detect_rank,
    init,
    keep_artifact_staging,
    rank_config,
    rank_metadata,
    resolve_job_id,
)
from .topology import (
    MAX_RANKS,
    METADATA_KEY,
    SINGLE_PROCESS,
    RankInfo,
    from_env,
    label_for,
    rank_number,
    slurm_task,
    validate,
    with_job,
)

__all__ = [
    "DATA_DIR_ENV",
    "JOB_ID_ENV",
    "MAX_RANKS",
    "METADATA_KEY",
    "RUN_DATA_DIR",
    "SINGLE_PROCESS",
    "RankInfo",
    "detect_rank",
    "from_env",
    "init",
    "keep_artifact_staging",
    "label_for",
    "rank_config",
    "rank_metadata",
    "rank_number",
    "resolve_job_id",
    "slurm_task",
    "validate",
    "with_job",
]

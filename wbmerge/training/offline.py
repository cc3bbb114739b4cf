"""The training side: one offline W&B run per rank that knows which rank wrote it.

`wbmerge.init(...)` is `wandb.init(...)` for distributed jobs. It works out the rank from
the launcher's environment (torchrun, SLURM's srun, Open MPI, MPICH), writes offline, labels the run like the Flyte plugin does, and
records a `wbmerge` block (rank, world size, worker, label, restart, job id) in the run's
config, i.e. inside the `.wandb` file, so that a copied file still describes itself.

Users who keep their own `wandb.init` add the same block with one argument:
`wandb.init(..., config=wbmerge.rank_config(config))`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import WbmergeError
from . import topology
from .topology import METADATA_KEY, RankInfo

JOB_ID_ENV = "WBMERGE_JOB_ID"
DATA_DIR_ENV = "WANDB_DATA_DIR"  # wandb reads it at each `add_file` for its artifact staging
RUN_DATA_DIR = "wandb-data"  # the rank's WANDB_DATA_DIR, inside its run directory


def detect_rank(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's RankInfo: the launcher's variables (torchrun's first), else an
    initialised process group, else a single process. The job id is left as the environment gives it (maybe None)."""
    env = os.environ if env is None else env
    info = topology.from_env(env)
    group = _process_group_rank()
    if group is not None and (
        info is None or (info.rank, info.world_size) != (group.rank, group.world_size)
    ):
        # The process group is what the job really runs: a launcher's variables that
        # disagree with it describe another layer (processes spawned inside one task).
        return group
    return info or topology.SINGLE_PROCESS


def _process_group_rank() -> RankInfo | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return RankInfo(
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", rank % local_world)),
        world_size=world,
        local_world_size=local_world,
        worker=int(os.environ.get("GROUP_RANK", rank // local_world)),
    )


def resolve_job_id(info: RankInfo, job_id: str | None = None) -> str:
    """The id shared by every rank of one job.

    In order: the argument, `WBMERGE_JOB_ID`, torch elastic's run id, rank 0's fresh id
    broadcast over an initialised process group, a fresh id for a single process.
    """
    for candidate in (job_id, os.environ.get(JOB_ID_ENV), info.job_id):
        if candidate:
            return str(candidate)
    if info.world_size == 1:
        return uuid.uuid4().hex[:12]
    broadcast = _broadcast_from_rank0(uuid.uuid4().hex[:12])
    if broadcast:
        return broadcast
    raise WbmergeError(
        "no job id shared by all ranks: launch with `torchrun --rdzv-id ID`, set "
        f"{JOB_ID_ENV}, pass job_id=..., or call wbmerge.init after init_process_group"
    )


def _broadcast_from_rank0(candidate: str) -> str | None:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    box = [candidate]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def rank_metadata(job_id: str | None = None, **defaults: Any) -> dict[str, Any]:
    """The `wbmerge` config block for this process (extra keys, e.g. run_mode, kept)."""
    info = detect_rank()
    info = topology.with_job(info, resolve_job_id(info, job_id))
    block = info.to_metadata()
    block.update({k: v for k, v in defaults.items() if v is not None})
    return block


def rank_config(config: Mapping[str, Any] | None = None, *, job_id: str | None = None) -> dict:
    """`config` plus this rank's `wbmerge` block: the one argument to add to `wandb.init`."""
    return {**(dict(config) if config else {}), METADATA_KEY: rank_metadata(job_id)}


def init(
    *,
    job_id: str | None = None,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    flush_every: float | None = None,
    **wandb_init_kwargs: Any,
) -> Any:
    """`wandb.init` for one rank of a distributed job, offline unless asked otherwise.

    `run_mode` / `rank_scope`, when given, are recorded as the merge's defaults for the job.
    `flush_every` (seconds) makes wandb write what the run logged to its `.wandb` file at
    least that often (wandb's `x_transaction_log_flush_interval`, 15 s by default), which
    bounds how late `wbmerge sync --follow` can see a rank that logs rarely.

    Accepts every `wandb.init` argument. Adds the rank's `wbmerge` block to the config
    and the plugin's `x_label` to the settings (a label the user set is kept). Points
    `WANDB_DATA_DIR` of this process into the run's directory (`keep_artifact_staging`).
    """
    import wandb

    block = rank_metadata(job_id, run_mode=run_mode, rank_scope=rank_scope)
    kwargs = dict(wandb_init_kwargs)
    if "mode" not in kwargs and not os.environ.get("WANDB_MODE"):
        kwargs["mode"] = "offline"
    kwargs["settings"] = _with_label(kwargs.get("settings"), block["label"])
    if flush_every is not None:
        kwargs["settings"] = _with_flush_interval(kwargs["settings"], flush_every)

    config = kwargs.get("config")
    if config is None or isinstance(config, Mapping):
        kwargs["config"] = {**(config or {}), METADATA_KEY: block}
        return keep_artifact_staging(wandb.init(**kwargs))
    run = wandb.init(**kwargs)  # a config file path or namespace: add the block after
    run.config.update({METADATA_KEY: block}, allow_val_change=True)
    return keep_artifact_staging(run)


def keep_artifact_staging(run: Any) -> Any:
    """Point this process's `WANDB_DATA_DIR` at `wandb-data/` inside `run`'s directory, so
    that wandb stages the files of the rank's artifacts (`artifacts/staging/` of it) with
    the run: a run directory copied to another machine (the Flyte hand-off, rsync) keeps
    them, and `wbmerge sync` reads them there. wandb 0.31 has no setting for the staging
    directory; it reads the variable each time a file is added, so setting it after
    `wandb.init` takes effect for every artifact the run logs. When the run finishes the
    variable is given back the value it had before (unset if it was). Returns `run`."""
    sync_dir = getattr(getattr(run, "settings", None), "sync_dir", None)
    if sync_dir:
        before = os.environ.get(DATA_DIR_ENV)
        ours = os.environ[DATA_DIR_ENV] = os.path.join(sync_dir, RUN_DATA_DIR)
        _at_finish(run, lambda: _restore_data_dir(before, ours))
    return run


def _restore_data_dir(before: str | None, ours: str) -> None:
    """Give the process back the `WANDB_DATA_DIR` it had before the run (`before`; None:
    unset), so that what it does after the run (another `wandb.init`, a `wandb.Artifact`
    of its own) does not stage files in a finished run's directory. A value set since
    (not `ours`) is the caller's, and kept."""
    if os.environ.get(DATA_DIR_ENV) != ours:
        return
    if before is None:
        os.environ.pop(DATA_DIR_ENV, None)
    else:
        os.environ[DATA_DIR_ENV] = before


def _at_finish(run: Any, call: Callable[[], None]) -> None:
    """Have `call` run when `run` finishes, however it does (`run.finish()`,
    `wandb.finish()`, the end of a `with` block), after its last records are written.
    wandb 0.31 has no public hook for this: its runs keep a list of teardown hooks
    (`Run._teardown_hooks`, a late stage after the last records), which is used where it
    is found; elsewhere the variable stays set (see ARCHITECTURE.md, seams)."""
    hooks = getattr(run, "_teardown_hooks", None)
    try:
        from wandb.sdk.wandb_run import TeardownHook, TeardownStage
    except ImportError:
        return
    if isinstance(hooks, list):
        hooks.append(TeardownHook(call, TeardownStage.LATE))


def _with_label(settings: Any, label: str) -> Any:
    import wandb

    if settings is None:
        return wandb.Settings(x_label=label)
    if isinstance(settings, Mapping):
        return {"x_label": label, **settings}
    if not getattr(settings, "x_label", None):
        settings.x_label = label
    return settings


FLUSH_SETTING = "x_transaction_log_flush_interval"


def _with_flush_interval(settings: Any, seconds: float) -> Any:
    """`settings` with wandb's transaction-log flush interval set (wandb 0.31 has it; older
    versions write the file only in 32 KiB blocks, which nothing can shorten)."""
    import wandb

    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
        raise WbmergeError(f"flush_every must be a positive number of seconds, not {seconds!r}")
    if FLUSH_SETTING not in getattr(wandb.Settings, "model_fields", {}):
        raise WbmergeError(
            f"flush_every needs a wandb that has {FLUSH_SETTING} (0.31 has it; "
            f"wandb {wandb.__version__} writes a run's file in 32 KiB blocks only)"
        )
    if isinstance(settings, Mapping):
        return {**settings, FLUSH_SETTING: float(seconds)}
    setattr(settings, FLUSH_SETTING, float(seconds))
    return settings

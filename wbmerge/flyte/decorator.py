"""`@wandb_init` for an `Elastic` training task: every rank gets an offline run that records
its rank and the job's run mode, as the online plugin's decorator gives every rank a run.

On the cluster the Elastic plugin's launcher starts the ranks and each one runs the decorated
function; in Flyte's local mode the task runs as one process, and the decorator starts the
ranks itself (`launcher.py`), so that a local run writes the same multi-rank runs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import training
from ..errors import WbmergeError
from .context import HANDOFFS, Settings, flyte_context, job_id, runs_root, worker_folder
from .links import training_links


@dataclass
class RankState:
    """What this rank's process knows of its job once the decorator has set it up."""

    job_id: str
    runs_dir: Path  # this node's folder: every local rank of the node writes here
    resolved: dict[str, Any]


_RUN: Any = None  # this process's run (one rank per process)
_STATE: RankState | None = None


def wandb_init(
    _func: Any = None,
    *,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    handoff: str = "blobstore",
    **init_kwargs: Any,
) -> Any:
    """Decorate an `Elastic` training task (outermost, like the plugin's `@wandb_init`):
    each rank gets an offline run with its rank metadata; run_mode and rank_scope are
    recorded in the runs as the merge's defaults. `handoff` says how the nodes' runs reach
    the merge task: "blobstore" (each node uploads its own runs to Flyte's raw data store)
    or "shared-volume" (every node mounts one volume at WBMERGE_DIR). Other arguments go to
    `wbmerge.init` (`flush_every=SECONDS` bounds how late a follower sees a rank) and on to
    `wandb.init`."""
    if handoff not in HANDOFFS:
        raise WbmergeError(f"handoff must be one of {', '.join(HANDOFFS)}, not {handoff!r}")

    def decorate(task: Any) -> Any:
        plugin = getattr(task, "plugin_config", None)
        if plugin is None or type(plugin).__name__ != "Elastic":
            raise WbmergeError(
                "wbmerge.flyte.wandb_init decorates a task whose plugin_config is Elastic"
            )
        nnodes = plugin.nnodes
        if isinstance(nnodes, str):
            nnodes = int(nnodes.split(":")[-1])
        settings = Settings(
            run_mode,
            rank_scope,
            project,
            entity,
            dict(init_kwargs),
            int(nnodes),
            int(plugin.nproc_per_node),
            handoff,
        )
        original = task.func

        @functools.wraps(original)
        def each_rank(*args: Any, **kwargs: Any) -> Any:
            resolved = settings.resolved(flyte_context())
            if "RANK" in os.environ:  # a worker of the real Elastic launcher
                return run_rank(original, args, kwargs, job_id(), resolved)
            from .launcher import launch_ranks

            return launch_ranks(original, args, kwargs, resolved, settings)

        task.func = each_rank
        task = task.override(links=(*task.links, *training_links(settings)))
        task.wbmerge_settings = settings
        return task

    return decorate if _func is None else decorate(_func)


def get_wandb_run() -> Any:
    """This rank's run (every rank has one: all ranks log offline), or None outside."""
    return _RUN


def rank_state() -> RankState:
    """The job this rank belongs to; an error outside a decorated task."""
    if _STATE is None:
        raise WbmergeError("offline_runs() is for tasks decorated with wbmerge.flyte.wandb_init")
    return _STATE


def finish_run(exit_code: int = 0) -> None:
    """Finish this rank's run (once): its offline files are whole afterwards."""
    global _RUN
    if _RUN is not None:
        _RUN.finish(exit_code=exit_code)
        _RUN = None


def run_rank(
    func: Callable[..., Any], args: tuple, kwargs: dict, job: str, resolved: dict[str, Any]
) -> Any:
    """One rank: an offline run recording its rank and the job's run mode, then the task."""
    global _RUN, _STATE
    worker = training.detect_rank().worker
    runs_dir = runs_root(job) / worker_folder(worker)
    runs_dir.mkdir(parents=True, exist_ok=True)
    _STATE = RankState(job, runs_dir, resolved)
    init_kwargs = dict(resolved["init_kwargs"])
    init_kwargs.setdefault("dir", str(runs_dir))
    _RUN = training.init(
        job_id=job,
        run_mode=resolved["run_mode"],
        rank_scope=resolved["rank_scope"],
        project=resolved["project"],
        entity=resolved["entity"],
        **init_kwargs,
    )
    try:
        result = func(*args, **kwargs)
    except BaseException:
        finish_run(exit_code=1)  # a crashed rank: a failed run (the merge warns)
        raise
    finish_run()  # the task did not call offline_runs()
    return result

"""`@wandb_init` for an `Elastic` training task: every rank gets an offline run that records
its rank and the job's run mode, as the online plugin's decorator gives every rank a run.

On the cluster the Elastic plugin's launcher starts the ranks and each one runs the decorated
function; in Flyte's local mode the task runs as one process, and the decorator starts the
ranks itself (`launcher.py`), so that a local run writes the same multi-rank runs.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..errors import WbmergeError
from .context import HANDOFFS, Settings, flyte_context, job_id
from .launcher import launch_ranks
from .links import training_links
from .rank import run_rank


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
            return launch_ranks(original, args, kwargs, resolved, settings)

        task.func = each_rank
        task = task.override(links=(*task.links, *training_links(settings)))
        task.wbmerge_settings = settings
        return task

    return decorate if _func is None else decorate(_func)

"""One rank of a decorated training task: its offline run, and what it knows of its job.

Every rank runs in a process of its own (the Elastic launcher's, or the local-mode
launcher's), so the run and the job are this process's: `run_rank` sets them up around the
task function, `get_wandb_run` gives the run to the task, and the hand-off
(`offline_runs`) finishes it and reads the job from `rank_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import training
from ..errors import WbmergeError
from .context import runs_root, worker_folder


@dataclass
class RankState:
    """What this rank's process knows of its job once the decorator has set it up."""

    job_id: str
    runs_dir: Path  # this node's folder: every local rank of the node writes here
    resolved: dict[str, Any]


_RUN: Any = None  # this process's run (one rank per process)
_STATE: RankState | None = None


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

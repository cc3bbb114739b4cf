"""A task beside the training task: `wbmerge sync --follow` of the ranks' runs while they
train, so that the runs the UI links to are live in W&B before the job ends.

    wbmerge_follow = wbmerge.flyte.follow_task(workflow_env, train)  # keep this variable name

    @workflow_env.task
    async def pipeline() -> list[str]:
        runs = await wbmerge.flyte.with_follower(wbmerge_follow, train.aio(steps=1000))
        return await wbmerge.flyte.sync(wbmerge_sync, runs)

The follower reads the runs where the ranks write them, `$WBMERGE_DIR/{job id}/...`, and
follows the jobs of its own Flyte run (job ids `{run name}-{action}`). It must see those
files while they are written: in local mode every node writes on this machine; on a
cluster that takes one volume mounted at `WBMERGE_DIR` on every node and on the follower
(`handoff="shared-volume"`). The blob-store hand-off copies the runs only when training
ends, which leaves nothing to follow. The follow runs in a child process of the task, as
the merge does; the merge task afterwards finds the runs whole on the server and sends
nothing twice.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import flyte

from ..errors import WbmergeError
from .child import run_in_child
from .context import runs_root

T = TypeVar("T")


def follow_task(
    env: flyte.TaskEnvironment, training_task: Any, name: str = "wbmerge_follow"
) -> Any:
    """A task in `env` that follows the runs `training_task` writes in this Flyte run and
    returns their links when every rank has finished. Call it through `with_follower`."""
    if not hasattr(training_task, "wbmerge_settings"):
        raise WbmergeError("follow_task follows a task decorated with wbmerge.flyte.wandb_init")

    async def wbmerge_follow(
        interval: float = 60.0,
        idle_timeout: float = 600.0,
        run_mode: str = "",
        rank_scope: str = "",
        project: str = "",
        entity: str = "",
        rank_stats: bool = False,
        per_rank: list[str] | None = None,
    ) -> list[str]:
        context = flyte.ctx()
        if context is None:
            raise WbmergeError("wbmerge.flyte tasks run inside Flyte (flyte.run or a cluster)")
        root = runs_root("-").parent  # $WBMERGE_DIR, where every job's folder is
        root.mkdir(parents=True, exist_ok=True)
        request = {
            "path": str(root),
            "job_prefix": f"{context.action.run_name}-",
            "interval": interval,
            "idle_timeout": idle_timeout,
            "run_mode": run_mode or None,
            "rank_scope": rank_scope or None,
            "project": project or None,
            "entity": entity or None,
            "rank_stats": rank_stats,
            "per_rank": list(per_rank or []),
        }
        return await run_in_child("follow", request)

    wbmerge_follow.__name__ = wbmerge_follow.__qualname__ = name
    wbmerge_follow.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    return env.task(wbmerge_follow)


async def with_follower(
    follower: Any, training: Awaitable[T], interval: float = 60.0, idle_timeout: float = 600.0
) -> T:
    """Await `training` (a training task's `.aio(...)`) with the follower task beside it;
    the training's result once both have ended. A training that fails cancels the follower
    (its runs keep what was sent; the merge task, or `wbmerge sync`, completes them)."""
    arguments = {"interval": float(interval), "idle_timeout": float(idle_timeout)}
    following = asyncio.ensure_future(follower.aio(**arguments))
    try:
        result = await training
    except BaseException:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        raise
    await following
    return result


def follow_main(request: dict) -> dict:
    """`python -m wbmerge.flyte follow REQUEST RESULT`: one follow, its links as JSON."""
    from .. import api

    options: dict[str, Any] = dict(
        run_mode=request.get("run_mode") or None,
        rank_scope=request.get("rank_scope") or None,
        project=request.get("project") or None,
        entity=request.get("entity") or None,
        rank_stats=bool(request.get("rank_stats")),
        per_rank=request.get("per_rank") or None,
    )

    from ..follow import idle_warning, round_lines
    from ..sync import UploadFailed

    def say(report: Any) -> None:
        for line in round_lines(report):
            print(line, file=sys.stderr, flush=True)

    def say_idle(unfinished: list[str]) -> None:  # (in the task's log, whatever comes next)
        print(
            f"wbmerge: warning: {idle_warning(float(request['idle_timeout']), unfinished)}",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = api.follow(
            request["path"],
            interval=float(request["interval"]),
            idle_timeout=float(request["idle_timeout"]),
            on_round=say,
            on_idle=say_idle,
            job_prefix=request["job_prefix"],
            **options,
        )
    except UploadFailed as exc:  # the runs the last sync verified, then what failed
        for target in exc.report.targets:
            print(f"{target.status:>16}: {target.target.id} {target.url}", file=sys.stderr)
        raise
    warnings = result.final_sync.warnings if result.final_sync else []
    return {"links": [link["url"] for link in result.links], "warnings": warnings}

"""The final task: fetch the handed-on runs, merge, upload with `wandb sync`, return the links.

With `rank_scope="worker"` on several nodes `sync` starts one merge task per node, all at
once (`asyncio.gather` of the task's calls, which Flyte runs as parallel actions; in local
mode `flyte.map` would run them one after another), and each downloads only its node's
folder. Every merge runs in a child process of the task: the merge is CPU work that would
otherwise hold the task's event loop, and each per-node merge keeps its own record of what
it uploaded (its targets are its own), so that merges running side by side on one machine
never write one record file at once.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import flyte
import flyte.io

from ..errors import WbmergeError
from .child import run_in_child
from .handoff import fetch_runs, read_manifest, workers_of
from .links import training_links


def merge_task(env: flyte.TaskEnvironment, training_task: Any, name: str = "wbmerge_sync") -> Any:
    """A task in `env` that merges and uploads the offline runs `training_task` returns
    (all of them, or with `worker` >= 0 that node's), returns the links, and shows them in
    the Flyte UI. Call it through `sync(...)`."""
    settings = training_task.wbmerge_settings

    async def wbmerge_sync(
        runs: flyte.io.Dir,
        run_mode: str = "",
        rank_scope: str = "",
        project: str = "",
        entity: str = "",
        worker: int = -1,
        rank_stats: bool = False,
        per_rank: list[str] | None = None,
    ) -> list[str]:
        manifest = await read_manifest(runs)
        node = worker if worker >= 0 else None
        local = await fetch_runs(runs, manifest, node)
        request = {
            "path": str(local),
            "run_mode": run_mode or None,
            "rank_scope": rank_scope or None,
            "project": project or None,
            "entity": entity or None,
            "worker": node,
            "rank_stats": rank_stats,
            "per_rank": list(per_rank or []),
        }
        return await run_in_child("merge", request)

    # Flyte finds a task on the cluster as `{func.__module__}.{func.__name__}`: the caller
    # keeps it in a module-level variable called `name`.
    wbmerge_sync.__name__ = wbmerge_sync.__qualname__ = name
    wbmerge_sync.__module__ = sys._getframe(1).f_globals.get("__name__", __name__)
    return env.task(links=training_links(settings, from_context=True))(wbmerge_sync)


async def sync(
    task: Any,
    runs: flyte.io.Dir,
    run_mode: str | None = None,
    rank_scope: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    per_node: bool = True,
    rank_stats: bool = False,
    per_rank: list[str] | None = None,
) -> list[str]:
    """Call the merge task on `runs` (once, or once per node for `rank_scope="worker"` on
    several nodes, in parallel, unless `per_node=False`), with the context its UI links are
    rendered from. Per node pays off where each task gets a machine (a cluster); in local
    mode the tasks share this machine's cores. `rank_stats` and `per_rank` are those of
    `wbmerge sync` (shared runs)."""
    manifest = await read_manifest(runs)
    workers = workers_of(manifest)
    scope = rank_scope or manifest.get("rank_scope") or "global"
    context = {"wbmerge_base": str(manifest.get("job_id") or Path(runs.path).name)}
    for key, value in (
        ("run_mode", run_mode or manifest.get("run_mode")),
        ("rank_scope", scope),
        ("project", project),
        ("entity", entity),
    ):
        if value:
            context[f"wbmerge_{key}"] = str(value)
    arguments: dict[str, Any] = {
        "run_mode": run_mode or "",
        "rank_scope": rank_scope or "",
        "project": project or "",
        "entity": entity or "",
        "rank_stats": rank_stats,
        "per_rank": list(per_rank or []),
    }
    with flyte.custom_context(**context):
        if per_node and scope == "worker" and len(workers) > 1:
            with flyte.group("wbmerge-per-node"):
                per_node = await asyncio.gather(
                    *(task.aio(runs, worker=w, **arguments) for w in workers)
                )
            return [link for links in per_node for link in links]
        return await task.aio(runs, **arguments)


def merge_and_upload(request: dict) -> dict:
    """Merge and upload the runs at `request["path"]`: the whole job, or with `worker` one
    node's runs, which must then be all of that node's ranks. Returns links and warnings."""
    from .. import api

    worker = request.get("worker")
    options: dict[str, Any] = dict(
        run_mode=request.get("run_mode") or None,
        rank_scope=request.get("rank_scope") or None,
        project=request.get("project") or None,
        entity=request.get("entity") or None,
        allow_missing_ranks=worker is not None,  # the other nodes' ranks are merged elsewhere
        rank_stats=bool(request.get("rank_stats")),
        per_rank=request.get("per_rank") or None,
    )
    planned = api.plan(request["path"], **options)
    if worker is not None:
        for job in planned:
            check_node_complete(job.job, worker)
    report = api.sync(
        request["path"], planned=planned, progress=say_bound, upload_progress=say_line, **options
    )
    return {"links": [link["url"] for link in report.links], "warnings": report.warnings}


def say_bound(staged: Any) -> None:
    """The one line of a run with more metrics than W&B recommends, in the task's log as
    soon as the run is merged, before its upload."""
    if staged.bound_notice:
        print(f"wbmerge: warning: {staged.bound_notice}", file=sys.stderr, flush=True)


def say_line(progress: Any) -> None:
    """A line the upload says (such as waiting for another writer of a run), in the task's
    log as it is said."""
    if progress.message:
        print(f"wbmerge: {progress.message}", file=sys.stderr, flush=True)


def check_node_complete(job: Any, worker: int) -> None:
    """A per-node merge has exactly that node's ranks, every one of them."""
    others = sorted({r.rank.worker for r in job.runs if r.rank.worker != worker})
    if others:
        raise WbmergeError(f"job {job.job_id}: runs of node(s) {others} in node {worker}'s folder")
    local_world = job.runs[0].rank.local_world_size
    present = {r.rank.local_rank for r in job.runs}
    missing = [lr for lr in range(local_world) if lr not in present]
    if missing:
        raise WbmergeError(
            f"job {job.job_id}: node {worker} has no offline run of local rank(s) "
            f"{', '.join(map(str, missing))} of {local_world}"
        )

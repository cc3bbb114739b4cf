"""Flyte 2: every rank of an `Elastic` training task logs offline; a final task merges and
uploads, and shows the links. Used like `flyteplugins-wandb` (install `wbmerge[flyte]`):

    @wbmerge.flyte.wandb_init(project="demo", run_mode="shared")    # outermost
    @train_env.task
    def train(steps: int) -> flyte.io.Dir:
        dist.init_process_group("gloo")
        run = wbmerge.flyte.get_wandb_run()          # this rank's offline run
        ...
        return wbmerge.flyte.offline_runs()          # every rank calls it (a barrier)

    sync_runs = wbmerge.flyte.merge_task(wf_env, train)   # the final task

    @wf_env.task
    async def pipeline() -> list[str]:
        runs = await train.aio(steps=30)
        return await wbmerge.flyte.sync(sync_runs, runs)  # merged, uploaded: the links

The job id of the offline runs is `{run_name}-{action_name}` of the training action, so
the merged run ids are the online plugin's. Each node writes its ranks' runs to its own disk
(`$WBMERGE_DIR/{job id}/worker-{w}`); when training ends every node uploads them to the
action's raw data store and rank 0 returns a Dir of all of them (`handoff.py`).

The modules, one job each: `decorator` (the training task's decorator and each rank's run),
`context` (settings, `wandb_config`, job id, directories), `links` (the W&B links in the UI),
`launcher` (local mode: the ranks of every node on this machine), `handoff` (the nodes' runs
to the merge task through the blob store), `merge_task` (the final task and `sync`),
`follow_task` (a task beside the training that keeps its runs live in W&B).
"""

from .context import RUNS_DIR_ENV, Settings, runs_root, wandb_config
from .decorator import wandb_init
from .follow_task import follow_task, with_follower
from .handoff import MANIFEST, check_reports, fetch_runs, node_files, offline_runs, read_manifest
from .links import RunLink, run_links, training_links
from .merge_task import merge_task, sync
from .rank import get_wandb_run

__all__ = [
    "MANIFEST",
    "RUNS_DIR_ENV",
    "RunLink",
    "Settings",
    "check_reports",
    "fetch_runs",
    "follow_task",
    "get_wandb_run",
    "merge_task",
    "node_files",
    "offline_runs",
    "read_manifest",
    "run_links",
    "runs_root",
    "sync",
    "training_links",
    "wandb_config",
    "wandb_init",
    "with_follower",
]

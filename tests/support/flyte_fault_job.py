"""A 2-node job in Flyte's local mode whose node FAULT_NODE loses its hand-off to the blob
store: with FAULT=raise the store refuses that node's upload, with FAULT=skip the upload
silently does nothing. Either way the workflow must fail and name the node.

    FAULT=raise FAULT_NODE=1 python tests/support/flyte_fault_job.py RAW_DATA_PATH
"""

from __future__ import annotations

import os
import sys

import flyte
import flyte.io
import flyte.storage
import torch.distributed as dist
from flyteplugins.pytorch.task import Elastic

import wbmerge.flyte

train_env = flyte.TaskEnvironment(
    name="fault_train", plugin_config=Elastic(nnodes=2, nproc_per_node=1, max_restarts=0)
)
workflow_env = flyte.TaskEnvironment(name="fault_workflow", depends_on=[train_env])


def _lose_this_nodes_upload(fault: str) -> None:
    """Stand-in for a store that fails one node: Flyte's own upload call on this node."""

    async def refuse(*args, **kwargs):
        raise PermissionError("the store refused the upload (simulated)")

    async def drop(*args, **kwargs):
        return None

    flyte.storage.put = refuse if fault == "raise" else drop


@wbmerge.flyte.wandb_init(project="fault", entity="local", run_mode="shared")
@train_env.task
def train(steps: int) -> flyte.io.Dir:
    dist.init_process_group("gloo")
    run = wbmerge.flyte.get_wandb_run()
    for step in range(steps):
        run.log({"value": float(dist.get_rank() * 100 + step)}, step=step)
    if os.environ.get("GROUP_RANK") == os.environ["FAULT_NODE"]:
        _lose_this_nodes_upload(os.environ["FAULT"])
    runs = wbmerge.flyte.offline_runs()
    dist.destroy_process_group()
    return runs


wbmerge_sync = wbmerge.flyte.merge_task(workflow_env, train)


@workflow_env.task
async def pipeline() -> list[str]:
    runs = await train.aio(steps=3)
    return await wbmerge.flyte.sync(wbmerge_sync, runs)


if __name__ == "__main__":
    flyte.init()
    try:
        run = flyte.with_runcontext(raw_data_path=sys.argv[1]).run(pipeline)
        print("LINKS", run.outputs()[0])
    except Exception as exc:
        print(f"FAILED: {exc}")
        sys.exit(1)

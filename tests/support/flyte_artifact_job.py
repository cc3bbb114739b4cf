"""A Flyte job (local mode, 1 node x 2 ranks) whose ranks each save a checkpoint with
`torch.save`, log it as a `model` artifact `ckpt` (alias `best`) and `wandb.save` it; the
runs are handed to the merge task through the raw data store, which uploads them.

    RUN_MODE=shared python tests/support/flyte_artifact_job.py RAW_DATA_PATH

Each rank writes its checkpoint to `ckpt-rank-{rank}/model.pt` under the working directory
(where the ranks ran), so the test can read the bytes each rank wrote. It prints the
links the merge task returns (`LINKS [...]`), or `FAILED: ...` and exits 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import flyte
import flyte.io
import torch
import torch.distributed as dist
import wandb
from flyteplugins.pytorch.task import Elastic

import wbmerge.flyte

train_env = flyte.TaskEnvironment(
    name="artifact_train", plugin_config=Elastic(nnodes=1, nproc_per_node=2, max_restarts=0)
)
workflow_env = flyte.TaskEnvironment(name="artifact_workflow", depends_on=[train_env])


def checkpoint_path(root: Path, rank: int) -> Path:
    return root / f"ckpt-rank-{rank}" / "model.pt"


@wbmerge.flyte.wandb_init(project="handoff", entity="local", run_mode=os.environ["RUN_MODE"])
@train_env.task
def train(steps: int) -> flyte.io.Dir:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = wbmerge.flyte.get_wandb_run()
    for step in range(steps):
        run.log({"loss": float(rank * 100 + step)}, step=step)
    path = checkpoint_path(Path.cwd(), rank)
    path.parent.mkdir(exist_ok=True)
    torch.manual_seed(rank)
    torch.save({"weights": torch.randn(64, 64), "rank": rank}, path)
    checkpoint = wandb.Artifact("ckpt", type="model", metadata={"rank": rank})
    checkpoint.add_file(str(path))
    run.log_artifact(checkpoint, aliases=["best"])
    run.save(str(path), base_path=str(path.parent))  # saved as `model.pt`
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

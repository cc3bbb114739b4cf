"""A Flyte 2 workflow: DDP training on real ranks logging offline, then the merge and upload.

    python examples/flyte_workflow.py                          # auto, 1 node x 2 ranks
    NODES=2 NPROC=2 python examples/flyte_workflow.py --run-mode shared
    NODES=2 NPROC=2 python examples/flyte_workflow.py --run-mode new --rank-scope worker
    python examples/flyte_workflow.py --run-mode shared --follow --steps 400   # live in W&B

Runs in Flyte's local mode (no cluster, no network). Uploads to WANDB_BASE_URL with
WANDB_API_KEY: start the built-in sink first (`wbmerge sink serve`, see docs/sink.md).

Flyte's local mode runs an `Elastic` task in-process, as one process. `wbmerge.flyte`'s
decorator then launches the ranks itself, as the cluster would: one torch elastic launcher
per node (NODES of them, NPROC ranks each, rendezvous on 127.0.0.1), so every rank writes
a real offline run. Each node writes to its own directory (no shared volume) and hands its
runs to Flyte's raw data store (`--raw-data-path`: a local folder, or s3://, gs://, abfs://
with the store's credentials in the environment); the merge task reads them from there.
`WBMERGE_HANDOFF=shared-volume` instead has all nodes write to one directory (WBMERGE_DIR). On a
cluster the same code runs under the Elastic plugin's launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import flyte
import flyte.io
import torch
import torch.distributed as dist
from flyteplugins.pytorch.task import Elastic
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import wbmerge.flyte

NODES = int(os.environ.get("NODES", "1"))
NPROC = int(os.environ.get("NPROC", "2"))

train_env = flyte.TaskEnvironment(
    name="wbmerge_train", plugin_config=Elastic(nnodes=NODES, nproc_per_node=NPROC, max_restarts=0)
)
workflow_env = flyte.TaskEnvironment(name="wbmerge_workflow", depends_on=[train_env])


# "blobstore" (each node uploads its runs) or "shared-volume" (one WBMERGE_DIR for all nodes)
HANDOFF = os.environ.get("WBMERGE_HANDOFF", "blobstore")


@wbmerge.flyte.wandb_init(handoff=HANDOFF)  # run_mode, rank_scope, project: from wandb_config
@train_env.task
def train(steps: int, step_seconds: float = 0.0) -> flyte.io.Dir:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = wbmerge.flyte.get_wandb_run()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(16, 1)
    generator = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        began = time.perf_counter()
        x = torch.randn(64, 16, generator=generator)
        loss = nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()  # gradients all-reduced over gloo
        optimizer.step()
        run.log(
            {
                "train/loss": loss.item(),
                "train/samples_per_sec": 64 / (time.perf_counter() - began),
            },
            step=step,
        )
        if step % 10 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(step_seconds)  # a slower job, to watch it live (--follow)
    runs = wbmerge.flyte.offline_runs()  # every rank: finish, wait for the others
    dist.destroy_process_group()
    return runs


wbmerge_sync = wbmerge.flyte.merge_task(workflow_env, train)
wbmerge_follow = wbmerge.flyte.follow_task(workflow_env, train)  # --follow: runs live in W&B


@dataclass
class Uploaded:
    flyte_run: str  # the runs' job id is "{flyte_run}-{the training action's name}"
    links: list[str]


@workflow_env.task
async def pipeline(
    steps: int = 20, run_mode: str = "auto", rank_scope: str = "global", project: str = "wbmerge-demo",
    entity: str = "local", follow: bool = False, step_seconds: float = 0.0,
) -> Uploaded:  # fmt: skip
    with wbmerge.flyte.wandb_config(
        project=project, entity=entity, run_mode=run_mode, rank_scope=rank_scope,
        flush_every=1.0 if follow else None,
    ):  # fmt: skip
        training = train.aio(steps=steps, step_seconds=step_seconds)
        if follow:  # a task beside the training keeps the runs live in W&B
            runs = await wbmerge.flyte.with_follower(wbmerge_follow, training, interval=2)
        else:
            runs = await training
    links = await wbmerge.flyte.sync(wbmerge_sync, runs, project=project, entity=entity)
    return Uploaded(flyte.ctx().action.run_name, links)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-mode", default="auto", choices=["auto", "shared", "new"])
    parser.add_argument("--rank-scope", default="global", choices=["global", "worker"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--project", default="wbmerge-demo")
    parser.add_argument("--entity", default="local")
    parser.add_argument("--raw-data-path", help="Flyte's raw data store (default: Flyte's own)")
    parser.add_argument("--json", action="store_true", help="print the links as JSON")
    parser.add_argument("--follow", action="store_true", help="keep the runs live while training")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step")
    args = parser.parse_args()
    flyte.init()
    run = flyte.with_runcontext(raw_data_path=args.raw_data_path).run(
        pipeline, steps=args.steps, run_mode=args.run_mode, rank_scope=args.rank_scope,
        project=args.project, entity=args.entity, follow=args.follow,
        step_seconds=args.step_seconds,
    )  # fmt: skip
    uploaded = run.outputs()[0]
    if args.json:
        print(json.dumps({"flyte_run": uploaded.flyte_run, "links": uploaded.links}))
    else:
        for link in uploaded.links:
            print(link)


if __name__ == "__main__":
    main()

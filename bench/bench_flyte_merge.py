"""Flyte's local mode: one merge task for all nodes vs one merge task per node, side by side.

A synthetic job of NODES x NPROC ranks is laid out as the blob-store hand-off leaves it
(`worker-{w}/` folders and the manifest, in a local raw data folder), then merged with
`rank_scope="worker"` and uploaded into a local sink twice: once by a single merge task
(`task.aio(runs, ...)`, as before the per-node split) and once through `wbmerge.flyte.sync`,
which starts one merge task per node at once. Same targets, same uploads; wall time each.
Then node 0's merge task alone: on a cluster every node's merge runs on its own machine, so
that is the per-node path's wall time there (plus starting the pods); on one machine the
per-node tasks share its cores.

    python bench/bench_flyte_merge.py --nodes 4 --nproc 2 --steps 5000 --run-mode shared
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import flyte
import flyte.io

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' writer

import wbmerge.flyte
from tests.support import synthetic
from wbmerge.flyte import node_files
from wbmerge.sink import read_api_key
from wbmerge.training import RankInfo

bench_env = flyte.TaskEnvironment(name="bench_flyte_merge")
# merge_task reads only the training task's settings (for the links it shows)
training = SimpleNamespace(wbmerge_settings=wbmerge.flyte.Settings(rank_scope="worker"))
merge = wbmerge.flyte.merge_task(bench_env, training, name="merge")


@bench_env.task
async def one_task(runs: flyte.io.Dir, run_mode: str) -> list[str]:
    return await merge.aio(runs, run_mode=run_mode, rank_scope="worker")


@bench_env.task
async def per_node(runs: flyte.io.Dir, run_mode: str) -> list[str]:
    return await wbmerge.flyte.sync(merge, runs, run_mode=run_mode, rank_scope="worker")


@bench_env.task
async def node_0_alone(runs: flyte.io.Dir, run_mode: str) -> list[str]:
    return await merge.aio(runs, run_mode=run_mode, rank_scope="worker", worker=0)


def hand_off(root: Path, job: str, nodes: int, nproc: int, steps: int, metrics: int) -> Path:
    """A job's runs as the blob-store hand-off leaves them."""
    prefix = root / job
    world = nodes * nproc
    workers = {}
    for worker in range(nodes):
        folder = prefix / f"worker-{worker}"
        for local in range(nproc):
            rank = worker * nproc + local
            info = RankInfo(rank, local, world, nproc, worker, job_id=job)
            synthetic.write_rank(folder, info, steps, metrics)
        workers[str(worker)] = {"files": node_files(folder)}
    manifest = {"format": 1, "job_id": job, "run_mode": None, "rank_scope": "worker"}
    manifest["workers"] = workers
    (prefix / wbmerge.flyte.MANIFEST).write_text(json.dumps(manifest))
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--metrics", type=int, default=20)
    parser.add_argument("--run-mode", default="shared", choices=["auto", "shared", "new"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-flyte-") as scratch:
        root = Path(scratch)
        data = root / "sink"
        data.mkdir()
        port_file = root / "port"
        sink = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wbmerge.sink",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--data",
                str(data),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.environ.update(
                WANDB_BASE_URL=f"http://127.0.0.1:{port_file.read_text()}",
                WANDB_API_KEY=read_api_key(data),
                WANDB_SILENT="true",
                WANDB_PROJECT="bench",
                WANDB_ENTITY="local",
                WBMERGE_STATE_DIR=str(root / "state"),
            )
            flyte.init()
            results = {}
            variants = (
                ("one merge task", one_task),
                ("a merge task per node", per_node),
                ("node 0's merge task alone", node_0_alone),
            )
            for name, task in variants:
                job = "bench-" + name.split()[0].replace("'s", "")
                runs = hand_off(root / "raw", job, args.nodes, args.nproc, args.steps, args.metrics)
                began = time.perf_counter()
                run = flyte.with_runcontext(raw_data_path=str(root / "flyte-raw")).run(
                    task, flyte.io.Dir(path=str(runs)), args.run_mode
                )
                links = run.outputs()[0]
                results[name] = time.perf_counter() - began
                print(f"{name}: {results[name]:.1f} s, {len(links)} link(s)", flush=True)
            print(
                f"{args.nodes} nodes x {args.nproc} ranks x {args.steps} steps x {args.metrics} "
                f"metrics, {args.run_mode}: per node {results['a merge task per node']:.1f} s "
                f"vs one task {results['one merge task']:.1f} s "
                f"({results['one merge task'] / results['a merge task per node']:.2f}x); "
                f"one node's merge alone {results[variants[2][0]]:.1f} s, what each node's "
                f"task takes when it has a machine to itself; {os.cpu_count()} cores"
            )
        finally:
            sink.terminate()
            sink.wait(timeout=30)


if __name__ == "__main__":
    main()

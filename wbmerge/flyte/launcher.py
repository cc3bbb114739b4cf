"""Flyte's local mode: start the ranks of an `Elastic` task on this machine.

Local mode runs an `Elastic` task in-process, as one process. Here the decorator launches
the ranks as the cluster would: one torch elastic launcher per node (`nnodes` of them,
`nproc_per_node` workers each, a c10d rendezvous on 127.0.0.1), each rank running the task
function inside the training action's Flyte context, as the Elastic plugin's own entrypoint
does on the cluster. With the blob-store hand-off every node gets its own `WBMERGE_DIR`, so
the nodes share no directory, as on a cluster without a shared volume.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
from flyte._context import internal_ctx

from .context import RUNS_DIR_ENV, Settings, job_id, runs_root
from .rank import run_rank

# After one node's launcher failed, how long the others may take to notice and stop on their
# own before they are terminated (a rank blocked in a collective with a dead peer waits for
# the process group's timeout otherwise, and torch elastic's agent of a node whose ranks
# succeeded waits up to 300 s at its exit barrier for the failed node), and how long after
# that they are killed with all their ranks (the agent may not act on SIGTERM while it waits).
FAILED_NODE_GRACE_SECONDS = 30.0
TERMINATE_GRACE_SECONDS = 10.0


def launch_ranks(
    func: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    resolved: dict[str, Any],
    settings: Settings,
) -> Any:
    """Run the task on `nnodes` x `nproc_per_node` real ranks on this machine; returns rank
    0's result (as Elastic does). A failed rank fails the task with that rank's error."""
    job = job_id()
    with tempfile.TemporaryDirectory(prefix="wbmerge-flyte-") as scratch:
        spec = Path(scratch) / "spec.pkl"
        result = Path(scratch) / "result.pkl"
        spec.write_bytes(
            cloudpickle.dumps(
                {
                    "func": func,
                    "args": args,
                    "kwargs": kwargs,
                    "job_id": job,
                    "resolved": resolved,
                    "task_context": internal_ctx().data.task_context,
                    "result": str(result),
                    "errors": scratch,
                }
            )
        )
        port = _free_port()
        base = runs_root(job).parent
        launchers = []
        for node in range(settings.nnodes):
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            shared = resolved.get("handoff") == "shared-volume"
            env[RUNS_DIR_ENV] = str(base if shared else base / f"node-{node}")
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(settings.nnodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                str(settings.nproc_per_node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                job,
                "--max-restarts",
                "0",
                "-m",
                "wbmerge.flyte",
                "rank",
                str(spec),
            ]
            launchers.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,  # a process group: the launcher and its ranks
                )
            )
        outputs = _wait_all(launchers)
        for output in outputs:
            sys.stdout.write(output)
        failed = [node for node, launcher in enumerate(launchers) if launcher.returncode]
        if failed:
            raise RuntimeError(_failure_message(failed, outputs, Path(scratch)))
        return cloudpickle.loads(result.read_bytes())


def _wait_all(launchers: list[subprocess.Popen]) -> list[str]:
    """Wait for every launcher, reading their output as it comes; once one failed, give the
    others a grace period, then terminate them, then kill them with their ranks."""
    import signal
    import threading

    outputs = [""] * len(launchers)

    def drain(index: int) -> None:
        outputs[index] = launchers[index].stdout.read()

    readers = [
        threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(launchers))
    ]
    for reader in readers:
        reader.start()
    failed_at = None
    while any(launcher.poll() is None for launcher in launchers):
        if failed_at is None and any(launcher.poll() for launcher in launchers):
            failed_at = time.monotonic()
        waited = time.monotonic() - failed_at if failed_at is not None else 0.0
        for launcher in launchers:
            if launcher.poll() is not None:
                continue
            if waited > FAILED_NODE_GRACE_SECONDS + TERMINATE_GRACE_SECONDS:
                os.killpg(launcher.pid, signal.SIGKILL)
            elif waited > FAILED_NODE_GRACE_SECONDS:
                launcher.terminate()
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=30)
    return outputs


def _failure_message(failed: list[int], outputs: list[str], scratch: Path) -> str:
    """The first failed rank's own error (rank order), else the launcher's last lines."""
    errors = sorted(scratch.glob("error-rank-*.txt"), key=lambda p: int(p.stem.split("-")[-1]))
    if errors:
        rank = errors[0].stem.split("-")[-1]
        return f"rank {rank} failed: {errors[0].read_text().strip()}"
    node = failed[0]
    tail = " | ".join(outputs[node].strip().splitlines()[-3:])
    return f"ranks of node {node} failed: {tail}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(spec_path: str) -> None:
    """One rank started by `launch_ranks` (`python -m wbmerge.flyte rank SPEC`): the task
    function inside the training action's context, as the Elastic plugin's entrypoint runs
    it on the cluster."""
    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    rank = os.environ.get("RANK", "0")
    try:
        with internal_ctx().replace_task_context(spec["task_context"]):
            out = run_rank(
                spec["func"], spec["args"], spec["kwargs"], spec["job_id"], spec["resolved"]
            )
    except BaseException as exc:
        message = str(exc).strip() or type(exc).__name__
        Path(spec["errors"], f"error-rank-{rank}.txt").write_text(message)
        raise
    if rank == "0":
        Path(spec["result"]).write_bytes(cloudpickle.dumps(out))

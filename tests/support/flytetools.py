"""Flyte end-to-end helpers: the example workflow (or a test job) in Flyte's local mode, and
an S3-compatible server on 127.0.0.1 (moto) standing in for a cluster's blob store."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from wbmerge.identify import discover

from ..conftest import ROOT

EXAMPLE = ROOT / "examples" / "flyte_workflow.py"
FAULT_JOB = Path(__file__).with_name("flyte_fault_job.py")
ARTIFACT_JOB = Path(__file__).with_name("flyte_artifact_job.py")


def flyte_env(sink, tmp_path: Path, nodes: int, nproc: int, extra: dict | None = None) -> dict:
    return {
        **sink.env,
        "WBMERGE_DIR": str(tmp_path / "runs"),
        "WBMERGE_STATE_DIR": str(tmp_path / "state"),
        "NODES": str(nodes),
        "NPROC": str(nproc),
        "HOME": str(tmp_path),  # flyte's local run data
        **(extra or {}),
    }


def run_script(script: Path, env: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )


def run_example(
    sink, tmp_path, *args: str, nodes: int = 1, nproc: int = 2, raw: str | None = None, env=None
) -> dict:
    """The example workflow; its links, the job id, and the offline runs every node wrote
    (each node in its own directory: `runs/node-{n}/{job id}/worker-{n}`)."""
    raw = raw or str(tmp_path / "raw-data")
    proc = run_script(
        EXAMPLE,
        flyte_env(sink, tmp_path, nodes, nproc, env),
        tmp_path,
        "--steps",
        "6",
        "--json",
        "--raw-data-path",
        raw,
        *args,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (base,) = {folder.parent.name for folder in (tmp_path / "runs").glob("**/worker-*")}
    result["base"] = base
    result["node_dirs"] = sorted((tmp_path / "runs").glob(f"node-*/{base}"))
    result["runs"] = discover([tmp_path / "runs"])
    return result


@dataclass
class ObjectStore:
    """moto's S3 server on a loopback port, with one bucket; `env` points Flyte at it."""

    url: str
    bucket: str
    proc: subprocess.Popen

    @property
    def env(self) -> dict:
        return {
            "FLYTE_AWS_ENDPOINT": self.url,
            "FLYTE_AWS_ACCESS_KEY_ID": "testing",
            "FLYTE_AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def keys(self) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]


def start_object_store(log: Path) -> ObjectStore:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=out,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the S3 server (moto) did not start") from None
            time.sleep(0.1)
    store = ObjectStore(f"http://127.0.0.1:{port}", "flyte-raw", proc)
    store.client().create_bucket(Bucket=store.bucket)
    return store

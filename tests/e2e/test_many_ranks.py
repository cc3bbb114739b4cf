"""A shared merge of 1,024 ranks in one command, within the open-file limit most shells set.

The merge keeps each rank's log open (1,024 files at 1,024 ranks, and one console spool
for all), past the usual soft limit of 1,024: it raises the soft limit to what it needs, and says in one
line when the hard limit is too low. The merged values are checked against the sources,
read with protobuf.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from wbmerge.log import read_records

from ..conftest import ROOT
from ..support import synthetic

RANKS, STEPS, METRICS = 1024, 6, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    synthetic.write_job(root / "job", 1, RANKS, STEPS, metrics=METRICS, job_id="many")
    return root


def merge_under_limit(job, limit: str, out: str) -> subprocess.CompletedProcess:
    command = (
        f"ulimit {limit} 1024 && exec {sys.executable} -m wbmerge merge --run-mode shared "
        f"--out {job / out} {job / 'job'}"
    )
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def history(log) -> list[dict]:
    rows = []
    for record in read_records(log):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


def test_1024_ranks_merge_under_a_soft_limit_of_1024_files(job):
    done = merge_under_limit(job, "-Sn", "out")
    assert done.returncode == 0, done.stderr
    (merged,) = (job / "out").glob("offline-run-*/run-*.wandb")
    got = history(merged)
    assert [row["_step"] for row in got] == list(range(STEPS))
    for log in sorted((job / "job").glob("wandb/*/run-*.wandb")):
        label = next(
            r.run.config for r in read_records(log) if r.WhichOneof("record_type") == "run"
        )
        label = json.loads(next(i.value_json for i in label.update if i.key == "wbmerge"))["label"]
        for step, row in enumerate(history(log)):
            for key, value in row.items():
                if not key.startswith("_"):
                    assert got[step][f"{key}/{label}"] == value


def test_a_hard_limit_too_low_is_one_line_before_any_work(job):
    done = merge_under_limit(job, "-n", "out-low")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("wbmerge: error: this merge keeps 1025 files open")
    assert "1024" in line
    assert not list((job / "out-low").glob("offline-run-*"))

"""Flyte: a follow task beside the training task keeps the merged run live in W&B.

The example workflow in Flyte's local mode with `--follow`: two real ranks train (slowed to
0.2 s a step, `flush_every=1`) while `wbmerge.flyte.follow_task` follows their runs; the
sink is watched meanwhile. Then the merge task runs as always and finds nothing missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import flyte
import pytest

import wbmerge.flyte as wf
from wbmerge.errors import WbmergeError

from ..support.flytetools import EXAMPLE, flyte_env

STEPS = 50


@pytest.mark.e2e
def test_follow_task_shows_the_merged_run_live_while_it_trains(sink, tmp_path):
    env = flyte_env(sink, tmp_path, nodes=1, nproc=2)
    command = [
        sys.executable,
        str(EXAMPLE),
        "--run-mode",
        "shared",
        "--follow",
        "--json",
        "--steps",
        str(STEPS),
        "--step-seconds",
        "0.2",
        "--raw-data-path",
        str(tmp_path / "raw-data"),
    ]
    proc = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    samples = []
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the workflow did not end"
            for run in sink.client.runs(project="wbmerge-demo"):
                got = sink.client.run("local", "wbmerge-demo", run["id"])
                samples.append((run["id"], got["state"], len(got["history"])))
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    (link,) = json.loads(out.strip().splitlines()[-1])["links"]
    run_id = link.rsplit("/", 1)[-1]
    live = [rows for rid, state, rows in samples if rid == run_id and state == "running"]
    assert len({rows for rows in live if 0 < rows < STEPS}) >= 2, samples  # grew, live
    final = sink.client.run("local", "wbmerge-demo", run_id)
    assert (final["state"], final["exit_code"]) == ("finished", 0)
    assert [row["_step"] for row in final["history"]] == list(range(STEPS))
    assert final["summary"]["_step"] == STEPS - 1  # (lost if the merge task sent it again)
    assert all({"train/loss/rank-0", "train/loss/rank-1"} <= row.keys() for row in final["history"])


def test_follow_task_wants_a_decorated_training_task():
    env = flyte.TaskEnvironment(name="wbmerge_follow_test")
    with pytest.raises(WbmergeError, match="decorated with wbmerge.flyte.wandb_init"):
        wf.follow_task(env, object())

"""Random faults and kills, rerun until success: every row, console line and system-metric
row exactly once. Seeded (WBMERGE_CHAOS_SEED to replay), bounded in time."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from ..support.sinktools import like_wandb_by_default
from .test_upload_faults import assert_exactly_once, long_job, spawn  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e


@pytest.fixture
def sink_like():
    """Chaos on a server like W&B (tests/conftest.py): exactly once must hold there."""
    return like_wandb_by_default()


BUDGET = 90.0  # seconds for the random rounds; the final clean round comes after
FAULTS = [
    "file_stream=400@2",
    "file_stream=500@1,2",
    "file_stream=drop@2",
    "file_stream=delay:1",
    "storage=400",
    "storage=403@1",
    "graphql:CreateRunFiles=400",
    "graphql:UpsertBucket=500@2",
]
KILLS = [None, signal.SIGINT, signal.SIGTERM, signal.SIGKILL]


def test_random_faults_and_kills_then_exactly_once(make_sink, tmp_path, long_job):  # noqa: F811
    source, want = long_job
    seed = int(os.environ.get("WBMERGE_CHAOS_SEED", "1414"))
    rng = random.Random(seed)
    sink = make_sink(allow_faults=True)  # faults are set round by round
    args = ["sync", "--json", str(source), "-p", "chaos", "-e", "local", "--timeout", "20"]
    started, rounds = time.monotonic(), []
    while time.monotonic() - started < BUDGET and len(rounds) < 8:
        fault, kill = rng.choice(FAULTS), rng.choice(KILLS)
        sink.client.set_faults([fault])
        proc = spawn(sink, tmp_path, args)
        if kill is not None:
            time.sleep(rng.uniform(0.5, 4.0))
            if proc.poll() is None:
                proc.send_signal(kill)
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        rounds.append((fault, kill and kill.name, proc.returncode))
    sink.client.set_faults([])
    final = spawn(sink, tmp_path, args)
    out, err = final.communicate(timeout=120)
    assert final.returncode == 0, (seed, rounds, err)
    # (a round killed after its upload ended whole but before the ledger recorded it leaves
    # the run whole and unrecorded: the final round finds it "already complete", as
    # docs/sync.md says; which one happens depends on where the kill lands)
    assert json.loads(out)["runs"][0]["status"] in (
        "uploaded",
        "already synced",
        "already complete",
    )
    assert_exactly_once(sink.client.run("local", "chaos", "long"), want)
    assert not list((tmp_path / "tmp").glob("wbmerge-*/wbmerge-staging-*"))
